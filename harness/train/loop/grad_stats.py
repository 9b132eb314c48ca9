"""Gradient noise and diversity, measured: McCandlish et al.'s simple noise scale and the Δ it implies.

Small batches are the ranks (each rank's gradient before the all-reduce); on one rank they are the
gradient-accumulation micro-batches. With ``g_k`` the gradient contribution of small batch ``k`` to
the global objective (so the step's gradient is ``G_W = Σ_k g_k``), ``W_k`` its loss weight and
``W = Σ W_k``, its own mean-loss gradient is ``G_k = g_k · W / W_k``:

* McCandlish et al. 2018 (arXiv 1812.06162, App. A): a batch of weight ``b`` has ``E|G_b|² = |G|² + tr Σ / b``.
  Each small batch with the step gives an unbiased pair of estimates whatever its size
  (:func:`small_batch_estimates`): ``|G|² ≈ (W |G_W|² − W_k |G_k|²) / (W − W_k)`` and
  ``tr Σ ≈ (|G_k|² − |G_W|²) / (1/W_k − 1/W)``, averaged over the small batches;
  ``B_simple = EMA(tr Σ) / EMA(|G|²)``, in units of loss weight (decayed supervised labels).
* Yin et al. 2018 (arXiv 1706.05699): Δ of ``n`` samples ``= Σ_i |∇_i|² / |Σ_i ∇_i|²``; for the step's
  unit-weight samples it is ``(1 + B_simple) / (W + B_simple)``, which is what ``grad_diversity`` reports. It
  falls as a step holds more weight: documents weigh about alike (anchors are capped per document), so a
  strategy whose steps hold few documents (sorted) shows a high Δ whatever its gradients. Compare strategies by
  ``grad_sample_diversity = 1 + B_simple = E|∇_i|² / |E ∇_i|²`` of one unit of weight instead: 1 when every
  sample's gradient is the step's mean, larger as they disagree, with no step size in it (validated on
  synthetic gradients with a known answer: ``benchmarks/diversity_estimator.py``).
  Δ *between micro-batches or ranks* is not reported: with identical per-sample gradients it equals
  ``Σ (W_k / W)²``, which differs by strategy with no gradient difference at all.

On several ranks the norms come out of the gradient all-reduce itself: :func:`summing_comm_hook` is a
DDP communication hook that sums (no division by world size: the loss is already normalised by the
global step's weight) and, on measured steps, records every parameter's squared gradient norm before and
after the all-reduce. One extra all-reduce of three scalars per measured step. :class:`GradientStatistics`
is the trainer's component that decides which steps are measured and how.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class BucketNorms:
    """Squared gradient norms gathered by :func:`summing_comm_hook` over one backward, per parameter.

    Kept per parameter (keyed by its storage) and summed exactly (``math.fsum``) so that the result does
    not depend on how DDP lays parameters out in buckets or in which order buckets finish: DDP rebuilds
    its buckets after its first step, so a resumed run's first step sees another layout than the
    uninterrupted run's, and per-bucket float sums would differ in the last bits."""

    active: bool = False
    local_sq: dict[int, float] = field(default_factory=dict)
    global_sq: dict[int, float] = field(default_factory=dict)
    comm: Any = None  # the Collectives of the group DDP reduces over (None: one rank, nothing to reduce)

    def start(self) -> None:
        self.active = True
        self.local_sq.clear()
        self.global_sq.clear()

    def stop(self) -> tuple[float, float]:
        """(|g_rank|², |G|²) summed over parameters."""
        self.active = False
        return math.fsum(self.local_sq.values()), math.fsum(self.global_sq.values())


def squared_norms(bucket: Any) -> dict[int, float]:
    """Each parameter's squared gradient norm in ``bucket`` (its gradients are views of the bucket's buffer)."""
    return {param.data_ptr(): float(grad.detach().double().square().sum())
            for param, grad in zip(bucket.parameters(), bucket.gradients())}


def summing_comm_hook(state, bucket):  # no annotations: DDP checks them, and they are strings here
    """DDP comm hook: all-reduce SUM of the bucket (DDP's default divides by world size).

    ``state`` is a :class:`BucketNorms`, ``bucket`` a ``dist.GradBucket``; returns a future of the
    reduced bucket.
    """
    buffer = bucket.buffer()
    if state.active:
        state.local_sq.update(squared_norms(bucket))
    future = state.comm.all_reduce_sum_future(buffer)

    def finished(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[0]
        if state.active:  # the all-reduce was in place: the gradient views now hold the global gradient
            state.global_sq.update(squared_norms(bucket))
        return reduced

    return future.then(finished)


def flat_grad(parameters: list[torch.nn.Parameter]) -> torch.Tensor:
    """All gradients in one fp64 vector (zeros for parameters without a gradient)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().reshape(-1)
                      for p in parameters])


def small_batch_estimates(own_sq: float, weight: float, big_sq: float, total_weight: float) -> tuple[float, float] | None:
    """``(|G|², tr Σ)`` estimated from one small batch of loss weight ``weight`` whose own mean-loss gradient has
    squared norm ``own_sq``, and the step's gradient (squared norm ``big_sq``, weight ``total_weight``).

    With ``E|G_b|² = |G|² + tr Σ / b`` for a batch of weight ``b`` (McCandlish et al. 2018, App. A), the two
    equations for ``b = weight`` and ``b = total_weight`` give both unknowns, unbiased whatever the small batch's
    size; None when the small batch is empty or is the whole step (no information)."""
    if weight <= 0 or weight >= total_weight:
        return None
    trace = (own_sq - big_sq) / (1.0 / weight - 1.0 / total_weight)
    g2 = (total_weight * big_sq - weight * own_sq) / (total_weight - weight)
    return g2, trace


class GradientNoise:
    """Turns the per-step estimates of |G|² and tr Σ into the simple noise scale and a split-free diversity.

    ``B_simple = EMA(tr Σ) / EMA(|G|²)`` (a ratio of EMAs, never an EMA of ratios), in units of loss weight.
    ``grad_diversity`` is Yin et al.'s Δ of the step's unit-weight samples implied by it,
    ``(1 + B_simple) / (W + B_simple)`` (``W`` the step's loss weight): unlike Δ between a step's micro-batches
    or ranks, whose floor is ``Σ (W_k / W)²``, it does not move when the same gradients are split differently.
    Never NaN once a step was measured: a negative EMA of tr Σ counts as 0 (no noise seen), and the EMA of
    |G|² is held at least :data:`G2_FLOOR` of the EMA of the step gradient's own squared norm (the noise then
    dominates; ``grad_noise_floored`` says so)."""

    #: the least share of the step gradient's squared norm that |G|² is held at in the noise scale
    G2_FLOOR = 1e-3

    def __init__(self, ema: float) -> None:
        self.ema = ema
        self.g2_ema: float | None = None
        self.trace_ema: float | None = None
        self.big_ema: float | None = None

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else self.ema * old + (1 - self.ema) * new

    def update(self, g2_sum: float, trace_sum: float, count: int, big_sq: float, weight: float) -> dict[str, Any]:
        """One measured step: the sums of :func:`small_batch_estimates` over its ``count`` informative small batches,
        the step gradient's squared norm and the step's loss weight. Returns the step's record entries (empty when
        nothing could be estimated: fewer than one informative small batch, or a zero gradient)."""
        if count < 1 or big_sq <= 0 or weight <= 0:
            return {}
        g2, trace = g2_sum / count, trace_sum / count
        self.g2_ema = self._average(self.g2_ema, g2)
        self.trace_ema = self._average(self.trace_ema, trace)
        self.big_ema = self._average(self.big_ema, big_sq)
        floor = self.G2_FLOOR * self.big_ema
        scale = max(self.trace_ema, 0.0) / max(self.g2_ema, floor)
        return {"grad_norm_sq_big": big_sq, "grad_norm_sq_estimate": g2, "grad_trace_estimate": trace,
                "grad_noise_scale": scale, "grad_diversity": (1.0 + scale) / (weight + scale),
                "grad_sample_diversity": 1.0 + scale, "grad_noise_floored": self.g2_ema < floor}

    def state_dict(self) -> dict[str, float | None]:
        return {"g2_ema": self.g2_ema, "trace_ema": self.trace_ema, "big_ema": self.big_ema}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        self.g2_ema, self.trace_ema, self.big_ema = state["g2_ema"], state["trace_ema"], state["big_ema"]


class GradientStatistics:
    """Measures Δ and B_simple every ``every`` optimizer steps and reports them in every step's record.

    Small batches are the ranks (norms from :func:`summing_comm_hook`, whose state :attr:`bucket_norms`
    is) or, on one rank, the accumulation micro-batches (each one's contribution to the accumulated
    gradient). Checkpointed: the EMAs and the last measured values (:meth:`state_dict`)."""

    state_version = 2  # 2: unequal-size estimators, the step gradient's EMA

    def __init__(self, parameters: list[torch.nn.Parameter], comm: Any, every: int, ema: float) -> None:
        self.parameters = parameters
        self.comm = comm
        self.every = every
        self.bucket_norms = BucketNorms(comm=comm)
        self.noise = GradientNoise(ema)
        self.last_diversity = math.nan
        self.last_noise_scale = math.nan
        self._mode: str | None = None  # "ranks", "accumulation" or None on the current step

    def start_step(self, step: int, num_micro_batches: int) -> None:
        """Before the first backward of optimizer step ``step`` (counted from 1)."""
        self._mode = None
        if step % self.every:
            return
        if self.comm.env.distributed:
            self._mode = "ranks"
            self.bucket_norms.start()
        elif num_micro_batches > 1:
            self._mode = "accumulation"
            self._previous = flat_grad(self.parameters)
            self._small: list[tuple[float, float]] = []  # (|contribution|², weight) of each micro-batch

    def micro_batch_done(self, weight_sum: float) -> None:
        """After a micro-batch's backward: its contribution to the gradient (accumulation mode only)."""
        if self._mode != "accumulation":
            return
        current = flat_grad(self.parameters)
        contribution = current - self._previous
        self._previous = current
        if weight_sum > 0:
            self._small.append((float(contribution.square().sum()), weight_sum))

    def end_step(self, global_weight: float, local_weight: float, divisor: float | None = None) -> dict[str, Any]:
        """After the last backward (before clipping): the step's gradient-statistics record entries. ``divisor``: what
        the step's loss was divided by when not its Σw (``optim.loss_normaliser=epoch``): the gradients are then
        ``W / divisor`` times the mean-loss gradients the estimators take, and are scaled back here."""
        stats: dict[str, Any] = {}
        rescale = 1.0 if divisor is None or global_weight <= 0 else (divisor / global_weight) ** 2
        if self._mode == "ranks":  # each rank estimates from its own share; one all-reduce sums the estimates
            local_sq, big_sq = self.bucket_norms.stop()
            local_sq, big_sq = local_sq * rescale, big_sq * rescale
            mine = [(local_sq, local_weight)] if local_weight > 0 else []
            sums = self.comm.all_reduce_sum(torch.tensor(self._estimate(mine, big_sq, global_weight),
                                                         dtype=torch.float64))
            stats = self.noise.update(float(sums[0]), float(sums[1]), int(sums[2]), big_sq, global_weight)
        elif self._mode == "accumulation":
            big_sq = float(self._previous.square().sum()) * rescale
            small = [(sq * rescale, w) for sq, w in self._small]
            stats = self.noise.update(*self._estimate(small, big_sq, global_weight), big_sq, global_weight)
            self._previous = None
        record = {k: v for k, v in stats.items()
                  if k not in ("grad_diversity", "grad_noise_scale", "grad_sample_diversity")}
        if stats:
            self.last_diversity, self.last_noise_scale = stats["grad_diversity"], stats["grad_noise_scale"]
        record.update(grad_diversity=self.last_diversity, grad_noise_scale=self.last_noise_scale,
                      grad_sample_diversity=1.0 + self.last_noise_scale, grad_stats_measured=bool(stats))
        return record

    @staticmethod
    def _estimate(small: list[tuple[float, float]], big_sq: float, weight: float) -> list[float]:
        """``[Σ |G|² estimates, Σ tr Σ estimates, informative small batches]`` of ``(|contribution|², weight)``
        pairs; a contribution ``g_k = (W_k / W) G_k`` gives its own mean-loss gradient ``G_k``."""
        found = [small_batch_estimates(sq * (weight / w) ** 2, w, big_sq, weight) for sq, w in small]
        found = [f for f in found if f is not None]
        return [sum(g2 for g2, _ in found), sum(trace for _, trace in found), float(len(found))]

    def state_dict(self) -> dict[str, Any]:
        return {**self.noise.state_dict(), "last_diversity": self.last_diversity,
                "last_noise_scale": self.last_noise_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.noise.load_state_dict(state)
        self.last_diversity, self.last_noise_scale = state["last_diversity"], state["last_noise_scale"]
