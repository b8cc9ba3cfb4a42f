"""Error types shared by every layer.

Every user-facing failure is a subclass of :class:`GschedError` so that callers can catch the
library's errors as one family, and each message names the problem *and* the fix. This module
is pure Python: the torch-free ``schedule`` layer imports it.
"""

from __future__ import annotations


class GschedError(Exception):
    """Base class of every error raised on purpose by lightning_gsched."""


_ORIGIN = "_gsched_origin"


def error_text(exc: BaseException) -> str:
    """``"ValueError: boom"``: an error's type and the first line of its message, as every
    report of a failure quotes it."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return type(exc).__name__ + (f": {text}" if text else "")


def mark_origin(exc: BaseException, where: str) -> None:
    """Note on ``exc`` which user code raised it (e.g. ``"LitGPT.test_step after self(...)"``).

    Why: the runtime runs the user's step code inside an action (the loss after ``self(...)``
    on the last stage's rank) and reports ``rank r failed at '<action>'``; the action alone
    does not tell the user which of their hooks to look at. The innermost mark is kept."""
    if getattr(exc, _ORIGIN, None) is None:
        try:
            setattr(exc, _ORIGIN, where)
        except AttributeError:  # an exception type with __slots__: reported without it
            pass


def origin(exc: BaseException) -> str | None:
    """What :func:`mark_origin` noted on ``exc`` (None: nothing)."""
    where = getattr(exc, _ORIGIN, None)
    return where if isinstance(where, str) else None


class ScheduleConfigError(GschedError, ValueError):
    """Workers, stages, microbatches, R, costs or an order name do not fit together."""


class UnknownScheduleError(ScheduleConfigError, KeyError):
    """A schedule name that is not in the library."""

    def __str__(self) -> str:  # KeyError would repr() the message; keep it readable
        return str(self.args[0]) if self.args else ""


class PlanTooLargeError(ScheduleConfigError):
    """A plan with more jobs than the planner builds (it builds and checks every rank's
    program): the message names the size and how to shrink it."""


class PlacementError(GschedError, ValueError):
    """A placement w(s, b, d) returned workers out of range or split F and B of one job."""


class UserCallableError(GschedError, RuntimeError):
    """A callable the user gave the planner (placement, priority/order, cap) raised.

    Apart from PlacementError and ScheduleConfigError because the arguments may all be valid and
    the bug is inside the user's function: the message names the callable, the arguments it was
    called with and the original exception, which is also chained as ``__cause__``.
    """


class CapTooSmallError(GschedError, RuntimeError):
    """An activation cap so small that no worker can make progress (would loop forever)."""


class ProgramError(GschedError, RuntimeError):
    """Lowered programs are inconsistent: unmatched send/recv or a possible deadlock."""


class PartitionError(GschedError, RuntimeError):
    """The model cannot be traced or cut as asked."""


class RuntimeConfigError(GschedError, ValueError):
    """Stages, programs, process groups or step inputs do not fit together (before anything runs)."""


class RuntimeFault(GschedError, RuntimeError):
    """A rank failed while executing its program, or timed out / lost a peer while waiting.

    The message names the rank, the action (text form and index) it failed at or waited at, and,
    when known, the root cause reported by the rank that failed first.
    """

    # what peers quote as the root cause where it differs from the message (the message
    # without the root cause this rank appended); None: the message itself
    headline: str | None = None


class MessageShapeError(RuntimeFault):
    """A stage's output (or input-gradient) changed shape or structure within a step signature
    whose messages the transport already knows, so the receiver (which posted its receive for
    the old shape, without a header) cannot be told.

    Raised on the sending rank; every other rank ends with a RuntimeFault quoting it. The fix
    for data-dependent shapes is ``transport="described"`` (every message carries its spec).
    """


class CalibrationError(GschedError, RuntimeError):
    """The runtime's costs measured on the process group do not fit the cost model.

    Raised by ``runtime.calibrate()`` rather than returning a cost the measurement does not
    support (a bandwidth of infinity from a per-byte slope lost in noise, for one): the message
    gives the measured figures and the fix (a quieter machine, more repeats, or costs passed
    explicitly).
    """


class StrategyConfigError(GschedError, ValueError):
    """GeneralParallel's arguments do not fit the Trainer, the model or the data."""


class TrainingStepError(StrategyConfigError):
    """A step method does not follow the contract: call ``self(...)`` exactly once, return a loss."""


class WholeModelCallError(StrategyConfigError):
    """The model was called directly (``model(x)``, not through a step) while its pipeline runs,
    on a rank that holds only some stages' weights: the others' parameters are empty there."""


class BatchSplitError(StrategyConfigError):
    """A batch cannot be split into the schedule's microbatches."""


class CheckpointError(GschedError, RuntimeError):
    """A checkpoint given to ``ckpt_path`` cannot be resumed from.

    Truncated or unreadable, not a checkpoint of this model (its parameters are missing or have
    other shapes), or a sharded directory without its metadata (a save that never finished).
    Raised on every rank with the same message, naming the file and what is wrong, so a job
    never resumes on some ranks while others wait for them.
    """


class CheckpointWriteError(GschedError, OSError):
    """Rank 0 could not write a full checkpoint file (e.g. its directory is not writable).

    Raised on rank 0 naming the file, after every rank's tensors were received (and dropped), so
    no rank waits on a transfer that stopped; nothing is left under the name (the previous file,
    if any, is untouched).
    """


class PreemptedError(GschedError, RuntimeError):
    """A Fabric loop stepped on after every rank agreed on a preemption notice (SIGTERM/SIGUSR1).

    Raised by ``fabric.strategy.step`` / ``evaluate`` on every rank at the same call, so a loop
    that does not read ``fabric.strategy.preempted`` still stops together instead of training
    into the scheduler's kill; the message names the signal, the rank it reached and the step.
    """
