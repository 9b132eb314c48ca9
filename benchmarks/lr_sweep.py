"""The main job's learning rate, chosen alike for every strategy: a grid of learning rates at the demo's budget.

Every strategy trains with the main job's settings (``experiment=strategies``: regenerated completions,
equal-token steps, the same tokens) at every learning rate of the grid, seed 0; the learning rate with the
lowest held-out loss *averaged over the strategies* is the one the main job uses — never a learning rate per
strategy. The table also shows each learning rate's ranking of the strategies, so a reader sees whether a
conclusion would change with the learning rate, and the share of steps whose gradient was clipped.

    python benchmarks/lr_sweep.py                        # print the table
    python benchmarks/lr_sweep.py --write                # also rewrite its section of RESULTS.md
    python benchmarks/lr_sweep.py --lrs 3e-3,6e-3,1.2e-2 # another grid
    python benchmarks/lr_sweep.py --runs-dir DIR         # keep the runs (and reuse them when rerun)
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from results_file import cpu_model, stop_words, write_section  # noqa: E402

TITLE = "## Learning rate of the main job (lr sweep, every strategy alike)"
METRICS = (("eval_loss", "held-out loss", "{:.3f}"), ("eval_tau", "τ", "{:.2f}"),
           ("eval_tau_real", "τ real", "{:.2f}"), ("clip_fraction", "clipped", "{:.0%}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lrs", default="5e-3,1e-2,2e-2,4e-2", help="comma-separated learning rates")
    parser.add_argument("--strategies", default=None, help="comma-separated (default: every registered strategy)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs-dir", default=None,
                        help="keep the runs here (a complete run found there is reused, so a grid can be extended); "
                             "default: a temporary directory")
    parser.add_argument("--write", action="store_true", help="rewrite this benchmark's section of RESULTS.md")
    args = parser.parse_args()

    from harness.train.config import compose_run_config as compose
    from harness.train.launch.run import run

    from strategies import report_order

    lrs = sorted(float(v) for v in args.lrs.split(","))
    strategies = args.strategies.split(",") if args.strategies else report_order()
    results: dict[tuple[float, str], dict] = {}
    reused = 0
    started = time.time()
    with tempfile.TemporaryDirectory() as temporary:
        scratch = args.runs_dir or temporary
        for lr in sorted(lrs, reverse=True):  # the largest first: a grid that must grow usually grows upwards
            for strategy in strategies:
                overrides = ["experiment=strategies", f"strategy={strategy}", f"seed={args.seed}", f"optim.lr={lr}",
                             "logger=none", "trainer.progress=false"]
                run_dir = Path(scratch) / f"{strategy}-{lr}"
                reused += (run_dir / "summary.json").exists()
                summary = run(compose(overrides), run_dir)
                results[lr, strategy] = summary
                print(f"lr {lr:g} {strategy}: held-out loss {summary['eval_loss']:.3f}, τ real "
                      f"{summary['eval_tau_real']:.2f}, clipped {summary['clip_fraction']:.0%}", flush=True)
        config = compose(["experiment=strategies"])
    elapsed = time.time() - started

    mean_loss = {lr: statistics.mean(results[lr, s]["eval_loss"] for s in strategies) for lr in lrs}
    chosen = min(lrs, key=mean_loss.get)
    lines = [f"| lr | mean held-out loss | ranking by held-out loss (best first) | "
             + " | ".join(strategies) + " |",
             "|---|---|---|" + "---|" * len(strategies)]
    for lr in lrs:
        ranking = sorted(strategies, key=lambda s: results[lr, s]["eval_loss"])
        cells = [" / ".join(fmt.format(results[lr, s][key]) for key, _, fmt in METRICS) for s in strategies]
        mark = " (chosen)" if lr == chosen else ""
        lines.append(f"| {lr:g}{mark} | {mean_loss[lr]:.3f} | {' < '.join(ranking)} | " + " | ".join(cells) + " |")
    flips = [f"{a} and {b}" for i, a in enumerate(strategies) for b in strategies[i + 1:]
             if len({results[lr, a]["eval_loss"] < results[lr, b]["eval_loss"] for lr in lrs}) > 1]
    ranking_sentence = ("is the same at every learning rate." if not flips else
                        f"changes with the learning rate for {', '.join(flips)} (their order flips within the grid); "
                        "every other pair keeps its order at every learning rate.")
    trainer, optim = config["trainer"], config["optim"]
    section = (
        f"{TITLE}\n\n"
        f"Command: `python benchmarks/lr_sweep.py --write` (lrs={args.lrs}, seed={args.seed}). Machine: "
        f"{cpu_model()}, {__import__('os').cpu_count()} cores, shared. Date: {datetime.date.today().isoformat()}. "
        f"Took {elapsed / 60:.1f} min"
        + (f" ({reused} of {len(results)} runs reused from --runs-dir, each {sum(r['wall_time_s'] for r in results.values()) / len(results):.0f} s of training wall time)" if reused else "")
        + ".\n\n"
        f"Each cell is one run of the main job's settings (`experiment=strategies`: regenerated completions, "
        f"step_tokens={trainer['step_tokens']}, "
        + stop_words(trainer) + ", warmup "
        f"{optim['warmup_fraction']:.0%}, clip {optim['grad_clip']:g}) at that learning rate: held-out loss / "
        f"τ / τ real / share of clipped steps. The learning rate with the lowest mean held-out loss over the "
        f"strategies is chosen for all of them: **{chosen:g}**. The ranking of the strategies "
        + ranking_sentence + "\n\n" + "\n".join(lines) + "\n"
    )
    print(section)
    if args.write:
        write_section(section, TITLE)


if __name__ == "__main__":
    main()
