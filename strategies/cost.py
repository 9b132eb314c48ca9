"""Cost model of one micro-batch: ``a * slots + b * sum(len^2) + c * blocks``.

The linear term is everything in the target that scales with computed token slots (projections,
MLP, GDN); the quadratic term is the target's full attention. A padded row attends over its padded
length, so its quadratic term is ``rows * max_len^2``; a packed row attends per document, so it is
``sum(len_i^2)``. The third term is the DFlash drafter, whose work scales with its blocks, not with
the target's slots: every block runs the drafter layers and the (frozen) LM head over
``block_size`` positions, forward and backward.

Blocks of a sample are estimated from its length with the drafter's anchor rule: an anchor ``p``
needs a whole block inside the sample, ``p <= len - block_size``, and at most ``num_anchors``
anchors are drawn per sample, so ``blocks(len) = min(num_anchors, max(0, len - block_size + 1))``
(:func:`drafter_blocks`). Blocks depend on the samples only, not on padding or packing.

Defaults (see ``docs/design/cost-model.md``), for a Qwen3.6-27B-sized target (hidden
``d = 5120``, vocabulary ``V = 248320``, about ``P = 27e9`` parameters) and a one-layer drafter
with SpecForge's anchors (``block_size = 16``, ``num_anchors = 512``), in units of one target
slot (``a = 1``, a target forward of ``~2 P`` FLOPs per token):

- ``b``: per token, a full-attention layer spends about ``4 * L * d`` FLOPs on scores and values
  against ``~24 * d^2`` for its projections and MLP; with one full-attention layer in four that
  makes ``b / a ~ 1 / (6 * d * 4)``, about ``8e-6``.
- ``c``: the LM head forward and backward over a block is ``4 * V * d * block_size`` FLOPs, 1.5
  target slots; a drafter layer forward and backward over the block about 0.6 more: ``c ~ 2``.
  On packed 16K rows of chat-like data a row carries thousands of blocks, so the drafter costs
  about as much as the target forward. These are FLOP estimates: calibrate ``a, b, c`` against
  measured step times on the real hardware.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .epoch_plan import segment_reduce


def drafter_blocks(lengths: np.ndarray, block_size: int, num_anchors: int) -> np.ndarray:
    """Estimated drafter blocks of every sample: ``min(num_anchors, max(0, len - block_size + 1))``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.clip(lengths - (block_size - 1), 0, num_anchors)


@dataclass(frozen=True)
class CostModel:
    """``a * slots + b * sum(len^2) + c * blocks`` per micro-batch (module docstring).

    Attributes:
        a: weight of the target's computed token slots.
        b: weight of the target's attention term ``sum(len^2)`` (padded: ``rows * max_len^2``).
        c: weight of one drafter block (0 leaves the drafter out).
        block_size: drafter block size (positions per block).
        num_anchors: most anchors (blocks) per sample.
    """

    a: float = 1.0
    b: float = 8e-6
    c: float = 2.0
    block_size: int = 16
    num_anchors: int = 512

    def __post_init__(self) -> None:
        for name in ("a", "b", "c"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise ValueError(f"CostModel.{name}={value!r} must be a number (a finite coefficient >= 0)")
            if not math.isfinite(value):
                raise ValueError(f"CostModel.{name}={value!r} must be finite; give a coefficient >= 0")
        if self.a < 0 or self.b < 0 or self.c < 0 or (self.a == 0 and self.b == 0 and self.c == 0):
            raise ValueError(
                f"CostModel(a={self.a}, b={self.b}, c={self.c}): coefficients must be >= 0, not all 0"
            )
        for name in ("block_size", "num_anchors"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"CostModel.{name}={value!r} must be a positive integer")

    def target_only(self) -> CostModel:
        """The same model without the drafter term (``c = 0``); the target's cost alone."""
        return CostModel(a=self.a, b=self.b, c=0.0, block_size=self.block_size, num_anchors=self.num_anchors)

    def micro_batch_blocks(
        self, lengths: np.ndarray, sample_indices: np.ndarray, micro_batch_offsets: np.ndarray
    ) -> np.ndarray:
        """Estimated drafter blocks of every micro-batch slot (empty slots: 0)."""
        blocks = drafter_blocks(lengths[sample_indices], self.block_size, self.num_anchors)
        return segment_reduce(np.add, blocks, micro_batch_offsets, dtype=np.float64)

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
        cost = self.a * slots + self.b * quad
        if self.c:
            cost = cost + self.c * self.micro_batch_blocks(lengths, sample_indices, micro_batch_offsets)
        return cost
