"""A torch batch sampler that yields this rank's micro-batches of a batchlab strategy's plan, and resumes mid-epoch.

``DataLoader(dataset, batch_sampler=StrategyBatchSampler(dataset=dataset, max_tokens=8192, strategy="packed"),
collate_fn=...)``: every rank plans the whole epoch from the same ``(seed, epoch)`` and yields its own micro-batches,
so no communication is needed and every sample is visited exactly once per epoch across the ranks. Rationale:
docs/design/other-trainers.md; the strategies: docs/concepts/strategies.md.
"""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import asdict
from typing import Any, Iterator

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler

from strategies import Budget, Plan, RankBalance, Strategy, build_strategy, plan_remainder
from strategies.metrics import plan_metrics

from .lengths import TOKENS_COLUMN, resolve_lengths

#: the layout of :meth:`StrategyBatchSampler.state_dict` (a newer or older one is refused, never half-read)
STATE_FORMAT = 1
#: fingerprint fields a resume may change: they only lay the same samples out on ranks and accumulation micro-steps
LAYOUT_FIELDS = ("world_size", "grad_accum")


class SamplerStateError(ValueError):
    """A ``state_dict`` that was written for another plan (or another format) than this sampler's."""


class StrategyBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches of one epoch of a strategy's plan, for ``DataLoader(batch_sampler=...)``.

    Args:
        lengths: the samples' token lengths: a sequence, a ``datasets`` column name, a callable of the index, or
            None to read them from ``dataset`` (:func:`batchlab.lengths.resolve_lengths`).
        max_tokens: the token budget of one micro-batch (``rows x longest`` padded, the row's capacity packed).
        strategy: a registered strategy name (``strategies.available_strategies()``) or a ``Strategy`` object.
        dataset: the dataset the indices are for; when given, the lengths are checked against it.
        strategy_options: the strategy's options by name (``{"num_buckets": 32}``).
        max_samples: optional cap on the samples of one micro-batch.
        seed: every random choice of the plan flows from ``(seed, epoch)``.
        rank, world_size: this process's place; None reads them from ``torch.distributed`` (which torchrun,
            accelerate and the ``Trainer`` initialise), else one process.
        grad_accum: micro-batches of one rank in an optimizer step.
        step_tokens: None, or the real tokens of every optimizer step (equal-token steps: a rank's micro-batches per
            step then vary; :meth:`step_boundaries` says where each step ends).
        oversize: ``"error"``, ``"truncate"`` or ``"drop"`` for samples longer than ``max_tokens``.
        balance: None, or a ``strategies.RankBalance`` (or a dict of its fields) to balance ranks by cost.
        tokens_column: the field of a sample that holds its tokens (for reading and checking lengths).
    """

    def __init__(self, lengths: Any = None, *, max_tokens: int, strategy: str | Strategy = "packed",
                 dataset: Any = None, strategy_options: dict[str, Any] | None = None, max_samples: int | None = None,
                 seed: int = 0, rank: int | None = None, world_size: int | None = None, grad_accum: int = 1,
                 step_tokens: int | None = None, oversize: str = "error", balance: Any = None,
                 tokens_column: str = TOKENS_COLUMN) -> None:
        self.lengths = resolve_lengths(lengths, dataset, tokens_column)
        self.strategy = _strategy(strategy, strategy_options or {})
        self.budget = Budget(max_tokens, max_samples)
        self.rank, self.world_size = process_position(rank, world_size)
        self.grad_accum = grad_accum
        self.seed = seed
        self.oversize = oversize
        self.balance = RankBalance.coerce(balance)
        self.step_tokens = step_tokens
        self.fingerprint = {
            "samples": int(self.lengths.size),
            "lengths_sha256": hashlib.sha256(np.ascontiguousarray(self.lengths, dtype=np.int64).tobytes()).hexdigest(),
            "max_tokens": int(max_tokens), "max_samples": max_samples, "strategy": self.strategy.name,
            "strategy_options": self.strategy.options(), "seed": int(seed), "oversize": oversize,
            "balance": None if self.balance is None else asdict(self.balance), "step_tokens": step_tokens,
        }
        self._start = 0  # where the next iteration starts (a restored position, else 0)
        self._yielded = 0  # micro-batches of this rank the current iteration has handed out
        self.restart(0)

    # ------------------------------------------------------------------ the torch Sampler protocol
    @property
    def layout(self) -> str:
        """``"packed"`` (one row of concatenated documents per micro-batch) or ``"padded"``."""
        return self.strategy.layout

    def set_epoch(self, epoch: int) -> None:
        """Plan ``epoch`` (a no-op for the epoch already planned, so a restored position survives it)."""
        if epoch != self.epoch:
            self.restart(epoch)

    def restart(self, epoch: int) -> None:
        """Plan the whole of ``epoch`` and start at its first micro-batch, whatever was planned or restored before."""
        self._use_plan(epoch, self._plan(epoch), consumed_before=None)

    def __iter__(self) -> Iterator[list[int]]:
        start, self._start = self._start, 0
        indices, offsets = self.plan.sample_indices, self.plan.micro_batch_offsets
        self._yielded = start
        for slot in self._slots[start:]:
            self._yielded += 1
            yield indices[offsets[slot]:offsets[slot + 1]].tolist()

    def __len__(self) -> int:
        """This rank's micro-batches in the epoch (empty ones of a short last step included)."""
        return int(self._slots.size)

    # ------------------------------------------------------------------ steps
    @property
    def num_steps(self) -> int:
        """Optimizer steps in the epoch (the same on every rank)."""
        return self.plan.num_steps

    def step_boundaries(self) -> np.ndarray:
        """``[num_steps + 1]`` offsets into this rank's micro-batches: step ``s`` is ``[b[s], b[s + 1])``.

        Fixed accumulation: every ``grad_accum``. Equal-token steps: a rank's real micro-batches of a step, or one
        empty micro-batch where it has none (it still joins the step's synchronised backward).
        """
        return self._boundaries.copy()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Where the epoch stands: resumed with :meth:`load_state_dict`, the next iteration continues after the last
        micro-batch handed out (on another world size or accumulation, the rest of the epoch is re-planned)."""
        position = self._yielded if self._start == 0 else self._start
        steps_done = int(np.searchsorted(self._boundaries, position, side="right") - 1)
        return {**self.state_for(self.epoch, steps_done, _encode(self._consumed_before)), "position": position}

    def state_for(self, epoch: int, steps_done: int, consumed_before: str | None = None) -> dict[str, Any]:
        """The state after ``steps_done`` whole optimizer steps of ``epoch``'s plan at this shape, the plan being the
        rest of the epoch after ``consumed_before`` (an encoded state field) when given: for trainers that count steps,
        so a checkpoint is exact whatever the loader has prefetched."""
        return {
            "format": STATE_FORMAT, "fingerprint": dict(self.fingerprint), "epoch": int(epoch),
            "steps_done": int(steps_done), "position": None, "rank": self.rank, "world_size": self.world_size,
            "grad_accum": self.grad_accum, "consumed_before": consumed_before,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` stood; refused, naming each field, when it was written for another plan."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise SamplerStateError(
                f"not a StrategyBatchSampler state of format {STATE_FORMAT} (got {_describe(state)}); resume with the "
                "state_dict() of this batchlab version's sampler"
            )
        differences = [f"{key}: state {state['fingerprint'].get(key)!r}, now {value!r}"
                       for key, value in self.fingerprint.items() if state["fingerprint"].get(key) != value]
        if differences:
            raise SamplerStateError(
                f"the state was written for another plan, so resuming would not continue the same epoch: "
                f"{'; '.join(differences)}. Build the sampler with the state's settings (only world_size and grad_accum "
                "may change), or start the epoch afresh without load_state_dict"
            )
        epoch, steps_done = int(state["epoch"]), int(state["steps_done"])
        before = _decode(state["consumed_before"], self.lengths.size)
        saved_shape = (int(state["world_size"]), int(state["grad_accum"]))
        saved = self._plan(epoch, before, *saved_shape)
        if saved_shape == (self.world_size, self.grad_accum):
            self._use_plan(epoch, saved, before)
            same_rank = state.get("rank") == self.rank and state.get("position") is not None
            self._start = int(state["position"]) if same_rank else int(self._boundaries[steps_done])
            return
        done = saved.sample_indices[:saved.micro_batch_offsets[steps_done * saved.micro_batches_per_step]]
        consumed = np.zeros(self.lengths.size, dtype=bool)
        consumed[done] = True
        if before is not None:
            consumed |= before
        self._use_plan(epoch, self._plan(epoch, consumed), consumed)
        self._start = 0

    # ------------------------------------------------------------------ what the plan looks like
    def plan_metrics(self, **options: Any) -> dict[str, Any]:
        """The epoch's plan metrics (``strategies.metrics.plan_metrics``): ``padding_efficiency``, ``recurrence``
        (against the next epoch's plan), ``length_mix_excess``, ``rank_imbalance`` and the rest."""
        if self.balance is not None:
            options.setdefault("cost_model", self.balance.cost_model)
        return plan_metrics(self.plan, next_epoch_plan=self._plan(self.epoch + 1), **options)

    def collator(self, **options: Any) -> Any:
        """The collator of this sampler's layout (:func:`batchlab.collate.collator_for`), truncating at the budget."""
        from .collate import collator_for

        return collator_for(self.layout, max_tokens=self.budget.max_tokens, **options)

    # ------------------------------------------------------------------ internals
    def _plan(self, epoch: int, consumed: np.ndarray | None = None, world_size: int | None = None,
              grad_accum: int | None = None) -> Plan:
        shape = dict(seed=self.seed, epoch=epoch, world_size=world_size or self.world_size,
                     grad_accum=grad_accum or self.grad_accum, oversize=self.oversize, balance=self.balance,
                     step_tokens=self.step_tokens)
        if consumed is None:
            return self.strategy.plan(self.lengths, self.budget, **shape)
        return plan_remainder(self.strategy, self.lengths, consumed, self.budget, **shape)

    def _use_plan(self, epoch: int, plan: Plan, consumed_before: np.ndarray | None) -> None:
        samples = plan.micro_batch_sizes().reshape(plan.num_steps, plan.world_size, plan.grad_accum).sum(axis=(0, 2))
        if consumed_before is None and plan.num_steps and (samples == 0).any():  # the rest of an epoch may run dry
            raise ValueError(
                f"epoch {epoch}: world_size={plan.world_size} leaves rank {int(np.argmin(samples))} without a single "
                f"sample: the plan has {int((plan.micro_batch_sizes() > 0).sum())} micro-batches of "
                f"max_tokens={plan.budget.max_tokens} for {plan.world_size * plan.grad_accum} slots a step. Use fewer "
                "ranks, a smaller max_tokens or grad_accum, or more samples"
            )
        self.epoch, self.plan, self._consumed_before = epoch, plan, consumed_before
        self._start = self._yielded = 0
        counts = plan.rank_step_slots()[:, self.rank]
        steps = np.repeat(np.arange(plan.num_steps), counts)
        within = np.arange(steps.size) - np.repeat(np.cumsum(counts) - counts, counts)
        self._slots = (steps * plan.world_size + self.rank) * plan.grad_accum + within
        self._boundaries = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def process_position(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)`` as given, else from ``torch.distributed``, else one process (refused where the
    environment says several processes were launched but none initialised a process group)."""
    if rank is None or world_size is None:
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError(
                f"WORLD_SIZE={os.environ['WORLD_SIZE']} says this is one of several processes, but torch.distributed is "
                "not initialised, so this rank cannot know its place: call torch.distributed.init_process_group (or "
                "create the Accelerator / TrainingArguments) first, or pass rank= and world_size="
            )
        else:
            rank = 0 if rank is None else rank
            world_size = 1 if world_size is None else world_size
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"rank={rank!r}, world_size={world_size!r}: need integers with 0 <= rank < world_size")
    return rank, world_size


def _strategy(strategy: str | Strategy, options: dict[str, Any]) -> Strategy:
    if isinstance(strategy, Strategy):
        if options:
            raise ValueError("strategy_options given with a Strategy object; set them on the object instead")
        return strategy
    return build_strategy(strategy, **options)


def _encode(mask: np.ndarray | None) -> str | None:
    return None if mask is None else base64.b64encode(np.packbits(mask).tobytes()).decode("ascii")


def _decode(text: str | None, size: int) -> np.ndarray | None:
    if text is None:
        return None
    return np.unpackbits(np.frombuffer(base64.b64decode(text), dtype=np.uint8), count=size).astype(bool)


def _describe(state: Any) -> str:
    if not isinstance(state, dict):
        return type(state).__name__
    return f"format {state.get('format')!r}"
