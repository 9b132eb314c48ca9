"""Causal self-attention that keeps documents apart, for padded ``[B, L]`` and packed ``[1, T]`` rows.

:func:`document_causal_attention` takes q/k/v in the flash-attention layout ``[B, L, H, D]`` (grouped
query attention: the query head count a multiple of the key/value head count) and returns
``[B, L, Hq, D]``.

* Padded rows (``attention_mask``): right-padded rows need no mask at all - a real token at position
  i only sees keys 0..i, which are all real - so plain causal SDPA is exact and takes the fused
  kernel. Any other padding (left padding, holes) gets an explicit causal-and-key-padding mask; pad
  queries are also allowed to see themselves so that no softmax row is empty (their outputs are
  never read by a real token).
* Packed rows (``cu_seqlens``): never a dense T x T mask, whose cost grows with the square of the row
  while per-document attention grows with each document's (docs/design/performance.md). The backends:

  - ``sdpa`` (CPU default): causal SDPA on each document's slice of the row, one call per document
    (slices are views: nothing is copied or padded).
  - ``flash``: ``flash_attn.flash_attn_varlen_func`` (CUDA, fp16/bf16, when flash-attn is installed).
  - ``flex``: FlexAttention with a document-causal block mask (compiled on CUDA, eager elsewhere).

  ``auto`` picks ``flash``, then ``flex`` on CUDA, and ``sdpa`` on CPU.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from harness.models.kernel_libraries import flash_attn_available
from harness.models.layout import PackedDocuments, packed_documents

ATTENTION_BACKENDS = ("sdpa", "flex", "flash")


def resolve_attention_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """Turn ``auto`` into a concrete packed-attention backend for ``device``/``dtype``; check explicit choices."""
    if backend not in ("auto", *ATTENTION_BACKENDS):
        raise ValueError(f"attention backend must be one of {('auto', *ATTENTION_BACKENDS)}, got {backend!r}")
    flash_ok = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flash_attn_available()
    if backend == "auto":
        if flash_ok:
            return "flash"
        return "flex" if device.type == "cuda" else "sdpa"
    if backend == "flash" and not flash_ok:
        raise ValueError(
            "attention backend 'flash' needs CUDA, fp16/bf16 inputs and the flash-attn package "
            f"(device={device.type}, dtype={dtype}, flash-attn installed={flash_attn_available()}); "
            "use backend='auto'"
        )
    return backend


def document_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | PackedDocuments | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention that never crosses a document boundary; q ``[B, L, Hq, D]``, k/v ``[B, L, Hkv, D]``.

    Give ``attention_mask`` (``[B, L]``, 1 = real token) for padded rows, or ``cu_seqlens`` (int32
    document starts plus total length, or :class:`PackedDocuments`; ``B`` must be 1) for a packed row,
    or neither for plain causal attention. ``scale`` defaults to ``D ** -0.5``. ``backend`` chooses
    the packed-row kernel (see the module docstring).
    """
    _check_qkv(query, key, value)
    if attention_mask is not None and cu_seqlens is not None:
        raise ValueError("give attention_mask (padded rows) or cu_seqlens (packed row), not both")
    if cu_seqlens is None:
        return _padded_attention(query, key, value, attention_mask, scale)
    if query.shape[0] != 1:
        raise ValueError(f"a packed row has batch size 1, got query batch {query.shape[0]} with cu_seqlens")
    documents = packed_documents(cu_seqlens, total=query.shape[1], device=query.device)
    chosen = resolve_attention_backend(backend, query.device, query.dtype)
    q, k, v = query[0], key[0], value[0]
    if chosen == "flash":
        out = _flash_varlen(q, k, v, documents, scale)
    elif chosen == "flex":
        out = _flex_documents(q, k, v, documents, scale)
    else:
        out = _per_document_sdpa(q, k, v, documents, scale)
    return out[None]


def _check_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"query/key/value must be [B, L, H, D]; got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if key.shape != value.shape or query.shape[:2] != key.shape[:2] or query.shape[3] != key.shape[3]:
        raise ValueError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} disagree on "
            "batch, length or head dim"
        )
    if query.shape[2] % key.shape[2]:
        raise ValueError(
            f"query heads ({query.shape[2]}) must be a multiple of key/value heads ({key.shape[2]})"
        )


def _sdpa_bhld(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA on ``[N, L, H, D]`` tensors (GQA expanded here), causal unless a mask is given; returns ``[N, L, Hq, D]``."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        # Repeat K/V heads rather than SDPA's enable_gqa: that needs torch >= 2.5 and gains nothing on CPU
        # (docs/design/performance.md).
        k = k.repeat_interleave(groups, dim=2)
        v = v.repeat_interleave(groups, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask, is_causal=mask is None, scale=scale,
    )
    return out.transpose(1, 2)


def _is_right_padded(attention_mask: torch.Tensor) -> bool:
    """True when every row is real tokens followed only by padding."""
    mask = attention_mask.bool()
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def _padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      attention_mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    if attention_mask is not None and attention_mask.shape != q.shape[:2]:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, expected [B, L] = {tuple(q.shape[:2])}"
        )
    if attention_mask is None or _is_right_padded(attention_mask):
        return _sdpa_bhld(q, k, v, scale)
    length = q.shape[1]
    real = attention_mask.bool()
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(length, dtype=torch.bool, device=q.device)
    mask = (causal[None] & real[:, None, :]) | eye[None]  # [B, Lq, Lk]
    return _sdpa_bhld(q, k, v, scale, mask=mask[:, None])


def _per_document_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: PackedDocuments,
                       scale: float | None) -> torch.Tensor:
    """Causal SDPA over each document of a packed ``[T, H, D]`` row, one call per document.

    A Python loop over documents: each document is a view of the row, so nothing is gathered or
    padded. Gathering documents of similar length into padded sub-batches would save calls but copy
    about as much as the attention itself computes at these head sizes (docs/design/performance.md).
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # expand K/V heads once for the whole row rather than once per document
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    bounds = documents.bounds
    out = torch.empty_like(q)
    for start, stop in zip(bounds[:-1], bounds[1:]):
        # 4-D [1, H, L, D] inputs: with 3-D ones CPU SDPA takes the slower math kernel
        out[start:stop] = F.scaled_dot_product_attention(
            q[None, start:stop].transpose(1, 2), k[None, start:stop].transpose(1, 2),
            v[None, start:stop].transpose(1, 2), is_causal=True, scale=scale,
        )[0].transpose(0, 1)
    return out


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: PackedDocuments,
                  scale: float | None) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    cu, max_len = documents.cu_seqlens.to(q.device), documents.max_length  # int32; a host int
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
        softmax_scale=scale, causal=True,
    )


@functools.cache
def _compiled_flex_attention(backend: str = "inductor"):
    """FlexAttention compiled once per process, for changing shapes (every batch has new lengths).

    ``backend`` is torch.compile's: inductor generates the fused kernel (CUDA); the tests use
    aot_eager on CPU to run the same tracing without code generation.
    """
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True, backend=backend)


def flex_attention_kernel(device: torch.device):
    """FlexAttention for ``device``: compiled (fused, block-sparse) on CUDA, eager (unfused) elsewhere."""
    if device.type == "cuda":
        return _compiled_flex_attention()
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def _document_causal_block_mask(documents: PackedDocuments, device: torch.device):
    """FlexAttention block mask of a packed row: causal, and only within a document."""
    from torch.nn.attention.flex_attention import create_block_mask

    total = documents.total
    cu = documents.cu_seqlens.to(device).long()
    document = torch.repeat_interleave(torch.arange(documents.num_documents, device=device), cu[1:] - cu[:-1],
                                       output_size=total)  # the size given: no device sync

    def document_causal(batch, head, q_idx, kv_idx):  # noqa: ARG001 - FlexAttention's mask_mod signature
        return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

    return create_block_mask(document_causal, None, None, total, total, device=device,
                             _compile=device.type == "cuda")


def _flex_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: PackedDocuments,
                    scale: float | None) -> torch.Tensor:
    # Built by the first attention layer of a forward pass, reused by the others.
    block_mask = documents.cached(("flex-document-causal", q.device),
                                  lambda: _document_causal_block_mask(documents, q.device))
    out = flex_attention_kernel(q.device)(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)
