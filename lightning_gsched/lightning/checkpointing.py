"""The Trainer strategy's checkpoint hooks: what ``GeneralParallel`` saves and loads.

Why a module of its own: Lightning calls the checkpoint hooks by name on the strategy, so the
names stay on ``GeneralParallel``, each one line handing over to :class:`TrainerCheckpoints`;
the decisions behind them (sharded or full, gathered or streamed, written here or by a user's
CheckpointIO, refused after a failure or a release, a deferred model's restore set aside for
the build) live here, apart from the training hooks. What the Fabric front end shares with it
(the streamed transfer and writer, atomic files, the checked read, a deferred model's restore,
``stream_checkpoint``'s validation) is in ``engine/``, which this module only calls: Fabric
never imports this one (tests/test_layering.py).

Every hook receives a :class:`SaveContext`: the strategy's state at the call (the module, the
running engine, the optimizers, the ranks, the CheckpointIO, a reported failure, a released
run), read afresh each time because Lightning and the tests change it between calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping, Optional

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer

from lightning_gsched.engine import ckpt_check, ckpt_files, ckpt_stream, sharded
from lightning_gsched.engine.deferred_restore import DeferredRestore, load_mapped
from lightning_gsched.engine.engine import PipelineEngine
from lightning_gsched.engine.options import check_stream_checkpoint
from lightning_gsched.errors import StrategyConfigError
from lightning_gsched.runtime import ModelRuntime, is_deferred
from lightning_gsched.schedule import validate

STATE_DICT_TYPES = ("full", "sharded")


@dataclass
class SaveContext:
    """What the checkpoint hooks read of the strategy at one call."""

    module: Any  # the LightningModule (None before the Trainer attached it)
    engine: PipelineEngine | None  # the running pipeline (None before setup / after teardown)
    optimizers: list  # the strategy's optimizers (LightningOptimizer wrappers or plain)
    rank: int
    world_size: int
    checkpoint_io: Any
    failure: str | None = None  # "rank r failed in <hook>: ..." once reported
    released: bool = False  # a run ended without giving every rank the full weights back

    @property
    def runtime(self) -> ModelRuntime | None:
        """The running pipeline's runtime facade (None before the first batch / after a run)."""
        return self.engine.runtime if self.engine is not None else None

    @property
    def deferred(self) -> bool:
        """The module was built without weights and the pipeline has not given them yet."""
        return (self.module is not None and self.runtime is None
                and is_deferred(self.module))


class TrainerCheckpoints:
    """``GeneralParallel``'s checkpoint hooks (see the module docstring).

    Holds the two checkpoint arguments and what one checkpoint leaves for later: ``restore``
    (a checkpoint read into a deferred model, applied by the engine at the build) and
    ``stream_stats`` (rank 0: what the last streamed save held and wrote).
    """

    def __init__(self, state_dict_type: str, stream_checkpoint: bool | str) -> None:
        self.state_dict_type = state_dict_type
        self.stream_checkpoint = stream_checkpoint
        self.restore: DeferredRestore | None = None
        self.stream_stats: ckpt_stream.StreamStats | None = None

    # ------------------------------------------------------------------ saving

    def module_state(self, ctx: SaveContext,
                     unpipelined: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``lightning_module_state_dict``: this rank's part (sharded), placeholders (a
        streamed save: ``save`` receives the tensors), the full state on rank 0 (gathered), or
        ``unpipelined()`` (Lightning's own) when no pipeline is built."""
        check_not_failed(ctx)
        check_not_released(ctx)
        if self.state_dict_type == "sharded":
            return sharded.local_model_state(ctx.module, _sharded_writer(ctx))
        runtime = ctx.runtime
        if runtime is None:
            return unpipelined()
        if self.streams(ctx):  # placeholders: save_checkpoint receives the tensors
            return runtime.streamed_state_dict()
        return runtime.full_state_dict()

    def streams(self, ctx: SaveContext) -> bool:
        """A full checkpoint of the running pipeline goes to rank 0 streamed (see
        ``stream_checkpoint``)."""
        if self.state_dict_type != "full" or ctx.engine is None or ctx.runtime is None:
            return False
        return ckpt_stream.streams(self.stream_checkpoint, ctx.engine.deferred)

    def optimizer_state(self, ctx: SaveContext, optimizer: Any) -> dict[str, Any]:
        """``optimizer_state``: described with the state dict when it was streamed (the
        tensors come at the save), else gathered to rank 0, or this rank's part (sharded)."""
        check_not_failed(ctx)
        optimizer = unwrap(optimizer)
        if self.state_dict_type == "sharded":
            return sharded.local_optimizer_state(ctx.module, optimizer, _sharded_writer(ctx))
        runtime = ctx.runtime
        if runtime is None:
            return optimizer.state_dict()
        if runtime.streaming:  # described with the state dict: tensors come at the save
            return runtime.streamed_optimizer_state(optimizer)
        return runtime.full_optimizer_state(optimizer)

    def save(self, ctx: SaveContext, checkpoint: dict[str, Any], filepath: Any,
             storage_options: Optional[Any], hand_on: Callable[[], None]) -> None:
        """``save_checkpoint``: a sharded directory (every rank its part), a streamed file
        (every rank sends, rank 0 writes: ``ckpt_stream.save_described``), or the gathered
        checkpoint written by rank 0 to a temporary name next to the target and renamed over
        it. A user's CheckpointIO or a remote path gets the real checkpoint through
        ``hand_on()`` (Lightning's own ``save_checkpoint``)."""
        if self.state_dict_type == "sharded":
            sharded.save(checkpoint, filepath, ctx.rank)
            return
        runtime = ctx.runtime
        local = writes_locally(ctx.checkpoint_io, filepath, storage_options)
        if runtime is not None and runtime.streaming:
            stats = ckpt_stream.save_described(runtime, checkpoint, filepath,
                                               rank_zero=ctx.rank == 0, local=local,
                                               hand_on=lambda _: hand_on())
            if stats is not None:
                self.stream_stats = stats
            return
        if not local:
            hand_on()  # user's CheckpointIO
            return
        if ctx.rank == 0:  # a temporary name next to the target, renamed over it
            ckpt_files.atomic_save(checkpoint, filepath)

    # ------------------------------------------------------------------ loading

    def load(self, ctx: SaveContext, checkpoint_path: Any, weights_only: Optional[bool],
             timeout: float, read_default: Callable[[], dict]) -> dict:
        """``load_checkpoint``: read ``ckpt_path`` on every rank; a truncated, foreign or
        incomplete checkpoint raises the same CheckpointError on every rank (``ckpt_check``),
        never a hang. A model built without weights gets a sharded directory's tensors at the
        build instead, each rank only its own (``deferred_restore``; the directory is checked
        against the model now, by the shapes in its index), and a local full file
        memory-mapped. ``read_default()``: Lightning's own reading."""
        self.restore = None
        deferred_sharded = sharded.is_sharded_checkpoint(checkpoint_path) and ctx.deferred

        def read() -> dict:
            if sharded.is_sharded_checkpoint(checkpoint_path):
                if deferred_sharded:
                    checkpoint, self.restore = sharded.load_deferred(checkpoint_path)
                    return checkpoint
                return sharded.load(checkpoint_path, ctx.module,
                                    [unwrap(o) for o in ctx.optimizers])
            if ctx.deferred and writes_locally(ctx.checkpoint_io, checkpoint_path, None):
                # each rank applies only what it keeps: read those pages, not the whole file
                return load_mapped(checkpoint_path, weights_only)
            return read_default()

        # a deferred sharded read holds no tensors yet: checked by the shapes in its index
        check = partial(_index_mismatch, checkpoint_path, ctx.module) if deferred_sharded else None
        return ckpt_check.load_checked(checkpoint_path, read, ctx.module, timeout=timeout,
                                       check=check)

    def load_model_state(self, ctx: SaveContext, checkpoint: Mapping[str, Any],
                         strict: bool) -> None:
        """``load_model_state_dict``: only the parameters this rank holds (a running
        pipeline), set aside for the build (a deferred model), or the module's own load."""
        module = ctx.module
        assert module is not None
        runtime = ctx.runtime
        if runtime is not None:  # only the parameters this rank holds
            runtime.load_state_dict(checkpoint["state_dict"])
            return
        if ctx.deferred:  # meta parameters would drop the values: applied at the build
            if self.restore is None:
                self.restore = DeferredRestore(state_dict=checkpoint["state_dict"])
            return
        module.load_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_states(self, ctx: SaveContext, checkpoint: Mapping[str, Any],
                              root_device: Any) -> None:
        """``load_optimizer_state_dict``: a deferred model's per-parameter state is set aside
        for the build (the param groups load now); a running pipeline keeps the state of the
        parameters this rank owns only."""
        optimizer_states = checkpoint["optimizer_states"]
        if ctx.runtime is None and self.restore is not None:
            # a deferred model: the per-parameter state is applied at the build (a sharded
            # directory's is read then); the param groups (learning rates) now
            if self.restore.path is None:
                self.restore.optimizer_states = list(optimizer_states)
            optimizer_states = [{"state": {}, "param_groups": s["param_groups"]}
                                for s in optimizer_states]
        # strict=False as in Lightning's Strategy.load_optimizer_state_dict (a drop-in for DDP)
        for optimizer, state in zip(ctx.optimizers, optimizer_states, strict=False):
            unwrap(optimizer).load_state_dict(state)
        _optimizers_to_device(ctx.optimizers, root_device)
        runtime = ctx.runtime
        if runtime is not None:
            runtime.prune_optimizer_state([unwrap(o) for o in ctx.optimizers])


def check_not_released(ctx: SaveContext) -> None:
    """A run that ended without gathering leaves each rank only its own stages."""
    if ctx.released and ctx.runtime is None:
        raise StrategyConfigError(
            "the last run ended without gathering the weights (gather_on_teardown=False, or "
            "a rank failed), so this rank holds only its own stages and a checkpoint would "
            "be incomplete. Save during fit (ModelCheckpoint) or keep gather_on_teardown=True"
        )


def check_not_failed(ctx: SaveContext) -> None:
    """After a failure the ranks stopped at different points of a step: nothing to save."""
    if ctx.failure is not None:
        raise StrategyConfigError(
            f"rank {ctx.rank} cannot save a checkpoint after a failure ({ctx.failure})"
            ": the ranks stopped at different points of a step, so no consistent state "
            "exists. The last checkpoint saved before the failure is intact: resume from it"
        )


def check_arguments(state_dict_type: Any, gather_on_teardown: Any,
                    stream_checkpoint: Any = "auto") -> None:
    """The Trainer strategy's own arguments (the shared ones: ``engine/options.py``, which
    checks ``stream_checkpoint`` for both front ends)."""
    if not (isinstance(state_dict_type, str) and state_dict_type in STATE_DICT_TYPES):
        raise StrategyConfigError(
            f"state_dict_type={state_dict_type!r} is not valid: use 'full' (one .ckpt) or "
            "'sharded' (a torch.distributed.checkpoint directory); e.g. state_dict_type='full'"
        )
    if gather_on_teardown != "auto":
        validate.flag("gather_on_teardown", gather_on_teardown, StrategyConfigError)
    check_stream_checkpoint(stream_checkpoint)


def writes_locally(checkpoint_io: Any, filepath: Any, storage_options: Any) -> bool:
    """Lightning's default CheckpointIO and a local path: the strategy writes the file itself
    (atomically, next to the target); a user's CheckpointIO or a remote URL keeps its own."""
    return ckpt_files.written_here(checkpoint_io, TorchCheckpointIO, filepath, storage_options)


def unwrap(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` wrapper."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _index_mismatch(path: Any, module: Any, checkpoint: Any) -> str | None:
    """What makes a sharded directory read without its tensors (for a model built without
    weights) another model's: the shapes in its index against the module's (None: nothing).
    Checked when ``ckpt_path`` is given, before Lightning restores the optimizers' param
    groups, which would otherwise fail in torch's words on another model's directory."""
    return ckpt_check.mismatch(f"ckpt_path {path}", sharded.saved_model_entries(path), module)


def _sharded_writer(ctx: SaveContext) -> Callable[[str], bool]:
    return sharded.writer_of_names(ctx.module, ctx.runtime, ctx.rank, ctx.world_size)
