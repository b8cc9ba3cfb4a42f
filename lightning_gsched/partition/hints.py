"""What to tell the user when a leaf module stands in the way (too few stages, a split point
inside it, an unbalanced split): where the leaf came from decides the fix.

* an automatic leaf (torch.fx could not trace into it): why, at which ``file:line``, and the
  option that lets the tracer in (static shapes), or that none does;
* a ``leaf_modules`` entry: drop it (only then: never suggest undoing what the user did not set);
* a torch layer (``nn.Linear``...): it always runs whole.
"""

from __future__ import annotations

from lightning_gsched.partition.compiled import compiled_modules, is_compiled
from lightning_gsched.partition.tracer import TracedModel


def auto_leaf_fix(traced: TracedModel, fqn: str | None = None) -> str:
    """The option that lets the tracer enter an automatic leaf, given what was tried and, once
    static shapes were tried too, what stopped the tracer in ``fqn`` (the real cause: a branch
    on a value, an object a graph cannot hold, a custom Function's argument)."""
    if traced.static_shapes_option is False:
        return (
            "drop static_shapes=False: the static-shape trace (sizes fixed to the example's) "
            "can enter code that computes or branches on sizes"
        )
    if not traced.static_tried:
        return (
            "pass static_shapes=True: the static-shape trace (sizes fixed to the example's) can "
            "enter code that computes or branches on sizes"
        )
    return f"{_static_cause(traced.auto_leaves.get(fqn or '', ''))}: " + (
        "move that code into a small submodule (only that one will run whole), or use fewer "
        "stages")


def _static_cause(reason: str) -> str:
    """What stopped the static-shape trace, in user terms, from an automatic leaf's reason."""
    if "cannot be used as inputs to control flow" in reason:
        return "even with static shapes the code at that line branches on a tensor's values"
    if "custom autograd Function" in reason:
        return ("a custom autograd Function there takes an argument a graph cannot hold (it "
                "runs correctly inside the leaf)")
    if "argument of type" in reason:
        cache = " (a key/value cache: pass use_cache=False)" if "Cache" in reason else ""
        return (f"the code at that line passes an object a graph cannot hold to a module or "
                f"function{cache}; pass tensors or pytrees of them instead")
    return "even with static shapes torch.fx cannot record the code at that line"


def is_user_leaf(traced: TracedModel, fqn: str) -> bool:
    """Whether ``leaf_modules`` names ``fqn`` (by name, class or class name)."""
    module = traced.resolve(fqn)
    cls = type(module)
    names = {cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}", fqn}
    for entry in traced.leaf_modules:
        if isinstance(entry, str) and entry in names:
            return True
        if isinstance(entry, type) and isinstance(module, entry):
            return True
    return False


def leaf_origin(traced: TracedModel, fqn: str) -> str:
    """Why ``fqn`` runs whole and what would change that, as one sentence fragment."""
    if fqn in traced.auto_leaves:
        return (
            f"torch.fx could not trace into it ({traced.auto_leaves[fqn]}); to go inside, "
            f"{auto_leaf_fix(traced, fqn)}"
        )
    if is_user_leaf(traced, fqn):
        return "it is in leaf_modules; drop it from leaf_modules to go inside"
    if is_compiled(traced.resolve(fqn)):
        return _COMPILED
    return f"it is a torch layer ({type(traced.resolve(fqn)).__name__}), which always runs whole"


def finer_trace_hint(traced: TracedModel) -> str:
    """How to get more units than the trace has, or ``""`` when no option gives more."""
    hints = [
        f"{fqn!r} is kept whole because {leaf_origin(traced, fqn)}" for fqn in traced.auto_leaves
    ]
    hints += [f"{fqn!r} is kept whole because {_COMPILED}" for fqn in compiled_modules(traced.module)]
    if traced.leaf_modules:
        hints.append("remove modules from leaf_modules so the tracer goes inside them")
    return "; ".join(hints)


_COMPILED = ("it is compiled (torch.compile), and torch.fx cannot enter compiled code: compile "
             "its blocks instead of it, each block then one unit that runs compiled "
             "(partition/compiled.py)")
