"""Checks of user-given arguments, shared by ``plan()``, the CLI, ``partition()`` and the strategy.

One kind of argument (a count, a duration, a flag, a callable) enters through several doors and
is refused at each before any simulation runs or process starts, in one wording: its name, the
bad value, a valid one. Each check takes the error class to raise, so every layer raises its own.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Iterable, Mapping, Sequence

from lightning_gsched.errors import GschedError, ScheduleConfigError, UserCallableError

ErrorType = type[GschedError]

# costs are durations: zero is refused (see positive_number and docs/usage.md "Errors")
COST_RULE = "costs are durations and must be finite numbers > 0"


def invalid(name: str, value: Any, rule: str, example: str,
            error: ErrorType = ScheduleConfigError) -> GschedError:
    """The one message format: ``name=value is not valid: rule; e.g. name=example``."""
    return error(f"{name}={value!r} is not valid: {rule}; e.g. {name}={example}")


def is_int(value: Any) -> bool:
    """True for ints (and numpy integers), False for bools, floats and strings."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """True for ints and floats (and numpy scalars), False for bools and strings."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def positive_int(name: str, value: Any, example: str = "4",
                 error: ErrorType = ScheduleConfigError) -> int:
    """``value`` as an int >= 1; 2.5, "2", True and 0 are refused."""
    if not is_int(value) or value < 1:
        raise invalid(name, value, "must be a positive integer", example, error)
    return int(value)


def optional_positive_int(name: str, value: Any, example: str = "4",
                          error: ErrorType = ScheduleConfigError) -> int | None:
    """None (the default applies) or :func:`positive_int`."""
    return None if value is None else positive_int(name, value, example, error)


def positive_number(name: str, value: Any, example: str = "1.0",
                    error: ErrorType = ScheduleConfigError,
                    rule: str = "must be a finite number > 0") -> float:
    """``value`` as a finite float > 0: a duration. Zero is refused: it makes latency and bubble
    meaningless and is almost always a missing measurement."""
    if not is_real(value) or not math.isfinite(value) or not value > 0:
        raise invalid(name, value, rule, example, error)
    return float(value)


def non_negative_number(name: str, value: Any, example: str = "0.1",
                        error: ErrorType = ScheduleConfigError) -> float:
    """``value`` as a finite float >= 0 (tolerances, per-unit costs that may be 0)."""
    if not is_real(value) or not math.isfinite(value) or value < 0:
        raise invalid(name, value, "must be a finite number >= 0", example, error)
    return float(value)


def costs(name: str, value: Any, stages: int | None = None,
          error: ErrorType = ScheduleConfigError) -> tuple[float, ...] | float:
    """One duration for every stage (a float), or one per stage (``stages`` of them where known)."""
    if is_real(value):
        return positive_number(name, value, "1.0", error, COST_RULE)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise invalid(name, value, f"give one number or one number per stage ({COST_RULE})",
                      "1.0", error)
    values = list(value)
    _check_count(name, values, stages, error, "", "number", "1.0")
    return tuple(positive_number(f"{name}[{s}]", v, "1.0", error, COST_RULE)
                 for s, v in enumerate(values))


_BYTE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def byte_size(name: str, value: Any, error: ErrorType = ScheduleConfigError) -> int:
    """Bytes from an int or a string like ``"20GiB"``, ``"512 MiB"``, ``"1.5GB"`` (> 0)."""
    if is_int(value) and value > 0:
        return int(value)
    if isinstance(value, str):
        text = value.strip().replace(" ", "")
        number = text.rstrip("BbIiKkMmGgTt")
        unit = text[len(number):].upper()
        try:
            amount = float(number)
        except ValueError:
            amount = -1.0
        if unit in _BYTE_UNITS and 0 < amount < math.inf:  # "inf" and "1e400" are floats too
            return int(amount * _BYTE_UNITS[unit])
    raise invalid(name, value, "give a positive number of bytes, or a string with a unit "
                  "(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)", '"20GiB"', error)


def flag(name: str, value: Any, error: ErrorType = ScheduleConfigError) -> bool:
    """A bool argument; 0/1 or "yes" are refused (a string is always truthy)."""
    if not isinstance(value, bool):
        raise invalid(name, value, "must be True or False", "True", error)
    return value


def stage_flags(name: str, value: Any, stages: int | None = None,
                error: ErrorType = ScheduleConfigError) -> bool | tuple[bool, ...]:
    """One bool for every stage, or a tuple of one per stage (``stages`` of them where known);
    as with :func:`flag`, 0/1 and strings are refused."""
    if isinstance(value, bool):
        return value
    rule = "give True or False for every stage, or a list of them, one per stage"
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise invalid(name, value, rule, "True", error)
    values = list(value)
    for s, v in enumerate(values):
        if not isinstance(v, bool):
            raise error(f"{name}[{s}]={v!r} is not valid: each entry must be True or False (one "
                        f"per stage); e.g. {name}=[True, False]")
    _check_count(name, values, stages, error, " (one per stage)", "bool", "True")
    return tuple(values)


def _check_count(name: str, values: list[Any], stages: int | None, error: ErrorType, note: str,
                 one: str, example: str) -> None:
    if not values or (stages is not None and len(values) != stages):
        expected = f"S={stages} values" if stages is not None else "at least one value"
        raise error(f"{name} has {len(values)} values but needs {expected}{note}: give one {one} "
                    f"for every stage or a single {one} for all, e.g. {name}={example}")


def per_stage_flags(name: str, value: Any, stages: int,
                    error: ErrorType = ScheduleConfigError) -> tuple[bool, ...]:
    """:func:`stage_flags` as one bool per stage."""
    checked = stage_flags(name, value, stages, error)
    return checked if isinstance(checked, tuple) else (checked,) * stages


def optional_flag(name: str, value: Any, error: ErrorType = ScheduleConfigError) -> bool | None:
    """None (decide automatically) or a bool."""
    if value is not None and not isinstance(value, bool):
        raise invalid(name, value, "must be None, True or False", "None", error)
    return value


def one_of(name: str, value: Any, choices: Sequence[Any],
           error: ErrorType = ScheduleConfigError) -> Any:
    """``value`` if it is one of ``choices`` (compared with ==, strings only for strings)."""
    if not any(type(value) is type(c) and value == c for c in choices):
        listed = ", ".join(repr(c) for c in choices)
        raise invalid(name, value, f"must be one of {listed}", repr(choices[0]), error)
    return value


def optional_callable(name: str, value: Any, signature: str,
                      error: ErrorType = ScheduleConfigError) -> None:
    """None or a callable (``signature`` shows how it is called, e.g. ``w(s, b, d)``)."""
    if value is not None and not callable(value):
        raise invalid(name, value, f"must be a callable {signature} or None",
                      "lambda s, b, d: ...", error)


def stage_edges(edges: Any) -> list[tuple[int, int]] | None:
    """None (a chain) or pairs ``(producer, consumer)`` of stage indices (in range: StageGraph)."""
    if edges is None:
        return None
    if isinstance(edges, (str, bytes)) or not isinstance(edges, Iterable):
        raise invalid("edges", edges, "must be a list of (producer, consumer) stage pairs",
                      "[(0, 1), (1, 2)]")
    pairs = list(edges)
    for pair in pairs:
        if (not isinstance(pair, Sequence) or isinstance(pair, str) or len(pair) != 2
                or not all(is_int(s) for s in pair)):
            raise ScheduleConfigError(f"edges entry {pair!r} is not valid: each edge is a pair "
                                      "(producer, consumer) of stage indices; e.g. "
                                      "edges=[(0, 1), (1, 2)]")
    return [(int(u), int(v)) for u, v in pairs]


def ties(value: Any, stages: int | None = None,
         error: ErrorType = ScheduleConfigError) -> dict[int, tuple[int, ...]]:
    """Tied weights as ``{home stage: every stage that reads the tie, home included}``, from a
    mapping ``{home: reader stages}`` or stage groups (``partition(...).shared_parameters``). A
    group's home is its lowest stage; groups of one home are one tie (one unit at runtime)."""
    if value is None:
        return {}
    example = "[(0, 3)] (stage 0 and stage 3 read one tied weight)"
    groups: list[tuple[Any, ...]] = []
    if isinstance(value, Mapping):
        for home, readers in value.items():
            if isinstance(readers, (str, bytes)) or not isinstance(readers, Iterable):
                raise invalid("ties", value, "a mapping must give each home stage an iterable "
                              "of reader stages", "{0: (3,)}", error)
            groups.append((home, *readers))
    elif isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise invalid("ties", value, "give a mapping {home stage: reader stages} or a sequence "
                      "of stage groups", example, error)
    else:
        for group in value:
            if isinstance(group, (str, bytes)) or not isinstance(group, Iterable):
                raise invalid("ties", value, "every group must be a sequence of stage indices",
                              example, error)
            groups.append(tuple(group))
    out: dict[int, set[int]] = {}
    for group in groups:
        for s in group:
            if not is_int(s) or s < 0 or (stages is not None and s >= stages):
                where = f"in [0, {stages})" if stages is not None else ">= 0"
                raise error(f"ties={value!r} is not valid: stage {s!r} of group {list(group)} is "
                            f"not a stage index {where}; e.g. ties={example}")
        members = {int(s) for s in group}
        if len(members) < 2:
            raise invalid("ties", value, f"group {list(group)} names fewer than two stages (a "
                          "tie is a weight read by several stages)", example, error)
        out.setdefault(min(members), set()).update(members)
    return {home: tuple(sorted(readers)) for home, readers in sorted(out.items())}


def cap_entry(worker: int, value: Any) -> int | None:
    """One worker's activation cap: a positive int, or None for no cap."""
    if value is not None and (not is_int(value) or value < 1):
        raise ScheduleConfigError(f"cap for worker {worker} is {value!r}; a cap must be a positive "
                                  "int (a worker must hold at least one activation to make "
                                  "progress) or None for no cap; e.g. cap=[4, 3, 2, 1]")
    return None if value is None else int(value)


def cap_form(cap: Any, words: Sequence[str], error: ErrorType = ScheduleConfigError) -> None:
    """The shape of a cap argument, before the number of workers is known (a list's length:
    :func:`~.orders.normalise_caps`). ``words``: the strings the caller understands."""
    rule = "use an int >= 1 or a list of them (one per worker)"
    if words:
        rule += f", or one of {', '.join(map(repr, words))}"
    if cap is None or callable(cap) or (isinstance(cap, str) and cap in words):
        return
    if is_int(cap):
        if cap < 1:
            raise invalid("cap", cap, "a cap must be >= 1 (a worker must hold at least one "
                          "activation to make progress); " + rule, "'auto'", error)
        return
    entries = [] if isinstance(cap, str) or not isinstance(cap, Iterable) else list(cap)
    if not entries:
        raise invalid("cap", cap, rule, "'auto'", error)
    for worker, value in enumerate(entries):
        cap_entry(worker, value)


def user_callable_error(role: str, fn: Callable[..., Any], args: Sequence[Any], names: str,
                        exc: BaseException) -> GschedError:
    """The error for a user callable ``fn`` given as ``role`` (``"placement"``), parameters
    ``names`` (``"s, b, d"``), that raised ``exc`` on ``args``; a ``GschedError`` it raised on
    purpose is kept. Raise the result ``from exc`` to keep the traceback."""
    if isinstance(exc, GschedError):
        return exc
    shown = ", ".join(f"{n}={_arg_text(a)}" for n, a in zip(names.split(", "), args, strict=False))
    label = getattr(fn, "__name__", type(fn).__name__)
    return UserCallableError(f"the {role} callable {label}({shown}) raised {type(exc).__name__}: "
                             f"{exc}. The planner calls {role}({names}) for every ({names}) of "
                             "the schedule; fix the callable so it handles these arguments")


def _arg_text(value: Any) -> str:  # phases print as F/B (their value), the rest as repr
    return str(getattr(value, "value", None) or repr(value))
