"""Packed and padded target batches give the same tapped features as running each document alone.

Covers the exactness promise of ``harness/models/target.py`` and ``harness/models/attention.py``:
packed rows (GDN state and short conv reset at every ``cu_seqlens`` boundary, attention per
document) and padded rows (right and left padding) against separate runs, a negative control that
disables the document reset, the attention backends against each other, and GPU checks that skip
without CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.models.attention import document_causal_attention, resolve_attention_backend
from harness.models.compare import max_relative_difference
from harness.models.layout import TokenBatch
from harness.models.target import HybridTarget, TargetFeatures

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "conf" / "target" / "tiny.yaml"
TOLERANCE = 1e-5
# lengths include 1 and lengths around the GDN chunk size (64) that it does not divide
DOC_LENGTHS = [37, 1, 130, 64, 65, 3]



def random_target(seed: int = 0, **kwargs) -> HybridTarget:
    """Tiny target with random weights, norms included (their zero init would hide mistakes)."""
    torch.manual_seed(seed)
    target = HybridTarget(TINY, tap_layer_ids=range(4), **kwargs)
    with torch.no_grad():
        for name, param in target.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.2)
    return target


def documents(lengths: list[int], seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen) for n in lengths]


def separate_runs(target: HybridTarget, docs: list[torch.Tensor], **kwargs) -> list[TargetFeatures]:
    return [target(TokenBatch.from_documents([doc], "packed"), **kwargs) for doc in docs]


def per_document(features: TargetFeatures, batch: TokenBatch, layer: int) -> list[torch.Tensor]:
    """Split one tapped output back into documents (packed: by cu_seqlens; padded: real positions of a row)."""
    hidden = features.hidden_states[layer]
    if batch.cu_seqlens is not None:
        return list(torch.split(hidden[0], batch.doc_lengths.tolist()))
    return [hidden[row][batch.attention_mask[row].bool()] for row in range(hidden.shape[0])]


def worst_error_per_layer(features: TargetFeatures, batch: TokenBatch, alone: list[TargetFeatures]) -> list[float]:
    return [
        max(max_relative_difference(part, single.hidden_states[layer][0])
            for part, single in zip(per_document(features, batch, layer), alone))
        for layer in range(len(features.layer_ids))
    ]


@pytest.fixture(scope="module")
def target() -> HybridTarget:
    return random_target()


@pytest.fixture(scope="module")
def docs() -> list[torch.Tensor]:
    return documents(DOC_LENGTHS)


@pytest.fixture(scope="module")
def alone(target: HybridTarget, docs: list[torch.Tensor]) -> list[TargetFeatures]:
    return separate_runs(target, docs)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_batch_matches_separate_runs_on_every_layer(target, docs, alone, layout: str) -> None:
    batch = TokenBatch.from_documents(docs, layout)
    errors = worst_error_per_layer(target(batch), batch, alone)
    assert max(errors) <= TOLERANCE, f"{layout}: per-layer relative errors {errors}"


def test_left_padding_matches_separate_runs(target, docs, alone) -> None:
    width = max(DOC_LENGTHS)
    input_ids = torch.zeros(len(docs), width, dtype=torch.long)
    attention_mask = torch.zeros(len(docs), width, dtype=torch.long)
    for row, doc in enumerate(docs):
        input_ids[row, width - doc.numel():] = doc
        attention_mask[row, width - doc.numel():] = 1
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    batch = TokenBatch(input_ids, position_ids, attention_mask.clone(), attention_mask=attention_mask)
    errors = worst_error_per_layer(target(batch), batch, alone)
    assert max(errors) <= TOLERANCE, f"left padding: per-layer relative errors {errors}"


def test_negative_control_without_document_reset_leaks(target, docs, alone) -> None:
    batch = TokenBatch.from_documents(docs, "packed")
    target.leak_across_documents = True
    try:
        leaked = worst_error_per_layer(target(batch), batch, alone)
    finally:
        target.leak_across_documents = False
    assert max(leaked) > 1e-2, f"cross-document leak not detected: per-layer relative errors {leaked}"
    restored = worst_error_per_layer(target(batch), batch, alone)
    assert max(restored) <= TOLERANCE


def test_recurrent_gdn_backend_agrees_on_a_packed_row(target) -> None:
    docs = documents([9, 1, 70, 20], seed=3)
    batch = TokenBatch.from_documents(docs, "packed")
    chunked = target(batch, gdn_backend="torch-chunk")
    recurrent = target(batch, gdn_backend="torch-recurrent")
    for a, b in zip(chunked.hidden_states, recurrent.hidden_states):
        assert max_relative_difference(a, b) <= TOLERANCE


def test_packed_row_with_one_document_equals_the_unpacked_run(target) -> None:
    doc = documents([77], seed=4)
    packed = target(TokenBatch.from_documents(doc, "packed"))
    padded = target(TokenBatch.from_documents(doc, "padded"))
    for a, b in zip(packed.hidden_states, padded.hidden_states):
        assert max_relative_difference(a, b) <= TOLERANCE


def test_packed_forward_checks_boundaries_and_plans_chunks_once(target, docs, monkeypatch) -> None:
    """A batch from TokenBatch.from_documents carries its checked host boundaries: the target reads
    nothing back (no device sync on CUDA). A raw batch (cu_seqlens set by hand) is checked and read
    back once per forward. Either way the GDN chunk plan and conv windows are built by the first
    layer that needs them, not once per layer."""
    import harness.models.gdn.gated_delta as gated_delta_module
    import harness.models.layout as layout_module
    import harness.models.gdn.short_conv as short_conv_module

    calls = {"validate": 0, "plan": 0, "windows": 0}

    def counting(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return wrapper

    trusted = TokenBatch.from_documents(docs, "packed")
    raw = TokenBatch.from_documents(docs, "packed")
    raw.cu_seqlens = raw.cu_seqlens.clone()  # a new tensor: the host copy no longer describes it
    assert trusted.cu_seqlens_host is not None and raw.cu_seqlens_host is None
    monkeypatch.setattr(layout_module, "validate_cu_seqlens", counting("validate", layout_module.validate_cu_seqlens))
    monkeypatch.setattr(gated_delta_module, "_plan_chunks", counting("plan", gated_delta_module._plan_chunks))
    monkeypatch.setattr(short_conv_module, "_document_head_windows",
                        counting("windows", short_conv_module._document_head_windows))
    linear_layers = target.config.layer_types.count("linear_attention")
    assert linear_layers >= 2, "the test needs several GDN layers to show the plan is shared"
    expected = target(raw, gdn_backend="torch-chunk")
    assert calls == {"validate": 1, "plan": 1, "windows": 1}
    got = target(trusted.to("cpu"), gdn_backend="torch-chunk")
    assert calls == {"validate": 1, "plan": 2, "windows": 2}
    for a, b in zip(got.hidden_states, expected.hidden_states):
        assert torch.equal(a, b)


def test_prepared_documents_give_the_same_result_as_raw_cu_seqlens() -> None:
    from harness.models.gdn.gated_delta import gated_delta_rule
    from harness.models.layout import PackedDocuments
    from harness.models.gdn.short_conv import causal_conv1d

    lengths = [5, 1, 40, 17]
    total = sum(lengths)
    cu = torch.tensor([0, 5, 6, 46, 63], dtype=torch.int32)
    prepared = PackedDocuments.from_cu_seqlens(cu, total=total)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, total, 2, 16, generator=gen) for _ in range(3))
    g = -torch.rand(1, total, 2, generator=gen)
    beta = torch.rand(1, total, 2, generator=gen)
    raw_out, _ = gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, backend="torch-chunk")
    prepared_out, _ = gated_delta_rule(q, k, v, g, beta, cu_seqlens=prepared, backend="torch-chunk")
    assert torch.equal(raw_out, prepared_out)
    x, weight = torch.randn(1, total, 8, generator=gen), torch.randn(8, 4, generator=gen)
    assert torch.equal(causal_conv1d(x, weight, cu_seqlens=cu), causal_conv1d(x, weight, cu_seqlens=prepared))
    kq, kk, kv = _qkv(total)
    assert torch.equal(document_causal_attention(kq, kk, kv, cu_seqlens=cu),
                       document_causal_attention(kq, kk, kv, cu_seqlens=prepared))
    # a prepared row of another length is refused like a raw one
    with pytest.raises(ValueError, match="must end at the packed length T=62"):
        causal_conv1d(x[:, :-1], weight, cu_seqlens=prepared)
    with pytest.raises(ValueError, match="must end at the packed length T=62"):
        gated_delta_rule(q[:, :-1], k[:, :-1], v[:, :-1], g[:, :-1], beta[:, :-1], cu_seqlens=prepared)


def test_prepared_documents_own_their_boundaries_and_survive_inference_mode() -> None:
    from harness.models.gdn.gated_delta import gated_delta_rule
    from harness.models.layout import PackedDocuments
    from harness.models.gdn.short_conv import causal_conv1d

    cu = torch.tensor([0, 5, 6, 46, 63], dtype=torch.int32)
    prepared = PackedDocuments.from_cu_seqlens(cu, total=63)
    cu[1] = 30  # a later write to the caller's tensor does not reach the prepared copy
    assert prepared.cu_seqlens.tolist() == list(prepared.bounds) == [0, 5, 6, 46, 63]

    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(1, 63, 8, generator=gen), torch.randn(8, 4, generator=gen)
    q, k, v = (torch.randn(1, 63, 2, 16, generator=gen) for _ in range(3))
    g, beta = -torch.rand(1, 63, 2, generator=gen), torch.rand(1, 63, 2, generator=gen)
    with torch.inference_mode():  # the first use builds (and caches) the index structures
        causal_conv1d(x, weight, cu_seqlens=prepared)
        gated_delta_rule(q, k, v, g, beta, cu_seqlens=prepared, backend="torch-chunk")
    # ... which a later call with gradients must be able to save for backward
    causal_conv1d(x.clone().requires_grad_(), weight, cu_seqlens=prepared).sum().backward()
    out, _ = gated_delta_rule(q.clone().requires_grad_(), k, v, g, beta, cu_seqlens=prepared, backend="torch-chunk")
    out.sum().backward()


# ----------------------------------------------------------------------------- attention op


def _qkv(total: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, total, 4, 16, generator=gen), torch.randn(1, total, 2, 16, generator=gen),
            torch.randn(1, total, 2, 16, generator=gen))


def test_packed_attention_equals_per_document_attention() -> None:
    lengths = [5, 1, 33, 12]
    q, k, v = _qkv(sum(lengths))
    cu = torch.tensor([0, 5, 6, 39, 51], dtype=torch.int32)
    packed = document_causal_attention(q, k, v, cu_seqlens=cu, backend="sdpa")
    for start, stop in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = document_causal_attention(q[:, start:stop], k[:, start:stop], v[:, start:stop])
        assert max_relative_difference(packed[:, start:stop], alone) <= TOLERANCE
    # a planted check that the op does separate documents: plain causal attention over the row differs
    plain = document_causal_attention(q, k, v)
    assert max_relative_difference(packed[:, 6:39], plain[:, 6:39]) > 1e-2


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_backend_matches_sdpa_on_cpu() -> None:
    lengths = [7, 1, 20]
    q, k, v = _qkv(sum(lengths), seed=1)
    cu = torch.tensor([0, 7, 8, 28], dtype=torch.int32)
    sdpa = document_causal_attention(q, k, v, cu_seqlens=cu, backend="sdpa")
    flex = document_causal_attention(q, k, v, cu_seqlens=cu, backend="flex")
    assert max_relative_difference(flex, sdpa) <= TOLERANCE


def test_attention_rejects_bad_input() -> None:
    q, k, v = _qkv(10)
    with pytest.raises(ValueError, match="start at 0"):
        document_causal_attention(q, k, v, cu_seqlens=torch.tensor([2, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="end at the packed length T=10"):
        document_causal_attention(q, k, v, cu_seqlens=torch.tensor([0, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="'flash' needs CUDA"):
        resolve_attention_backend("flash", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        document_causal_attention(q[:, :, :3], k, v)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-3), (torch.bfloat16, 5e-2)])
def test_gpu_packed_matches_cpu_separate_runs(target, docs, alone, dtype: torch.dtype, tolerance: float) -> None:
    # fp32 on GPU still differs by TF32 matmuls (fla documents ~1.5e-3); bf16 by its 8-bit mantissa.
    gpu = random_target().to("cuda", dtype)  # same weights as the CPU fixture
    batch = TokenBatch.from_documents(docs, "packed")
    features = gpu(batch)
    assert features.hidden_states[0].device.type == "cuda"
    per_layer = [
        max(max_relative_difference(part.float().cpu(), single.hidden_states[layer][0])
            for part, single in zip(per_document(features, batch, layer), alone))
        for layer in range(4)
    ]
    assert max(per_layer) <= tolerance, f"{dtype}: per-layer relative errors {per_layer}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_gpu_attention_backends_match_cpu(backend: str) -> None:
    lengths = [70, 1, 200, 64]
    q, k, v = _qkv(sum(lengths), seed=2)
    cu = torch.tensor([0, 70, 71, 271, 335], dtype=torch.int32)
    expected = document_causal_attention(q, k, v, cu_seqlens=cu, backend="sdpa")
    got = document_causal_attention(q.cuda(), k.cuda(), v.cuda(), cu_seqlens=cu.cuda(), backend=backend)
    assert max_relative_difference(got.cpu(), expected) <= 2e-3
