"""batchlab-advise against reality: predicted real tokens/s per strategy, then the real batchlab-train runs.

The settings are the training throughput benchmark's (the embedded default data, tiny target and drafter, its
budget, 2 gloo ranks, 200,000 real tokens a run). The calibration is measured first (not from the cache) by as
many processes as the run has ranks, together, each with its share of the cores and the gradients' all-reduce
in its step; the prediction is made from it and the run's own training lengths, then every
strategy trains for real, rounds interleaved; the table gives predicted and measured (median over rounds)
real tokens/s, the error, and both rankings. Goal: every strategy within ±10 %, the same ranking.

    python benchmarks/advise_accuracy.py            # print the table
    python benchmarks/advise_accuracy.py --write    # also rewrite its section of RESULTS.md
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

TITLE = "## batchlab-advise: predicted against measured throughput (CPU)"
GOAL = 0.10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default=None, help="comma-separated (default: every registered strategy)")
    parser.add_argument("--tokens", type=int, default=200_000, help="real tokens per run")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="rewrite this benchmark's section of RESULTS.md")
    args = parser.parse_args()

    from harness.advise.calibrate import calibrate
    from harness.advise.predict import predict
    from harness.data.config import DataConfig
    from harness.data.samples import load_samples
    from harness.train.config import compose_run_config as compose
    from harness.train.config import run_config_from_dict
    from harness.train.epoch_data import select_rows
    from harness.train.run import run
    from strategies import report_order

    strategies = args.strategies.split(",") if args.strategies else report_order()
    started = time.time()
    config_dict = compose(["logger=none", "trainer.progress=false"])
    config = run_config_from_dict(config_dict)
    samples = load_samples(config.data, progress=False)
    selection = select_rows(config, samples)
    lengths = samples.lengths[selection.train_rows].clip(max=config.trainer.max_tokens)
    with tempfile.TemporaryDirectory() as scratch:
        calibration, _ = calibrate(config_dict, Path(scratch), progress=True, local_ranks=args.nproc)
    calibrated = time.time() - started
    predicted = {p.strategy: p for p in predict(lengths, strategies, calibration, world_size=args.nproc,
                                                grad_accum=config.trainer.grad_accum,
                                                step_tokens=config.trainer.step_tokens, seed=config.seed)}
    measured: dict[str, list[float]] = {s: [] for s in strategies}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for strategy in strategies if round_index % 2 == 0 else strategies[::-1]:
                overrides = [f"strategy={strategy}", f"trainer.nproc={args.nproc}", "logger=none",
                             "trainer.progress=false", f"trainer.stop_tokens={args.tokens}",
                             f"trainer.eval_every_tokens={args.tokens}"]
                summary = run(compose(overrides), Path(scratch) / f"{strategy}-{round_index}")
                measured[strategy].append(summary["tokens_per_second"])
                print(f"round {round_index} {strategy}: measured {summary['tokens_per_second']:,.0f} tok/s, "
                      f"predicted {predicted[strategy].tokens_per_second:,.0f}", flush=True)
    elapsed = time.time() - started
    median = {s: statistics.median(v) for s, v in measured.items()}
    errors = {s: predicted[s].tokens_per_second / median[s] - 1 for s in strategies}
    rank_predicted = sorted(strategies, key=lambda s: -predicted[s].tokens_per_second)
    rank_measured = sorted(strategies, key=lambda s: -median[s])
    rows = [f"| {s} | {predicted[s].tokens_per_second:,.0f} | {median[s]:,.0f} | "
            f"{', '.join(f'{v:,.0f}' for v in measured[s])} | {100 * errors[s]:+.1f}% | "
            f"{'PASS' if abs(errors[s]) <= GOAL else 'FAIL'} |" for s in strategies]
    worst = max(abs(e) for e in errors.values())
    section = (
        f"{TITLE}\n\n"
        f"Command: `python benchmarks/advise_accuracy.py --write` (tokens={args.tokens}, nproc={args.nproc}, "
        f"rounds={args.rounds}). Machine: {cpu_model()}, {os.cpu_count()} cores, shared. Date: "
        f"{datetime.date.today().isoformat()}. Calibration {calibrated:.0f} s (worst fit error "
        f"{100 * calibration.worst_error():.0f}% over {len(calibration.shapes)} shapes: a={calibration.a:.3g} s/slot, "
        f"b={calibration.b:.3g} s/len², c={calibration.c:.3g} s/block, {1e3 * calibration.micro_batch_s:.1f} ms a "
        f"micro-batch, {1e3 * calibration.step_s:.1f} ms a step, each rank with its share of the cores); "
        f"all took {elapsed / 60:.1f} min.\n\n"
        "The training throughput benchmark's settings (embedded default data, tiny target and drafter, "
        f"max_tokens={config.trainer.max_tokens}, {args.nproc} gloo ranks); predicted from the run's own training "
        "lengths and plans (epoch 0), measured as the run's `tokens_per_second` (median over rounds).\n\n"
        "| strategy | predicted real tok/s | measured (median) | measured per round | error | within ±10% |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        f"- worst error {100 * worst:.1f}% — {'PASS' if worst <= GOAL else 'FAIL'} (goal ±{100 * GOAL:.0f}%)\n"
        f"- ranking predicted: {' > '.join(rank_predicted)}; measured: {' > '.join(rank_measured)} — "
        f"{'the same' if rank_predicted == rank_measured else 'different'}\n"
    )
    print(section)
    if args.write:
        write_section(section, TITLE)


if __name__ == "__main__":
    main()
