"""`make install` with and without pip's byte-compilation, side by side, and what every later process pays for it.

Usage:
    python benchmarks/install_time.py --rounds 2 --write

Each round builds two fresh venvs (``make install VENV=...``), one with ``PIP_FLAGS=--no-compile`` and one as the
Makefile installs (pip compiles every module it installs), in alternating order. Then, in each venv, what a 2-rank
run's processes import (the launcher's and the rank forkserver's modules) is timed twice: the first time Python
compiles what pip did not; the second reads the bytecode the first wrote, unless PYTHONDONTWRITEBYTECODE is set,
when every process compiles again.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import cpu_model, write_section  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TITLE = "## Install time: pip's byte-compilation (make install)"
MODES = {"no-compile": "--no-compile", "compile": ""}


def imports() -> str:
    """What a 2-rank run's processes import: the command's module, then the rank forkserver's preload."""
    from harness.train.distributed import RANK_PRELOAD

    return "import " + ", ".join(("harness.cli.train", *RANK_PRELOAD))


def timed(command: list[str], **kwargs) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kwargs)
    return time.perf_counter() - started


def one(mode: str, root: Path) -> dict[str, float]:
    venv = root / mode
    install = timed(["make", "install", f"VENV={venv}", f"PIP_FLAGS={MODES[mode]}"], cwd=REPO)
    python, statement = str(venv / "bin" / "python"), imports()
    first = timed([python, "-c", statement], cwd=REPO)
    second = timed([python, "-c", statement], cwd=REPO)
    shutil.rmtree(venv)
    return {"install": install, "first_import": first, "second_import": second}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="batchlab-install-") as tmp:
        for round_ in range(args.rounds):
            order = list(MODES) if round_ % 2 == 0 else list(reversed(MODES))
            for mode in order:
                results[mode].append(one(mode, Path(tmp)))
                print(mode, {k: round(v, 1) for k, v in results[mode][-1].items()}, flush=True)
    median = {mode: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for mode, rows in results.items()}
    saved = median["compile"]["install"] - median["no-compile"]["install"]
    extra = median["no-compile"]["second_import"] - median["compile"]["second_import"]
    no_bytecode = os.environ.get("PYTHONDONTWRITEBYTECODE", "")
    lines = [
        TITLE, "",
        f"Command: `python benchmarks/install_time.py --rounds {args.rounds}`; {cpu_model()}, {os.cpu_count()} cores, "
        f"load average {load:.1f} at start; {datetime.date.today().isoformat()}; PYTHONDONTWRITEBYTECODE "
        f"{'set' if no_bytecode else 'unset'}. Each round installs both ways in fresh venvs (alternating order), "
        "then times a 2-rank run's imports (launcher and rank forkserver) twice in each.", "",
        "| pip | install (median) | imports, first | imports, again |",
        "|---|---|---|---|",
    ]
    for mode, m in median.items():
        lines.append(f"| {mode} | {m['install']:.1f} s | {m['first_import']:.1f} s | {m['second_import']:.1f} s |")
    if extra > 0.5:
        verdict = (f"--no-compile saves {saved:.1f} s of install, and costs {extra:.1f} s of imports in every later "
                   f"process that imports these modules: repaid after {saved / extra:.0f} processes, where a sweep "
                   "or the test suite starts one or more a run. The Makefile keeps pip's compilation.")
    else:
        verdict = (f"--no-compile saves {saved:.1f} s of install, and later processes read the bytecode their first "
                   f"import wrote ({extra:+.1f} s of imports).")
    lines += ["", verdict, ""]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        write_section(text, TITLE)


if __name__ == "__main__":
    main()
