"""The main job's learning rate, chosen without the test: a bracketed grid, on the validation split, on seeds the
main job does not use.

sorted and packed (by default; ``--strategies``) train with the main job's settings (``experiment=strategies``:
regenerated completions, equal-token steps, the same tokens, the same training rows) at every learning rate of
the grid and every tuning seed (default 200, 201: neither the pilot's 0–2 nor the confirmatory 100–107), and
are evaluated on the *validation* rows (``eval.split=validation``: ``data.validation_fraction`` of the training
rows, set aside in the main job too, never trained on), never on the held-out test rows. The learning rate with
the lowest validation loss averaged over strategies and seeds is the main job's, for every strategy — unless it
sits at the grid's edge, which the table says (extend the grid then). Each strategy's own best learning rate is
listed too: the secondary comparison of the main job (each strategy at its own best lr) reads it.

    python benchmarks/lr_sweep.py                        # print the table
    python benchmarks/lr_sweep.py --write                # also rewrite its section of RESULTS.md
    python benchmarks/lr_sweep.py --lrs 1e-2,2e-2,4e-2   # another grid
    python benchmarks/lr_sweep.py --runs-dir DIR         # keep the runs (and reuse them when rerun)
    python benchmarks/lr_sweep.py --experiment study_real --write   # the real-model study's lr (its own section)
    python benchmarks/lr_sweep.py --runs-csv FILE        # every run's validation numbers, to recompute the choice

The committed ``--runs-csv`` files (``docs/*/lr_sweep_runs.csv``) are what tests recompute each chosen lr from
(:func:`chosen_lr` over :func:`mean_losses`).
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

from results_file import cpu_model, stop_words, write_section  # noqa: E402

TITLE = "## Learning rate of the main job (lr sweep on the validation split, own seeds)"
METRICS = (("eval_loss", "validation loss", "{:.3f}"), ("eval_tau_real", "τ real", "{:.2f}"),
           ("clip_fraction", "clipped", "{:.0%}"))
#: the sections of the other sweeps (--experiment)
TITLES = {"study_real": "## Learning rate of the real-model study (SmolLM2 × ShareGPT; lr sweep on the validation split, "
                        "own seeds)"}
#: the tuning seeds: none of the main job's (pilot 0-2, confirmatory 100-107)
TUNING_SEEDS = "200,201"


def chosen_lr(mean_loss: dict[float, float]) -> tuple[float, bool]:
    """The learning rate of the lowest mean validation loss, and whether it lies inside the grid (not at an edge)."""
    lrs = sorted(mean_loss)
    best = min(lrs, key=mean_loss.get)
    return best, lrs[0] < best < lrs[-1]


#: the columns of --runs-csv: one row per run of the sweep
RUN_COLUMNS = ("experiment", "lr", "strategy", "seed", "eval_loss", "eval_tau_real", "clip_fraction", "data_fingerprint")


def mean_losses(rows: list[dict]) -> dict[float, float]:
    """The mean validation loss of each learning rate: over the seeds of each strategy, then over the strategies (the
    table's second column)."""
    by_lr: dict[float, dict[str, list[float]]] = {}
    for row in rows:
        by_lr.setdefault(float(row["lr"]), {}).setdefault(row["strategy"], []).append(float(row["eval_loss"]))
    return {lr: statistics.mean(statistics.mean(losses) for losses in strategies.values())
            for lr, strategies in by_lr.items()}


def write_runs_csv(path: Path, experiment: str, results: dict[tuple[float, str, int], dict]) -> None:
    """Every run's validation numbers (:data:`RUN_COLUMNS`), in the sweep's order of lr, strategy, seed."""
    import csv

    with Path(path).open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=RUN_COLUMNS)
        writer.writeheader()
        for (lr, strategy, seed), summary in sorted(results.items()):
            writer.writerow({"experiment": experiment, "lr": repr(lr), "strategy": strategy, "seed": seed,
                             **{key: (repr(summary[key]) if isinstance(summary[key], float) else summary[key])
                                for key in RUN_COLUMNS[4:]}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default="strategies",
                        help="the sweep whose settings the runs take (conf/experiment/NAME.yaml): strategies (the main "
                             "job, default) or study_real (SmolLM2 x ShareGPT); each has its own section of RESULTS.md")
    parser.add_argument("--lrs", default="1e-2,2e-2,4e-2,8e-2", help="comma-separated learning rates")
    parser.add_argument("--strategies", default="sorted,packed", help="comma-separated strategies")
    parser.add_argument("--seeds", default=TUNING_SEEDS, help="comma-separated tuning seeds")
    parser.add_argument("--runs-dir", default=None,
                        help="keep the runs here (a complete run found there is reused, so a grid can be extended); "
                             "default: a temporary directory")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra override for every run (repeatable), e.g. trainer.target_features=online to "
                             "extend a grid whose runs computed the target online (the same training: the cache is "
                             "tested to train exactly as the online target)")
    parser.add_argument("--runs-csv", type=Path, default=None,
                        help="also write every run's validation numbers here (commit it: tests recompute the chosen "
                             "lr from it)")
    parser.add_argument("--write", action="store_true", help="rewrite this benchmark's section of RESULTS.md")
    args = parser.parse_args()

    from harness.train.config import compose_run_config as compose
    from harness.train.launch.run import run

    lrs = sorted(float(v) for v in args.lrs.split(","))
    strategies = args.strategies.split(",")
    seeds = [int(v) for v in args.seeds.split(",")]
    results: dict[tuple[float, str, int], dict] = {}
    reused = 0
    started = time.time()
    with tempfile.TemporaryDirectory() as temporary:
        scratch = args.runs_dir or temporary
        for seed in seeds:  # seeds outermost, then the largest lr first
            for lr in sorted(lrs, reverse=True):
                for strategy in strategies:
                    overrides = [f"experiment={args.experiment}", f"strategy={strategy}", f"seed={seed}", f"optim.lr={lr}",
                                 "eval.split=validation", "logger=none", "trainer.progress=false", *args.override]
                    run_dir = Path(scratch) / (f"{strategy}-{lr}-s{seed}" if args.experiment == "strategies"
                                               else f"{args.experiment}-{strategy}-{lr}-s{seed}")
                    reused += (run_dir / "summary.json").exists()
                    summary = run(compose(overrides), run_dir)
                    assert summary["eval_split"] == "validation"
                    results[lr, strategy, seed] = summary
                    print(f"seed {seed} lr {lr:g} {strategy}: validation loss {summary['eval_loss']:.3f}, τ real "
                          f"{summary['eval_tau_real']:.2f}, clipped {summary['clip_fraction']:.0%}", flush=True)
        config = compose([f"experiment={args.experiment}"])
    elapsed = time.time() - started

    def mean(lr: float, strategy: str, key: str) -> float:
        return statistics.mean(results[lr, strategy, seed][key] for seed in seeds)

    mean_loss = mean_losses([{"lr": lr, "strategy": strategy, "eval_loss": summary["eval_loss"]}
                             for (lr, strategy, _), summary in results.items()])
    chosen, inside = chosen_lr(mean_loss)
    own_best = {s: chosen_lr({lr: mean(lr, s, "eval_loss") for lr in lrs}) for s in strategies}
    lines = ["| lr | mean validation loss | " + " | ".join(strategies) + " |", "|---|---|" + "---|" * len(strategies)]
    for lr in lrs:
        cells = [" / ".join(fmt.format(mean(lr, s, key)) for key, _, fmt in METRICS) for s in strategies]
        mark = " (chosen)" if lr == chosen else ""
        lines.append(f"| {lr:g}{mark} | {mean_loss[lr]:.3f} | " + " | ".join(cells) + " |")
    verdict = (f"**{chosen:g}**, inside the grid (a worse learning rate on each side)" if inside else
               f"{chosen:g}, at the grid's edge: extend the grid (`--lrs`) before using it")
    own = "; ".join(f"{s} {best:g}" + ("" if ok else " (at the edge)") for s, (best, ok) in own_best.items())
    trainer, optim, data = config["trainer"], config["optim"], config["data"]
    title = TITLE if args.experiment == "strategies" else TITLES[args.experiment]
    section = (
        f"{title}\n\n"
        f"Command: `python benchmarks/lr_sweep.py --write` (experiment={args.experiment}, lrs={args.lrs}, "
        f"strategies={args.strategies}, "
        f"seeds={args.seeds}" + "".join(f", --override {o}" for o in args.override)
        + f"). Machine: {cpu_model()}, {os.cpu_count()} cores, shared. Date: "
        f"{datetime.date.today().isoformat()}. Took {elapsed / 60:.1f} min"
        + (f" ({reused} of {len(results)} runs reused from --runs-dir)" if reused else "") + ".\n\n"
        f"Each cell is the mean over the tuning seeds of runs of the sweep's settings (`experiment={args.experiment}`: "
        f"regenerated completions, step_tokens={trainer['step_tokens']}, " + stop_words(trainer)
        + f", warmup {optim['warmup_fraction']:.0%}, clip {optim['grad_clip']:g}) at that learning rate, evaluated on "
        f"the validation split (data.validation_fraction={data['validation_fraction']:g} of the training rows, held "
        f"out of every run of the sweep; never the test rows): validation loss / τ real / share of clipped steps. "
        f"The learning rate of the lowest mean validation loss over strategies and seeds is the sweep's, for "
        f"every strategy: {verdict}. Each strategy's own best: {own}.\n\n" + "\n".join(lines) + "\n"
    )
    print(section)
    if args.runs_csv is not None:
        write_runs_csv(args.runs_csv, args.experiment, results)
        section += f"\nEvery run's numbers: `{args.runs_csv}` (tests recompute the chosen lr from it).\n"
    if args.write:
        write_section(section, title)


if __name__ == "__main__":
    main()
