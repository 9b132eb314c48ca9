"""Build a training rank's :class:`~harness.train.loop.trainer.Trainer` from its components' configs, in order.

Data → models → gradient statistics → optimizer → checkpointed state (restored when the run directory holds
a checkpoint, re-planning the rest of its epoch on another world size) → feature source → evaluator →
logger (last, so that a failure while building never leaves a W&B run open).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.train.batch import BatchCollator
from harness.train.config import (
    GradStatsConfig,
    LoaderConfig,
    LoggerConfig,
    OptimConfig,
    TopologyConfig,
    TrainerConfig,
)
from harness.train.distributed import Collectives
from harness.train.feature_cache import FeaturesConfig
from harness.train.loop.checkpoint import CheckpointManager, RngState, TorchState
from harness.train.loop.consumed import ConsumedSamples
from harness.train.loop.epoch_data import EpochData, EpochDataConfig
from harness.train.loop.evaluator import Evaluator
from harness.train.loop.grad_stats import GradientStatistics, summing_comm_hook
from harness.train.loop.loss_normaliser import LossNormaliser
from harness.train.loop.lr_schedule import TokenCosineSchedule
from harness.train.loop.metrics import build_logger
from harness.train.loop.train_state import TrainState
from harness.train.loop.trainer import LoopConfig, Trainer
from harness.train.placement.feature_source import SourceInputs
from harness.train.placement.registry import COLOCATED, Placement, placement_kind
from harness.train.rank_models import DrafterModel, ModelsConfig, TargetSpec, rank_device
from harness.train.status import RankStatus


#: the draft vocabulary's mapping (EAGLE-3's and SpecForge's d2t and t2d), beside the run's checkpoints
DRAFT_VOCAB_FILE = "draft_vocab.pt"


@dataclass(frozen=True)
class RankConfig:
    """A rank's components' configs: each its own section of the run config (composed by
    :func:`harness.train.launch.compose.rank_config`)."""

    data: EpochDataConfig
    """The data by epoch."""
    models: ModelsConfig
    """The target and the drafter."""
    loop: LoopConfig
    """The training loop's own settings."""
    features: FeaturesConfig
    """The cache of the target's features (``trainer.target_features`` or ``eval.target_features=cached``)."""
    optim: OptimConfig
    """The optimizer, its schedule and the loss normaliser."""
    grad_stats: GradStatsConfig
    """Gradient diversity and noise scale."""
    trainer: TrainerConfig
    """The rank's device, threads, resume and the feature source's settings."""
    loader: LoaderConfig
    """A training rank's DataLoader."""
    logger: LoggerConfig
    """Where metrics go besides the run's files."""
    topology: TopologyConfig
    """Where the target and the drafter run."""


def build_trainer(config: RankConfig, run_dir: str | Path, placement: Placement,
                  config_dict: dict[str, Any] | None = None) -> Trainer:
    """The Trainer of a training rank (``placement.trains``); ``config_dict``: the resolved run config as given (W&B
    config, checkpoints)."""
    run_dir, config_dict = Path(run_dir), config_dict or {}
    env = placement.trainer_env  # this rank among the ranks that train the drafter
    comm = Collectives(env, placement.group)
    trainer, loop, drafter_config = config.trainer, config.loop, config.models.drafter
    device = rank_device(trainer, placement.env)  # the whole job shares the cores, not only the drafter ranks
    # where this rank is (run_dir/status/): the launcher names the stage and step of a rank that died
    status = RankStatus(run_dir, env.rank, role="train" if placement.role == COLOCATED else placement.role)
    status.stage("setup", 0)
    data = EpochData(config.data, comm, progress=env.is_main and trainer.progress)
    model = DrafterModel(config.models, device, data.samples.samples(data.train_rows)
                         if drafter_config.draft_vocab_size is not None else None)
    draft_vocab = model.drafter.draft_vocab
    if draft_vocab is not None and env.is_main:  # the mapping an inference engine needs beside the drafter
        torch.save({"d2t": draft_vocab.d2t, "t2d": draft_vocab.t2d}, run_dir / DRAFT_VOCAB_FILE)
    grads = GradientStatistics(model.parameters, comm, config.grad_stats.every, config.grad_stats.ema)
    model.distribute(comm, grads.bucket_norms, summing_comm_hook)
    optim = config.optim
    optimizer = torch.optim.AdamW(model.parameters, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                                  weight_decay=optim.weight_decay)
    schedule = TokenCosineSchedule(optimizer, optim.lr, data.total_tokens, optim.warmup_fraction, optim.min_lr_ratio)
    state = TrainState()
    consumed = ConsumedSamples(len(data.samples), comm)
    checkpoints = CheckpointManager(
        run_dir, {"progress": state, "drafter": TorchState(model.drafter), "optimizer": TorchState(optimizer),
                  "grad_stats": grads, "consumed": consumed, "data": data, "rng": RngState()},
        fingerprint=data.fingerprint, config=config_dict, keep=loop.checkpoint.keep, is_main=env.is_main,
        barrier=comm.barrier, status=status)
    resumed = resume(checkpoints, data, state, consumed, env) if trainer.resume else False
    drafter = model.drafter
    collate = dict(block_size=drafter.block_size, num_anchors=drafter_config.num_anchors,
                   mask_token_id=drafter.mask_token_id, loss_decay_gamma=drafter.loss_decay_gamma,
                   max_blocks=drafter_config.max_blocks)
    train_collate = BatchCollator(data.samples, data.strategy.layout, anchor_seed=loop.seed, **collate)
    eval_collate = BatchCollator(data.samples, "padded", anchor_seed=config.data.data.heldout_seed, **collate)
    source = placement_kind(placement.kind).feature_source(placement, SourceInputs(
        trainer=trainer, loader=config.loader, topology=config.topology, features=config.features, env=env,
        status=status, device=device, target=model.target, tap_layer_ids=list(drafter.target_layer_ids),
        hidden_size=drafter.hidden_size, rows=data.train_rows, collate=train_collate, plan_epoch=data.plan_epoch,
        first_epoch=state.epoch, run_dir=run_dir))
    evaluator = Evaluator(data=data, collate=eval_collate, model=model, comm=comm, status=status,
                          eval_config=loop.eval, gdn_backend=trainer.gdn_backend, device=device,
                          progress=trainer.progress, run_dir=run_dir,
                          resumed_step=state.global_step if resumed else None,
                          replay_cache=replay_cache(config.features, device) if loop.eval.real_replay else None,
                          feature_store=eval_feature_store(config.features, data, model)
                          if loop.eval.target_features == "cached" else None)
    logger = build_logger(config.logger, run_dir, env.is_main, state.global_step if resumed else None, config_dict,
                          group=loop.group, name=loop.name, job_type=loop.strategy)
    return Trainer(config=loop, run_dir=run_dir, comm=comm, status=status, data=data, model=model,
                   optimizer=optimizer, schedule=schedule, source=source, grads=grads, evaluator=evaluator,
                   consumed=consumed, checkpoints=checkpoints, logger=logger, state=state,
                   normaliser=LossNormaliser(optim.loss_normaliser, data, train_collate))


def eval_feature_store(features: FeaturesConfig, data: EpochData, model: DrafterModel) -> Any:
    """``eval.target_features=cached``: the evaluated rows' target features, built before the ranks started
    (:func:`harness.train.launch.run.run`), read from the cache."""
    from harness.train.feature_cache import feature_store

    return feature_store(features, data.samples, data.eval_rows, lambda: model.target,
                         list(model.drafter.target_layer_ids))


def replay_cache(features: FeaturesConfig, device: torch.device) -> tuple[Path, dict[str, Any]]:
    """Where every run of a sweep finds the target's side of τ real's replay, and what it depends on besides the
    prompts (the target, its precision and kernels, the device kind and torch's version)."""
    from harness.train.feature_cache import target_identity

    target: TargetSpec = features.target
    return features.cache_dir, {
        "target": target_identity(target), "precision": features.precision, "device": device.type,
        "attention": target.attention_backend, "torch": torch.__version__}


def resume(checkpoints: CheckpointManager, data: EpochData, state: TrainState, consumed: ConsumedSamples,
           env: Any) -> bool:
    """Restore the run directory's latest checkpoint, if any (True then). A checkpoint of another world size or
    accumulation (elastic resume) continues its epoch with the samples it had not consumed, planned for this
    shape; the consumed counts are carried over, so the epoch's exactly-once check still covers all of it."""
    restored = checkpoints.restore()
    if restored is None:
        return False
    if restored.layout_changed:
        stopped_at = state.step_in_epoch
        plan, left = data.replan_rest(state.epoch, consumed.resumed_total, restored.path)
        state.step_in_epoch = 0
        old, grad_accum = restored.fingerprint, data.config.trainer.grad_accum
        if env.is_main:
            shape = "" if old.get("grad_accum") == grad_accum else f" (grad_accum {old.get('grad_accum')} -> {grad_accum})"
            print(
                f"batchlab-train: resumed a {old.get('world_size')}-rank checkpoint on {env.world_size} "
                f"rank{'s' if env.world_size != 1 else ''}{shape} at epoch {state.epoch}, step {stopped_at}: "
                f"{left} samples left in the epoch, re-planned ({plan.num_steps} steps)",
                flush=True,
            )
    return True
