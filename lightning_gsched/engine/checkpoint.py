"""The checkpoint service: every save and load of both front ends, decided here once per call.

Why one service: the Trainer strategy and the Fabric strategy save and load the same pipelined
model, and each used to decide on its own whether a checkpoint is gathered, streamed, sharded or
set aside for a model built without weights. Now they only translate Lightning's hooks into the
calls below (``lightning_module_state_dict`` / Fabric's conversion of ``state`` ->
:meth:`CheckpointService.saving` + :meth:`~CheckpointService.model_state` and
:meth:`~CheckpointService.optimizer_state`; ``save_checkpoint`` -> :meth:`~CheckpointService.
write`; ``load_checkpoint`` -> :meth:`~CheckpointService.read`; ``load_model_state_dict`` ->
:meth:`~CheckpointService.load_model_state`; ``load_optimizer_state_dict`` ->
:meth:`~CheckpointService.load_optimizer_states`).

A save is decided when it begins (:meth:`CheckpointService.saving`), from the model's state:

=========== ==================================================================================
sharded     ``state_dict_type="sharded"``: every rank writes what it first-owns into one
            torch.distributed.checkpoint directory (:mod:`.checkpoint_sharded`); a
            tensor-parallel rank its pieces, as ``DTensor`` views of the full tensors
whole       no pipeline is running: the module is whole on every rank, its own ``state_dict``
streamed    ``stream_checkpoint`` (``"auto"``: a model built without weights): placeholders
            now, the tensors sent to rank 0 one weight unit at a time and written into the
            file as they arrive (:mod:`.checkpoint_files`), never gathered
gathered    the full model and optimizer state gathered to rank 0 from their owners
=========== ==================================================================================

and written to a hidden name next to the target and renamed over it (atomic), on rank 0, when
the strategy writes the file itself (the front end's default CheckpointIO and a local path);
a user's CheckpointIO or a remote path gets the real checkpoint. A load is decided when it is
read (:meth:`CheckpointService.read`): a sharded directory is read in full, or, into a model
built without weights, only its index now and each rank's kept tensors at the build; a local
full file into such a model is memory-mapped; anything else is read as the CheckpointIO reads
it. A local path is checked on every rank and agreed: a truncated, foreign or incomplete
checkpoint raises the same CheckpointError everywhere (:mod:`.checkpoint_check`). What a model
built without weights cannot take yet is kept in :attr:`CheckpointService.restore` and applied
by the engine at the build, to what each rank keeps.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence, TypeVar, cast

from fsspec.core import url_to_fs  # type: ignore[import-untyped]
from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped]
from torch import nn
from torch.optim import Optimizer

from lightning_gsched.engine import checkpoint_check, checkpoint_files, checkpoint_sharded
from lightning_gsched.engine.checkpoint_files import StreamStats
from lightning_gsched.engine.checkpoint_sharded import DeferredRestore
from lightning_gsched.errors import StrategyConfigError
from lightning_gsched.partition.tensor_parallel_state import (
    full_optimizer_state,
    global_model_state,
    global_optimizer_state,
    local_model_state,
    local_optimizer_state,
)
from lightning_gsched.runtime import ModelRuntime, is_deferred, parameters_to_meta
from lightning_gsched.schedule import validate

STATE_DICT_TYPES = ("full", "sharded")
StateDict = dict[str, Any]

_T = TypeVar("_T")


class Pipeline(Protocol):
    """What the service reads of the running pipeline (``PipelineEngine``)."""

    @property
    def runtime(self) -> ModelRuntime | None: ...
    @property
    def deferred(self) -> bool: ...  # built from a model without weights
    @property
    def tensor_parallel_size(self) -> int: ...  # T: each worker's stages sharded T ways
    def collective(self, what: str, collective: Callable[[], _T]) -> _T: ...  # fault-named


@dataclass
class CheckpointView:
    """What the service reads of a front end at one call (read afresh: Lightning and the tests
    change it between calls)."""

    module: nn.Module | None  # the pipelined module (None: no model, or not the pipelined one)
    engine: Pipeline | None  # the running pipeline (None before setup / after teardown)
    optimizers: Sequence[Optimizer]  # the strategy's torch optimizers
    rank: int
    world_size: int
    checkpoint_io: Any = None
    timeout: float = 300.0  # bounds the ranks' agreement on a checkpoint read
    failure: str | None = None  # "rank r failed in <hook>: ..." once reported
    released: bool = False  # a run ended without giving every rank the full weights back

    @property
    def runtime(self) -> ModelRuntime | None:
        """The running pipeline's runtime (None before the first batch / after a run)."""
        return self.engine.runtime if self.engine is not None else None

    @property
    def deferred(self) -> bool:
        """The module was built without weights and the pipeline has not given them yet."""
        return self.module is not None and self.runtime is None and is_deferred(self.module)

    def collective(self, what: str, collective: Callable[[], _T]) -> _T:
        """``collective()``, one of the runtime's gathers or streams for a save, as the engine's
        collective: a peer lost in it (killed mid-save) ends this rank with a RuntimeFault
        naming ``what`` and quoting the job's first failure, not gloo's bare error."""
        return collective() if self.engine is None else self.engine.collective(what, collective)


def check_stream_checkpoint(stream_checkpoint: Any) -> bool | str:
    """``stream_checkpoint``: a bool or ``"auto"`` (both front ends)."""
    if stream_checkpoint != "auto":
        validate.flag("stream_checkpoint", stream_checkpoint, StrategyConfigError)
    return cast("bool | str", stream_checkpoint)


class CheckpointService:
    """Every checkpoint of one front end (see the module docstring).

    Args:
        default_io: the front end's default CheckpointIO class (Lightning's
            ``TorchCheckpointIO``, which this package does not import): with it and a local
            path the service writes and reads the file itself.
        what: how messages name the path read (``checkpoint_check.TRAINER`` / ``FABRIC``).
        state_dict_type, stream_checkpoint: the strategy's arguments, checked here.

    Holds, between calls: ``restore`` (a checkpoint read into a model built without weights,
    applied by the engine at the build) and ``stream_stats`` (rank 0: what the last streamed
    save held and wrote).
    """

    def __init__(self, default_io: type | None, what: str = checkpoint_check.TRAINER,
                 state_dict_type: str = "full", stream_checkpoint: bool | str = "auto") -> None:
        if not (isinstance(state_dict_type, str) and state_dict_type in STATE_DICT_TYPES):
            raise StrategyConfigError(
                f"state_dict_type={state_dict_type!r} is not valid: use 'full' (one .ckpt) or "
                "'sharded' (a torch.distributed.checkpoint directory); e.g. "
                "state_dict_type='full'")
        self.state_dict_type = state_dict_type
        self.stream_checkpoint: bool | str = check_stream_checkpoint(stream_checkpoint)
        self.default_io = default_io
        self.what = what
        self.restore: DeferredRestore | None = None
        self.stream_stats: StreamStats | None = None
        self._described: StateDict | None = None  # the model, during a streamed save

    def writes_here(self, checkpoint_io: Any, path: Any, storage_options: Any = None) -> bool:
        """The strategy reads and writes ``path`` itself: the default CheckpointIO and a local
        path, as Lightning's ``get_filesystem`` resolves it. A user's CheckpointIO, storage
        options or a remote URL keep their own reader and writer."""
        if type(checkpoint_io) is not self.default_io or storage_options is not None:
            return False
        return _is_local(path)

    # ------------------------------------------------------------------ saving

    def streams(self, view: CheckpointView) -> bool:
        """A full checkpoint of the running pipeline goes to rank 0 streamed: ``"auto"`` for a
        model built without weights, which must never be whole on one rank; a bool decides."""
        if self.state_dict_type != "full" or view.engine is None or view.runtime is None:
            return False
        if self.stream_checkpoint == "auto":
            return view.engine.deferred
        return bool(self.stream_checkpoint)

    @contextmanager
    def saving(self, view: CheckpointView, includes_model: bool = True) -> Iterator[None]:
        """One save's collection of the state (:meth:`model_state`, :meth:`optimizer_state`),
        decided here: streamed (``includes_model``: the pipelined model is among what is saved)
        describes the model now (collective, no data moves), so the optimizers' descriptions,
        in any order, extend it and :meth:`write` sends the tensors."""
        self._described = None
        runtime = view.runtime
        if includes_model and runtime is not None and self.streams(view):
            self._described = view.collective("the checkpoint's description of the model",
                                              runtime.streamed_state_dict)
        try:
            yield
        finally:
            self._described = None

    def model_state(self, view: CheckpointView, whole: Callable[[], StateDict]) -> StateDict:
        """The model's part of a checkpoint (inside :meth:`saving`): this rank's entries
        (sharded), ``whole()`` (no pipeline running), the placeholders (streamed) or the full
        state on rank 0 (gathered)."""
        self._check_consistent(view)
        if self.state_dict_type == "sharded":
            state = checkpoint_sharded.local_model_state(_module(view), self._writer(view))
            # each rank's pieces, written where they are (the directory records their offsets)
            return global_model_state(state, _module(view)) if _tensor_parallel(view) else state
        runtime = view.runtime
        if runtime is None:
            return whole()
        if self._described is not None:
            return self._described
        # rank 0's, full tensors also where tensor-parallel ranks hold pieces (runtime/fullstate.py)
        return view.collective("the checkpoint's gather of the model", runtime.full_state_dict)

    def optimizer_state(self, view: CheckpointView, optimizer: Optimizer) -> StateDict:
        """An optimizer's part: this rank's entries keyed by name (sharded), its own state (no
        pipeline), described (streamed) or gathered to rank 0."""
        _check_not_failed(view)
        if self.state_dict_type == "sharded":
            state = checkpoint_sharded.local_optimizer_state(_module(view), optimizer,
                                                             self._writer(view))
            if _tensor_parallel(view):  # as in model_state
                state = global_optimizer_state(state, optimizer, _module(view))
            return state
        runtime = view.runtime
        if runtime is None:
            return optimizer.state_dict()
        if runtime.streaming:  # described with the model: the tensors come in write()
            return view.collective("the checkpoint's description of the optimizer state",
                                   lambda: runtime.streamed_optimizer_state(optimizer))
        state = view.collective("the checkpoint's gather of the optimizer state",
                                lambda: runtime.full_optimizer_state(optimizer))
        if _tensor_parallel(view) and state:  # worker 0's T ranks, as in model_state
            state = full_optimizer_state(state, optimizer, _module(view))
            return state if view.rank == 0 else {}
        return state

    def write(self, view: CheckpointView, checkpoint: StateDict, path: Any,
              storage_options: Any, hand_on: Callable[[StateDict], None],
              entries: tuple[str | None, Sequence[str]] | None = None) -> None:
        """Write what :meth:`saving` collected (every rank calls it): a sharded directory, a
        streamed file (every rank sends, rank 0 writes), or the checkpoint on rank 0, atomically.
        ``hand_on(checkpoint)``: the front end's own writer (a user's CheckpointIO or a remote
        path), which gets real tensors (streamed ones collected on rank 0). ``entries``: Fabric's
        (model key, optimizer keys) in ``checkpoint``, which a sharded directory records
        (``checkpoint_sharded.in_directory_layout``); None: Lightning's own keys."""
        if self.state_dict_type == "sharded":
            if entries is not None:
                checkpoint = checkpoint_sharded.in_directory_layout(checkpoint, *entries)
            checkpoint_sharded.save(checkpoint, path, view.rank, view.timeout)
            return
        local = self.writes_here(view.checkpoint_io, path, storage_options)
        runtime = view.runtime
        if runtime is not None and runtime.streaming:
            what = "the checkpoint's stream to rank 0"
            if local and view.rank == 0:
                self.stream_stats = view.collective(what, lambda: checkpoint_files.save_streamed(
                    checkpoint, path, runtime.stream))
            elif local:
                view.collective(what, lambda: runtime.stream(None))
            else:  # rank 0 keeps every tensor and fills the placeholders in
                hand_on(view.collective(what, lambda: runtime.stream_kept(checkpoint)))
            return
        if not local:
            hand_on(checkpoint)
        elif view.rank == 0:
            checkpoint_files.atomic_save(checkpoint, path)

    # ------------------------------------------------------------------ loading

    def read(self, view: CheckpointView, path: Any, weights_only: bool | None,
             read_default: Callable[[], Any], fabric_state: Any = None,
             strict: bool = True) -> StateDict:
        """Read the checkpoint at ``path`` on every rank (collective). A local path is checked
        and agreed first (:mod:`.checkpoint_check`: ``ckpt_path``'s Lightning checkpoint, or
        ``fabric.load(path, fabric_state, strict)``'s dict). ``read_default()``: the front
        end's CheckpointIO."""
        name = str(path)
        sharded = checkpoint_sharded.is_sharded_checkpoint(name)
        if view.released and view.runtime is None and view.module is not None:
            # a run ended without a gather: each rank holds other parameters; restored like a
            # model built without weights (runtime/materialize.py, parameters_to_meta)
            parameters_to_meta(_module(view))
        deferred = view.deferred
        # a directory fabric.save wrote, read back under the user's keys
        keys = (checkpoint_sharded.in_user_layout if self.what != checkpoint_check.TRAINER
                else lambda checkpoint: checkpoint)

        def read() -> Any:
            if sharded and deferred:  # the index now, each rank's kept tensors at the build
                checkpoint, self.restore = checkpoint_sharded.load_deferred(name)
                return keys(checkpoint)
            if sharded:
                return keys(checkpoint_sharded.load(name))
            if deferred and self.writes_here(view.checkpoint_io, name):
                # each rank applies only what it keeps: read those pages, not the whole file
                return checkpoint_files.load_mapped(name, weights_only)
            return read_default()

        if not _is_local(name):
            return cast(StateDict, read())

        def check(checkpoint: Any) -> str | None:
            fabric = self.what != checkpoint_check.TRAINER
            if sharded and deferred:  # no tensors read yet: the shapes in the index
                if fabric and not strict:
                    return None
                return checkpoint_check.mismatch(f"{self.what} {name}",
                                                 checkpoint_sharded.saved_model_entries(name),
                                                 _module(view))
            if fabric:
                return checkpoint_check.fabric_problem(name, checkpoint, fabric_state, strict)
            return checkpoint_check.lightning_problem(name, checkpoint, view.module)

        return cast(StateDict, checkpoint_check.load_checked(name, read, check, view.timeout,
                                                            self.what))

    def load_model_state(self, view: CheckpointView, state_dict: Mapping[str, Any],
                         strict: bool) -> None:
        """Only the parameters this rank holds (a running pipeline), set aside for the build (a
        model built without weights: a copy into meta parameters is a no-op), or the module's
        own load."""
        module = _module(view)
        runtime = view.runtime
        if runtime is not None:
            if _tensor_parallel(view):  # this rank's piece of each sharded tensor
                state_dict = local_model_state(state_dict, module)
            runtime.load_state_dict(dict(state_dict))
        elif view.deferred:
            # an empty one (a sharded directory read without its tensors) keeps its restore
            if state_dict or self.restore is None or self.restore.path is None:
                self.restore = DeferredRestore(state_dict=state_dict)
        else:
            module.load_state_dict(state_dict, strict=strict)

    def load_optimizer_states(self, view: CheckpointView,
                              states: Sequence[StateDict | None]) -> None:
        """Each optimizer's saved state (None: none saved, left as it is). A model built without
        weights gets the param groups now and the per-parameter state at the build; a running
        pipeline keeps the state of the parameters this rank owns only."""
        if view.runtime is None and self.restore is not None:
            if self.restore.path is None:  # a sharded directory's is read at the build
                self.restore.optimizer_states = [s if s is not None else {"state": {}}
                                                 for s in states]
            states = [None if s is None else {"state": {}, "param_groups": s["param_groups"]}
                      for s in states]
        # strict=False as in Lightning's Strategy.load_optimizer_state_dict (a drop-in for DDP)
        for optimizer, state in zip(view.optimizers, states, strict=False):
            if state is not None:
                optimizer.load_state_dict(self.local_optimizer_state(view, optimizer, state))
        self.prune(view)

    def local_optimizer_state(self, view: CheckpointView, optimizer: Optimizer,
                              state: StateDict) -> StateDict:
        """A full checkpoint's optimizer state as this rank's optimizer takes it: with
        tensor-parallel stages running, each tensor cut to this rank's piece (before the build
        the engine cuts it when it shards)."""
        if not _tensor_parallel(view):
            return state
        return local_optimizer_state(state, optimizer, _module(view))

    def prune(self, view: CheckpointView) -> None:
        """A running pipeline: drop the optimizer state of parameters this rank does not own."""
        runtime = view.runtime
        if runtime is not None:
            runtime.prune_optimizer_state(list(view.optimizers))

    def take_restore(self) -> DeferredRestore | None:
        """The engine's build: the restore to apply now (it is then no longer pending)."""
        restore, self.restore = self.restore, None
        return restore

    # ------------------------------------------------------------------ helpers

    def _check_consistent(self, view: CheckpointView) -> None:
        _check_not_failed(view)
        if view.released and view.runtime is None:
            raise StrategyConfigError(
                "the last run ended without gathering the weights (gather_on_teardown=False; "
                "the default 'auto' for a model built without weights, which one rank may not "
                "hold; or a rank failed), so this rank holds only its own stages and a "
                "checkpoint would be incomplete. Save during the run (ModelCheckpoint, "
                "trainer.save_checkpoint in on_train_end), or pass gather_on_teardown=True "
                "where one rank can hold the whole model")

    @staticmethod
    def _writer(view: CheckpointView) -> Callable[[str], bool]:
        return checkpoint_sharded.writer_of_names(_module(view), view.runtime, view.rank,
                                                  view.world_size)


def _tensor_parallel(view: CheckpointView) -> bool:
    """A running pipeline of tensor-parallel workers: its stages hold shards."""
    return view.runtime is not None and view.engine is not None and \
        view.engine.tensor_parallel_size > 1


def _check_not_failed(view: CheckpointView) -> None:
    """After a failure the ranks stopped at different points of a step: nothing to save."""
    if view.failure is not None:
        raise StrategyConfigError(
            f"rank {view.rank} cannot save a checkpoint after a failure ({view.failure})"
            ": the ranks stopped at different points of a step, so no consistent state "
            "exists. The last checkpoint saved before the failure is intact: resume from it")


def _module(view: CheckpointView) -> nn.Module:
    assert view.module is not None, "a checkpoint of the model before the model was attached"
    return view.module


def _is_local(path: Any) -> bool:
    filesystem, _ = url_to_fs(str(path))
    return isinstance(filesystem, LocalFileSystem)


class CheckpointSettings:
    """The checkpoint options both front ends expose as their own attributes
    (``strategy.state_dict_type``, ``strategy.stream_checkpoint``,
    ``strategy.checkpoint_stream_stats``), forwarded to the
    strategy's :class:`CheckpointService` (``_checkpoints``): written once for both."""

    _checkpoints: CheckpointService

    @property
    def stream_checkpoint(self) -> bool | str:
        return self._checkpoints.stream_checkpoint

    @stream_checkpoint.setter
    def stream_checkpoint(self, value: bool | str) -> None:
        self._checkpoints.stream_checkpoint = value

    @property
    def state_dict_type(self) -> str:
        """``"full"`` or ``"sharded"``: how the next save writes (see :class:`CheckpointService`)."""
        return self._checkpoints.state_dict_type

    @state_dict_type.setter
    def state_dict_type(self, value: str) -> None:
        self._checkpoints.state_dict_type = value

    @property
    def checkpoint_stream_stats(self) -> StreamStats | None:
        """Rank 0: what the last streamed save held and wrote."""
        return self._checkpoints.stream_stats

    @checkpoint_stream_stats.setter
    def checkpoint_stream_stats(self, value: StreamStats | None) -> None:
        self._checkpoints.stream_stats = value

