"""The built-in placements, registered by name: ``colocated`` and ``disaggregated``
(see :mod:`harness.train.placement.registry`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from harness.train.config import TopologyConfig
from harness.train.distributed import RankEnv
from harness.train.placement.registry import COLOCATED, DRAFTER, TARGET, Placement, PlacementKind, register_placement

if TYPE_CHECKING:  # the feature sources import the models: the ranks need them, the launcher does not
    from harness.train.placement.feature_source import LocalTarget, SourceInputs


@register_placement
class Colocated(PlacementKind):
    """Every rank runs the frozen target and the drafter; DDP on the drafter over the whole job."""

    name = "colocated"

    def place(self, topology: TopologyConfig, env: RankEnv) -> Placement:  # noqa: ARG002
        return Placement(COLOCATED, env, tuple(range(env.world_size)), (), kind=self.name)

    def feature_source(self, placement: Placement, inputs: SourceInputs) -> LocalTarget:  # noqa: ARG002
        from harness.train.placement.feature_source import CachedFeatures, LocalTarget

        return (CachedFeatures if inputs.trainer.target_features == "cached" else LocalTarget)(inputs)


@register_placement
class Disaggregated(PlacementKind):
    """``topology.target_ranks`` ranks run the target and send features to ``topology.drafter_ranks`` drafter ranks."""

    name = "disaggregated"

    def place(self, topology: TopologyConfig, env: RankEnv) -> Placement:
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
        return Placement(role, env, drafters, targets, group if role == DRAFTER else None, kind=self.name)

    def feature_source(self, placement: Placement, inputs: SourceInputs) -> Any:
        from harness.train.placement.drafter_link import DrafterLink

        return DrafterLink(placement, inputs.topology, inputs)

    def worker(self, config: Any, placement: Placement, run_dir: str) -> Any:
        """A target rank (``config``: the rank's :class:`~harness.train.loop.build.RankConfig`): the frozen target,
        feeding the drafter ranks."""
        from harness.train.placement.target_producer import TargetProducer
        from harness.train.rank_models import build_target, precision_dtype, rank_device

        device = rank_device(config.trainer, placement.env)
        models = config.models
        target = build_target(models.target, models.drafter, precision_dtype(models.precision), device)
        return TargetProducer(config.topology, config.data.data, config.trainer.gdn_backend, placement, run_dir,
                              target, device)
