"""Attention per document for packed rows where transformers has no varlen kernel (CPU): ``use_varlen_attention(model)``.

On GPU, FlashAttention's varlen path reads the packed collator's ``cu_seq_lens_q/k`` and attends within each document.
Elsewhere transformers' sdpa and eager paths find the documents from ``position_ids`` and build a dense block-diagonal
mask over the whole row: a row of ``T`` tokens costs ``T x T`` scores per head and layer, most of them masked, and
sdpa's masked kernels keep them for the backward. ``"batchlab_varlen"`` is a registered transformers attention
implementation that runs causal sdpa on each document of a row instead (``cu_seq_lens_q``), and sdpa itself on rows
without it (padded batches). Rationale: docs/design/other-trainers.md (docs/design/performance.md measured the same
rule for batchlab's own models).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

#: the attention implementation's registered name (``model.config._attn_implementation``)
NAME = "batchlab_varlen"


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature (``[batch, heads, tokens, dim]`` in, ``[batch, tokens, heads, dim]`` out):
    causal sdpa per document of a packed row (``cu_seq_lens_q``), else transformers' own sdpa."""
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None or query.shape[0] != 1 or not getattr(module, "is_causal", True):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    edges = bounds.tolist()
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    parts = [F.scaled_dot_product_attention(query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                                            is_causal=True, dropout_p=dropout, scale=scaling, enable_gqa=grouped)
             for start, end in zip(edges, edges[1:])]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def use_varlen_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Register :data:`NAME` with transformers and switch ``model`` to it; returns ``model``. Its packed rows must
    carry ``cu_seq_lens_q`` (``PackedCollator(flash_attn_kwargs=True)``, the default)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # padded rows keep sdpa's mask
    model.set_attn_implementation(NAME)
    return model
