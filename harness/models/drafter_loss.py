"""The DFlash drafter's training signal: decayed cross-entropy, accuracy and teacher-forced τ.

Every quantity is returned as a numerator and a denominator (:class:`DrafterLoss`) so that a trainer
can sum them over all micro-batches and ranks of an optimizer step before dividing: the loss of a
step is ``Σ w·CE / Σ w`` over the *global* step (docs/design/metrics.md), which keeps the objective independent
of how samples were grouped into micro-batches.

Weights (docs/design/metrics.md): slot ``k`` (``k = 1 .. B-1``) of a block has
``w = keep · [anchor + k < doc_len] · loss_mask[anchor + k] · exp(-(k - 1) / γ)``. Accuracy uses the
same mask without the decay. τ of a block (teacher-forced acceptance length) is 1 plus the number of
leading slots whose argmax equals a valid label; its mean is taken over kept blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

# γ of the released DFlash drafters, by block size (docs/design/metrics.md).
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
    correct_per_position: torch.Tensor  # [B - 1] Σ m·[argmax == label] per block slot 1 .. B-1
    count_per_position: torch.Tensor  # [B - 1] Σ m per block slot
    draft_vocab_misses: torch.Tensor  # Σ m over labels outside the draft vocabulary (harness.models.draft_vocab)

    def __add__(self, other: DrafterLoss) -> DrafterLoss:
        return DrafterLoss(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def detach(self) -> DrafterLoss:
        """The same sums outside the autograd graph (for logging and accumulation)."""
        return DrafterLoss(**{f.name: getattr(self, f.name).detach() for f in fields(self)})

    @staticmethod
    def zeros(num_slots: int, device: torch.device | str = "cpu") -> DrafterLoss:
        """The sums of a micro-batch with nothing in it (``num_slots`` = block size − 1)."""
        zero = torch.zeros((), device=device)
        per_position = torch.zeros(num_slots, device=device)
        return DrafterLoss(weighted_ce_sum=zero, weight_sum=zero, correct_sum=zero, label_count=zero,
                           tau_sum=zero, block_count=zero, blocks_computed=zero,
                           correct_per_position=per_position, count_per_position=per_position,
                           draft_vocab_misses=zero)

    def loss(self) -> torch.Tensor:
        """``Σ w·CE / Σ w`` of these sums (0 when no label counts); normalise globally in training."""
        return self.weighted_ce_sum / self.weight_sum.clamp_min(torch.finfo(self.weight_sum.dtype).tiny)

    @property
    def accuracy(self) -> float:
        """Share of counted labels predicted by argmax (NaN when none counts)."""
        count = float(self.label_count)
        return float(self.correct_sum) / count if count else math.nan

    @property
    def accuracy_per_position(self) -> list[float]:
        """Accuracy of block slots ``1 .. B-1`` (NaN where no label counts)."""
        return [c / n if n else math.nan
                for c, n in zip(self.correct_per_position.tolist(), self.count_per_position.tolist())]

    @property
    def mean_tau(self) -> float:
        """Mean teacher-forced acceptance length over kept blocks (NaN without blocks)."""
        count = float(self.block_count)
        return float(self.tau_sum) / count if count else math.nan

    @property
    def slot_efficiency(self) -> float:
        """Kept blocks / computed blocks (docs/design/metrics.md drafter slot efficiency; NaN without blocks)."""
        computed = float(self.blocks_computed)
        return float(self.block_count) / computed if computed else math.nan


def drafter_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    label_valid: torch.Tensor,
    keep: torch.Tensor,
    loss_decay_gamma: float,
    misses: torch.Tensor | None = None,
) -> DrafterLoss:
    """Decayed CE, accuracy and τ of ``logits`` ``[NB, B-1, V]`` for slots ``1 .. B-1``.

    ``labels`` ``[NB, B-1]`` holds the token at ``anchor + k`` for slot ``k``; ``label_valid`` says
    which labels count (kept block, inside the document, loss mask set); ``keep`` ``[NB]`` marks
    real blocks. The cross-entropy is computed in fp32 whatever the logits' dtype. ``misses``: counted labels
    outside a draft vocabulary (no weight, never hit, still counted).
    """
    if logits.dim() != 3 or logits.shape[:2] != labels.shape or labels.shape != label_valid.shape:
        raise ValueError(
            f"logits must be [blocks, B-1, vocab] with labels and label_valid [blocks, B-1]; got logits "
            f"{tuple(logits.shape)}, labels {tuple(labels.shape)}, label_valid {tuple(label_valid.shape)}"
        )
    num_blocks, num_slots, vocab = logits.shape
    dtype = torch.promote_types(logits.dtype, torch.float32)  # at least fp32, float64 stays float64
    hittable = _hittable(label_valid, misses)
    weights = hittable.to(dtype) * slot_decay(num_slots + 1, loss_decay_gamma, logits.device).to(dtype)
    ce = F.cross_entropy(logits.to(dtype).reshape(-1, vocab), labels.reshape(-1), reduction="none")
    ce = ce.reshape(num_blocks, num_slots)
    with torch.no_grad():
        correct = (logits.argmax(dim=-1) == labels) & hittable
        stats = _block_statistics(correct, label_valid, keep, dtype, misses)
    return DrafterLoss(
        weighted_ce_sum=(ce * weights).sum(),
        weight_sum=weights.sum().detach(),
        blocks_computed=torch.full((), float(num_blocks), dtype=dtype, device=logits.device),
        **stats,
    )


def _hittable(label_valid: torch.Tensor, misses: torch.Tensor | None) -> torch.Tensor:
    """The counted labels an argmax can hit: all of them, or those inside the draft vocabulary."""
    return label_valid if misses is None else label_valid & ~misses


def _block_statistics(correct: torch.Tensor, label_valid: torch.Tensor, keep: torch.Tensor,
                      dtype: torch.dtype, misses: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Accuracy and τ sums of ``[nb, B-1]`` argmax hits (already masked by ``label_valid``); ``misses``: the counted
    labels outside a draft vocabulary (none without one)."""
    leading = torch.cumprod(correct.long(), dim=1).sum(dim=1)
    kept = keep.to(dtype)
    correct_f, mask = correct.to(dtype), label_valid.to(dtype)
    return dict(
        correct_sum=correct_f.sum(),
        label_count=mask.sum(),
        tau_sum=((1 + leading).to(dtype) * kept).sum(),
        block_count=kept.sum(),
        correct_per_position=correct_f.sum(dim=0),
        count_per_position=mask.sum(dim=0),
        draft_vocab_misses=(mask.new_zeros(()) if misses is None else misses.to(dtype).sum()),
    )


def _chunk_cross_entropy(lm_head: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's ``(logits, logsumexp, CE, argmax == label)`` for rows ``x`` ``[rows, D]`` and labels ``y``: the
    logits in ``dtype`` (>= fp32; a copy only when the head is in half precision), CE per row unweighted, the
    argmax taken on the head's own logits."""
    logits = lm_head(x)  # [rows, V] in the head's dtype
    hits = logits.argmax(dim=-1) == y
    logits = logits.to(dtype)
    lse = torch.logsumexp(logits, dim=-1)
    return logits, lse, lse - logits.gather(1, y[:, None]).squeeze(1), hits


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """``Σ w·CE(lm_head(hidden), labels)`` over chunks of blocks, gradient computed chunk by chunk.

    Forward walks the blocks ``chunk`` at a time: logits of one chunk, their cross-entropy and argmax
    statistics, and (when a gradient is wanted) the gradient of the weighted CE sum with respect to
    the chunk's hidden states, ``(w·(softmax - onehot)) @ W``, after which the chunk's logits are
    freed. Only that gradient (the size of ``hidden``, not of the logits) is kept for backward, which
    scales it by the incoming scalar gradient. So neither pass ever holds more than one chunk's
    logits, and the LM head runs twice per chunk (logits, input gradient) instead of three times
    (recomputation under checkpointing). Gradients of the head's own weight and bias are
    accumulated the same way when they require one (the target's head is frozen: normally not).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, lm_head, labels, weights, label_valid, keep, chunk, need_grad,  # noqa: D102
                teacher=None, distill_weight=0.0):
        num_blocks, num_slots, width = hidden.shape
        dtype = torch.promote_types(weight.dtype, torch.float32)
        weighted_ce = torch.zeros((), dtype=dtype, device=hidden.device)
        correct = torch.zeros(num_blocks, num_slots, dtype=torch.bool, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=dtype) if need_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=dtype) if need_grad[2] else None
        for start in range(0, num_blocks, chunk):
            stop = min(start + chunk, num_blocks)
            x = hidden[start:stop].reshape(-1, width)
            y = labels[start:stop].reshape(-1)
            w = weights[start:stop].reshape(-1).to(dtype)
            logits, lse, ce, hits = _chunk_cross_entropy(lm_head, x, y, dtype)  # the only logits alive
            correct[start:stop] = hits.view(stop - start, num_slots)
            soft = None
            if teacher is not None:  # the label: (1 - α)·onehot + α·the target's own distribution q, computed at
                with torch.autocast(hidden.device.type, enabled=False):  # the head's precision (not the drafter's)
                    soft = torch.softmax(lm_head(teacher[start:stop].reshape(-1, width)).to(dtype), dim=-1)
                ce = (1.0 - distill_weight) * ce + distill_weight * (lse - (soft * logits).sum(dim=-1))
            weighted_ce += (ce * w).sum()
            if any(need_grad):
                probs = logits.sub_(lse[:, None]).exp_().mul_(w[:, None])  # in place: w·softmax
                hard = w if soft is None else (1.0 - distill_weight) * w
                probs.scatter_add_(1, y[:, None], -hard[:, None])  # w·(softmax - label)
                if soft is not None:
                    probs.sub_(soft.mul_(distill_weight * w[:, None]))
                grad_logits = probs.to(weight.dtype)
                if grad_hidden is not None:
                    grad_hidden[start:stop] = (grad_logits @ weight).view(stop - start, num_slots, width)
                if grad_weight is not None:
                    grad_weight += (grad_logits.t() @ x).to(dtype)
                if grad_bias is not None:
                    grad_bias += grad_logits.sum(dim=0).to(dtype)
                del probs, grad_logits
            del logits, soft
        correct &= label_valid
        ctx.save_for_backward(*(t for t in (grad_hidden, grad_weight, grad_bias) if t is not None))
        ctx.have = tuple(t is not None for t in (grad_hidden, grad_weight, grad_bias))
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(correct)
        return weighted_ce, correct

    @staticmethod
    def backward(ctx, grad_output, _grad_correct):  # noqa: D102
        saved = iter(ctx.saved_tensors)
        grads = [next(saved) if have else None for have in ctx.have]
        grads = [None if g is None else (g * grad_output.to(g.dtype)).to(dt) for g, dt in zip(grads, ctx.dtypes)]
        return (*grads, None, None, None, None, None, None, None, None, None)


def chunked_drafter_loss(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    labels: torch.Tensor,
    loss_weights: torch.Tensor,
    label_valid: torch.Tensor,
    keep: torch.Tensor,
    chunk_blocks: int,
    misses: torch.Tensor | None = None,
    teacher: torch.Tensor | None = None,
    distill_weight: float = 0.0,
) -> DrafterLoss:
    """The sums of :func:`drafter_loss` from the block hidden states ``[NB, B-1, D]`` (after the final
    norm, cast to the head's dtype), with the LM head applied ``chunk_blocks`` blocks at a time.

    ``teacher`` ``[NB, B-1, D]`` (the target's own last hidden states after its final norm, at the position before
    each slot's label): each slot's label becomes ``(1 - distill_weight)·onehot + distill_weight·softmax(head(teacher))``
    (soft labels from the target's next-token distribution over the same head; EAGLE's practice), its CE
    ``-Σ label·log softmax``. Accuracy and τ still count argmax hits of the hard labels.

    ``loss_weights`` ``[NB, B-1]`` are the decayed weights (zero where a label does not count). The
    logits of all blocks never exist at once, in forward or backward (:class:`_ChunkedHeadCrossEntropy`).
    With a draft vocabulary (:meth:`~harness.models.draft_vocab.DraftVocabulary.map_labels`), ``misses`` marks the
    counted labels outside it: no argmax hits them.
    """
    if chunk_blocks < 1:
        raise ValueError(f"chunk_blocks must be at least 1, got {chunk_blocks}")
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    grad_on = torch.is_grad_enabled()
    need_grad = tuple(bool(grad_on and t is not None and t.requires_grad) for t in (hidden, weight, bias))
    if teacher is not None and tuple(teacher.shape) != tuple(hidden.shape):
        raise ValueError(f"teacher has shape {tuple(teacher.shape)}, expected the hidden states' {tuple(hidden.shape)}")
    if not 0.0 <= distill_weight <= 1.0:
        raise ValueError(f"distill_weight must be in [0, 1], got {distill_weight}")
    weighted_ce, correct = _ChunkedHeadCrossEntropy.apply(
        hidden, weight, bias, lm_head, labels, loss_weights, _hittable(label_valid, misses), keep,
        int(chunk_blocks), need_grad, None if teacher is None or distill_weight == 0 else teacher.detach(),
        float(distill_weight)
    )
    dtype = weighted_ce.dtype
    with torch.no_grad():
        stats = _block_statistics(correct, label_valid, keep, dtype, misses)
    return DrafterLoss(
        weighted_ce_sum=weighted_ce,
        weight_sum=loss_weights.to(dtype).sum().detach(),
        blocks_computed=torch.full((), float(hidden.shape[0]), dtype=dtype, device=hidden.device),
        **stats,
    )


@dataclass
class BlockLosses:
    """Per block of a micro-batch (evaluation): its Σw·CE, Σw and teacher-forced τ (0 for a padding block), and
    the micro-batch's :class:`DrafterLoss` sums computed from the same logits."""

    weighted_ce: torch.Tensor  # [NB]
    weight: torch.Tensor  # [NB]
    tau: torch.Tensor  # [NB]
    sums: DrafterLoss


@torch.no_grad()
def block_losses(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    labels: torch.Tensor,
    loss_weights: torch.Tensor,
    label_valid: torch.Tensor,
    keep: torch.Tensor,
    chunk_blocks: int,
    misses: torch.Tensor | None = None,
) -> BlockLosses:
    """:func:`chunked_drafter_loss`'s sums without a gradient, kept per block as well (the evaluation's
    per-sample numbers; one LM-head pass, ``chunk_blocks`` blocks at a time)."""
    if chunk_blocks < 1:
        raise ValueError(f"chunk_blocks must be at least 1, got {chunk_blocks}")
    num_blocks, num_slots, width = hidden.shape
    dtype = torch.promote_types(lm_head.weight.dtype, torch.float32)
    weighted_ce = torch.zeros(num_blocks, dtype=dtype, device=hidden.device)
    correct = torch.zeros(num_blocks, num_slots, dtype=torch.bool, device=hidden.device)
    for start in range(0, num_blocks, chunk_blocks):
        stop = min(start + chunk_blocks, num_blocks)
        _, _, ce, hits = _chunk_cross_entropy(lm_head, hidden[start:stop].reshape(-1, width),
                                              labels[start:stop].reshape(-1), dtype)
        correct[start:stop] = hits.view(stop - start, num_slots)
        weighted_ce[start:stop] = (ce * loss_weights[start:stop].reshape(-1).to(dtype)).view(stop - start, -1).sum(1)
    correct &= _hittable(label_valid, misses)
    weights = loss_weights.to(dtype)
    tau = (1 + torch.cumprod(correct.long(), dim=1).sum(dim=1)).to(dtype) * keep.to(dtype)
    sums = DrafterLoss(weighted_ce_sum=weighted_ce.sum(), weight_sum=weights.sum(),
                       blocks_computed=torch.full((), float(num_blocks), dtype=dtype, device=hidden.device),
                       **_block_statistics(correct, label_valid, keep, dtype, misses))
    return BlockLosses(weighted_ce=weighted_ce, weight=weights.sum(dim=1), tau=tau, sums=sums)
