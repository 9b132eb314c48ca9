"""When the loop evaluates, checkpoints and stops: the loop asks, :class:`Cadence` decides from the run's counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Cadence:
    """Evaluate every ``eval_every_tokens`` real tokens and at the end; checkpoint every ``checkpoint_every_steps``
    optimizer steps; stop after ``total_steps`` steps (equal-token steps: the same count for every strategy) or,
    without a step count, once ``total_tokens`` real tokens are seen."""

    eval_every_tokens: int
    checkpoint_every_steps: int
    total_tokens: int
    total_steps: int | None = None

    @classmethod
    def of(cls, eval_config: Any, checkpoint_config: Any, data: Any) -> Cadence:
        """The cadence of a run's ``eval`` and ``checkpoint`` config sections over its epoch ``data`` (its stop
        condition)."""
        return cls(eval_config.every_tokens, checkpoint_config.every_steps, data.total_tokens, data.total_steps)

    def done(self, state: Any) -> bool:
        if self.total_steps is not None:
            return state.global_step >= self.total_steps
        return state.tokens_seen >= self.total_tokens

    def start(self, state: Any) -> None:
        """A fresh run's first evaluation comes after ``eval_every_tokens``."""
        state.next_eval_tokens = self.eval_every_tokens

    def evaluate_now(self, state: Any) -> bool:
        return state.tokens_seen >= state.next_eval_tokens or self.done(state)

    def evaluated(self, state: Any) -> None:
        """The next evaluation: the first multiple of ``eval_every_tokens`` past the tokens seen."""
        while state.next_eval_tokens <= state.tokens_seen:
            state.next_eval_tokens += self.eval_every_tokens

    def checkpoint_now(self, state: Any) -> bool:
        return state.global_step % self.checkpoint_every_steps == 0
