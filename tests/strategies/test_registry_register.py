"""register_strategy's refusals: not a Strategy subclass, an empty name, a cli_options entry naming no field."""

from __future__ import annotations

import re

import pytest

from strategies import CliOption, available_strategies, register_strategy, strategy_class
from strategies.builtin import ShuffleStrategy

SUBCLASS = re.escape("must be a Strategy subclass with a non-empty `name`")


def test_a_strategy_subclass_without_a_name_is_refused():
    class Nameless(ShuffleStrategy):
        name = ""

    with pytest.raises(ValueError, match=rf"^{re.escape(repr(Nameless))} {SUBCLASS}$"):
        register_strategy(Nameless)
    assert "" not in available_strategies()


def test_a_named_class_that_is_not_a_strategy_is_refused():
    class Impostor:
        name = "impostor-strategy"

    with pytest.raises(ValueError, match=rf"^{re.escape(repr(Impostor))} {SUBCLASS}$"):
        register_strategy(Impostor)
    assert "impostor-strategy" not in available_strategies()


def test_an_option_naming_no_field_of_a_strategy_without_fields_says_none():
    class NoFields(ShuffleStrategy):
        name = "scratch-no-fields"
        cli_options = (CliOption("--fit", "fit", help="how samples fill a row"),)

    with pytest.raises(ValueError, match=r"^strategy 'scratch-no-fields': cli_options entry .* must be a CliOption "
                                         r"naming one of its fields \(none\)$"):
        register_strategy(NoFields)
    assert "scratch-no-fields" not in available_strategies()


def test_an_option_naming_no_field_lists_the_strategys_fields():
    packed = strategy_class("packed")

    class Misnamed(packed):
        name = "scratch-misnamed"
        cli_options = (CliOption("--nothing", "nothing", help="no such field"),)

    with pytest.raises(ValueError, match=r"naming one of its fields \(fit\)$"):
        register_strategy(Misnamed)
    bucketed = strategy_class("bucketed")

    class Misnamed2(bucketed):
        name = "scratch-misnamed-2"
        cli_options = ("--num-buckets",)

    with pytest.raises(ValueError, match=r"naming one of its fields \(num_buckets, edges, same_bucket_steps, "
                                         r"max_recurrence\)$"):
        register_strategy(Misnamed2)
    assert not {"scratch-misnamed", "scratch-misnamed-2"} & set(available_strategies())
