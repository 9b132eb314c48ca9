"""τ real replayed on the target's cached greedy continuation (harness/eval/replay.py) equals live speculative
decoding, whose tokens equal plain greedy decoding."""

from __future__ import annotations

import pytest
import torch
from test_speculative import CheckingPartialOracle, OracleDrafter, models, random_prompts  # noqa: F401 (fixture)

from harness.eval.replay import cached_replay, prepare_replay, replay_acceptance, replay_decode
from harness.eval.speculative import evaluate_acceptance, greedy_decode, speculative_decode_batch


class SpoiledOracle(OracleDrafter):
    """The oracle with one proposal spoiled at a slot that varies with the anchor: gains between 1 and B."""

    def forward(self, batch, target_hidden_states, anchors):
        output = super().forward(batch, target_hidden_states, anchors)
        for doc, anchor in enumerate(anchors):
            spoil = int(anchor[0]) % (self.block_size - 1)
            output.logits[doc, spoil] = output.logits[doc, spoil].roll(1)
        return output


@pytest.mark.parametrize("which", ["drafter", "oracle", "spoiled"])
def test_replayed_rounds_equal_live_decoding_and_its_tokens_plain_greedy(models, which):
    target, drafter = models
    block = drafter.block_size
    if which != "drafter":
        drafter = (OracleDrafter if which == "oracle" else SpoiledOracle)(target, block, list(drafter.target_layer_ids))
    prompts = random_prompts(4, seed=11)
    cached = prepare_replay(target, prompts, 11, drafter.target_layer_ids, batch_size=3)
    for prompt, replay in zip(prompts, cached):  # the cache holds the target's own greedy continuation
        assert replay.tokens == prompt + greedy_decode(target, prompt, 11)
    live = speculative_decode_batch(target, drafter, prompts, 11)
    replayed = replay_decode(drafter, cached, 11)
    assert [r.tokens for r in replayed] == [r.tokens for r in live]
    assert [r.accepted_per_forward for r in replayed] == [r.accepted_per_forward for r in live]
    assert [r.target_forwards for r in replayed] == [r.target_forwards for r in live]
    gains = {g for r in live for g in r.accepted_per_forward}
    if which == "oracle":
        assert max(gains) == block  # whole blocks accepted
    if which == "spoiled":
        assert len(gains) > 2  # partial acceptance, several lengths
    summary = replay_acceptance(drafter, cached, 11, batch_size=2)
    reference = evaluate_acceptance(target, drafter, prompts, 11, batch_size=2)
    for key in ("eval_tau_real", "eval_tau_real_hist", "eval_speedup_bound", "eval_real_tokens",
                "eval_real_target_forwards", "eval_accepted_per_prompt"):
        assert summary[key] == reference[key], key


def test_a_replay_stops_at_eos_and_at_fewer_new_tokens_than_were_cached(models):
    target, drafter = models
    oracle = OracleDrafter(target, drafter.block_size, list(drafter.target_layer_ids))
    prompts = random_prompts(4, seed=5)
    cached = prepare_replay(target, prompts, 12, oracle.target_layer_ids)
    for new_tokens in (1, 5, 12):
        live = speculative_decode_batch(target, oracle, prompts, new_tokens)
        assert [r.tokens for r in replay_decode(oracle, cached, new_tokens)] == [r.tokens for r in live]
    eos = cached[0].tokens[cached[0].prompt_length + 3]  # the first prompt's 4th greedy token
    with_eos = prepare_replay(target, prompts, 12, oracle.target_layer_ids, eos_id=eos)
    live = speculative_decode_batch(target, oracle, prompts, 12, eos_id=eos)
    replayed = replay_decode(oracle, with_eos, 12, eos_id=eos)
    assert [r.tokens for r in replayed] == [r.tokens for r in live] and replayed[0].tokens[-1] == eos


def test_the_replays_contexts_are_the_targets_features_before_each_anchor(models):
    target, drafter = models
    checking = CheckingPartialOracle(target, drafter.block_size, list(drafter.target_layer_ids))
    cached = prepare_replay(target, random_prompts(3, seed=2), 10, checking.target_layer_ids)
    replay_decode(checking, cached, 10)  # it asserts on every block: positions < anchor, nothing after
    assert checking.calls > 3


def test_a_run_that_replays_gets_the_real_acceptance_of_one_that_decodes_live(tmp_path, batchlab_cache):
    """eval.real_replay: the target's continuations once, at the first evaluation; every evaluation's numbers equal
    those of the same run decoding live."""
    import json

    from support.train import compose_config

    from harness.train.launch.run import run

    base = ["experiment=smoke", "trainer.nproc=1", "trainer.stop_tokens=6000", "eval.every_tokens=2500",
            "logger=none", "trainer.progress=false"]
    run(compose_config(base), tmp_path / "live")
    run(compose_config([*base, "eval.real_replay=true"]), tmp_path / "replay")

    def evaluations(name):
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["eval_tau_real"], r["eval_tau_real_hist"], r["eval_speedup_bound"])
                for r in records if "eval_tau_real" in r]

    live = evaluations("live")
    assert len(live) >= 3 and evaluations("replay") == live


def _counted(target):
    """``(builds, make_target)``: a target builder that counts its calls (a cache hit never calls it)."""
    builds = []

    def make_target():
        builds.append(1)
        return target

    return builds, make_target


def test_a_cached_replay_is_built_once_and_read_back_bit_for_bit(models, tmp_path):
    """Every run of a sweep reads the target's side from the cache: the entry equals a fresh prepare_replay exactly,
    a second run never builds the target, and other prompts, new tokens, taps or identity are another entry."""
    target, drafter = models
    prompts, taps = random_prompts(3, seed=2), list(drafter.target_layer_ids)
    builds, make_target = _counted(target)
    first = cached_replay(tmp_path, {"target": "t"}, make_target, prompts, 6, taps)
    again = cached_replay(tmp_path, {"target": "t"}, make_target, prompts, 6, taps)
    fresh = prepare_replay(target, prompts, 6, taps)
    assert len(builds) == 1
    for got in (first, again):
        assert [(r.tokens, r.prompt_length) for r in got] == [(r.tokens, r.prompt_length) for r in fresh]
        assert all(torch.equal(a, b) for r, f in zip(got, fresh) for a, b in zip(r.features, f.features))
    for other in ((prompts[:2], 6, taps, {"target": "t"}), (prompts, 5, taps, {"target": "t"}),
                  (prompts, 6, taps[:1], {"target": "t"}), (prompts, 6, taps, {"target": "u"})):
        cached_replay(tmp_path, other[3], make_target, other[0], other[1], other[2])
    assert len(builds) == 5


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_damaged_cached_replay_is_built_again_never_read(models, tmp_path, capsys, damage):
    from test_integrity import DAMAGES

    target, drafter = models
    prompts, taps = random_prompts(3, seed=2), list(drafter.target_layer_ids)
    builds, make_target = _counted(target)
    first = cached_replay(tmp_path, {"target": "t"}, make_target, prompts, 6, taps)
    (entry,) = [p for p in tmp_path.iterdir() if p.name.startswith("replay-")]
    largest = max((p for p in entry.rglob("*") if p.is_file() and p.name != "meta.json"),
                  key=lambda p: p.stat().st_size)
    DAMAGES[damage](largest)
    again = cached_replay(tmp_path, {"target": "t"}, make_target, prompts, 6, taps)
    assert len(builds) == 2 and f"cache entry {entry.name} is damaged" in capsys.readouterr().out
    assert all(torch.equal(a, b) for r, f in zip(first, again) for a, b in zip(r.features, f.features))
