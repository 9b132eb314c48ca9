"""A run's data by epoch: the samples, their validation and oversize policy, the plan fingerprint, each epoch's plan.

Built once per rank (rank 0 builds any cache first). The training rows are the validated samples of the
training split after ``trainer.oversize``; the held-out rows are split in length terciles, each with one fixed
padded plan (the same for every strategy and seed). :meth:`EpochData.plan_epoch` is the strategy's plan of an epoch — or, after an elastic
resume on another world size or accumulation, the rest of the checkpoint's epoch re-planned from the samples
it had consumed (:meth:`EpochData.replan_rest`; the set is checkpointed, so a later resume in the same epoch
rebuilds the same plan).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from harness.data.samples import (
    TokenizedSamples,
    ValidationReport,
    heldout_split,
    load_samples,
    validate_samples,
    validation_split,
)
from harness.data.config import DataConfig
from harness.models.drafter_config import DrafterConfig
from harness.train.config import TrainerConfig
from harness.train.loop import checkpoint as ckpt
from harness.train.rank_models import EMBEDDED_TARGET, TargetSpec, pretrained_target_path
from strategies import Budget, CostModel, Plan, build_strategy, plan_remainder
from strategies.metrics import plan_metrics

#: the held-out length terciles, shortest first (evaluated separately: forgetting shows per length range)
LENGTH_GROUPS = ("short", "mid", "long")


@dataclass(frozen=True)
class EpochDataConfig:
    """What a run's data by epoch is built from: the samples, their checks, the strategy and the step's shape."""

    data: DataConfig
    """The samples and their split (``data``)."""
    target: TargetSpec
    """The target whose vocabulary every token id must lie in."""
    drafter: DrafterConfig
    """The drafter's blocks: a sample needs a position to anchor one; the plan's fingerprint records them."""
    trainer: TrainerConfig
    """The budget, oversize policy, accumulation, step size, stop condition and ACF lags (``trainer``)."""
    strategy: str = "sorted"
    """The strategy's registered name."""
    strategy_options: dict[str, Any] = field(default_factory=dict)
    """Its options (the strategy group's keys but ``name`` and the balancing ones)."""
    balance: Optional[dict[str, Any]] = None
    """Rank balancing (``{"window_steps": n}``), or None."""
    seed: int = 0
    """The run's seed: the strategy's random choices."""
    eval_split: str = "heldout"
    """``eval.split``: the rows the evaluator evaluates."""


@dataclass(frozen=True)
class EvalGroup:
    """One length tercile of the held-out set: its dataset rows, their fixed plan, their length range."""

    name: str
    rows: np.ndarray
    plan: Plan
    lengths: tuple[int, int]


@dataclass(frozen=True)
class Selection:
    """The rows a run trains and evaluates on: the validated samples of each split after ``trainer.oversize``."""

    train_report: ValidationReport
    heldout_report: ValidationReport
    train_rows: np.ndarray
    heldout_rows: np.ndarray
    oversize_dropped: int
    oversize_truncated: int
    max_tokens: int
    # data.validation_fraction's rows (never trained on)
    validation_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def eval_rows(self, split: str) -> np.ndarray:
        """The rows ``eval.split`` evaluates: the held-out ones, or the validation ones."""
        return self.validation_rows if split == "validation" else self.heldout_rows

    def words(self) -> str:
        """``92 of 114 training samples used (9 without a position to anchor a block, 13 over
        trainer.max_tokens=1024 dropped)``."""
        report = self.train_report.summary()
        left_out = [f"{count} {why}" for count, why in (
            (report["dropped_no_anchor"], "without a position to anchor a block (data.no_anchor)"),
            (self.oversize_dropped, f"over trainer.max_tokens={self.max_tokens} dropped (trainer.oversize)"),
            (self.oversize_truncated, f"over trainer.max_tokens={self.max_tokens} truncated to it"))
            if count]
        return f"{self.train_rows.size} of {report['checked']} training samples used" + (
            f" ({', '.join(left_out)})" if left_out else "")


def target_vocab_size(target: TargetSpec) -> int:
    """The vocabulary every token id must lie in: a pretrained checkpoint's own (from its config), else the
    random-weight or embedded target's ``target.vocab_size`` (0: unknown, not checked)."""
    pretrained = target.pretrained
    if pretrained and pretrained != EMBEDDED_TARGET:  # the embedded target follows the data, as a random one does
        from harness.models.causal_lm_target import checkpoint_vocab_size

        return checkpoint_vocab_size(pretrained_target_path(target))  # (``bundled``: the shipped checkpoint)
    return int(target.kwargs.get("vocab_size") or 0)


def select_rows(config: EpochDataConfig, samples: TokenizedSamples) -> Selection:
    """Validate both splits and apply ``trainer.oversize`` ("drop" leaves samples out, counted; "truncate"
    shortens them to the budget; "error" names the first one). Run once before any rank starts (bad data is
    bad input) and again by every rank; a ValueError names the sample, the setting and the fix."""
    vocab_size = target_vocab_size(config.target)
    train_rows, heldout_rows = heldout_split(len(samples), config.data)
    train_rows, validation_rows = validation_split(train_rows, config.data)
    check = dict(vocab_size=vocab_size, block_size=config.drafter.block_size, no_anchor=config.data.no_anchor)
    train_report = validate_samples(samples, train_rows, **check)
    heldout_report = validate_samples(samples, heldout_rows, **check)
    validation_report = validate_samples(samples, validation_rows, **check)
    max_tokens, policy = config.trainer.max_tokens, config.trainer.oversize

    def apply_oversize(rows: np.ndarray) -> tuple[np.ndarray, int, int]:
        over = samples.lengths[rows] > max_tokens
        if not over.any():
            return rows, 0, 0
        if policy == "error":
            first = int(rows[over][0])
            raise ValueError(
                f"sample {first} has {int(samples.lengths[first])} tokens, more than trainer.max_tokens="
                f"{max_tokens} ({int(over.sum())} such samples); raise trainer.max_tokens or set "
                "trainer.oversize=drop (leave them out, counted) or trainer.oversize=truncate"
            )
        if policy == "drop":
            return rows[~over], int(over.sum()), 0
        return rows, 0, int(over.sum())

    train, dropped, truncated = apply_oversize(train_report.kept)
    heldout, _, _ = apply_oversize(heldout_report.kept)
    validation, _, _ = apply_oversize(validation_report.kept)
    selection = Selection(train_report, heldout_report, train, heldout, dropped, truncated, max_tokens, validation)
    if train.size == 0:
        raise ValueError(f"no training sample is left: {selection.words()}; raise trainer.max_tokens or "
                         "check the data source")
    return selection


class EpochData:
    state_version = 1

    def __init__(self, config: EpochDataConfig, comm: Any, progress: bool = False) -> None:
        self.config = config
        self.env = comm.env
        if not self.env.is_main:  # rank 0 builds any cache first; the others read it
            comm.barrier()
        self.samples: TokenizedSamples = load_samples(config.data, progress=progress)
        if self.env.is_main:
            comm.barrier()
        drafter = config.drafter
        self.selection = select_rows(config, self.samples)
        self.train_report, self.heldout_report = self.selection.train_report, self.selection.heldout_report
        self.train_rows, self.heldout_rows = self.selection.train_rows, self.selection.heldout_rows
        self.validation_rows = self.selection.validation_rows
        # what the evaluator evaluates (eval.split): the held-out test rows, or the validation rows when tuning
        self.eval_rows = self.validation_rows if config.eval_split == "validation" else self.heldout_rows
        self.oversize_dropped, self.oversize_truncated = self.selection.oversize_dropped, self.selection.oversize_truncated
        self.budget = Budget(config.trainer.max_tokens, config.trainer.max_samples)
        self.train_lengths = np.minimum(self.samples.lengths[self.train_rows], self.budget.max_tokens)
        self.strategy = build_strategy(config.strategy, **config.strategy_options)
        self.fingerprint = ckpt.plan_fingerprint(
            lengths_sha256=ckpt.lengths_hash(self.train_lengths, self.train_rows),
            data_fingerprint=self.samples.fingerprint, max_tokens=self.budget.max_tokens,
            max_samples=self.budget.max_samples, strategy=config.strategy,
            strategy_options=config.strategy_options, balance=config.balance, oversize=config.trainer.oversize,
            world_size=self.env.world_size, grad_accum=config.trainer.grad_accum, seed=config.seed,
            block_size=drafter.block_size, num_anchors=drafter.num_anchors, max_blocks=drafter.max_blocks,
            step_tokens=config.trainer.step_tokens,
        )
        self.epoch_tokens = int(self.train_lengths.sum())
        stop = config.trainer
        self.total_tokens = (stop.stop_tokens if stop.stop_tokens is not None
                             else int(math.ceil(stop.stop_epochs * self.epoch_tokens)))
        # equal-token steps stop after a step count, the same for every strategy (not at a token count reached
        # part way through a step that differs by strategy). None: stop at total_tokens, which a whole number
        # of epochs (trainer.stop_epochs=N) reaches exactly at the end of epoch N in either step mode: every
        # strategy has then seen every sample N times (the same tokens, no tail subset that differs by
        # strategy), its step count within one step an epoch of the others'
        whole_epochs = stop.stop_epochs is not None and float(stop.stop_epochs).is_integer()
        self.total_steps = (int(math.ceil(self.total_tokens / stop.step_tokens))
                            if stop.step_tokens is not None and not whole_epochs else None)
        self.eval_groups = self._eval_groups(config.data.heldout_seed)
        # elastic resume: (epoch, the training-sample (plan) indices it had consumed) when the rest of that epoch
        # was re-planned for this world size / accumulation; None while every epoch runs its whole plan
        self._replanned: tuple[int, np.ndarray] | None = None
        self._last_plan: Plan | None = None

    def _eval_groups(self, seed: int) -> list[EvalGroup]:
        """The evaluated set (:attr:`eval_rows`: held-out, or validation) in length terciles (equal counts, by
        length then row), each with one fixed padded plan: the same for every strategy and seed."""
        lengths = np.minimum(self.samples.lengths[self.eval_rows], self.budget.max_tokens)
        order = np.lexsort((self.eval_rows, lengths))
        groups = []
        for name, part in zip(LENGTH_GROUPS, np.array_split(order, len(LENGTH_GROUPS))):
            if part.size == 0:
                continue
            part = np.sort(part)
            plan = build_strategy("sorted").plan(lengths[part], self.budget, seed=seed, epoch=0,
                                                 world_size=self.env.world_size, grad_accum=1)
            groups.append(EvalGroup(name, self.eval_rows[part], plan,
                                    (int(lengths[part].min()), int(lengths[part].max()))))
        return groups

    def selection_words(self) -> str:
        """Which training samples the run uses, in words (:meth:`Selection.words`)."""
        return self.selection.words()

    # ---------------------------------------------------------------- plans
    def plan_epoch(self, epoch: int) -> Plan:
        """The plan of ``epoch`` (the last one made is kept: each epoch's metrics plan the next one first)."""
        if self._last_plan is not None and self._last_plan.epoch == epoch:
            return self._last_plan
        if self.replanned(epoch):
            self._last_plan = plan_remainder(self.strategy, self.train_lengths, self._replanned[1], self.budget,
                                             **self._plan_shape(epoch))
        else:
            self._last_plan = self.strategy.plan(self.train_lengths, self.budget, **self._plan_shape(epoch))
        return self._last_plan

    def _plan_shape(self, epoch: int) -> dict[str, Any]:
        """The strategy's plan arguments of ``epoch`` besides the lengths and the budget."""
        cfg = self.config
        return dict(seed=cfg.seed, epoch=epoch, world_size=self.env.world_size, grad_accum=cfg.trainer.grad_accum,
                    balance=cfg.balance, step_tokens=cfg.trainer.step_tokens)

    def whole_plan(self, plan: Plan) -> Plan:
        """``plan`` itself, or, for the rest of an epoch re-planned by an elastic resume, the whole epoch's plan for
        this shape (not kept: :meth:`plan_epoch`'s plan stays the one the run trains on)."""
        if not self.replanned(plan.epoch):
            return plan
        return self.strategy.plan(self.train_lengths, self.budget, **self._plan_shape(plan.epoch))

    def replanned(self, epoch: int) -> bool:
        """Is ``epoch`` the rest of an epoch re-planned by an elastic resume?"""
        return self._replanned is not None and self._replanned[0] == epoch

    def kept_rows(self, plan: Plan) -> np.ndarray:
        """The dataset rows ``plan``'s epoch must consume exactly once (all of its epoch, re-planned or not)."""
        return self.train_rows[plan.kept_indices()]

    def replan_rest(self, epoch: int, consumed_total: np.ndarray, path: Path) -> tuple[Plan, int]:
        """Elastic resume: ``epoch`` continues with the training samples not in ``consumed_total`` (the checkpoint's
        counts summed over its ranks), planned for this shape; ``(that plan, samples left)``. Later epochs are
        planned as usual."""
        counts = np.asarray(consumed_total)[self.train_rows]
        most, elsewhere = int(counts.max(initial=0)), int(np.asarray(consumed_total).sum() - counts.sum())
        if most > 1 or elsewhere:
            raise ValueError(
                f"checkpoint {path}: its consumed-sample counts are not a set of this run's training samples (a "
                f"sample consumed {most} times, {elsewhere} visits of other rows); it cannot be resumed on another "
                "world size"
            )
        done = np.flatnonzero(counts).astype(np.int64)
        # nothing consumed yet (a checkpoint at an epoch boundary): the epoch's own plan for this shape
        self._replanned = (epoch, done) if done.size else None
        self._last_plan = None
        plan = self.plan_epoch(epoch)
        if plan.num_steps == 0:
            raise ValueError(
                f"checkpoint {path}: epoch {epoch} has consumed every training sample but was not finished; "
                "the checkpoint is inconsistent"
            )
        return plan, int(self.train_rows.size - done.size)

    def plan_record(self, plan: Plan) -> tuple[dict[str, Any], list[float] | None]:
        """The epoch's plan metrics as ``plan_*`` record entries (ACF of step mean length, recurrence, mix), and the
        ACF by lag (for a W&B table)."""
        drafter = self.config.drafter  # the drafter's block term counts this run's blocks
        cost = CostModel(block_size=drafter.block_size, num_anchors=drafter.num_anchors)
        metrics = plan_metrics(plan, next_epoch_plan=self.plan_epoch(plan.epoch + 1),
                               acf_lags=self.config.trainer.acf_lags, cost_model=cost)
        record = {f"plan_{key}": value for key, value in metrics.items()
                  if isinstance(value, (int, float, bool))
                  or (isinstance(value, list) and all(isinstance(v, (int, float)) for v in value))}
        acf = metrics.get("acf") or metrics.get("step_length_acf")
        return record, acf if isinstance(acf, list) else None

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"replanned": self._replanned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._replanned = state["replanned"]
        self._last_plan = None
