"""The notebooks: stored without outputs, and they execute (nbclient) against the tiny sweep."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient

from support import analysis as support
from strategies import available_strategies

NOTEBOOKS = support.REPO / "notebooks"


@pytest.fixture(scope="session")
def sweep_dir(tmp_path_factory, batchlab_cache):
    return support.tiny_sweep(tmp_path_factory.mktemp("analysis"))


@pytest.mark.parametrize("name", ["tradeoffs.ipynb", "dataset_lengths.ipynb"])
def test_stored_without_outputs(name):
    path = NOTEBOOKS / name
    book = nbformat.read(path, as_version=4)
    nbformat.validate(book)
    for cell in book.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name} has outputs: run nbstripout"
    parameters = [c for c in book.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(parameters) == 1
    exe = Path(sys.executable).with_name("nbstripout")
    command = [str(exe)] if exe.exists() else [shutil.which("nbstripout")] if shutil.which("nbstripout") else None
    assert command is not None, "nbstripout (a dev dependency) is not installed: pip install -e '.[dev]'"
    result = subprocess.run([*command, "--verify", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _execute(name, tmp_path, env):
    book = nbformat.read(NOTEBOOKS / name, as_version=4)
    previous = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits the environment: the notebooks' parameters read it
    try:
        NotebookClient(book, timeout=180, kernel_name="python3",
                       resources={"metadata": {"path": str(support.REPO)}}).execute()
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    nbformat.write(book, tmp_path / name)
    return book


def _outputs(book, kind):
    return [o for c in book.cells if c.cell_type == "code" for o in c.outputs if kind in o.get("data", {})]


def _text(book):
    parts = []
    for cell in book.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts.extend(str(v) for k, v in output.get("data", {}).items() if k.startswith("text/"))
    return "\n".join(parts)


def test_tradeoffs_reproduces_the_report_on_the_sweep(sweep_dir, tmp_path):
    book = _execute("tradeoffs.ipynb", tmp_path, {"BATCHLAB_SWEEP": str(sweep_dir)})
    assert len(_outputs(book, "image/png")) == 8  # the report's eight figures
    text = _text(book)
    assert f"{len(support.STRATEGIES) * len(support.SEEDS)} complete runs" in text and "has the highest throughput" in text
    assert "broken down by" in text


def test_dataset_lengths_runs_in_seconds(tmp_path):
    lengths = np.random.default_rng(0).lognormal(np.log(300), 1.0, 3000).clip(16, 4096).astype(np.int64)
    np.save(tmp_path / "lengths.npy", lengths)
    book = _execute("dataset_lengths.ipynb", tmp_path, {"BATCHLAB_LENGTHS": str(tmp_path / "lengths.npy"),
                                                        "BATCHLAB_MAX_TOKENS": "4096"})
    assert len(_outputs(book, "image/png")) == 2
    text = _text(book)
    assert "3,000 samples" in text
    for word in ("quantile", "equal_tokens", "dp", *available_strategies()):
        assert word in text
