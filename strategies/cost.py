"""Cost model of one micro-batch: ``a * slots + b * sum(len^2)``.

The linear term is everything that scales with computed token slots (projections, MLP, GDN); the
quadratic term is full attention. A padded row attends over its padded length, so its quadratic
term is ``rows * max_len^2``; a packed row attends per document, so it is ``sum(len_i^2)``.

Default ``b``: per token, a full-attention layer spends about ``4 * L * d`` FLOPs on scores and
values against ``~24 * d^2`` for its projections and MLP; with one full-attention layer in four
that makes ``b / a ~ 1 / (6 * d * 4)``, about ``8e-6`` for a 5120-wide target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .epoch_plan import segment_reduce


@dataclass(frozen=True)
class CostModel:
    a: float = 1.0
    b: float = 8e-6

    def __post_init__(self) -> None:
        for name in ("a", "b"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise ValueError(f"CostModel.{name}={value!r} must be a number (a finite coefficient >= 0)")
            if not math.isfinite(value):
                raise ValueError(f"CostModel.{name}={value!r} must be finite; give a coefficient >= 0")
        if self.a < 0 or self.b < 0 or (self.a == 0 and self.b == 0):
            raise ValueError(f"CostModel(a={self.a}, b={self.b}): coefficients must be >= 0, not both 0")

    def micro_batch_costs(
        self,
        lengths: np.ndarray,
        sample_indices: np.ndarray,
        micro_batch_offsets: np.ndarray,
        layout: str,
        max_tokens: int,
    ) -> np.ndarray:
        """Cost of every micro-batch slot (empty slots cost 0), vectorised (in float64: no overflow of len^2)."""
        lens = lengths[sample_indices].astype(np.float64)
        sizes = np.diff(micro_batch_offsets)
        if layout == "packed":
            slots = np.where(sizes > 0, max_tokens, 0).astype(np.float64)
            quad = segment_reduce(np.add, lens * lens, micro_batch_offsets, dtype=np.float64)
        else:
            max_len = segment_reduce(np.maximum, lens, micro_batch_offsets, dtype=np.float64)
            slots = sizes * max_len
            quad = sizes * max_len * max_len
        return self.a * slots + self.b * quad
