"""The run config cut into each component's own config: with the launcher, the only code that reads it whole.

Below the launch every component is given its section (lingua's rule): the data by epoch its
:class:`~harness.train.loop.epoch_data.EpochDataConfig`, the models their
:class:`~harness.train.rank_models.ModelsConfig`, and so on; a rank gets them together as a
:class:`~harness.train.loop.build.RankConfig`. ``tests/harness/train/test_compose.py`` keeps it so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.train.config import RunConfig
from harness.train.feature_cache import FeaturesConfig
from harness.train.loop.epoch_data import EpochDataConfig
from harness.train.rank_models import ModelsConfig, TargetSpec

if TYPE_CHECKING:  # the loop's modules load on the ranks (imported below when composed): the launcher starts faster
    from harness.train.loop.build import RankConfig
    from harness.train.loop.trainer import LoopConfig


def target_spec(run: RunConfig) -> TargetSpec:
    """The frozen target: ``target`` with ``data`` (an embedded target's rows) and its attention kernels."""
    return TargetSpec(pretrained=run.target.pretrained, kwargs=run.target_kwargs, data=run.data,
                      attention_backend=run.trainer.target_attention_backend)


def models_config(run: RunConfig) -> ModelsConfig:
    """The target, the drafter, the seed that initialises it and their precisions."""
    return ModelsConfig(target=target_spec(run), drafter=run.drafter_config, seed=run.seed,
                        precision=run.trainer.precision, drafter_precision=run.trainer.drafter_precision)


def features_config(run: RunConfig) -> FeaturesConfig:
    """What the cached target features depend on, and the cache they live in."""
    return FeaturesConfig(target=target_spec(run), target_layer_ids=run.drafter.target_layer_ids,
                          num_hidden_layers=run.drafter.num_hidden_layers, precision=run.trainer.precision,
                          max_tokens=run.trainer.max_tokens, cache_dir=run.data.resolved_cache_dir())


def epoch_data_config(run: RunConfig) -> EpochDataConfig:
    """The samples, their checks, the strategy and the step's shape."""
    return EpochDataConfig(data=run.data, target=target_spec(run), drafter=run.drafter_config, trainer=run.trainer,
                           strategy=run.strategy_name, strategy_options=run.strategy_options, balance=run.balance,
                           seed=run.seed, eval_split=run.eval.split)


def loop_config(run: RunConfig) -> LoopConfig:
    """The training loop's names, clipping and cadences."""
    from harness.train.loop.trainer import LoopConfig

    return LoopConfig(name=run.name, group=run.group, strategy=run.strategy_name, seed=run.seed,
                      grad_clip=run.optim.grad_clip, eval=run.eval, checkpoint=run.checkpoint, trainer=run.trainer,
                      target=run.target.pretrained)


def rank_config(run: RunConfig) -> RankConfig:
    """Every component's config of a rank."""
    from harness.train.loop.build import RankConfig

    return RankConfig(data=epoch_data_config(run), models=models_config(run), loop=loop_config(run),
                      features=features_config(run), optim=run.optim, grad_stats=run.grad_stats, trainer=run.trainer,
                      loader=run.loader, logger=run.logger, topology=run.topology)
