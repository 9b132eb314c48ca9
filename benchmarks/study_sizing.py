"""Sizing the real-model study (experiment=study_real): one run per arm, evaluated on the validation rows (never the
held-out ones): how fast each setting trains on 2 cores and how much it learns in that time (validation loss per
block, τ, τ real against SmolLM2, first-slot accuracy). Two sets of arms, each with its own section of RESULTS.md:

* ``--arms drafter`` (sorted, seed 200, 6 epochs): the drafter's block size and learning rate, before the study was
  declared;
* ``--arms training`` (packed, seed 200, the study's drafter and lr): how far τ real goes with more training than the
  study's 8 epochs (16, 32), or with more anchors a sample, at the cost in time of each.

    python benchmarks/study_sizing.py --arms drafter --runs-dir DIR            # run the arms (a complete run is reused)
    python benchmarks/study_sizing.py --arms training --runs-dir DIR --write   # also replace its section of RESULTS.md

The study's data, features and τ real continuations come from the batchlab cache (built by the first run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from results_file import cpu_model, write_section  # noqa: E402

#: per set of arms: its section's title, the overrides every arm shares, each arm's own, and what the section says of them
ARM_SETS = {
    "drafter": (
        "## Sizing the real-model study (SmolLM2 × ShareGPT: drafter settings on the validation rows)",
        ["experiment=study_real", "strategy=sorted", "seed=200", "eval.split=validation", "logger=none",
         "trainer.progress=false", "trainer.stop_epochs=6"],
        {  # blocks of 8 with DFlash's decay for them, 4; or of 4 with a decay of 2; the lr
            "block 8, lr 1e-3": ["drafter.block_size=8", "drafter.loss_decay_gamma=null", "optim.lr=1e-3"],
            "block 8, lr 2e-3": ["drafter.block_size=8", "drafter.loss_decay_gamma=null", "optim.lr=2e-3"],
            "block 8, lr 4e-3": ["drafter.block_size=8", "drafter.loss_decay_gamma=null", "optim.lr=4e-3"],
            "block 8, lr 1e-2": ["drafter.block_size=8", "drafter.loss_decay_gamma=null", "optim.lr=1e-2"],
            "block 4, lr 2e-3": ["drafter.block_size=4", "drafter.loss_decay_gamma=2", "optim.lr=2e-3"],
        },
        "Each arm is one run of `{base}` with the arm's drafter block size, loss decay and learning rate "
        "(its weights depend on the block size: compare validation losses within a block size).",
    ),
    "training": (
        "## How far τ real goes with training (SmolLM2 × ShareGPT: the study's drafter on the validation rows)",
        ["experiment=study_real", "strategy=packed", "seed=200", "eval.split=validation", "logger=none",
         "trainer.progress=false", "eval.every_tokens=700000"],
        {
            "8 epochs (the study's)": [],
            "16 epochs": ["trainer.stop_epochs=16"],
            "32 epochs": ["trainer.stop_epochs=32"],
            "8 epochs, 48 anchors a sample": ["drafter.num_anchors=48"],
        },
        "Each arm is one run of `{base}` (the study's drafter, lr and schedule, which stretches over the run's "
        "tokens) with the arm's epochs or anchors a sample (16 in the study).",
    ),
}


def arm_dir(runs_dir: Path, name: str) -> Path:
    return runs_dir / name.replace(", ", "-").replace(" ", "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", choices=sorted(ARM_SETS), default="drafter", help="which set of arms to run")
    parser.add_argument("--runs-dir", required=True, type=Path, help="the arms' run directories (reused when complete)")
    parser.add_argument("--write", action="store_true", help="replace this set's section of RESULTS.md")
    args = parser.parse_args()
    from harness.train.config import compose_run_config
    from harness.train.launch.run import run

    title, base, arms, says = ARM_SETS[args.arms]
    rows = []
    for name, overrides in arms.items():
        directory = arm_dir(args.runs_dir, name)
        summary = run(compose_run_config([*base, *overrides]), directory)
        evals = [r for r in map(json.loads, (directory / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
        last = evals[-1]
        rows.append(f"| {name} | {summary['train_time_s']:.0f} | {last['eval_loss']:.3f} | "
                    f"{last['eval_tau']:.3f} | {last['eval_tau_real']:.3f} | {last['eval_accuracy_per_position'][0]:.0%} | "
                    f"{last['eval_draft_vocab_miss_rate']:.1%} |")
        print(rows[-1], flush=True)
    section = (
        f"{title}\n\nCommand: `python benchmarks/study_sizing.py --arms {args.arms} --runs-dir DIR --write` · machine: "
        f"{cpu_model()}, {os.cpu_count()} cores, shared · date: {datetime.date.today().isoformat()}.\n\n"
        + says.format(base=" ".join(base)) + f" {summary['train_samples']} training rows, "
        f"{summary['epoch_tokens']:,} tokens an epoch; {summary['validation_samples']} validation rows. The run's "
        "training seconds (its steps alone; the arms ran one at a time), then the last evaluation: validation loss per "
        "block, τ and τ real (against SmolLM2's greedy continuations of "
        f"{summary['eval_real_prompts']} validation prompts), the first drafted slot's accuracy and the share of "
        "labels outside the 8,192-token draft vocabulary.\n\n"
        "| arm | train s | validation loss | τ | τ real | slot-1 accuracy | draft-vocab misses |\n"
        "|---|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n")
    print(section)
    if args.write:
        write_section(section, title)


if __name__ == "__main__":
    main()
