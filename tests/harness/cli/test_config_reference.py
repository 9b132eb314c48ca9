"""The config reference (docs/reference/config.md) is current and documents every key that conf/ sets."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.cli import config_reference as reference

REPO = Path(__file__).resolve().parents[3]
CONF = REPO / "conf"
PAGE = REPO / "docs" / "reference" / "config.md"
FIX = "run python -m harness.cli.config_reference --write (make config-reference)"


@pytest.fixture(scope="module")
def sections() -> list[reference.Section]:
    return reference.sections()


def documented(page: str) -> dict[str, str]:
    """The page's table rows: key -> its description cell."""
    rows = {}
    for line in page.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)]
        if len(cells) == 6 and cells[1].startswith("`") and cells[1] != "`Key`":
            rows[cells[1].strip("`")] = cells[4]
    return rows


def package(text: str) -> str | None:
    """A Hydra file's ``# @package`` directive, if any."""
    found = re.search(r"^# @package (\S+)", text, re.MULTILINE)
    return found.group(1) if found else None


def leaf_keys(values: Any, prefix: str) -> Iterator[str]:
    """The dotted keys of a mapping's leaves; a list of mappings by its items' keys (``name[].key``)."""
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from leaf_keys(value, dotted + ".")
        elif isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            for item in value:
                yield from leaf_keys(item, dotted + "[].")
        else:
            yield dotted


def conf_keys(path: Path) -> list[str]:
    """The keys a file under conf/ sets, as the reference names them (Hydra's own and defaults lists left out)."""
    text = path.read_text()
    values = yaml.safe_load(text) or {}
    where = package(text)
    group = path.relative_to(CONF).parts[0] if path.parent != CONF else None
    if where and where.startswith("hydra"):
        return []  # a launcher's keys are Hydra's (package hydra.launcher)
    values = {k: v for k, v in values.items() if k not in ("defaults", "hydra")}
    # a _global_ file (experiment, step_mode) and train.yaml set keys of the whole tree; a preregistration's keys
    # are its own (read by batchlab-report); any other group file sets keys of its group
    prefix = "" if where == "_global_" or group in (None, "preregistration") else f"{group}."
    keys = list(leaf_keys(values, prefix))
    if group == "preregistration":  # a secondary family's keys are the file's own (endpoint, contrasts[].a, ...)
        keys = [key.removeprefix("secondary.") for key in keys] + ["secondary"] * any(
            key.startswith("secondary.") for key in keys)
    return sorted(set(keys))


def test_the_page_is_current(sections):
    assert PAGE.is_file(), f"{PAGE.relative_to(REPO)} is missing: {FIX}"
    assert PAGE.read_text() == reference.render(sections), f"{PAGE.relative_to(REPO)} is stale: {FIX}"


def test_every_key_under_conf_is_documented():
    rows = documented(PAGE.read_text())
    files = sorted(CONF.rglob("*.yaml"))
    assert len(files) > 30  # every group is walked
    seen = set()
    for path in files:
        for key in conf_keys(path):
            seen.add(key)
            assert rows.get(key), (f"conf/{path.relative_to(CONF)} sets {key}, which {PAGE.relative_to(REPO)} does "
                                   "not document: give its schema field a docstring (or a TARGET_KEYS line for a "
                                   f"target key), then {FIX}")
    # the walk reaches every kind of file: group files, train.yaml, _global_ presets, nested values, preregistrations
    assert {"strategy.fit", "eval.every_tokens", "topology.peer_timeout_s", "target.rope_parameters.rope_theta",
            "contrasts[].margin", "group", "secondary", "combine"} <= seen


def test_every_schema_field_has_an_attribute_docstring(sections):
    assert reference.undocumented(sections) == [], "give each field a docstring (a string right under it)"
    keys = [key for section in sections for key in section.keys]
    assert len(keys) > 150
    assert all(key.doc for key in keys)


@dataclass
class Planted:
    """A schema with one undocumented field."""

    documented: int = 1
    """A documented field."""
    bare: int = 2


def test_a_field_without_a_docstring_is_caught():
    keys = reference.dataclass_keys("planted.", Planted)
    assert [key.doc for key in keys] == ["A documented field.", ""]
    section = reference.Section("planted", tables=[("", keys)])
    assert reference.undocumented([section]) == [f"planted.bare ({__name__}.Planted)"]


def test_check_passes_on_the_committed_page(capsys):
    assert reference.main(["--check"]) == 0, capsys.readouterr().err
