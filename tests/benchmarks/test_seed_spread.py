"""The design pilot's arithmetic (benchmarks/seed_spread.py): arms parsed, spreads and seed counts by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from seed_spread import parse_arms, spread_rows  # noqa: E402


def test_arms_are_named_override_lists_and_a_bad_one_is_refused():
    assert parse_arms("now:;long:trainer.stop_epochs=18, optim.lr=0.02") == {
        "now": [], "long": ["trainer.stop_epochs=18", "optim.lr=0.02"]}
    with pytest.raises(SystemExit, match="needs a new name"):
        parse_arms("now:;now:optim.lr=1")
    with pytest.raises(SystemExit, match="at least one arm"):
        parse_arms(" ; ")


def test_the_paired_spread_and_the_seeds_it_needs_by_hand():
    loss = {("a", "packed", 0): 1.0, ("a", "packed", 1): 1.2, ("a", "packed", 2): 1.1,
            ("a", "sorted", 0): 1.5, ("a", "sorted", 1): 1.5, ("a", "sorted", 2): 1.8}
    packed_row, sorted_row = spread_rows(loss, ["a"], ["packed", "sorted"], [0, 1, 2], "packed")
    assert packed_row == "| a | packed | 1.100 ± 0.100 | — | — | — |"
    # differences 0.5, 0.3, 0.7: mean 0.5, sd 0.2; (1.96 + 0.84)² · 0.2² / 0.5² = 1.25 -> 1
    assert sorted_row == "| a | sorted | 1.600 ± 0.173 | +0.500 | 0.200 | 1 |"
