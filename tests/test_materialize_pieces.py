"""A model built without weights, materialised as tensor-parallel pieces (one process, no mesh).

With ``tensor_parallel_size=T`` the engine shards a deferred model while it is still on the
meta device, then gives each rank only its pieces: ``initialize_parameters(..., pieces=)``
draws each module's parameters at their full shape under the module's seed (so the values are
one device's) and cuts them to the rank's region before the next module is drawn;
``load_parameters(..., pieces=)`` reads only the region from a safetensors file. Here a
``Piece`` is given by hand (rows or columns of a parameter, as a column- or row-wise shard at
index t of T=2 holds them) and checked against the full tensors one device draws or reads,
and the rank's bytes while drawing are bounded by its pieces plus one module's full tensors.
The multi-rank runs (the engine making the pieces from its shards) are in
test_lightning_tensor_parallel.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lightning_gsched.runtime import (
    Piece,
    initialize_parameters,
    load_parameters,
    pretrained_weights,
)
from lightning_gsched.runtime.materialize import deferred_parameters, initialize

SEED = 11
T = 2


def build() -> nn.Module:
    """Four layers, sharded like a transformer block's: column-wise (rows of the weight and
    bias), row-wise (columns of the weight; the bias whole), and an unsharded norm."""
    with deferred_parameters():
        return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8), nn.LayerNorm(8),
                             nn.Linear(8, 12))


def pieces_of(model: nn.Module, t: int) -> dict[int, Piece]:
    """Index t of T's pieces: layers 0 and 3 column-wise, layer 1 row-wise. Each parameter is
    then made a meta tensor of its piece's shape, as sharding on the meta device leaves it."""
    def rows(p: nn.Parameter) -> Piece:
        n = p.shape[0] // T
        return Piece(p.shape, (slice(t * n, (t + 1) * n),) + (slice(None),) * (p.dim() - 1))

    def cols(p: nn.Parameter) -> Piece:
        n = p.shape[1] // T
        return Piece(p.shape, (slice(None), slice(t * n, (t + 1) * n)))

    layers = list(model)
    found = {id(p): rows(p) for layer in (layers[0], layers[3]) for p in layer.parameters()}
    found[id(layers[1].weight)] = cols(layers[1].weight)
    for p in model.parameters():
        if id(p) in found:
            p.data = torch.empty(p[found[id(p)].region].shape, device="meta")
    return found


def one_device() -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in initialize(build(), SEED).named_parameters()}


@pytest.mark.parametrize("t", range(T))
def test_each_piece_is_its_region_of_one_devices_draw(t: int) -> None:
    want = one_device()
    model = build()
    pieces = pieces_of(model, t)
    names = dict(model.named_parameters())
    held: list[int] = []  # bytes with storage, each time a module is drawn

    def count(reset: object) -> object:
        def counted() -> None:
            held.append(sum(p.numel() * p.element_size() for p in model.parameters()
                            if not p.is_meta))
            reset()  # type: ignore[operator]
        return counted

    for layer in model:
        layer.reset_parameters = count(layer.reset_parameters)  # type: ignore[assignment]
    initialize_parameters(model, list(model.parameters()), SEED, torch.device("cpu"), pieces)
    for name, p in names.items():
        piece = pieces.get(id(p))
        expected = want[name] if piece is None else want[name][piece.region]
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=0, msg=name)
    # while a module is drawn: the pieces already cut, plus that module's full tensors
    for i in range(len(model)):
        before = sum((want[f"{j}.{n}"][pieces[id(q)].region] if id(q) in pieces
                      else want[f"{j}.{n}"]).numel() * 4
                     for j in range(i) for n, q in model[j].named_parameters())
        full = sum(p.numel() * 4 for n, p in want.items() if n.startswith(f"{i}."))
        assert held[i] == before + full, (i, held[i], before, full)


@pytest.mark.parametrize("t", range(T))
def test_a_piece_is_read_as_its_region_of_the_file(t: int, tmp_path: Path) -> None:
    full = {n: torch.randn(v.shape) for n, v in one_device().items()}
    save_file(full, str(tmp_path / "model.safetensors"))
    model = build()
    pieces = pieces_of(model, t)
    rest = load_parameters(model, list(model.parameters()),
                           pretrained_weights(tmp_path / "model.safetensors"),
                           torch.device("cpu"), pieces)
    assert rest == []
    for name, p in model.named_parameters():
        piece = pieces.get(id(p))
        expected = full[name] if piece is None else full[name][piece.region]
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=0, msg=name)


def test_a_file_of_another_shape_is_named_by_its_full_shape(tmp_path: Path) -> None:
    from lightning_gsched.runtime import PretrainedWeightsError

    full = {n: torch.randn(v.shape) for n, v in one_device().items()}
    full["0.weight"] = torch.randn(8, 8)  # the model's is (16, 8); its piece (8, 8)
    save_file(full, str(tmp_path / "model.safetensors"))
    model = build()
    pieces = pieces_of(model, 0)
    with pytest.raises(PretrainedWeightsError, match=r"shape \[8, 8\].*has \[16, 8\]"):
        load_parameters(model, list(model.parameters()),
                        pretrained_weights(tmp_path / "model.safetensors"),
                        torch.device("cpu"), pieces)
