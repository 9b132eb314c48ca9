"""Depthwise causal short convolution (the q/k/v conv of Gated DeltaNet) that never reads across documents.

:func:`causal_conv1d` computes, per channel d and token t of a document,

    y_t = act(bias_d + sum_{s=0}^{W-1} w[d, W-1-s] * x_{t-s} * [pos_in_doc(t) >= s])

which on one unpacked sequence is exactly transformers' ``causal_conv1d_fn`` torch fallback (a
zero-padded ``F.conv1d`` with ``groups=D``). On a packed row (``cu_seqlens``) every document sees
zeros before its first token instead of the previous document's last W-1 tokens.

CPU path: one ``F.conv1d`` over the whole row (transformers' math), then the first W-1 outputs of
every document, the only ones a plain conv computes from the previous document, are recomputed from
windows masked at the document start, all documents at once (one gather, no loop over documents or
time). On CUDA with flash-linear-attention installed, fla's varlen Triton conv is used instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.models.kernel_libraries import fla_available, triton_interpreter_enabled
from harness.models.layout import PackedDocuments, packed_documents

SHORT_CONV_BACKENDS = ("torch", "fla")
_ACTIVATIONS = (None, "silu", "swish")


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
           cu_seqlens: torch.Tensor | PackedDocuments | None) -> tuple[torch.Tensor, PackedDocuments | None]:
    """Validate inputs; return the weight as ``[D, W]`` and the packed row's documents (or None)."""
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, D], got shape {tuple(x.shape)}")
    channels = x.shape[2]
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight.squeeze(1)  # nn.Conv1d(groups=D).weight is [D, 1, W]
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(
            f"weight must be depthwise [D, W] (or nn.Conv1d's [D, 1, W]) with D={channels} (x's last dim), "
            f"got shape {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"bias must be [D] = ({channels},), got shape {tuple(bias.shape)}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; choose one of {_ACTIVATIONS}")
    if cu_seqlens is not None:
        if x.shape[0] != 1:
            raise ValueError(
                f"with cu_seqlens the batch dimension must be 1 (one packed row), got B={x.shape[0]}; "
                "flatten the documents into one row of shape [1, T, D]"
            )
        return weight, packed_documents(cu_seqlens, total=x.shape[1], device=x.device)
    return weight, None


def _resolve(backend: str, device: torch.device) -> str:
    choices = ("auto", *SHORT_CONV_BACKENDS)
    if backend not in choices:
        raise ValueError(f"backend={backend!r} is not a short conv backend; choose one of {choices}")
    has_fla = fla_available()
    if backend == "auto":
        return "fla" if device.type == "cuda" and has_fla else "torch"
    if backend == "fla" and ((device.type != "cuda" and not triton_interpreter_enabled()) or not has_fla):
        raise ValueError(
            f"backend='fla' needs CUDA tensors and flash-linear-attention (device={device}, "
            f"fla installed={has_fla}); use backend='torch' or 'auto'"
        )
    return backend


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | PackedDocuments | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Depthwise causal conv over time, reset at every document start.

    Args:
        x: ``[B, T, D]`` (time before channels, fla's layout).
        weight: ``[D, W]`` or nn.Conv1d's ``[D, 1, W]``; ``weight[:, W-1]`` multiplies the current token.
        bias: optional ``[D]``.
        activation: ``"silu"`` (= ``"swish"``) or None.
        cu_seqlens: int32/int64 ``[N + 1]`` document boundaries of one packed row (B must be 1), or
            :class:`PackedDocuments` prepared once per forward pass.
        backend: ``auto`` (fla on CUDA when installed, else torch), ``torch`` or ``fla``.

    Returns:
        ``[B, T, D]`` in x's dtype (computed in the weight's dtype, as transformers does).
    """
    weight, documents = _check(x, weight, bias, activation, cu_seqlens)
    if _resolve(backend, x.device) == "fla":
        return _fla_conv(x, weight, bias, activation, documents)
    width, channels, length = weight.shape[1], x.shape[2], x.shape[1]
    compute_x = x.to(weight.dtype)
    # transformers' fallback: one zero-padded depthwise F.conv1d over [B, D, T]
    out = F.conv1d(compute_x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1,
                   groups=channels)[..., :length].transpose(1, 2)
    if documents is not None and width > 1:
        out = _recompute_document_heads(out, compute_x, weight, bias, documents)
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)


def _recompute_document_heads(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None, documents: PackedDocuments) -> torch.Tensor:
    """Overwrite the first W-1 outputs of every document with windows that stop at its start.

    Only these outputs can read a previous document, so the row-wide conv stays and at most
    (W-1) * N outputs are recomputed, all at once with one gather.
    """
    width = weight.shape[1]
    token, source, inside = documents.cached(
        ("conv-document-heads", width, x.device), lambda: _document_head_windows(documents, width, x.device)
    )
    window = x[0, source] * inside[..., None].to(x.dtype)  # [F, W, D]
    fixed = (window * weight.transpose(0, 1)[None]).sum(dim=1)
    if bias is not None:
        fixed = fixed + bias
    # in place: out is a fresh conv output that autograd does not need (conv1d saves input and weight)
    return out.index_put_((torch.zeros_like(token), token), fixed)


def _document_head_windows(documents: PackedDocuments, width: int,
                           device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first W-1 tokens of every document, the W tokens each one reads, and which reads are inside."""
    bounds = documents.cu_seqlens.to(device, torch.long)
    starts, lengths = bounds[:-1], bounds[1:] - bounds[:-1]
    head = torch.arange(width - 1, device=device)
    in_doc = head[None, :] < lengths[:, None]  # [N, W-1]
    position = head[None, :].expand_as(in_doc)[in_doc]  # position in document of every head token
    token = (starts[:, None] + head[None, :])[in_doc]  # [F]
    tap = torch.arange(width, device=device)  # tap j multiplies x_{t - (W-1) + j}
    source = token[:, None] - (width - 1) + tap[None, :]  # [F, W]
    inside = (width - 1 - tap)[None, :] <= position[:, None]  # reads stay within the document
    return token, source.clamp(min=0), inside


def _fla_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
              documents: PackedDocuments | None) -> torch.Tensor:
    """fla's Triton varlen conv (keyword arguments; it returns ``(y, final_state)``)."""
    from fla.modules.causal_conv1d import causal_conv1d as fla_causal_conv1d

    cu_seqlens = cu_seqlens_cpu = None
    if documents is not None:
        cu_seqlens, cu_seqlens_cpu = documents.int64_boundaries(x.device)
    result = fla_causal_conv1d(
        x=x,
        weight=weight,
        bias=bias,
        activation=activation,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    out = result[0] if isinstance(result, tuple) else result
    return out.to(x.dtype)
