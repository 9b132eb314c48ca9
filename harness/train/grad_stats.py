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
global step's weight) and, on measured steps, records the squared norm of every bucket before and after
the all-reduce. One extra all-reduce of three scalars per measured step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class BucketNorms:
    """Squared gradient norms gathered by :func:`summing_comm_hook` over one backward."""

    active: bool = False
    local_sq: list[torch.Tensor] = field(default_factory=list)
    global_sq: list[torch.Tensor] = field(default_factory=list)
    group: Any = None  # the process group DDP reduces over (None: the whole job)

    def start(self) -> None:
        self.active = True
        self.local_sq.clear()
        self.global_sq.clear()

    def stop(self) -> tuple[float, float]:
        """(|g_rank|², |G|²) summed over buckets."""
        self.active = False
        local = float(sum(t.item() for t in self.local_sq))
        total = float(sum(t.item() for t in self.global_sq))
        return local, total


def summing_comm_hook(state, bucket):  # no annotations: DDP checks them, and they are strings here
    """DDP comm hook: all-reduce SUM of the bucket (DDP's default divides by world size).

    ``state`` is a :class:`BucketNorms`, ``bucket`` a ``dist.GradBucket``; returns a future of the
    reduced bucket.
    """
    buffer = bucket.buffer()
    if state.active:
        state.local_sq.append(buffer.detach().double().square().sum())
    future = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=state.group, async_op=True).get_future()

    def finished(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[0]
        if state.active:
            state.global_sq.append(reduced.detach().double().square().sum())
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
