"""Deferred initialisation: build a model without its weights, give each rank only its own.

A model that does not fit one device must never be whole on any rank. Built under
:func:`deferred_parameters`, every parameter is on the ``meta`` device while buffers stay real
(small, and often computed at build: causal masks, rotary frequencies). Tracing, partitioning and
planning work on the meta model; then each rank gives its stages' parameters storage and values.

**Same seed, same weights, whatever W, schedule and S.** Every module holding parameters runs its
own ``reset_parameters()`` under an RNG seeded by :func:`module_seed` (the run's seed and the
module's name), so no value depends on which rank initialises which module, nor in which order;
a tied parameter keeps its first holder's values in ``named_modules()`` order, as in eager
construction. :func:`initialize` does the same on one device, for a single-process reference.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence, cast

import torch
from torch import nn

from lightning_gsched.errors import StrategyConfigError
from lightning_gsched.runtime.flat import set_storage
from lightning_gsched.runtime.layout import split_parameters
from lightning_gsched.runtime.region_draw import RegionTensor, RegionUnsupported, region_tensor
from lightning_gsched.schedule.program import Programs

_REGISTER_PARAMETER = nn.Module.register_parameter


class DeferredLoadError(StrategyConfigError):
    """Weights were loaded into a model while it is being built without weights."""


_LOAD_FIX = (
    "GeneralParallel builds the model without weights inside configure_model() and "
    "trainer.init_module() (deferred initialisation: each rank later initialises only its own "
    "stages), so weights loaded there would be dropped. Load them after the model is built (a "
    "checkpoint: trainer.fit(ckpt_path=...)), or build with real weights: "
    "trainer.init_module(empty_init=False), or outside configure_model.")


@contextlib.contextmanager
def deferred_parameters() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device, moved as they are registered
    (``torch.empty`` commits no pages). Loading weights inside (``load_state_dict``, or a real
    parameter assigned over a meta one, as ``from_pretrained`` does) raises, not drops them."""
    load_state_dict = nn.Module.load_state_dict

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            previous = module._parameters.get(name)
            if previous is not None and previous.is_meta:
                raise DeferredLoadError(
                    f"a real tensor is assigned over the parameter {name!r} of "
                    f"{type(module).__name__} (loading weights). {_LOAD_FIX}")
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        _REGISTER_PARAMETER(module, name, param)

    def refuse_load(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        raise DeferredLoadError(f"{type(module).__name__}.load_state_dict was called. {_LOAD_FIX}")

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign,assignment]
    nn.Module.load_state_dict = refuse_load  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = _REGISTER_PARAMETER  # type: ignore[method-assign]
        nn.Module.load_state_dict = load_state_dict  # type: ignore[method-assign]


def is_deferred(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (no weights yet)."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def module_seed(seed: int, name: str) -> int:
    """The RNG seed module ``name`` is initialised under: a function of the seed and name alone."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _holders(module: nn.Module, params: Collection[int]) -> list[tuple[str, nn.Module]]:
    """Modules (canonical names) directly holding a parameter in ``params`` or a meta buffer."""
    return [(name, sub) for name, sub in module.named_modules()
            if any(id(p) in params for p in sub.parameters(recurse=False))
            or any(b.is_meta for b in sub.buffers(recurse=False))]


def _reset_parameters(name: str, sub: nn.Module, owner: str) -> Callable[[], None]:
    reset: Callable[[], None] | None = getattr(sub, "reset_parameters", None)
    if not callable(reset):
        raise StrategyConfigError(
            f"module {name or '(root)'!r} ({type(sub).__name__}) of {owner} holds parameters of "
            "its own but has no reset_parameters(), so a model built without weights (deferred "
            "initialisation: configure_model, init_module) cannot initialise them. Define "
            f"{type(sub).__name__}.reset_parameters() to fill its parameters (as torch's layers "
            "do), or build the model with real weights outside init_module/configure_model.")
    return reset


@dataclass(frozen=True)
class Piece:
    """A parameter held as a region of a larger tensor (a tensor-parallel shard): the full
    tensor is what one device draws or reads, ``region`` the part this rank keeps.

    Why the runtime knows it: a model built without weights must never hold a worker's full
    parameters at once when they are sharded, so each module's are drawn at full size, cut to
    their pieces, and only then is the next module drawn (:func:`initialize_parameters`); a
    pretrained file is read region by region (``runtime/pretrained.py``); a full checkpoint
    streamed to rank 0 sends each piece's full tensor, made on the worker (``fullstate.py``)."""

    shape: torch.Size  # the full tensor's
    region: tuple[slice, ...]  # this rank's part of it
    # a local buffer seen as the full tensor (a DTensor view), for a reader that fills only
    # this rank's region in place (torch.distributed.checkpoint); None: read whole, then cut
    view: Callable[[torch.Tensor], torch.Tensor] | None = None
    # the full tensor from this rank's piece and its peers' (collective over the worker's T
    # ranks, each calling with its own piece), for a full checkpoint streamed to rank 0
    whole: Callable[[torch.Tensor], torch.Tensor] | None = None

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full`` (a copy: the full tensor is not kept alive)."""
        return full[self.region].clone()


Pieces = Mapping[int, Piece]  # id(parameter) -> its piece, for parameters held as one


def full_shape(param: nn.Parameter, pieces: Pieces) -> torch.Size:
    """The shape ``param`` has on one device (its local shape unless it is a piece)."""
    piece = pieces.get(id(param))
    return param.shape if piece is None else piece.shape


def parameters_to_meta(module: nn.Module) -> None:
    """Every parameter of ``module`` becomes a meta tensor of its shape: the module is a model
    built without weights again (each rank materialises or restores its own at the next
    build). For a module whose run ended without a gather, before a checkpoint is restored
    into it: the parameters a rank kept differ between ranks, which the next build's weight
    broadcast cannot take, and the checkpoint overwrites them anyway."""
    for param in module.parameters():
        if not param.is_meta:
            set_storage(param, torch.empty(param.shape, dtype=param.dtype, device="meta"))


def allocate_parameters(params: Collection[nn.Parameter], device: torch.device,
                        pieces: Pieces | None = None) -> None:
    """Give ``params`` storage on ``device``, uninitialised (a piece: its region's shape), for
    a caller that fills every one of them itself (a checkpoint restored into a model built
    without weights): drawing them first would spend the RNG on values never used, and refuse
    modules without ``reset_parameters()`` (transformers' norms) for nothing."""
    pieces = pieces or {}
    for p in params:
        piece = pieces.get(id(p))
        shape = (p.shape if piece is None
                 else torch.empty(piece.shape, device="meta")[piece.region].shape)
        set_storage(p, torch.empty(shape, dtype=p.dtype, device=device))


@torch.no_grad()
def initialize_parameters(module: nn.Module, params: Collection[nn.Parameter], seed: int,
                          device: torch.device, pieces: Pieces | None = None) -> None:
    """Give ``params`` storage on ``device`` and initialise them; other meta parameters stay so.
    Each module holding one runs ``reset_parameters()`` under :func:`module_seed`, its other meta
    parameters (another rank's) on scratch storage, so the RNG draws and values are the same as on
    one device. Meta buffers (of a model built on ``torch.device("meta")``) are reset there too.

    ``pieces``: parameters held as a region of a larger tensor. Their values are one device's
    draws: on CPU each is drawn in chunks keeping only its region (``region_draw.py``: the rank
    never holds its full tensor), unless the module's initialiser does more than fill it; then,
    and on other devices, it is drawn at its full shape and cut to its region before the next
    module is drawn: the rank holds the pieces it keeps plus one module's full parameters."""
    pieces = pieces or {}
    wanted = {id(p) for p in params}
    owner = type(module).__name__
    # every rank checks every module (not only those it initialises), so all fail alike
    for name, sub in _holders(module, {id(p) for p in module.parameters()}):
        _reset_parameters(name, sub, owner)
    initialised: set[int] = set()  # a tied parameter keeps its first holder's values
    by_region = device.type == "cpu" and bool(pieces)  # (region_tensor checks the dtype)
    for name, sub in _holders(module, wanted):
        own = list(sub.parameters(recurse=False))
        kept = [(p, p.detach().clone()) for p in own if id(p) in initialised]
        scratch = [(p, p.shape) for p in own if p.is_meta and id(p) not in wanted]
        cut = [p for p in own if id(p) in wanted and id(p) in pieces and id(p) not in initialised]
        reset = _reset_parameters(name, sub, owner)
        regions = _regions(cut, pieces) if by_region else {}
        try:  # the pieces drawn by region (region_draw.py), the rest at full shape
            _draw(sub, own, reset, module_seed(seed, name), device, pieces, regions)
        except Exception:  # noqa: BLE001 - drawing by region only saves memory: on any failure
            if not regions:  # (RegionUnsupported: an initialiser that reads the values, ...)
                raise  # the module is drawn at full shape, whose own errors are the user's
            regions = {}
            _draw(sub, own, reset, module_seed(seed, name), device, pieces, regions)
        for p, shape in scratch:
            set_storage(p, torch.empty(shape, dtype=p.dtype, device="meta"))
        for p in cut:
            region = regions.get(id(p))
            set_storage(p, pieces[id(p)].cut(p.detach()) if region is None
                        else cast(torch.Tensor, region.local))
        for p, value in kept:  # (a piece's value has its region's shape)
            if p.shape == value.shape:
                p.copy_(value)
            else:
                set_storage(p, value)
        initialised.update(id(p) for p in own if id(p) in wanted)


def _regions(params: Sequence[nn.Parameter], pieces: Pieces) -> dict[int, RegionTensor]:
    """A :class:`RegionTensor` for each piece of ``params`` cut along one dimension."""
    found = {id(p): region_tensor(pieces[id(p)].shape, p.dtype, pieces[id(p)].region)
             for p in params}
    return {key: region for key, region in found.items() if region is not None}


def _draw(sub: nn.Module, own: Sequence[nn.Parameter], reset: Callable[[], None], seed: int,
          device: torch.device, pieces: Pieces, regions: Mapping[int, RegionTensor]) -> None:
    """``sub``'s ``reset_parameters()`` under ``seed``: each of ``own`` at one device's shape
    (real storage), but those with a region, seen as their :class:`RegionTensor` meanwhile."""
    for p in own:
        if id(p) not in regions and (p.is_meta or p.shape != full_shape(p, pieces)):
            set_storage(p, torch.empty(full_shape(p, pieces), dtype=p.dtype, device=device))
    for bname, b in list(sub.named_buffers(recurse=False)):
        if b.is_meta:
            sub._buffers[bname] = torch.empty_like(b, device=device)
    originals = dict(sub._parameters)
    for pname, param in originals.items():
        if param is not None and id(param) in regions:
            sub._parameters[pname] = regions[id(param)]  # type: ignore[assignment]
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            reset()
        for pname, param in originals.items():  # every region written, in place
            region = regions.get(id(param))
            now: Any = sub._parameters.get(pname)  # (a RegionTensor while drawn)
            if region is not None and not (now is region and region.filled):
                raise RegionUnsupported(f"reset_parameters() left {pname!r} unfilled or "
                                        "replaced it")
    finally:
        sub._parameters.update(originals)


def owned_parameters(stages: Sequence[nn.Module], programs: Programs, rank: int,
                     module: nn.Module) -> list[nn.Parameter]:
    """The parameters ``rank`` keeps: its stages' own, its ties', and those no stage reads (the
    loss may read them; every rank keeps those)."""
    own, ties = split_parameters(stages)
    keep = [p for s in programs.owned_stages(rank) for p in own[s]]
    homes = set(programs.owned_ties(rank))
    keep += [p for g in ties if g.home in homes for p in g.params]
    in_stages = {id(p) for stage in stages for p in stage.parameters()}
    keep += [p for p in module.parameters() if id(p) not in in_stages]
    return list(dict.fromkeys(keep))


def initialize(module: nn.Module, seed: int, device: Any = "cpu") -> nn.Module:
    """The weights a deferred ``module`` gets under ``GeneralParallel``, on one device (a
    single-process reference, or a model written for deferred initialisation trained on one)."""
    initialize_parameters(module, list(module.parameters()), seed, torch.device(device))
    return module
