"""Every command lives in ``harness/cli`` and stays thin: it parses, calls a service, and renders (issue 50, item 4)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the longest a function in a command module may be; validation and work belong in the services
MAX_COMMAND_FUNCTION_LINES = 60


def test_every_console_script_is_a_command_in_harness_cli():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts, "pyproject.toml declares no console scripts"
    outside = {name: target for name, target in scripts.items() if not target.startswith("harness.cli.")}
    assert not outside, f"console scripts outside harness.cli: {outside}"
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        path = ROOT / (module.replace(".", "/") + ".py")
        assert path.is_file(), f"{name}: no module {module}"
        defined = {node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)}
        assert function in defined, f"{name}: {module} defines no {function}()"


def long_functions(path: Path, limit: int = MAX_COMMAND_FUNCTION_LINES) -> list[str]:
    """``path:line name (lines)`` for every function (methods and nested ones included) over ``limit`` lines."""
    tree = ast.parse(path.read_text())
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{node.lineno} {node.name} "
            f"({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_no_command_function_is_over_sixty_lines():
    found = [line for path in sorted((ROOT / "harness" / "cli").glob("*.py")) for line in long_functions(path)]
    assert not found, "command functions over 60 lines (move the work into a service):\n" + "\n".join(found)


def test_the_length_check_finds_a_long_function(tmp_path):
    source = tmp_path / "command.py"
    source.write_text("def short():\n    return 1\n\n\ndef long():\n" + "    x = 1\n" * 60 + "    return x\n")
    assert long_functions(source) == [f"{source}:5 long (62 lines)"]
