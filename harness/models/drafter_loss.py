"""The DFlash drafter's training signal: decayed cross-entropy, accuracy and teacher-forced τ.

Every quantity is returned as a numerator and a denominator (:class:`DrafterLoss`) so that a trainer
can sum them over all micro-batches and ranks of an optimizer step before dividing: the loss of a
step is ``Σ w·CE / Σ w`` over the *global* step (docs/design.md §6), which keeps the objective independent
of how samples were grouped into micro-batches.

Weights (docs/design.md §6): slot ``k`` (``k = 1 .. B-1``) of a block has
``w = keep · [anchor + k < doc_len] · loss_mask[anchor + k] · exp(-(k - 1) / γ)``. Accuracy uses the
same mask without the decay. τ of a block (teacher-forced acceptance length) is 1 plus the number of
leading slots whose argmax equals a valid label; its mean is taken over kept blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

# γ of the released DFlash drafters, by block size (docs/design.md §6).
DEFAULT_LOSS_DECAY_GAMMA: dict[int, float] = {16: 7.0, 10: 5.0, 8: 4.0}


def resolve_loss_decay_gamma(block_size: int, loss_decay_gamma: float | None) -> float:
    """``loss_decay_gamma`` if given, else the released value for ``block_size`` (8, 10 or 16)."""
    if loss_decay_gamma is not None:
        if not loss_decay_gamma > 0:
            raise ValueError(
                f"loss_decay_gamma must be > 0 (use a very large value for no decay), got {loss_decay_gamma}"
            )
        return float(loss_decay_gamma)
    if block_size not in DEFAULT_LOSS_DECAY_GAMMA:
        raise ValueError(
            f"loss_decay_gamma is not set and block_size={block_size} has no default "
            f"(defaults exist for block sizes {sorted(DEFAULT_LOSS_DECAY_GAMMA)}); set loss_decay_gamma"
        )
    return DEFAULT_LOSS_DECAY_GAMMA[block_size]


def slot_decay(block_size: int, loss_decay_gamma: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[B - 1]`` fp32 decay of slots ``1 .. B-1``: ``exp(-(k - 1) / γ)`` (slot 1 has weight 1)."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / loss_decay_gamma)


@dataclass
class DrafterLoss:
    """Sums over the blocks of one micro-batch; divide only after summing over the global step."""

    weighted_ce_sum: torch.Tensor  # Σ w·CE (differentiable)
    weight_sum: torch.Tensor  # Σ w
    correct_sum: torch.Tensor  # Σ m·[argmax == label], m = w without decay
    label_count: torch.Tensor  # Σ m
    tau_sum: torch.Tensor  # Σ τ over kept blocks
    block_count: torch.Tensor  # kept blocks
    blocks_computed: torch.Tensor  # all blocks, kept or padding

    def __add__(self, other: DrafterLoss) -> DrafterLoss:
        return DrafterLoss(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def loss(self) -> torch.Tensor:
        """``Σ w·CE / Σ w`` of these sums (0 when no label counts); normalise globally in training."""
        return self.weighted_ce_sum / self.weight_sum.clamp_min(torch.finfo(self.weight_sum.dtype).tiny)

    @property
    def accuracy(self) -> float:
        """Share of counted labels predicted by argmax (NaN when none counts)."""
        count = float(self.label_count)
        return float(self.correct_sum) / count if count else math.nan

    @property
    def mean_tau(self) -> float:
        """Mean teacher-forced acceptance length over kept blocks (NaN without blocks)."""
        count = float(self.block_count)
        return float(self.tau_sum) / count if count else math.nan

    @property
    def slot_efficiency(self) -> float:
        """Kept blocks / computed blocks (docs/design.md §6 drafter slot efficiency; NaN without blocks)."""
        computed = float(self.blocks_computed)
        return float(self.block_count) / computed if computed else math.nan


def drafter_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    label_valid: torch.Tensor,
    keep: torch.Tensor,
    loss_decay_gamma: float,
) -> DrafterLoss:
    """Decayed CE, accuracy and τ of ``logits`` ``[NB, B-1, V]`` for slots ``1 .. B-1``.

    ``labels`` ``[NB, B-1]`` holds the token at ``anchor + k`` for slot ``k``; ``label_valid`` says
    which labels count (kept block, inside the document, loss mask set); ``keep`` ``[NB]`` marks
    real blocks. The cross-entropy is computed in fp32 whatever the logits' dtype.
    """
    if logits.dim() != 3 or logits.shape[:2] != labels.shape or labels.shape != label_valid.shape:
        raise ValueError(
            f"logits must be [blocks, B-1, vocab] with labels and label_valid [blocks, B-1]; got logits "
            f"{tuple(logits.shape)}, labels {tuple(labels.shape)}, label_valid {tuple(label_valid.shape)}"
        )
    num_blocks, num_slots, vocab = logits.shape
    dtype = torch.promote_types(logits.dtype, torch.float32)  # at least fp32, float64 stays float64
    mask = label_valid.to(dtype)
    weights = mask * slot_decay(num_slots + 1, loss_decay_gamma, logits.device).to(dtype)
    ce = F.cross_entropy(logits.to(dtype).reshape(-1, vocab), labels.reshape(-1), reduction="none")
    ce = ce.reshape(num_blocks, num_slots)
    with torch.no_grad():
        correct = (logits.argmax(dim=-1) == labels) & label_valid
        leading = torch.cumprod(correct.long(), dim=1).sum(dim=1)
        kept = keep.to(dtype)
        tau_sum = ((1 + leading).to(dtype) * kept).sum()
    return DrafterLoss(
        weighted_ce_sum=(ce * weights).sum(),
        weight_sum=weights.sum().detach(),
        correct_sum=correct.to(dtype).sum(),
        label_count=mask.sum(),
        tau_sum=tau_sum,
        block_count=kept.sum(),
        blocks_computed=torch.tensor(float(num_blocks), dtype=dtype, device=logits.device),
    )
