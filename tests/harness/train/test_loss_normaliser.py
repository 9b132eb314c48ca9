"""optim.loss_normaliser: a sample's Σw without a batch, the epoch constant, and what each arm does to a step's
gradient (the mechanism ablation's arm, harness/train/loop/loss_normaliser.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from support.train import IN_PROCESS, data_overrides, random_samples, write_samples_jsonl
from support.train import compose_config, read_jsonl

from harness.train.batch import BatchCollator
from harness.train.config import run_config_from_dict
from harness.train.launch.run import run


class _Docs:
    def __init__(self, docs):
        self.docs = docs

    def samples(self, rows):
        return [self.docs[r] for r in rows]


def test_a_samples_weight_without_a_batch_is_its_weight_in_any_batch():
    rng = np.random.default_rng(4)
    docs = []
    for _ in range(24):
        length = int(rng.integers(4, 70))
        docs.append((rng.integers(2, 90, length), (rng.random(length) > 0.25).astype(np.int64)))
    rows, lengths = np.arange(24), np.array([len(ids) for ids, _ in docs])
    lengths[3] = 9  # truncated in the plan: its mask is cut too
    for layout in ("padded", "packed"):
        collate = BatchCollator(_Docs(docs), layout, block_size=8, num_anchors=3, mask_token_id=90,
                                loss_decay_gamma=4.0, max_blocks=None, anchor_seed=7)
        alone = collate.weight_sums(rows, lengths, epoch=2)
        assert alone.sum() == pytest.approx(collate(rows, lengths, 2).weight_sum, rel=1e-12)
        assert alone[5] == pytest.approx(collate(rows[5:6], lengths[5:6], 2).weight_sum, rel=1e-12)
        assert alone[:11].sum() == pytest.approx(collate(rows[:11], lengths[:11], 2).weight_sum, rel=1e-12)
        assert (alone == 0).any() and (alone > 0).any()  # a sample without an anchor weighs nothing
        assert not np.array_equal(alone, collate.weight_sums(rows, lengths, epoch=3))  # the anchors move by epoch
    capped = BatchCollator(_Docs(docs), "padded", block_size=8, num_anchors=3, mask_token_id=90,
                           loss_decay_gamma=4.0, max_blocks=10, anchor_seed=7)
    with pytest.raises(ValueError, match="max_blocks=null"):
        capped.weight_sums(rows, lengths, epoch=0)


def test_the_epoch_arm_refuses_a_block_cap_and_unknown_arms_are_named():
    with pytest.raises(ValueError, match="drafter.max_blocks=null"):
        run_config_from_dict(compose_config([*IN_PROCESS, "optim.loss_normaliser=epoch", "drafter.max_blocks=64"]))
    with pytest.raises(ValueError, match="choose one of step, epoch"):
        run_config_from_dict(compose_config([*IN_PROCESS, "optim.loss_normaliser=mean"]))


def _first_step(tmp_path, data, name, *overrides):
    config = compose_config([*IN_PROCESS, *data_overrides(data), "trainer.max_tokens=128", "optim.grad_clip=0",
                             "grad_stats.every=1", *overrides])
    run(config, tmp_path / name)
    return read_jsonl(tmp_path / name / "metrics.jsonl")


def test_the_epoch_arm_gives_one_gradient_for_every_grouping_when_its_constant_is_the_steps_weight(tmp_path,
                                                                                                   batchlab_cache):
    """The whole training split in one step: the epoch's constant is that step's Σw, so both arms and each
    strategy's grouping of the 12 samples (padded one by one, padded by length, packed) give the same loss and
    gradient (every strategy under the step arm: test_train_step)."""
    data = write_samples_jsonl(tmp_path / "data.jsonl", random_samples(14, 12, 60, 300, seed=1))
    first = {}
    for strategy, arm in (("shuffle", "step"), ("shuffle", "epoch"), ("sorted", "epoch"), ("packed", "epoch")):
        first[strategy, arm] = _first_step(tmp_path, data, f"{strategy}-{arm}", f"strategy={strategy}",
                                           f"optim.loss_normaliser={arm}", "trainer.grad_accum=16",
                                           "trainer.stop_tokens=1")[0]
    reference = first["shuffle", "step"]
    assert reference["samples_per_step"] == 12
    for key, record in first.items():
        assert record["loss_divisor"] == pytest.approx(reference["step_weight_sum"], rel=1e-9), key
        assert record["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5), key
    assert len({r["computed_slots"] for r in first.values()}) > 1  # the groupings really differ


def test_the_epoch_arm_scales_a_steps_gradient_by_its_weight_over_the_epoch_constant(tmp_path, batchlab_cache):
    """Several steps an epoch: the constant is the epoch's Σw over its steps; a step's gradient is W / C times the
    step arm's (the same first step, no clipping), and the gradient statistics, which take mean-loss gradients,
    are the same in both arms."""
    data = write_samples_jsonl(tmp_path / "data.jsonl", random_samples(40, 10, 80, 300, seed=2))
    shape = ("strategy=sorted", "trainer.grad_accum=2", "trainer.stop_epochs=1", "trainer.stop_tokens=null")
    per_step = _first_step(tmp_path, data, "step", *shape)
    constant = _first_step(tmp_path, data, "epoch", *shape, "optim.loss_normaliser=epoch")
    assert len(per_step) == len(constant) >= 4
    weights = np.array([r["step_weight_sum"] for r in per_step])
    assert [r["step_weight_sum"] for r in constant] == pytest.approx(weights.tolist(), rel=1e-12)
    epoch_constant = weights.sum() / len(weights)
    assert [r["loss_divisor"] for r in constant] == pytest.approx([epoch_constant] * len(weights), rel=1e-9)
    assert [r["loss_divisor"] for r in per_step] == pytest.approx(weights.tolist(), rel=1e-12)
    assert weights.std() / weights.mean() > 0.05  # sorted steps differ in weight: the arms differ
    first_step, first_constant = per_step[0], constant[0]
    assert first_constant["grad_norm"] == pytest.approx(
        first_step["grad_norm"] * weights[0] / epoch_constant, rel=1e-5)
    assert not math.isclose(first_constant["grad_norm"], first_step["grad_norm"], rel_tol=1e-3)
    assert first_constant["loss"] == pytest.approx(first_step["loss"], rel=1e-6)  # the loss reported is Σ(w·CE)/W
    for key in ("grad_norm_sq_estimate", "grad_trace_estimate"):
        assert first_constant[key] == pytest.approx(first_step[key], rel=1e-5), key
