"""The counters of a run that a checkpoint restores: where in the plan it is, what it has seen, its last evaluation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.train.loop.step_record import StepRecord


@dataclass
class TrainState:
    state_version = 1  # a class attribute, not a field: the layout of what state_dict() returns

    epoch: int = 0
    step_in_epoch: int = 0  # the next step of the epoch's plan to run
    global_step: int = 0  # optimizer steps done
    tokens_seen: int = 0
    samples_seen: int = 0
    computed_slots: int = 0
    next_eval_tokens: int = 0
    train_time_s: float = 0.0
    epochs_exactly_once: list[bool] = field(default_factory=list)
    last_eval: dict[str, Any] = field(default_factory=dict)

    def advance(self, step_in_epoch: int, record: StepRecord) -> None:
        """Step ``step_in_epoch`` of the epoch's plan is done; ``record`` is its step record."""
        self.global_step += 1
        self.step_in_epoch = step_in_epoch + 1
        self.tokens_seen += record.real_tokens
        self.samples_seen += record.samples
        self.computed_slots += record.computed_slots

    def end_epoch(self, exactly_once: bool) -> None:
        self.epochs_exactly_once.append(exactly_once)
        self.epoch += 1
        self.step_in_epoch = 0

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
