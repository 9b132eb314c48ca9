"""Placements of the target and the drafter over the job's ranks (the ``topology`` config group).

``colocated`` (the default): every rank runs the frozen target and the drafter; DDP on the drafter over
the whole job. ``disaggregated``: the job's ``drafter_ranks + target_ranks`` ranks split in two roles:

* global ranks ``0 .. drafter_ranks - 1`` are **drafter ranks**: each runs a :class:`~harness.train.trainer.Trainer`
  whose features come from the target ranks (:class:`~harness.train.feature_link.DrafterLink`). They form
  their own process group (``dist.new_group``): DDP, the Σw all-reduce, the metric gathers, eval and
  checkpoints run over it only, and the plan is made for ``world_size = drafter_ranks``. Global rank 0
  is drafter rank 0, the one that writes files. Eval runs there too, on a local copy of the target.
* global ranks ``drafter_ranks .. drafter_ranks + target_ranks - 1`` are **target ranks**: each runs
  :class:`~harness.train.feature_link.TargetProducer` (take a micro-batch, collate, target forward,
  send) and no collective at all, so nothing the drafters do can deadlock them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

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

    @property
    def disaggregated(self) -> bool:
        return self.role != COLOCATED

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


def place(topology: TopologyConfig, env: RankEnv) -> Placement:
    """This rank's placement; the drafter group is created here (every rank of the job must call it)."""
    if not topology.disaggregated:
        return Placement(COLOCATED, env, tuple(range(env.world_size)), ())
    if env.world_size != topology.world_size:
        raise ValueError(
            f"topology=disaggregated needs topology.target_ranks + topology.drafter_ranks = "
            f"{topology.target_ranks} + {topology.drafter_ranks} = {topology.world_size} ranks, but the job "
            f"has {env.world_size}; set trainer.nproc={topology.world_size} (or launch that many ranks)"
        )
    drafters = tuple(range(topology.drafter_ranks))
    targets = tuple(range(topology.drafter_ranks, topology.world_size))
    group = None
    if len(drafters) > 1:
        group = dist.new_group(ranks=list(drafters))  # collective over the whole job: every rank calls it
    role = DRAFTER if env.rank in drafters else TARGET
    return Placement(role, env, drafters, targets, group if role == DRAFTER else None)
