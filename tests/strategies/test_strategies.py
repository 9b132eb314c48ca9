"""Behaviour of each batching strategy, the registry, rank balancing, resume and the size targets."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from strategies import (
    DEFAULT_NUM_BUCKETS,
    Budget,
    CostModel,
    LengthsError,
    Plan,
    RankBalance,
    Strategy,
    available_strategies,
    bucket_edges,
    build_strategy,
    plan,
    register_strategy,
    report_order,
    strategy_class,
    strategy_options,
    unregister_strategy,
)
from strategies.balance import rank_costs
from strategies.kernels import best_fit_packed, first_fit_packed, greedy_fill_padded

#: the built-in strategies and their layouts (the registry may hold more)
BUILTIN_LAYOUTS = {
    "bucketed": "padded", "length_grouped": "padded", "packed": "packed", "shuffle": "padded", "sorted": "padded"
}


def lognormal_lengths(n: int, seed: int = 0) -> np.ndarray:
    """The chat-902k length profile (median 600, sigma 1.0, clipped to [16, 8192]) at size n."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(600), 1.0, n)), 16, 8192).astype(np.int64)


def micro_batches(p: Plan) -> list[np.ndarray]:
    return [p.sample_indices[p.micro_batch_offsets[m] : p.micro_batch_offsets[m + 1]] for m in range(p.num_micro_batches)]


def padding_efficiency(p: Plan) -> float:
    return float(p.micro_batch_tokens().sum() / p.micro_batch_slots().sum())


def step_mean_length_lag1_acf(p: Plan) -> float:
    per_step = p.micro_batches_per_step
    tokens = p.micro_batch_tokens().reshape(-1, per_step).sum(axis=1)
    samples = p.micro_batch_sizes().reshape(-1, per_step).sum(axis=1)
    means = tokens / samples
    centred = means - means.mean()
    return float((centred[1:] * centred[:-1]).sum() / (centred * centred).sum())


def step_max_rank_cost(p: Plan, cost_model: CostModel) -> np.ndarray:
    costs = cost_model.micro_batch_costs(
        p.lengths, p.sample_indices, p.micro_batch_offsets, p.layout, p.budget.max_tokens
    ).reshape(p.num_steps, -1)
    return rank_costs(costs, p.world_size, p.grad_accum).max(axis=1)


# -- API and registry --------------------------------------------------------------------------


def test_registry_holds_the_built_ins_with_their_layouts_and_report_order():
    names = available_strategies()
    assert set(BUILTIN_LAYOUTS) <= set(names) and names == sorted(names)
    lengths = np.arange(1, 50)
    layouts = {name: plan(lengths, Budget(128), strategy=name).layout for name in names}
    assert layouts == {name: strategy_class(name).layout for name in names}
    assert {name: layouts[name] for name in BUILTIN_LAYOUTS} == BUILTIN_LAYOUTS
    # reports show sorted (the defect) first and shuffle (the random extreme) last of the built-ins
    order = report_order()
    assert sorted(order) == names
    built_in_order = [name for name in order if name in BUILTIN_LAYOUTS]
    assert built_in_order == ["sorted", "length_grouped", "bucketed", "packed", "shuffle"]


def test_build_strategy_plan_equals_top_level_plan():
    lengths = lognormal_lengths(3000, seed=3)
    strategy = build_strategy("bucketed", num_buckets=6, edges="quantile")
    by_object = strategy.plan(lengths, Budget(16384), seed=4, epoch=2, world_size=4, grad_accum=2)
    by_name = plan(lengths, Budget(16384), "bucketed", seed=4, epoch=2, world_size=4, grad_accum=2,
                   num_buckets=6, edges="quantile")
    np.testing.assert_array_equal(by_object.sample_indices, by_name.sample_indices)
    np.testing.assert_array_equal(by_object.micro_batch_offsets, by_name.micro_batch_offsets)
    assert by_name.info["options"] == {
        "num_buckets": 6, "edges": "quantile", "same_bucket_steps": True, "max_recurrence": 0.1
    }
    assert strategy_options("packed") == ["fit"]


def test_unknown_strategy_and_options_are_refused_with_the_accepted_ones():
    known = re.escape(", ".join(available_strategies()))
    with pytest.raises(ValueError, match=f"unknown strategy 'sortd'; known strategies: {known}$"):
        build_strategy("sortd")
    with pytest.raises(ValueError, match=r"no option\(s\) \['bucket_count'\].*num_buckets, edges, same_bucket_steps"):
        build_strategy("bucketed", bucket_count=8)
    with pytest.raises(ValueError, match=r"fit='worst'.*'first' or 'best'"):
        build_strategy("packed", fit="worst")
    with pytest.raises(ValueError, match=r"edges='median'.*'dp', 'quantile', 'equal_tokens'"):
        build_strategy("bucketed", edges="median")
    with pytest.raises(ValueError, match=r"options \['fit'\] given with a strategy object"):
        plan([1, 2], Budget(8), strategy=build_strategy("packed"), fit="best")


def test_register_strategy_adds_a_named_strategy():
    from strategies.builtin import ShuffleStrategy

    class ReversedShuffle(ShuffleStrategy):
        name = "reversed-shuffle"

    try:
        register_strategy(ReversedShuffle)
        assert "reversed-shuffle" in available_strategies()
        # it inherits shuffle's report_rank: reports show it right after shuffle
        assert report_order()[report_order().index("shuffle") + 1] == "reversed-shuffle"
        p = plan(np.arange(1, 30), Budget(64), strategy="reversed-shuffle")
        assert p.strategy == "reversed-shuffle" and p.exactly_once()
        with pytest.raises(ValueError, match="already registered"):
            register_strategy(type("Other", (ShuffleStrategy,), {"name": "reversed-shuffle"}))
    finally:
        unregister_strategy("reversed-shuffle")
    assert "reversed-shuffle" not in available_strategies()
    assert isinstance(build_strategy("sorted"), Strategy)


def test_a_cli_option_must_name_a_field_of_its_strategy():
    from dataclasses import dataclass
    from typing import ClassVar

    from strategies import CliOption
    from strategies.builtin import SortedStrategy

    @dataclass(frozen=True)
    class Misdeclared(SortedStrategy):
        name: ClassVar[str] = "misdeclared"
        cli_options: ClassVar[tuple] = (CliOption("--width", "width", "no such field"),)

    with pytest.raises(ValueError, match=r"'misdeclared': cli_options entry .*'width'.* must be a CliOption naming"):
        register_strategy(Misdeclared)
    assert "misdeclared" not in available_strategies()
    with pytest.raises(ValueError, match="give type or parse, not both"):
        CliOption("--width", "width", "", type=int, parse=int)
    with pytest.raises(ValueError, match="must start with '--'"):
        CliOption("width", "width", "")


# -- strategy semantics ------------------------------------------------------------------------


def test_sorted_composition_is_fixed_across_epochs_but_order_changes():
    lengths = lognormal_lengths(5000, seed=1)
    epoch0 = plan(lengths, Budget(16384), "sorted", seed=7, epoch=0, world_size=2)
    epoch1 = plan(lengths, Budget(16384), "sorted", seed=7, epoch=1, world_size=2)
    as_sets = lambda p: {frozenset(mb.tolist()) for mb in micro_batches(p) if mb.size}  # noqa: E731
    assert as_sets(epoch0) == as_sets(epoch1)
    assert not np.array_equal(epoch0.sample_indices, epoch1.sample_indices)
    # micro-batches are contiguous runs of the sorted lengths
    ranges = sorted((lengths[mb].min(), lengths[mb].max()) for mb in micro_batches(epoch0) if mb.size)
    assert all(previous[1] <= current[0] for previous, current in zip(ranges, ranges[1:]))
    assert padding_efficiency(epoch0) >= 0.99


def test_sorted_ties_follow_the_seed_not_the_epoch():
    lengths = np.full(200, 50)
    sets = lambda seed, epoch: {  # noqa: E731
        frozenset(mb.tolist()) for mb in micro_batches(plan(lengths, Budget(500), "sorted", seed=seed, epoch=epoch))
    }
    assert sets(1, 0) == sets(1, 5)
    assert sets(1, 0) != sets(2, 0)


def test_shuffle_fill_is_greedy_and_changes_every_epoch():
    lengths = lognormal_lengths(4000, seed=2)
    budget = Budget(16384, max_samples=12)
    p = plan(lengths, budget, "shuffle", seed=3, epoch=0)  # world_size 1: plan order = fill order
    batches = micro_batches(p)
    for current, following in zip(batches, batches[1:]):
        rows = current.size + 1
        longest = max(lengths[current].max(), lengths[following[0]])
        assert rows * longest > budget.max_tokens or rows > budget.max_samples
    other = plan(lengths, budget, "shuffle", seed=3, epoch=1)
    assert not np.array_equal(p.sample_indices, other.sample_indices)


def test_greedy_fill_kernel_respects_groups_budget_and_row_cap():
    lengths = np.array([3, 3, 3, 5, 1, 1, 1, 1, 2], dtype=np.int64)
    offsets = greedy_fill_padded(lengths, np.array([0, 4, 9], dtype=np.int64), 10, 3)
    # group 1: [3,3,3] (9 slots), [5]; group 2: [1,1,1] (row cap 3), [1,2]
    np.testing.assert_array_equal(offsets, [0, 3, 4, 7, 9])


def test_bucketed_micro_batches_stay_inside_one_bucket():
    lengths = lognormal_lengths(20000, seed=4)
    p = plan(lengths, Budget(16384), "bucketed", seed=0, epoch=3, world_size=4, num_buckets=8)
    edges = np.asarray(p.info["edges"])
    assert edges.size == 8 and edges[-1] == lengths.max()
    for mb in micro_batches(p):
        if mb.size:
            assert np.unique(np.searchsorted(edges, lengths[mb], side="left")).size == 1
    np.testing.assert_array_equal(edges, bucket_edges(lengths, 8, "dp", budget=Budget(16384)))


def test_bucketed_explicit_edges_and_default_bucket_count():
    lengths = lognormal_lengths(3000, seed=5)
    p = plan(lengths, Budget(16384), "bucketed", edges=[256, 1024])
    assert p.info["edges"] == [256, 1024, int(lengths.max())]
    for mb in micro_batches(p):
        buckets = np.searchsorted(np.asarray(p.info["edges"]), lengths[mb], side="left")
        assert np.unique(buckets).size == 1
    default = plan(lengths, Budget(16384), "bucketed")
    # 3,000 samples cannot fill 64 buckets under max_recurrence=0.1: the dp uses fewer
    assert 4 <= len(default.info["edges"]) < DEFAULT_NUM_BUCKETS == 64
    unbounded = plan(lengths, Budget(16384), "bucketed", max_recurrence=None)
    assert len(unbounded.info["edges"]) > len(default.info["edges"])


def small_corpus_lengths() -> np.ndarray:
    """A stand-in for the standard library's top-level definitions: 6,000 samples, median ~100, cap 8192."""
    rng = np.random.default_rng(21)
    return np.clip(np.round(rng.lognormal(np.log(100), 1.3, 6000)), 1, 8192).astype(np.int64)


def test_bucketed_default_stays_diverse_on_a_small_dataset():
    from strategies.metrics import composition_recurrence, step_recurrence

    lengths = small_corpus_lengths()
    budget = Budget(16384)
    kwargs = dict(seed=0, world_size=8)

    def recurrence_and_efficiency(**options):
        first = plan(lengths, budget, "bucketed", epoch=0, **kwargs, **options)
        second = plan(lengths, budget, "bucketed", epoch=1, **kwargs, **options)
        return composition_recurrence(first, second)[0], padding_efficiency(first)

    recurrence, efficiency = recurrence_and_efficiency()
    # measured 0.0975 and 80.0% (80.45% while the dp could still carve out one-sample buckets, alone
    # in their micro-batch every epoch; they now count as recurrence 1)
    assert recurrence <= 0.10 and efficiency >= 0.79, (recurrence, efficiency)
    # buckets too small for 1 / max_recurrence steps do not form steps of their own
    first, second = (plan(lengths, budget, "bucketed", epoch=e, **kwargs) for e in (0, 1))
    assert step_recurrence(first, second)[0] <= 0.12
    unbounded = [plan(lengths, budget, "bucketed", epoch=e, max_recurrence=None, **kwargs) for e in (0, 1)]
    assert step_recurrence(*unbounded)[0] > 0.3
    # the former default (32 unbounded dp buckets) repeats most micro-batch partners
    old_recurrence, old_efficiency = recurrence_and_efficiency(num_buckets=32, max_recurrence=None)
    assert old_recurrence > 0.3 and old_efficiency > efficiency
    tight, _ = recurrence_and_efficiency(max_recurrence=0.03)
    assert tight <= 0.03
    with pytest.raises(ValueError, match="max_recurrence"):
        build_strategy("bucketed", max_recurrence=0.0)


def test_bucketed_same_bucket_steps_keeps_steps_in_one_bucket():
    lengths = lognormal_lengths(30000, seed=6)
    num_buckets, world_size, grad_accum = 6, 4, 2
    p = plan(lengths, Budget(16384), "bucketed", world_size=world_size, grad_accum=grad_accum,
             num_buckets=num_buckets, same_bucket_steps=True, seed=1, epoch=1)
    edges = np.asarray(p.info["edges"])
    mixed = 0
    for step in range(p.num_steps):
        members = np.concatenate([mb for rank in p.step_micro_batches(step) for mb in rank])
        mixed += np.unique(np.searchsorted(edges, lengths[members], side="left")).size > 1
    # leftovers of each bucket (< one step each) fill at most num_buckets - 1 mixed steps, plus the last
    assert mixed <= num_buckets
    assert p.num_steps > 10 * num_buckets
    assert p.exactly_once()
    free = plan(lengths, Budget(16384), "bucketed", world_size=world_size, grad_accum=grad_accum,
                num_buckets=num_buckets, same_bucket_steps=False, seed=1, epoch=1)
    free_mixed = sum(
        np.unique(np.searchsorted(edges, lengths[np.concatenate([mb for r in free.step_micro_batches(s) for mb in r])],
                                  side="left")).size > 1
        for s in range(free.num_steps)
    )
    assert free_mixed > mixed  # without the option most steps mix buckets


def test_bucketed_default_keeps_ranks_balanced_and_reports_the_mix_it_costs():
    from strategies.metrics import plan_metrics

    lengths = lognormal_lengths(100_000, seed=16)
    target = CostModel(c=0.0)
    default = plan_metrics(plan(lengths, Budget(16384), "bucketed", world_size=8), cost_model=target)
    mixed = plan_metrics(
        plan(lengths, Budget(16384), "bucketed", world_size=8, same_bucket_steps=False), cost_model=target
    )
    assert default["rank_imbalance"] <= 1.04 < mixed["rank_imbalance"]
    # the price: each step holds one bucket's lengths
    assert default["length_mix_excess"] > mixed["length_mix_excess"] + 0.5
    assert default["padding_efficiency"] == mixed["padding_efficiency"]


def test_packed_rows_hold_whole_samples_within_capacity():
    lengths = lognormal_lengths(20000, seed=7)
    for fit in ("first", "best"):
        p = plan(lengths, Budget(16384), "packed", fit=fit, world_size=4, seed=2)
        assert p.layout == "packed"
        assert p.micro_batch_tokens().max() <= 16384
        assert p.budget_violations().size == 0
        floor = np.ceil(lengths.sum() / 16384)
        assert (p.micro_batch_sizes() > 0).sum() <= floor / 0.99
        assert padding_efficiency(p) >= 0.99


def test_first_fit_and_best_fit_kernels_choose_different_rows():
    lengths = np.array([5, 7, 3], dtype=np.int64)
    grouped, offsets = first_fit_packed(lengths, 10, 100, 3)
    assert [grouped[offsets[r] : offsets[r + 1]].tolist() for r in range(offsets.size - 1)] == [[0, 2], [1]]
    grouped, offsets = best_fit_packed(lengths, 10, 100, 3)
    assert [grouped[offsets[r] : offsets[r + 1]].tolist() for r in range(offsets.size - 1)] == [[0], [1, 2]]


def test_packing_kernels_refuse_a_row_bound_that_is_too_small():
    lengths = np.array([6, 6, 6], dtype=np.int64)
    for kernel in (first_fit_packed, best_fit_packed):
        with pytest.raises(ValueError, match="max_bins is smaller than the rows needed"):
            kernel(lengths, 10, 100, 2)


def test_packed_respects_max_samples():
    p = plan(np.full(100, 3), Budget(1000, max_samples=7), "packed", fit="best")
    assert p.micro_batch_sizes().max() == 7
    assert p.budget_violations().size == 0 and p.exactly_once()


def test_length_grouped_follows_hugging_faces_megabatch_rule():
    lengths = lognormal_lengths(5000, seed=13)
    budget = Budget(16384)
    p = plan(lengths, budget, "length_grouped", seed=2, epoch=1, batch_size=10, mega_batch_mult=5,
             shuffle_order=False)  # world_size 1, HF order: plan order = megabatch order
    size = 50
    assert p.info["megabatch_size"] == size
    order = p.sample_indices
    assert order[0] == np.argmax(lengths) or lengths[order[0]] == lengths.max()  # longest sample first
    heads = np.arange(0, order.size, size)
    for start in heads:
        chunk = lengths[order[start + 1 : start + size]]
        assert np.all(np.diff(chunk) <= 0)  # longest first inside each megabatch (bar the swapped head)
    # micro-batches never span two megabatches; each is the greedy fill of its megabatch
    starts = p.micro_batch_offsets[:-1][p.micro_batch_sizes() > 0]
    assert set(heads.tolist()) <= set(starts.tolist())
    assert p.exactly_once() and p.budget_violations().size == 0
    # megabatches come from a fresh permutation each epoch
    other = plan(lengths, budget, "length_grouped", seed=2, epoch=2, batch_size=10, mega_batch_mult=5,
                 shuffle_order=False)
    assert set(order[:size].tolist()) != set(other.sample_indices[:size].tolist())


def test_length_grouped_default_megabatch_and_small_dataset_multiplier():
    lengths = lognormal_lengths(40000, seed=14)
    p = plan(lengths, Budget(16384), "length_grouped")
    batch = 16384 // int(np.median(lengths))
    assert p.info["megabatch_size"] == 50 * batch
    # Hugging Face lowers the multiplier to samples // (4 * batch_size) on small sets
    small = plan(lengths[:1000], Budget(16384), "length_grouped", batch_size=20)
    assert small.info["megabatch_size"] == (1000 // 80) * 20
    assert padding_efficiency(p) > padding_efficiency(plan(lengths, Budget(16384), "shuffle"))
    with pytest.raises(ValueError, match="mega_batch_mult"):
        build_strategy("length_grouped", mega_batch_mult=0)
    with pytest.raises(ValueError, match="shuffle_order"):
        build_strategy("length_grouped", shuffle_order="yes")


def test_hugging_face_order_oscillates_and_shuffled_order_does_not():
    """The step-mean-length ACF can tell the two orders apart (it fails for a length-grouped order)."""
    lengths = lognormal_lengths(60000, seed=15)
    budget = Budget(16384)
    hf = plan(lengths, budget, "length_grouped", shuffle_order=False, world_size=1)
    shuffled = plan(lengths, budget, "length_grouped", world_size=1)
    assert step_mean_length_lag1_acf(hf) > 0.6
    assert abs(step_mean_length_lag1_acf(shuffled)) < 0.1
    # same micro-batches, only their order differs
    assert {frozenset(mb.tolist()) for mb in micro_batches(hf)} == {
        frozenset(mb.tolist()) for mb in micro_batches(shuffled)
    }


def test_short_final_step_gets_empty_micro_batches_spread_over_ranks():
    # 10 identical samples, one per micro-batch -> 10 micro-batches on 4 ranks x 2 accum = 2 steps
    p = plan(np.full(10, 8), Budget(8), "shuffle", world_size=4, grad_accum=2)
    assert p.num_steps == 2
    last = p.step_micro_batches(1)
    real_per_rank = [sum(mb.size for mb in rank) for rank in last]
    assert real_per_rank == [1, 1, 0, 0]
    assert all(mb.size == 1 for rank in p.step_micro_batches(0) for mb in rank)
    assert p.exactly_once()


def test_resume_from_a_step_equals_the_tail_of_the_full_iteration():
    lengths = lognormal_lengths(6000, seed=8)
    for name in available_strategies():
        kwargs = dict(seed=5, epoch=3, world_size=3, grad_accum=2)
        full = plan(lengths, Budget(16384), name, **kwargs)
        rebuilt = plan(lengths, Budget(16384), name, **kwargs)  # a restarted job rebuilds from (seed, epoch)
        start = full.num_steps // 2
        for rank in range(3):
            tail = list(full.rank_steps(rank))[start:]
            resumed = list(rebuilt.rank_steps(rank, start_step=start))
            assert [s for s, _ in tail] == [s for s, _ in resumed]
            for (_, expected), (_, got) in zip(tail, resumed):
                assert all(np.array_equal(a, b) for a, b in zip(expected, got))


def test_different_epochs_give_different_orders():
    lengths = lognormal_lengths(3000, seed=9)
    for name in available_strategies():
        a = plan(lengths, Budget(16384), name, seed=1, epoch=0, world_size=2)
        b = plan(lengths, Budget(16384), name, seed=1, epoch=1, world_size=2)
        assert not np.array_equal(a.sample_indices, b.sample_indices), name


# -- oversize ----------------------------------------------------------------------------------


def test_truncate_and_drop_are_recorded_and_logged(caplog):
    lengths = np.array([10, 500, 20, 300, 30])
    with caplog.at_level(logging.WARNING, logger="strategies.validate"):
        truncated = plan(lengths, Budget(100), "sorted", oversize="truncate")
    assert truncated.truncated.tolist() == [1, 3]
    assert truncated.lengths.tolist() == [10, 100, 20, 100, 30]
    assert truncated.exactly_once() and truncated.budget_violations().size == 0
    assert "2 sample(s)" in caplog.text and "truncate" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="strategies.validate"):
        dropped = plan(lengths, Budget(100), "packed", oversize="drop", world_size=2)
    assert dropped.dropped.tolist() == [1, 3]
    assert sorted(dropped.sample_indices.tolist()) == [0, 2, 4]
    assert dropped.exactly_once() and dropped.kept_indices().tolist() == [0, 2, 4]
    assert dropped.lengths.tolist() == lengths.tolist()
    assert "left out" in caplog.text and dropped.info["oversize"] == "drop"


def test_oversize_error_is_the_default():
    with pytest.raises(LengthsError, match=r"lengths\[1\] = 500 exceeds Budget.max_tokens=100"):
        plan([10, 500], Budget(100), "shuffle")


# -- rank balance ------------------------------------------------------------------------------


def test_rank_balance_lowers_max_rank_cost_and_never_raises_it():
    lengths = lognormal_lengths(20000, seed=10)
    model = CostModel(a=1.0, b=8e-6)
    # packed rows all cost about the same (full capacity), so there is little to gain there
    for name, gain in (("shuffle", 0.97), ("packed", 0.999)):
        kwargs = dict(seed=3, epoch=1, world_size=4, grad_accum=4)
        plain = plan(lengths, Budget(16384), name, **kwargs)
        balanced = plan(lengths, Budget(16384), name, balance=RankBalance(cost_model=model), **kwargs)
        before, after = step_max_rank_cost(plain, model), step_max_rank_cost(balanced, model)
        assert np.all(after <= before * (1 + 1e-12))
        assert after.sum() < gain * before.sum(), name
        assert balanced.exactly_once()
        # balancing moves micro-batches between ranks of a step, never between steps
        for step in range(plain.num_steps):
            lhs = np.sort(np.concatenate([mb for r in plain.step_micro_batches(step) for mb in r]))
            rhs = np.sort(np.concatenate([mb for r in balanced.step_micro_batches(step) for mb in r]))
            np.testing.assert_array_equal(lhs, rhs)


def test_rank_balance_windows_help_without_accumulation():
    lengths = lognormal_lengths(20000, seed=11)
    model = CostModel()
    kwargs = dict(seed=0, epoch=0, world_size=8, grad_accum=1)
    plain = plan(lengths, Budget(16384), "shuffle", **kwargs)
    in_step = plan(lengths, Budget(16384), "shuffle", balance={"cost_model": {"a": 1.0, "b": 8e-6}}, **kwargs)
    windowed = plan(lengths, Budget(16384), "shuffle", balance={"a": 1.0, "b": 8e-6, "window_steps": 4}, **kwargs)
    # with one micro-batch per rank, in-step placement cannot change the max
    np.testing.assert_allclose(step_max_rank_cost(in_step, model).sum(), step_max_rank_cost(plain, model).sum(), rtol=1e-12)
    assert step_max_rank_cost(windowed, model).sum() < 0.95 * step_max_rank_cost(plain, model).sum()
    assert windowed.exactly_once() and windowed.info["balance"]["window_steps"] == 4
    assert windowed.micro_batch_sizes()[: -windowed.micro_batches_per_step].min() > 0  # empties stay last


def test_rank_balance_rejects_bad_settings():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['d'\]"):
        plan([1, 2], Budget(8), "sorted", balance={"d": 1.0})
    with pytest.raises(ValueError, match="window_steps=0 must be >= 1"):
        RankBalance(window_steps=0)
    with pytest.raises(ValueError, match="must be None, a RankBalance or a mapping"):
        plan([1, 2], Budget(8), "sorted", balance="yes")


# -- the size targets (chat-902k profile, max_tokens=16384, world_size=8) ------------------------


@pytest.mark.slow
def test_chat_902k_targets():
    from strategies.metrics import composition_recurrence

    lengths = lognormal_lengths(902_000, seed=0)
    budget = Budget(16384)
    results = {}  # plan time is a benchmark goal (benchmarks/plan_speed.py), not asserted here
    for name in available_strategies():
        p = plan(lengths, budget, name, seed=0, epoch=0, world_size=8)
        results[name] = padding_efficiency(p)
        assert p.exactly_once(), name
    assert results["packed"] >= 0.995, results
    assert results["sorted"] >= 0.99, results
    assert results["bucketed"] >= 0.97, results
    assert results["shuffle"] < results["bucketed"]
    # rank balance of the default (same_bucket_steps) under the target's cost terms
    from strategies.metrics import plan_metrics

    bucketed = plan(lengths, budget, "bucketed", seed=0, epoch=0, world_size=8)
    assert plan_metrics(bucketed, cost_model=CostModel(c=0.0))["rank_imbalance"] <= 1.04
    following = plan(lengths, budget, "bucketed", seed=0, epoch=1, world_size=8)
    assert composition_recurrence(plan(lengths, budget, "bucketed", seed=0, epoch=0, world_size=8), following)[0] <= 0.01
    # The step-mean-length ACF of a permuted micro-batch order is ~0 by construction, so asserting
    # it for our strategies could not fail; what the metric must do is catch a length-grouped order.
    hf_order = plan(lengths, budget, "length_grouped", shuffle_order=False, seed=0, epoch=0, world_size=8)
    assert step_mean_length_lag1_acf(hf_order) > 0.3


def test_long_samples_and_large_budgets_plan_correctly():
    lengths = np.random.default_rng(12).integers(1, 200_000, 3000)  # beyond 16-bit lengths
    for name in available_strategies():
        p = plan(lengths, Budget(1_000_000), name, world_size=3, grad_accum=2)
        assert p.exactly_once() and p.budget_violations().size == 0, name
