"""What forking the ranks' server from the launcher saves (``harness/train/rank_server.py``), against
multiprocessing's own server (a fresh interpreter that imports torch and the rank's code again).

The same two-rank smoke run (the cache warm: a first run builds it), each timed run a fresh ``batchlab-train``
process, with ``BATCHLAB_FORK_RANK_SERVER=1`` (shipped) and ``=0``. Wall time from the launch to the process's end;
rounds interleave the two, the median is reported. Both must train the same run: their losses are compared.

    python benchmarks/rank_server.py            # print
    python benchmarks/rank_server.py --write    # also rewrite its section of RESULTS.md
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
sys.path.insert(0, str(REPO / "benchmarks"))

from results_file import cpu_model, median_table, write_section  # noqa: E402

TITLE = "## The ranks' server: forked from the launcher, or a fresh interpreter (CPU)"
ARGS = ["experiment=smoke", "trainer.nproc=2", "logger=none", "trainer.progress=false", "strategy=packed"]
#: BATCHLAB_FORK_RANK_SERVER of each variant
VARIANTS = {"forked from the launcher (shipped)": "1", "multiprocessing's own server": "0"}


def one_run(switch: str, run_dir: Path, env: dict[str, str]) -> tuple[float, float]:
    """(seconds from launching the process to its end, the run's held-out loss) for one smoke run."""
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "harness.cli.train", *ARGS, f"hydra.run.dir={run_dir}"], cwd=REPO,
                          env={**env, "BATCHLAB_FORK_RANK_SERVER": switch}, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    if done.returncode != 0 or "complete after" not in done.stdout:
        sys.exit(f"the smoke run failed (BATCHLAB_FORK_RANK_SERVER={switch}):\n{done.stdout[-2000:]}\n"
                 f"{done.stderr[-2000:]}")
    return seconds, json.loads((run_dir / "summary.json").read_text())["eval_loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, BATCHLAB_CACHE=str(Path(tmp) / "cache"), HF_DATASETS_DISABLE_PROGRESS_BARS="1")
        one_run("1", Path(tmp) / "warm-up", env)  # builds the cache
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        losses: set[float] = set()
        for round_ in range(args.rounds):
            for name, switch in VARIANTS.items():
                seconds, loss = one_run(switch, Path(tmp) / f"{round_}-{switch}", env)
                times[name].append(seconds)
                losses.add(loss)
                print(f"round {round_}: {name} {seconds:.2f} s, held-out loss {loss!r}", flush=True)
    if len(losses) != 1:
        sys.exit(f"the two servers' runs differ: held-out losses {sorted(losses)}")
    forked, fresh = (statistics.median(times[name]) for name in VARIANTS)
    lines = [
        TITLE, "",
        f"Command: `python benchmarks/rank_server.py --rounds {args.rounds} --write`. Machine: {cpu_model()}, "
        f"{os.cpu_count()} cores. Date: {datetime.date.today().isoformat()}. The smoke run "
        f"(`{' '.join(ARGS)}`), cache warm, each run a fresh process; rounds interleave the variants. Every run's "
        f"held-out loss was the same ({losses.pop()!r}).", "",
        *median_table("ranks' server", times),
        "",
        f"Forking the server from the launcher saves {fresh - forked:.2f} s a run ({(fresh - forked) / fresh:.1%} of "
        "this smoke run's wall time): the server no longer imports torch, transformers' model code and the rank's own "
        "modules a second time. A sweep's later jobs reuse the server either way; the test suite starts dozens of "
        "multi-rank jobs, each paying it once.", "",
    ]
    section = "\n".join(lines)
    print(section)
    if args.write:
        write_section(section, TITLE)


if __name__ == "__main__":
    main()
