"""A tiny sweep for the analysis, report and notebook tests, built once per process.

``tiny_sweep(root)`` runs ``batchlab-train -m experiment=strategies_smoke``: every strategy × 3 seeds
on one CPU rank (a 48-document slice, 384-token budget, 2 accumulation micro-batches so that the
gradient statistics are measured, about 2 epochs): a few seconds a run. ``wandb_run(root)`` adds one
run logged to an offline W&B run. Both are built once per test session and shared by every test module
(and, under pytest-xdist, by every worker: the first one builds under a file lock, the others wait and
reuse it).
"""

import json
import os
import shutil
import sys
from pathlib import Path

from support.process import failure_text, run_process
from strategies import report_order

REPO = Path(__file__).resolve().parents[2]
# conf/experiment/strategies_smoke.yaml sweeps every registered strategy, in report order
STRATEGIES = tuple(report_order())
SEEDS = (0, 1, 2)

EXPERIMENT = """\
# @package _global_
group: analysis_tiny
data:
  max_documents: 48
  vocab_size: 512
  max_heldout: 16
  heldout_fraction: 0.15
trainer:
  nproc: 1
  num_workers: 0
  threads_per_rank: 1
  max_tokens: 384
  grad_accum: 2
  stop_tokens: 7000
  eval_every_tokens: 1500
  checkpoint_every_steps: 1000
  grad_stats_every: 1
  progress: false
"""

_built: dict[str, Path] = {}


def _once(name: str, root: Path, build) -> Path:
    """``build(directory)`` run once per session: in ``root`` alone, or under pytest-xdist in a directory all the
    session's workers share (the first builds under a file lock; a ``.done`` marker says it finished)."""
    if name in _built:
        return _built[name]
    # a worker's temporary directories lie in .../pytest-N/popen-gwK/: .../pytest-N is the session's, shared
    # by its workers and cleaned up by pytest like the rest
    workers = [p.parent for p in Path(root).resolve().parents if p.name.startswith("popen-gw")]
    if not workers:
        directory = Path(root) / name
        build(directory)
    else:
        from filelock import FileLock

        shared = workers[0] / "shared"
        shared.mkdir(parents=True, exist_ok=True)
        directory = shared / name
        failed = shared / f"{name}.failed"
        with FileLock(str(shared / f"{name}.lock")):
            if failed.exists():  # one failed build is reported by every test that needs it, not repeated
                raise RuntimeError(f"building the shared {name!r} failed earlier in this session:\n"
                                   + failed.read_text())
            if not (shared / f"{name}.done").exists():
                if directory.exists():
                    shutil.rmtree(directory)  # a worker died while building it
                try:
                    build(directory)
                except BaseException as error:
                    failed.write_text(f"{type(error).__name__}: {error}"[-6000:])
                    raise
                (shared / f"{name}.done").touch()
    _built[name] = directory
    return directory


def _config_dir(root: Path) -> Path:
    conf = root / "conf"
    (conf / "experiment").mkdir(parents=True, exist_ok=True)
    (conf / "experiment" / "analysis_tiny.yaml").write_text(EXPERIMENT)
    return conf


def _train(args, root: Path, timeout: int = 500) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_SILENT="true")
    env.pop("WANDB_MODE", None)
    env.setdefault("BATCHLAB_CACHE", str(root / "cache"))
    result = run_process([sys.executable, "-m", "harness.cli.train", "--config-dir", str(_config_dir(root)), *args],
                         cwd=REPO, env=env, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"batchlab-train {' '.join(args)} failed ({result.returncode}):\n{failure_text(result)}")


def tiny_sweep(root: Path) -> Path:
    """The project's own test sweep, ``experiment=strategies_smoke`` (every strategy x 3 seeds; sub-directories
    ``strategy=X,seed=S``)."""
    def build(sweep: Path) -> None:
        _train(["-m", "experiment=strategies_smoke", "logger=none", f"hydra.sweep.dir={sweep}"], sweep.parent)

    return _once("sweep", root, build)


def wandb_run(root: Path) -> Path:
    """A sweep directory with one short packed run logged to an offline W&B run as well."""
    def build(sweep: Path) -> None:
        _train(["-m", "experiment=analysis_tiny", "strategy=packed", "seed=0", "trainer.stop_tokens=2500",
                "logger=wandb", f"hydra.sweep.dir={sweep}"], sweep.parent)

    return _once("wandb-sweep", root, build)


def run_dirs(sweep: Path) -> list[Path]:
    return sorted(p.parent for p in Path(sweep).glob("*/summary.json"))


def run_dir(sweep: Path, strategy: str, seed: int) -> Path:
    return Path(sweep) / f"strategy={strategy},seed={seed}"


def copy_sweep(sweep: Path, target: Path, runs=None) -> Path:
    """A copy of the sweep's run directories (metrics, config, summary only), optionally only ``runs``."""
    target.mkdir(parents=True, exist_ok=True)
    for source in run_dirs(sweep):
        if runs is not None and source.name not in runs:
            continue
        destination = target / source.name
        destination.mkdir()
        for name in ("config.json", "metrics.jsonl", "summary.json"):
            shutil.copy(source / name, destination / name)
    return target


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def report_dir(root: Path) -> Path:
    """``batchlab-report SWEEP --out ...`` of the tiny sweep, run once (in process)."""
    def build(out: Path) -> None:
        from harness.cli.report import main

        code = main([str(tiny_sweep(root)), "--out", str(out)])
        if code != 0:
            raise RuntimeError(f"batchlab-report exited with {code}")

    return _once("report", root, build)
