"""Placements per strategy: colocated against disaggregated, measured on 3 CPU processes, modelled on 8 GPUs.

1. Measured (CPU, gloo, 3 processes, side by side, rounds interleaved): every strategy trains the tiny
   drafter on the tiny target over the embedded default data for the same number of tokens, once with
   ``topology=colocated`` on 3 ranks and once with ``topology=disaggregated`` (2 target ranks + 1
   drafter rank, ``grad_accum=3``: the same 3 micro-batches per optimizer step). Reported: real
   tokens/s end to end and the ratio, the target ranks' busy fraction, the drafter's idle fraction,
   bytes moved per second, and each colocated rank's target and drafter time per micro-batch.
   Predicted before each strategy's runs of a round (``advise_accuracy.predict_placements``): the stage fits
   calibrated just before them by concurrent ranks, one a core (on 2 cores, the 3 processes are simulated sharing
   them), and the link measured by two at the start of the round, both placements simulated
   (``harness/advise/schedule.py``), each run's tokens/s against its prediction.
2. Modelled (labelled as a model, nothing runs on a GPU): the reference run's shape, the 27B-class
   target and a 5-layer drafter on 8 GPUs, on the ``chat-902k`` lengths at ``max_tokens=16384``.
   Per micro-batch the target stage costs ``a * slots + b * sum(len^2)`` and the drafter stage
   ``c * min(blocks, max_blocks)`` in target-slot units (``strategies.CostModel``'s FLOP estimates;
   ``c = 1.5 + 0.6 * layers`` for the LM head and 5 drafter layers). Colocated on 8 ranks a step lasts
   as long as its slowest rank (target + drafter); disaggregated with T target ranks and 8 - T drafter
   ranks (dynamic dispatch, the drafter ranks at the same global batch) the epoch lasts as long as the
   slower stage: ``max(sum target / T, sum drafter / (8 - T))``. Transfers are left out (a 16K-slot
   micro-batch's 5 tapped layers are ~0.8 GB, a few ms over NVLink).

    python benchmarks/placement.py              # print the tables
    python benchmarks/placement.py --write      # also rewrite its section of RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from results_file import cpu_model, write_section  # noqa: E402
from strategies import report_order  # noqa: E402

TITLE = "## Placements: colocated and disaggregated (CPU measured, 8 GPUs modelled)"
STRATEGIES = tuple(report_order())  # every registered strategy
PLACEMENTS = {
    "colocated": ["topology=colocated", "trainer.nproc=3", "trainer.grad_accum=1"],
    "disaggregated": ["topology=disaggregated", "topology.target_ranks=2", "topology.drafter_ranks=1",
                      "trainer.nproc=3", "trainer.grad_accum=3"],
}
#: the reference run's drafter (conf/experiment/reference_8gpu.yaml): 5 layers, blocks capped per micro-batch
MODEL_DRAFTER_LAYERS = 5
MODEL_MAX_BLOCKS = 512
MODEL_GPUS = 8


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean(values) -> float:
    values = [v for v in values if isinstance(v, (int, float)) and np.isfinite(v)]
    return float(np.mean(values)) if values else float("nan")


def measure(strategies, tokens: int, rounds: int,
            before_run=None) -> dict[tuple[str, str], list[dict]]:
    """Every strategy's runs in both placements, ``rounds`` interleaved rounds; ``before_run(r, strategy)`` runs
    just before each run of round ``r`` (its prediction: ``advise_accuracy.RoundPredictions``)."""
    from harness.train.config import compose_run_config as compose
    from harness.train.launch.run import run

    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(rounds):
            order = [(s, p) for s in strategies for p in PLACEMENTS]
            for strategy, placement in (order if round_index % 2 == 0 else order[::-1]):
                if before_run is not None:
                    before_run(round_index, strategy)
                overrides = [f"strategy={strategy}", *PLACEMENTS[placement], "logger=none", "trainer.progress=false",
                             f"trainer.stop_tokens={tokens}", f"eval.every_tokens={tokens}",
                             "eval.real_prompts=0", "checkpoint.every_steps=100000"]
                run_dir = Path(scratch) / f"{strategy}-{placement}-{round_index}"
                summary = run(compose(overrides), run_dir)
                records = _read_jsonl(run_dir / "metrics.jsonl")
                row = {
                    "tokens_per_second": summary["tokens_per_second"],
                    "target_busy": _mean(summary.get("topology_target_busy_fraction") or []),
                    "drafter_idle": _mean(r.get("topology_drafter_idle_fraction") for r in records),
                    "bytes_per_second": _mean(r.get("topology_bytes_per_second") for r in records),
                    "in_flight_max": summary.get("topology_in_flight_max"),
                    "time_target": _mean(r.get("time_target") for r in records),
                    "time_drafter": _mean(r.get("time_drafter") for r in records),
                }
                results.setdefault((strategy, placement), []).append(row)
                print(f"round {round_index} {strategy} {placement}: {row['tokens_per_second']:.0f} tok/s", flush=True)
    return results


def model_8gpu(strategies) -> list[dict]:
    """Per strategy: modelled 8-GPU throughput of colocated and of every T + (8 - T) split (module docstring), on
    the stage-time model batchlab-advise uses (:mod:`harness.advise.stages`) with the FLOP-estimate costs."""
    from harness.advise.stages import StageCost, colocated_seconds, splits
    from harness.data.profiles import profile_lengths
    from strategies import Budget, CostModel, plan

    lengths = profile_lengths("chat-902k")
    budget = Budget(16384)
    cost = CostModel(c=1.5 + 0.6 * MODEL_DRAFTER_LAYERS, block_size=16, num_anchors=512)
    anchors = dict(block_size=cost.block_size, num_anchors=cost.num_anchors)
    target = StageCost(a=cost.a, b=cost.b, **anchors)
    drafter = StageCost(c=cost.c, max_blocks=MODEL_MAX_BLOCKS, **anchors)
    rows = []
    for strategy in strategies:
        def make_plan(world_size: int, grad_accum: int, strategy=strategy):
            return plan(lengths, budget, strategy, seed=0, epoch=0, world_size=world_size, grad_accum=grad_accum)

        colocated_plan = make_plan(MODEL_GPUS, 1)
        tokens = float(colocated_plan.micro_batch_tokens().sum())
        row = {"strategy": strategy, "colocated": tokens / colocated_seconds(colocated_plan, target, drafter),
               "splits": {}}
        for split in splits(make_plan, MODEL_GPUS, 1, target, drafter):
            row["splits"][split.target_ranks] = {"tokens_per_cost": split.tokens_per_second,
                                                 "target_busy": split.target_busy, "drafter_busy": split.drafter_busy}
        target_work = float(target.micro_batch(colocated_plan).sum())
        drafter_work = float(drafter.micro_batch(colocated_plan).sum())
        row["drafter_share"] = drafter_work / (target_work + drafter_work)
        rows.append(row)
    return rows


def render(measured, modelled, strategies, tokens: int, rounds: int, elapsed: float, command: str,
           predicted: list[dict], methods: list[tuple]) -> str:
    from advise_accuracy import placement_table, prediction_method

    lines = [TITLE, "", f"`{command}` — {datetime.date.today().isoformat()}, {cpu_model()}, {elapsed / 60:.1f} min.", ""]
    lines.append(
        f"**Measured** (CPU, 3 gloo processes, {tokens:,} real tokens a run, {rounds} interleaved rounds, medians): "
        "colocated = 3 ranks each running target and drafter; disaggregated = 2 target ranks + 1 drafter rank "
        "(`grad_accum=3`, the same 3 micro-batches a step). Stage times are a colocated rank's mean per step "
        "(one micro-batch); from them the model column predicts the ratio as the slower stage's rate, "
        "`min(2 / t_target, 1 / t_drafter)` against the colocated `3 / (t_target + t_drafter)`. On 2 cores "
        "the 3 processes share the cores, so the target ranks' busy fraction is time-sliced too."
    )
    lines.append("")
    lines.append("| strategy | colocated tok/s | disaggregated tok/s | disagg / coloc | modelled from stage times | "
                 "target busy | drafter idle | MB/s moved | max in flight | coloc target s / drafter s |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for strategy in strategies:
        co, di = measured[(strategy, "colocated")], measured[(strategy, "disaggregated")]

        def med(rows, key):
            values = [r[key] for r in rows if isinstance(r[key], (int, float)) and np.isfinite(r[key])]
            return statistics.median(values) if values else float("nan")

        # the slower stage bounds the disaggregated job: 2 target ranks share the target work, 1 drafter rank
        # does all of the drafter's; colocated, 3 ranks each do both (transfers and core sharing left out)
        t_target, t_drafter = med(co, "time_target"), med(co, "time_drafter")
        modelled_ratio = min(2 / t_target, 1 / t_drafter) / (3 / (t_target + t_drafter))
        lines.append(
            f"| {strategy} | {med(co, 'tokens_per_second'):,.0f} | {med(di, 'tokens_per_second'):,.0f} | "
            f"{med(di, 'tokens_per_second') / med(co, 'tokens_per_second'):.2f}x | {modelled_ratio:.2f}x | "
            f"{100 * med(di, 'target_busy'):.0f}% | "
            f"{100 * med(di, 'drafter_idle'):.0f}% | {med(di, 'bytes_per_second') / 1e6:.1f} | "
            f"{max(r['in_flight_max'] or 0 for r in di)} | "
            f"{med(co, 'time_target'):.3f} / {med(co, 'time_drafter'):.3f} |"
        )
    lines.append("")
    stages = {s: [(r["target_busy"], r["drafter_idle"]) for r in measured[(s, "disaggregated")]] for s in strategies}
    table, verdict = placement_table(strategies, predicted, {k: [r["tokens_per_second"] for r in v]
                                                            for k, v in measured.items()}, stages, "disaggregated")
    lines += [f"**Predicted against measured** (the same runs, 3 ranks on {os.cpu_count()} cores). "
              + prediction_method(methods), "",
              table, "", verdict, ""]
    lines.append(
        f"**Modelled, not measured**: {MODEL_GPUS} GPUs, the 27B-class target and a {MODEL_DRAFTER_LAYERS}-layer "
        f"drafter (blocks capped at {MODEL_MAX_BLOCKS} a micro-batch), `chat-902k` at `max_tokens=16384`, stage "
        "costs from `strategies.CostModel`'s FLOP estimates (module docstring). Throughput in real tokens per "
        "target-slot cost unit, and relative to colocated; `T+D` = T target ranks and D drafter ranks "
        "(splits with D dividing 8, the drafter ranks at the same global batch)."
    )
    lines.append("")
    splits = sorted({t for row in modelled for t in row["splits"]})
    lines.append("| strategy | drafter share of the work | colocated | " +
                 " | ".join(f"{t}+{MODEL_GPUS - t} (target busy)" for t in splits) + " | best |")
    lines.append("|---|---|---|" + "---|" * len(splits) + "---|")
    for row in modelled:
        cells = []
        for t in splits:
            s = row["splits"][t]
            cells.append(f"{s['tokens_per_cost'] / row['colocated']:.2f}x ({100 * s['target_busy']:.0f}%)")
        best = max(row["splits"].items(), key=lambda kv: kv[1]["tokens_per_cost"])
        best_label = (f"{best[0]}+{MODEL_GPUS - best[0]}" if best[1]["tokens_per_cost"] > row["colocated"]
                      else "colocated")
        lines.append(f"| {row['strategy']} | {100 * row['drafter_share']:.0f}% | {row['colocated']:.3f} (1.00x) | "
                     + " | ".join(cells) + f" | {best_label} |")
    lines.append("")
    lines.append(
        "Reading: a disaggregated split pays off only when its stages balance — the drafter ranks' share of "
        "the GPUs must match the drafter's share of the work; a split whose target busy fraction is far "
        "below 100% is drafter-bound. Calibrate `a, b, c` against measured GPU step times before trusting "
        "the absolute numbers."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--tokens", type=int, default=100_000, help="real tokens per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="rewrite this benchmark's section of RESULTS.md")
    args = parser.parse_args()
    strategies = args.strategies.split(",")
    started = time.time()
    from advise_accuracy import RoundPredictions

    # each run predicted just before it: colocated on 3 ranks and the 2 + 1 split
    predictions = RoundPredictions(["trainer.device=cpu"], 3, 2, args.tokens)
    measured = measure(strategies, args.tokens, args.rounds, predictions.before_run)
    modelled = model_8gpu(strategies)
    command = "python benchmarks/placement.py" + (f" --tokens {args.tokens}" if args.tokens != 100_000 else "") + (
        f" --rounds {args.rounds}" if args.rounds != 2 else "") + (" --write" if args.write else "")
    section = render(measured, modelled, strategies, args.tokens, args.rounds, time.time() - started, command,
                     predictions.predicted, predictions.methods)
    print(section)
    if args.write:
        write_section(section, TITLE)


if __name__ == "__main__":
    main()
