"""The (pipeline, data_parallel) ``DeviceMesh`` both front ends expose as ``device_mesh``.

Why: users of Lightning's ``ModelParallelStrategy`` read ``self.device_mesh["data_parallel"]``
in their LightningModule (and ``trainer.strategy.device_mesh``) to find their data-parallel
peers; a plan with ``data_parallel_size=G`` has the same structure, so the strategies expose
it the same way. One module makes it, so the Trainer and Fabric strategies cannot disagree.

The layout is the planner's (:class:`~lightning_gsched.schedule.replicas.ReplicaLayout`):
rank ``p * G + g`` is pipeline position ``p`` of replica ``g``, so the mesh has shape (P, G)
with dimensions ``("pipeline", "data_parallel")``, as torchtitan's ``["pp", "dp"]`` mesh: a
stage's column of G ranks is ``mesh["data_parallel"]`` and a replica's P ranks
``mesh["pipeline"]``. With G = 1 the mesh is (W, 1).

When: making a mesh creates process groups, a collective every rank must enter at the same
point. For a fixed schedule G is known from the arguments, so the front ends make it right
after the process group exists (``setup_environment``; Lightning's ``configure_model`` can read
it). For ``schedule="auto"`` G is the tuner's pick, known at the first batch: the engine makes
it at its build, right after the pick, and reading it earlier raises a
:class:`~lightning_gsched.errors.StrategyConfigError` saying so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from lightning_gsched.engine.config import ScheduleConfig
from lightning_gsched.errors import StrategyConfigError
from lightning_gsched.schedule.data_parallel import pipeline_size

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("pipeline", "data_parallel")  # rank = p * G + g: pipeline outermost


def pipeline_data_mesh(device_type: str, world_size: int, data_parallel_size: int
                       ) -> DeviceMesh:
    """The (P, G) mesh of ``world_size`` ranks (collective: every rank calls it).

    A G that does not divide W raises the planner's :class:`ScheduleConfigError` (naming
    the divisors) before any process group is made.
    """
    from torch.distributed.device_mesh import init_device_mesh

    P = pipeline_size(world_size, data_parallel_size)
    return init_device_mesh(device_type, (P, data_parallel_size), mesh_dim_names=MESH_DIMS)


class DeviceMeshSlot:
    """A front end's ``device_mesh``: empty until G is known, then made once (module doc).

    ``on_made(mesh)``: what the front end does with a new mesh (the Trainer strategy hands
    it to the LightningModule, whose ``device_mesh`` reads it).
    """

    def __init__(self, on_made: Callable[[DeviceMesh], None] | None = None) -> None:
        self._mesh: DeviceMesh | None = None
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
        return self._mesh is not None

    def make_if_decided(self, config: ScheduleConfig, world_size: int, device_type: str
                        ) -> None:
        """At setup: the mesh of a fixed schedule (or of ``"auto"``'s earlier pick); an
        undecided ``"auto"`` leaves it to :meth:`make_for`, at the first batch."""
        if config.decided:
            self._make(device_type, world_size, config.data_parallel_size)

    def make_for(self, world_size: int, data_parallel_size: int, device_type: str) -> None:
        """At the engine's build: the mesh of the plan it runs, unless made already."""
        if self._mesh is None:
            self._make(device_type, world_size, data_parallel_size)

    def _make(self, device_type: str, world_size: int, data_parallel_size: int) -> None:
        mesh = self._mesh
        same = (mesh is not None and mesh.device_type == device_type
                and tuple(mesh.shape) == (world_size // data_parallel_size, data_parallel_size))
        if not same:  # else a later run of the same strategy (fit, then test): same groups
            mesh = self._mesh = pipeline_data_mesh(device_type, world_size, data_parallel_size)
        if self._on_made is not None:
            self._on_made(mesh)  # type: ignore[arg-type]  # made above
