"""One optimizer step's numbers: what each rank measures, gathered from every rank by name, and the step's record.

:class:`StepStats` is one rank's measurements of a step; :meth:`StepStats.gather` all-gathers every field at
once (one flat fp64 tensor, laid out by the dataclass's fields) into :class:`RankStats`, which reads them
back by name; :func:`step_record` turns that into the record ``metrics.jsonl`` and W&B get. **Adding a
metric** is one field here (filled where it is measured): a field declared with ``stat(report=...)`` is
logged as that reduction over the ranks under its own name (or ``as_``), one declared without is an input of
:func:`step_record`'s derived metrics; then its column in the report (:mod:`analysis.compare`) if it
belongs there. The held-out evaluation reduces :class:`~harness.models.drafter_loss.DrafterLoss` the same
way (:func:`reduce_sum`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch

#: reductions over the ranks a field can be reported with
REDUCTIONS = {
    "sum": lambda values: float(values.sum()),
    "mean": lambda values: float(values.mean()),
    "max": lambda values: float(values.max()),
}


def stat(report: str | None = None, as_: str | None = None, integer: bool = False) -> Any:
    """A scalar field of :class:`StepStats`: ``report`` its reduction over ranks in the record (None: not logged
    as such), ``as_`` the record's name for it (default: the field's), ``integer`` logged as an int."""
    if report is not None and report not in REDUCTIONS:
        raise ValueError(f"report={report!r} is not one of {sorted(REDUCTIONS)}")
    return field(default=0.0, metadata={"report": report, "as": as_, "integer": integer})


def per_position() -> Any:
    """A vector field of :class:`StepStats` (one value per block slot 1 .. B-1)."""
    return field(default_factory=lambda: torch.zeros(0, dtype=torch.float64), metadata={"vector": True})


@dataclass
class StepStats:
    """One rank's numbers of one optimizer step (every rank fills its own; :meth:`gather` collects them)."""

    real_tokens: float = stat("sum", integer=True)
    computed_slots: float = stat("sum", integer=True)
    micro_batches: float = stat("sum", integer=True)  # non-empty ones
    samples: float = stat()
    length_sum: float = stat()
    length_sq_sum: float = stat()
    # the drafter's loss sums over this rank's micro-batches (:class:`~harness.models.drafter_loss.DrafterLoss`)
    weighted_ce_sum: float = stat()
    weight_sum: float = stat()
    correct_sum: float = stat()
    label_count: float = stat()
    draft_vocab_misses: float = stat()
    tau_sum: float = stat()
    block_count: float = stat("sum", as_="blocks", integer=True)
    blocks_computed: float = stat()
    blocks_capped: float = stat("sum", integer=True)
    # seconds: the whole step on this rank (data wait included), and its stages
    step_time: float = stat()
    data_wait: float = stat("mean", as_="time_data")
    target_time: float = stat("mean", as_="time_target")
    drafter_time: float = stat("mean", as_="time_drafter")
    stop_requested: float = stat()
    peak_memory_mb: float = stat("max")
    nonfinite: float = stat()
    correct_per_position: torch.Tensor = per_position()
    count_per_position: torch.Tensor = per_position()

    @classmethod
    def measure(cls, batches: list[Any], sums: Any, **timings: float) -> StepStats:
        """This rank's stats of a step from its micro-batches (:class:`~harness.train.batch.TrainingBatch`), their
        summed :class:`~harness.models.drafter_loss.DrafterLoss` and the other fields by name (times, flags)."""
        lengths = torch.cat([b.lengths for b in batches]).double()
        loss_sums = {name: float(getattr(sums, name)) for name in (
            "weighted_ce_sum", "weight_sum", "correct_sum", "label_count", "draft_vocab_misses", "tau_sum", "block_count",
            "blocks_computed")}
        return cls(
            real_tokens=float(lengths.sum()), computed_slots=float(sum(b.computed_slots for b in batches)),
            micro_batches=float(sum(not b.empty for b in batches)),
            samples=float(lengths.numel()), length_sum=float(lengths.sum()),
            length_sq_sum=float(lengths.square().sum()), **loss_sums,
            blocks_capped=float(sum(b.drafter.num_blocks_capped for b in batches if not b.empty)),
            nonfinite=float(not math.isfinite(loss_sums["weighted_ce_sum"])),
            correct_per_position=sums.correct_per_position, count_per_position=sums.count_per_position,
            **{name: float(value) for name, value in timings.items()},
        )

    def vector(self) -> torch.Tensor:
        """Every field in one fp64 vector, in field order."""
        parts = [getattr(self, f.name).detach().double().cpu().reshape(-1) if f.metadata.get("vector")
                 else torch.tensor([float(getattr(self, f.name))], dtype=torch.float64) for f in fields(self)]
        return torch.cat(parts)

    def gather(self, comm: Any) -> RankStats:
        """Every rank's stats (a collective: every rank calls it with vectors of the same length)."""
        return RankStats(comm.all_gather(self.vector()), self._layout(), type(self))

    def _layout(self) -> dict[str, slice]:
        layout, start = {}, 0
        for f in fields(self):
            size = getattr(self, f.name).numel() if f.metadata.get("vector") else 1
            layout[f.name] = slice(start, start + size) if f.metadata.get("vector") else start
            start += size
        return layout


class RankStats:
    """Every rank's :class:`StepStats`: ``stats["real_tokens"]`` is a ``[world]`` tensor (``[world, n]`` for a
    vector field), ``stats.total(name)`` its sum over ranks."""

    def __init__(self, matrix: torch.Tensor, layout: dict[str, Any], stats_class: type = StepStats) -> None:
        self.matrix = matrix
        self.layout = layout
        self.stats_class = stats_class

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.matrix[:, self.layout[name]]

    def total(self, name: str) -> float:
        return float(self[name].sum())

    def reported(self) -> dict[str, Any]:
        """The fields declared with ``report=``, reduced over ranks, under their record names."""
        out = {}
        for f in fields(self.stats_class):
            reduce = f.metadata.get("report")
            if reduce is not None:
                value = REDUCTIONS[reduce](self[f.name])
                out[f.metadata.get("as") or f.name] = int(value) if f.metadata.get("integer") else value
        return out


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan


def step_record(stats: RankStats, grad_norm: float, lr: float, optimizer_time: float) -> dict[str, Any]:
    """The step's record: the reported fields plus the metrics derived from the gathered sums."""
    totals = {name: stats.total(name) for name in stats.layout if not isinstance(stats.layout[name], slice)}
    step_time = float(stats["step_time"].max()) + optimizer_time
    busy = stats["target_time"] + stats["drafter_time"]
    weight_sum = stats["weight_sum"]
    rank_losses = torch.where(weight_sum > 0, stats["weighted_ce_sum"] / weight_sum.clamp_min(1e-30),
                              torch.full_like(weight_sum, -math.inf))
    samples = totals["samples"]
    mean_length = _ratio(totals["length_sum"], samples)
    correct_pos = stats["correct_per_position"].sum(0)
    count_pos = stats["count_per_position"].sum(0)
    record = stats.reported()
    record.update({
        "loss": _ratio(totals["weighted_ce_sum"], totals["weight_sum"]),
        "loss_max_rank": float(rank_losses.max()),
        "accuracy": _ratio(totals["correct_sum"], totals["label_count"]),
        # labels outside the draft vocabulary (0 without one): counted as misses in accuracy and τ
        "draft_vocab_miss_rate": _ratio(totals["draft_vocab_misses"], totals["label_count"]),
        "accuracy_per_position": (correct_pos / count_pos.clamp_min(1)).tolist(),
        "tau": _ratio(totals["tau_sum"], totals["block_count"]),
        "padding_ratio": 1.0 - totals["real_tokens"] / totals["computed_slots"] if totals["computed_slots"] else 0.0,
        "drafter_block_efficiency": _ratio(totals["block_count"], totals["blocks_computed"]),
        "tokens_per_second": totals["real_tokens"] / step_time if step_time > 0 else math.nan,
        "rank_tokens_per_second": (stats["real_tokens"] / busy.clamp_min(1e-9)).tolist(),
        "step_time": step_time,
        "time_optimizer_comm": max(step_time - float((stats["data_wait"] + busy).mean()), 0.0),
        "data_wait_fraction": float(stats["data_wait"].mean()) / step_time if step_time > 0 else math.nan,
        "lr": lr, "grad_norm": grad_norm, "samples_per_step": int(samples),
        "step_mean_length": mean_length,
        "step_length_std": (math.sqrt(max(totals["length_sq_sum"] / samples - mean_length ** 2, 0.0))
                            if samples else math.nan),
        "rank_imbalance": float(busy.max() / busy.mean()) if float(busy.mean()) > 0 else math.nan,
    })
    return record


def reduce_sum(sums: Any, comm: Any) -> Any:
    """A dataclass of tensors (e.g. :class:`~harness.models.drafter_loss.DrafterLoss`) summed over the ranks,
    field by field, in one all-reduce; fp64 on the host."""
    names = [f.name for f in fields(sums)]
    values = [getattr(sums, name).detach().double().cpu().reshape(-1) for name in names]
    reduced = comm.all_reduce_sum(torch.cat(values)).split([v.numel() for v in values])
    return type(sums)(**{name: value.reshape(getattr(sums, name).shape) for name, value in zip(names, reduced)})
