"""What a step returns besides its loss, handed to the hooks of the rank that loaded the rows.

Why: Lightning passes a step's return value to ``on_train_batch_end`` (the training step's
dict, its ``loss`` and any other keys) and to ``on_validation_batch_end`` /
``on_test_batch_end`` (whatever the step returned), and callbacks read them there (predictions
for a metric, images to log). Under a pipeline the user's step finishes on the rank that
computes the microbatch's last stage, once per microbatch, so the returns exist there only, cut
into microbatches that may mix several ranks' rows. This module puts them back together as one
device would have returned them for the rows *this* rank loaded (DDP's semantics, as
predictions already are, :func:`.batches.local_outputs`), leaf by leaf:

* a tensor whose first dimension is its microbatch's rows, or a list holding no tensor with
  one value per row (ids): this rank's rows, in its batch's order (exact; a tensor or list that
  is not per row but has as many entries as the microbatch has rows is taken for one);
* a floating scalar (a float, or a floating tensor of the same shape in every microbatch
  without a row dimension, such as a mean accuracy): the mean over the global batch's
  microbatches weighted by their rows, as the step's loss is (exact for a mean over rows, the
  global batch's value rather than this rank's share);
* any other value: the value when every microbatch returned the same one (a flag, a name),
  else ``None``, named in a warning: a count or an integer per microbatch cannot be attributed
  to this rank's rows (return it per row, or log it with ``self.log``).

Only what a hook can read travels: the front end asks for outputs when the LightningModule or a
callback of the user's (not Lightning's own, which do not read them) overrides the hook.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from lightning_gsched.engine.batches import plain_list
from lightning_gsched.engine.rows import RowMap

# a step's returns above this many bytes per step on one rank are warned of, once per hook
LARGE_OUTPUTS_BYTES = 64 * 2**20
_WARNED_LARGE: set[str] = set()


def warn_if_large(shipped: Any, what: str) -> None:
    """Warn once per hook when the returns this rank ships in one step are large: every rank
    receives every microbatch's (a pickled all-gather), so a step returning its logits moves
    the global batch's logits to each rank at every step, though a hook may use none of it."""
    nbytes = sum(leaf.numel() * leaf.element_size() for leaf in pytree.tree_leaves(shipped)
                 if isinstance(leaf, torch.Tensor))
    if nbytes > LARGE_OUTPUTS_BYTES and what not in _WARNED_LARGE:
        _WARNED_LARGE.add(what)
        warnings.warn(
            f"{what} returned {nbytes / 2**20:.0f} MiB in one step on this rank, which travels to "
            "every rank because a batch-end hook reads the step's outputs (the LightningModule "
            "or a callback of yours overrides it). Return only what your hooks use (log the "
            "rest with self.log)", stacklevel=2)


def training_extras(result: Any) -> dict[str, Any] | None:
    """The keys of a training step's returned dict other than ``loss`` (detached, as Lightning
    keeps them); ``None`` when the step returned the loss alone."""
    if not isinstance(result, dict):
        return None
    extras = {k: v for k, v in result.items() if k != "loss"}
    if not extras:
        return None
    detached: dict[str, Any] = pytree.tree_map(
        lambda x: x.detach() if isinstance(x, torch.Tensor) else x, extras)
    return detached


def rank_step_outputs(outputs: Mapping[int, Any], cut: RowMap, position: int,
                      what: str) -> Any:
    """The step's return as one device would give it for the rows ``position`` loaded, from
    every microbatch's return (``outputs[b]``, rows in microbatch b's order); see the module
    doc for each kind of value. ``what`` names the hook in the warnings."""
    micros = sorted(b for b in outputs if cut.micros[b])
    if not micros:
        return None
    flat = [pytree.tree_flatten_with_path(outputs[b], is_leaf=plain_list) for b in micros]
    spec = flat[0][1]
    if any(s != spec for _, s in flat):
        warnings.warn(
            f"{what} returned differently structured values for different microbatches, so "
            "its outputs cannot be joined; the hooks get None. Return the same structure for "
            "every batch", stacklevel=2)
        return None
    rows = cut.micro_rows()
    pieces = cut.loaded_by(position)
    joined: list[Any] = []
    for column, (path, _) in enumerate(flat[0][0]):
        values = {b: leaves[column][1] for b, (leaves, _) in zip(micros, flat, strict=True)}
        joined.append(_join_leaf(values, rows, pieces, f"{what}{pytree.keystr(path)}"))
    return pytree.tree_unflatten(joined, spec)


def _join_leaf(values: dict[int, Any], rows: list[int], pieces: list[Any], name: str) -> Any:
    """One leaf of the step's return, joined over the microbatches (module doc)."""
    first = next(iter(values.values()))
    if _per_row(values, rows):
        mine = [values[p.micro][p.offset:p.offset + p.rows] for p in pieces]
        if isinstance(first, list):
            return [value for part in mine for value in part]
        return torch.cat(mine) if mine else first[:0]
    if _floating_scalar(values):
        total = sum(rows[b] for b in values)
        if isinstance(first, torch.Tensor):
            return sum(v.to(torch.float64) * rows[b] for b, v in values.items()).div(
                total).to(first.dtype)
        return sum(float(v) * rows[b] for b, v in values.items()) / total
    if all(_same(v, first) for v in values.values()):
        return first
    warnings.warn(
        f"{name} differs between microbatches and has no row dimension (a "
        f"{type(first).__name__}), so it cannot be given for this rank's rows; the hooks get "
        "None for it. Return it per row (first dimension = samples), as a float mean, or log "
        "it with self.log", stacklevel=3)
    return None


def _per_row(values: dict[int, Any], rows: list[int]) -> bool:
    if all(plain_list(v) and len(v) == rows[b] for b, v in values.items()):
        return True
    return all(isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows[b]
               for b, v in values.items())


def _floating_scalar(values: dict[int, Any]) -> bool:
    first = next(iter(values.values()))
    if isinstance(first, float):
        return all(isinstance(v, float) for v in values.values())
    return (isinstance(first, torch.Tensor) and first.is_floating_point()
            and all(isinstance(v, torch.Tensor) and v.shape == first.shape
                    and v.dtype == first.dtype for v in values.values()))


def _same(value: Any, first: Any) -> bool:
    if isinstance(value, torch.Tensor) or isinstance(first, torch.Tensor):
        return (isinstance(value, torch.Tensor) and isinstance(first, torch.Tensor)
                and value.shape == first.shape and bool(torch.equal(value, first)))
    try:
        return bool(value == first)
    except Exception:  # an object without a usable ==: not known to be the same
        return False
