"""Real against teacher-forced acceptance per strategy, from a finished sweep (by default `make demo`'s).

    make demo                                             # multirun/strategies
    python benchmarks/acceptance.py multirun/strategies --write

Teacher-forced τ scores the drafter's blocks against the dataset's tokens at randomly drawn anchors;
real τ (`eval_tau_real`) is the acceptance length greedy speculative decoding of held-out prompts
reaches against the target itself. Both are the final evaluation of each run; mean ± s.d. over seeds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from analysis.load import order_strategies  # noqa: E402
from harness.train.config import moved_into_place  # noqa: E402
from results_file import cpu_model, stop_words, write_section  # noqa: E402

TITLE = "## Real against teacher-forced acceptance per strategy (make demo's sweep)"


def _mean_sd(values: list[float]) -> str:
    if not values:
        return "—"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", nargs="?", default="multirun/strategies")
    parser.add_argument("--write", action="store_true", help="rewrite this section of benchmarks/RESULTS.md")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = defaultdict(list)
    configs = {}
    for path in sorted(Path(args.sweep).glob("*/summary.json")):
        summary = json.loads(path.read_text())
        if summary.get("status") != "complete":
            continue
        runs[summary["strategy"]].append(summary)
        configs[summary["strategy"]] = json.loads((path.parent / "config.json").read_text())
    if not runs:
        raise SystemExit(f"no complete run under {args.sweep}; run `make demo` first")
    config = next(iter(configs.values()))
    rows = []
    for strategy in order_strategies(runs):
        summaries = runs[strategy]
        tau = [s["eval_tau"] for s in summaries if s.get("eval_tau") is not None]
        real = [s["eval_tau_real"] for s in summaries if s.get("eval_tau_real") is not None]
        gap = [s["eval_tau_real"] - s["eval_tau"] for s in summaries
               if s.get("eval_tau_real") is not None and s.get("eval_tau") is not None]
        bound = [s["eval_speedup_bound"] for s in summaries if s.get("eval_speedup_bound") is not None]
        loss = [s["eval_loss"] for s in summaries if s.get("eval_loss") is not None]
        rows.append(f"| {strategy} | {len(summaries)} | {_mean_sd(tau)} | {_mean_sd(real)} | {_mean_sd(gap)} | "
                    f"{_mean_sd(bound)} | {_mean_sd(loss)} |")
    config = moved_into_place(config)  # a sweep from before the eval settings had their own section
    trainer, drafter, target, evaluation = config["trainer"], config["drafter"], config["target"], config["eval"]
    section = (
        f"{TITLE}\n\n"
        f"Command: `make demo` then `python benchmarks/acceptance.py {args.sweep} --write`. Machine: {cpu_model()}. "
        f"Date: {datetime.date.today().isoformat()}.\n\n"
        f"Drafters trained at the demo's budget: target `{target.get('pretrained') or 'random weights'}` "
        f"({target['num_hidden_layers']} layers, hidden {target['hidden_size']}), drafter "
        f"{drafter['num_hidden_layers']} layers, block {drafter['block_size']}, max_tokens {trainer['max_tokens']}, "
        + stop_words(trainer) + f"; real τ from {evaluation['real_prompts']} held-out prompts × "
        f"{evaluation['real_new_tokens']} new tokens. Final evaluation of each run, mean ± s.d. over seeds.\n\n"
        "| strategy | seeds | τ teacher-forced | τ real | real − teacher-forced | speed-up bound | held-out loss |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    print(section)
    if args.write:
        write_section(section, TITLE)


if __name__ == "__main__":
    main()
