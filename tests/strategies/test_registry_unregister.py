"""unregister_strategy: hands back the class it removes, and refuses a name that is not registered."""

from __future__ import annotations

import pytest

from strategies import available_strategies, register_strategy, unregister_strategy
from strategies.builtin import ShuffleStrategy


def test_unregister_returns_the_removed_class_which_can_be_registered_again():
    class Scratch(ShuffleStrategy):
        name = "scratch-unregister"

    register_strategy(Scratch)
    try:
        assert unregister_strategy("scratch-unregister") is Scratch
        assert "scratch-unregister" not in available_strategies()
        assert register_strategy(Scratch) is Scratch
        assert unregister_strategy("scratch-unregister") is Scratch
    finally:
        if "scratch-unregister" in available_strategies():
            unregister_strategy("scratch-unregister")
    assert "scratch-unregister" not in available_strategies()


@pytest.mark.parametrize("name", ["no-such-strategy", 3, None])
def test_unregister_refuses_an_unknown_name_with_the_known_ones(name):
    before = available_strategies()
    with pytest.raises(ValueError, match=rf"^unknown strategy {name!r}; known strategies: .*shuffle"):
        unregister_strategy(name)
    assert available_strategies() == before
