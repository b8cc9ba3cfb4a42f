"""Bad input to GeneralParallel fails on every rank with a clear GschedError, never a hang.

Each case runs a real ``Trainer.fit`` on 2 gloo processes (``expect_errors=True``) and checks
that *every* rank raised, with a message that names the problem and the fix, well within the
harness timeout. The last case is a fault inside a user's step on one rank only.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dist_harness import RankError, WorkerContext
from lightning_gsched.errors import UnknownScheduleError
from lightning_models import LitGPT, as_worker, rank_loader, tokens, trainer
from models import seeded

pytestmark = pytest.mark.distributed


class ManualOptimization(LitGPT):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class NeverCallsSelf(LitGPT):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (t,) = batch
        logits = self.model(t[:, :-1])  # bypasses self(...)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), t[:, 1:].reshape(-1))


class CallsSelfTwice(LitGPT):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (t,) = batch
        a, b = self(t[:, :4]), self(t[:, 4:-1])
        return a.mean() + b.mean()


class Untraceable(LitGPT):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out = self.model(idx)
        if out.sum() > 0:  # data-dependent control flow: fx cannot trace it
            out = -out
        return out


class OwnBackward(LitGPT):
    """A backward the schedule would never call (its halved loss silently lost: found by
    probing)."""

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        (loss * 0.5).backward(*args, **kwargs)


class WithWeightAveraging(LitGPT):
    """Stochastic Weight Averaging averages the empty parameters of the stages a rank does not
    hold (it failed with a bare size mismatch at its first epoch: found by probing)."""

    def configure_callbacks(self) -> Any:
        import lightning.pytorch as pl

        return [pl.callbacks.StochasticWeightAveraging(swa_lrs=0.01)]


class BackwardInStep(LitGPT):
    """A plain loop's ``loss.backward()`` left in training_step: a bare torch RuntimeError
    ("element 0 of tensors does not require grad") on every rank, or, when a validation built
    the pipeline first, "Trying to backward through the graph a second time" from the
    schedule's own backward (found by probing)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        loss.backward()
        return loss


class _Reentrant(torch.nn.Module):
    """A block run under ``torch.utils.checkpoint(..., use_reentrant=True)``."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, *args, use_reentrant=True)


class ReentrantCheckpoint(LitGPT):
    """Blocks checkpointed the reentrant way under a split backward: torch refuses .grad()
    through them, which failed inside the first B of the first step with a bare RuntimeError
    (found by probing)."""

    def __init__(self) -> None:
        super().__init__()
        for i, block in enumerate(self.model.blocks):
            self.model.blocks[i] = _Reentrant(block)


class FailsOnRankOne(LitGPT):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 1 and self.global_rank == 1:
            raise ValueError("boom in the user's loss code")
        return loss


def fit_on_worker(ctx: WorkerContext, cls_name: str, options: dict, global_batch: int) -> None:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    model = seeded(0, globals()[cls_name])
    data = tokens(global_batch * 3)
    fit = trainer(ctx.world_size, GeneralParallel(**options), max_steps=3)
    fit.fit(model, rank_loader(data, global_batch, ctx.world_size, ctx.rank))


STEP_TIMEOUT = 60.0  # a bound on each wait in a step, far above a prompt failure



CASES = [
    ("ManualOptimization", {"schedule": "gpipe"}, 8, "StrategyConfigError",
     ["automatic_optimization", "return the loss"]),
    ("NeverCallsSelf", {"schedule": "fslpp"}, 8, "TrainingStepError",
     ["never calls self(...)", "forward()"]),
    ("CallsSelfTwice", {"schedule": "1f1b"}, 8, "TrainingStepError", ["more than once"]),
    ("LitGPT", {"schedule": "gpipe", "microbatches": 4}, 6, "BatchSplitError",
     ["6 rows", "microbatches=4", "drop_last"]),
    ("LitGPT", {"schedule": "fslpp", "R": 3}, 8, "ScheduleConfigError",
     ["R=3", "2 devices"]),
    ("OwnBackward", {"schedule": "1f1b"}, 8, "StrategyConfigError",
     ["OwnBackward overrides backward()", "on_after_backward"]),
    ("WithWeightAveraging", {"schedule": "zbv"}, 8, "StrategyConfigError",
     ["StochasticWeightAveraging (Stochastic Weight Averaging) is not supported",
      "Remove the callback"]),
    ("BackwardInStep", {"schedule": "1f1b"}, 8, "TrainingStepError",
     ["BackwardInStep.training_step calls backward itself (loss.backward() or "
      "self.manual_backward(loss))", "schedule runs each microbatch's backward itself",
      "remove the backward call"]),
    ("ReentrantCheckpoint", {"schedule": "zbv"}, 8, "StrategyConfigError",
     ["splits each backward", "use_reentrant=True in stage", "split_backward=False"]),
    ("Untraceable", {"schedule": "gpipe"}, 8, "TraceFailedError",
     ["could not split Untraceable.forward", "test_lightning_errors.py"]),
]


@pytest.mark.parametrize("cls_name, options, global_batch, error, phrases", CASES,
                         ids=[c[0] + "-" + c[3] for c in CASES])
def test_bad_input_fails_on_every_rank(world, cls_name: str, options: dict, global_batch: int,
                                       error: str, phrases: list[str]) -> None:
    results = world.run(fit_on_worker, cls_name, options, global_batch, expect_errors=True)
    for result in results:
        assert isinstance(result, RankError), result
        assert result.type_name == error, (result.type_name, result.message)
        for phrase in phrases:
            assert phrase in result.message, (phrase, result.message)


def short_last_batch_on_worker(ctx: WorkerContext) -> None:
    """Two global batches of 8 rows, then one of 2 (drop_last=False): the last one does not
    split into gpipe's 4 microbatches."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    data = tokens(18)
    share = torch.cat([data[i * 8 + ctx.rank * 4:][:4] for i in range(2)]
                      + [data[16 + ctx.rank:][:1]])
    fit = trainer(ctx.world_size, GeneralParallel("gpipe", microbatches=4), max_epochs=1)
    fit.fit(seeded(0, LitGPT), DataLoader(TensorDataset(share), batch_size=4))


def test_a_short_last_training_batch_is_named_as_such(world) -> None:
    """The refusal said how to size a global batch of 2 (found by probing): it now says the
    epoch's last batch is short and what the earlier ones had."""
    for result in world.run(short_last_batch_on_worker, expect_errors=True):
        assert isinstance(result, RankError) and result.type_name == "BatchSplitError", result
        assert result.message.startswith("the epoch's last batch is short (2 rows where the "
                                         "earlier ones had 8): the global batch has 2 rows"), \
            result.message
        assert "drop_last=True" in result.message


def backward_after_validation_on_worker(ctx: WorkerContext) -> None:
    """BackwardInStep with a sanity validation first: the pipeline is built for the
    validation, so training_step is never probed and its backward runs on the real graph of
    the last stage's rank (where it succeeds, and the schedule's own backward failed after)."""
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    loader = rank_loader(tokens(16), 8, ctx.world_size, ctx.rank)
    fit = trainer(ctx.world_size, GeneralParallel("1f1b", step_timeout=STEP_TIMEOUT),
                  max_steps=1, num_sanity_val_steps=1)
    fit.fit(seeded(0, BackwardInStep), loader, loader)


def test_a_backward_in_the_step_is_named_after_a_validation_built_the_pipeline(world) -> None:
    """The last stage's rank fails in the step with the TrainingStepError (a hook on the
    step's output, held while the step runs), the other rank quotes it."""
    results = world.run(backward_after_validation_on_worker, expect_errors=True)
    for result in results:
        assert isinstance(result, RankError) and result.type_name == "RuntimeFault", result
        assert ("TrainingStepError: BackwardInStep.training_step calls backward itself"
                in result.message), result.message
        assert "graph a second time" not in result.message, result.message


def test_fault_on_one_rank_stops_every_rank_with_its_position(world) -> None:
    # step_timeout bounds every wait; rank 0 must not need it: rank 1's failure closes its
    # connections, so rank 0 stops on the lost connection (not a timeout) and quotes rank 1
    results = world.run(fit_on_worker, "FailsOnRankOne",
                        {"schedule": "gpipe", "step_timeout": STEP_TIMEOUT}, 8, expect_errors=True)
    assert all(isinstance(r, RankError) for r in results), results
    failing, other = results[1], results[0]
    assert "rank 1 failed at 'F s1 b" in failing.message and "boom" in failing.message
    # the action and the user's hook it ran (the code after self(...) in training_step)
    assert "in FailsOnRankOne.training_step after self(...): ValueError" in failing.message
    assert other.type_name == "RuntimeFault"
    assert "rank 0" in other.message and "rank 1 failed at 'F s1 b" in other.message
    assert other.message.startswith("rank 0 stopped at '"), other.message
    assert "lost the connection to a peer" in other.message, other.message
    assert "timed out" not in other.message, other.message


def test_unknown_schedule_name_is_rejected_at_construction() -> None:
    from lightning_gsched import GeneralParallel

    with pytest.raises(UnknownScheduleError, match="did you mean 'fslpp'"):
        GeneralParallel("fslp")


def save_after_ungathered_run(ctx: WorkerContext, path: str) -> None:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    model = seeded(0, LitGPT)
    fit = trainer(ctx.world_size, GeneralParallel("fsdp", gather_on_teardown=False), max_steps=1)
    fit.fit(model, rank_loader(tokens(8), 8, ctx.world_size, ctx.rank))
    fit.save_checkpoint(path)


def test_checkpoint_after_an_ungathered_run_is_refused(world, tmp_path) -> None:
    results = world.run(save_after_ungathered_run, str(tmp_path / "x.ckpt"), expect_errors=True)
    for result in results:
        assert isinstance(result, RankError) and result.type_name == "StrategyConfigError"
        assert "gather_on_teardown" in result.message
    assert not (tmp_path / "x.ckpt").exists()


class KeepsEvenRows(LitGPT):
    """The model keeps the rows whose first token is even: stage 0's output rows depend on the
    data, not only on the batch's shape."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx[idx[:, 0] % 2 == 0])

    def _loss(self, batch: Any) -> torch.Tensor:
        (t,) = batch
        kept = t[t[:, 0] % 2 == 0]
        logits = self(t[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), kept[:, 1:].reshape(-1))


def even_rows_batches(global_batch: int, steps: int) -> torch.Tensor:
    """Token rows whose first token's parity makes microbatch 0 keep 2, then 1, then 2 rows."""
    data = tokens(global_batch * steps)
    data[:, 0] = data[:, 0] // 2 * 2  # even: kept
    data[global_batch, 0] += 1  # step 1, microbatch 0, first row: odd, dropped
    return data


def fit_even_rows(ctx: WorkerContext, transport: str) -> float:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    model = seeded(0, KeepsEvenRows)
    strategy = GeneralParallel("gpipe", microbatches=4, transport=transport)
    fit = trainer(ctx.world_size, strategy, max_steps=3)
    fit.fit(model, rank_loader(even_rows_batches(8, 3), 8, ctx.world_size, ctx.rank))
    return float(fit.callback_metrics["train_loss"])


def test_data_dependent_shapes_need_the_described_transport(world) -> None:
    """Under the default transport the second step (same batch shape, fewer rows kept) stops
    every rank: rank 0 with MessageShapeError naming the option, rank 1 quoting it; with
    transport="described" the same run trains."""
    results = world.run(fit_even_rows, "auto", expect_errors=True)
    assert all(isinstance(r, RankError) for r in results), results
    sender, receiver = results
    assert sender.type_name == "MessageShapeError", (sender.type_name, sender.message)
    assert "rank 0 failed at 'SEND_ACT s0 b0 ->1'" in sender.message
    assert 'transport="described"' in sender.message
    assert receiver.type_name == "RuntimeFault"
    assert "MessageShapeError" in receiver.message
    losses = world.run(fit_even_rows, "described")
    assert losses[0] == losses[1] and math.isfinite(losses[0])
