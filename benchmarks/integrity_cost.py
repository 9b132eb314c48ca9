"""What checking the cache's checksums costs a smoke run's start-up.

Every cache entry a run opens is checked against the xxh3 checksums written after it (``harness/data/cache.py``).
This runs ``experiment=smoke`` (one rank, the cache warm: a first run builds it), each timed run a fresh process,
times every checksum computed, and sets their sum against the start-up: the wall time from the process's launch to
its first training step.
Two variants: the smoke run as shipped (the target online), and with ``trainer.target_features=cached`` (the
largest entry a run reads, so the check's worst case). Rounds interleave the variants; the median is reported.

    python benchmarks/integrity_cost.py            # print
    python benchmarks/integrity_cost.py --write    # also rewrite its section of RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from results_file import cpu_model, write_section  # noqa: E402

TITLE = "## Checksums on read: their cost to a smoke run's start-up (CPU)"
BASE = ["experiment=smoke", "trainer.nproc=1", "trainer.num_workers=0", "logger=none", "trainer.progress=false",
        "strategy=packed", "trainer.stop_tokens=2000", "eval.every_tokens=1000000"]
VARIANTS = {"target online": [], "features cached": ["trainer.target_features=cached"]}
GOAL = 0.02


def timed_run(overrides: list[str], run_dir: Path, launched: float) -> tuple[float, float, int]:
    """(checksum seconds, start-up seconds from ``launched``, a ``time.time()``, bytes checked) of one run in this
    process."""
    from support.train import compose_config

    from harness.data import cache
    from harness.train.launch.run import run
    from harness.train.loop.trainer import Trainer

    spent = {"seconds": 0.0, "bytes": 0}
    first_step: list[float] = []
    original_checksum, original_step = cache.file_checksum, Trainer.train_step

    def checksum(path):
        begin = time.perf_counter()
        try:
            return original_checksum(path)
        finally:
            spent["seconds"] += time.perf_counter() - begin
            spent["bytes"] += Path(path).stat().st_size

    def step(self, *args, **kwargs):
        if not first_step:
            first_step.append(time.time())
        return original_step(self, *args, **kwargs)

    cache.file_checksum, Trainer.train_step = checksum, step
    try:
        run(compose_config([*BASE, *overrides]), run_dir)
    finally:
        cache.file_checksum, Trainer.train_step = original_checksum, original_step
    return spent["seconds"], first_step[0] - launched, spent["bytes"]


def fresh_process(overrides: list[str], run_dir: Path) -> tuple[float, float, int]:
    """:func:`timed_run` in a new Python process (nothing imported, nothing verified yet)."""
    launched = time.time()
    result = subprocess.run([sys.executable, __file__, "--child", json.dumps([overrides, str(run_dir), launched])],
                            capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"the run failed:\n{result.stderr[-4000:]}")
    return tuple(json.loads(result.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        overrides, run_dir, launched = json.loads(args.child)
        print(json.dumps(timed_run(overrides, Path(run_dir), launched)))
        return
    began = time.time()
    work = Path(tempfile.mkdtemp(prefix="integrity-cost-"))
    os.environ["BATCHLAB_CACHE"] = str(work / "cache")
    for name, overrides in VARIANTS.items():  # build the cache: not timed
        fresh_process(overrides, work / f"warm-{len(overrides)}")
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in VARIANTS}
    for round_ in range(args.rounds):
        for name, overrides in VARIANTS.items():
            results[name].append(fresh_process(overrides, work / f"round{round_}-{len(overrides)}"))
            check, startup, size = results[name][-1]
            print(f"round {round_} {name}: checksums {check * 1e3:.1f} ms over {size / 2**20:.1f} MiB, start-up "
                  f"{startup:.2f} s", flush=True)
    lines = ["| run | bytes checked | checksums (median) | start-up (median) | share | goal |",
             "|---|---|---|---|---|---|"]
    for name, rows in results.items():
        check = statistics.median(r[0] for r in rows)
        startup = statistics.median(r[1] for r in rows)
        share = statistics.median(r[0] / r[1] for r in rows)
        lines.append(f"| smoke, {name} | {rows[0][2] / 2**20:.1f} MiB | {check * 1e3:.1f} ms | {startup:.2f} s | "
                     f"{share:.2%} | " + ("PASS" if share <= GOAL else "FAIL") + f" (≤ {GOAL:.0%}) |")
    section = (
        f"{TITLE}\n\n"
        f"Command: `python benchmarks/integrity_cost.py --write` (rounds={args.rounds}). Machine: {cpu_model()}, "
        f"{os.cpu_count()} cores. Date: {datetime.date.today().isoformat()}; took {(time.time() - began) / 60:.1f} "
        "min.\n\n"
        "`experiment=smoke` on one rank, the cache warm, each run a fresh process; start-up is the wall time from the "
        "process's launch to its first training step; checksums is the time spent computing xxh3 over the entries "
        "the run opened (each entry's every file, once a process).\n\n" + "\n".join(lines) + "\n")
    print(section)
    if args.write:
        write_section(section, TITLE)


if __name__ == "__main__":
    main()
