"""Property tests (hypothesis): exactly-once, budget adherence, determinism, resume and balance."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strategies import Budget, CostModel, RankBalance, available_strategies, plan
from strategies.balance import rank_costs

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def planning_cases(draw):
    """A strategy with options, lengths that fit the budget, and a distributed shape."""
    name = draw(st.sampled_from(available_strategies()))
    lengths = draw(st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=150))
    max_tokens = draw(st.integers(min_value=max(lengths), max_value=2000))
    max_samples = draw(st.one_of(st.none(), st.integers(min_value=1, max_value=10)))
    options = {}
    if name == "bucketed":
        options = {
            "num_buckets": draw(st.integers(min_value=1, max_value=8)),
            "edges": draw(st.sampled_from(["dp", "quantile", "equal_tokens", (16, 64, 128)])),
            "same_bucket_steps": draw(st.booleans()),
            "max_recurrence": draw(st.sampled_from([None, 0.05, 0.1, 0.5, 1.0])),
        }
    elif name == "packed":
        options = {"fit": draw(st.sampled_from(["first", "best"]))}
    elif name == "length_grouped":
        options = {
            "mega_batch_mult": draw(st.integers(min_value=1, max_value=4)),
            "batch_size": draw(st.one_of(st.none(), st.integers(min_value=1, max_value=6))),
            "shuffle_order": draw(st.booleans()),
        }
    balance = draw(st.one_of(st.none(), st.builds(lambda w: RankBalance(window_steps=w), st.integers(1, 3))))
    return {
        "lengths": np.asarray(lengths, dtype=np.int64),
        "budget": Budget(max_tokens, max_samples=max_samples),
        "strategy": name,
        "seed": draw(st.integers(min_value=0, max_value=2**32)),
        "epoch": draw(st.integers(min_value=0, max_value=50)),
        "world_size": draw(st.integers(min_value=1, max_value=4)),
        "grad_accum": draw(st.integers(min_value=1, max_value=3)),
        "balance": balance,
        **options,
    }


@SETTINGS
@given(case=planning_cases())
def test_exactly_once_within_budget_and_empty_slots_only_at_the_end(case):
    p = plan(**case)
    assert p.exactly_once()
    assert sorted(p.sample_indices.tolist()) == list(range(len(case["lengths"])))
    assert p.budget_violations().size == 0
    if p.layout == "padded":
        assert np.all(p.micro_batch_slots() <= case["budget"].max_tokens)
    else:
        assert np.all(p.micro_batch_tokens() <= case["budget"].max_tokens)
    if case["budget"].max_samples is not None:
        assert p.micro_batch_sizes().max() <= case["budget"].max_samples
    per_step = case["world_size"] * case["grad_accum"]
    assert p.num_micro_batches == p.num_steps * per_step
    sizes = p.micro_batch_sizes().reshape(p.num_steps, per_step)
    assert np.all(sizes[:-1] > 0)  # only the final step may hold empty micro-batches
    assert sizes[-1].max() > 0


@SETTINGS
@given(case=planning_cases())
def test_same_seed_and_epoch_give_the_same_plan_and_resume_matches(case):
    first, second = plan(**case), plan(**case)
    np.testing.assert_array_equal(first.sample_indices, second.sample_indices)
    np.testing.assert_array_equal(first.micro_batch_offsets, second.micro_batch_offsets)
    start = first.num_steps // 2
    for rank in range(case["world_size"]):
        tail = list(first.rank_steps(rank))[start:]
        resumed = list(second.rank_steps(rank, start_step=start))
        assert len(tail) == len(resumed)
        for (step_a, batches_a), (step_b, batches_b) in zip(tail, resumed):
            assert step_a == step_b
            assert all(np.array_equal(a, b) for a, b in zip(batches_a, batches_b))


@SETTINGS
@given(case=planning_cases(), a=st.floats(0.0, 2.0), b=st.floats(1e-7, 1e-3))
def test_in_step_balance_never_raises_any_steps_max_rank_cost(case, a, b):
    model = CostModel(a=a, b=b)
    case = {**case, "balance": None}
    plain = plan(**case)
    balanced = plan(**{**case, "balance": RankBalance(cost_model=model)})

    def max_rank_cost(p):
        costs = model.micro_batch_costs(p.lengths, p.sample_indices, p.micro_batch_offsets, p.layout,
                                        p.budget.max_tokens).reshape(p.num_steps, -1)
        return rank_costs(costs, p.world_size, p.grad_accum).max(axis=1)

    before, after = max_rank_cost(plain), max_rank_cost(balanced)
    assert np.all(after <= before + 1e-9 * np.maximum(before, 1.0))
    assert balanced.exactly_once()


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(available_strategies()),
    lengths=st.lists(st.integers(min_value=1, max_value=500), min_size=1, max_size=80),
    max_tokens=st.integers(min_value=20, max_value=400),
    policy=st.sampled_from(["truncate", "drop"]),
    world_size=st.integers(min_value=1, max_value=4),
    grad_accum=st.integers(min_value=1, max_value=3),
    balanced=st.booleans(),
)
def test_oversize_policies_are_exact_and_recorded(name, lengths, max_tokens, policy, world_size, grad_accum, balanced):
    lengths = np.asarray(lengths)
    too_long = np.flatnonzero(lengths > max_tokens)
    if policy == "drop" and too_long.size == lengths.size:
        return  # dropping everything is an error (tested in test_validate)
    p = plan(lengths, Budget(max_tokens), name, oversize=policy, world_size=world_size, grad_accum=grad_accum,
             balance=RankBalance(window_steps=2) if balanced else None)
    assert p.exactly_once() and p.budget_violations().size == 0
    kept = np.setdiff1d(np.arange(lengths.size), too_long) if policy == "drop" else np.arange(lengths.size)
    np.testing.assert_array_equal(np.sort(p.sample_indices), kept)  # independent of Plan.exactly_once
    sizes = p.micro_batch_sizes().reshape(p.num_steps, world_size * grad_accum)
    assert np.all(sizes[:-1] > 0) and sizes[-1].max() > 0  # empty slots only in the final step
    if policy == "truncate":
        np.testing.assert_array_equal(p.truncated, too_long)
        np.testing.assert_array_equal(p.lengths, np.minimum(lengths, max_tokens))
        assert p.dropped.size == 0
    else:
        np.testing.assert_array_equal(p.dropped, too_long)
        assert not np.isin(p.sample_indices, too_long).any()
        assert p.sample_indices.size == lengths.size - too_long.size


@SETTINGS
@given(case=planning_cases(), step_tokens=st.integers(min_value=1, max_value=5000))
def test_equal_token_steps_keep_every_invariant_and_the_cut_rules_bounds(case, step_tokens):
    balance = case["balance"] and RankBalance(cost_model=case["balance"].cost_model)  # in-step placement only
    case = {**case, "grad_accum": 1, "balance": balance, "step_tokens": step_tokens}
    p = plan(**case)
    again = plan(**case)
    np.testing.assert_array_equal(p.sample_indices, again.sample_indices)
    np.testing.assert_array_equal(p.micro_batch_offsets, again.micro_batch_offsets)
    assert p.exactly_once() and p.budget_violations().size == 0 and p.step_tokens == step_tokens
    # the grid: each rank's real micro-batches first, padding after; grad_accum the most a rank holds
    counts = p.rank_step_counts()
    filled = p.micro_batch_sizes().reshape(p.num_steps, p.world_size, p.grad_accum) > 0
    np.testing.assert_array_equal(filled, np.arange(p.grad_accum)[None, None, :] < counts[:, :, None])
    assert counts.max() == p.grad_accum and counts.sum(axis=1).min() >= 1
    tokens = p.tokens_per_step()
    largest = int(p.micro_batch_tokens().max())
    if largest <= step_tokens:
        body = tokens[:-1]
        assert np.all(body > step_tokens - largest) and np.all(body <= step_tokens + largest)
        assert 0 < tokens[-1] <= step_tokens + largest
        if not (case["strategy"] == "bucketed" and case.get("same_bucket_steps", True)):
            running = np.cumsum(body) - step_tokens * np.arange(1, body.size + 1)
            assert body.size == 0 or np.abs(running).max() <= largest / 2
    else:  # a micro-batch over step_tokens is a step alone
        over = (p.micro_batch_tokens() > step_tokens).reshape(p.num_steps, -1).any(axis=1)
        assert np.all(counts[over].sum(axis=1) == 1)
