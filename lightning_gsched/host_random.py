"""Python's and numpy's random numbers in a forward: refused while traced, kept with torch's.

Why: torch.fx records tensor operations, so a call such as ``random.random()`` or
``np.random.rand()`` in a forward runs once, at trace time, and its value becomes a constant of
the split. A layer drop decided by one (``if self.training and random.random() < p``;
transformers' wav2vec2 encoder draws its layer drop from numpy) would be frozen for the whole
run: the layer dropped always or never, silently. So while the tracer runs traced code, these
functions raise :class:`HostRandomDraw` (:func:`host_draws_refused`); the tracer then keeps the
module that drew whole (an automatic leaf, as for data-dependent control flow), so its forward
runs with real draws at every call, and a draw in the root forward fails the trace naming the
function. A draw that bypasses those functions (``from random import random``, a generator
object the module holds, ``self.rng = np.random.default_rng()``, or one in the globals of the
file that defines its forward) is found afterwards by its generator's state (:func:`draw_marks`,
:func:`refuse_unguarded_draws`, compared around each traced module call) and refused the same
way. Code that runs for real while tracing (a leaf's example run under static shapes) may
draw: it runs whole later too, and :func:`states_kept` puts the global streams back after it.
Which code is traced is one flag per thread (:func:`traced_code`, :func:`real_code`,
:func:`in_traced_code`), read also by the partitioner's grad-mode guard; other threads (data
loading) draw as usual.

The same streams are kept with torch's wherever the partitioner restores or seeds torch's
(:func:`host_states`, :func:`set_host_states`, :func:`seed_host`): tracing leaves them as they
were, and the split's check runs the model and its stages from the same draws.
"""

from __future__ import annotations

import functools
import pickle
import random
import sys
import threading
from contextlib import AbstractContextManager, contextmanager
from types import ModuleType
from typing import Any, Callable, Iterator, Mapping, cast

# the module-level draws of ``random`` and of numpy's legacy global generator (``np.random``)
PYTHON_DRAWS = ("random", "uniform", "randint", "randrange", "choice", "choices", "sample",
                "shuffle", "gauss", "normalvariate", "lognormvariate", "expovariate",
                "betavariate", "gammavariate", "triangular", "vonmisesvariate",
                "paretovariate", "weibullvariate", "getrandbits", "randbytes")
NUMPY_DRAWS = ("random", "rand", "randn", "randint", "random_sample", "ranf", "sample",
               "uniform", "normal", "standard_normal", "choice", "permutation", "shuffle",
               "binomial", "poisson", "beta", "exponential", "bytes", "random_integers")

_traced = threading.local()  # .on: this thread is running code the tracer records


@contextmanager
def _traced_flag(on: bool) -> Iterator[None]:
    before = getattr(_traced, "on", False)
    _traced.on = on
    try:
        yield
    finally:
        _traced.on = before


def traced_code() -> AbstractContextManager[None]:
    """The body is code the tracer records (on this thread): the guards raise in it."""
    return _traced_flag(True)


def real_code() -> AbstractContextManager[None]:
    """Inside :func:`traced_code`: the body runs for real (a leaf's example run)."""
    return _traced_flag(False)


def in_traced_code() -> bool:
    """Whether this thread is running code the tracer records."""
    return bool(getattr(_traced, "on", False))


class HostRandomDraw(RuntimeError):
    """Traced code drew from Python's or numpy's global random numbers."""


def _numpy_random() -> ModuleType | None:
    """``numpy.random`` when numpy is imported (model code that draws from it has imported it)."""
    numpy = sys.modules.get("numpy")
    return getattr(numpy, "random", None) if numpy is not None else None


def _guarded(owner: str, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def draw(*args: Any, **kwargs: Any) -> Any:
        if in_traced_code():
            raise HostRandomDraw(
                f"{owner}.{name}() was called while the model was traced: its value would be "
                "frozen into the split (e.g. a layer drop decided once for the whole run). The "
                "module that calls it runs whole instead; in the root forward, draw with torch "
                f"(torch.rand(()) < p) or move the call into a submodule")
        return original(*args, **kwargs)

    return draw


@contextmanager
def host_draws_refused() -> Iterator[None]:
    """While the body runs, the module-level draws of ``random`` and ``numpy.random`` raise
    :class:`HostRandomDraw` in :func:`traced_code` (the originals come back on exit)."""
    swapped: list[tuple[ModuleType, str, Any]] = []
    owners: list[tuple[ModuleType, str, tuple[str, ...]]] = [(random, "random", PYTHON_DRAWS)]
    numpy_random = _numpy_random()
    if numpy_random is not None:
        owners.append((numpy_random, "numpy.random", NUMPY_DRAWS))
    for module, label, names in owners:
        for name in names:
            original = getattr(module, name, None)
            if callable(original):
                swapped.append((module, name, original))
                setattr(module, name, _guarded(label, name, original))
    try:
        yield
    finally:
        for module, name, original in swapped:
            setattr(module, name, original)


HostStates = tuple[Any, Any]  # (random.getstate(), numpy's global state or None)


def host_states() -> HostStates:
    """The states of Python's global generator and numpy's (None without numpy)."""
    numpy_random = _numpy_random()
    return random.getstate(), numpy_random.get_state() if numpy_random is not None else None


def set_host_states(states: HostStates) -> None:
    """Put back states taken by :func:`host_states` (numpy's where it was taken)."""
    python_state, numpy_state = states
    random.setstate(python_state)
    numpy_random = _numpy_random()
    if numpy_random is not None and numpy_state is not None:
        numpy_random.set_state(numpy_state)


def seed_host(seed: int) -> None:
    """Seed Python's global generator and numpy's, as ``torch.manual_seed`` seeds torch's."""
    random.seed(seed)
    numpy_random = _numpy_random()
    if numpy_random is not None:
        numpy_random.seed(seed)


@contextmanager
def states_kept() -> Iterator[None]:
    """Python's and numpy's global streams are as before the body when it ends: code run for
    real while tracing (a leaf's example run) must not look like a draw of the traced code."""
    states = host_states()
    try:
        yield
    finally:
        set_host_states(states)


def generator_state(value: Any) -> bytes | None:
    """The state of a random-number generator object, pickled (comparable bytes): a
    ``random.Random``, a numpy ``Generator``, ``RandomState`` or bit generator; None for anything
    else (also ``random.SystemRandom``, which has no state to draw it again from)."""
    if isinstance(value, random.Random):
        try:
            return pickle.dumps(value.getstate())
        except NotImplementedError:  # SystemRandom
            return None
    numpy_random = _numpy_random()
    if numpy_random is None:
        return None
    if isinstance(value, numpy_random.Generator):
        return pickle.dumps(value.bit_generator.state)
    if isinstance(value, numpy_random.RandomState):
        return pickle.dumps(value.get_state(legacy=False))
    if isinstance(value, numpy_random.BitGenerator):
        return pickle.dumps(value.state)
    return None


def set_generator_state(value: Any, state: bytes) -> None:
    """Put a generator object back in a state taken by :func:`generator_state`."""
    unpickled = pickle.loads(state)
    if isinstance(value, random.Random):
        value.setstate(unpickled)
        return
    numpy_random = _numpy_random()
    if numpy_random is not None and isinstance(value, numpy_random.Generator):
        value.bit_generator.state = unpickled
    elif numpy_random is not None and isinstance(value, numpy_random.RandomState):
        value.set_state(unpickled)
    else:
        value.state = unpickled


GLOBAL_STREAMS = "Python's or numpy's global generator"


def held_generators(owner: Any) -> dict[str, Any]:
    """The generator objects ``owner``'s forward (a module's) can draw from without a guarded
    function, by a name for messages: each among its attributes (``self.<key>``) and each in
    the globals of the file that defines its ``forward`` (read there directly or by a helper of
    that file)."""
    found = {f"self.{key}": value for key, value in vars(owner).items()
             if generator_state(value) is not None}
    forward = getattr(owner, "forward", None)
    function = getattr(forward, "__func__", forward)  # a bound method's function
    for name, value in list(getattr(function, "__globals__", {}).items()):
        if generator_state(value) is not None:
            found[f"the global {name!r}"] = value
    return found


def draw_marks(owner: Any) -> dict[str, bytes]:
    """What traced code could draw from without a guarded function, each generator's state by
    a name for the message: the global streams (also reached through ``from random import
    random``) and :func:`held_generators`. Compared before and after a traced call
    (:func:`refuse_unguarded_draws`): a draw moves its generator's state."""
    marks = {GLOBAL_STREAMS: pickle.dumps(host_states())}
    for name, generator in held_generators(owner).items():
        marks[name] = cast(bytes, generator_state(generator))
    return marks


def refuse_unguarded_draws(before: Mapping[str, bytes], after: Mapping[str, bytes],
                           where: str) -> None:
    """Raise :class:`HostRandomDraw` when a generator of :func:`draw_marks` moved between
    ``before`` and ``after`` (the traced call of ``where`` drew from it)."""
    moved = [name for name, state in before.items() if after.get(name) != state]
    if moved:
        raise HostRandomDraw(
            f"{where} drew from {', '.join(moved)} while traced (a function imported by name, "
            "such as `from random import random`, or a generator object): the value would be "
            "frozen into the split. The module runs whole instead; in the root forward, draw "
            "with torch (torch.rand(()) < p) or move the draw into a submodule")
