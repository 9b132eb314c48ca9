"""The DFlash drafter's attention with KV injection, its visibility rule and its decoder layer.

Q comes from the block only; K and V are the same ``k_proj`` / ``v_proj`` (with ``k_norm`` on K) over
[context ; block]. A block sees the context strictly before its anchor within its own document and
all slots of its own block; blocks never see each other, and padding blocks see nothing. Three paths
compute the same thing: ``sdpa`` (fused ``scaled_dot_product_attention`` over chunks of a document's
blocks, the CPU default), ``dense`` (the rule written out with einsums, one document at a time: the
reference) and ``flex`` (one FlexAttention call with :func:`block_attention_mask`, the CUDA default).
See :mod:`harness.models.drafter`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, rotate_half

from harness.models import attention as attention_ops
from harness.models.anchors import BlockLayout, FlatDocuments, context_visible
from harness.models.drafter_inputs import DenseSlice


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` ``[..., heads, head_dim]`` with ``cos``/``sin`` ``[..., head_dim]``."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


@dataclass(frozen=True)
class _DocumentSlice:
    """The blocks of one document and the context positions they may see."""

    blocks: slice  # rows of the block tensors
    context: slice  # rows of the flat context (the document's positions 0 .. max anchor - 1)
    visible: torch.Tensor  # [nb, context_len] bool


#: queries (block slots) per fused attention call of the ``sdpa`` path: a document's blocks are cut into
#: chunks of ``SDPA_CHUNK_SLOTS // B`` consecutive blocks (anchors ascend within a document), each seeing
#: its document's context up to the chunk's last anchor. Smaller chunks skip more of the masked
#: context and own-block keys of other blocks, larger ones make fewer calls: 256-1024 measure alike on an
#: 8K-token document (hidden 1024, block 16; 128 and 2048 are 25% slower). One call per block (no mask)
#: is 3x slower: the fused kernel wants many queries per call.
SDPA_CHUNK_SLOTS = 512


@dataclass(frozen=True)
class _SdpaChunk:
    """Consecutive blocks of one document for one fused attention call."""

    blocks: slice  # rows of the block tensors
    context: slice  # rows of the flat context: the document's positions before the chunk's last kept anchor
    mask: torch.Tensor  # [n * B, context + n * B] additive: 0 where a slot sees a key, -inf elsewhere


@dataclass(frozen=True)
class _SharedLayerInputs:
    """What every drafter layer reads besides the block hidden states: the fused context and the layout."""

    context: torch.Tensor  # [N, D] fused context of every real token
    context_rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [N, head_dim] at in-document positions
    block_rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [NB, B, head_dim] at anchor + k
    documents: list[_DocumentSlice]  # documents that hold at least one block, in block order
    keep: torch.Tensor  # [NB] bool, False for padding blocks
    block_mask: Any = None  # FlexAttention BlockMask over [blocks x (context ; blocks)]; None: dense path
    chunks: list[_SdpaChunk] | None = None  # the sdpa path's calls, in block order; None: another path


def document_slices(layout: BlockLayout, dense_slices: Sequence[DenseSlice]) -> list[_DocumentSlice]:
    """The dense path's per-document views: host-int slices, visibility computed on the layout's device."""
    slices = []
    for piece in dense_slices:
        rows = slice(piece.block_start, piece.block_stop)
        slices.append(
            _DocumentSlice(
                blocks=rows,
                context=slice(piece.context_start, piece.context_start + piece.context_length),
                visible=context_visible(layout.anchor[rows], layout.keep[rows], piece.context_length),
            )
        )
    return slices


def sdpa_chunks(layout: BlockLayout, dense_slices: Sequence[DenseSlice], dtype: torch.dtype,
                chunk_slots: int | None = None) -> list[_SdpaChunk]:
    """The ``sdpa`` path's calls: every document's blocks in chunks, each with its key mask.

    Reads the anchors back to the host once (free on CPU, the path's home; on CUDA ``flex`` is the
    default). Slot ``q`` of block ``n`` sees context position ``t < anchor[n]`` and the ``B`` slots of
    block ``n``; a padding block sees its own slots only (never an empty row, which fused kernels turn
    into NaN) and its output is zeroed afterwards, as the dense path's is.
    """
    block_size = layout.block_size
    per_chunk = max(1, int(SDPA_CHUNK_SLOTS if chunk_slots is None else chunk_slots) // block_size)
    anchors = torch.where(layout.keep, layout.anchor, 0).tolist()
    device = layout.anchor.device
    chunks = []
    for piece in dense_slices:
        for start in range(piece.block_start, piece.block_stop, per_chunk):
            rows = slice(start, min(start + per_chunk, piece.block_stop))
            count = rows.stop - rows.start
            context_length = max(anchors[rows])
            sees_context = context_visible(layout.anchor[rows], layout.keep[rows], context_length)
            block_of_slot = torch.arange(count, device=device).repeat_interleave(block_size)
            own_block = block_of_slot[:, None] == block_of_slot[None, :]
            visible = torch.cat([sees_context.repeat_interleave(block_size, dim=0), own_block], dim=1)
            # additive, in the attention's dtype: SDPA would turn a bool mask into one per call (per layer)
            # and keep each for the backward; this one tensor serves every layer
            mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
            context = slice(piece.context_start, piece.context_start + context_length)
            chunks.append(_SdpaChunk(blocks=rows, context=context, mask=mask))
    return chunks


class DFlashAttention(nn.Module):
    """Attention with KV injection: Q from the block, K/V from [context ; block] with shared projections."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, block_hidden: torch.Tensor, shared: _SharedLayerInputs) -> torch.Tensor:
        """``block_hidden`` ``[NB, B, D]`` (already normed) and the shared context -> ``[NB, B, D]``."""
        context, keep = shared.context, shared.keep
        num_blocks, block_size, _ = block_hidden.shape
        groups = self.num_heads // self.num_kv_heads
        kv_shape = (self.num_kv_heads, self.head_dim)
        q = self.q_norm(self.q_proj(block_hidden).view(num_blocks, block_size, self.num_heads, self.head_dim))
        k_block = self.k_norm(self.k_proj(block_hidden).view(num_blocks, block_size, *kv_shape))
        v_block = self.v_proj(block_hidden).view(num_blocks, block_size, *kv_shape)
        k_context = self.k_norm(self.k_proj(context).view(-1, *kv_shape))
        v_context = self.v_proj(context).view(-1, *kv_shape)
        q, k_block = _rotate(q, *shared.block_rope), _rotate(k_block, *shared.block_rope)
        k_context = _rotate(k_context, *shared.context_rope)
        if shared.block_mask is not None:
            attended = self._flex(q, k_block, v_block, k_context, v_context, shared.block_mask)
            return self.o_proj(attended.reshape(num_blocks, block_size, self.num_heads * self.head_dim))
        if shared.chunks is not None:
            attended = self._sdpa(q, k_block, v_block, k_context, v_context, shared.chunks, keep)
            return self.o_proj(attended.reshape(num_blocks, block_size, self.num_heads * self.head_dim))
        # [NB, B, H, d] -> [NB, B, H_kv, groups, d]: query heads grouped by the key/value head they share.
        q = q.view(num_blocks, block_size, self.num_kv_heads, groups, self.head_dim) * self.scaling
        # Written by hand rather than with SDPA: each block attends to [its document's context prefix ;
        # its own B slots], which SDPA could only express with a dense (blocks x B) by
        # (context + blocks x B) mask. Scores against the own block are batched over all blocks.
        block_scores = torch.einsum("nbhgd,nchd->nbhgc", q, k_block)  # [NB, B, H_kv, g, B]
        outputs = []
        for doc in shared.documents:
            rows = doc.blocks
            q_doc = q[rows]
            context_scores = torch.einsum("nbhgd,thd->nbhgt", q_doc, k_context[doc.context])
            scores = torch.cat([context_scores, block_scores[rows]], dim=-1)
            scores = scores.to(torch.promote_types(scores.dtype, torch.float32))  # softmax in >= fp32
            visible = torch.cat(
                [doc.visible, keep[rows, None].expand(-1, block_size)], dim=-1
            )[:, None, None, None, :]
            # A finite fill keeps rows that see nothing (padding blocks) free of NaN; the product
            # with `visible` then zeroes them exactly.
            scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
            probs = (torch.softmax(scores, dim=-1) * visible).to(q.dtype)
            context_len = doc.visible.shape[1]
            out = torch.einsum("nbhgt,thd->nbhgd", probs[..., :context_len], v_context[doc.context])
            out = out + torch.einsum("nbhgc,nchd->nbhgd", probs[..., context_len:], v_block[rows])
            outputs.append(out)
        if outputs:
            attended = torch.cat(outputs, dim=0)
        else:
            attended = q.new_zeros(q.shape)
        return self.o_proj(attended.reshape(num_blocks, block_size, self.num_heads * self.head_dim))

    def _sdpa(self, q: torch.Tensor, k_block: torch.Tensor, v_block: torch.Tensor, k_context: torch.Tensor,
              v_context: torch.Tensor, chunks: Sequence[_SdpaChunk], keep: torch.Tensor) -> torch.Tensor:
        """The same attention as fused ``scaled_dot_product_attention`` calls, one per chunk of a document's
        blocks (:func:`sdpa_chunks`): queries are the chunk's slots, keys/values [its context ; its slots].
        The fused kernels (CPU flash included) keep no score matrix for the backward, so memory stays
        flat in a document's blocks x context where the dense path stores them (benchmarks/drafter_step.py).
        """
        num_blocks, block_size = q.shape[:2]
        outputs = []
        for chunk in chunks:
            rows, count = chunk.blocks, chunk.blocks.stop - chunk.blocks.start
            queries = q[rows].reshape(count * block_size, self.num_heads, self.head_dim).transpose(0, 1)[None]
            keys = torch.cat([k_context[chunk.context],
                              k_block[rows].reshape(count * block_size, self.num_kv_heads, self.head_dim)])
            values = torch.cat([v_context[chunk.context],
                                v_block[rows].reshape(count * block_size, self.num_kv_heads, self.head_dim)])
            out = F.scaled_dot_product_attention(queries, keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                                                 attn_mask=chunk.mask, scale=self.scaling,
                                                 enable_gqa=self.num_heads != self.num_kv_heads)
            outputs.append(out[0].transpose(0, 1).reshape(count, block_size, self.num_heads, self.head_dim))
        if not outputs:
            return q.new_zeros(q.shape)
        attended = torch.cat(outputs, dim=0)
        return attended * keep[:, None, None, None].to(attended.dtype)  # padding blocks: exactly 0, as dense

    def _flex(self, q: torch.Tensor, k_block: torch.Tensor, v_block: torch.Tensor, k_context: torch.Tensor,
              v_context: torch.Tensor, block_mask: Any) -> torch.Tensor:
        """The same attention as one FlexAttention call: queries are all block slots, keys/values are
        [context ; all block slots], and ``block_mask`` (:func:`block_attention_mask`) admits exactly
        what the dense path admits. Scores are never materialised on CUDA (a fused kernel that skips
        fully masked tiles); on CPU FlexAttention runs unfused, so there the dense path is the default.
        """
        num_blocks, block_size = q.shape[:2]
        queries = q.reshape(num_blocks * block_size, self.num_heads, self.head_dim).transpose(0, 1)[None]
        keys = torch.cat([k_context, k_block.reshape(-1, self.num_kv_heads, self.head_dim)]).transpose(0, 1)[None]
        values = torch.cat([v_context, v_block.reshape(-1, self.num_kv_heads, self.head_dim)]).transpose(0, 1)[None]
        attend = attention_ops.flex_attention_kernel(q.device)
        out = attend(queries, keys, values, block_mask=block_mask, scale=self.scaling,
                     enable_gqa=self.num_heads != self.num_kv_heads)
        return out[0].transpose(0, 1)  # [NB * B, H, d]; rows that see nothing (padding blocks) are 0


def block_attention_mask(documents: FlatDocuments, layout: BlockLayout, device: torch.device) -> Any:
    """FlexAttention block mask of the drafter's attention (the rule of :func:`context_visible`).

    Queries: the ``NB * B`` block slots. Keys: the ``N`` context tokens, then the ``NB * B`` block
    slots. Slot ``q`` of block ``n`` sees context token ``t`` when ``t`` is in block ``n``'s document
    strictly before its anchor, and every slot of block ``n``; padding blocks see nothing.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    num_tokens, num_blocks, block_size = documents.num_tokens, layout.num_blocks, layout.block_size
    block_slots = num_blocks * block_size
    block_of_slot = torch.arange(num_blocks, device=device).repeat_interleave(block_size)
    # Per key: document and position of a context token (-1 / 0 for block slots), and block of a
    # block slot (-1 for context tokens).
    key_document = torch.cat([documents.doc_of_token.to(device), torch.full((block_slots,), -1, device=device)])
    key_position = torch.cat([documents.position_in_document.to(device),
                              torch.zeros(block_slots, dtype=torch.long, device=device)])
    key_block = torch.cat([torch.full((num_tokens,), -1, device=device), block_of_slot])
    block_document, anchor, keep = (t.to(device) for t in (layout.doc_index, layout.anchor, layout.keep))

    def drafter_visible(batch, head, q_idx, kv_idx):  # noqa: ARG001 - FlexAttention's mask_mod signature
        block = block_of_slot[q_idx]
        in_context = (key_document[kv_idx] == block_document[block]) & (key_position[kv_idx] < anchor[block])
        return keep[block] & (in_context | (key_block[kv_idx] == block))

    return create_block_mask(drafter_visible, None, None, block_slots, num_tokens + block_slots, device=device,
                             _compile=device.type == "cuda")


class DFlashDecoderLayer(nn.Module):
    """A Qwen3 decoder layer whose attention also reads the shared context (which skips norm and MLP)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, block_hidden: torch.Tensor, shared: _SharedLayerInputs) -> torch.Tensor:
        """One pre-norm residual attention + MLP step on the block hidden states ``[NB, B, D]``."""
        attended = self.self_attn(self.input_layernorm(block_hidden), shared)
        block_hidden = block_hidden + attended
        return block_hidden + self.mlp(self.post_attention_layernorm(block_hidden))
