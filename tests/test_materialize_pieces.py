"""A model built without weights, materialised as tensor-parallel pieces (one process, no mesh).

With ``tensor_parallel_size=T`` the engine shards a deferred model while it is still on the
meta device, then gives each rank only its pieces: ``initialize_parameters(..., pieces=)``
draws each module's parameters under the module's seed, so the values are one device's; a
piece is drawn in chunks keeping only its region (CPU, runtime/region_draw.py), or, where the
module's initialiser does more than fill it, at its full shape and cut before the next module;
``load_parameters(..., pieces=)`` reads only the region from a safetensors file. Here a
``Piece`` is given by hand (rows or columns of a parameter, as a column- or row-wise shard at
index t of T=2 holds them) and checked against the full tensors one device draws or reads,
and the rank's bytes while drawing are its pieces plus the module's unsharded tensors (plus
its full tensors where the module is drawn whole).
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
    region_draw,
)
from lightning_gsched.runtime.materialize import deferred_parameters, initialize
from lightning_gsched.runtime.region_draw import RegionTensor

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


def held_bytes(model: nn.Module) -> int:
    """Bytes the parameters hold now: a parameter drawn by region holds its region only."""
    return sum((p.local if isinstance(p, RegionTensor) and p.local is not None else p).numel() * 4
               for p in model.parameters() if not p.is_meta)


def draw_counting(model: nn.Module, pieces: dict[int, Piece]) -> list[int]:
    """``initialize_parameters`` of ``model``; the bytes held as each module starts its draw."""
    held: list[int] = []

    def count(reset: object) -> object:
        def counted() -> None:
            held.append(held_bytes(model))
            reset()  # type: ignore[operator]
        return counted

    for layer in model:
        layer.reset_parameters = count(layer.reset_parameters)  # type: ignore[assignment]
    initialize_parameters(model, list(model.parameters()), SEED, torch.device("cpu"), pieces)
    return held


@pytest.mark.parametrize("chunk", [16, 1 << 24], ids=["chunks-of-16", "one-chunk"])
@pytest.mark.parametrize("t", range(T))
def test_each_piece_is_its_region_of_one_devices_draw(t: int, chunk: int, monkeypatch) -> None:
    monkeypatch.setattr(region_draw, "CHUNK_ELEMENTS", chunk)
    want = one_device()
    model = build()
    pieces = pieces_of(model, t)
    names = dict(model.named_parameters())
    held = draw_counting(model, pieces)
    for name, p in names.items():
        piece = pieces.get(id(p))
        expected = want[name] if piece is None else want[name][piece.region]
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=0, msg=name)
    # while a module is drawn: the pieces already cut, plus that module's regions and its
    # unsharded tensors, never a sharded parameter's full tensor
    kept = {name: (want[name][pieces[id(p)].region] if id(p) in pieces else want[name]).numel()
            * 4 for name, p in names.items()}
    for i in range(len(model)):
        before = sum(n for name, n in kept.items() if int(name.split(".")[0]) < i)
        drawn = sum(n for name, n in kept.items() if name.startswith(f"{i}."))
        assert held[i] == before + drawn, (i, held[i], before, drawn)


class Truncated(nn.Linear):
    """A layer whose initialiser reads its weight (trunc_normal_'s rejection loop)."""

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, std=0.5)
        nn.init.zeros_(self.bias)


class ThroughNumpy(nn.Linear):
    """A layer whose initialiser writes through a numpy view of its weight (a tensor subclass
    has none: a RuntimeError, not RegionUnsupported, while drawn by region)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        if not self.weight.is_meta:  # (its build, without weights)
            self.weight.detach().numpy()[0] = 0.0
        nn.init.zeros_(self.bias)


@pytest.mark.parametrize("layer", [Truncated, ThroughNumpy])
def test_an_initialiser_that_reads_a_piece_draws_its_module_whole(layer: type) -> None:
    """Drawn by region it would be refused (RegionUnsupported, or any error while drawn so);
    the module is drawn at its full shape instead and cut, with one device's values, holding
    its full tensors meanwhile."""
    def make() -> nn.Module:
        with deferred_parameters():
            return nn.Sequential(nn.Linear(8, 16), layer(16, 8))

    want = {n: p.detach().clone() for n, p in initialize(make(), SEED).named_parameters()}
    model = make()
    layers = list(model)
    n = 8 // T
    pieces = {id(layers[1].weight): Piece(torch.Size((8, 16)), (slice(n, 2 * n), slice(None)))}
    layers[1].weight.data = torch.empty(n, 16, device="meta")
    held = draw_counting(model, pieces)
    torch.testing.assert_close(layers[1].weight.detach(), want["1.weight"][n:], rtol=0, atol=0)
    torch.testing.assert_close(layers[0].weight.detach(), want["0.weight"], rtol=0, atol=0)
    # the second attempt (whole) starts holding the first layer and its own full weight
    assert held[-1] == (8 * 16 + 16) * 4 + (8 * 16 + 8) * 4, held


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_chunked_draw_is_exact_on_this_torch(dtype: torch.dtype) -> None:
    """What the region draw rests on (checked by the runtime once per dtype and process), and
    the same over shapes with and without a tail past the last block of 16, cut along each
    dimension, in chunks of 16 elements and in one: uniform_ and normal_ of the region equal
    one draw's region, and the generator ends where one draw leaves it."""
    assert region_draw.chunked_draw_is_exact(dtype)
    for shape in [(50,), (16, 3), (7, 37), (4, 5, 9)]:
        for dim in range(len(shape)):
            stop = max(1, shape[dim] // 2)
            region = tuple(slice(0, stop) if d == dim else slice(None) for d in range(len(shape)))
            for method, args in (("uniform_", (-2.0, 3.0)), ("normal_", (0.5, 2.0))):
                for chunk in (16, 1 << 24):
                    torch.manual_seed(5)
                    whole = getattr(torch.empty(shape, dtype=dtype), method)(*args)
                    after = torch.rand(3)
                    torch.manual_seed(5)
                    tensor = region_draw.region_tensor(torch.Size(shape), dtype, region)
                    assert tensor is not None and tensor.local is not None
                    tensor._draw(lambda t, m=method, a=args: getattr(t, m)(*a), chunk)
                    case = (shape, dim, method, chunk)
                    assert torch.equal(tensor.local, whole[region]), case
                    assert torch.equal(torch.rand(3), after), case


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


class Replacing(nn.Linear):
    """A layer whose initialiser assigns new parameters instead of filling its own."""

    def reset_parameters(self) -> None:
        self.weight = nn.Parameter(torch.randn(self.out_features, self.in_features))
        self.bias = nn.Parameter(torch.zeros(self.out_features))


def test_an_initialiser_that_replaces_a_piece_is_not_taken_for_one_that_filled_it() -> None:
    """Nothing reaches the region (no op on it): it would be left uninitialised memory; the
    module is drawn whole instead, as before region draws (the values then are what the
    full path gives such a layer: its original parameter objects keep their draw)."""
    def make() -> nn.Module:
        with torch.device("meta"):  # (deferred_parameters refuses such a layer at its build)
            return nn.Sequential(Replacing(8, 16))

    model = make()
    weight = model[0].weight
    n = 16 // T
    pieces = {id(weight): Piece(torch.Size((16, 8)), (slice(0, n), slice(None)))}
    weight.data = torch.empty(n, 8, device="meta")
    held = draw_counting(model, pieces)
    assert len(held) == 2, held  # tried by region, then whole
