"""One Trainer run's pipeline: partition, plans, executor, and the per-batch step logic.

Why separate from the strategy class: the strategy speaks Lightning (hooks, plugins, registry),
the engine speaks schedules (global batch -> microbatches -> program -> gradients and logged
values). The engine is built lazily at the first batch of the run, because tracing the model
needs one real call of ``forward`` and Lightning hands the strategy no data before that. Every
rank sees the same global batch, so everything decided at that point (the probe of the user's
step, the partition, the programs) is identical on every rank, and a contract error is raised by
every rank at once instead of leaving some ranks waiting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_gsched.errors import GschedError, PartitionError, RuntimeFault, StrategyConfigError
from lightning_gsched.lightning.batches import (
    concat_outputs,
    gather_batch,
    micro_rows,
    row_counts,
    take_rows,
)
from lightning_gsched.lightning.checkpoint import (
    prune_optimizer_state,
    restore_full_optimizer_state,
    restore_full_weights,
)
from lightning_gsched.lightning.config import ScheduleConfig
from lightning_gsched.lightning.grads import GradStash
from lightning_gsched.lightning.intercept import StepCaller, step_loss
from lightning_gsched.lightning.logsync import (
    LossLogExchange,
    exchange,
    reduce_records,
    replay,
)
from lightning_gsched.partition import partition
from lightning_gsched.partition.preserve import preserved_tensors_and_rng
from lightning_gsched.runtime import ProgramExecutor, stage_micros
from lightning_gsched.schedule.describe import describe
from lightning_gsched.schedule.plan import Plan


@dataclass
class PartitionOptions:
    balance: Any = "params"
    leaf_modules: tuple = ()
    split_points: Any = None
    static_shapes: bool | None = None


def _sync_module_states(module: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers everywhere, as DDP does when it wraps a model."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, 0)


class PipelineEngine:
    """Runs the strategy's steps through one :class:`ProgramExecutor` (see module doc)."""

    def __init__(self, module: LightningModule, config: ScheduleConfig, options: PartitionOptions,
                 train_plan: Plan, *, world_size: int, rank: int, timeout: float,
                 optimizers: Callable[[], list]) -> None:
        self.module = module
        self.config = config
        self.options = options
        self.train_plan = train_plan
        self.world_size, self.rank = world_size, rank
        self.timeout = timeout
        self.optimizers = optimizers
        self.executor: ProgramExecutor | None = None
        self.grads: GradStash | None = None
        self.partition: Any = None
        self.failed = False
        self.losses_and_logs: LossLogExchange | None = None
        self._needed: dict[int, list[list[int]]] = {}

    # ------------------------------------------------------------------ building

    @property
    def built(self) -> bool:
        return self.executor is not None

    def _probe(self, caller: StepCaller, micro_batch: Any) -> tuple[tuple, dict]:
        """Run the user's step once on the full local model to check the step contract."""
        with preserved_tensors_and_rng(self.module), torch.no_grad():
            call = caller.probe(micro_batch)
        if caller.hook == "training_step":
            step_loss(call.result, caller.hook)
        return call.args, call.kwargs

    def build(self, caller: StepCaller, micro_batch: Any) -> None:
        """Partition the model, build the executor, release non-owned stages (collective)."""
        with torch.inference_mode(False):
            args, kwargs = self._probe(caller, micro_batch)
            args = tuple(_normal(a) for a in args)
            kwargs = {k: _normal(v) for k, v in kwargs.items()}
            if self.world_size > 1:
                _sync_module_states(self.module)
            self.partition = self._partition(args, kwargs)
            self.executor = ProgramExecutor(self.partition.stages, self.train_plan.programs,
                                            timeout=self.timeout, sync_weights=False)
            self.grads = GradStash(self.executor, self.module)
            prune_optimizer_state(self.optimizers(), self.grads.owned_parameters())
        if self.rank == 0:
            rank_zero_info(
                "GeneralParallel plan (unit costs: forward 1, backward 2 per stage):\n"
                + describe(self.train_plan) + "\n" + self.memory_summary() + "\n"
                + self.partition.report()
            )

    def memory_summary(self) -> str:
        """Parameter memory per worker implied by the plan and the partition's stage sizes."""
        assert self.executor is not None
        sizes = [flat.nbytes for flat in self.executor.flats]
        shared = self.executor.shared.nbytes
        owners = self.train_plan.table.owners
        lines = [f"parameter memory per worker (tied parameters, {_mib(shared)}, on every "
                 "worker in addition):"]
        for m in self.train_plan.metrics.per_worker:
            owned = [s for s, o in enumerate(owners) if m.worker in o]
            held = sum(sizes[s] for s in owned)
            others = sorted((sizes[s] for s in range(len(sizes)) if s not in owned), reverse=True)
            extra = sum(others[: max(0, m.peak_resident_stages - len(owned))])
            lines.append(f"  worker {m.worker}: owns {_mib(held)} (stages {owned}), peak "
                         f"resident <= {_mib(held + extra)}; optimizer state for the owned part")
        return "\n".join(lines)

    def _partition(self, args: tuple, kwargs: dict) -> Any:
        S = self.train_plan.stages
        opts = self.options
        common = dict(balance=opts.balance, leaf_modules=opts.leaf_modules,
                      split_points=opts.split_points, static_shapes=opts.static_shapes)
        unit_costs = None
        if opts.balance == "time" and self.world_size > 1:
            # rank 0 measures; everyone cuts at the same places with rank 0's costs
            box: list[Any] = [None]
            if self.rank == 0:
                try:
                    box[0] = ("ok", partition(self.module, S, args, kwargs, **common).unit_costs)
                except GschedError as exc:
                    box[0] = ("error", str(exc))
            dist.broadcast_object_list(box, 0)
            status, value = box[0]
            if status == "error":
                raise PartitionError(f"rank 0 could not partition the model: {value}")
            unit_costs = value
        try:
            return partition(self.module, S, args, kwargs, unit_costs=unit_costs, **common)
        except GschedError as exc:
            raise type(exc)(
                f"GeneralParallel could not split {type(self.module).__name__}.forward into "
                f"{S} stages: {exc}"
            ) from exc

    # ------------------------------------------------------------------ steps

    def _capture_all(self, caller: StepCaller, micros: list[Any], wanted: list[int]) -> dict:
        inputs = {}
        for b in wanted:
            try:
                inputs[b] = caller.capture(micros[b])
            except Exception as exc:
                self._abort(f"rank {self.rank} failed in {caller.hook} on microbatch {b} "
                            f"before stage 0: {type(exc).__name__}: {exc}", exc)
        return inputs

    def _abort(self, message: str, exc: BaseException) -> None:
        self.failed = True
        assert self.executor is not None
        self.executor.channels.report_fault(message)
        self.executor.channels.abort()
        if isinstance(exc, GschedError) and not isinstance(exc, RuntimeFault):
            raise type(exc)(message) from exc
        raise RuntimeFault(message) from exc

    def _needed_micros(self, plan: Plan) -> list[list[int]] | None:
        """Per rank, the microbatches whose rows it uses (None before the first build).

        Before the engine is built every rank probes microbatch 0, so the whole batch is needed.
        """
        if not self.built:
            return None
        key = id(plan.programs)
        if key not in self._needed:
            needed = []
            for r in range(self.world_size):
                first, last = stage_micros(plan.programs, r)
                needed.append(sorted(set(first) | set(last)))
            self._needed[key] = needed
        return self._needed[key]

    def _global_batch(self, batch: Any, rows: list[int], plan: Plan) -> Any:
        return gather_batch(batch, rows, self.rank, plan.micro, self._needed_micros(plan))

    def training_step(self, batch: Any, rest: tuple, kwargs: dict) -> torch.Tensor:
        B = self.train_plan.micro
        batch = self._global_batch(batch, row_counts(batch, self.world_size), self.train_plan)
        micros = batch.micros(B, exact=True)
        caller = StepCaller(self.module, "training_step", rest, kwargs)
        if not self.built:
            self.build(caller, micros[0])
        assert self.executor is not None and self.grads is not None
        if self.losses_and_logs is None:
            self.losses_and_logs = LossLogExchange(self.world_size, self.rank, B,
                                                   self.executor.device)
        inputs = self._capture_all(caller, micros, self.executor.first_stage_micros)

        def loss_fn(output: Any, b: int) -> torch.Tensor:
            return step_loss(caller.finish(micros[b], output, b), "training_step")

        self.grads.before_step()
        try:
            result = self.executor.step(inputs, loss_fn)
        except RuntimeFault:
            self.failed = True
            raise
        self.grads.after_step()
        losses = {b: float(v) for b, v in result.losses.items()}
        all_losses, records = self.losses_and_logs(losses, caller.logs)
        if len(all_losses) != B:
            raise StrategyConfigError(
                f"expected one loss per microbatch ({B}), got {sorted(all_losses)}; every rank "
                "must run the same plan"
            )
        weights = micro_rows(batch.rows, B)
        device = self.executor.device
        replay(self.module, reduce_records(records, weights), device,
               batch.rows_per_rank[self.rank])
        return torch.tensor(sum(all_losses[b] for b in range(B)) / B, device=device)

    def eval_step(self, hook: str, batch: Any, rest: tuple, kwargs: dict) -> Any:
        """validation/test/predict: a forward-only plan; predictions go back to their rank."""
        rows = row_counts(batch, self.world_size)
        plan = self.config.eval_plan(self.world_size, sum(rows))
        B = plan.micro
        batch = self._global_batch(batch, rows, plan)
        micros = batch.micros(B, exact=False, what="evaluation batch")
        weights = micro_rows(batch.rows, B)
        caller = StepCaller(self.module, hook, rest, kwargs)
        if not self.built:
            first = next(b for b in range(B) if weights[b] > 0)
            self.build(caller, micros[first])
        assert self.executor is not None
        first_micros, _ = stage_micros(plan.programs, self.rank)
        inputs = self._capture_all(caller, micros, first_micros)
        try:
            outputs = self.executor.forward(
                plan.programs, inputs, lambda out, b: caller.finish(micros[b], out, b)
            )
        except RuntimeFault:
            self.failed = True
            raise
        predicting = hook == "predict_step"
        shipped = {b: _to_cpu(v) for b, v in outputs.items()} if predicting else {}
        gathered = exchange((shipped, caller.logs), self.world_size)
        records = [r for _, logs in gathered for r in logs]
        replay(self.module, reduce_records(records, weights), self.executor.device,
               batch.rows_per_rank[self.rank])
        if not predicting:
            return None
        by_micro = {b: v for part, _ in gathered for b, v in part.items()}
        joined = concat_outputs([by_micro[b] for b in range(B)], hook)
        start = batch.offset(self.rank)
        local = take_rows(joined, start, start + batch.rows_per_rank[self.rank])
        return _to_device(local, self.executor.device)

    # ------------------------------------------------------------------ backward

    def hand_over_grads(self, scale: float) -> None:
        if self.grads is not None:
            self.grads.hand_over(scale)

    # ------------------------------------------------------------------ end

    def close(self, gather: bool) -> None:
        """Give every rank the full model again (unless a rank failed) and drop the groups."""
        if self.executor is None:
            return
        if gather and not self.failed and not self.executor.channels.closed:
            assert self.grads is not None
            with torch.no_grad():
                restore_full_weights(self.executor)
            restore_full_optimizer_state(self.optimizers(), self.grads)
        if not self.executor.channels.closed:
            self.executor.close()
        self.executor = None
        self.grads = None


def _mib(nbytes: int) -> str:
    """Human-readable bytes (B, KiB, MiB, GiB)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.2f} GiB"


def _normal(value: Any) -> Any:
    """Inference tensors (Lightning evaluates in inference mode) cannot be traced or saved."""
    from torch.utils import _pytree as pytree

    def fix(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.is_inference():
            return leaf.clone()
        return leaf

    return pytree.tree_map(fix, value)


def _to_cpu(value: Any) -> Any:
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, value)


def _to_device(value: Any, device: torch.device) -> Any:
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, value)
