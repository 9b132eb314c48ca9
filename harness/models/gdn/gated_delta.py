"""The gated delta rule (the Gated DeltaNet token mixer) with exact per-document state resets.

One op, :func:`gated_delta_rule`, with the argument names and layout of flash-linear-attention's
``chunk_gated_delta_rule`` and three backends:

* ``torch-chunk``: pure PyTorch chunked (WY / UT-transform) form, vectorised across documents. Every
  document is split into chunks from its own start, all chunks of all documents are solved in
  parallel, and only the small chunk-to-chunk state recurrence runs as a loop over chunk positions.
  The CPU default; differentiable.
* ``torch-recurrent``: the token-by-token recurrence, the oracle for tests.
* ``fla``: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (Triton, CUDA only).

Math (per value head; the state S is K x V; why per-document resets make packing exact:
docs/design/target-and-drafter.md)::

    q <- l2norm(q) * scale, k <- l2norm(k)      (l2norm only with use_qk_l2norm_in_kernel)
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t

With ``cu_seqlens`` the row holds documents back to back and S restarts (from zero or
``initial_state[n]``) at every document start, so a packed row gives the same outputs as running
each document alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.models.kernel_libraries import fla_available, triton_interpreter_enabled
from harness.models.layout import PackedDocuments, packed_documents

GATED_DELTA_BACKENDS = ("torch-chunk", "torch-recurrent", "fla")
_BACKEND_CHOICES = ("auto", *GATED_DELTA_BACKENDS)


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x**2) + eps)`` along ``dim``: the normalisation of transformers and fla."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def resolve_backend(backend: str, device: torch.device) -> str:
    """Turn ``backend`` (``auto`` or one of :data:`GATED_DELTA_BACKENDS`) into a concrete backend."""
    if backend not in _BACKEND_CHOICES:
        raise ValueError(
            f"backend={backend!r} is not a gated delta rule backend; choose one of {_BACKEND_CHOICES}"
        )
    if backend == "auto":
        return "fla" if device.type == "cuda" and fla_available() else "torch-chunk"
    if backend == "fla":
        if device.type != "cuda" and not triton_interpreter_enabled():
            raise ValueError(
                f"backend='fla' needs CUDA tensors, got tensors on {device}; "
                "use backend='torch-chunk' (or 'auto') on CPU"
            )
        if not fla_available():
            raise ValueError(
                "backend='fla' needs flash-linear-attention, which is not installed; "
                "install the 'gpu' extra (pip install 'batchlab[gpu]') or use backend='torch-chunk'"
            )
    return backend


@dataclass(frozen=True)
class _Shapes:
    batch: int
    length: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    num_docs: int
    documents: PackedDocuments | None  # the packed row's boundaries, None for a batch of whole rows


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | PackedDocuments | None,
    chunk_size: int,
) -> _Shapes:
    """Validate shapes and ``cu_seqlens``; raise ValueError naming the field, the value and the fix."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape [B, T, H, K] = {tuple(q.shape)}, got {tuple(k.shape)}")
    batch, length, key_heads, key_dim = q.shape
    if v.dim() != 4 or v.shape[:2] != (batch, length):
        raise ValueError(f"v must be [B, T, HV, V] with B, T = {batch}, {length} (from q), got {tuple(v.shape)}")
    value_heads, value_dim = v.shape[2], v.shape[3]
    if value_heads % key_heads != 0:
        raise ValueError(
            f"v has {value_heads} heads, not a multiple of q/k's {key_heads} heads; "
            "value head h reads key head h // (HV // H), so HV must be a multiple of H"
        )
    for name, tensor in (("g", g), ("beta", beta)):
        if tensor.shape != (batch, length, value_heads):
            raise ValueError(
                f"{name} must be [B, T, HV] = {(batch, length, value_heads)}, got {tuple(tensor.shape)}"
            )
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(
                f"with cu_seqlens the batch dimension must be 1 (one packed row), got B={batch}; "
                "flatten the documents into one row of shape [1, T, ...]"
            )
        documents = packed_documents(cu_seqlens, total=length, device=q.device)
        num_docs = documents.num_documents
    else:
        documents = None
        num_docs = batch
    if initial_state is not None:
        expected = (num_docs, value_heads, key_dim, value_dim)
        if tuple(initial_state.shape) != expected:
            raise ValueError(
                f"initial_state must be [N, HV, K, V] = {expected} (one state per document), "
                f"got {tuple(initial_state.shape)}"
            )
    return _Shapes(batch, length, key_heads, value_heads, key_dim, value_dim, num_docs, documents)


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 when any input is float64 (for tight tests), else float32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    shapes: _Shapes,
    scale: float,
    use_qk_l2norm_in_kernel: bool,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Upcast, l2-normalise and scale q, k, and expand key heads to value heads.

    Normalising before the expansion gives the same values as transformers' order (expand, then
    normalise: each head vector is normalised on its own) on H instead of HV heads.
    """
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q = l2norm(q)
        k = l2norm(k)
    q, k = _expand_key_heads(q * scale, k, shapes)
    return q, k, v, g, beta


def _expand_key_heads(q: torch.Tensor, k: torch.Tensor, shapes: _Shapes) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat each q/k head HV // H times so that value head h reads key head h // (HV // H)."""
    if shapes.value_heads == shapes.key_heads:
        return q, k
    repeats = shapes.value_heads // shapes.key_heads
    return q.repeat_interleave(repeats, dim=2), k.repeat_interleave(repeats, dim=2)


def _document_bounds(shapes: _Shapes) -> list[tuple[int, int]]:
    """(start, end) of every document in the flattened ``[B * T]`` token order."""
    if shapes.documents is None:
        return [(b * shapes.length, (b + 1) * shapes.length) for b in range(shapes.batch)]
    bounds = shapes.documents.bounds
    return list(zip(bounds[:-1], bounds[1:]))


def _recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    bounds: list[tuple[int, int]],
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence over flattened tokens ``[N_tok, HV, ...]``; returns (o, final states).

    A Python loop over documents and tokens on purpose: this is the readable oracle the fast
    backends are tested against, not a production path.
    """
    value_heads, key_dim, value_dim = v.shape[1], k.shape[2], v.shape[2]
    outputs: list[torch.Tensor] = []
    finals: list[torch.Tensor] = []
    for doc, (start, end) in enumerate(bounds):
        if initial_state is None:
            state = v.new_zeros(value_heads, key_dim, value_dim)
        else:
            state = initial_state[doc].to(v.dtype)
        for t in range(start, end):
            state = state * g[t].exp()[:, None, None]
            predicted = torch.einsum("hkv,hk->hv", state, k[t])
            delta = (v[t] - predicted) * beta[t][:, None]
            state = state + k[t][:, :, None] * delta[:, None, :]
            outputs.append(torch.einsum("hkv,hk->hv", state, q[t]))
        finals.append(state)
    return torch.stack(outputs), torch.stack(finals)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | PackedDocuments | None = None,
    backend: str = "auto",
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the gated delta rule; fla's argument names and layout.

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, HV, V]`` with HV a multiple of H (value head h reads key
            head ``h // (HV // H)``).
        g: log-decay ``[B, T, HV]`` (``-exp(A_log) * softplus(a + dt_bias)``, <= 0). beta: ``[B, T, HV]``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]``, one state per document (N = B without ``cu_seqlens``).
        output_final_state: also return the state after every document, ``[N, HV, K, V]`` (fp32).
        use_qk_l2norm_in_kernel: l2-normalise q and k (eps 1e-6) before scaling.
        cu_seqlens: int32/int64 ``[N + 1]`` document boundaries of one packed row (B must be 1), or
            :class:`PackedDocuments` prepared once per forward pass; the state restarts at every
            document start.
        backend: ``auto`` (fla on CUDA when installed, else torch-chunk) or one of
            :data:`GATED_DELTA_BACKENDS`.
        chunk_size: chunk length of the torch-chunk backend (fla uses its own, 64); default
            :func:`default_chunk_size` of the key head dim.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype (computed in fp32, or fp64 for fp64
        inputs); final_state or None.
    """
    if chunk_size is None:
        chunk_size = default_chunk_size(q.shape[-1])
    shapes = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size)
    resolved = resolve_backend(backend, q.device)
    if scale is None:
        scale = shapes.key_dim**-0.5
    if resolved == "fla":
        return _fla(q, k, v, g, beta, shapes, scale, initial_state, output_final_state,
                    use_qk_l2norm_in_kernel)

    out_dtype = q.dtype
    dtype = _compute_dtype(q, k, v, initial_state)
    if shapes.length == 0:  # nothing to mix: empty output, states unchanged
        state_shape = (shapes.num_docs, shapes.value_heads, shapes.key_dim, shapes.value_dim)
        final = v.new_zeros(state_shape, dtype=dtype) if initial_state is None else initial_state.to(dtype)
        return v.new_zeros(*v.shape, dtype=out_dtype), (final if output_final_state else None)
    q, k, v, g, beta = _prepare(q, k, v, g, beta, shapes, scale, use_qk_l2norm_in_kernel, dtype)
    flat = lambda x: x.reshape(shapes.batch * shapes.length, *x.shape[2:])  # noqa: E731
    state0 = None if initial_state is None else initial_state.to(dtype)
    if resolved == "torch-recurrent":
        o, final = _recurrent(flat(q), flat(k), flat(v), flat(g), flat(beta),
                              _document_bounds(shapes), state0)
    else:
        o, final = _chunked(flat(q), flat(k), flat(v), flat(g), flat(beta), shapes, state0, chunk_size)
    o = o.reshape(shapes.batch, shapes.length, shapes.value_heads, shapes.value_dim).to(out_dtype)
    return o, (final if output_final_state else None)


def default_chunk_size(key_dim: int) -> int:
    """Chunk length of the torch-chunk backend for a key head dim: ``key_dim // 2`` within [16, 64].

    Per chunk the backend pays a C x C triangular solve and C x K products, and the state moves from
    chunk to chunk through K x K and K x V products: a longer chunk makes the solve dearer per token
    and the state updates cheaper, which pays more as K grows (the fastest chunks measured:
    docs/design/performance.md).
    """
    return min(64, max(16, key_dim // 2))


def _fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    shapes: _Shapes,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Call fla's Triton kernel (keyword arguments only: positional calls of some fla ops mis-bind).

    More value heads than key heads go to fla as they are: fla >= 0.6 maps value head h to key head
    h // (HV // H) itself (checked bit-identical to expanding q/k first), so q and k are not copied.
    """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    cu_seqlens = cu_seqlens_cpu = None
    if shapes.documents is not None:
        cu_seqlens, cu_seqlens_cpu = shapes.documents.int64_boundaries(q.device)
    o, final = chunk_gated_delta_rule(
        q=q,
        k=k,
        v=v,
        g=g.float(),
        beta=beta.to(q.dtype),
        scale=scale,
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    return o.to(q.dtype), final


@dataclass(frozen=True)
class _ChunkPlan:
    """Where every chunk of every document sits, in chunk-position-major order.

    Documents are sorted by chunk count (descending, stable), so the documents still running at chunk
    position p are the first ``active[p]`` of that order and their chunks are the contiguous block
    ``offsets[p] : offsets[p] + active[p]`` of the chunk table.
    """

    token_index: torch.Tensor  # [num_chunks, C] flat token of each slot; num_tokens marks padding
    slot_of_token: torch.Tensor  # [num_tokens] flat slot (chunk * C + offset) of each real token
    order: torch.Tensor  # [N] document at each sorted rank
    active: list[int]  # documents still running at each chunk position
    offsets: list[int]  # first chunk of each chunk position


def _plan_chunks(starts: torch.Tensor, lengths: torch.Tensor, chunk_size: int, num_tokens: int,
                 device: torch.device) -> _ChunkPlan:
    """Split every document into chunks from its own start and lay them out position-major."""
    chunks_per_doc = (lengths + chunk_size - 1) // chunk_size
    order = torch.argsort(chunks_per_doc, descending=True, stable=True)
    sorted_chunks = chunks_per_doc[order]
    max_chunks = int(sorted_chunks[0])
    position = torch.arange(max_chunks)
    running = sorted_chunks[None, :] > position[:, None]  # [max_chunks, N], a prefix of each row
    active = running.sum(dim=1)
    chunk_position, rank = running.nonzero(as_tuple=True)  # row-major: position-major, rank ascending
    doc = order[rank]
    first_token = starts[doc] + chunk_position * chunk_size
    token_index = first_token[:, None] + torch.arange(chunk_size)[None, :]
    real = token_index < (starts[doc] + lengths[doc])[:, None]
    token_index = torch.where(real, token_index, torch.full_like(token_index, num_tokens))
    slot_of_token = torch.empty(num_tokens, dtype=torch.long)
    slot_of_token[token_index[real]] = torch.nonzero(real.flatten(), as_tuple=True)[0]
    offsets = torch.cumsum(active, 0) - active
    return _ChunkPlan(
        token_index=token_index.to(device),
        slot_of_token=slot_of_token.to(device),
        order=order.to(device),
        active=active.tolist(),
        offsets=offsets.tolist(),
    )


def _chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    shapes: _Shapes,
    initial_state: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (UT-transform) form over flattened tokens ``[N_tok, HV, ...]``; returns (o, final states).

    All intra-chunk work runs at once over every chunk of every document; the only loop is over chunk
    positions, where the states of all still-running documents advance together by one matmul.
    """
    num_tokens, value_heads, key_dim = k.shape
    value_dim = v.shape[2]
    if shapes.documents is None:
        starts = torch.arange(shapes.batch) * shapes.length
        lengths = torch.full((shapes.batch,), shapes.length)
        plan = _plan_chunks(starts, lengths, chunk_size, num_tokens, q.device)
    else:
        documents = shapes.documents

        def build() -> _ChunkPlan:
            bounds = torch.tensor(documents.bounds)
            return _plan_chunks(bounds[:-1], bounds[1:] - bounds[:-1], chunk_size, num_tokens, q.device)

        # Planned by the first GDN layer of a forward pass, reused by the others.
        plan = documents.cached(("gdn-chunk-plan", chunk_size, q.device), build)

    # One gather for all inputs; the appended zero row fills the tail of each document's last chunk
    # (q = k = v = 0, beta = 0, g = 0), which leaves outputs and states of real tokens unchanged.
    packed = torch.cat([q, k, v, g[..., None], beta[..., None]], dim=-1)
    packed = torch.cat([packed, packed.new_zeros(1, *packed.shape[1:])])
    chunks = packed[plan.token_index].transpose(1, 2)  # [num_chunks, HV, C, 2K + V + 2]
    qc, kc, vc, gc, bc = chunks.split([key_dim, key_dim, value_dim, 1, 1], dim=-1)
    gc, bc = gc.squeeze(-1), bc.squeeze(-1)

    gamma = gc.cumsum(dim=-1)  # log decay from the chunk start, [num_chunks, HV, C]
    future = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    # Gamma_ij = exp(gamma_i - gamma_j) for i >= j; masking before exp avoids overflow above the diagonal
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(future, float("-inf")).exp()
    attn = (qc @ kc.transpose(-1, -2)) * decay
    # (I + A) with A = strictly_lower(beta k k^T * Gamma); unitriangular ignores the diagonal
    system = (kc @ kc.transpose(-1, -2)) * bc[..., :, None] * decay
    rhs = torch.cat([vc * bc[..., None], kc * (bc * gamma.exp())[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split([value_dim, key_dim], dim=-1)

    chunk_decay = gamma[..., -1:].exp()  # [num_chunks, HV, 1]
    k_to_end = kc * (gamma[..., -1:] - gamma).exp()[..., None]
    # S_next = (exp(gamma_C) I - k_to_end^T W) S + k_to_end^T U, precomputed for every chunk at once
    eye = torch.eye(key_dim, dtype=k.dtype, device=k.device)
    transition = chunk_decay[..., None] * eye - k_to_end.transpose(-1, -2) @ w  # [num_chunks, HV, K, K]
    injection = k_to_end.transpose(-1, -2) @ u  # [num_chunks, HV, K, V]
    # o = attn U + (exp(gamma) q - attn W) S_start
    read_state = qc * gamma.exp()[..., None] - attn @ w
    local_out = attn @ u

    if initial_state is None:
        state = v.new_zeros(len(plan.order), value_heads, key_dim, value_dim)
    else:
        state = initial_state.index_select(0, plan.order)
    chunk_starts: list[torch.Tensor] = []
    finished: list[torch.Tensor] = []  # final states, last-finishing documents first
    active_next = [*plan.active[1:], 0]
    for offset, active, still_running in zip(plan.offsets, plan.active, active_next):
        state = state[:active]
        chunk_starts.append(state)
        block = slice(offset, offset + active)
        state = transition[block] @ state + injection[block]
        finished.append(state[still_running:])
    start_states = torch.cat(chunk_starts)  # [num_chunks, HV, K, V], same order as the chunk table

    out = local_out + read_state @ start_states  # [num_chunks, HV, C, V]
    out = out.transpose(1, 2).reshape(-1, value_heads, value_dim).index_select(0, plan.slot_of_token)
    final_sorted = torch.cat(finished[::-1])  # sorted rank order
    final = final_sorted.index_select(0, torch.argsort(plan.order))  # back to document order
    return out, final
