"""Registry look-ups: report order (ranked first by rank, then unranked in registration order), unknown names and options refused with what is accepted."""

from __future__ import annotations

import contextlib
from typing import Optional

import pytest

from strategies import available_strategies, build_strategy, register_strategy, report_order, unregister_strategy
from strategies.builtin import BucketedStrategy, ShuffleStrategy, SortedStrategy
from strategies.registry import resolve_strategy, strategy_class, strategy_options

BUILTIN_ORDER = ["sorted", "length_grouped", "bucketed", "packed", "shuffle"]


@contextlib.contextmanager
def registered(*specs: tuple[str, Optional[int]]):
    """Throwaway shuffle-like strategies ``(name, report_rank)``, registered in order for the block."""
    classes = [type(f"Scratch{i}", (ShuffleStrategy,), {"name": name, "report_rank": rank})
               for i, (name, rank) in enumerate(specs)]
    try:
        for cls in classes:
            register_strategy(cls)
        yield classes
    finally:
        for cls in classes:
            if cls.name in available_strategies():
                unregister_strategy(cls.name)


def test_the_builtins_are_reported_by_their_rank():
    assert report_order() == BUILTIN_ORDER


def test_unranked_strategies_come_last_in_registration_order():
    with registered(("zz-unranked", None), ("aa-unranked", None)):
        assert report_order() == BUILTIN_ORDER + ["zz-unranked", "aa-unranked"]


def test_a_ranked_strategy_takes_its_place_by_rank_whenever_it_was_registered():
    with registered(("late-first", -1), ("unranked-between", None), ("after-sorted", 0), ("second-last", 3)):
        assert report_order() == [
            "late-first", "sorted", "after-sorted", "length_grouped", "bucketed", "packed", "second-last", "shuffle",
            "unranked-between",
        ]


def test_a_rank_of_zero_is_a_rank_like_any_other():
    with registered(("rank-one", 1)):
        # sorted (rank 0) before rank 1; among rank 1, registration order: length_grouped, then rank-one
        assert report_order()[:3] == ["sorted", "length_grouped", "rank-one"]


def test_strategy_class_and_options_by_name():
    assert strategy_class("sorted") is SortedStrategy
    assert strategy_class("bucketed") is BucketedStrategy
    assert strategy_options("bucketed") == ["num_buckets", "edges", "same_bucket_steps", "max_recurrence"]
    assert strategy_options("shuffle") == []


@pytest.mark.parametrize(("name", "shown"), [("nope", "'nope'"), ("Sorted", "'Sorted'"), (None, "None"), (3, "3")])
def test_an_unknown_name_is_refused_with_the_known_names(name, shown):
    message = rf"^unknown strategy {shown}; known strategies: bucketed, length_grouped, packed, shuffle, sorted$"
    with pytest.raises(ValueError, match=message):
        strategy_class(name)
    with pytest.raises(ValueError, match=message):
        build_strategy(name)
    with pytest.raises(ValueError, match=message):
        strategy_options(name)


def test_build_strategy_sets_the_options_given():
    strategy = build_strategy("bucketed", num_buckets=3, edges="quantile")
    assert isinstance(strategy, BucketedStrategy)
    assert (strategy.num_buckets, strategy.edges) == (3, "quantile")
    assert build_strategy("shuffle") == ShuffleStrategy()


def test_build_strategy_refuses_unknown_options_listing_its_options():
    with pytest.raises(
        ValueError,
        match=r"^strategy 'bucketed' has no option\(s\) \['buckets', 'fit'\]; "
        r"its options: num_buckets, edges, same_bucket_steps, max_recurrence$",
    ):
        build_strategy("bucketed", fit="best", buckets=3, num_buckets=2)


def test_build_strategy_says_none_for_a_strategy_without_options():
    with pytest.raises(ValueError, match=r"^strategy 'shuffle' has no option\(s\) \['seed'\]; its options: none$"):
        build_strategy("shuffle", seed=1)


def test_resolve_strategy_takes_an_object_as_it_is_or_builds_one_by_name():
    strategy = BucketedStrategy(num_buckets=2)
    assert resolve_strategy(strategy) is strategy
    assert resolve_strategy("bucketed", num_buckets=2) == strategy


def test_resolve_strategy_refuses_options_given_with_an_object():
    with pytest.raises(
        ValueError,
        match=r"^options \['edges', 'num_buckets'\] given with a strategy object; set them on the object or pass the "
        r"strategy by name$",
    ):
        resolve_strategy(BucketedStrategy(), num_buckets=2, edges="dp")
