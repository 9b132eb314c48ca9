"""Gradient diversity, measured: Yin et al.'s Δ and McCandlish et al.'s simple noise scale.

Small batches are the ranks (each rank's gradient before the all-reduce); on one rank they are the
gradient-accumulation micro-batches. With ``g_k`` the gradient contribution of small batch ``k`` to
the global objective (so the global gradient is ``G = Σ_k g_k``):

* Yin et al. 2018 (arXiv 1706.05699): ``Δ = Σ_k |g_k|² / |Σ_k g_k|²`` — about ``1/K`` when the small
  batches agree, about 1 when their gradients are orthogonal, more when they conflict.
* McCandlish et al. 2018 (arXiv 1812.06162): with ``G_k = g_k · W / W_k`` the gradient of small batch
  ``k``'s own mean loss (``W_k`` its loss weight, ``W = Σ W_k``), ``B_small = W / K``, ``B_big = W``:
  ``|G|² ≈ (B_big |G_big|² − B_small E|G_small|²) / (B_big − B_small)`` and
  ``tr Σ ≈ (E|G_small|² − |G_big|²) / (1/B_small − 1/B_big)``; ``B_simple = EMA(tr Σ) / EMA(|G|²)``,
  in units of loss weight (decayed supervised labels).

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
import torch.distributed as dist


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
    group: Any = None  # the process group DDP reduces over (None: the whole job)

    def start(self) -> None:
        self.active = True
        self.local_sq.clear()
        self.global_sq.clear()

    def stop(self) -> tuple[float, float]:
        """(|g_rank|², |G|²) summed over parameters."""
        self.active = False
        return math.fsum(self.local_sq.values()), math.fsum(self.global_sq.values())


def _squared_norms(bucket: Any) -> dict[int, float]:
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
        state.local_sq.update(_squared_norms(bucket))
    future = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=state.group, async_op=True).get_future()

    def finished(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[0]
        if state.active:  # the all-reduce was in place: the gradient views now hold the global gradient
            state.global_sq.update(_squared_norms(bucket))
        return reduced

    return future.then(finished)


def flat_grad(parameters: list[torch.nn.Parameter]) -> torch.Tensor:
    """All gradients in one fp64 vector (zeros for parameters without a gradient)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().reshape(-1)
                      for p in parameters])


class GradientNoise:
    """Turns small/big-batch norms into Δ and B_simple (with EMAs of |G|² and tr Σ)."""

    def __init__(self, ema: float) -> None:
        self.ema = ema
        self.g2_ema: float | None = None
        self.trace_ema: float | None = None

    def update(self, sum_small_sq: float, sum_small_mean_sq: float, num_small: int, big_sq: float,
               weight: float) -> dict[str, float]:
        """One measurement.

        Args:
            sum_small_sq: ``Σ_k |g_k|²`` (contributions to the global objective).
            sum_small_mean_sq: ``Σ_k |G_k|²`` (each small batch's own mean-loss gradient).
            num_small: ``K``, small batches with any loss weight.
            big_sq: ``|G|²`` of the global gradient.
            weight: ``W``, the global step's loss weight.
        """
        out = {"grad_diversity": math.nan, "grad_noise_scale": math.nan, "grad_norm_sq_big": big_sq,
               "grad_norm_sq_small": math.nan}
        if num_small < 2 or big_sq <= 0 or weight <= 0:
            return out
        out["grad_diversity"] = sum_small_sq / big_sq
        b_small, b_big = weight / num_small, weight
        small_sq = sum_small_mean_sq / num_small
        out["grad_norm_sq_small"] = small_sq
        g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
        trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
        if self.g2_ema is None:
            self.g2_ema, self.trace_ema = g2, trace
        else:
            self.g2_ema = self.ema * self.g2_ema + (1 - self.ema) * g2
            self.trace_ema = self.ema * self.trace_ema + (1 - self.ema) * trace
        out["grad_norm_sq_estimate"] = g2
        out["grad_trace_estimate"] = trace
        if self.g2_ema > 0:
            out["grad_noise_scale"] = self.trace_ema / self.g2_ema
        return out

    def state_dict(self) -> dict[str, float | None]:
        return {"g2_ema": self.g2_ema, "trace_ema": self.trace_ema}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        self.g2_ema, self.trace_ema = state["g2_ema"], state["trace_ema"]


class GradientStatistics:
    """Measures Δ and B_simple every ``every`` optimizer steps and reports them in every step's record.

    Small batches are the ranks (norms from :func:`summing_comm_hook`, whose state :attr:`bucket_norms`
    is) or, on one rank, the accumulation micro-batches (each one's contribution to the accumulated
    gradient). Checkpointed: the EMAs and the last measured values (:meth:`state_dict`)."""

    state_version = 1

    def __init__(self, parameters: list[torch.nn.Parameter], comm: Any, every: int, ema: float) -> None:
        self.parameters = parameters
        self.comm = comm
        self.every = every
        self.bucket_norms = BucketNorms(group=comm.group)
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
            self._small_sq = self._small_mean_sq = 0.0
            self._small_count = 0

    def micro_batch_done(self, weight_sum: float, global_weight: float) -> None:
        """After a micro-batch's backward: its contribution to the gradient (accumulation mode only)."""
        if self._mode != "accumulation":
            return
        current = flat_grad(self.parameters)
        contribution = current - self._previous
        self._previous = current
        if weight_sum > 0:
            norm_sq = float(contribution.square().sum())
            self._small_sq += norm_sq
            self._small_mean_sq += norm_sq * (global_weight / weight_sum) ** 2
            self._small_count += 1

    def end_step(self, global_weight: float, local_weight: float) -> dict[str, Any]:
        """After the last backward (before clipping): the step's gradient-statistics record entries."""
        stats: dict[str, float] = {}
        if self._mode == "ranks":
            local_sq, big_sq = self.bucket_norms.stop()
            mean_sq = local_sq * (global_weight / local_weight) ** 2 if local_weight > 0 else 0.0
            reduced = self.comm.all_reduce_sum(torch.tensor([local_sq, mean_sq, float(local_weight > 0)],
                                                            dtype=torch.float64))
            stats = self.noise.update(float(reduced[0]), float(reduced[1]), int(reduced[2]), big_sq, global_weight)
        elif self._mode == "accumulation":
            big_sq = float(self._previous.square().sum())
            stats = self.noise.update(self._small_sq, self._small_mean_sq, self._small_count, big_sq, global_weight)
            self._previous = None
        record = {k: v for k, v in stats.items() if k not in ("grad_diversity", "grad_noise_scale")}
        if stats:
            self.last_diversity, self.last_noise_scale = stats["grad_diversity"], stats["grad_noise_scale"]
        record.update(grad_diversity=self.last_diversity, grad_noise_scale=self.last_noise_scale,
                      grad_stats_measured=bool(stats))
        return record

    def state_dict(self) -> dict[str, Any]:
        return {**self.noise.state_dict(), "last_diversity": self.last_diversity,
                "last_noise_scale": self.last_noise_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.noise.load_state_dict(state)
        self.last_diversity, self.last_noise_scale = state["last_diversity"], state["last_noise_scale"]
