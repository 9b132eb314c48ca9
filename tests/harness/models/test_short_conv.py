"""Tests of the varlen depthwise causal conv: transformers parity, no leak at document starts, errors."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

from harness.models.compare import max_relative_difference
from harness.models.gdn.short_conv import causal_conv1d

TOL = 1e-6


@pytest.fixture(autouse=True)
def _quiet_transformers_fallback_warnings():
    """transformers warns that the causal-conv1d kernel is missing; that is expected here."""
    logging.getLogger("transformers").setLevel(logging.ERROR)



def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def transformers_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None):
    """transformers' torch fallback takes [B, D, T]; ours takes [B, T, D]."""
    return causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_transformers_fallback_on_unpacked_batches(activation, with_bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 11, 10, generator=gen)
    weight = torch.randn(10, 4, generator=gen)
    bias = torch.randn(10, generator=gen) if with_bias else None
    ours = causal_conv1d(x, weight, bias, activation=activation)
    assert ours.shape == x.shape
    assert max_relative_difference(ours, transformers_conv(x, weight, bias, activation)) <= TOL


def test_accepts_nn_conv1d_weight_layout():
    conv = torch.nn.Conv1d(6, 6, kernel_size=4, groups=6, padding=3, bias=False)
    x = torch.randn(2, 9, 6)
    with torch.no_grad():
        expected = torch.nn.functional.silu(conv(x.transpose(1, 2))[..., :9]).transpose(1, 2)
        ours = causal_conv1d(x, conv.weight)  # [D, 1, W]
    assert max_relative_difference(ours, expected) <= TOL


LENGTHS = [1, 2, 3, 4, 9, 1, 5]  # documents shorter than, equal to and longer than the width


@pytest.mark.parametrize("width", [2, 4])
def test_packed_row_equals_each_document_alone(width):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, sum(LENGTHS), 8, generator=gen)
    weight = torch.randn(8, width, generator=gen)
    bias = torch.randn(8, generator=gen)
    packed = causal_conv1d(x, weight, bias, cu_seqlens=cu_seqlens_of(LENGTHS))
    bounds = cu_seqlens_of(LENGTHS).tolist()
    alone = torch.cat([transformers_conv(x[:, s:e], weight, bias, "silu") for s, e in zip(bounds[:-1], bounds[1:])],
                      dim=1)
    assert max_relative_difference(packed, alone) <= TOL


def test_planted_leak_plain_conv_reads_previous_document_ours_does_not():
    """Document 0 is large, document 1 is zeros: alone, document 1's output is exactly silu(0) = 0."""
    lengths = [6, 5]
    x = torch.cat([torch.full((1, 6, 3), 100.0), torch.zeros(1, 5, 3)], dim=1)
    weight = torch.ones(3, 4)
    plain = causal_conv1d(x, weight)  # the whole row as one sequence
    ours = causal_conv1d(x, weight, cu_seqlens=cu_seqlens_of(lengths))
    second_doc = slice(6, None)
    assert plain[:, second_doc].abs().max() > 1.0  # the plain conv leaks into the first W-1 tokens
    assert torch.equal(ours[:, second_doc], torch.zeros(1, 5, 3))
    assert torch.allclose(ours[:, :6], plain[:, :6], rtol=0, atol=1e-5)  # the first document is unaffected


def test_gradients_of_packed_row_match_separate_documents():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, sum(LENGTHS), 5, generator=gen, dtype=torch.float64)
    weight = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    upstream = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    bounds = cu_seqlens_of(LENGTHS).tolist()

    x_packed, w_packed = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    (causal_conv1d(x_packed, w_packed, cu_seqlens=cu_seqlens_of(LENGTHS)) * upstream).sum().backward()

    x_alone, w_alone = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    total = sum((transformers_conv(x_alone[:, s:e], w_alone, None, "silu") * upstream[:, s:e]).sum()
                for s, e in zip(bounds[:-1], bounds[1:]))
    total.backward()
    assert max_relative_difference(x_packed.grad, x_alone.grad) <= 1e-12
    assert max_relative_difference(w_packed.grad, w_alone.grad) <= 1e-12


def test_output_dtype_follows_input():
    x = torch.randn(1, 7, 4, dtype=torch.bfloat16)
    out = causal_conv1d(x, torch.randn(4, 4), cu_seqlens=cu_seqlens_of([3, 4]))
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"x": torch.randn(7, 4)}, "x must be [B, T, D]"),
        ({"weight": torch.randn(5, 4)}, "weight must be depthwise [D, W]"),
        ({"weight": torch.randn(4, 2, 4)}, "weight must be depthwise [D, W]"),
        ({"bias": torch.randn(3)}, "bias must be [D] = (4,)"),
        ({"activation": "gelu"}, "activation='gelu' is not supported"),
        ({"cu_seqlens": torch.tensor([1, 3, 7], dtype=torch.int32)}, "must start at 0"),
        ({"cu_seqlens": torch.tensor([0, 3, 6], dtype=torch.int32)}, "must end at the packed length T=7"),
        ({"x": torch.randn(2, 7, 4)}, "batch dimension must be 1"),
        ({"backend": "cuda"}, "choose one of ('auto', 'torch', 'fla')"),
        ({"backend": "fla"}, "backend='fla' needs CUDA tensors"),
    ],
)
def test_bad_input_raises_clear_error(kwargs, message):
    args = {"x": torch.randn(1, 7, 4), "weight": torch.randn(4, 4), "bias": None,
            "cu_seqlens": cu_seqlens_of([3, 4])}
    args.update(kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        causal_conv1d(**args)
