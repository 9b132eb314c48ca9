"""The training loop: the DFlash drafter on a frozen target's features, batched by one strategy.

Per optimizer step, on every rank, for each of its ``grad_accum`` micro-batches of the epoch's plan:
target forward (no grad) → drafter forward and backward of ``Σ(w·CE) / W``, where ``W`` = Σw over the
*whole global step* (every rank, every micro-batch), all-reduced from the collated Σw **before** the
first backward. DDP syncs only on the last micro-batch (``no_sync`` before) and sums gradients (its
division by world size is undone by :func:`~harness.train.grad_stats.summing_comm_hook`), so the
gradient is exactly that of the global objective whatever the grouping. Then clip on the global norm,
AdamW, and a cosine schedule in tokens seen.

Named steps, in torchtitan's manner: :meth:`Trainer.batch_generator`, :meth:`Trainer.forward_backward_step`,
:meth:`Trainer.train_step`, :meth:`Trainer.evaluate`, :meth:`Trainer.train`. Rank-0-only work (files,
W&B, the progress bar) goes through ``self.logger`` and ``self.env.is_main`` only.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import random
import resource
import secrets
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from harness.data.samples import TokenizedSamples, heldout_split, load_samples, validate_samples
from harness.models.drafter import DFlashDrafter
from harness.models.drafter_loss import DrafterLoss
from harness.models.target import HybridTarget
from harness.train import checkpoint as ckpt
from harness.train.batch import BatchCollator, RankMicroBatches, TrainingBatch, micro_batch_loader
from harness.train.config import RunConfig
from harness.train.distributed import Collectives, RankEnv
from harness.train.grad_stats import BucketNorms, GradientNoise, flat_grad, summing_comm_hook
from harness.train.metrics import JsonlSink, MetricLogger, WandbSink, truncate_metrics
from harness.train.schedule import TokenCosineSchedule
from harness.train.status import RankStatus
from strategies import Budget, CostModel, Plan, build_strategy, plan_remainder
from strategies.metrics import plan_metrics

#: seed of the random-weight target: the same target for every strategy and seed of a sweep
TARGET_INIT_SEED = 0
WANDB_ID_FILE = "wandb_run_id"


#: ``target.pretrained: embedded``: the tiny target pretrained on this run's data (built once, cached)
EMBEDDED_TARGET = "embedded"


def pretrained_target_path(config: RunConfig, progress: bool = False) -> str:
    """The checkpoint directory ``target.pretrained`` names; ``embedded`` builds or finds the cached one."""
    if config.target.pretrained == EMBEDDED_TARGET:
        from harness.pretrain.target import ensure_pretrained_target

        return str(ensure_pretrained_target(config.data, config.target_kwargs, progress=progress))
    return str(config.target.pretrained)


def build_target(config: RunConfig, dtype: torch.dtype, device: torch.device) -> HybridTarget:
    """The run's frozen target (fixed init seed for a random-weight one): the same on every rank and strategy."""
    drafter_cfg = config.drafter_config
    torch.manual_seed(TARGET_INIT_SEED)
    if config.target.pretrained:
        return HybridTarget.from_pretrained(
            pretrained_target_path(config), dtype=dtype, device=device, tap_layer_ids=drafter_cfg.target_layer_ids,
            num_draft_layers=drafter_cfg.num_hidden_layers, attention_backend=config.trainer.target_attention_backend)
    return HybridTarget(config.target_kwargs, tap_layer_ids=drafter_cfg.target_layer_ids,
                        num_draft_layers=drafter_cfg.num_hidden_layers, dtype=dtype,
                        attention_backend=config.trainer.target_attention_backend).to(device)


class NonFiniteLoss(RuntimeError):
    """A step's loss or gradient norm is not finite; the last good checkpoint is kept."""


class DrafterObjective(torch.nn.Module):
    """The drafter's loss sums for one micro-batch (the module DDP wraps)."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, batch: TrainingBatch, features: Any) -> DrafterLoss:
        if batch.empty:
            return self.drafter.empty_loss(self.drafter.fc.weight.device)
        hidden = self.drafter.forward_prepared(batch.drafter, features)
        return self.drafter.prepared_loss(batch.drafter, hidden)


@dataclass
class TrainState:
    """Counters that a checkpoint restores (everything else is rebuilt from the config)."""

    epoch: int = 0
    step_in_epoch: int = 0  # the next step of the epoch's plan to run
    global_step: int = 0  # optimizer steps done
    tokens_seen: int = 0
    samples_seen: int = 0
    computed_slots: int = 0
    next_eval_tokens: int = 0
    train_time_s: float = 0.0
    last_grad_diversity: float = math.nan
    last_grad_noise_scale: float = math.nan
    epochs_exactly_once: list[bool] = field(default_factory=list)
    last_eval: dict[str, Any] = field(default_factory=dict)
    # elastic resume: the training-sample (plan) indices the current epoch had consumed when a resume on
    # another world size / grad_accum re-planned its rest; None while the epoch runs its whole plan
    replanned_from: np.ndarray | None = None


# the per-rank scalars gathered every step (then the per-position accuracy sums)
_GATHERED = ("real_tokens", "computed_slots", "samples", "length_sum", "length_sq_sum", "weighted_ce_sum",
             "weight_sum", "correct_sum", "label_count", "tau_sum", "block_count", "blocks_computed",
             "blocks_capped", "step_time", "data_wait", "target_time", "drafter_time", "stop_requested",
             "peak_memory_mb", "nonfinite")


class Trainer:
    def __init__(self, config: RunConfig, run_dir: str | Path, env: RankEnv,
                 config_dict: dict[str, Any] | None = None, group: Any = None, role: str = "train") -> None:
        """``env``/``group``: this rank among the ranks that train the drafter (a disaggregated run's drafter
        ranks, see :mod:`harness.train.topology`; None: the whole job); ``role``: what its status file calls it."""
        self.config = config
        self.config_dict = config_dict or {}  # the resolved config as given (W&B config, checkpoints)
        self.run_dir = Path(run_dir)
        self.env = env
        self.group = group
        self.comm = Collectives(env, group)
        # topology=disaggregated: the micro-batches and their features come from the target ranks
        # (harness.train.feature_link.DrafterLink, attached by run_rank); None: this rank runs the target
        self.feature_link: Any = None
        trainer = config.trainer
        self.device = torch.device(f"cuda:{env.local_rank}" if trainer.device == "cuda" else "cpu")
        torch.set_num_threads(trainer.threads_per_rank or max(1, (os.cpu_count() or 1) // env.world_size))
        self.dtype = torch.bfloat16 if trainer.precision == "bf16" else torch.float32
        self.state = TrainState()
        self.stop_requested = False
        # where this rank is (run_dir/status/): the launcher names the stage and step of a rank that died
        self.status = RankStatus(self.run_dir, env.rank, role="train" if role == "colocated" else role)
        self._test_failure = _test_failure(env.rank)
        self._stage("setup", 0)
        self._consumed_log_checked = False
        self._last_plan: Plan | None = None
        self._build_data()
        self._build_models()
        self._build_optimizer()
        resumed_from = self._maybe_resume()
        self._build_logger(resumed=resumed_from is not None)

    # ------------------------------------------------------------------ setup
    def _build_data(self) -> None:
        cfg = self.config
        if not self.env.is_main:  # rank 0 builds any cache first; the others read it
            self.comm.barrier()
        self.samples: TokenizedSamples = load_samples(cfg.data, progress=self.env.is_main and cfg.trainer.progress)
        if self.env.is_main:
            self.comm.barrier()
        drafter_cfg = cfg.drafter_config
        vocab_size = int(cfg.target_kwargs.get("vocab_size") or 0)
        train_rows, heldout_rows = heldout_split(len(self.samples), cfg.data)
        check = dict(vocab_size=vocab_size, block_size=drafter_cfg.block_size, no_anchor=cfg.data.no_anchor)
        self.train_report = validate_samples(self.samples, train_rows, **check)
        self.heldout_report = validate_samples(self.samples, heldout_rows, **check)
        self.budget = Budget(cfg.trainer.max_tokens, cfg.trainer.max_samples)
        # The oversize policy is applied once here, not by every epoch's plan: "drop" leaves the samples
        # out (counted), "truncate" shortens them to the budget, "error" names the first one.
        self.train_rows, self.oversize_dropped, self.oversize_truncated = self._apply_oversize(self.train_report.kept)
        self.heldout_rows, _, _ = self._apply_oversize(self.heldout_report.kept)
        if self.train_rows.size == 0:
            raise ValueError(
                f"no training sample is left after validation (dropped: {self.train_report.summary()}, "
                f"{self.oversize_dropped} over trainer.max_tokens={self.budget.max_tokens}); raise max_tokens or "
                "check the data source"
            )
        self.train_lengths = np.minimum(self.samples.lengths[self.train_rows], self.budget.max_tokens)
        self.strategy = build_strategy(cfg.strategy_name, **cfg.strategy_options)
        self.fingerprint = ckpt.plan_fingerprint(
            lengths_sha256=ckpt.lengths_hash(self.train_lengths, self.train_rows),
            data_fingerprint=self.samples.fingerprint, max_tokens=self.budget.max_tokens,
            max_samples=self.budget.max_samples, strategy=cfg.strategy_name, strategy_options=cfg.strategy_options,
            balance=cfg.balance, oversize=cfg.trainer.oversize, world_size=self.env.world_size,
            grad_accum=cfg.trainer.grad_accum, seed=cfg.seed, block_size=drafter_cfg.block_size,
            num_anchors=drafter_cfg.num_anchors, max_blocks=drafter_cfg.max_blocks,
        )
        self.epoch_tokens = int(self.train_lengths.sum())
        stop = cfg.trainer
        self.total_tokens = (stop.stop_tokens if stop.stop_tokens is not None
                             else int(math.ceil(stop.stop_epochs * self.epoch_tokens)))
        # the held-out set: one fixed padded plan, fixed anchors, the same for every strategy and seed
        heldout_lengths = np.minimum(self.samples.lengths[self.heldout_rows], self.budget.max_tokens)
        self.eval_plan = None
        if self.heldout_rows.size:
            self.eval_plan = build_strategy("sorted").plan(
                heldout_lengths, self.budget, seed=cfg.data.heldout_seed, epoch=0, world_size=self.env.world_size,
                grad_accum=1,
            )

    def _apply_oversize(self, rows: np.ndarray) -> tuple[np.ndarray, int, int]:
        """(rows kept, how many dropped, how many truncated) under ``trainer.oversize``."""
        over = self.samples.lengths[rows] > self.budget.max_tokens
        policy = self.config.trainer.oversize
        if not over.any():
            return rows, 0, 0
        if policy == "error":
            first = int(rows[over][0])
            raise ValueError(
                f"sample {first} has {int(self.samples.lengths[first])} tokens, more than trainer.max_tokens="
                f"{self.budget.max_tokens} ({int(over.sum())} such samples); raise trainer.max_tokens or set "
                "trainer.oversize=drop (leave them out, counted) or trainer.oversize=truncate"
            )
        if policy == "drop":
            return rows[~over], int(over.sum()), 0
        return rows, 0, int(over.sum())

    def _build_models(self) -> None:
        cfg = self.config
        drafter_cfg = cfg.drafter_config
        # disaggregated: the drafter ranks keep a local copy of the target for eval only
        self.target = build_target(cfg, self.dtype, self.device)
        torch.manual_seed(cfg.seed)
        # fp32 master weights whatever the target's dtype; bf16 runs use autocast
        self.drafter = DFlashDrafter(drafter_cfg, self.target.embed_tokens, self.target.lm_head,
                                     self.target.num_layers).to(device=self.device, dtype=torch.float32)
        self.objective: torch.nn.Module = DrafterObjective(self.drafter)
        self.bucket_norms = BucketNorms(group=self.group)
        if self.env.distributed:
            # the drafter's only buffers are its fixed rotary frequencies: nothing to sync per forward
            buffers = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(
                DistributedDataParallel.__init__).parameters else {"broadcast_buffers": False})
            self.objective = DistributedDataParallel(
                self.objective, device_ids=[self.env.local_rank] if self.device.type == "cuda" else None,
                process_group=self.group, **buffers)
            self.objective.register_comm_hook(self.bucket_norms, summing_comm_hook)
        self.parameters = [p for p in self.drafter.parameters() if p.requires_grad]
        collate = dict(block_size=drafter_cfg.block_size, num_anchors=drafter_cfg.num_anchors,
                       mask_token_id=self.drafter.mask_token_id, loss_decay_gamma=self.drafter.loss_decay_gamma,
                       max_blocks=drafter_cfg.max_blocks)
        self.train_collate = BatchCollator(self.samples, self.strategy.layout, anchor_seed=cfg.seed, **collate)
        self.eval_collate = BatchCollator(self.samples, "padded", anchor_seed=cfg.data.heldout_seed, **collate)
        self.noise = GradientNoise(cfg.trainer.grad_stats_ema)

    def _build_optimizer(self) -> None:
        optim = self.config.optim
        self.optimizer = torch.optim.AdamW(self.parameters, lr=optim.lr, betas=(optim.beta1, optim.beta2),
                                           eps=optim.eps, weight_decay=optim.weight_decay)
        self.schedule = TokenCosineSchedule(self.optimizer, optim.lr, self.total_tokens, optim.warmup_fraction,
                                            optim.min_lr_ratio)

    def _build_logger(self, resumed: bool) -> None:
        cfg = self.config
        self.logger = MetricLogger()
        self.consumed_file = None
        if not self.env.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        sinks: list[Any] = [JsonlSink(self.run_dir, resume_after_step=self.state.global_step if resumed else None)]
        if cfg.logger.wandb and cfg.logger.mode != "disabled":
            id_file = self.run_dir / WANDB_ID_FILE  # the same W&B run when this directory is resumed
            if not id_file.exists():
                id_file.write_text(secrets.token_hex(4))
            try:
                sinks.append(WandbSink(
                    self.run_dir, project=cfg.logger.project, entity=cfg.logger.entity, group=cfg.group,
                    name=cfg.name, job_type=cfg.strategy_name, tags=cfg.logger.tags, config=self.config_dict,
                    mode=cfg.logger.mode, run_id=id_file.read_text().strip(), resume=resumed))
            except Exception as error:  # noqa: BLE001 - W&B must never stop a run
                import warnings

                warnings.warn(f"W&B could not start ({type(error).__name__}: {error}); logging to metrics.jsonl only",
                              stacklevel=2)
        self.logger = MetricLogger(sinks)

    # ------------------------------------------------------------------ plans and batches
    def plan_epoch(self, epoch: int) -> Plan:
        """The plan of ``epoch`` (the last one made is kept: each epoch's metrics plan the next one first).

        After an elastic resume the current epoch's plan is the rest of the epoch, re-planned for this
        world size from the samples it had consumed (``TrainState.replanned_from``).
        """
        if self._last_plan is not None and self._last_plan.epoch == epoch:
            return self._last_plan
        cfg = self.config
        if epoch == self.state.epoch and self.state.replanned_from is not None:
            self._last_plan = plan_remainder(
                self.strategy, self.train_lengths, self.state.replanned_from, self.budget, seed=cfg.seed, epoch=epoch,
                world_size=self.env.world_size, grad_accum=cfg.trainer.grad_accum, balance=cfg.balance)
            return self._last_plan
        self._last_plan = self.strategy.plan(self.train_lengths, self.budget, seed=cfg.seed, epoch=epoch,
                                             world_size=self.env.world_size, grad_accum=cfg.trainer.grad_accum,
                                             balance=cfg.balance)
        return self._last_plan

    def batch_generator(self, plan: Plan, start_step: int) -> Iterator[tuple[int, list[TrainingBatch], float]]:
        """This rank's ``(step, grad_accum micro-batches, data wait in seconds)`` from ``start_step`` on."""
        if self.feature_link is not None:
            yield from self.feature_link.batches(plan, start_step, self.state.global_step)
            return
        trainer = self.config.trainer
        dataset = RankMicroBatches(plan, self.env.rank, start_step, self.train_rows, self.train_collate)
        workers = trainer.num_workers if trainer.num_workers is not None else (4 if self.device.type == "cuda" else 0)
        loader = micro_batch_loader(dataset, workers, trainer.prefetch_factor, pin_memory=self.device.type == "cuda")
        iterator = iter(loader)
        try:
            for step in range(start_step, plan.num_steps):
                self._stage("data_wait", self.state.global_step + 1)
                started = time.perf_counter()
                batches = [next(iterator).to(self.device) for _ in range(plan.grad_accum)]
                yield step, batches, time.perf_counter() - started
        finally:
            # Shut the workers down now, through the loader's own protocol (they ignore SIGTERM, see
            # batch.py); leaving them to interpreter exit would block there.
            del iterator

    # ------------------------------------------------------------------ one step
    def _autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def forward_backward_step(self, batch: TrainingBatch, global_weight: float, sync: bool) -> tuple[DrafterLoss, float, float]:
        """Target forward, drafter forward + backward of ``Σ(w·CE) / W``; returns the sums and the two stage times."""
        started = time.perf_counter()
        step = self.state.global_step + 1
        features = batch.features  # received from a target rank (disaggregated), else computed here
        if features is None and not batch.empty:
            self._stage("target_forward", step)
            features = self.target(batch.tokens, gdn_backend=self.config.trainer.gdn_backend,
                                   tap_layer_ids=self.drafter.target_layer_ids)
        self._sync()
        target_done = time.perf_counter()
        no_sync = self.objective.no_sync() if (self.env.distributed and not sync) else contextlib.nullcontext()
        with no_sync:
            self._stage("drafter_forward", step)
            with self._autocast():
                sums = self.objective(batch, features)
            self._stage("drafter_backward", step)  # with DDP's gradient all-reduce on the last micro-batch
            (sums.weighted_ce_sum / global_weight).backward()
        self._sync()
        return sums.detach(), target_done - started, time.perf_counter() - target_done

    def train_step(self, batches: list[TrainingBatch], data_wait: float, measure_grads: bool) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches; returns the step's record (global metrics)."""
        started = time.perf_counter() - data_wait
        self._stage("weight_all_reduce", self.state.global_step + 1)
        local_weight = sum(b.weight_sum for b in batches)
        weight = float(self.comm.all_reduce_sum(torch.tensor([local_weight], dtype=torch.float64))[0])
        global_weight = weight if weight > 0 else 1.0
        measure_ranks = measure_grads and self.env.distributed
        measure_accum = measure_grads and not self.env.distributed and len(batches) > 1
        if measure_ranks:
            self.bucket_norms.start()
        small_sq = small_mean_sq = 0.0
        small_count = 0
        previous = flat_grad(self.parameters) if measure_accum else None
        total = None
        target_time = drafter_time = 0.0
        for k, batch in enumerate(batches):
            sums, t_target, t_drafter = self.forward_backward_step(batch, global_weight, sync=k == len(batches) - 1)
            target_time, drafter_time = target_time + t_target, drafter_time + t_drafter
            total = sums if total is None else total + sums
            if measure_accum:
                current = flat_grad(self.parameters)
                contribution = current - previous
                previous = current
                if batch.weight_sum > 0:
                    norm_sq = float(contribution.square().sum())
                    small_sq += norm_sq
                    small_mean_sq += norm_sq * (weight / batch.weight_sum) ** 2
                    small_count += 1
        grad_stats: dict[str, float] = {}
        self._stage("optimizer", self.state.global_step + 1)  # gradient statistics, clipping, metrics gather, step
        if measure_ranks:
            local_sq, big_sq = self.bucket_norms.stop()
            mean_sq = local_sq * (weight / local_weight) ** 2 if local_weight > 0 else 0.0
            reduced = self.comm.all_reduce_sum(torch.tensor([local_sq, mean_sq, float(local_weight > 0)],
                                                            dtype=torch.float64))
            grad_stats = self.noise.update(float(reduced[0]), float(reduced[1]), int(reduced[2]), big_sq, weight)
        elif measure_accum:
            big_sq = float(previous.square().sum())
            grad_stats = self.noise.update(small_sq, small_mean_sq, small_count, big_sq, weight)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(
            self.parameters, self.config.optim.grad_clip if self.config.optim.grad_clip > 0 else math.inf))

        lengths = torch.cat([b.lengths for b in batches]).double()
        local = {
            "real_tokens": float(lengths.sum()), "computed_slots": float(sum(b.computed_slots for b in batches)),
            "samples": float(lengths.numel()), "length_sum": float(lengths.sum()),
            "length_sq_sum": float(lengths.square().sum()), "weighted_ce_sum": float(total.weighted_ce_sum),
            "weight_sum": float(total.weight_sum), "correct_sum": float(total.correct_sum),
            "label_count": float(total.label_count), "tau_sum": float(total.tau_sum),
            "block_count": float(total.block_count), "blocks_computed": float(total.blocks_computed),
            "blocks_capped": float(sum(b.drafter.num_blocks_capped for b in batches if not b.empty)),
            "step_time": time.perf_counter() - started, "data_wait": data_wait, "target_time": target_time,
            "drafter_time": drafter_time, "stop_requested": float(self.stop_requested),
            "peak_memory_mb": _peak_memory_mb(self.device),
            "nonfinite": float(not math.isfinite(float(total.weighted_ce_sum))),
        }
        vector = torch.tensor([local[k] for k in _GATHERED] + total.correct_per_position.double().tolist()
                              + total.count_per_position.double().tolist(), dtype=torch.float64)
        gathered = self.comm.all_gather(vector)  # [world, n]: every rank sees every rank's numbers
        per_rank = {k: gathered[:, i] for i, k in enumerate(_GATHERED)}
        slots = self.drafter.block_size - 1
        correct_pos = gathered[:, len(_GATHERED):len(_GATHERED) + slots].sum(0)
        count_pos = gathered[:, len(_GATHERED) + slots:].sum(0)
        totals = {k: float(v.sum()) for k, v in per_rank.items()}
        loss = totals["weighted_ce_sum"] / totals["weight_sum"] if totals["weight_sum"] > 0 else math.nan
        if not (math.isfinite(grad_norm) and (math.isfinite(loss) or totals["weight_sum"] == 0)):
            self._raise_nonfinite(batches, loss, grad_norm, local["nonfinite"])
        lr = self.schedule.set(self.state.tokens_seen)
        optimizer_started = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        optimizer_time = time.perf_counter() - optimizer_started
        step_time = float(per_rank["step_time"].max()) + optimizer_time
        busy = per_rank["target_time"] + per_rank["drafter_time"]
        rank_losses = per_rank["weighted_ce_sum"] / per_rank["weight_sum"].clamp_min(1e-30)
        rank_losses = torch.where(per_rank["weight_sum"] > 0, rank_losses, torch.full_like(rank_losses, -math.inf))
        samples = totals["samples"]
        mean_length = totals["length_sum"] / samples if samples else math.nan
        record = {
            "loss": loss, "loss_max_rank": float(rank_losses.max()),
            "accuracy": totals["correct_sum"] / totals["label_count"] if totals["label_count"] else math.nan,
            "accuracy_per_position": (correct_pos / count_pos.clamp_min(1)).tolist(),
            "tau": totals["tau_sum"] / totals["block_count"] if totals["block_count"] else math.nan,
            "real_tokens": int(totals["real_tokens"]), "computed_slots": int(totals["computed_slots"]),
            "padding_ratio": 1.0 - totals["real_tokens"] / totals["computed_slots"] if totals["computed_slots"] else 0.0,
            "drafter_block_efficiency": (totals["block_count"] / totals["blocks_computed"]
                                         if totals["blocks_computed"] else math.nan),
            "blocks": int(totals["block_count"]), "blocks_capped": int(totals["blocks_capped"]),
            "tokens_per_second": totals["real_tokens"] / step_time if step_time > 0 else math.nan,
            "rank_tokens_per_second": (per_rank["real_tokens"] / busy.clamp_min(1e-9)).tolist(),
            "step_time": step_time, "time_data": float(per_rank["data_wait"].mean()),
            "time_target": float(per_rank["target_time"].mean()), "time_drafter": float(per_rank["drafter_time"].mean()),
            "time_optimizer_comm": max(step_time - float((per_rank["data_wait"] + busy).mean()), 0.0),
            "data_wait_fraction": float(per_rank["data_wait"].mean()) / step_time if step_time > 0 else math.nan,
            "lr": lr, "grad_norm": grad_norm, "samples_per_step": int(samples),
            "step_mean_length": mean_length,
            "step_length_std": math.sqrt(max(totals["length_sq_sum"] / samples - mean_length ** 2, 0.0)) if samples else math.nan,
            "rank_imbalance": float(busy.max() / busy.mean()) if float(busy.mean()) > 0 else math.nan,
            "peak_memory_mb": float(per_rank["peak_memory_mb"].max()),
        }
        if grad_stats:
            self.state.last_grad_diversity = grad_stats["grad_diversity"]
            self.state.last_grad_noise_scale = grad_stats["grad_noise_scale"]
            record.update({k: v for k, v in grad_stats.items() if k not in ("grad_diversity", "grad_noise_scale")})
        record["grad_diversity"] = self.state.last_grad_diversity
        record["grad_noise_scale"] = self.state.last_grad_noise_scale
        record["grad_stats_measured"] = bool(grad_stats)
        self.stop_requested = bool(per_rank["stop_requested"].max() > 0)
        return record

    def _raise_nonfinite(self, batches: list[TrainingBatch], loss: float, grad_norm: float, local_bad: float) -> None:
        mine = [b.sample_indices.tolist() for b in batches] if local_bad else []
        reports = self.comm.all_gather_object({"rank": self.env.rank, "micro_batches": mine})
        culprits = "; ".join(f"rank {r['rank']} samples {r['micro_batches']}" for r in reports if r["micro_batches"])
        raise NonFiniteLoss(
            f"non-finite training signal at step {self.state.global_step + 1} (epoch {self.state.epoch}, "
            f"step {self.state.step_in_epoch} of the epoch): loss={loss}, grad_norm={grad_norm}; "
            f"{culprits or 'no single micro-batch had a non-finite loss (the gradient overflowed)'}. "
            f"The last good checkpoint in {self.run_dir / ckpt.CHECKPOINT_DIR} is kept; lower optim.lr or check "
            "these samples"
        )

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Held-out loss, accuracy per position and τ: one fixed padded plan, fixed anchors, every rank a share."""
        if self.eval_plan is None:
            return {}
        self._stage("eval", self.state.global_step)
        total = None
        dataset = RankMicroBatches(self.eval_plan, self.env.rank, 0, self.heldout_rows, self.eval_collate,
                                   anchor_epoch=0)
        drafter = self.drafter
        for item in range(len(dataset)):
            batch = dataset[item].to(self.device)
            if batch.empty:
                continue
            features = self.target(batch.tokens, gdn_backend=self.config.trainer.gdn_backend,
                                   tap_layer_ids=drafter.target_layer_ids)
            with self._autocast():
                sums = drafter.prepared_loss(batch.drafter, drafter.forward_prepared(batch.drafter, features)).detach()
            total = sums if total is None else total + sums
        slots = drafter.block_size - 1
        if total is None:  # this rank's share of the held-out set is empty
            vector = torch.zeros(6 + 2 * slots, dtype=torch.float64)
        else:
            vector = torch.tensor([float(total.weighted_ce_sum), float(total.weight_sum), float(total.correct_sum),
                                   float(total.label_count), float(total.tau_sum), float(total.block_count)]
                                  + total.correct_per_position.double().tolist()
                                  + total.count_per_position.double().tolist(), dtype=torch.float64)
        vector = self.comm.all_reduce_sum(vector)
        ce, weight, correct, count, tau, blocks = (float(v) for v in vector[:6])
        correct_pos, count_pos = vector[6:6 + slots], vector[6 + slots:]
        return {
            "eval_loss": ce / weight if weight else math.nan,
            "eval_accuracy": correct / count if count else math.nan,
            "eval_accuracy_per_position": (correct_pos / count_pos.clamp_min(1)).tolist(),
            "eval_tau": tau / blocks if blocks else math.nan,
            "eval_blocks": int(blocks),
            **self.evaluate_real_acceptance(),
        }

    @torch.no_grad()
    def evaluate_real_acceptance(self) -> dict[str, Any]:
        """``eval_tau_real``: greedy speculative decoding of fixed held-out prompts, shared over the ranks.

        The teacher-forced τ above scores the drafter against the dataset's tokens; this one lets it
        propose against the target's own greedy continuation, as a speculative decoder would.
        """
        trainer = self.config.trainer
        if trainer.eval_real_prompts == 0 or self.heldout_rows.size == 0:
            return {}
        from harness.eval.speculative import evaluate_acceptance, heldout_prompts

        if not hasattr(self, "_real_prompts"):
            self._real_prompts = heldout_prompts(self.samples, self.heldout_rows, trainer.eval_real_prompt_tokens,
                                                 trainer.eval_real_prompts)
        mine = self._real_prompts[self.env.rank::self.env.world_size]
        block = self.drafter.block_size
        vector = torch.zeros(block + 2, dtype=torch.float64)  # [forwards gaining 1..B tokens, tokens, forwards]
        if mine:
            with self._autocast():
                result = evaluate_acceptance(self.target, self.drafter, mine, trainer.eval_real_new_tokens,
                                             gdn_backend=trainer.gdn_backend)
            vector[:block] = torch.tensor(result["eval_tau_real_hist"], dtype=torch.float64)
            vector[block] = result["eval_real_tokens"]
            vector[block + 1] = result["eval_real_target_forwards"]
        vector = self.comm.all_reduce_sum(vector)
        hist, tokens, forwards = vector[:block], float(vector[block]), float(vector[block + 1])
        gains = float(hist.sum())
        return {
            "eval_tau_real": float((hist * torch.arange(1, block + 1, dtype=torch.float64)).sum()) / gains
            if gains else math.nan,
            "eval_tau_real_hist": [int(v) for v in hist.tolist()],
            "eval_speedup_bound": tokens / forwards if forwards else math.nan,
            "eval_real_prompts": len(self._real_prompts),
        }

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self, consumed: np.ndarray) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "noise": self.noise.state_dict(),
            "state": self.state.__dict__.copy(),
            "consumed": consumed.copy(),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
            "config": self.config_dict,
        }

    def save(self, consumed: np.ndarray) -> None:
        # every rank holds the same drafter and optimizer state; the consumed counts are summed over ranks
        # (a resumed run gives them to rank 0, so the sum over ranks is the same again)
        self._stage("checkpoint", self.state.global_step)
        everyone = self.comm.all_reduce_sum(torch.from_numpy(consumed.copy())).numpy()
        state = self.checkpoint_state(everyone)
        if self.env.is_main:
            ckpt.save_checkpoint(self.run_dir, self.state.global_step, state, self.config.trainer.keep_checkpoints)
        self.comm.barrier()

    def _maybe_resume(self) -> Path | None:
        self._resume_consumed: np.ndarray | None = None
        if not self.config.trainer.resume:
            return None
        path = ckpt.latest_checkpoint(self.run_dir)
        if path is None:
            return None
        saved = ckpt.load_checkpoint(path)
        # world size and accumulation may change (elastic resume): the rest of the epoch is re-planned below
        layout_changed = ckpt.check_fingerprint(saved["fingerprint"], self.fingerprint, path,
                                                allowed=ckpt.LAYOUT_KEYS)
        self.drafter.load_state_dict(saved["drafter"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.noise.load_state_dict(saved["noise"])
        self.state = TrainState(**saved["state"])
        self._resume_consumed = saved["consumed"] if self.env.is_main else np.zeros_like(saved["consumed"])
        torch.set_rng_state(saved["rng"]["torch"])
        np.random.set_state(saved["rng"]["numpy"])
        random.setstate(saved["rng"]["python"])
        if layout_changed:
            self._replan_epoch(saved, path)
        return path

    def _replan_epoch(self, saved: dict[str, Any], path: Path) -> None:
        """Elastic resume: the checkpoint's epoch continues with its unconsumed samples planned for this shape.

        The consumed counts (summed over the old ranks) are carried over, so the epoch's exactly-once
        check still covers the whole epoch; later epochs are planned as usual for this shape.
        """
        old = saved["fingerprint"]
        counts = np.asarray(saved["consumed"])[self.train_rows]
        most, elsewhere = int(counts.max(initial=0)), int(np.asarray(saved["consumed"]).sum() - counts.sum())
        if most > 1 or elsewhere:
            raise ValueError(
                f"checkpoint {path}: its consumed-sample counts are not a set of this run's training samples (a "
                f"sample consumed {most} times, {elsewhere} visits of other rows); it cannot be resumed on another "
                "world size"
            )
        state = self.state
        stopped_at = state.step_in_epoch
        done = np.flatnonzero(counts).astype(np.int64)
        # nothing consumed yet (a checkpoint at an epoch boundary): the epoch's own plan for this shape
        state.replanned_from = done if done.size else None
        state.step_in_epoch = 0
        self._last_plan = None
        plan = self.plan_epoch(state.epoch)
        left = int(self.train_rows.size - done.size)
        if plan.num_steps == 0:
            raise ValueError(
                f"checkpoint {path}: epoch {state.epoch} has consumed every training sample but was not finished; "
                "the checkpoint is inconsistent"
            )
        if self.env.is_main:
            shape = "" if old.get("grad_accum") == self.config.trainer.grad_accum else (
                f" (grad_accum {old.get('grad_accum')} -> {self.config.trainer.grad_accum})")
            print(
                f"batchlab-train: resumed a {old.get('world_size')}-rank checkpoint on {self.env.world_size} "
                f"rank{'s' if self.env.world_size != 1 else ''}{shape} at epoch {state.epoch}, step {stopped_at}: "
                f"{left} samples left in the epoch, re-planned ({plan.num_steps} steps)",
                flush=True,
            )

    # ------------------------------------------------------------------ the loop
    def _stage(self, name: str, step: int) -> None:
        """This rank enters stage ``name`` of optimizer step ``step`` (its status file; the test failure hook)."""
        self.status.stage(name, step)
        if self._test_failure is not None and self._test_failure[:2] == (step, name):
            _fail_for_test(self._test_failure[2], self.env.rank, name, step)

    def _install_signal_handlers(self) -> None:
        def request_stop(signum: int, frame: Any) -> None:  # noqa: ARG001
            self.stop_requested = True

        # a submitit job (hydra/launcher=slurm) is warned by SIGUSR2 before its time limit (signal_delay_s)
        submitit = (signal.SIGUSR2,) if os.environ.get("SUBMITIT_EXECUTOR") else ()
        for sig in (signal.SIGTERM, signal.SIGINT, *submitit):
            with contextlib.suppress(ValueError):  # not the main thread
                signal.signal(sig, request_stop)

    def abort(self) -> None:
        """After a failure: shut the epoch's DataLoader workers down (they ignore SIGTERM: a process exiting
        with them alive would wait for them for good) and close the status file."""
        batches = getattr(self, "_epoch_batches", None)
        if batches is not None:
            batches.close()
        self.status.close()

    def _done(self) -> bool:
        return self.state.tokens_seen >= self.total_tokens

    def train(self) -> dict[str, Any]:
        """Run until the stop condition; returns the summary (rank 0's copy is the one written)."""
        self._install_signal_handlers()
        trainer = self.config.trainer
        state = self.state
        if state.global_step == 0:
            state.next_eval_tokens = trainer.eval_every_tokens
            self._log_start()
        consumed = (self._resume_consumed if self._resume_consumed is not None
                    else np.zeros(len(self.samples), dtype=np.int64))
        progress = self._progress_bar()
        wall_started = time.perf_counter()
        stop = False
        while not self._done() and not stop:
            plan = self.plan_epoch(state.epoch)
            # a re-planned rest of an epoch (elastic resume) logged its epoch's plan metrics before
            epoch_record = self._plan_record(plan) if state.step_in_epoch == 0 and state.replanned_from is None else {}
            consumed_log = self._consumed_log()
            epoch_batches = self._epoch_batches = self.batch_generator(plan, state.step_in_epoch)
            for step, batches, data_wait in epoch_batches:
                measure = (state.global_step + 1) % trainer.grad_stats_every == 0
                step_started = time.perf_counter()
                record = self.train_step(batches, data_wait, measure)
                if self.feature_link is not None:
                    record.update(self.feature_link.step_metrics(self.comm))
                state.train_time_s += time.perf_counter() - step_started + data_wait
                for batch in batches:
                    np.add.at(consumed, batch.sample_indices.numpy(), 1)
                    if consumed_log is not None:
                        consumed_log.write(json.dumps({"step": state.global_step + 1, "epoch": state.epoch,
                                                       "step_in_epoch": step,
                                                       "rows": batch.sample_indices.tolist()}) + "\n")
                if consumed_log is not None:
                    consumed_log.flush()  # a killed run keeps what it consumed up to its last step
                state.global_step += 1
                state.step_in_epoch = step + 1
                state.tokens_seen += record["real_tokens"]
                state.samples_seen += record["samples_per_step"]
                state.computed_slots += record["computed_slots"]
                record.update(step=state.global_step, epoch=state.epoch, step_in_epoch=step,
                              tokens_seen=state.tokens_seen, samples_seen=state.samples_seen,
                              epochs=state.tokens_seen / self.epoch_tokens, **epoch_record)
                epoch_record = {}
                if state.tokens_seen >= state.next_eval_tokens or self._done():
                    state.last_eval = self.evaluate()
                    record.update(state.last_eval)
                    while state.next_eval_tokens <= state.tokens_seen:
                        state.next_eval_tokens += trainer.eval_every_tokens
                self.logger.log(record)
                if progress is not None:
                    progress.update(record["real_tokens"])
                    progress.set_postfix(loss=f"{record['loss']:.3f}", tau=f"{record['tau']:.2f}",
                                         tok_s=f"{record['tokens_per_second']:.0f}", refresh=False)
                epoch_finished = state.step_in_epoch == plan.num_steps
                if epoch_finished:
                    state.epochs_exactly_once.append(self._epoch_exactly_once(plan, consumed))
                    consumed[:] = 0
                    state.epoch += 1
                    state.step_in_epoch = 0
                    state.replanned_from = None
                if self.stop_requested or self._done():
                    stop = True
                    break
                if state.global_step % trainer.checkpoint_every_steps == 0:
                    self.save(consumed)
                if epoch_finished:
                    break
            epoch_batches.close()
            if consumed_log is not None:
                consumed_log.close()
        if progress is not None:
            progress.close()
        self.save(consumed)
        interrupted = self.stop_requested and not self._done()
        summary = self._summary(interrupted, time.perf_counter() - wall_started, consumed)
        self.logger.summary(summary)
        self.logger.close()
        self._stage("done", self.state.global_step)
        self.status.close()
        return summary

    def _epoch_exactly_once(self, plan: Plan, consumed: np.ndarray) -> bool:
        self._stage("epoch_end", self.state.global_step)
        counts = self.comm.all_reduce_sum(torch.from_numpy(consumed.copy())).numpy()
        expected = np.zeros_like(counts)
        expected[self.train_rows[plan.kept_indices()]] = 1
        return bool(np.array_equal(counts, expected))

    def _consumed_log(self):
        """``consumed/rank{r}.jsonl``: every micro-batch's dataset rows as this rank consumed them (tests)."""
        if not self.config.trainer.record_consumed:
            return None
        directory = self.run_dir / "consumed"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"rank{self.env.rank}.jsonl"
        if not self._consumed_log_checked:  # a resumed run rewrites what came after its checkpoint
            self._consumed_log_checked = True
            if self._resume_consumed is not None:
                truncate_metrics(path, self.state.global_step)
                if self.env.is_main:  # the files of ranks a resume on fewer ranks no longer has
                    for rank_file in directory.glob("rank*.jsonl"):
                        rank = rank_file.stem[len("rank"):]
                        if rank.isdigit() and int(rank) >= self.env.world_size:
                            truncate_metrics(rank_file, self.state.global_step)
            elif path.exists():
                path.unlink()
        return path.open("a")

    def _plan_record(self, plan: Plan) -> dict[str, Any]:
        """The epoch's plan metrics (ACF of step mean length, recurrence, mix), logged with its first step."""
        drafter = self.config.drafter_config  # the drafter's block term counts this run's blocks
        cost = CostModel(block_size=drafter.block_size, num_anchors=drafter.num_anchors)
        metrics = plan_metrics(plan, next_epoch_plan=self.plan_epoch(plan.epoch + 1),
                               acf_lags=self.config.trainer.acf_lags, cost_model=cost)
        record = {}
        for key, value in metrics.items():
            if isinstance(value, (int, float, bool)) or (isinstance(value, list) and all(
                    isinstance(v, (int, float)) for v in value)):
                record[f"plan_{key}"] = value
        acf = metrics.get("acf") or metrics.get("step_length_acf")
        if isinstance(acf, list):  # a W&B table; metrics.jsonl has the same values as plan_acf
            self.logger.log_table("plan_acf", ["lag", "acf"], [[i + 1, v] for i, v in enumerate(acf)],
                                  self.state.tokens_seen)
        return record

    def _log_start(self) -> None:
        if not self.env.is_main:
            return
        print(
            f"batchlab-train: {self.config.name} ({self.config.strategy_name}, seed {self.config.seed}) on "
            f"{self.env.world_size} rank(s), {self.device.type}: {self.train_rows.size} training samples "
            f"({self.epoch_tokens} tokens an epoch), {self.heldout_rows.size} held out; "
            f"stop at {self.total_tokens} tokens ({self.total_tokens / self.epoch_tokens:.2f} epochs); "
            f"dropped: {self.train_report.summary()} oversize {self.oversize_dropped}; run dir {self.run_dir}",
            flush=True,
        )

    def _progress_bar(self):
        if not (self.env.is_main and self.config.trainer.progress):
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.total_tokens, initial=min(self.state.tokens_seen, self.total_tokens), unit="tok",
                    unit_scale=True, desc=self.config.name, dynamic_ncols=True)

    def _summary(self, interrupted: bool, wall_time: float, consumed: np.ndarray) -> dict[str, Any]:
        state = self.state
        complete_epochs_ok = all(state.epochs_exactly_once)
        # the unfinished epoch: no sample more than once so far
        partial = self.comm.all_reduce_sum(torch.from_numpy(consumed.copy())).numpy()
        once = complete_epochs_ok and bool((partial <= 1).all())
        summary = {
            "status": "interrupted" if interrupted else "complete",
            "strategy": self.config.strategy_name, "seed": self.config.seed, "group": self.config.group,
            "name": self.config.name, "world_size": self.env.world_size, "grad_accum": self.config.trainer.grad_accum,
            "max_tokens": self.budget.max_tokens, "layout": self.strategy.layout,
            "tokens_seen": state.tokens_seen, "samples_seen": state.samples_seen, "steps": state.global_step,
            "epochs": state.tokens_seen / self.epoch_tokens, "epoch_tokens": self.epoch_tokens,
            "stop_tokens": self.total_tokens,
            "tokens_per_second": state.tokens_seen / state.train_time_s if state.train_time_s else math.nan,
            "train_time_s": state.train_time_s, "wall_time_s": wall_time,
            "padding_ratio": 1.0 - state.tokens_seen / state.computed_slots if state.computed_slots else 0.0,
            "samples_seen_once": once, "epochs_exactly_once": state.epochs_exactly_once,
            "train_samples": int(self.train_rows.size), "heldout_samples": int(self.heldout_rows.size),
            "dropped_no_anchor": int(self.train_report.dropped_no_anchor.size),
            "dropped_oversize": self.oversize_dropped, "truncated_oversize": self.oversize_truncated,
            "grad_diversity_last": state.last_grad_diversity, "grad_noise_scale_last": state.last_grad_noise_scale,
            "data_fingerprint": self.samples.fingerprint, "plan_fingerprint": self.fingerprint,
        }
        summary.update(state.last_eval)
        if self.feature_link is not None:
            summary.update(self.feature_link.summary())
        summary.update(_run_averages(self.run_dir / "metrics.jsonl") if self.env.is_main else {})
        return summary


def _run_averages(path: Path) -> dict[str, Any]:
    """Means over the logged steps of what the report compares (rank 0 reads its own file)."""
    if not path.exists():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        return {}

    def mean(key: str) -> float:
        values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        return float(np.mean(values)) if values else math.nan

    measured = [r["grad_diversity"] for r in records if r.get("grad_stats_measured") and r.get("grad_diversity")]
    return {
        "grad_diversity": float(np.mean(measured)) if measured else math.nan,
        "grad_noise_scale": next((r["grad_noise_scale"] for r in reversed(records)
                                  if isinstance(r.get("grad_noise_scale"), (int, float))), math.nan),
        "rank_imbalance": mean("rank_imbalance"), "data_wait_fraction": mean("data_wait_fraction"),
        "drafter_block_efficiency": mean("drafter_block_efficiency"), "peak_memory_mb": mean("peak_memory_mb"),
        "final_loss": records[-1].get("loss"), "plan_acf_lag1": next(
            (r["plan_acf"][0] for r in records if isinstance(r.get("plan_acf"), list) and r["plan_acf"]), math.nan),
        "plan_recurrence": next((r["plan_recurrence"] for r in records if "plan_recurrence" in r), math.nan),
    }


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


#: tests only: ``RANK:STEP:STAGE:MODE`` makes that rank fail on entering that stage of that step, MODE being
#: ``kill`` (SIGKILL, as the kernel's out-of-memory killer does), ``raise`` (a Python exception), ``oom``
#: (``torch.OutOfMemoryError``, as CUDA raises it) or ``hang`` (stop answering the collectives)
TEST_FAIL_ENV = "BATCHLAB_TEST_FAIL"
_TEST_FAIL_MODES = ("kill", "raise", "oom", "hang")


def _test_failure(rank: int) -> tuple[int, str, str] | None:
    """``(step, stage, mode)`` of ``BATCHLAB_TEST_FAIL`` when it names this rank, else None."""
    value = os.environ.get(TEST_FAIL_ENV)
    if not value:
        return None
    try:
        fail_rank, step, stage, mode = value.split(":")
        fail_rank, step = int(fail_rank), int(step)
    except ValueError:
        raise ValueError(
            f"{TEST_FAIL_ENV}={value!r}: expected RANK:STEP:STAGE:MODE, e.g. 1:3:drafter_backward:kill") from None
    if mode not in _TEST_FAIL_MODES:
        raise ValueError(f"{TEST_FAIL_ENV}={value!r}: MODE must be one of {', '.join(_TEST_FAIL_MODES)}")
    return (step, stage, mode) if fail_rank == rank else None


def _fail_for_test(mode: str, rank: int, stage: str, step: int) -> None:
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "oom":
        raise torch.OutOfMemoryError(f"{TEST_FAIL_ENV}: simulated out of memory on rank {rank}")
    if mode == "hang":
        # stuck outside any collective: the others' collective timeout ends the job. (A rank stuck in C code
        # outlives the agent's SIGTERM and is SIGKILLed 30 s later; this one dies of it, to keep tests short.)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        while True:
            time.sleep(1.0)
    raise RuntimeError(f"{TEST_FAIL_ENV}: simulated failure of rank {rank} in stage {stage!r} of step {step}")
