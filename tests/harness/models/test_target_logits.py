"""``HybridTarget.logits`` (all layers, final norm, LM head) equals transformers' ``Qwen3_5ForCausalLM`` logits.

Padded and packed batches are both compared with transformers running each document alone, on the
same weights (fp32). ``compute_logits`` is the same computation with autograd (pretraining).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3_5ForCausalLM

from harness.models.compare import max_relative_difference
from harness.models.config import load_target_config
from harness.models.layout import TokenBatch
from harness.models.target import HybridTarget

TINY = Path(__file__).resolve().parents[3] / "conf" / "target" / "tiny.yaml"
TOLERANCE = 1e-5
LENGTHS = (37, 150, 5, 90)


def reference_model(seed: int = 0) -> Qwen3_5ForCausalLM:
    """transformers' model with random weights, norm weights made non-trivial (zero at init)."""
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(load_target_config(TINY)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.2)
    return model


def documents(seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=generator) for n in LENGTHS]


def alone(reference: Qwen3_5ForCausalLM, doc: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(input_ids=doc[None]).logits[0]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_logits_equal_transformers_on_each_document_alone(layout: str) -> None:
    reference = reference_model()
    target = HybridTarget(reference.config)
    target.load_state_dict(reference.state_dict())
    docs = documents()
    batch = TokenBatch.from_documents(docs, layout)
    logits = target.logits(batch)
    assert not logits.requires_grad
    width = max(LENGTHS)
    assert logits.shape == ((len(docs), width, 256) if layout == "padded" else (1, sum(LENGTHS), 256))
    start = 0
    for row, doc in enumerate(docs):
        ours = logits[row, : doc.numel()] if layout == "padded" else logits[0, start : start + doc.numel()]
        start += doc.numel()
        error = max_relative_difference(ours, alone(reference, doc))
        assert error <= TOLERANCE, f"document {row} ({layout}): relative error {error:.2e}"


def test_compute_logits_records_gradients_and_matches_logits() -> None:
    reference = reference_model(seed=2)
    target = HybridTarget(reference.config)
    target.load_state_dict(reference.state_dict())
    batch = TokenBatch.from_documents(documents(seed=3), "packed")
    frozen = target.logits(batch)
    target.requires_grad_(True)
    live = target.compute_logits(batch)
    assert live.requires_grad and torch.equal(live.detach(), frozen)
    live.square().mean().backward()
    assert all(p.grad is not None for p in target.parameters())


def test_forward_still_stops_at_the_deepest_tap() -> None:
    target = HybridTarget(TINY, tap_layer_ids=[1])
    ran = []
    for index, layer in enumerate(target.model.layers):
        layer.register_forward_hook(lambda *_, index=index: ran.append(index))
    target(TokenBatch.from_documents(documents()[:2], "packed"))
    assert ran == [0, 1]
    ran.clear()
    target.logits(TokenBatch.from_documents(documents()[:2], "packed"))
    assert ran == [0, 1, 2, 3]
