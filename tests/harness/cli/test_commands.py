"""Every command lives in ``harness/cli`` and stays thin: it parses, calls a service, and renders (issue 50, item 4)."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
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


EXITING = '''
import atexit, sys, threading, time
from pathlib import Path
from harness.cli.process_exit import exits_fast
out = Path(sys.argv[1])
def late():
    time.sleep(0.3)
    out.with_suffix(".thread").write_text("joined")
def main():
    atexit.register(lambda: out.with_suffix(".atexit").write_text("ran"))
    threading.Thread(target=late).start()
    print("last line, unflushed", end="")
    sys.stdout = open(out, "w")  # buffered: only a flush at the end writes it
    print("to the file")
    return {code}
exits_fast(main)()
'''


@pytest.mark.parametrize(("code", "status", "said"), [("None", 0, ""), ("3", 3, ""), ("sys.exit('no such run')", 1, "no such run")])
def test_a_fast_exit_keeps_the_exit_status_threads_hooks_and_buffered_output(tmp_path, code, status, said):
    """What the interpreter's teardown would have done that anyone can see, done before ``os._exit``."""
    out = tmp_path / "out.txt"
    done = subprocess.run([sys.executable, "-c", EXITING.format(code=code), str(out)], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.returncode == status, done.stderr
    assert done.stdout == "last line, unflushed" and said in done.stderr
    assert out.read_text() == "to the file\n"
    assert out.with_suffix(".thread").read_text() == "joined"
    assert out.with_suffix(".atexit").read_text() == "ran"
