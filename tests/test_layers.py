"""The package's layering holds: import-linter's contracts (pyproject.toml) are kept, and a contract can fail."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the most modules one package (a "room") holds before it should be split by concern
MAX_ROOM = 15
#: the project's packages (pyproject.toml's import-linter root_packages)
PACKAGES = ("batchlab", "harness", "strategies", "analysis")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` over the package tree at ``root`` (its pyproject.toml's contracts), uncached."""
    script = (f"import sys; sys.path.insert(0, {str(root)!r}); "
              "from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))")
    return subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)


def tree_copy(tmp_path: Path) -> Path:
    """A copy of the packages and pyproject.toml (its contracts) to plant an import in."""
    copy = tmp_path / "tree"
    copy.mkdir()
    shutil.copy(ROOT / "pyproject.toml", copy)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_every_layer_contract_is_kept():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_an_import_up_the_layers_breaks_the_contract_naming_it(tmp_path):
    """The contract is live: a copy of the tree whose feature link imports the trainer fails, naming the line."""
    copy = tree_copy(tmp_path)
    link = copy / "harness/train/placement/link.py"
    link.write_text(link.read_text() + "\n\ndef _upward():\n    from harness.train.loop import trainer  # noqa\n")
    result = lint_imports(copy)
    assert result.returncode != 0
    assert "harness.train.placement is not allowed to import harness.train.loop" in result.stdout
    assert "harness.train.placement.link -> harness.train.loop.trainer" in result.stdout


def test_a_circle_in_the_data_layers_breaks_their_contract(tmp_path):
    """harness/data's own contract is live: a format that imports its dispatcher, even inside a function (the
    old way of dodging a circle), fails naming the line."""
    copy = tree_copy(tmp_path)
    read = copy / "harness/data/chat/read.py"
    read.write_text(read.read_text() + "\n\ndef _circle():\n    from harness.data.sources import load_source  # noqa\n")
    result = lint_imports(copy)
    assert result.returncode != 0
    assert "harness.data.chat is not allowed to import harness.data.sources" in result.stdout


def test_no_module_is_part_of_an_import_circle():
    """No module imports itself back through others, imports inside functions included (grimp's graph)."""
    import grimp
    import networkx

    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    edges = networkx.DiGraph((module, imported) for module in graph.modules
                             for imported in graph.find_modules_directly_imported_by(module))
    circles = [sorted(c) for c in networkx.strongly_connected_components(edges) if len(c) > 1]
    assert not circles, circles


@pytest.mark.parametrize("package", PACKAGES)
def test_no_room_holds_more_than_a_newcomer_can_name(package):
    """Every package (a folder of modules) holds at most MAX_ROOM modules; more means two concerns share it."""
    crowded = {}
    for folder in [ROOT / package, *(p for p in (ROOT / package).rglob("*") if p.is_dir())]:
        if folder.name == "__pycache__":
            continue
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MAX_ROOM:
            crowded[str(folder.relative_to(ROOT))] = len(modules)
    assert not crowded, f"packages over {MAX_ROOM} modules: {crowded}"


def test_every_package_folder_is_a_regular_package():
    """A folder of modules without ``__init__.py`` is a namespace package the layering tools cannot see."""
    missing = [str(p.relative_to(ROOT)) for package in PACKAGES
               for p in [ROOT / package, *(ROOT / package).rglob("*")]
               if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py")) and not (p / "__init__.py").exists()]
    assert not missing, missing


#: the project's own packages (a private name of torch or another library is that library's business)
PROJECT = PACKAGES


def _private_imports(path: Path, package: str) -> list[str]:
    """``from X import _y`` / ``import X._y`` / ``from X._y import z`` in ``path`` where X is outside ``package``."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [a.name for a in node.names]
            module = node.module
        elif isinstance(node, ast.Import):
            names, module = [], None
            for alias in node.names:
                if alias.name.startswith(PROJECT) and any(part.startswith("_") and not part.startswith("__") for part in alias.name.split(".")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} import {alias.name}")
            continue
        else:
            continue
        if not module.startswith(PROJECT) or module == package or \
                module.startswith(package + "."):
            continue
        private_module = any(p.startswith("_") and not p.startswith("__") for p in module.split("."))
        private_names = [n for n in names if n.startswith("_") and not n.startswith("__")]
        if private_module or private_names:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {module} import {', '.join(names)}")
    return found


def test_no_module_imports_a_private_name_from_outside_its_package():
    """Private names (``_x``) and private modules (``pkg._mod``) stay inside their package; the strategy plugin
    API is exported by ``strategies`` (the plugin test imports only public names)."""
    found = []
    for top in (*PACKAGES, "tests", "benchmarks"):
        for path in (ROOT / top).rglob("*.py"):
            package = ".".join(path.relative_to(ROOT).parent.parts)
            found += _private_imports(path, package)
    assert not found, "\n".join(found)


def test_the_private_import_scan_finds_each_form(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    source = tmp_path / "mod.py"
    source.write_text("from strategies._random import generator\nfrom harness.models.config import _X\n"
                      "import strategies._kernels\nfrom harness.models import config\nfrom harness.train.x import _y\n")
    found = _private_imports(source, "harness.train")
    assert [line.split(" ", 1)[0] for line in found] == ["mod.py:1", "mod.py:2", "mod.py:3"]


def test_the_run_config_climbs_back_up_the_layering_at_most_twice(tmp_path, monkeypatch, batchlab_cache):
    """benchmarks/config_walk.py traces the config from batchlab-train's entry point (one small in-process run):
    the only climb allowed is the launcher calling back the rank's function; the detector finds a climb it is
    shown (a file handing the config to a file above it)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import config_walk
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.chdir(tmp_path)
    handlers_before = list(logging.getLogger().handlers)
    modules, steps = config_walk.traced_walk([
        "experiment=smoke", "strategy=packed", "trainer.nproc=1", "logger=none", "trainer.progress=false",
        "trainer.stop_tokens=2000", "eval.every_tokens=2000", "eval.real_prompts=0"])
    _, climbs = config_walk.walk_table(modules, steps)
    # Hydra's file handler into the walk's deleted run directory is gone again (later tests log to the root)
    assert logging.getLogger().handlers == handlers_before
    assert modules[0] == "harness.cli.train" and "harness.train.loop.trainer" in modules
    assert len(climbs) <= 2, climbs
    _, shown = config_walk.walk_table(["harness.train.loop.build", "harness.train.launch.run"],
                                      {("harness.train.loop.build", "harness.train.launch.run"): None})
    assert shown == ["`harness/train/loop/build.py` (3) → `harness/train/launch/run.py` (2)"]
