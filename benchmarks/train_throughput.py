"""Training throughput per strategy: the real batchlab-train run, same data, tokens, budget and ranks.

Every strategy trains the tiny drafter on the tiny target over the embedded default data for the same
number of tokens, on 2 gloo ranks, side by side in one invocation; rounds interleave the strategies so
that the shared machine's load drifts over all of them alike. Reported per strategy (medians over
rounds): real tokens/s and its ratio to ``sorted``, padding ratio, data-wait share of step time, peak
memory per rank, final held-out loss and τ.

    python benchmarks/train_throughput.py              # print the table
    python benchmarks/train_throughput.py --write      # also rewrite its section of RESULTS.md
    python benchmarks/train_throughput.py --experiment strategies --nproc 1 --write   # the main job's design

With ``--experiment strategies`` the runs take the main job's settings (its shipped target and data, equal-token
steps, its ranks) with the target online (the main job reads cached features, which time the drafter alone), and
write their own section: the source of the main job's throughput ratios (docs/results/main-job.md), each with a 95%
t interval over rounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import pandas as pd  # noqa: E402
from results_file import cpu_model, write_section  # noqa: E402

from analysis.answer import ratio_interval  # noqa: E402

TITLE = "## Training throughput per strategy (CPU, batchlab-train)"
MAIN_JOB_TITLE = "## Throughput of the main job's design per strategy (CPU, target online, interleaved rounds)"
GOALS = {"packed": 1.0, "bucketed": 0.92}
#: where --experiment strategies --write stores its rounds (make demo's report reads them)
ROUNDS_CSV = REPO / "docs" / "demo" / "throughput_rounds.csv"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default=None, help="comma-separated (default: every registered strategy)")
    parser.add_argument("--tokens", type=int, default=200_000, help="real tokens per run")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--num-workers", default="null", help="DataLoader workers per rank (null: the default)")
    parser.add_argument("--experiment", default=None,
                        help="an experiment's settings (e.g. strategies: the main job's), with the target online")
    parser.add_argument("--write", action="store_true", help="rewrite this benchmark's section of RESULTS.md")
    args = parser.parse_args()

    from harness.train.config import compose_run_config as compose
    from harness.train.launch.run import run

    from strategies import report_order

    strategies = args.strategies.split(",") if args.strategies else report_order()
    results: dict[str, list[dict]] = {s: [] for s in strategies}
    started = time.time()
    experiment = ([f"experiment={args.experiment}", "trainer.target_features=online", "trainer.stop_epochs=null",
                   "eval.real_prompts=0"] if args.experiment else [])

    def overrides(strategy: str, tokens: int) -> list[str]:
        return [*experiment, f"strategy={strategy}", f"trainer.nproc={args.nproc}", "logger=none",
                "trainer.progress=false", f"trainer.stop_tokens={tokens}", f"eval.every_tokens={args.tokens}",
                f"loader.num_workers={args.num_workers}"]

    with tempfile.TemporaryDirectory() as scratch:
        if args.experiment:  # one untimed run first: the process's first run pays its one-time costs (imports, caches)
            run(compose(overrides(strategies[0], args.tokens // 4)), Path(scratch) / "warm-up")
        for round_index in range(args.rounds):
            order = strategies if round_index % 2 == 0 else strategies[::-1]
            for strategy in order:
                summary = run(compose(overrides(strategy, args.tokens)), Path(scratch) / f"{strategy}-{round_index}")
                results[strategy].append(summary)
                print(f"round {round_index} {strategy}: {summary['tokens_per_second']:.0f} tok/s", flush=True)
        config = compose([f"experiment={args.experiment}"] if args.experiment else [])
    elapsed = time.time() - started

    if args.experiment:
        write_main_job_section(args, config, strategies, results, elapsed)
        return

    def median(strategy: str, key: str) -> float:
        return statistics.median(s[key] for s in results[strategy])

    reference = median("sorted", "tokens_per_second") if "sorted" in results else float("nan")
    header = ("| strategy | real tok/s | vs sorted | per-round ratios | padding | data wait | peak MB/rank | "
              "held-out loss | held-out τ |\n|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for strategy in strategies:
        ratios = [s["tokens_per_second"] / r["tokens_per_second"] for s, r in zip(results[strategy], results["sorted"])]
        rows.append(
            f"| {strategy} | {median(strategy, 'tokens_per_second'):,.0f} | "
            f"{median(strategy, 'tokens_per_second') / reference:.2f}x | {', '.join(f'{x:.2f}' for x in ratios)} | "
            f"{100 * median(strategy, 'padding_ratio'):.1f}% | {100 * median(strategy, 'data_wait_fraction'):.1f}% | "
            f"{median(strategy, 'peak_memory_mb'):.0f} | {median(strategy, 'eval_loss'):.4f} | "
            f"{median(strategy, 'eval_tau'):.3f} |"
        )
    goals = []
    for strategy, goal in GOALS.items():
        if strategy in results:
            ratio = median(strategy, "tokens_per_second") / reference
            goals.append(f"- `{strategy}` ≥ {goal:.2f}x sorted: {ratio:.2f}x — {'PASS' if ratio >= goal else 'FAIL'}")
    wait = max(median(s, "data_wait_fraction") for s in strategies)
    goals.append(f"- data wait ≤ 5% of step time: worst {100 * wait:.1f}% — {'PASS' if wait <= 0.05 else 'FAIL'}")
    data = config["data"]
    trainer = config["trainer"]
    section = (
        f"{TITLE}\n\n"
        f"Command: `python benchmarks/train_throughput.py --write` (tokens={args.tokens}, nproc={args.nproc}, "
        f"rounds={args.rounds}, num_workers={args.num_workers}). Machine: {cpu_model()}, "
        f"{__import__('os').cpu_count()} cores, shared. Date: {datetime.date.today().isoformat()}. "
        f"Took {elapsed / 60:.1f} min.\n\n"
        f"Each run is the real `batchlab-train` on the embedded default (stdlib definitions, "
        f"max_documents={data['max_documents']}, vocab {data['vocab_size']}), tiny target and drafter, "
        f"max_tokens={trainer['max_tokens']}, {args.tokens:,} real tokens, {args.nproc} gloo ranks; strategies "
        "interleaved over rounds, medians shown. Real tok/s counts training steps only (eval excluded); "
        "the padding ratio is computed slots (rows × longest row) against real tokens — packed rows compute "
        "no padding. Per-round ratios show the machine's noise.\n\n"
        + header + "\n".join(rows) + "\n\n" + "\n".join(goals) + "\n"
    )
    print(section)
    print(json.dumps({s: [r["tokens_per_second"] for r in results[s]] for s in strategies}))
    if args.write:
        write_section(section, TITLE)


def write_main_job_section(args, config: dict, strategies: list[str], results: dict, elapsed: float) -> None:
    rows = ["| strategy | real tok/s (median) | × sorted, mean over rounds [95% interval] | per-round ratios | "
            "padding |", "|---|---|---|---|---|"]
    for strategy in strategies:
        ratios = [s["tokens_per_second"] / r["tokens_per_second"] for s, r in zip(results[strategy], results["sorted"])]
        mean, (low, high) = ratio_interval(ratios)
        speed = statistics.median(s["tokens_per_second"] for s in results[strategy])
        padding = statistics.median(s["padding_ratio"] for s in results[strategy])
        rows.append(f"| {strategy} | {speed:,.0f} | {mean:.2f} [{low:.2f}, {high:.2f}] | "
                    f"{', '.join(f'{x:.2f}' for x in ratios)} | {100 * padding:.1f}% |")
    data, trainer = config["data"], config["trainer"]
    section = (
        f"{MAIN_JOB_TITLE}\n\n"
        f"Command: `python benchmarks/train_throughput.py --experiment {args.experiment} --nproc {args.nproc} "
        f"--write` (tokens={args.tokens}, rounds={args.rounds}). Machine: {cpu_model()}, "
        f"{__import__('os').cpu_count()} cores, shared. Date: {datetime.date.today().isoformat()}. "
        f"Took {elapsed / 60:.1f} min.\n\n"
        f"The main job's settings (`experiment={args.experiment}`: data.source={data['source']}, equal-token steps of "
        f"{trainer['step_tokens']:,} real tokens, max_tokens={trainer['max_tokens']}) with the target online "
        f"(`trainer.target_features=online`; the main job reads cached features, which time the drafter alone), "
        f"{args.tokens:,} real tokens a run on {args.nproc} rank(s), strategies interleaved over {args.rounds} rounds "
        "(the order reversed every other round) after one untimed warm-up run. The ratio is each round's tokens/s over the same round's sorted run; "
        "its interval is a t interval over rounds. The padding (computed slots against real tokens) is "
        "deterministic: the cost each strategy's batches carry whatever the machine.\n\n" + "\n".join(rows) + "\n"
    )
    print(section)
    if args.write:
        write_section(section, MAIN_JOB_TITLE)
        # the rounds themselves, which batchlab-report's summary reads for its throughput sentence (make demo)
        ROUNDS_CSV.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame([{"round": index, "strategy": strategy, "tokens_per_second": summary["tokens_per_second"],
                       "padding_ratio": summary["padding_ratio"]}
                      for strategy in strategies for index, summary in enumerate(results[strategy])]
                     ).to_csv(ROUNDS_CSV, index=False)
        print(f"wrote {ROUNDS_CSV}")


if __name__ == "__main__":
    main()
