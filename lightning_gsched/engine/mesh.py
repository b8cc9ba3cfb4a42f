"""The (pipeline, data_parallel) ``DeviceMesh`` both front ends expose as ``device_mesh``.

Why: users of Lightning's ``ModelParallelStrategy`` read ``self.device_mesh["data_parallel"]``
in their LightningModule (and ``trainer.strategy.device_mesh``) to find their data-parallel
peers; a plan with ``data_parallel_size=G`` has the same structure, so the strategies expose
it the same way. One module makes it, so the Trainer and Fabric strategies cannot disagree.

The layout is the planner's (:class:`~lightning_gsched.schedule.replicas.ReplicaLayout`):
rank ``p * G + g`` is pipeline position ``p`` of replica ``g``, so the mesh has shape (P, G)
with dimensions ``("pipeline", "data_parallel")``, as torchtitan's ``["pp", "dp"]`` mesh: a
stage's column of G ranks is ``mesh["data_parallel"]`` and a replica's P ranks
``mesh["pipeline"]``. With G = 1 the mesh is (W, 1). With ``tensor_parallel_size=T`` > 1 it
is (P, G, T), ``"tensor_parallel"`` innermost, as Lightning's ModelParallelStrategy names it.

When: making a mesh creates process groups, a collective every rank must enter at the same
point. For a fixed schedule G is known from the arguments, so the front ends make it right
after the process group exists (``setup_environment``; Lightning's ``configure_model`` can read
it). For ``schedule="auto"`` G is the tuner's pick, known at the first batch: the engine makes
it at its build, right after the pick, and reading it earlier raises a
:class:`~lightning_gsched.errors.StrategyConfigError` saying so.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterator

from lightning_gsched.engine.config import ScheduleConfig
from lightning_gsched.errors import StrategyConfigError
from lightning_gsched.runtime import destroy_groups, mesh_backend, mesh_backend_override
from lightning_gsched.schedule.data_parallel import pipeline_size, tensor_parallel_workers

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("pipeline", "data_parallel")  # rank = p * G + g: pipeline outermost
TENSOR_PARALLEL = "tensor_parallel"  # the third dimension, innermost, when T > 1


def mesh_shape(world_size: int, data_parallel_size: int, tensor_parallel_size: int = 1
               ) -> tuple[int, ...]:
    """(P, G), or (P, G, T) with tensor parallelism: a G or T that does not divide raises the
    planner's :class:`ScheduleConfigError` (naming the divisors) before any group is made."""
    workers = tensor_parallel_workers(world_size, tensor_parallel_size)
    P = pipeline_size(workers, data_parallel_size)
    if tensor_parallel_size == 1:
        return (P, data_parallel_size)
    return (P, data_parallel_size, tensor_parallel_size)


def pipeline_data_mesh(device_type: str, world_size: int, data_parallel_size: int,
                       tensor_parallel_size: int = 1) -> DeviceMesh:
    """The (P, G) or (P, G, T) mesh of ``world_size`` ranks (collective: every rank calls it).

    With T > 1 the ``"tensor_parallel"`` dimension is innermost: a worker's T ranks are
    consecutive (rank ``(p * G + g) * T + t``), so its per-layer collectives stay inside a node,
    and ``mesh["tensor_parallel"]`` is the group each stage is sharded over.
    """
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(world_size, data_parallel_size, tensor_parallel_size)
    names = MESH_DIMS if len(shape) == 2 else (*MESH_DIMS, TENSOR_PARALLEL)
    forget_sharding_decisions()  # an earlier mesh of the same ranks may have been decided on
    # on a CPU gloo job its groups share the default group's transport device (one thread
    # fewer per dimension, runtime/gloo_groups)
    return init_device_mesh(device_type, shape, mesh_dim_names=names,
                            backend_override=mesh_backend_override(device_type, len(shape)))


class DeviceMeshSlot:
    """A front end's ``device_mesh``: empty until G is known, then made once (module doc).

    ``on_made(mesh)``: what the front end does with a new mesh (the Trainer strategy hands
    it to the LightningModule, whose ``device_mesh`` reads it).
    """

    def __init__(self, on_made: Callable[[DeviceMesh], None] | None = None) -> None:
        self._mesh: DeviceMesh | None = None
        self._live = False  # its groups exist (False after release: still readable)
        self._submeshes: dict[str, DeviceMesh] = {}
        self._on_made = on_made

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh, or a :class:`StrategyConfigError` saying when it will exist."""
        if self._mesh is None:
            raise StrategyConfigError(
                "device_mesh is made once the processes have started and data_parallel_size "
                "is known: at setup (Trainer.fit, fabric.launch) for a named schedule, at the "
                "first batch for schedule='auto' (the tuner picks it then). Read it from the "
                "first training step on (or in configure_model with a named schedule)")
        return self._mesh

    @property
    def made(self) -> bool:
        return self._live

    def make_if_decided(self, config: ScheduleConfig, world_size: int, device_type: str
                        ) -> None:
        """At setup: the mesh of a fixed schedule (or of ``"auto"``'s earlier pick); an
        undecided ``"auto"`` leaves it to :meth:`make_for`, at the first batch."""
        if config.decided:
            self._make(device_type, world_size, config.data_parallel_size,
                       config.tensor_parallel_size)

    def make_for(self, world_size: int, data_parallel_size: int, device_type: str,
                 tensor_parallel_size: int = 1) -> None:
        """At the engine's build: the mesh of the plan it runs, unless made already."""
        if not self._live:
            self._make(device_type, world_size, data_parallel_size, tensor_parallel_size)

    def _make(self, device_type: str, world_size: int, data_parallel_size: int,
              tensor_parallel_size: int = 1) -> None:
        mesh = self._mesh
        shape = mesh_shape(world_size, data_parallel_size, tensor_parallel_size)
        same = (self._live and mesh is not None and mesh.device_type == device_type
                and tuple(mesh.shape) == shape)
        if not same:  # else a later run of the same strategy (fit, then test): same groups
            self._submeshes = {}
            mesh = self._mesh = pipeline_data_mesh(device_type, world_size, data_parallel_size,
                                                   tensor_parallel_size)
            self._live = True
        if self._on_made is not None:
            self._on_made(mesh)  # type: ignore[arg-type]  # made above

    def dimension(self, name: str) -> DeviceMesh:
        """``mesh[name]``, made once and kept: the same object for every caller (the stages
        sharded over it keep it), so that :meth:`abort` reaches it."""
        if name not in self._submeshes:
            self._submeshes[name] = self.mesh[name]
        return self._submeshes[name]

    def release(self) -> None:
        """The run ended (the strategy's teardown): destroy the mesh's groups, as the
        strategy's other groups are; the mesh stays readable (shape, names, ranks) but carries
        no collective. Why: each fit of a new strategy makes a mesh, so a process running many
        (a sweep, a test suite) would keep every earlier fit's groups, each with connections to
        every peer; a later run of the same strategy (fit, then test) makes a new mesh at its
        setup."""
        mesh = self._mesh
        meshes = [mesh, *self._submeshes.values()] if mesh is not None else []
        live, self._submeshes, self._live = self._live, {}, False
        if mesh is not None and live:
            _release(meshes, list(mesh.get_all_groups()))

    def abort(self) -> None:
        """This job is failing: destroy the mesh's groups, so a peer waiting in one of them
        (a sharded layer's collective) sees the closed connection at once, and forget the mesh
        (a later run makes a new one).

        Why the registries are emptied: a ``DeviceMesh`` (and each sub-mesh) keeps its process
        groups in ``_pg_registry``, and a group's connections close only when its last
        reference goes; the sharded stages keep their sub-mesh, so destroying the groups alone
        left a tensor-parallel peer waiting until this process exited (measured: ~20 s, the
        peer's wait, instead of at once)."""
        self.release()
        self._mesh = None


def forget_sharding_decisions() -> None:
    """Empty DTensor's caches of sharding decisions (torch's debugging helper, private: skipped
    where a torch version lacks it).

    Why: torch caches each operator's output layout by its inputs' layouts, and a layout holds
    its ``DeviceMesh``, which compares equal to any mesh of the same ranks and names whatever
    its process groups. A mesh made after another of the same ranks (``"auto"`` profiling one T
    after another, a second fit in the same process) would otherwise get outputs laid out on
    the earlier mesh, whose groups are destroyed: "Could not resolve the process group"."""
    from torch.distributed.tensor import debug

    clear = getattr(debug, "_clear_sharding_prop_cache", None)  # the Python and C++ caches
    if clear is not None:
        clear()


def _release(meshes: list[DeviceMesh], groups: list[Any]) -> None:
    """Destroy ``groups`` and empty the meshes' group registries (:meth:`DeviceMeshSlot.abort`
    says why both), and the sharding decisions made on them (:func:`forget_sharding_decisions`)."""
    destroy_groups(groups)
    forget_sharding_decisions()
    for each in meshes:
        registry = getattr(each, "_pg_registry", None)  # torch's
        if isinstance(registry, dict):
            registry.clear()


@contextmanager
def first_worker_mesh(device_type: str, world_size: int, tensor_parallel_size: int,
                      timeout: float) -> Iterator[DeviceMesh | None]:
    """Worker 0's tensor-parallel group (ranks 0 .. T - 1) as a one-dimensional mesh, for
    ``schedule="auto"`` to profile its stages sharded as they will run, before the tuner's
    pick decides G and so the run's mesh (collective: every rank enters; the others get None).

    The group waits at most ``timeout`` seconds in a collective (a peer that failed cannot keep
    the others waiting for the backend's default half hour), and is destroyed on the way out:
    each gloo group keeps a thread."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    ranks = list(range(tensor_parallel_size))
    forget_sharding_decisions()  # an earlier mesh of the same ranks may have been decided on
    group = dist.new_group(ranks, timeout=timedelta(seconds=timeout),
                           backend=mesh_backend(device_type))
    if dist.get_rank() not in ranks:
        yield None
        return
    mesh = DeviceMesh.from_group(group, device_type, mesh=ranks,
                                 mesh_dim_names=(TENSOR_PARALLEL,))
    try:
        yield mesh
    finally:
        _release([mesh], [group])
