"""Preregistration files for the analysis tests: a minimal one with fields set, and the refusal a file gets."""

from pathlib import Path

import pytest
import yaml

from analysis.planned import load_preregistration

MINIMAL = {"endpoint": "final_eval_loss", "better": "lower", "contrasts": [{"a": "x", "b": "y", "kind": "superiority"}]}


def plan_file(tmp_path: Path, **fields) -> Path:
    """A preregistration file of :data:`MINIMAL` with ``fields`` set (a field set to ``...`` is left out)."""
    declared = {key: value for key, value in {**MINIMAL, **fields}.items() if value is not ...}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(declared, allow_unicode=True))
    return path


def refusal(path: Path) -> str:
    """The message of the ValueError that loading ``path`` raises."""
    with pytest.raises(ValueError) as excinfo:
        load_preregistration(path)
    return str(excinfo.value)
