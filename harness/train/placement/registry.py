"""Placements of the target and the drafter over the job's ranks (the ``topology`` config group), by name.

A placement is one :class:`PlacementKind` subclass registered with :func:`register_placement` (plus its
``conf/topology/<name>.yaml``): it says which role every rank of the job has (:meth:`PlacementKind.place`),
where a training rank's features come from (:meth:`PlacementKind.feature_source`, a
:class:`~harness.train.placement.feature_source.FeatureSource`), and what a rank that does not train runs
(:meth:`PlacementKind.worker`). The trainer sees only the feature source. The built-in placements are
registered in :mod:`harness.train.placement.builtin` (imported by the package's ``__init__``):

``colocated`` (the default): every rank runs the frozen target and the drafter; DDP on the drafter over
the whole job. ``disaggregated``: the job's ``drafter_ranks + target_ranks`` ranks split in two roles:

* global ranks ``0 .. drafter_ranks - 1`` are **drafter ranks**: each runs a
  :class:`~harness.train.loop.trainer.Trainer` whose features come from the target ranks (:class:`~harness.train.placement.drafter_link.DrafterLink`). They form
  their own process group (``dist.new_group``): DDP, the Σw all-reduce, the metric gathers, eval and
  checkpoints run over it only, and the plan is made for ``world_size = drafter_ranks``. Global rank 0
  is drafter rank 0, the one that writes files. Eval runs there too, on a local copy of the target.
* global ranks ``drafter_ranks .. drafter_ranks + target_ranks - 1`` are **target ranks**: each runs
  :class:`~harness.train.placement.target_producer.TargetProducer` (take a micro-batch, collate, target forward,
  send) and no collective at all, so nothing the drafters do can deadlock them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from harness.train.config import TopologyConfig
from harness.train.distributed import RankEnv

COLOCATED, TARGET, DRAFTER = "colocated", "target", "drafter"


@dataclass(frozen=True)
class Placement:
    """This rank's role and where everybody else is (global ranks)."""

    role: str
    env: RankEnv  # this rank in the whole job
    drafter_ranks: tuple[int, ...]
    target_ranks: tuple[int, ...]
    group: Any = None  # the drafter ranks' process group (None: the whole job, or a single drafter rank)
    kind: str = COLOCATED  # the registered placement (``topology.name``)

    @property
    def disaggregated(self) -> bool:
        return self.role != COLOCATED

    @property
    def trains(self) -> bool:
        """Does this rank train the drafter (run a Trainer)?"""
        return self.role in (COLOCATED, DRAFTER)

    @property
    def trainer_env(self) -> RankEnv:
        """The env a drafter rank's Trainer sees: its place among the drafter ranks (colocated: the job's)."""
        if not self.disaggregated:
            return self.env
        if self.role != DRAFTER:
            raise ValueError(f"rank {self.env.rank} is a {self.role} rank; only drafter ranks run a Trainer")
        return RankEnv(self.drafter_ranks.index(self.env.rank), len(self.drafter_ranks), self.env.local_rank)

    @property
    def index(self) -> int:
        """This rank's index among the ranks of its role."""
        ranks = self.target_ranks if self.role == TARGET else self.drafter_ranks
        return ranks.index(self.env.rank) if self.disaggregated else self.env.rank

    def describe(self, rank: int) -> str:
        """``target rank 1 (global rank 2)``: how error messages name a rank of this job."""
        if rank in self.target_ranks:
            return f"target rank {self.target_ranks.index(rank)} (global rank {rank})"
        if rank in self.drafter_ranks and self.disaggregated:
            return f"drafter rank {self.drafter_ranks.index(rank)} (global rank {rank})"
        return f"rank {rank}"


class RankWorker(Protocol):
    """What a rank that does not train runs (:meth:`PlacementKind.worker`)."""

    signalled: bool  # stopped by a signal (the training ranks end the job; not a failure of this rank)

    def run(self) -> dict[str, Any]: ...


class PlacementKind:
    """A way to place the target and the drafter over a job's ranks; registered under :attr:`name`."""

    name: ClassVar[str] = ""

    def place(self, topology: TopologyConfig, env: RankEnv) -> Placement:
        """This rank's placement (every rank of the job calls it: it may create process groups)."""
        raise NotImplementedError

    def feature_source(self, placement: Placement, inputs: Any) -> Any:
        """The :class:`~harness.train.placement.feature_source.FeatureSource` of a training rank (``inputs``: its
        :class:`~harness.train.placement.feature_source.SourceInputs`)."""
        raise NotImplementedError

    def worker(self, config: Any, placement: Placement, run_dir: str) -> RankWorker:
        """What a rank that does not train runs (its ``run()`` returns the rank's summary); ``config``: the rank's
        :class:`~harness.train.loop.build.RankConfig`, each component's section of the run config."""
        raise ValueError(f"topology={self.name} has no rank of role {placement.role!r}")


_PLACEMENTS: dict[str, type[PlacementKind]] = {}


def register_placement(cls: type[PlacementKind]) -> type[PlacementKind]:
    """Register a :class:`PlacementKind` subclass under its ``name`` (a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, PlacementKind)) or not cls.name:
        raise ValueError(f"{cls!r} must be a PlacementKind subclass with a non-empty `name`")
    if _PLACEMENTS.get(cls.name, cls) is not cls:
        raise ValueError(f"a placement named {cls.name!r} is already registered")
    _PLACEMENTS[cls.name] = cls
    return cls


def placement_names() -> list[str]:
    """The registered placements (``topology.name`` values), sorted; the built-ins are registered by
    :mod:`harness.train.placement`'s own ``__init__``."""
    return sorted(_PLACEMENTS)


def placement_kind(name: str) -> PlacementKind:
    """The registered placement ``name``; an unknown name fails naming the registered ones (and the nearest)."""
    if name not in _PLACEMENTS:
        import difflib

        near = difflib.get_close_matches(name, placement_names(), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"topology.name={name!r} is not one of {placement_names()}{hint}")
    return _PLACEMENTS[name]()


def place(topology: TopologyConfig, env: RankEnv) -> Placement:
    """This rank's placement under ``topology`` (every rank of the job must call it)."""
    return placement_kind(topology.name).place(topology, env)
