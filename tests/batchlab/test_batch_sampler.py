"""StrategyBatchSampler: each rank's micro-batches of the plan, exactly once per epoch, resumable mid-epoch on any
world size, refusing a state of another plan; the lengths it reads and the errors it gives before any batch."""

from __future__ import annotations

import json

import numpy as np
import pytest
from torch.utils.data import DataLoader

from batchlab import DatasetLengthsError, RunBatches, SamplerStateError, StrategyBatchSampler, resolve_lengths
from strategies import available_strategies, plan

LENGTHS = np.random.default_rng(11).integers(3, 200, 300)
BUDGET = 512


def ranks(world_size: int, **options) -> list[StrategyBatchSampler]:
    return [StrategyBatchSampler(LENGTHS, max_tokens=BUDGET, rank=r, world_size=world_size, **options)
            for r in range(world_size)]


def visits(batches) -> np.ndarray:
    """How often each sample appears in ``batches`` (lists of indices)."""
    flat = [i for batch in batches for i in batch]
    return np.bincount(np.asarray(flat, dtype=np.int64), minlength=LENGTHS.size)


@pytest.mark.parametrize("strategy", available_strategies())
@pytest.mark.parametrize("world_size, grad_accum", [(1, 1), (3, 2)])
def test_every_sample_once_an_epoch_across_ranks_and_each_rank_yields_its_share_of_the_plan(strategy, world_size,
                                                                                          grad_accum):
    samplers = ranks(world_size, strategy=strategy, grad_accum=grad_accum, seed=4)
    for epoch in (0, 1):
        yielded = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            batches = list(sampler)
            assert len(batches) == len(sampler) == sampler.num_steps * grad_accum  # every rank runs every step
            expected = plan(LENGTHS, BUDGET, strategy=strategy, seed=4, epoch=epoch, world_size=world_size,
                            grad_accum=grad_accum)
            assert batches == [mb.tolist() for _, step in expected.rank_steps(sampler.rank) for mb in step]
            yielded += batches
        assert (visits(yielded) == 1).all()


def test_the_plan_follows_the_seed_and_the_epoch_and_repeats_for_the_same_pair():
    first, again, other_seed = (StrategyBatchSampler(LENGTHS, max_tokens=BUDGET, strategy="packed", seed=s)
                                for s in (1, 1, 2))
    assert list(first) == list(again)
    assert list(first) != list(other_seed)
    epoch0 = list(first)
    first.set_epoch(1)
    assert list(first) != epoch0
    first.set_epoch(0)
    assert list(first) == epoch0


def test_equal_token_steps_give_each_rank_its_real_micro_batches_and_the_same_step_count():
    samplers = ranks(2, strategy="packed", step_tokens=1500, seed=2)
    yielded, steps = [], set()
    for sampler in samplers:
        bounds = sampler.step_boundaries()
        batches = list(sampler)
        assert bounds[0] == 0 and bounds[-1] == len(batches) and (np.diff(bounds) >= 1).all()
        steps.add(sampler.num_steps)
        yielded += batches
    assert len(steps) == 1 and (visits(yielded) == 1).all()


@pytest.mark.parametrize("strategy", ["bucketed", "packed"])
def test_a_state_taken_mid_epoch_continues_with_the_same_batches(strategy):
    whole = list(StrategyBatchSampler(LENGTHS, max_tokens=BUDGET, strategy=strategy, seed=9, grad_accum=2))
    sampler = StrategyBatchSampler(LENGTHS, max_tokens=BUDGET, strategy=strategy, seed=9, grad_accum=2)
    head = []
    for batch in sampler:
        head.append(batch)
        if len(head) == 5:  # mid-step: the state keeps this rank's position, not only whole steps
            break
    state = sampler.state_dict()
    fresh = StrategyBatchSampler(LENGTHS, max_tokens=BUDGET, strategy=strategy, seed=9, grad_accum=2)
    fresh.load_state_dict(state)
    fresh.set_epoch(0)  # the loop's usual call keeps the restored position
    assert head + list(fresh) == whole
    assert list(fresh) == whole  # the next pass is the whole epoch again


@pytest.mark.parametrize("strategy", available_strategies())
@pytest.mark.parametrize("new_world, new_accum", [(1, 1), (3, 2)])
def test_resuming_on_another_world_size_visits_the_rest_of_the_epoch_exactly_once(strategy, new_world, new_accum):
    old = ranks(2, strategy=strategy, grad_accum=2, seed=6)
    steps_done = old[0].num_steps // 2
    done = [batch for sampler in old for batch in list(sampler)[:steps_done * 2]]
    state = old[1].state_dict() | old[1].state_for(0, steps_done)
    rest = []
    for sampler in ranks(new_world, strategy=strategy, grad_accum=new_accum, seed=6):
        sampler.load_state_dict(state)
        rest += list(sampler)
    assert (visits(done + rest) == 1).all()


def test_every_fingerprint_field_refuses_a_changed_value():
    base = dict(max_tokens=BUDGET, strategy="bucketed", seed=0, oversize="error", max_samples=None, step_tokens=None,
                balance=None, strategy_options={"num_buckets": 8})
    state = StrategyBatchSampler(LENGTHS, **base).state_dict()
    changes = {
        "samples": dict(lengths=LENGTHS[:-1]),
        "lengths_sha256": dict(lengths=LENGTHS[::-1].copy()),
        "max_tokens": dict(max_tokens=BUDGET + 1),
        "max_samples": dict(max_samples=64),
        "strategy": dict(strategy="sorted", strategy_options={}),
        "strategy_options": dict(strategy_options={"num_buckets": 9}),
        "seed": dict(seed=1),
        "oversize": dict(oversize="truncate"),
        "balance": dict(balance={"window_steps": 1}),
        "step_tokens": dict(step_tokens=2000),
    }
    assert set(changes) == set(state["fingerprint"])  # a new field must get a row here
    for field, change in changes.items():
        arguments = {**base, "lengths": LENGTHS, **change}
        sampler = StrategyBatchSampler(arguments.pop("lengths"), **arguments)
        with pytest.raises(SamplerStateError, match=f"{field}: state"):
            sampler.load_state_dict(state)
    StrategyBatchSampler(LENGTHS, **base, world_size=2, rank=1, grad_accum=3).load_state_dict(state)  # layout may


def test_a_state_of_another_format_is_refused_naming_it():
    sampler = StrategyBatchSampler(LENGTHS, max_tokens=BUDGET)
    with pytest.raises(SamplerStateError, match="format 0"):
        sampler.load_state_dict({**sampler.state_dict(), "format": 0})


def test_bad_input_is_refused_before_any_batch_naming_the_value_and_the_fix(monkeypatch):
    dataset = [{"input_ids": [1] * int(n)} for n in LENGTHS]
    with pytest.raises(DatasetLengthsError, match="299 lengths for a dataset of 300 samples"):
        StrategyBatchSampler(LENGTHS[:-1], dataset=dataset, max_tokens=BUDGET)
    shuffled = LENGTHS.copy()
    shuffled[[0, 1]] = shuffled[[1, 0]] + np.array([0, 1])
    with pytest.raises(DatasetLengthsError, match=r"sample 0: lengths says \d+ tokens but its 'input_ids' field"):
        StrategyBatchSampler(shuffled, dataset=dataset, max_tokens=BUDGET)
    with pytest.raises(ValueError, match=r"lengths\[2\] = 160 exceeds Budget.max_tokens=100.*oversize="):
        StrategyBatchSampler(LENGTHS, max_tokens=100)
    with pytest.raises(ValueError, match="world_size=400 leaves rank .* without a single sample"):
        StrategyBatchSampler(LENGTHS, max_tokens=BUDGET, world_size=400, rank=0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2 .* not initialised"):
        StrategyBatchSampler(LENGTHS, max_tokens=BUDGET)


def test_lengths_are_read_from_a_sequence_a_datasets_column_a_callable_or_the_tokens():
    datasets = pytest.importorskip("datasets")
    tokens = [[7] * int(n) for n in LENGTHS[:50]]
    table = datasets.Dataset.from_dict({"input_ids": tokens})
    with_length = table.add_column("length", [len(t) for t in tokens])
    expected = LENGTHS[:50]
    assert (resolve_lengths(None, table) == expected).all()
    assert (resolve_lengths(None, with_length) == expected).all()
    assert (resolve_lengths("length", with_length) == expected).all()
    assert (resolve_lengths(lambda i: len(tokens[i]), table) == expected).all()
    assert (resolve_lengths(None, [{"input_ids": t} for t in tokens]) == expected).all()
    with pytest.raises(DatasetLengthsError, match="no column 'n_tokens'"):
        resolve_lengths("n_tokens", table)


def test_plan_metrics_on_request_say_padding_recurrence_mix_and_balance():
    packed = StrategyBatchSampler(LENGTHS, max_tokens=BUDGET, strategy="packed", world_size=2, rank=0).plan_metrics()
    sorted_ = StrategyBatchSampler(LENGTHS, max_tokens=BUDGET, strategy="sorted", world_size=2, rank=0).plan_metrics()
    assert sorted_["recurrence"] == pytest.approx(1.0) and packed["recurrence"] < 0.5
    assert sorted_["length_mix_excess"] > packed["length_mix_excess"]
    assert {"padding_efficiency", "rank_imbalance"} <= set(packed) and packed["rank_imbalance"] >= 1.0


def test_a_data_loader_takes_it_with_its_collator():
    dataset = [{"input_ids": list(range(1, int(n) + 1))} for n in LENGTHS]
    sampler = StrategyBatchSampler(dataset=dataset, max_tokens=BUDGET, strategy="sorted")
    for batch in DataLoader(dataset, batch_sampler=sampler, collate_fn=sampler.collator()):
        rows = batch["input_ids"].shape[0]
        assert batch["input_ids"].numel() <= BUDGET  # rows x longest within the budget
        assert batch["attention_mask"].sum() - rows == (batch["labels"] != -100).sum()  # no label on padding


def run_of(epochs=2.0, max_steps=None, resume=None, world_size=1, rank=0):
    sampler = StrategyBatchSampler(LENGTHS, max_tokens=BUDGET, strategy="bucketed", seed=2, grad_accum=2,
                                   world_size=world_size, rank=rank)
    return sampler, RunBatches(sampler, epochs=epochs, max_steps=max_steps, resume=resume)


def test_a_run_is_its_epochs_one_after_the_other_whatever_their_lengths():
    sampler, run = run_of(epochs=2)
    epochs = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        epochs.append(list(sampler))
    assert len(epochs[0]) != len(epochs[1])  # bucketed epochs differ in length: the case the Trainer gets wrong
    assert list(run) == epochs[0] + epochs[1] and len(run) == len(epochs[0]) + len(epochs[1])
    assert run.steps == (len(epochs[0]) + len(epochs[1])) // 2
    _, half = run_of(epochs=1.5)
    assert list(half) == epochs[0] + epochs[1][:2 * -(-run.segments[1][3] // 2)]
    _, capped = run_of(max_steps=run.segments[0][3] + 3)
    assert list(capped) == epochs[0] + epochs[1][:6] and capped.steps == run.segments[0][3] + 3


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_run_resumed_from_any_step_opens_with_placeholders_then_continues_the_same_batches(world_size):
    _, whole = run_of(epochs=3)
    everything = list(whole)
    for step in (0, 3, whole.segments[0][3], whole.steps - 1):
        state = json.loads(json.dumps(whole.checkpoint(step)))  # as written to the checkpoint
        if world_size == 1:
            _, resumed = run_of(epochs=3, resume=state)
            assert list(resumed) == [[]] * (2 * step) + everything[2 * step:]
        else:  # 2 ranks finish the epoch the 1-rank run was in: with its done part, every sample once
            epoch, first, end, _ = run_of(epochs=3, resume=state, world_size=2, rank=0)[1].segments[0]
            before = sum(e - f for _, f, e, _ in whole.segments[:epoch])
            done = everything[2 * before:2 * step]
            rest = [b for r in (0, 1)
                    for b in list(run_of(epochs=3, resume=state, world_size=2, rank=r)[1])[2 * step:][:2 * (end - first)]]
            assert (visits(done + rest) == 1).all(), step
    assert whole.epoch_progress(0) == 0 and whole.epoch_progress(whole.steps) == 3
