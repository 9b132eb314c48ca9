"""GPU checks of the gated delta rule and short conv: fla's Triton kernels against the torch reference.

Skipped on machines without CUDA (and, for the fla tests, without flash-linear-attention).

Tolerances (max |a - b| / max |b|):
* torch-chunk on CUDA vs torch-recurrent, fp32: 1e-5 (plain fp32 matmuls, TF32 off by default).
* fla vs torch-chunk, fp32 inputs: 2e-3. fla's dot products run in TF32, which differs from fp32
  references by up to ~1.5e-3 (docs/design/target-and-drafter.md).
* fla vs torch-chunk, bf16 inputs: 2e-2 for outputs and final states (fla keeps the solved UT
  transform and the outputs in bf16; the reference gets the same bf16 inputs upcast to fp32),
  5e-2 for gradients.
* fla conv vs torch conv: 1e-5 in fp32 (no reductions beyond W products), 1e-2 in bf16.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from harness.models.compare import max_relative_difference
from harness.models.gdn.gated_delta import gated_delta_rule, resolve_backend
from harness.models.gdn.short_conv import causal_conv1d

HAS_CUDA = torch.cuda.is_available()
HAS_FLA = importlib.util.find_spec("fla") is not None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device"),
]
needs_fla = pytest.mark.skipif(not HAS_FLA, reason="needs flash-linear-attention (pip install 'batchlab[gpu]')")

LENGTHS = [1, 64, 65, 200, 7, 130, 33]  # length 1, exact chunk, chunk + 1, several chunks



def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def packed_inputs(dtype: torch.dtype, key_heads: int = 2, value_heads: int = 4, dim: int = 64,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(LENGTHS)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
    return {
        "q": randn(1, total, key_heads, dim).to(dtype),
        "k": randn(1, total, key_heads, dim).to(dtype),
        "v": randn(1, total, value_heads, dim).to(dtype),
        "g": -torch.nn.functional.softplus(randn(1, total, value_heads)),  # fp32, as the model computes it
        "beta": torch.sigmoid(randn(1, total, value_heads)).to(dtype),
        "initial_state": randn(len(LENGTHS), value_heads, dim, dim),
    }


def call(inputs: dict[str, torch.Tensor], backend: str, upcast: bool = False):
    tensors = {n: (t.float() if upcast else t) for n, t in inputs.items()}
    return gated_delta_rule(
        tensors["q"], tensors["k"], tensors["v"], tensors["g"], tensors["beta"],
        initial_state=tensors["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens_of(LENGTHS), backend=backend,
    )


def test_torch_chunk_on_cuda_matches_recurrent():
    inputs = packed_inputs(torch.float32, dim=16)
    out_chunk, state_chunk = call(inputs, "torch-chunk")
    out_rec, state_rec = call(inputs, "torch-recurrent")
    assert max_relative_difference(out_chunk, out_rec) <= 1e-5
    assert max_relative_difference(state_chunk, state_rec) <= 1e-5


@needs_fla
def test_auto_backend_picks_fla_on_cuda():
    assert resolve_backend("auto", torch.device("cuda")) == "fla"


@needs_fla
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-3), (torch.bfloat16, 2e-2)])
def test_fla_matches_torch_chunk_on_packed_rows(dtype, tolerance):
    inputs = packed_inputs(dtype)
    try:
        out_fla, state_fla = call(inputs, "fla")
    except AssertionError as error:  # some fla releases accept only bf16/fp16 inputs
        if dtype == torch.float32 and "float32" in str(error):
            pytest.skip(f"this fla release rejects fp32 inputs: {error}")
        raise
    out_ref, state_ref = call(inputs, "torch-chunk", upcast=True)
    assert out_fla.dtype == dtype and out_fla.shape == out_ref.shape
    assert max_relative_difference(out_fla, out_ref) <= tolerance
    assert max_relative_difference(state_fla, state_ref) <= tolerance


@needs_fla
def test_fla_gradients_match_torch_chunk_in_bf16():
    inputs = packed_inputs(torch.bfloat16, seed=1)
    upstream = torch.randn(1, sum(LENGTHS), 4, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    grads = {}
    for backend, upcast in (("fla", False), ("torch-chunk", True)):
        leaves = {n: (t.float() if upcast else t).clone().requires_grad_(n in ("q", "k", "v"))
                  for n, t in inputs.items()}
        out, _ = call(leaves, backend)
        (out.float() * upstream).sum().backward()
        grads[backend] = {n: leaves[n].grad for n in ("q", "k", "v")}
    for name in ("q", "k", "v"):
        assert max_relative_difference(grads["fla"][name], grads["torch-chunk"][name]) <= 5e-2, name


@needs_fla
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fla_conv_matches_torch_conv_on_packed_rows(dtype, tolerance):
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(1, sum(LENGTHS), 96, generator=gen, device="cuda").to(dtype)
    weight = torch.randn(96, 4, generator=gen, device="cuda").to(dtype)
    fla_out = causal_conv1d(x, weight, cu_seqlens=cu_seqlens_of(LENGTHS), backend="fla")
    torch_out = causal_conv1d(x.float(), weight.float(), cu_seqlens=cu_seqlens_of(LENGTHS), backend="torch")
    assert fla_out.shape == x.shape
    assert max_relative_difference(fla_out, torch_out) <= tolerance
