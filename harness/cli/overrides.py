"""Check ``batchlab-train``'s command-line overrides before Hydra composes them: a misspelt key or group
option gets one line with "did you mean", instead of Hydra's list (which includes the strategies' internal
``*_schema`` entries) or its ``+key`` hint that ends in a type error.

Plain ``key=value`` overrides (and ``+key=value`` into a typed section, which cannot add a key) are checked
against the typed config tree (:class:`~harness.train.config.RunSchema`: the run config's dataclasses, the old names of moved keys included) and the option files under ``conf/``; the
rest of Hydra's syntax (``+group=option``, ``~``, ``@``, ``hydra.*``, ``group/sub=``, sweeps written as
functions) is left to Hydra.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from collections.abc import Sequence

from harness.train.config import CONF_DIR, MOVED_KEYS, RunSchema, group_options


@functools.cache
def _groups() -> list[str]:
    return sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")


@functools.cache
def _default_groups() -> frozenset[str]:
    """The groups ``conf/train.yaml``'s defaults list chooses (``+group=`` would add a second choice)."""
    import yaml

    defaults = yaml.safe_load((CONF_DIR / "train.yaml").read_text()).get("defaults", [])
    return frozenset(key.split("@")[0].removeprefix("override /") for entry in defaults if isinstance(entry, dict)
                     for key in entry)


@functools.cache
def _fields(cls: type) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name) for f in dataclasses.fields(cls)}


def _suggest(word: str, candidates: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def check_override(argument: str, options_known: bool = True) -> str | None:
    """The problem with one override, in one sentence with its fix, or None (also for what Hydra checks itself).
    ``options_known=False`` (another config search path is given) leaves group options to Hydra."""
    if argument.startswith(("-", "~")) or "=" not in argument:
        return None
    key, value = argument.split("=", 1)
    adding = key.startswith("+")  # Hydra's "+key=value" adds a key: the typed tree has none to add
    key = key.lstrip("+")
    if not key or "/" in key or "@" in key or key.split(".")[0] == "hydra":
        return None
    groups, top = _groups(), _fields(RunSchema)
    parts = key.split(".")
    if adding and len(parts) == 1 and key in _default_groups():
        return f"+{key}={value}: {key} is in conf/train.yaml's defaults already; write {key}={value} to choose it"
    if adding and (parts[0] in groups and len(parts) == 1 or parts[0] not in top):
        return None  # "+group=option" for a group outside the defaults, or a key Hydra reports itself
    if len(parts) == 1 and key in groups:
        if not options_known or any(c in value for c in "()$[]{}") or not value:
            return None
        options = group_options(key)
        for choice in value.split(","):
            if choice not in options:
                return (f"{key}={choice}: there is no such {key} (conf/{key}/){_suggest(choice, options)} "
                        f"Choose one of: {', '.join(options)}")
        return None
    if parts[0] not in top:
        names = sorted({*top, *groups})
        return (f"{key}={value}: {parts[0]} is not a setting{_suggest(parts[0], names)} "
                f"Top-level settings and groups: {', '.join(names)}")
    section = top[parts[0]]
    if len(parts) >= 2 and dataclasses.is_dataclass(section):
        fields = _fields(section)
        if parts[1] not in fields:
            close = _suggest(parts[1], list(fields))
            close = close.replace("did you mean ", f"did you mean {parts[0]}.") if close else ""
            typed = " (settings are typed: '+' cannot add one)" if adding else ""
            return (f"{argument.split('=', 1)[0]}={value}: {parts[0]} has no setting {parts[1]!r}{typed}{close} "
                    f"(its settings: {', '.join(sorted(fields))})")
    return None


def check_overrides(arguments: Sequence[str]) -> str | None:
    """The first problem among the command line's overrides, or None."""
    options_known = not any(a.startswith(("hydra.searchpath", "--config-dir", "-cd")) for a in arguments)
    keys = {a.split("=", 1)[0].lstrip("+") for a in arguments if "=" in a and not a.startswith("-")}
    for old, new in MOVED_KEYS.items():
        if old in keys and new in keys:
            return f"{old} and {new}: {old} is the old name of {new}; give {new} only"
    for argument in arguments:
        problem = check_override(argument, options_known)
        if problem:
            return problem
    return None
