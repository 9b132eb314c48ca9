"""Greedy speculative decoding (harness.eval): equals plain greedy, oracle and random acceptance,
the drafter's visibility at decode time, the eval's cost, and the held-out prompts."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch
from datasets import Dataset
from datasets.table import InMemoryTable
from torch import nn

from harness.data import samples as samples_module
from harness.data.samples import TokenizedSamples
from harness.eval import speculative as spec
from harness.eval.speculative import (
    evaluate_acceptance,
    greedy_decode,
    heldout_prompts,
    speculative_decode,
    speculative_decode_batch,
)
from harness.models.drafter import DFlashDrafter, load_drafter_config
from harness.models.layout import TokenBatch
from harness.models.target import HybridTarget

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def models():
    config = load_drafter_config(REPO / "conf" / "drafter" / "tiny.yaml")
    torch.manual_seed(0)
    target = HybridTarget(REPO / "conf" / "target" / "tiny.yaml", tap_layer_ids=config.target_layer_ids)
    torch.manual_seed(1)
    drafter = DFlashDrafter.from_target(target, config)
    return target, drafter


def random_prompts(count: int, seed: int, low: int = 3, high: int = 20) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=generator).tolist()
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]


class OracleDrafter(nn.Module):
    """Stand-in drafter whose proposals are the target's own greedy continuation of the tokens up to
    (and including) each block's anchor: it reads nothing after the anchor."""

    def __init__(self, target: HybridTarget, block_size: int, target_layer_ids: list[int]) -> None:
        super().__init__()
        self._target = (target,)
        self.block_size = block_size
        self.target_layer_ids = target_layer_ids

    def forward(self, batch: TokenBatch, target_hidden_states, anchors):
        (target,) = self._target
        vocab = target.config.vocab_size
        rows = []
        for doc, anchor in enumerate(anchors):
            prefix = batch.input_ids[doc, : int(anchor[0]) + 1].tolist()
            continuation = greedy_decode(target, prefix, self.block_size - 1)
            rows.append(nn.functional.one_hot(torch.tensor(continuation), vocab).float())
        return SimpleNamespace(logits=torch.stack(rows))


class CheckingPartialOracle(OracleDrafter):
    """The oracle with some proposals spoiled (partial acceptance: 1 < gains < B), which also checks
    that the context features it is given (positions < anchor) are the target's own features of the
    current sequence, reused from the verification forward, and that nothing from the anchor on is given."""

    calls = 0

    def forward(self, batch, target_hidden_states, anchors):
        (target,) = self._target
        output = super().forward(batch, target_hidden_states, anchors)
        for doc, anchor in enumerate(anchors):
            a = int(anchor[0])
            prefix = TokenBatch.from_documents([batch.input_ids[doc, : a + 1]], "padded")
            expected = target(prefix, tap_layer_ids=self.target_layer_ids).hidden_states
            for given, want in zip(target_hidden_states, expected):
                torch.testing.assert_close(given[doc, :a], want[0, :a], rtol=1e-4, atol=1e-5)
                assert not given[doc, a:].any()
            spoil = (a % 3) + 1  # slot of the first wrong proposal varies with the anchor
            if spoil < self.block_size - 1:
                output.logits[doc, spoil] = output.logits[doc, spoil].roll(1)
            self.calls += 1
        return output


# ---------------------------------------------------------------------- equals greedy
@pytest.mark.parametrize("max_new_tokens", [1, 3, 7, 20])
def test_speculative_output_equals_greedy(models, max_new_tokens):
    target, drafter = models
    for prompt in random_prompts(3, seed=max_new_tokens):
        greedy = greedy_decode(target, prompt, max_new_tokens)
        result = speculative_decode(target, drafter, prompt, max_new_tokens)
        assert result.tokens == greedy
        assert len(greedy) == max_new_tokens
        assert sum(result.accepted_per_forward) == max_new_tokens - 1  # the prefill gave the first
        assert result.target_forwards == 1 + len(result.accepted_per_forward)


def test_oracle_speculation_equals_greedy_and_stops_at_eos(models):
    target, drafter = models
    oracle = OracleDrafter(target, drafter.block_size, drafter.target_layer_ids)
    prompt = random_prompts(1, seed=11)[0]
    greedy = greedy_decode(target, prompt, 24)
    eos = greedy[10]  # its first occurrence ends the output
    expected = greedy[: greedy.index(eos) + 1]
    assert greedy_decode(target, prompt, 24, eos_id=eos) == expected
    for candidate in (drafter, oracle):
        result = speculative_decode(target, candidate, prompt, 24, eos_id=eos)
        assert result.tokens == expected
    assert speculative_decode(target, oracle, prompt, 24).tokens == greedy


def test_batched_decoding_equals_one_prompt_at_a_time(models):
    target, drafter = models
    prompts = random_prompts(4, seed=5)
    together = speculative_decode_batch(target, drafter, prompts, 12)
    for prompt, result in zip(prompts, together):
        alone = speculative_decode(target, drafter, prompt, 12)
        assert result.tokens == alone.tokens == greedy_decode(target, prompt, 12)
        assert result.accepted_per_forward == alone.accepted_per_forward


def test_partial_acceptance_equals_greedy_and_reuses_the_verification_features(models):
    target, drafter = models
    partial = CheckingPartialOracle(target, drafter.block_size, drafter.target_layer_ids)
    prompts = random_prompts(3, seed=13)
    results = speculative_decode_batch(target, partial, prompts, 30)
    for prompt, result in zip(prompts, results):
        assert result.tokens == greedy_decode(target, prompt, 30)
        assert 1 < max(result.accepted_per_forward[:-1]) < drafter.block_size
    assert partial.calls == sum(len(r.accepted_per_forward) for r in results)


# ---------------------------------------------------------------------- acceptance
def test_oracle_reaches_acceptance_block_size_and_random_about_one(models):
    target, drafter = models
    block = drafter.block_size
    oracle = OracleDrafter(target, block, drafter.target_layer_ids)
    prompts = random_prompts(3, seed=7)
    max_new = 1 + 2 * block + 3  # the prefill, two full rounds, a truncated one
    for prompt in prompts:
        result = speculative_decode(target, oracle, prompt, max_new)
        assert result.accepted_per_forward == [block, block, 3]
    metrics = evaluate_acceptance(target, oracle, prompts, max_new_tokens=1 + 4 * block)
    assert metrics["eval_tau_real"] == block
    assert metrics["eval_tau_real_hist"] == [0] * (block - 1) + [12]
    assert metrics["eval_speedup_bound"] == pytest.approx((1 + 4 * block) / 5)
    drafter.train()
    random_metrics = evaluate_acceptance(target, drafter, random_prompts(8, seed=8), max_new_tokens=16)
    assert drafter.training  # restored
    print(f"\noracle tau_real={metrics['eval_tau_real']:.3f}; random drafter tau_real="
          f"{random_metrics['eval_tau_real']:.3f} hist={random_metrics['eval_tau_real_hist']}")
    assert 1.0 <= random_metrics["eval_tau_real"] < 1.3
    assert sum(random_metrics["eval_tau_real_hist"]) == random_metrics["eval_real_target_forwards"] - 8
    assert random_metrics["eval_prompts"] == 8


class VaryingOracle(OracleDrafter):
    """The oracle whose first wrong draft sits at slot ``anchor % B`` (none when that is ``B - 1``):
    every gain from 1 to B occurs."""

    def forward(self, batch, target_hidden_states, anchors):
        output = super().forward(batch, target_hidden_states, anchors)
        for doc, anchor in enumerate(anchors):
            spoil = int(anchor[0]) % self.block_size
            if spoil < self.block_size - 1:
                output.logits[doc, spoil] = output.logits[doc, spoil].roll(1)
        return output


def independent_gains(target, drafter, prompt, max_new_tokens):
    """Tokens gained per verification forward, decoded independently of harness.eval: the drafts of each
    round from a fresh target forward of the sequence so far (features before the anchor, zeros after),
    scored against plain greedy decoding's continuation (not against the verification forward)."""
    block, taps = drafter.block_size, list(drafter.target_layer_ids)
    greedy = greedy_decode(target, prompt, max_new_tokens + block)
    produced, gains = 1, []  # the prefill gives the first token
    with torch.no_grad():
        while produced < max_new_tokens:
            sequence = list(prompt) + greedy[:produced]
            anchor = len(sequence) - 1
            features = target(TokenBatch.from_documents([torch.tensor(sequence)], "padded"),
                              tap_layer_ids=taps).hidden_states
            document = torch.tensor(sequence + [7] * (block - 1))
            visible = []
            for layer in features:
                padded = layer.new_zeros((1, document.numel(), layer.shape[-1]))
                padded[0, :anchor] = layer[0, :anchor]
                visible.append(padded)
            logits = drafter(TokenBatch.from_documents([document], "padded"), visible,
                             anchors=[torch.tensor([anchor])]).logits
            drafts = logits.argmax(dim=-1)[0].tolist()
            matched = 0
            while matched < block - 1 and drafts[matched] == greedy[produced + matched]:
                matched += 1
            gain = min(matched + 1, max_new_tokens - produced)
            gains.append(gain)
            produced += gain
    return gains


def test_real_acceptance_equals_an_independent_decode(models):
    """tau_real and its histogram from the decoder's own bookkeeping equal the gains of an independent
    decode, for the random drafter (gains of 1 and 2) and for a drafter right on a varying prefix of each
    block (gains from 1 to B)."""
    target, drafter = models
    drafter.eval()
    block = drafter.block_size
    prompts = random_prompts(4, seed=21)
    for candidate in (drafter, VaryingOracle(target, block, drafter.target_layer_ids)):
        per_prompt = [independent_gains(target, candidate, prompt, 20) for prompt in prompts]
        for prompt, expected in zip(prompts, per_prompt):
            assert speculative_decode(target, candidate, prompt, 20).accepted_per_forward == expected
        gains = [g for expected in per_prompt for g in expected]
        metrics = evaluate_acceptance(target, candidate, prompts, max_new_tokens=20)
        assert metrics["eval_tau_real"] == pytest.approx(np.mean(gains), rel=1e-12)
        assert metrics["eval_tau_real_hist"] == np.bincount(gains, minlength=block + 1)[1:].tolist()
        assert metrics["eval_speedup_bound"] == pytest.approx(len(prompts) * 20 / (len(prompts) + len(gains)))
    assert min(gains) == 1 and max(gains) == block and len(set(gains)) >= block // 2  # short to full


# ---------------------------------------------------------------------- visibility at decode time
def test_decode_time_block_sees_only_the_context_before_its_anchor(models):
    """The decode-time document (sequence + placeholders, zero features from the anchor on) drafts
    exactly what training's document (the real continuation and its features) drafts at that anchor."""
    target, drafter = models
    taps = drafter.target_layer_ids
    block = drafter.block_size
    document = random_prompts(1, seed=3, low=30, high=31)[0]
    full = TokenBatch.from_documents([torch.tensor(document)], "padded")
    features = target(full, tap_layer_ids=taps).hidden_states
    drafter.eval()
    with torch.no_grad():
        for anchor in (0, 5, 17, len(document) - block):
            reference = drafter(full, features, anchors=[torch.tensor([anchor])]).logits
            outputs = []
            for placeholder, noise in ((0, 0.0), (255, 0.0), (7, 3.0)):
                tokens = document[: anchor + 1] + [placeholder] * (block - 1)
                cut = [f[:, : anchor + block].clone() for f in features]
                for f in cut:  # positions >= anchor: zeros, or noise
                    f[:, anchor:] = noise * torch.randn_like(f[:, anchor:])
                batch = TokenBatch.from_documents([torch.tensor(tokens)], "padded")
                outputs.append(drafter(batch, cut, anchors=[torch.tensor([anchor])]).logits)
            for logits in outputs:
                torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
                assert torch.equal(logits.argmax(-1), reference.argmax(-1))


def test_placeholder_tokens_do_not_change_the_drafts(models, monkeypatch):
    target, drafter = models
    prompts = random_prompts(3, seed=9)
    before = speculative_decode_batch(target, drafter, prompts, 10)
    monkeypatch.setattr(spec, "PLACEHOLDER_ID", 123)
    after = speculative_decode_batch(target, drafter, prompts, 10)
    for a, b in zip(before, after):
        assert a.tokens == b.tokens and a.accepted_per_forward == b.accepted_per_forward


def test_edge_requests(models):
    target, drafter = models
    assert speculative_decode(target, drafter, [1, 2], 0).tokens == []
    assert greedy_decode(target, [1, 2], 0) == []
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        speculative_decode(target, drafter, [], 4)
    empty = evaluate_acceptance(target, drafter, [], 4)
    assert empty["eval_prompts"] == 0 and empty["eval_tau_real_hist"] == [0] * drafter.block_size


def test_eval_of_64_prompts_is_fast(models):
    target, drafter = models
    prompts = random_prompts(64, seed=12, low=8, high=48)
    start = time.perf_counter()
    metrics = evaluate_acceptance(target, drafter, prompts, max_new_tokens=16)
    elapsed = time.perf_counter() - start
    print(f"\neval of 64 prompts, 16 new tokens: {elapsed:.2f}s, tau_real={metrics['eval_tau_real']:.3f}")
    assert metrics["eval_prompts"] == 64 and metrics["eval_real_tokens"] == 64 * 16
    assert elapsed < 60


# ---------------------------------------------------------------------- held-out prompts
def _samples(ids, masks) -> TokenizedSamples:
    columns = {"input_ids": pa.array(ids, type=pa.list_(pa.int32())),
               "loss_mask": pa.array(masks, type=pa.list_(pa.int8()))}
    dataset = Dataset(InMemoryTable(pa.table(columns)))
    return TokenizedSamples(dataset, samples_module._lengths(dataset), "test data", "0" * 64)


def test_heldout_prompts():
    samples = _samples(
        [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 14], [15, 16, 17]],
        [[0, 0, 0, 1, 1], [1, 1, 1], [0, 1, 0, 1], [0, 0], [0, 1, 1]],
    )
    rows = np.array([0, 1, 2, 3, 4])
    assert heldout_prompts(samples, rows, 8, 10) == [[1, 2, 3], [9], [13, 14], [15]]
    assert heldout_prompts(samples, rows, 2, 10) == [[2, 3], [9], [13, 14], [15]]  # the last tokens
    assert heldout_prompts(samples, rows, 8, 2) == [[1, 2, 3], [9]]  # first `limit`, in row order
    assert heldout_prompts(samples, [4, 0], 8, 10) == [[15], [1, 2, 3]]
    assert heldout_prompts(samples, rows, 8, 10) == heldout_prompts(samples, rows, 8, 10)
    assert heldout_prompts(samples, [], 8, 10) == []
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        heldout_prompts(samples, rows, 0, 10)
