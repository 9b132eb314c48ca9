"""Equal-token optimizer steps (``step_tokens``): the cut rule's bounds, the grid's padding, resume."""

from __future__ import annotations

import numpy as np
import pytest

from strategies import Budget, CostModel, RankBalance, available_strategies, build_strategy, plan, plan_remainder
from strategies.kernels import token_step_cuts
from strategies.balance import rank_costs

ALL = available_strategies()
BUDGET = Budget(16384)
T = 8 * BUDGET.max_tokens  # a global batch of eight full micro-batches


def lognormal(n: int, seed: int = 0) -> np.ndarray:
    """The chat-902k shape (median 600, sigma 1.0, clipped to [16, 8192]) at size n."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(600), 1.0, n)), 16, 8192).astype(np.int64)


def step_sequences(p) -> list[np.ndarray]:
    """Real tokens of each step's micro-batches, in (rank, accum) slot order, padding left out."""
    tokens = p.micro_batch_tokens().reshape(p.num_steps, -1)
    sizes = p.micro_batch_sizes().reshape(p.num_steps, -1)
    return [tokens[t][sizes[t] > 0] for t in range(p.num_steps)]


def check_grid(p) -> None:
    """The grid holds each rank's real micro-batches first, then empty padding slots only."""
    counts = p.rank_step_counts()
    assert counts.shape == (p.num_steps, p.world_size)
    filled = p.micro_batch_sizes().reshape(p.num_steps, p.world_size, p.grad_accum) > 0
    first = np.arange(p.grad_accum)[None, None, :] < counts[:, :, None]
    np.testing.assert_array_equal(filled, first)
    assert counts.sum(axis=1).min() >= 1, "an empty step"
    assert counts.max() == p.grad_accum, "grad_accum is not the most micro-batches a rank holds"


def check_bounds(p, per_step_only: bool = False) -> None:
    """Every step but the last within (T - t, T + t]; running totals within t / 2 of k * T."""
    tokens = p.tokens_per_step()
    largest = int(p.micro_batch_tokens().max())
    assert largest <= p.step_tokens
    body = tokens[:-1]
    assert np.all(body > p.step_tokens - largest) and np.all(body <= p.step_tokens + largest)
    assert 0 < tokens[-1] <= p.step_tokens + largest
    if not per_step_only:
        running = np.cumsum(body) - p.step_tokens * np.arange(1, body.size + 1)
        assert np.abs(running).max() <= largest / 2


# -- the cut rule ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "groups", "step_tokens", "cuts"),
    [
        # 8 vs 12 from 10: a tie closes before; then the running total (-2) calls for the longer cut
        ([4, 4, 4, 4, 4], None, 10, [0, 2, 5]),
        # 12 is closer than 6; then the running +2 calls for the shorter; the rest is the last step
        ([6, 6, 6, 6], None, 10, [0, 2, 3, 4]),
        # a micro-batch over step_tokens is a step alone, the one before it closes early
        ([3, 20, 3, 3], None, 10, [0, 1, 2, 4]),
        # no step crosses a group, and each group keeps its own running total
        ([4, 4, 4, 4, 4], [0, 3, 5], 10, [0, 2, 3, 5]),
        ([5], None, 10, [0, 1]),
    ],
)
def test_cut_rule_on_hand_made_sequences(tokens, groups, step_tokens, cuts):
    groups = np.array([0, len(tokens)] if groups is None else groups, dtype=np.int64)
    np.testing.assert_array_equal(token_step_cuts(np.array(tokens, dtype=np.int64), groups, step_tokens), cuts)


def test_the_running_total_does_not_drift_on_equal_micro_batches():
    """Micro-batches of 15 against steps of 128: each step alone would round to 8 x 15 = 120 (6% short);
    the running total mixes 8- and 9-micro-batch steps so the epoch's steps average 128."""
    tokens = np.full(8000, 15, dtype=np.int64)
    cuts = token_step_cuts(tokens, np.array([0, tokens.size], dtype=np.int64), 128)
    sizes = np.diff(cuts)[:-1]
    assert set(sizes.tolist()) == {8, 9}
    assert abs(sizes.sum() * 15 / sizes.size - 128) < 0.1
    assert abs(cuts.size - 1 - tokens.sum() / 128) <= 1


# -- every strategy, every world size ----------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_steps_carry_step_tokens_exactly_once_within_budget(name, world_size):
    data = lognormal(6000, seed=world_size)
    for balance in (None, RankBalance(CostModel(a=1.0, b=8e-6))):
        p = plan(data, BUDGET, name, seed=3, epoch=1, world_size=world_size, step_tokens=T, balance=balance)
        assert p.step_tokens == T and p.world_size == world_size
        assert p.exactly_once() and p.budget_violations().size == 0
        np.testing.assert_array_equal(np.sort(p.sample_indices), np.arange(data.size))
        check_grid(p)
        same_bucket = name == "bucketed" and build_strategy(name).same_bucket_steps
        check_bounds(p, per_step_only=same_bucket)
        # the same micro-batches as without step_tokens: only their grouping into steps differs
        fixed = plan(data, BUDGET, name, seed=3, epoch=1, world_size=world_size)
        as_sets = lambda q: sorted(  # noqa: E731
            tuple(sorted(q.sample_indices[q.micro_batch_offsets[m]:q.micro_batch_offsets[m + 1]].tolist()))
            for m in range(q.num_micro_batches) if q.micro_batch_offsets[m + 1] > q.micro_batch_offsets[m]
        )
        assert as_sets(p) == as_sets(fixed)


@pytest.mark.parametrize("name", ALL)
def test_same_arguments_same_plan_and_the_epoch_changes_it(name):
    data = lognormal(4000, seed=5)
    kwargs = dict(seed=2, epoch=4, world_size=3, step_tokens=50_000)
    first, again = plan(data, BUDGET, name, **kwargs), plan(data, BUDGET, name, **kwargs)
    np.testing.assert_array_equal(first.sample_indices, again.sample_indices)
    np.testing.assert_array_equal(first.micro_batch_offsets, again.micro_batch_offsets)
    assert first.grad_accum == again.grad_accum
    other = plan(data, BUDGET, name, **{**kwargs, "epoch": 5})
    assert not np.array_equal(first.sample_indices, other.sample_indices)


def test_equal_tokens_give_equal_step_counts_where_fixed_accumulation_does_not():
    from harness.data.profiles import profile_lengths

    for data, budget, step_tokens, world_size in (
        (lognormal(20_000, seed=9), BUDGET, T, 8),
        (profile_lengths("stdlib-defs"), Budget(8192), 16384, 2),
    ):
        fixed = {name: plan(data, budget, name, world_size=world_size).num_steps for name in ALL}
        assert fixed["shuffle"] > 1.3 * fixed["packed"], fixed  # the confound: padded steps carry less
        equal = {name: plan(data, budget, name, world_size=world_size, step_tokens=step_tokens).num_steps
                 for name in ALL}
        assert max(equal.values()) <= 1.02 * min(equal.values()), equal
        # one run of the cut rule over the epoch: within one step of each other (docs/design/data-flow.md)
        unshaped = [steps for name, steps in equal.items() if name != "bucketed"]
        assert max(unshaped) - min(unshaped) <= 1, equal
        assert abs(equal["shuffle"] - data.sum() / step_tokens) <= 1.5


# -- the grid: padding slots, a rank with nothing ----------------------------------------------


def test_a_rank_with_nothing_in_a_step_keeps_one_empty_slot():
    # every micro-batch is one 100-token sample and a step takes one: ranks 1..3 have nothing
    p = plan(np.full(6, 100), Budget(100), "shuffle", world_size=4, step_tokens=100)
    assert p.num_steps == 6 and p.grad_accum == 1
    np.testing.assert_array_equal(p.rank_step_counts(), [[1, 0, 0, 0]] * 6)
    for rank in range(1, 4):
        views = list(p.rank_steps(rank, skip_padding=True))
        assert [step for step, _ in views] == list(range(6))
        assert all(len(batches) == 1 and batches[0].size == 0 for _, batches in views)
    assert [batches[0].size for _, batches in p.rank_steps(0, skip_padding=True)] == [1] * 6


def test_skip_padding_yields_exactly_the_real_micro_batches():
    data = lognormal(3000, seed=11)
    p = plan(data, BUDGET, "shuffle", world_size=3, step_tokens=3 * BUDGET.max_tokens)
    assert p.grad_accum > 1 and (p.rank_step_counts() < p.grad_accum).any()
    seen = []
    for rank in range(3):
        padded = list(p.rank_steps(rank))
        skipped = list(p.rank_steps(rank, start_step=2, skip_padding=True))
        assert all(len(batches) == p.grad_accum for _, batches in padded)
        for (step, batches), count in zip(skipped, p.rank_step_counts()[2:, rank]):
            assert len(batches) == max(count, 1)
            assert all(mb.size for mb in batches) or (count == 0 and batches[0].size == 0)
        seen += [mb for _, batches in p.rank_steps(rank, skip_padding=True) for mb in batches]
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(data.size))


def test_fixed_accumulation_counts_every_slot_but_a_short_final_steps_empty_ones():
    p = plan(np.full(10, 8), Budget(8), "shuffle", world_size=4, grad_accum=2)  # 10 micro-batches, 8 a step
    assert p.step_tokens is None
    np.testing.assert_array_equal(p.rank_step_counts(), [[2, 2, 2, 2], [1, 1, 0, 0]])
    # with costless micro-batches an empty slot may precede a real one; the count still covers it
    data = np.random.default_rng(4).integers(1, 40, 200)
    for seed in range(20):
        q = plan(data, Budget(40), "shuffle", world_size=3, grad_accum=3, seed=seed,
                 balance=RankBalance(CostModel(a=0.0, b=0.0, c=1.0)))
        seen = [mb for rank in range(3) for _, batches in q.rank_steps(rank, skip_padding=True) for mb in batches]
        np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(data.size))


def test_a_micro_batch_over_step_tokens_is_a_step_alone():
    data = np.array([900] + [100] * 30)
    p = plan(data, Budget(1000), "sorted", world_size=2, step_tokens=500, seed=1)
    tokens = p.tokens_per_step()
    alone = [step for step in range(p.num_steps) if 0 in np.concatenate(
        [mb for rank in p.step_micro_batches(step) for mb in rank])]
    assert len(alone) == 1 and tokens[alone[0]] == 900
    assert p.rank_step_counts()[alone[0]].sum() == 1
    assert p.exactly_once()


def test_balance_places_inside_each_step_and_never_raises_its_max_rank_cost():
    data = lognormal(8000, seed=12)
    model = CostModel(a=1.0, b=8e-6)
    kwargs = dict(seed=1, epoch=0, world_size=4, step_tokens=6 * BUDGET.max_tokens)
    plain = plan(data, BUDGET, "shuffle", **kwargs)
    balanced = plan(data, BUDGET, "shuffle", balance=RankBalance(model), **kwargs)
    assert balanced.num_steps == plain.num_steps and balanced.exactly_once()
    check_grid(balanced)

    def max_rank_cost(p):
        costs = model.micro_batch_costs(p.lengths, p.sample_indices, p.micro_batch_offsets, p.layout,
                                        p.budget.max_tokens).reshape(p.num_steps, -1)
        return rank_costs(costs, p.world_size, p.grad_accum).max(axis=1)

    before, after = max_rank_cost(plain), max_rank_cost(balanced)
    assert np.all(after <= before * (1 + 1e-12)) and after.sum() < 0.97 * before.sum()
    for step in range(plain.num_steps):  # the same samples in every step
        members = [np.sort(np.concatenate([mb for r in q.step_micro_batches(step) for mb in r]))
                   for q in (plain, balanced)]
        np.testing.assert_array_equal(*members)


def test_balance_keeps_real_micro_batches_first_when_some_cost_nothing():
    """Under a drafter-only cost model, samples shorter than a block cost 0 and tie with empty slots
    in the placement; the grid still lists every rank's real micro-batches first."""
    data = np.random.default_rng(1).integers(1, 40, 60)
    p = plan(data, Budget(40), "shuffle", world_size=3, step_tokens=100, seed=1,
             balance=RankBalance(CostModel(a=0.0, b=0.0, c=1.0)))
    check_grid(p)
    assert p.exactly_once()


def test_bucketed_same_bucket_steps_keeps_equal_token_steps_in_one_bucket():
    data = lognormal(30_000, seed=6)
    p = plan(data, BUDGET, "bucketed", world_size=4, num_buckets=6, step_tokens=T, seed=1, epoch=1)
    edges = np.asarray(p.info["edges"])
    mixed = sum(
        np.unique(np.searchsorted(edges, data[np.concatenate([mb for r in p.step_micro_batches(s) for mb in r])],
                                  side="left")).size > 1
        for s in range(p.num_steps)
    )
    # each bucket's last step (and what small buckets hold) is pooled into a few mixed steps
    assert mixed <= 6 and p.num_steps > 10 * 6
    free = plan(data, BUDGET, "bucketed", world_size=4, num_buckets=6, step_tokens=T, seed=1, epoch=1,
                same_bucket_steps=False)
    assert abs(free.num_steps - p.num_steps) <= 0.02 * p.num_steps


# -- resume on another world size --------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_resume_two_ranks_to_one_mid_epoch_covers_exactly_the_rest(name):
    data = lognormal(5000, seed=13)
    full = plan(data, BUDGET, name, seed=7, epoch=2, world_size=2, step_tokens=T)
    stopped_at = full.num_steps // 2
    consumed = full.sample_indices[: full.micro_batch_offsets[stopped_at * full.micro_batches_per_step]]
    rest = plan_remainder(name, data, consumed, BUDGET, seed=7, epoch=2, world_size=1, step_tokens=T)
    assert rest.step_tokens == T and rest.world_size == 1 and rest.exactly_once()
    visits = np.bincount(np.concatenate([consumed, rest.sample_indices]), minlength=data.size)
    assert (visits == 1).all()
    assert rest.budget_violations().size == 0
    check_grid(rest)
    check_bounds(rest, per_step_only=name == "bucketed")
    again = plan_remainder(name, data, consumed, BUDGET, seed=7, epoch=2, world_size=1, step_tokens=T)
    np.testing.assert_array_equal(rest.sample_indices, again.sample_indices)
    np.testing.assert_array_equal(rest.micro_batch_offsets, again.micro_batch_offsets)
    # nothing consumed: the whole epoch's plan
    whole = plan_remainder(name, data, [], BUDGET, seed=7, epoch=2, world_size=2, step_tokens=T)
    np.testing.assert_array_equal(whole.sample_indices, full.sample_indices)
    np.testing.assert_array_equal(whole.micro_batch_offsets, full.micro_batch_offsets)
    assert whole.grad_accum == full.grad_accum
    done = plan_remainder(name, data, np.ones(data.size, dtype=bool), BUDGET, world_size=2, step_tokens=T)
    assert done.num_steps == 0 and done.rank_step_counts().shape == (0, 2) and done.tokens_per_step().size == 0


# -- refused arguments -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"step_tokens": 0}, "step_tokens=0 must be a positive integer"),
        ({"step_tokens": 1.5}, "step_tokens=1.5 must be a positive integer"),
        ({"step_tokens": True}, "step_tokens=True must be a positive integer"),
        ({"step_tokens": 4096, "grad_accum": 2}, "grad_accum must be 1, got grad_accum=2"),
        ({"step_tokens": 4096, "balance": {"window_steps": 2}}, "window_steps=2 regroups micro-batches"),
    ],
)
def test_bad_step_token_settings_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        plan([10, 20, 30], Budget(64), "shuffle", **extra)
    with pytest.raises(ValueError, match=message):
        plan_remainder("shuffle", [10, 20, 30], [0], Budget(64), **extra)
