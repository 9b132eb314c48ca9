"""When the loop evaluates, checkpoints and stops (harness/train/loop/cadence.py)."""

from __future__ import annotations

from types import SimpleNamespace

from harness.train.loop.cadence import Cadence
from harness.train.loop.train_state import TrainState


def test_evaluation_falls_due_every_eval_every_tokens_and_at_the_end():
    cadence = Cadence(eval_every_tokens=100, checkpoint_every_steps=3, total_tokens=450)
    state = TrainState()
    cadence.start(state)
    due = []
    for step, tokens in enumerate([60, 130, 250, 260, 390, 455], start=1):
        state.global_step, state.tokens_seen = step, tokens
        if cadence.evaluate_now(state):
            due.append(tokens)
            cadence.evaluated(state)
    # 130 passes 100; 250 passes 200 (the next is 300, not 200 again); 390 passes 300; 455 is the end
    assert due == [130, 250, 390, 455]
    assert state.next_eval_tokens == 500


def test_the_stop_is_the_step_count_when_there_is_one_else_the_tokens():
    by_tokens = Cadence(eval_every_tokens=10, checkpoint_every_steps=1, total_tokens=1000)
    by_steps = Cadence(eval_every_tokens=10, checkpoint_every_steps=1, total_tokens=1000, total_steps=5)
    assert not by_tokens.done(SimpleNamespace(global_step=50, tokens_seen=999))
    assert by_tokens.done(SimpleNamespace(global_step=1, tokens_seen=1000))
    assert not by_steps.done(SimpleNamespace(global_step=4, tokens_seen=5000))
    assert by_steps.done(SimpleNamespace(global_step=5, tokens_seen=10))


def test_checkpoints_fall_on_every_nth_step_and_the_cadence_reads_its_config_sections():
    data = SimpleNamespace(total_tokens=4096, total_steps=None)
    cadence = Cadence.of(SimpleNamespace(every_tokens=64), SimpleNamespace(every_steps=4), data)
    assert cadence == Cadence(64, 4, 4096, None)
    assert [s for s in range(1, 13) if cadence.checkpoint_now(SimpleNamespace(global_step=s))] == [4, 8, 12]
