"""Modules compiled with ``torch.compile``: found without importing torch's compiler, and the
one setting that lets the strategy run their backward more than once.

A compiled module (``torch.compile(block)``, an ``OptimizedModule``, or ``block.compile()`` in
place) cannot be traced by torch.fx, so the split keeps each one whole, as one unit of its
stage, and the stage calls it compiled: the layout torchtitan uses (each transformer block
compiled, the pipeline cut between blocks). Compile the blocks, not the whole model, which
would then be one unit.

AOTAutograd, which builds a compiled module's backward, by default *donates* to the backward
the buffers its forward saved, and a backward that donated cannot run twice
(``retain_graph=True`` is refused). The strategy runs some backwards twice: a split backward's
W after its B (zb-h1, zb-h2, zbv, v-half, v-min), the build's memory measurement and the
tuner's repeated profiles. :class:`DonationOff` turns donation off while a strategy holds such
a model (``torch._functorch.config.donated_buffer = False``, what torch's own error message
proposes), for the graphs compiled in that time; the cost is that a compiled backward keeps
its saved buffers until it ends instead of reusing them.

A split backward is refused all the same (:func:`split_backward_refusal`): a compiled module's
backward is one autograd node, which B runs and W runs again, and with inductor's code the
second run trains wrong weights (measured 2026-11-29: zb-h1 and zbv on the test GPT with each
block compiled, weights up to 1.2e-3 off one device's after 3 steps; 1f1b exact; AOTAutograd
without code generation, ``backend="aot_eager"``, exact too). ``"auto"`` then searches the
schedules without one. Tensor parallelism is refused too (:func:`tensor_parallel_refusal`):
the stages are sharded after the split, and a compiled module's code was traced for the
weights it held.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def is_compiled(module: nn.Module) -> bool:
    """``torch.compile(module)``'s wrapper, or a module compiled in place (``.compile()``)."""
    wrapped = type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod")
    return wrapped or getattr(module, "_compiled_call_impl", None) is not None


def compiled_modules(module: nn.Module) -> list[str]:
    """The names of the compiled modules in ``module`` (outermost only)."""
    found: list[str] = []
    for name, sub in module.named_modules():
        if is_compiled(sub) and not any(name.startswith(f"{outer}.") for outer in found):
            found.append(name or "<the module itself>")
    return found


class DonationOff:
    """AOTAutograd's buffer donation off until :meth:`restore` (see the module doc): the flag
    is process-wide; its value before is put back."""

    def __init__(self) -> None:
        # imported here: a model with compiled modules has loaded torch's compiler already
        import torch._functorch.config

        config: Any = torch._functorch.config
        self._config = config
        self._before = config.donated_buffer
        config.donated_buffer = False

    def restore(self) -> None:
        if self._config is not None:
            self._config.donated_buffer = self._before
            self._config = None


def split_backward_refusal(schedule: str, compiled: list[str]) -> str:
    """Why a schedule whose backward is split into B and W cannot train ``compiled`` modules,
    and what to use instead (see the module doc)."""
    return (f"schedule {schedule!r} splits each backward into B (input gradients) and W (weight "
            f"gradients), which runs a compiled module's backward twice, and the model has "
            f"modules compiled with torch.compile ({_shown(compiled)}): torch's compiled backward does not "
            "support that (with inductor the weights train wrong). Use a schedule without the "
            "split (gpipe, 1f1b, interleaved, lpp, fsdp, fslpp, ddp, or 'auto', which then "
            "searches only those), pass split_backward=False, or leave those modules "
            "uncompiled")


def tensor_parallel_refusal(size: int, compiled: list[str]) -> str:
    """Why ``tensor_parallel_size`` > 1 cannot shard ``compiled`` modules (see the module doc)."""
    return (f"tensor_parallel_size={size} shards each stage's modules by the "
            "tensor_parallel_plan after the split, and the model has modules compiled with "
            f"torch.compile ({_shown(compiled)}), whose compiled code was made for the full "
            "weights (their names hold '_orig_mod', which the plan's patterns do not match). "
            "Leave them uncompiled under tensor parallelism, or use tensor_parallel_size=1")


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def donation_line(compiled: list[str]) -> str:
    """The startup line saying what :class:`DonationOff` did, and why."""
    return (f"GeneralParallel: {len(compiled)} module(s) compiled with torch.compile "
            f"({_shown(compiled)}) run whole, compiled, in their stages; AOTAutograd's buffer "
            "donation is off while this strategy runs (the memory measurement and the tuner run "
            "their backward more than once)")
