"""same_bucket_token_steps: pure steps per bucket, the max_recurrence filter at its boundary, cuts inside buckets; token_steps passes max_recurrence on."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import strategies.builtin as builtin
from strategies import MicroBatches
from strategies.builtin import BucketedStrategy, same_bucket_token_steps

# bucket 0: six micro-batches (3 steps of 2), bucket 1: two (1 step); 10 tokens each, 20 per step
BUCKETS = np.array([0, 0, 0, 0, 0, 0, 1, 1])
TOKENS = np.full(8, 10)


def steps(micro_bucket, tokens, step_tokens, seed, max_recurrence):
    sequence, offsets = same_bucket_token_steps(
        np.asarray(micro_bucket), np.asarray(tokens), step_tokens, np.random.default_rng(seed), max_recurrence
    )
    assert offsets.dtype == np.int64
    return [sequence[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]


def test_without_bound_every_bucket_but_its_last_step_is_pure():
    # pure: bucket 0's first two steps; pool: ids 4..7 shuffled into two mixed steps
    assert steps(BUCKETS, TOKENS, 20, 0, None) == [[6, 4], [2, 3], [0, 1], [5, 7]]


def test_bound_met_exactly_keeps_pure_steps():
    assert steps(BUCKETS, TOKENS, 20, 0, 0.5) == [[6, 4], [2, 3], [0, 1], [5, 7]]
    # 2 whole steps x bound == 1 - 1e-9 exactly: still kept
    bound = (1.0 - 1e-9) / 2
    assert 2 * bound == 1.0 - 1e-9
    assert steps(BUCKETS, TOKENS, 20, 0, bound) == [[6, 4], [2, 3], [0, 1], [5, 7]]


def test_bound_not_met_sends_everything_to_the_pool():
    result = steps(BUCKETS, TOKENS, 20, 0, 0.4)
    assert result == [[3, 6], [5, 0], [2, 4], [1, 7]]
    assert [0, 1] not in result and [2, 3] not in result


def test_steps_are_cut_inside_each_bucket():
    # bucket 0 cuts [0, 1] | [2]; bucket 1 cuts [3, 4] | [5]; the two last steps pool into one
    assert steps([0, 0, 0, 1, 1, 1], np.full(6, 10), 20, 0, None) == [[0, 1], [3, 4], [2, 5]]


def test_token_steps_passes_its_max_recurrence(monkeypatch):
    seen = []

    def recorder(micro_bucket, tokens, step_tokens, rng, max_recurrence=None):
        seen.append((micro_bucket.tolist(), tokens.tolist(), step_tokens, max_recurrence))
        return np.arange(micro_bucket.size, dtype=np.int64), np.array([0, micro_bucket.size], dtype=np.int64)

    monkeypatch.setattr(builtin, "same_bucket_token_steps", recorder)
    micro = MicroBatches(
        np.array([0, 1, 2], dtype=np.int64), np.array([0, 2, 3], dtype=np.int64), np.array([0, 1], dtype=np.int64),
        {"edges": [4, 9]},
    )
    prepared = SimpleNamespace(lengths=np.array([3, 4, 9], dtype=np.int64))
    for bound in (0.25, None):
        result = BucketedStrategy(max_recurrence=bound).token_steps(micro, prepared, 12, 1, 2)
        assert seen[-1] == ([0, 1], [7, 9], 12, bound)
        assert result.step_offsets.tolist() == [0, 2]
