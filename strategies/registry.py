"""Strategies by name (for Hydra configs and the command line) and the one-call :func:`plan`.

``build_strategy("bucketed", num_buckets=32)`` returns a configured strategy object; unknown names
and unknown or bad options are refused with the list of what is accepted. A strategy joins the
registry with :func:`register_strategy` (the built-ins decorate their classes with it); every list
of strategies in batchlab (``batchlab-plan``'s flags and default, the sweeps, the report's order
and colours, the tests) is read from here.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from .balance import RankBalance
from .base import CliOption, Strategy
from .epoch_plan import Budget, Plan

#: name -> class, in registration order
_REGISTRY: dict[str, type[Strategy]] = {}


def available_strategies() -> list[str]:
    """Registered strategy names, sorted."""
    return sorted(_REGISTRY)


def report_order() -> list[str]:
    """Registered strategy names in the order reports and sweeps show them: by ``report_rank`` (unranked
    strategies last), ties in registration order."""
    ranked = sorted(
        enumerate(_REGISTRY.values()),
        key=lambda item: (item[1].report_rank is None, item[1].report_rank or 0, item[0]),
    )
    return [cls.name for _, cls in ranked]


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Register a :class:`Strategy` subclass under its ``name`` (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Strategy)) or not cls.name:
        raise ValueError(f"{cls!r} must be a Strategy subclass with a non-empty `name`")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"a strategy named {cls.name!r} is already registered")
    options = [f.name for f in fields(cls)]
    for option in cls.cli_options:
        if not isinstance(option, CliOption) or option.field not in options:
            raise ValueError(
                f"strategy {cls.name!r}: cli_options entry {option!r} must be a CliOption naming one of its "
                f"fields ({', '.join(options) or 'none'})"
            )
    _REGISTRY[cls.name] = cls
    return cls


def unregister_strategy(name: str) -> type[Strategy]:
    """Remove a registered strategy (a test's or a plugin's); returns its class."""
    cls = strategy_class(name)
    del _REGISTRY[name]
    return cls


def strategy_options(name: str) -> list[str]:
    """Option names accepted by a strategy."""
    return [f.name for f in fields(strategy_class(name))]


def strategy_class(name: Any) -> type[Strategy]:
    """The class registered under ``name``; an unknown name is refused with the known ones."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; known strategies: {', '.join(available_strategies())}")
    return _REGISTRY[name]


def build_strategy(name: str, **options: Any) -> Strategy:
    """A configured strategy by registry name; options are the strategy's fields."""
    cls = strategy_class(name)
    allowed = [f.name for f in fields(cls)]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        accepted = ", ".join(allowed) if allowed else "none"
        raise ValueError(f"strategy {name!r} has no option(s) {unknown}; its options: {accepted}")
    return cls(**options)


def resolve_strategy(strategy: str | Strategy, **strategy_options: Any) -> Strategy:
    """A strategy object as given, or built from its registry name and options."""
    if isinstance(strategy, Strategy):
        if strategy_options:
            raise ValueError(
                f"options {sorted(strategy_options)} given with a strategy object; set them on the object "
                "or pass the strategy by name"
            )
        return strategy
    return build_strategy(strategy, **strategy_options)


def plan(
    lengths: Any,
    budget: Budget | int,
    strategy: str | Strategy = "bucketed",
    seed: int = 0,
    epoch: int = 0,
    world_size: int = 1,
    grad_accum: int = 1,
    oversize: str = "error",
    balance: RankBalance | dict[str, Any] | None = None,
    step_tokens: int | None = None,
    **strategy_options: Any,
) -> Plan:
    """Plan one epoch with a strategy given by name (plus its options) or as an object.

    See :meth:`Strategy.plan` for the arguments (``step_tokens``: equal-token steps);
    ``strategy_options`` go to :func:`build_strategy`.
    """
    chosen = resolve_strategy(strategy, **strategy_options)
    return chosen.plan(
        lengths, budget, seed=seed, epoch=epoch, world_size=world_size, grad_accum=grad_accum,
        oversize=oversize, balance=balance, step_tokens=step_tokens,
    )
