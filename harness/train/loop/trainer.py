"""The training loop: the DFlash drafter on a frozen target's features, batched by one strategy.

Per optimizer step, on every rank, for each of its ``grad_accum`` micro-batches of the epoch's plan:
target features (computed here or received: the rank's
:class:`~harness.train.placement.feature_source.FeatureSource`) →
drafter forward and backward of ``Σ(w·CE) / W``, where ``W`` = Σw over the *whole global step* (every
rank, every micro-batch), all-reduced from the collated Σw **before** the first backward (or one constant per
epoch: :mod:`~harness.train.loop.loss_normaliser`). DDP syncs only on
the last micro-batch and sums gradients (its division by world size is undone by
:func:`~harness.train.loop.grad_stats.summing_comm_hook`), so the gradient is exactly that of the global
objective whatever the grouping. Then clip on the global norm, AdamW, and a cosine schedule in tokens seen.

The :class:`Trainer` holds the loop only — :meth:`~Trainer.train`, :meth:`~Trainer.train_step`,
:meth:`~Trainer.forward_backward_step` — and is handed its components
(:func:`harness.train.loop.build.build_trainer`):
the epoch data and plans, the models, the feature source, the gradient statistics, the evaluator, the
consumed-sample counts, the checkpoints, the logger. Rank-0-only work (files, W&B, the progress bar)
goes through the logger and ``env.is_main`` only.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from harness.machine import machine_name
from harness.models.drafter_loss import DrafterLoss
from harness.train.batch import TrainingBatch
from harness.train.config import CheckpointConfig, EvalConfig, TrainerConfig
from harness.train.loop.cadence import Cadence
from harness.train.loop.checkpoint import CHECKPOINT_DIR
from harness.train.loop.evaluator import EVALUATED_ROWS
from harness.train.loop.step_record import StepPosition, StepRecord
from harness.train.loop.step_stats import StepStats, step_record
from harness.train.loop.summary import run_summary
from strategies import Plan

if TYPE_CHECKING:  # the components, typed by what the trainer asks of them
    from pathlib import Path

    from harness.train.distributed import Collectives
    from harness.train.loop.checkpoint import CheckpointManager
    from harness.train.loop.consumed import ConsumedSamples
    from harness.train.loop.epoch_data import EpochData
    from harness.train.loop.evaluator import Evaluator
    from harness.train.loop.grad_stats import GradientStatistics
    from harness.train.loop.loss_normaliser import LossNormaliser
    from harness.train.loop.lr_schedule import TokenCosineSchedule
    from harness.train.loop.metrics import MetricSink
    from harness.train.loop.train_state import TrainState
    from harness.train.placement.feature_source import FeatureSource
    from harness.train.rank_models import DrafterModel
    from harness.train.status import RankStatus


#: set in a process a launcher started (torch elastic / torchrun, submitit, srun): a rank, not the user's own process
LAUNCHER_VARIABLES = ("TORCHELASTIC_RUN_ID", "SUBMITIT_EXECUTOR", "SLURM_PROCID")


class NonFiniteLoss(RuntimeError):
    """A step's loss or gradient norm is not finite; the last good checkpoint is kept."""


@dataclass(frozen=True)
class LoopConfig:
    """What the training loop reads itself: the run's names, clipping, its cadences and its summary's settings."""

    name: str
    """The run's name (messages, the progress bar, the summary)."""
    group: str
    """The run's W&B group (the summary)."""
    strategy: str
    """The strategy's name (messages, the summary)."""
    seed: int
    """The run's seed (messages, the summary)."""
    grad_clip: float
    """``optim.grad_clip``: the gradient norm clipped to (0: no clipping)."""
    eval: EvalConfig
    """When to evaluate, and on which split."""
    checkpoint: CheckpointConfig
    """When to checkpoint."""
    trainer: TrainerConfig
    """The progress bar, and the step settings the summary records."""
    target: Optional[str] = None
    """``target.pretrained`` (the summary names the target)."""


class Trainer:
    def __init__(self, *, config: LoopConfig, run_dir: Path, comm: Collectives, status: RankStatus, data: EpochData,
                 model: DrafterModel, optimizer: torch.optim.Optimizer, schedule: TokenCosineSchedule,
                 source: FeatureSource, grads: GradientStatistics, evaluator: Evaluator, consumed: ConsumedSamples,
                 checkpoints: CheckpointManager, logger: MetricSink, state: TrainState,
                 normaliser: LossNormaliser) -> None:
        self.config, self.run_dir, self.comm, self.env, self.status = config, run_dir, comm, comm.env, status
        self.data, self.model, self.optimizer, self.schedule = data, model, optimizer, schedule
        self.source, self.grads, self.evaluator = source, grads, evaluator
        self.consumed, self.checkpoints, self.logger, self.state = consumed, checkpoints, logger, state
        self.normaliser = normaliser
        self.cadence = Cadence.of(config.eval, config.checkpoint, data)  # when to evaluate, checkpoint and stop
        self.signal_received = False  # set by a stop signal's handler, at any moment; never cleared
        self.stop_requested = False  # the job's decision, the same on every rank: some rank had a signal

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict[str, Any]:
        """Run until the stop condition; returns the summary (rank 0's copy is the one written)."""
        previous = self._install_signal_handlers()
        try:
            summary = self._train()
            self.source.close()
        except BaseException:
            self.abort()
            raise
        finally:
            if not any(name in os.environ for name in LAUNCHER_VARIABLES):
                # a run inside a notebook or a test leaves Ctrl-C (and SIGTERM) as it found them; a launched
                # rank keeps its handlers to the end (a peer's late SIGUSR2 must not reach submitit's own)
                for sig, handler in previous.items():
                    with contextlib.suppress(ValueError, TypeError):
                        signal.signal(sig, handler)
        return summary

    def _train(self) -> dict[str, Any]:
        state = self.state
        if state.global_step == 0:
            self.cadence.start(state)
            self._print_start()
        elif self.env.is_main:
            print(f"batchlab-train: {self.config.name} resuming from step {state.global_step} "
                  f"({state.tokens_seen:,} tokens, epoch {state.epoch}) in {self.run_dir}", flush=True)
        progress = self._progress_bar()
        wall_started = time.perf_counter()
        stop = False
        while not self.cadence.done(state) and not stop:
            stop = self._train_epoch(self.data.plan_epoch(state.epoch), progress)
        if progress is not None:
            progress.close()
        self.save()
        summary = run_summary(
            config=self.config, world_size=self.env.world_size, data=self.data, state=state,
            interrupted=self.stop_requested and not self.cadence.done(state),
            wall_time=time.perf_counter() - wall_started,
            seen_at_most_once=self.consumed.at_most_once(),
            extra={**self.source.summary(), "torch_threads": torch.get_num_threads(),  # this rank's CPU threads
                   "machine": machine_name(_accelerator(self.model.device))},
            run_dir=self.run_dir if self.env.is_main else None)
        self.logger.summary(summary)
        where = self.logger.locations()
        self.logger.close()
        self._print_end(summary, where)
        self.status.stage("done", state.global_step)
        self.status.close()
        return summary

    def _train_epoch(self, plan: Plan, progress: Any) -> bool:
        """Train the rest of ``plan``'s epoch; True when the run is to stop (done, or asked to)."""
        state = self.state
        # a re-planned rest of an epoch (elastic resume) logged its epoch's plan metrics before
        epoch_record = (self._plan_record(plan) if state.step_in_epoch == 0 and not self.data.replanned(plan.epoch)
                        else {})
        self.normaliser.start_epoch(plan)
        epoch_batches = self.source.batches(plan, state.step_in_epoch, state.global_step)
        try:
            for step, batches, data_wait in epoch_batches:
                started = time.perf_counter()
                record = self.train_step(batches, data_wait)
                record.placement = self.source.step_metrics(self.comm)
                state.train_time_s += time.perf_counter() - started + data_wait
                self.consumed.add(batches, state.global_step + 1, state.epoch, step)
                state.advance(step, record)
                record.position = StepPosition(step=state.global_step, epoch=state.epoch, step_in_epoch=step,
                                               tokens_seen=state.tokens_seen, samples_seen=state.samples_seen,
                                               epochs=state.tokens_seen / self.data.epoch_tokens)
                record.plan, epoch_record = epoch_record, {}
                if self.cadence.evaluate_now(state):
                    state.last_eval = self.evaluator(state.global_step)
                    record.evaluation = state.last_eval
                    self.cadence.evaluated(state)
                self.logger.log(record.logged())
                self._show(progress, record)
                epoch_finished = state.step_in_epoch == plan.num_steps
                if epoch_finished:
                    self.status.stage("epoch_end", state.global_step)
                    state.end_epoch(self.consumed.end_epoch(self.data.kept_rows(plan)))
                if self.stop_requested or self.cadence.done(state):
                    return True
                if self.cadence.checkpoint_now(state):
                    self.save()
                if epoch_finished:
                    return False
            return False
        finally:
            epoch_batches.close()

    # ------------------------------------------------------------------ one step
    def forward_backward_step(self, batch: TrainingBatch, divisor: float,
                              sync: bool) -> tuple[DrafterLoss, float, float]:
        """Target features, drafter forward + backward of ``Σ(w·CE) / divisor``; returns the sums and the two stage
        times."""
        started = time.perf_counter()
        step = self.state.global_step + 1
        features = self.source.features(batch, step)
        self.model.synchronize()
        target_done = time.perf_counter()
        with self.model.no_sync(skip=not sync):
            self.status.stage("drafter_forward", step)
            with self.model.autocast():
                sums = self.model.objective(batch, features)
            self.status.stage("drafter_backward", step)  # with DDP's gradient all-reduce on the last micro-batch
            (sums.weighted_ce_sum / divisor).backward()
        self.model.synchronize()
        return sums.detach(), target_done - started, time.perf_counter() - target_done

    def train_step(self, batches: list[TrainingBatch], data_wait: float) -> StepRecord:
        """One optimizer step over this rank's micro-batches; returns the step's record (global metrics)."""
        started = time.perf_counter() - data_wait
        step = self.state.global_step + 1
        self.status.stage("weight_all_reduce", step)
        local_weight = sum(b.weight_sum for b in batches)
        weight = float(self.comm.all_reduce_sum(torch.tensor([local_weight], dtype=torch.float64))[0])
        divisor = self.normaliser.divisor(weight)  # W, or the epoch's constant (optim.loss_normaliser)
        self.grads.start_step(step, len(batches))
        total, target_time, drafter_time = None, 0.0, 0.0
        for k, batch in enumerate(batches):
            sums, t_target, t_drafter = self.forward_backward_step(batch, divisor, sync=k == len(batches) - 1)
            target_time, drafter_time = target_time + t_target, drafter_time + t_drafter
            total = sums if total is None else total + sums
            self.grads.micro_batch_done(batch.weight_sum)
        self.status.stage("optimizer", step)  # gradient statistics, clipping, metrics gather, step
        grad_record = self.grads.end_step(weight, local_weight, divisor)
        clip = self.config.grad_clip
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters, clip if clip > 0 else math.inf))
        mine = StepStats.measure(batches, total, step_time=time.perf_counter() - started, data_wait=data_wait,
                                 target_time=target_time, drafter_time=drafter_time,
                                 stop_requested=self.signal_received, peak_memory_mb=_peak_memory_mb(self.model.device))
        ranks = mine.gather(self.comm)  # every rank sees every rank's numbers
        weight_sum = ranks.total("weight_sum")
        loss = ranks.total("weighted_ce_sum") / weight_sum if weight_sum > 0 else math.nan
        if not (math.isfinite(grad_norm) and (math.isfinite(loss) or weight_sum == 0)):
            self._raise_nonfinite(batches, loss, grad_norm, mine.nonfinite)
        lr = self.schedule.set(self.state.tokens_seen)
        optimizer_started = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = step_record(ranks, grad_norm, lr, time.perf_counter() - optimizer_started)
        gradients = {**grad_record, "grad_clipped": bool(clip > 0 and grad_norm > clip), "step_weight_sum": weight,
                     "loss_divisor": divisor}
        self.stop_requested = bool(ranks["stop_requested"].max() > 0)
        return StepRecord.of(ranks, metrics, gradients)

    def _raise_nonfinite(self, batches: list[TrainingBatch], loss: float, grad_norm: float, local_bad: float) -> None:
        mine = [b.sample_indices.tolist() for b in batches] if local_bad else []
        reports = self.comm.all_gather_object({"rank": self.env.rank, "micro_batches": mine})
        culprits = "; ".join(f"rank {r['rank']} samples {r['micro_batches']}" for r in reports if r["micro_batches"])
        state = self.state
        raise NonFiniteLoss(
            f"non-finite training signal at step {state.global_step + 1} (epoch {state.epoch}, "
            f"step {state.step_in_epoch} of the epoch): loss={loss}, grad_norm={grad_norm}; "
            f"{culprits or 'no single micro-batch had a non-finite loss (the gradient overflowed)'}. "
            f"The last good checkpoint in {self.run_dir / CHECKPOINT_DIR} is kept; lower optim.lr or check "
            "these samples"
        )

    # ------------------------------------------------------------------ around the loop
    def save(self) -> None:
        self.checkpoints.save(self.state.global_step)

    def abort(self) -> None:
        """After a failure (idempotent): release the feature source (DataLoader workers), finish the W&B run as
        failed, close the logs and the status file."""
        self.source.abort()
        self.logger.close(failed=True)
        self.status.close()

    def _install_signal_handlers(self) -> dict[int, Any]:
        """Stop signals finish the step and checkpoint; returns the handlers they replaced."""
        def request_stop(signum: int, frame: Any) -> None:  # noqa: ARG001
            # Only noted here: the ranks decide together at the next step's gather of StepStats. Setting the
            # decision itself would race with that gather's result (a signal landing between the two was lost).
            self.signal_received = True

        # a submitit job (hydra/launcher=slurm) is warned by SIGUSR2 before its time limit (signal_delay_s)
        submitit = (signal.SIGUSR2,) if os.environ.get("SUBMITIT_EXECUTOR") else ()
        previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT, *submitit):
            with contextlib.suppress(ValueError):  # not the main thread
                previous[sig] = signal.signal(sig, request_stop)
        return previous

    def _plan_record(self, plan: Plan) -> dict[str, Any]:
        """The epoch's plan metrics, logged with its first step (the ACF also as a W&B table)."""
        record, acf = self.data.plan_record(plan)
        if acf is not None:  # metrics.jsonl has the same values as plan_acf
            self.logger.log_table("plan_acf", ["lag", "acf"], [[i + 1, v] for i, v in enumerate(acf)],
                                  self.state.tokens_seen)
        return record

    def _print_start(self) -> None:
        if not self.env.is_main:
            return
        data, config = self.data, self.config
        print(
            f"batchlab-train: {config.name} ({config.strategy}, seed {config.seed}) on "
            f"{self.env.world_size} rank(s), {self.model.device.type}: {data.selection_words()}, "
            f"{data.epoch_tokens:,} tokens an epoch, {data.heldout_rows.size} held out"
            + (f", {data.validation_rows.size} for validation" if data.validation_rows.size else "")
            + (" (evaluated: validation)" if config.eval.split == "validation" else "") + "; "
            f"stop at {data.total_tokens:,} tokens ({data.total_tokens / data.epoch_tokens:.2f} epochs); "
            f"run dir {self.run_dir}",
            flush=True,
        )

    def _print_end(self, summary: dict[str, Any], where: list[str]) -> None:
        """The closing lines: how the run ended, its held-out numbers and speed, and where its results are."""
        if not self.env.is_main:
            return

        def number(key: str, spec: str) -> str:
            value = summary.get(key)
            return format(value, spec) if isinstance(value, (int, float)) and math.isfinite(value) else "n/a"

        print(f"batchlab-train: {self.config.name} {summary['status']} after {summary['steps']} steps, "
              f"{summary['tokens_seen']:,} tokens, {summary['wall_time_s']:.0f} s: "
              f"{EVALUATED_ROWS[summary['eval_split']]} loss "
              f"{number('eval_loss', '.4f')}, τ {number('eval_tau', '.2f')}, τ real {number('eval_tau_real', '.2f')}, "
              f"{number('tokens_per_second', ',.0f')} real tokens/s\n"
              f"  results: {'; '.join(where)}",
              flush=True)

    def _progress_bar(self) -> Any:
        if not (self.env.is_main and self.config.trainer.progress):
            return None
        from tqdm.auto import tqdm

        total = self.data.total_tokens
        return tqdm(total=total, initial=min(self.state.tokens_seen, total), unit="tok", unit_scale=True,
                    desc=self.config.name, dynamic_ncols=True)

    @staticmethod
    def _show(progress: Any, record: StepRecord) -> None:
        if progress is not None:
            progress.update(record.real_tokens)
            progress.set_postfix(loss=f"{record.loss:.3f}", tau=f"{record.tau:.2f}",
                                 tok_s=f"{record.tokens_per_second:.0f}", refresh=False)


def _accelerator(device: torch.device) -> str | None:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
