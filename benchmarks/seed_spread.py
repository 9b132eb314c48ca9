"""Which settings of the main job make its verdicts reachable: the seed-to-seed spread of the validation loss.

The planned contrasts are paired by seed, so the number of seeds a contrast needs grows with the variance of the
paired difference (sd² / effect²). This pilot trains the main job (``experiment=strategies``) under a few arms
(each a list of overrides: longer training, a schedule that ends at zero, another learning rate) on tuning seeds
(default 200-202: never the pilot's 0-2 nor the confirmatory 100-107), evaluates on the *validation* rows
(``eval.split=validation``, never the test rows) and prints, per arm, each strategy's mean ± sd and the sd of
each paired difference against ``--reference``. It chooses nothing: a design change it motivates is written in
the experiment's config and the pre-registration, then the lr is tuned again (benchmarks/lr_sweep.py).

    python benchmarks/seed_spread.py --arms "now:;zero_end:optim.min_lr_ratio=0"           # print the table
    python benchmarks/seed_spread.py ... --runs-dir DIR --write                              # keep runs, record
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from results_file import cpu_model, write_section  # noqa: E402

TITLE = "## Seed spread of the main job by setting (design pilot, validation split, tuning seeds)"
TUNING_SEEDS = "200,201,202"


def parse_arms(text: str) -> dict[str, list[str]]:
    """``"name:ov1,ov2;name2:"`` → ``{name: [ov1, ov2], name2: []}`` (an arm with no override is the main job)."""
    arms: dict[str, list[str]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, overrides = part.partition(":")
        if not name or name in arms:
            raise SystemExit(f"--arms: {part!r} needs a new name before its ':' (names so far: {sorted(arms)})")
        arms[name] = [o.strip() for o in overrides.split(",") if o.strip()]
    if not arms:
        raise SystemExit("--arms: give at least one arm, e.g. 'now:'")
    return arms


def spread_rows(results: dict[tuple[str, str, int], float], arms: list[str], strategies: list[str],
                seeds: list[int], reference: str) -> list[str]:
    """Markdown rows: per arm and strategy, mean ± sd over seeds, and the sd of the paired difference
    (strategy − reference, by seed) with the seeds a two-sided paired t-test at α 0.05 and 80% power would need
    to detect that arm's mean difference (normal approximation, ``(1.96 + 0.84)² sd² / d²``)."""
    rows = []
    for arm in arms:
        for strategy in strategies:
            values = [results[arm, strategy, seed] for seed in seeds]
            cells = [f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"]
            if strategy == reference:
                cells += ["—", "—", "—"]
            else:
                differences = [results[arm, strategy, s] - results[arm, reference, s] for s in seeds]
                mean, sd = statistics.mean(differences), statistics.stdev(differences)
                needed = (1.96 + 0.84) ** 2 * sd ** 2 / mean ** 2 if mean else float("inf")
                cells += [f"{mean:+.3f}", f"{sd:.3f}", f"{needed:.0f}" if needed < 1000 else "> 1000"]
            rows.append(f"| {arm} | {strategy} | " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", default="now:", help="';'-separated arms, each 'name:override,override'")
    parser.add_argument("--strategies", default="sorted,bucketed,packed,shuffle", help="comma-separated")
    parser.add_argument("--reference", default="packed", help="the strategy each paired difference is against")
    parser.add_argument("--seeds", default=TUNING_SEEDS, help="comma-separated tuning seeds")
    parser.add_argument("--runs-dir", default=None, help="keep the runs here (a complete run found there is reused)")
    parser.add_argument("--write", action="store_true", help="rewrite this benchmark's section of RESULTS.md")
    args = parser.parse_args()

    from harness.train.config import compose_run_config as compose
    from harness.train.launch.run import run

    arms = parse_arms(args.arms)
    strategies, seeds = args.strategies.split(","), [int(v) for v in args.seeds.split(",")]
    if args.reference not in strategies:
        raise SystemExit(f"--reference {args.reference!r} is not among --strategies {strategies}")
    loss: dict[tuple[str, str, int], float] = {}
    tau_real: dict[tuple[str, str, int], float] = {}
    started, reused = time.time(), 0
    with tempfile.TemporaryDirectory() as temporary:
        scratch = Path(args.runs_dir or temporary)
        for seed in seeds:  # seeds outermost, strategies interleaved: a slow spell falls on all alike
            for arm, overrides in arms.items():
                for strategy in strategies:
                    run_dir = scratch / arm / f"{strategy}-s{seed}"
                    reused += (run_dir / "summary.json").exists()
                    summary = run(compose(["experiment=strategies", f"strategy={strategy}", f"seed={seed}",
                                           "eval.split=validation", "logger=none", "trainer.progress=false",
                                           *overrides]), run_dir)
                    assert summary["eval_split"] == "validation"
                    loss[arm, strategy, seed] = summary["eval_loss"]
                    tau_real[arm, strategy, seed] = summary["eval_tau_real"]
                    print(f"seed {seed} {arm} {strategy}: validation loss {summary['eval_loss']:.3f}, τ real "
                          f"{summary['eval_tau_real']:.2f}", flush=True)
    elapsed = time.time() - started
    header = (f"| arm | strategy | validation loss, mean ± sd | − {args.reference}, mean | sd of the paired "
              "difference | seeds for 80% power |\n|---|---|---|---|---|---|")
    section = (
        f"{TITLE}\n\n"
        f"Command: `python benchmarks/seed_spread.py --arms \"{args.arms}\" --strategies {args.strategies} "
        f"--seeds {args.seeds} --write`. Machine: {cpu_model()}, {os.cpu_count()} cores, shared. Date: "
        f"{datetime.date.today().isoformat()}. Took {elapsed / 60:.1f} min"
        + (f" ({reused} of {len(loss)} runs reused from --runs-dir)" if reused else "") + ".\n\n"
        "The main job (`experiment=strategies`) under each arm's overrides, evaluated on the validation rows (never "
        "the test rows) at the end of each run, on tuning seeds. A pilot for the design, not a result: the seeds "
        "a contrast needs scale with the sd of its paired difference squared.\n\n"
        + header + "\n" + "\n".join(spread_rows(loss, list(arms), strategies, seeds, args.reference))
        + "\n\nτ real (validation prompts), mean over seeds:\n\n| arm | " + " | ".join(strategies) + " |\n|---|"
        + "---|" * len(strategies) + "\n" + "\n".join(
            f"| {arm} | " + " | ".join(f"{statistics.mean(tau_real[arm, s, seed] for seed in seeds):.2f}"
                                       for s in strategies) + " |" for arm in arms) + "\n")
    print(section)
    if args.write:
        write_section(section, TITLE)


if __name__ == "__main__":
    main()
