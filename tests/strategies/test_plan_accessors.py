"""Plan accessors: micro-batch and rank-step bounds with their messages, per-rank slot counts, kept and remaining indices."""

from __future__ import annotations

import numpy as np
import pytest

from strategies import Budget, Plan


def small_plan(sizes, step_tokens=None, grad_accum=2, dropped=(), consumed=()) -> Plan:
    """Five samples on world_size=2 with the given micro-batch sizes (samples 0, 1, ... in order)."""
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return Plan(
        strategy="sorted",
        layout="padded",
        lengths=np.array([5, 6, 7, 8, 9], dtype=np.int64),
        sample_indices=np.arange(offsets[-1], dtype=np.int64),
        micro_batch_offsets=offsets,
        budget=Budget(100),
        seed=0,
        epoch=0,
        world_size=2,
        grad_accum=grad_accum,
        dropped=np.asarray(dropped, dtype=np.int64),
        consumed=np.asarray(consumed, dtype=np.int64),
        step_tokens=step_tokens,
    )


# two steps of 2 ranks x 2 accumulation slots; the last step holds one sample, on rank 0
FIXED = [1, 1, 1, 1, 1, 0, 0, 0]
# equal-token steps: rank 0 of step 0 has one real micro-batch, rank 1 of step 1 none
TOKEN_STEPS = [1, 0, 1, 1, 1, 0, 0, 0]


def test_micro_batch_index_is_step_major_then_rank_then_accum():
    p = small_plan(FIXED)
    assert p.num_steps == 2
    assert [p.micro_batch_index(s, r, a) for s in range(2) for r in range(2) for a in range(2)] == list(range(8))
    assert p.micro_batch_index(1, 1, 1) == 7


@pytest.mark.parametrize(
    ("step", "rank", "accum"), [(2, 0, 0), (0, 2, 0), (0, 0, 2), (-1, 0, 0), (0, -1, 0), (0, 0, -1), (2, 2, 2)]
)
def test_micro_batch_index_refuses_any_coordinate_outside_the_plan(step, rank, accum):
    p = small_plan(FIXED)
    with pytest.raises(
        IndexError,
        match=rf"^\(step={step}, rank={rank}, accum={accum}\) outside plan of 2 steps, world_size=2, grad_accum=2$",
    ):
        p.micro_batch_index(step, rank, accum)
    with pytest.raises(IndexError):
        p.micro_batch(step, rank, accum)


@pytest.mark.parametrize("rank", [2, 3, -1])
def test_rank_steps_refuses_a_rank_outside_the_world_size(rank):
    p = small_plan(FIXED)
    with pytest.raises(IndexError, match=rf"^rank={rank} outside world_size=2$"):
        next(p.rank_steps(rank))


@pytest.mark.parametrize("start_step", [3, -1])
def test_rank_steps_refuses_a_start_step_outside_the_plan(start_step):
    p = small_plan(FIXED)
    with pytest.raises(IndexError, match=rf"^start_step={start_step} outside plan of 2 steps$"):
        next(p.rank_steps(0, start_step=start_step))


def test_rank_steps_from_the_last_rank_and_from_the_end():
    p = small_plan(FIXED)
    steps = list(p.rank_steps(1))
    assert [step for step, _ in steps] == [0, 1]
    assert [[mb.tolist() for mb in micro] for _, micro in steps] == [[[2], [3]], [[], []]]
    assert list(p.rank_steps(1, start_step=2)) == []


def test_rank_step_counts_count_each_ranks_slots_up_to_its_last_real_one_as_int64():
    counts = small_plan(FIXED).rank_step_counts()
    assert counts.dtype == np.int64
    np.testing.assert_array_equal(counts, [[2, 2], [1, 0]])
    np.testing.assert_array_equal(small_plan(TOKEN_STEPS, step_tokens=10).rank_step_counts(), [[1, 2], [1, 0]])


def test_rank_step_slots_of_fixed_accumulation_are_grad_accum_everywhere_even_in_a_short_last_step():
    slots = small_plan(FIXED).rank_step_slots()
    assert slots.dtype == np.int64
    np.testing.assert_array_equal(slots, [[2, 2], [2, 2]])


def test_rank_step_slots_are_int64_whatever_integer_type_grad_accum_has():
    slots = small_plan(FIXED, grad_accum=np.int32(2)).rank_step_slots()
    assert slots.dtype == np.int64
    np.testing.assert_array_equal(slots, [[2, 2], [2, 2]])


def test_rank_step_slots_of_equal_token_steps_are_the_real_ones_or_one_empty_slot():
    p = small_plan(TOKEN_STEPS, step_tokens=10)
    slots = p.rank_step_slots()
    assert slots.dtype == np.int64 and slots.shape == (2, 2)
    np.testing.assert_array_equal(slots, [[1, 2], [1, 1]])
    assert [len(micro) for _, micro in p.rank_steps(0, skip_padding=True)] == [1, 1]
    assert [len(micro) for _, micro in p.rank_steps(1, skip_padding=True)] == [2, 1]


def test_kept_indices_leave_out_the_dropped_samples_as_int64():
    p = small_plan([1, 1, 1, 0], grad_accum=1, dropped=[1, 3])
    kept = p.kept_indices()
    assert kept.dtype == np.int64
    np.testing.assert_array_equal(kept, [0, 2, 4])
    full = small_plan(FIXED).kept_indices()
    assert full.dtype == np.int64
    np.testing.assert_array_equal(full, [0, 1, 2, 3, 4])


def test_remaining_indices_leave_out_the_dropped_and_the_consumed_samples_as_int64():
    p = small_plan([1, 1, 1, 0], grad_accum=1, dropped=[3], consumed=[0])
    remaining = p.remaining_indices()
    assert remaining.dtype == np.int64
    np.testing.assert_array_equal(remaining, [1, 2, 4])
    np.testing.assert_array_equal(p.kept_indices(), [0, 1, 2, 4])
    only_consumed = small_plan([1, 1, 1, 0], grad_accum=1, consumed=[0, 4]).remaining_indices()
    assert only_consumed.dtype == np.int64
    np.testing.assert_array_equal(only_consumed, [1, 2, 3])
