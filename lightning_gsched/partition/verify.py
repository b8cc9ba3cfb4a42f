"""``partition(..., verify=...)``: run the split and the unsplit model once and compare.

Why: a split can be wrong without failing (a custom backward replaced by autograd of its
forward, a trace-time object returned, an assignment the tracer did not see). The tracer now
records each of those it knows (:mod:`.recording`, :mod:`.output_objects`); this check catches
the ones nobody has thought of yet, on the user's own model, before a single step trains on it.

What runs, on the example call, from the same RNG state and buffer values for both:

* the **unsplit** model: forward, then one backward with fixed random output gradients;
* the **split** as a pipeline runtime runs it: stage by stage, every value handed to the next
  stage as a *copy* (``detach().clone()``, as the wire delivers it: a stage never sees an
  earlier stage's tensor object, so an aliasing or in-place dependency across a cut shows up),
  then backward stage by stage from the same output gradients.

Compared: the output's structure and every tensor in it, and the gradient of every parameter
(a sparse gradient, ``nn.Embedding(..., sparse=True)``'s, as the dense tensor it stands for).
Tolerance (:func:`tolerance`): a tensor passes when ``max|got - want| <= tol * max(max|want|,
tiny)`` with ``tol = max(1e-3, 8 * eps(dtype))``. Reason: the split runs the same kernels on
the same values, except that a value read by several stages (a tied embedding, a residual
stream handed through) gets its gradient contributions summed in another order, which moves
the last few bits of a float sum; the mistakes this check exists for (a dropped or replaced
backward, a stale output, a lost assignment) change a value by a large fraction of its scale.
Parameters, ``.grad``, buffers (BatchNorm statistics) and the RNG are restored afterwards.

Cost: two forward and backward passes of the example, and one parameter-sized copy of the
reference gradients. The default, ``verify="auto"``, runs it when the parameters are real
tensors (not on the meta device) of at most :data:`AUTO_LIMIT_BYTES`; beyond that, or for a
model built without weights, the report says it was skipped and ``verify=True`` forces it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lightning_gsched.host_random import seed_host, states_kept
from lightning_gsched.partition.cache_off import submodule_calls_cache_off
from lightning_gsched.partition.errors import ExampleInputError, PartitionError, SplitMismatchError
from lightning_gsched.partition.preserve import preserved_attributes, preserved_tensors_and_rng

AUTO_LIMIT_BYTES = 1 << 30  # verify="auto" checks models with at most 1 GiB of parameters
VERIFY_SEED = 20_261_125  # the RNG seed both runs start from (dropout masks match)
VERIFY_MODES = ("auto", True, False)


@dataclass(frozen=True)
class Verdict:
    """What the check did: ``status`` is ``"passed"`` or ``"skipped"`` (a failure raises)."""

    status: str
    detail: str

    def __str__(self) -> str:
        return f"{self.status}, {self.detail}"


def check_verify(verify: Any) -> str | bool:
    if verify is True or verify is False or verify == "auto":
        return verify  # type: ignore[no-any-return]
    raise PartitionError(
        f"verify={verify!r} is not valid: use 'auto' (check models up to "
        f"{AUTO_LIMIT_BYTES >> 20} MiB of parameters), True (always) or False (never)."
    )


def tolerance(dtype: torch.dtype) -> float:
    """Allowed error relative to a tensor's largest magnitude (module docstring: why)."""
    if not dtype.is_floating_point and not dtype.is_complex:
        return 0.0
    return max(1e-3, 8 * torch.finfo(dtype).eps)


def skip_reason(module: nn.Module, verify: str | bool) -> str | None:
    """Why ``verify`` does not run on this module (None: it runs)."""
    if verify is False:
        return "verify=False"
    params = list(module.parameters())
    if any(p.is_meta for p in params):
        return "the parameters are on the meta device (no weights to run)"
    nbytes = sum(p.numel() * p.element_size() for p in params)
    if verify == "auto" and nbytes > AUTO_LIMIT_BYTES:
        return (f"{nbytes / 2**30:.1f} GiB of parameters is above verify='auto''s "
                f"{AUTO_LIMIT_BYTES >> 30} GiB; pass verify=True to check anyway")
    return None


@contextlib.contextmanager
def _kept_state(module: nn.Module) -> Iterator[None]:
    """Restore ``.grad``, buffers and the RNG; run with gradients on (Lightning may have
    entered no_grad or inference mode around the first validation batch)."""
    params = list(module.parameters())
    grads = [p.grad for p in params]
    try:
        with preserved_tensors_and_rng(module), torch.inference_mode(False), \
                torch.enable_grad():
            yield
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g


def _seeded() -> contextlib.AbstractContextManager[Any]:
    # torch.cuda.is_initialized has no annotations
    cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    devices = [torch.cuda.current_device()] if cuda else []
    fork = torch.random.fork_rng(devices=devices)

    @contextlib.contextmanager
    def run() -> Iterator[None]:
        with fork, states_kept():  # the model and its stages draw Python's and numpy's alike
            torch.manual_seed(VERIFY_SEED)
            seed_host(VERIFY_SEED)
            yield

    return run()


def _output_grads(output: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(roots, fixed random gradients) for the output's floating tensors that need one."""
    generator = torch.Generator().manual_seed(VERIFY_SEED)
    roots, grads = [], []
    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.is_floating_point():
            roots.append(leaf)
            grads.append(torch.randn(leaf.shape, generator=generator).to(leaf))
    return roots, grads


def _copy_over(value: Any) -> Any:
    """What the next stage receives: a fresh tensor, as from the wire."""
    if isinstance(value, torch.Tensor):
        copy = value.detach().clone()
        return copy.requires_grad_(value.requires_grad and value.is_floating_point())
    return value


def _run_unsplit(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[Any, dict[str, Any]]:
    for p in module.parameters():
        p.grad = None
    with _seeded():
        output = module(*args, **kwargs)
    roots, grads = _output_grads(output)
    if roots:
        try:
            torch.autograd.backward(roots, grads)
        except RuntimeError as exc:  # the model's own backward: no split is involved yet
            raise ExampleInputError(
                f"verify runs {type(module).__name__} whole on the example first, and its own "
                f"backward fails, before any stage runs: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0]}. The model cannot train on this input as it is "
                "(e.g. an in-place change of a tensor autograd saved: x += y, "
                "ReLU(inplace=True) on a value used again); fix it and check with "
                "model(x).sum().backward() on one device") from exc
    return output, {n: p.grad.detach().clone() for n, p in module.named_parameters()
                    if p.grad is not None}


def _run_split(stages: Sequence[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Forward stage by stage through copies, then backward stage by stage."""
    outputs: list[Any] = []
    received: list[Any] = []
    with _seeded():
        for k, stage in enumerate(stages):
            try:
                if k == 0:
                    carried = stage(*args, **kwargs)
                else:
                    inputs = pytree.tree_map(_copy_over, outputs[-1])
                    received.append(inputs)
                    carried = stage(inputs)
            except Exception as exc:
                raise SplitMismatchError(
                    f"stage {k} fails when run as a pipeline runs it (its inputs are copies of "
                    f"what stage {k - 1} returned): {type(exc).__name__}: {exc}"
                ) from exc
            outputs.append(carried)
    roots, grads = _output_grads(outputs[-1])
    if roots:
        torch.autograd.backward(roots, grads)
    for k in range(len(stages) - 2, -1, -1):
        pairs = [
            (out, got.grad)
            for out, got in zip(pytree.tree_leaves(outputs[k]), pytree.tree_leaves(received[k]),
                                strict=True)
            if isinstance(out, torch.Tensor) and out.requires_grad and isinstance(
                got, torch.Tensor) and got.grad is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return outputs[-1]


def _strided(t: torch.Tensor) -> torch.Tensor:
    """A sparse tensor (``nn.Embedding(..., sparse=True)``'s gradient) as the dense one it
    stands for: its repeated indices summed, in whatever order either run produced them."""
    return t if t.layout == torch.strided else t.detach().to_dense()


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape or got.dtype != want.dtype:
        return float("inf")
    got, want = _strided(got), _strided(want)
    if not want.is_floating_point() and not want.is_complex():
        return 0.0 if torch.equal(got, want) else float("inf")
    diff = (got.detach() - want.detach()).abs()
    if diff.numel() == 0:
        return 0.0
    if not torch.isfinite(want).all() or not torch.isfinite(got).all():
        same = torch.equal(torch.isnan(got), torch.isnan(want)) and bool(
            ((got == want) | torch.isnan(want)).all())
        return 0.0 if same else float("inf")
    scale = max(want.detach().abs().max().item(), torch.finfo(want.dtype).tiny)
    return diff.max().item() / scale


def _output_differences(got: Any, want: Any) -> list[str]:
    got_leaves, got_spec = pytree.tree_flatten_with_path(got)
    want_leaves, want_spec = pytree.tree_flatten_with_path(want)
    if got_spec != want_spec:
        return [f"the output's structure: the split returns {got_spec}, the model {want_spec}"]
    problems = []
    for (path, a), (_, b) in zip(got_leaves, want_leaves, strict=True):
        where = "output" + pytree.keystr(path)
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                problems.append(f"{where}: the split returns a {type(a).__name__}")
                continue
            error = _relative_error(a, b)
            if error > tolerance(b.dtype):
                problems.append(f"{where} (shape {tuple(b.shape)}): {_describe_error(error)}")
        elif type(a) is not type(b):
            problems.append(f"{where}: {type(a).__name__} instead of {type(b).__name__}")
    return problems


def _describe_error(error: float) -> str:
    if error == float("inf"):
        return "a different shape, dtype or non-finite pattern"
    return f"differs by {error:.3g} of its largest magnitude"


def verify_split(part: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 verify: str | bool) -> Verdict:
    """Compare ``part`` with ``part.module`` on the example; raise :class:`SplitMismatchError`.

    The error names the first stage that differs (the earliest stage holding a parameter whose
    gradient differs; the last stage for an output), what differs, and the fixes.
    """
    module: nn.Module = part.module
    reason = skip_reason(module, verify)
    if reason is not None:
        return Verdict("skipped", reason)
    with _kept_state(module):
        # attributes too: a forward may cache things on the module (self.src_mask = ...)
        # called as the split was traced: the call's and its submodules' cache keywords
        with preserved_attributes(module), preserved_tensors_and_rng(module), \
                submodule_calls_cache_off(module, part.cache_off_modules):
            want_out, want_grads = _run_unsplit(module, args, {**kwargs, **part.fixed_keywords})
        for p in module.parameters():
            p.grad = None
        with preserved_attributes(module), preserved_tensors_and_rng(module):
            got_out = _run_split(part.stages, args, kwargs)
        params = dict(module.named_parameters())
        got_grads = {n: p.grad for n, p in params.items() if p.grad is not None}
        problems = _output_differences(got_out, want_out)
        first_stage = part.num_stages - 1 if problems else None
        for name in sorted(set(want_grads) | set(got_grads)):
            want, got = want_grads.get(name), got_grads.get(name)
            stage = part.stage_of_parameter.get(part.canonical_name(params[name]),
                                                part.num_stages - 1)
            if want is None or got is None:
                missing = "the split" if got is None else "the model"
                problems.append(f"gradient of {name!r} (stage {stage}): none from {missing}")
            else:
                error = _relative_error(got, want)
                if error <= tolerance(want.dtype):
                    continue
                problems.append(f"gradient of {name!r} (stage {stage}): {_describe_error(error)}")
            first_stage = stage if first_stage is None else min(first_stage, stage)
    if problems:
        raise SplitMismatchError(_mismatch_message(part, first_stage, problems))
    return Verdict("passed", f"outputs and {len(want_grads)} parameter gradients equal the "
                             "unsplit model's on the example")


def _mismatch_message(part: Any, first_stage: int | None, problems: list[str]) -> str:
    shown = problems[:6] + ([f"... and {len(problems) - 6} more"] if len(problems) > 6 else [])
    units = part.stage_units[first_stage] if first_stage is not None else []
    where = (f"The first stage that differs is stage {first_stage} (units {units[0]} .. "
             f"{units[-1]}). " if units else "")
    separated = getattr(part, "separated_changes", [])
    if separated:  # the likelier cause: a view handed over beside a value changed later
        where += (
            f"The cuts separate in-place changes from their values ({'; '.join(separated[:3])}"
            "): the next stage changes its own copy, so a view of the value handed over too "
            "no longer sees the change. Cut before the value or after the change "
            "(split_points=[...]), or make the change out of place (inplace=False, "
            "x = x + y). Otherwise: ")
    return (
        f"The split of {type(part.module).__name__} into {part.num_stages} stages does not "
        f"compute what the model computes on the example input: {'; '.join(shown)}. {where}"
        "Something in that stage's code is not recorded faithfully by torch.fx (see "
        "part.report(verbose=True) for its units). Fix: keep the module doing it whole with "
        "leaf_modules=(ThatModule,), or choose the cuts with split_points=[...]; please also "
        "report the model to lightning_gsched. verify=False skips this check."
    )
