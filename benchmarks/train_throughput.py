"""Training throughput per strategy: the real batchlab-train run, same data, tokens, budget and ranks.

Every strategy trains the tiny drafter on the tiny target over the embedded default data for the same
number of tokens, on 2 gloo ranks, side by side in one invocation; rounds interleave the strategies so
that the shared machine's load drifts over all of them alike. Reported per strategy (medians over
rounds): real tokens/s and its ratio to ``sorted``, padding ratio, data-wait share of step time, peak
memory per rank, final held-out loss and τ.

    python benchmarks/train_throughput.py              # print the table
    python benchmarks/train_throughput.py --write      # also rewrite its section of RESULTS.md
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

from results_file import cpu_model, write_section  # noqa: E402

TITLE = "## Training throughput per strategy (CPU, batchlab-train)"
GOALS = {"packed": 1.0, "bucketed": 0.92}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default=None, help="comma-separated (default: every registered strategy)")
    parser.add_argument("--tokens", type=int, default=200_000, help="real tokens per run")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--num-workers", default="null", help="DataLoader workers per rank (null: the default)")
    parser.add_argument("--write", action="store_true", help="rewrite this benchmark's section of RESULTS.md")
    args = parser.parse_args()

    from harness.train.config import compose_run_config as compose
    from harness.train.launch.run import run

    from strategies import report_order

    strategies = args.strategies.split(",") if args.strategies else report_order()
    results: dict[str, list[dict]] = {s: [] for s in strategies}
    started = time.time()
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            order = strategies if round_index % 2 == 0 else strategies[::-1]
            for strategy in order:
                overrides = [f"strategy={strategy}", f"trainer.nproc={args.nproc}", "logger=none",
                             "trainer.progress=false", f"trainer.stop_tokens={args.tokens}",
                             f"eval.every_tokens={args.tokens}", f"loader.num_workers={args.num_workers}"]
                summary = run(compose(overrides), Path(scratch) / f"{strategy}-{round_index}")
                results[strategy].append(summary)
                print(f"round {round_index} {strategy}: {summary['tokens_per_second']:.0f} tok/s", flush=True)
        config = compose([])
    elapsed = time.time() - started

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


if __name__ == "__main__":
    main()
