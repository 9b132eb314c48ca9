"""Tests of the gated delta rule op: chunked vs recurrent, packed vs separate, transformers parity, errors."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from harness.models.compare import max_relative_difference
from harness.models.gdn.gated_delta import (
    GATED_DELTA_BACKENDS,
    default_chunk_size,
    gated_delta_rule,
    resolve_backend,
)

FP32_TOL = 1e-5
FP64_TOL = 1e-10


@pytest.fixture(autouse=True)
def _quiet_transformers_fallback_warnings():
    """transformers warns once per call that fla is missing; that is expected here."""
    logging.getLogger("transformers").setLevel(logging.ERROR)



def random_inputs(
    batch: int,
    length: int,
    key_heads: int = 2,
    value_heads: int = 4,
    key_dim: int = 8,
    value_dim: int = 6,
    num_states: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    decay_scale: float = 1.0,
) -> dict[str, torch.Tensor]:
    """q, k, v, g (log-decay, as the model computes it), beta and one initial state per document."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype)  # noqa: E731
    a = randn(batch, length, value_heads)
    a_log = torch.linspace(-1.0, 1.0, value_heads, dtype=dtype)
    return {
        "q": randn(batch, length, key_heads, key_dim),
        "k": randn(batch, length, key_heads, key_dim),
        "v": randn(batch, length, value_heads, value_dim),
        "g": -decay_scale * a_log.exp() * torch.nn.functional.softplus(a),
        "beta": torch.sigmoid(randn(batch, length, value_heads)),
        "initial_state": randn(num_states or batch, value_heads, key_dim, value_dim),
    }


def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def run(inputs: dict[str, torch.Tensor], use_initial_state: bool = True, **kwargs):
    initial_state = inputs["initial_state"] if use_initial_state else None
    return gated_delta_rule(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                            initial_state=initial_state, **kwargs)


@pytest.mark.parametrize("use_initial_state", [False, True])
@pytest.mark.parametrize("l2norm", [False, True])
@pytest.mark.parametrize("heads", [(2, 4), (3, 3)], ids=["H<HV", "H=HV"])
def test_chunk_matches_recurrent_on_padded_batches(use_initial_state, l2norm, heads):
    inputs = random_inputs(batch=3, length=41, key_heads=heads[0], value_heads=heads[1])
    kwargs = dict(use_initial_state=use_initial_state, use_qk_l2norm_in_kernel=l2norm, output_final_state=True)
    out_chunk, state_chunk = run(inputs, backend="torch-chunk", chunk_size=16, **kwargs)
    out_rec, state_rec = run(inputs, backend="torch-recurrent", **kwargs)
    assert out_chunk.shape == (3, 41, heads[1], 6)
    assert state_chunk.shape == (3, heads[1], 8, 6)
    assert max_relative_difference(out_chunk, out_rec) <= FP32_TOL
    assert max_relative_difference(state_chunk, state_rec) <= FP32_TOL


PACKED_LENGTHS = [1, 16, 17, 5, 53, 32, 2]  # length 1, multiples of the chunk, a 4-chunk document


@pytest.mark.parametrize("use_initial_state", [False, True])
@pytest.mark.parametrize("l2norm", [False, True])
def test_chunk_matches_recurrent_on_packed_rows(use_initial_state, l2norm):
    inputs = random_inputs(batch=1, length=sum(PACKED_LENGTHS), num_states=len(PACKED_LENGTHS))
    kwargs = dict(use_initial_state=use_initial_state, use_qk_l2norm_in_kernel=l2norm,
                  output_final_state=True, cu_seqlens=cu_seqlens_of(PACKED_LENGTHS))
    out_chunk, state_chunk = run(inputs, backend="torch-chunk", chunk_size=16, **kwargs)
    out_rec, state_rec = run(inputs, backend="torch-recurrent", **kwargs)
    assert state_chunk.shape == (len(PACKED_LENGTHS), 4, 8, 6)
    assert max_relative_difference(out_chunk, out_rec) <= FP32_TOL
    assert max_relative_difference(state_chunk, state_rec) <= FP32_TOL


def test_chunk_matches_recurrent_in_float64_with_default_chunk_and_strong_decay():
    lengths = [150, 1, 64, 63, 9]  # one document longer than two default chunks
    inputs = random_inputs(batch=1, length=sum(lengths), num_states=len(lengths), dtype=torch.float64,
                           decay_scale=8.0)
    kwargs = dict(output_final_state=True, cu_seqlens=cu_seqlens_of(lengths), use_qk_l2norm_in_kernel=True)
    out_chunk, state_chunk = run(inputs, backend="torch-chunk", **kwargs)
    out_rec, state_rec = run(inputs, backend="torch-recurrent", **kwargs)
    assert out_chunk.dtype == torch.float64
    assert max_relative_difference(out_chunk, out_rec) <= FP64_TOL
    assert max_relative_difference(state_chunk, state_rec) <= FP64_TOL


@pytest.mark.parametrize("backend", ["torch-chunk", "torch-recurrent"])
def test_packed_row_equals_each_document_run_alone(backend):
    inputs = random_inputs(batch=1, length=sum(PACKED_LENGTHS), num_states=len(PACKED_LENGTHS), seed=1)
    packed_out, packed_state = run(inputs, backend=backend, chunk_size=16, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens_of(PACKED_LENGTHS))
    start = 0
    for doc, length in enumerate(PACKED_LENGTHS):
        piece = {name: t[:, start:start + length] for name, t in inputs.items() if name != "initial_state"}
        piece["initial_state"] = inputs["initial_state"][doc:doc + 1]
        alone_out, alone_state = run(piece, backend=backend, chunk_size=16, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)
        assert max_relative_difference(packed_out[:, start:start + length], alone_out) <= FP32_TOL
        assert max_relative_difference(packed_state[doc], alone_state[0]) <= FP32_TOL
        start += length


def test_negative_control_packed_row_without_state_reset_leaks_across_documents():
    """Running the packed row as one sequence (no cu_seqlens) must differ from separate runs."""
    lengths = [40, 30, 25]
    inputs = random_inputs(batch=1, length=sum(lengths), seed=2)
    no_reset, _ = run(inputs, use_initial_state=False, backend="torch-chunk", chunk_size=16,
                      use_qk_l2norm_in_kernel=True)
    with_reset, _ = run(inputs, use_initial_state=False, backend="torch-chunk", chunk_size=16,
                        use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens_of(lengths))
    later_docs = slice(lengths[0], None)
    bounds = cu_seqlens_of(lengths).tolist()
    separate = torch.cat([
        run({n: t[:, start:end] for n, t in inputs.items() if n != "initial_state"}, use_initial_state=False,
            backend="torch-recurrent", use_qk_l2norm_in_kernel=True)[0]
        for start, end in zip(bounds[:-1], bounds[1:])
    ], dim=1)
    assert max_relative_difference(with_reset, separate) <= FP32_TOL
    assert max_relative_difference(no_reset[:, later_docs], separate[:, later_docs]) > 1e-2


@pytest.mark.parametrize("use_initial_state", [False, True])
def test_gradients_of_chunk_match_recurrent(use_initial_state):
    lengths = [1, 20, 9, 35]
    base = random_inputs(batch=1, length=sum(lengths), num_states=len(lengths), dtype=torch.float64, seed=3)
    weights = torch.randn(1, sum(lengths), 4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    state_weights = torch.randn(len(lengths), 4, 8, 6, dtype=torch.float64)
    grads = {}
    for backend in ("torch-chunk", "torch-recurrent"):
        leaves = {n: t.clone().requires_grad_(True) for n, t in base.items()}
        out, state = run(leaves, use_initial_state=use_initial_state, backend=backend, chunk_size=8,
                         output_final_state=True, use_qk_l2norm_in_kernel=True,
                         cu_seqlens=cu_seqlens_of(lengths))
        ((out * weights).sum() + (state * state_weights).sum()).backward()
        names = [n for n in leaves if n != "initial_state" or use_initial_state]
        grads[backend] = {n: leaves[n].grad for n in names}
    for name, grad in grads["torch-chunk"].items():
        assert grad is not None and grad.abs().max() > 0, name
        assert max_relative_difference(grad, grads["torch-recurrent"][name]) <= FP64_TOL, name


@pytest.mark.parametrize("l2norm", [False, True])
def test_parity_with_transformers_torch_chunk_and_recurrent(l2norm):
    """Same layout as transformers' functions ([B, T, H, K] in, [B, T, HV, V] out).

    transformers' Qwen3.5 layer repeats q/k heads up to the value heads before calling its functions
    (releases before 5.24 need that; later ones also accept fewer key heads), so the reference gets
    expanded q/k and our op the grouped ones.
    """
    inputs = random_inputs(batch=2, length=70, key_heads=2, value_heads=4, key_dim=16, value_dim=16, seed=4)
    args = (inputs["q"].repeat_interleave(2, dim=2), inputs["k"].repeat_interleave(2, dim=2), inputs["v"])
    common = dict(g=inputs["g"], beta=inputs["beta"], initial_state=inputs["initial_state"],
                  output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    ref_chunk_out, ref_chunk_state = torch_chunk_gated_delta_rule(*args, chunk_size=64, **common)
    ref_rec_out, ref_rec_state = torch_recurrent_gated_delta_rule(*args, **common)
    for backend, ref_out, ref_state in (("torch-chunk", ref_chunk_out, ref_chunk_state),
                                        ("torch-recurrent", ref_rec_out, ref_rec_state)):
        out, state = run(inputs, backend=backend, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
        assert max_relative_difference(out, ref_out) <= FP32_TOL, backend
        assert max_relative_difference(state, ref_state) <= FP32_TOL, backend


def test_output_keeps_input_dtype_and_final_state_is_optional():
    inputs = random_inputs(batch=2, length=10, dtype=torch.bfloat16)
    out, state = run(inputs, backend="torch-chunk", chunk_size=4)
    assert out.dtype == torch.bfloat16 and state is None
    reference, _ = run({n: t.float() for n, t in inputs.items()}, backend="torch-recurrent")
    assert max_relative_difference(out, reference) <= 1e-2  # only the bf16 rounding of the output


def test_explicit_scale_is_used():
    inputs = random_inputs(batch=1, length=12, key_dim=8)
    default, _ = run(inputs, backend="torch-chunk", chunk_size=4)
    doubled, _ = run(inputs, backend="torch-chunk", chunk_size=4, scale=2 * 8**-0.5)
    assert max_relative_difference(doubled, 2 * default) <= FP32_TOL  # o is linear in q


@pytest.mark.parametrize("backend", ["torch-chunk", "torch-recurrent"])
def test_empty_sequence_returns_empty_output_and_unchanged_state(backend):
    inputs = random_inputs(batch=2, length=0)
    out, state = run(inputs, backend=backend, output_final_state=True)
    assert out.shape == (2, 0, 4, 6)
    assert torch.equal(state, inputs["initial_state"])


def test_auto_backend_is_torch_chunk_on_cpu():
    assert resolve_backend("auto", torch.device("cpu")) == "torch-chunk"


@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.integers(min_value=1, max_value=20), min_size=1, max_size=5),
       chunk_size=st.sampled_from([1, 3, 4, 8]))
def test_packed_chunk_matches_recurrent_for_any_lengths(lengths, chunk_size):
    inputs = random_inputs(batch=1, length=sum(lengths), num_states=len(lengths), dtype=torch.float64)
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens_of(lengths))
    out_chunk, state_chunk = run(inputs, backend="torch-chunk", chunk_size=chunk_size, **kwargs)
    out_rec, state_rec = run(inputs, backend="torch-recurrent", **kwargs)
    assert max_relative_difference(out_chunk, out_rec) <= FP64_TOL
    assert max_relative_difference(state_chunk, state_rec) <= FP64_TOL


# ---- bad input -------------------------------------------------------------------------------------

def _bad_call(**overrides):
    inputs = random_inputs(batch=1, length=10, num_states=2)
    args = {"q": inputs["q"], "k": inputs["k"], "v": inputs["v"], "g": inputs["g"], "beta": inputs["beta"],
            "cu_seqlens": cu_seqlens_of([4, 6]), "backend": "torch-chunk"}
    args.update(overrides)
    q, k, v, g, beta = (args.pop(n) for n in ("q", "k", "v", "g", "beta"))
    return gated_delta_rule(q, k, v, g, beta, **args)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"cu_seqlens": torch.tensor([1, 4, 10], dtype=torch.int32)}, "must start at 0"),
        ({"cu_seqlens": torch.tensor([0, 4, 9], dtype=torch.int32)}, "must end at the packed length T=10"),
        ({"cu_seqlens": torch.tensor([0, 4, 10], dtype=torch.float32)}, "int32"),
        ({"q": torch.randn(2, 10, 2, 8), "k": torch.randn(2, 10, 2, 8), "v": torch.randn(2, 10, 4, 6),
          "g": -torch.rand(2, 10, 4), "beta": torch.rand(2, 10, 4)}, "batch dimension must be 1"),
        ({"k": torch.randn(1, 10, 2, 7)}, "k must have q's shape"),
        ({"q": torch.randn(10, 2, 8)}, "q must be [B, T, H, K]"),
        ({"v": torch.randn(1, 9, 4, 6)}, "v must be [B, T, HV, V]"),
        ({"v": torch.randn(1, 10, 3, 6), "g": -torch.rand(1, 10, 3), "beta": torch.rand(1, 10, 3)},
         "not a multiple"),
        ({"g": -torch.rand(1, 10, 2)}, "g must be [B, T, HV]"),
        ({"beta": torch.rand(1, 10)}, "beta must be [B, T, HV]"),
        ({"initial_state": torch.zeros(1, 4, 8, 6)}, "initial_state must be [N, HV, K, V] = (2, 4, 8, 6)"),
        ({"backend": "triton"}, "torch-recurrent"),
        ({"chunk_size": 0}, "chunk_size must be a positive int"),
    ],
)
def test_bad_input_raises_clear_error(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _bad_call(**overrides)


def test_fla_backend_on_cpu_tensors_says_how_to_fix(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA tensors.*torch-chunk"):
        _bad_call(backend="fla")


def test_triton_interpreter_lets_fla_take_cpu_tensors_but_auto_never_picks_it(monkeypatch):
    from harness.models.gdn.gated_delta import resolve_backend
    from harness.models.kernel_libraries import fla_available

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("auto", torch.device("cpu")) == "torch-chunk"
    if fla_available():
        assert resolve_backend("fla", torch.device("cpu")) == "fla"
    else:  # past the device check, the missing package is what is reported
        with pytest.raises(ValueError, match="flash-linear-attention, which is not installed"):
            resolve_backend("fla", torch.device("cpu"))


def test_known_backends_are_listed():
    assert GATED_DELTA_BACKENDS == ("torch-chunk", "torch-recurrent", "fla")
    with pytest.raises(ValueError, match="torch-chunk.*torch-recurrent.*fla"):
        _bad_call(backend="cuda")


@pytest.mark.parametrize("key_dim, expected", [(8, 16), (16, 16), (64, 32), (128, 64), (256, 64)])
def test_default_chunk_size_follows_the_key_head_dim(key_dim, expected):
    assert default_chunk_size(key_dim) == expected


def test_default_chunk_size_gives_the_same_result_as_any_explicit_chunk():
    lengths = [1, 40, 97, 16]
    inputs = random_inputs(1, sum(lengths), key_dim=16, value_dim=16, num_states=len(lengths), dtype=torch.float64)
    cu_seqlens = cu_seqlens_of(lengths)
    default_o, default_state = run(inputs, cu_seqlens=cu_seqlens, output_final_state=True)
    for chunk_size in (7, 64):
        o, state = run(inputs, cu_seqlens=cu_seqlens, output_final_state=True, chunk_size=chunk_size)
        assert max_relative_difference(default_o, o) < 1e-10
        assert max_relative_difference(default_state, state) < 1e-10
