"""What ending ``batchlab-train``'s process without the interpreter's teardown saves (``harness/cli/process_exit.py``).

The same smoke run (one rank, the cache warm: a first run builds it), each timed run a fresh process, two ways:
``cli()`` as shipped (exit hooks, then ``os._exit``) and ``cli.__wrapped__()``, the same command left to Python's
own teardown. Wall time from the process's launch to its end; rounds interleave the two, the median is reported.

    python benchmarks/process_exit.py            # print
    python benchmarks/process_exit.py --write    # also rewrite its section of RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from results_file import cpu_model, median_table, write_section  # noqa: E402

TITLE = "## Ending a command's process: batchlab-train without the interpreter's teardown (CPU)"
ARGS = ["experiment=smoke", "trainer.nproc=1", "trainer.num_workers=0", "logger=none", "trainer.progress=false",
        "strategy=packed", "trainer.stop_tokens=2000", "eval.every_tokens=1000000"]
#: how each variant calls the command: the shipped entry point, or the function it wraps
VARIANTS = {"fast exit (shipped)": "cli()", "Python's teardown": "cli.__wrapped__()"}


def one_run(call: str, run_dir: Path, env: dict[str, str]) -> float:
    """Seconds from launching the process to its end, for one smoke run."""
    code = f"import sys; sys.argv = ['batchlab-train', *sys.argv[1:]]; from harness.cli.train import cli; {call}"
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, *ARGS, f"hydra.run.dir={run_dir}"], cwd=REPO, env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - began
    if done.returncode != 0 or "complete after" not in done.stdout:
        sys.exit(f"the smoke run failed ({call}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, BATCHLAB_CACHE=str(Path(tmp) / "cache"), HF_DATASETS_DISABLE_PROGRESS_BARS="1")
        one_run(VARIANTS["fast exit (shipped)"], Path(tmp) / "warm-up", env)  # builds the cache
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for round_ in range(args.rounds):
            for name, call in VARIANTS.items():
                times[name].append(one_run(call, Path(tmp) / f"{round_}-{len(times[name])}-{name[:4]}", env))
                print(f"round {round_}: {name} {times[name][-1]:.2f} s", flush=True)
    fast, slow = (statistics.median(times[name]) for name in VARIANTS)
    lines = [
        TITLE, "",
        f"Command: `python benchmarks/process_exit.py --rounds {args.rounds} --write`. Machine: {cpu_model()}, "
        f"{os.cpu_count()} cores. Date: {datetime.date.today().isoformat()}. The smoke run "
        f"(`{' '.join(ARGS)}`), cache warm, each run a fresh process; rounds interleave the variants.", "",
        *median_table("variant", times),
        "",
        f"Ending the process with `os._exit` after the exit hooks saves {slow - fast:.2f} s a run "
        f"({(slow - fast) / slow:.1%} of this smoke run's wall time). A sweep pays it once a run, the test suite once "
        "for each of its `batchlab-train` processes.", "",
    ]
    section = "\n".join(lines)
    print(section)
    if args.write:
        write_section(section, TITLE)


if __name__ == "__main__":
    main()
