"""Command-line option texts: ``--max-recurrence`` and ``--edges`` parsing, and how a CliOption turns text into a value."""

from __future__ import annotations

import pytest

from strategies import CliOption
from strategies.base import NO_CONST
from strategies.builtin import parse_max_recurrence
from strategies.edges import parse_edges


@pytest.mark.parametrize("text", ["none", "null", "off", "None", "NULL", " Off ", "  none\n"])
def test_max_recurrence_words_for_no_bound_give_none_in_any_case(text):
    assert parse_max_recurrence(text) is None


@pytest.mark.parametrize(("text", "value"), [("0.5", 0.5), ("1", 1.0), ("1.0", 1.0), (" 0.25 ", 0.25), ("1e-3", 0.001)])
def test_max_recurrence_accepts_a_number_in_the_half_open_unit_interval(text, value):
    parsed = parse_max_recurrence(text)
    assert parsed == value and type(parsed) is float


@pytest.mark.parametrize("text", ["0", "0.0", "-0.5", "1.0000001", "1.5", "2", "inf"])
def test_max_recurrence_refuses_a_number_outside_zero_exclusive_one_inclusive(text):
    with pytest.raises(ValueError, match=rf"^{text!r} must be in \(0, 1\] \(or 'none' for no bound\)$"):
        parse_max_recurrence(text)


@pytest.mark.parametrize("text", ["often", "", "0.1.2", "nothing"])
def test_max_recurrence_refuses_text_that_is_neither_a_number_nor_none(text):
    with pytest.raises(ValueError, match=rf"^{text!r} is neither a number in \(0, 1\] nor 'none'$"):
        parse_max_recurrence(text)


@pytest.mark.parametrize("method", ["dp", "quantile", "equal_tokens", "dp_upper"])
def test_edges_text_naming_a_method_gives_the_method(method):
    assert parse_edges(method) == method
    assert parse_edges(f"  {method}\n") == method


@pytest.mark.parametrize(
    ("text", "values"),
    [("64,128,512", [64, 128, 512]), (" 64 , 128 ", [64, 128]), ("256", [256]), ("64,,128,", [64, 128])],
)
def test_edges_text_with_a_comma_list_gives_its_integers(text, values):
    parsed = parse_edges(text)
    assert parsed == values and all(type(value) is int for value in parsed)


@pytest.mark.parametrize(("text", "shown"), [("fast", "'fast'"), (" 64 128 ", "'64 128'"), ("64,x", "'64,x'")])
def test_edges_text_that_is_neither_a_method_nor_integers_is_refused_with_the_methods(text, shown):
    with pytest.raises(
        ValueError,
        match=rf"^{shown} is neither one of dp, quantile, equal_tokens, dp_upper nor a comma list of integer lengths$",
    ):
        parse_edges(text)


@pytest.mark.parametrize(("text", "shown"), [(",", "','"), (" , , ", "', ,'"), ("", "''")])
def test_edges_text_listing_no_length_is_refused(text, shown):
    with pytest.raises(ValueError, match=rf"^{shown} lists no lengths$"):
        parse_edges(text)


def test_a_cli_option_with_parse_converts_the_given_text():
    option = CliOption("--max-recurrence", "max_recurrence", "bound", parse=parse_max_recurrence)
    assert option.value("0.25") == 0.25
    assert option.value("none") is None
    assert CliOption("--width", "width", "", parse=int).value("7") == 7


def test_a_cli_option_without_parse_passes_the_value_through():
    assert CliOption("--width", "width", "", type=int).value(7) == 7
    assert CliOption("--fast", "fast", "", const=True).value(True) is True


def test_no_const_shows_as_its_name():
    assert repr(NO_CONST) == "NO_CONST"
    assert "const=NO_CONST" in repr(CliOption("--width", "width", ""))


def test_a_switch_refuses_either_converter_alone():
    with pytest.raises(ValueError, match=r"^CliOption --fast: a switch \(const\) takes no value to convert$"):
        CliOption("--fast", "fast", "", type=int, const=True)
    with pytest.raises(ValueError, match=r"^CliOption --fast: a switch \(const\) takes no value to convert$"):
        CliOption("--fast", "fast", "", parse=int, const=True)
    assert CliOption("--fast", "fast", "", const=True).is_switch
