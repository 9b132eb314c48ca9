"""BucketedStrategy.token_steps without same_bucket_steps passes seed and epoch on to the next token_steps in the MRO."""

from __future__ import annotations

from strategies.base import Strategy
from strategies.builtin import BucketedStrategy


class _Recording(Strategy):
    def token_steps(self, micro, prepared, step_tokens, seed, epoch):
        return (micro, prepared, step_tokens, seed, epoch)


class _RecordingBucketed(BucketedStrategy, _Recording):
    pass


def test_seed_and_epoch_reach_the_next_token_steps():
    strategy = _RecordingBucketed(same_bucket_steps=False)
    assert strategy.token_steps("micro", "prepared", 64, 7, 3) == ("micro", "prepared", 64, 7, 3)
    assert strategy.token_steps("m", "p", 1, 0, 12) == ("m", "p", 1, 0, 12)
