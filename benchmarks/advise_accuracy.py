"""batchlab-advise against reality: predicted real tokens/s per strategy, then the real batchlab-train runs.

The settings are the training throughput benchmark's (the embedded default data, tiny target and drafter, its
budget, 2 gloo ranks, 200,000 real tokens a run). The calibration is measured first (not from the cache) by as
many processes as the run has ranks, together, each with its share of the cores and the gradients' all-reduce
in its step; the prediction is made from it and the run's own training lengths, then every
strategy trains for real, rounds interleaved; the table gives predicted and measured (median over rounds)
real tokens/s, the error, and both rankings. Goal: every strategy within ±10 %, the same ranking.

``--placement``: the disaggregated placement instead (``--split T+D``, default 1 target rank + 1 drafter rank,
one rank a core on 2 cores): the calibration's stage fits, measured by ``T + D`` concurrent ranks (at most one a
core; the simulation shares the cores among the processes computing), measured just before each strategy's
runs, and the link measured by two ranks at the start of each round (:mod:`harness.advise.link`), predict both
placements over each run's first steps, replayed micro-batch by micro-batch (:mod:`harness.advise.schedule`); then
the strategy trains both ways, rounds interleaved. The table gives predicted and measured tokens/s of colocated and
of the split with their errors (goal: the split within ±15%), the ratio of the two, and whether the placements'
measured order is predicted where their rounds do not overlap.

    python benchmarks/advise_accuracy.py                        # print the table
    python benchmarks/advise_accuracy.py --write                # also rewrite its section of RESULTS.md
    python benchmarks/advise_accuracy.py --placement --write    # the placement check, its own section
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
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from results_file import cpu_model, write_section  # noqa: E402

from harness.train.launch.compose import epoch_data_config  # noqa: E402

TITLE = "## batchlab-advise: predicted against measured throughput (CPU)"
CUDA_TITLE = "## batchlab-advise: predicted against measured throughput (CUDA)"
PLACEMENT_TITLE = "## batchlab-advise: predicted against measured placements (CPU)"
GOAL = 0.10


def placements(target_ranks: int, drafter_ranks: int) -> dict[str, list[str]]:
    """Colocated on ``T + D`` ranks against the ``T + D`` split at the same global batch."""
    world = target_ranks + drafter_ranks
    return {"colocated": ["topology=colocated", f"trainer.nproc={world}", "trainer.grad_accum=1"],
            "disaggregated": ["topology=disaggregated", f"topology.target_ranks={target_ranks}",
                              f"topology.drafter_ranks={drafter_ranks}", f"trainer.nproc={world}",
                              f"trainer.grad_accum={world // drafter_ranks}"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default=None, help="comma-separated (default: every registered strategy)")
    parser.add_argument("--tokens", type=int, default=200_000, help="real tokens per run")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: calibrate and train on the GPU(s) (--nproc 1 on one GPU)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--placement", action="store_true", help="check a target+drafter split against colocated")
    parser.add_argument("--split", default="1+1", help="--placement: target ranks + drafter ranks (default 1+1)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a batchlab-train override for the calibration and every run (repeatable), e.g. "
                             "data.source=DIR target.pretrained=DIR on a machine that should build neither")
    parser.add_argument("--write", action="store_true", help="rewrite this benchmark's section of RESULTS.md")
    args = parser.parse_args()
    if args.placement:
        return placement_check(args)

    from harness.advise.predict import predict
    from harness.train.config import compose_run_config as compose
    from harness.train.launch.run import run
    from strategies import report_order

    strategies = args.strategies.split(",") if args.strategies else report_order()
    started = time.time()
    device = [f"trainer.device={args.device}", *args.set]
    config, lengths, calibration = calibrated(device, local_ranks=args.nproc)
    calibrated_s = time.time() - started
    predicted = {p.strategy: p for p in predict(lengths, strategies, calibration, world_size=args.nproc,
                                                grad_accum=config.trainer.grad_accum,
                                                step_tokens=config.trainer.step_tokens, seed=config.seed)}
    measured: dict[str, list[float]] = {s: [] for s in strategies}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for strategy in strategies if round_index % 2 == 0 else strategies[::-1]:
                overrides = [f"strategy={strategy}", f"trainer.nproc={args.nproc}", "logger=none", *device,
                             "trainer.progress=false", f"trainer.stop_tokens={args.tokens}",
                             f"eval.every_tokens={args.tokens}"]
                summary = run(compose(overrides), Path(scratch) / f"{strategy}-{round_index}")
                complete(summary, strategy)
                measured[strategy].append(summary["tokens_per_second"])
                print(f"round {round_index} {strategy}: measured {summary['tokens_per_second']:,.0f} tok/s, "
                      f"predicted {predicted[strategy].tokens_per_second:,.0f}", flush=True)
    elapsed = time.time() - started
    median = {s: statistics.median(v) for s, v in measured.items()}
    errors = {s: predicted[s].tokens_per_second / median[s] - 1 for s in strategies}
    rank_predicted = sorted(strategies, key=lambda s: -predicted[s].tokens_per_second)
    rank_measured = sorted(strategies, key=lambda s: -median[s])
    # a pair's order is measured only when its rounds do not overlap; closer pairs are ties within the noise
    separated = [(a, b) for i, a in enumerate(strategies) for b in strategies[i + 1:]
                 if min(measured[a]) > max(measured[b]) or min(measured[b]) > max(measured[a])]
    alike = sum((predicted[a].tokens_per_second > predicted[b].tokens_per_second) == (median[a] > median[b])
                for a, b in separated)
    pairs = len(strategies) * (len(strategies) - 1) // 2
    rows = [f"| {s} | {predicted[s].tokens_per_second:,.0f} | {median[s]:,.0f} | "
            f"{', '.join(f'{v:,.0f}' for v in measured[s])} | {100 * errors[s]:+.1f}% | "
            f"{'PASS' if abs(errors[s]) <= GOAL else 'FAIL'} |" for s in strategies]
    worst = max(abs(e) for e in errors.values())
    section = (
        f"{TITLE if args.device == 'cpu' else CUDA_TITLE}\n\n"
        f"Command: `python benchmarks/advise_accuracy.py --write` (tokens={args.tokens}, nproc={args.nproc}, "
        f"rounds={args.rounds}, device={args.device}{''.join(f', --set {kv}' for kv in args.set)}). Machine: {machine(args.device)}. Date: "
        f"{datetime.date.today().isoformat()}. Calibration {calibrated_s:.0f} s (worst fit error "
        f"{100 * calibration.worst_error():.0f}% over {len(calibration.shapes)} shapes: a={calibration.a:.3g} s/slot, "
        f"b={calibration.b:.3g} s/len², c={calibration.c:.3g} s/block, {1e3 * calibration.micro_batch_s:.1f} ms a "
        f"micro-batch, {1e3 * calibration.step_s:.1f} ms a step, each rank with its share of the cores); "
        f"all took {elapsed / 60:.1f} min.\n\n"
        "The training throughput benchmark's settings (embedded default data, tiny target and drafter, "
        f"max_tokens={config.trainer.max_tokens}, {args.nproc} rank(s) on {args.device}); predicted from the run's "
        "own training "
        "lengths and plans (epoch 0), measured as the run's `tokens_per_second` (median over rounds).\n\n"
        "| strategy | predicted real tok/s | measured (median) | measured per round | error | within ±10% |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        f"- worst error {100 * worst:.1f}% — {'PASS' if worst <= GOAL else 'FAIL'} (goal ±{100 * GOAL:.0f}%)\n"
        f"- ranking predicted: {' > '.join(rank_predicted)}; measured: {' > '.join(rank_measured)} — "
        f"{'the same' if rank_predicted == rank_measured else 'different'}; of the {len(separated)} of {pairs} "
        f"pairs whose rounds do not overlap, {alike} are ordered alike "
        f"({'PASS' if alike == len(separated) else 'FAIL'}; the other pairs differ by less than the "
        "round-to-round spread)\n"
    )
    print(section)
    if args.write:
        write_section(section, TITLE if args.device == "cpu" else CUDA_TITLE)


def complete(summary: dict, what: str) -> None:
    """A run stopped early (a signal: the time limit of a caller) measured part of its tokens: stop here, with
    nothing written, rather than record it."""
    if summary.get("status") != "complete":
        raise SystemExit(f"advise_accuracy: the {what} run ended {summary.get('status')!r}; nothing is recorded")


def calibrated(device: list[str], local_ranks: int) -> tuple:
    """``(config, lengths, calibration)``: the default run's config on ``device``, its own training lengths (as
    a run selects and clips them) and a fresh calibration measured by ``local_ranks`` concurrent ranks."""
    from harness.advise.calibrate import calibrate
    from harness.data.samples import load_samples
    from harness.train.config import compose_run_config, run_config_from_dict
    from harness.train.loop.epoch_data import select_rows

    config_dict = compose_run_config(["logger=none", "trainer.progress=false", *device])
    config = run_config_from_dict(config_dict)
    samples = load_samples(config.data, progress=False)
    rows = select_rows(epoch_data_config(config), samples).train_rows
    lengths = samples.lengths[rows].clip(max=config.trainer.max_tokens)
    with tempfile.TemporaryDirectory() as scratch:  # measured now, never from the cache
        calibration, _ = calibrate(config_dict, Path(scratch), progress=True, local_ranks=local_ranks)
    return config, lengths, calibration


def machine(device: str) -> str:
    if device == "cuda":
        import torch

        return f"{torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible), torch {torch.__version__}"
    return f"{cpu_model()}, {os.cpu_count()} cores, shared"


def placement_check(args: argparse.Namespace) -> None:
    """Predicted and measured ``--split`` against colocated, per strategy (module docstring)."""
    from harness.train.config import compose_run_config as compose
    from harness.train.launch.run import run
    from strategies import report_order

    strategies = args.strategies.split(",") if args.strategies else report_order()
    try:
        target_ranks, drafter_ranks = (int(n) for n in args.split.split("+"))
    except ValueError:
        raise SystemExit(f"--split {args.split}: give target ranks + drafter ranks, e.g. 1+1 or 2+1") from None
    world, layouts = target_ranks + drafter_ranks, placements(target_ranks, drafter_ranks)
    if target_ranks < 1 or drafter_ranks < 1 or world % drafter_ranks:
        raise SystemExit(f"--split {args.split}: the drafter ranks must divide the {world} ranks' global batch")
    device = [f"trainer.device={args.device}", *args.set]
    tokens = args.tokens // 2
    started = time.time()
    predictions = RoundPredictions(device, world, target_ranks, tokens)
    measured: dict[tuple[str, str], list[float]] = {}
    stages: dict[str, list[tuple[float, float]]] = {}  # the split's measured target busy and drafter waiting
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            order = [(s, p) for s in strategies for p in layouts]
            for strategy, placement in order if round_index % 2 == 0 else order[::-1]:
                predicted = predictions.before_run(round_index, strategy)
                overrides = [f"strategy={strategy}", *layouts[placement], *device, "logger=none",
                             "trainer.progress=false",
                             f"trainer.stop_tokens={tokens}", f"eval.every_tokens={tokens}",
                             "eval.real_prompts=0"]
                summary = run(compose(overrides), Path(scratch) / f"{strategy}-{placement}-{round_index}")
                complete(summary, f"{strategy} {placement}")
                measured.setdefault((strategy, placement), []).append(summary["tokens_per_second"])
                if placement == "disaggregated":
                    stages.setdefault(strategy, []).append(
                        (statistics.mean(summary["topology_target_busy_fraction"]), summary["data_wait_fraction"]))
                key = "tokens_per_second" if placement == "disaggregated" else "colocated"
                print(f"round {round_index} {strategy} {placement}: {summary['tokens_per_second']:,.0f} tok/s, "
                      f"predicted {predicted[key]:,.0f}", flush=True)
    elapsed = time.time() - started
    table, verdict = placement_table(strategies, predictions.predicted, measured, stages, "disaggregated")
    section = (
        f"{PLACEMENT_TITLE}\n\n"
        f"Command: `python benchmarks/advise_accuracy.py --placement --write` (split {args.split}, tokens={tokens}, "
        f"rounds={args.rounds}). "
        f"Machine: {cpu_model()}, {os.cpu_count()} cores, shared. Date: {datetime.date.today().isoformat()}; "
        f"{elapsed / 60:.1f} min.\n\n"
        f"Embedded default data, tiny target and drafter, {world} gloo ranks: colocated on {world} ranks against "
        f"{target_ranks} target rank(s) + {drafter_ranks} drafter rank(s) (`grad_accum={world // drafter_ranks}`, "
        f"the same {world} micro-batches a step), every run {tokens:,} real tokens. "
        + prediction_method(predictions.methods) + "\n\n" + table + "\n\n" + verdict + "\n"
    )
    print(section)
    if args.write:
        write_section(section, PLACEMENT_TITLE)


SPLIT_GOAL = 0.15


def measure_link(device: list[str]) -> Any:
    """The split's link cost measured now by two ranks (``harness/advise/link.py``), never from the cache."""
    from harness.advise.link import calibrate_link
    from harness.train.config import compose_run_config

    with tempfile.TemporaryDirectory() as scratch:
        cost, _ = calibrate_link(compose_run_config(["logger=none", "trainer.progress=false", *device]), Path(scratch))
    return cost


def predict_placements(device: list[str], strategies: list[str], world: int, target_ranks: int,
                       tokens: int, link_cost: Any) -> tuple[dict, tuple]:
    """Every strategy's predicted colocated and ``target_ranks`` split tokens/s over a run's first ``tokens`` real
    tokens, and what :func:`prediction_method` says how with, ``(calibration, link, max_tokens)``: the stage fits
    calibrated now by as many concurrent CPU ranks as the runs have, up to one a core (batchlab-advise's rule,
    :func:`harness.advise.predict.calibration_ranks`), the link's cost given (``link_cost``: :func:`measure_link`),
    the placements simulated (``harness/advise/schedule.py``) with the processes sharing
    the cores."""
    from harness.advise.predict import LinkModel, calibration_ranks, predict, shared_cores

    kind = "cuda" if "trainer.device=cuda" in device else "cpu"
    config, lengths, calibration = calibrated(device, local_ranks=calibration_ranks(world, kind))
    cores = shared_cores(kind)
    link = LinkModel(link_cost, cores=cores, max_in_flight=config.topology.max_in_flight, dispatch=config.topology.dispatch)
    label = f"{target_ranks}+{world - target_ranks}"
    predicted = {}
    for p in predict(lengths, strategies, calibration, world_size=world, step_tokens=config.trainer.step_tokens,
                     seed=config.seed, link=link, run_tokens=tokens, cores=cores):
        split = next(r for r in p.placement["splits"] if r["split"] == label)
        predicted[p.strategy] = {"colocated": p.placement["colocated_tokens_per_second"], **split}
    return predicted, (calibration, link, config.trainer.max_tokens)


class RoundPredictions:
    """Each run predicted just before it, round by round (both placement benchmarks): a strategy's stages calibrated
    afresh before its first run of a round (a shared machine's speed drifts by more than the goal over a round's
    minutes, and each run is compared with the prediction made just before it), the link measured once a round."""

    def __init__(self, device: list[str], world: int, target_ranks: int, tokens: int) -> None:
        self.device, self.world, self.target_ranks, self.tokens = device, world, target_ranks, tokens
        self.predicted: list[dict] = []  # per round: each strategy's prediction (placement_table)
        self.methods: list[tuple] = []  # what each was predicted with (prediction_method)
        self._link: Any = None

    def before_run(self, round_index: int, strategy: str) -> dict:
        """``strategy``'s prediction in round ``round_index`` (rounds in order), made now before its first run."""
        if round_index == len(self.predicted):
            self._link = measure_link(self.device)
            self.predicted.append({})
        this_round = self.predicted[round_index]
        if strategy not in this_round:
            one, method = predict_placements(self.device, [strategy], self.world, self.target_ranks, self.tokens,
                                             self._link)
            this_round.update(one)
            self.methods.append(method)
        return this_round[strategy]


def prediction_method(methods: list[tuple]) -> str:
    """How the rounds' predictions were made: ``methods`` holds each round's ``(calibration, link, max_tokens)`` as
    :func:`predict_placements` returns them."""
    target_ms, drafter_ms, send_ms, receive_ms, unpack_ms = [], [], [], [], []
    for calibration, link, max_tokens in methods:
        target, drafter = calibration.stage_costs()
        send, receive, unpack = link.cost.seconds(np.array([max_tokens]), np.array([max_tokens]))
        target_ms.append(1e3 * (target.a * max_tokens + target.m))
        drafter_ms.append(1e3 * drafter.c)
        send_ms.append(1e3 * send[0])
        receive_ms.append(1e3 * receive[0])
        unpack_ms.append(1e3 * unpack[0])

    def spread(values: list[float], digits: int = 1) -> str:
        low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
        return low if low == high else f"{low}–{high}"

    ranks = methods[0][0].machine["local_ranks"]
    return (
        f"Each strategy's runs predicted, in each round, from a calibration measured just before them by {ranks} "
        f"concurrent ranks (over the rounds: the target stage, its collate included, {spread(target_ms)} ms per "
        f"full micro-batch of slots, the "
        f"drafter {spread(drafter_ms, 2)} ms a block) and the link measured by two ranks at the start of the round "
        f"(`harness/advise/link.py`; a "
        f"full micro-batch: send {spread(send_ms)} ms, receive {spread(receive_ms)} ms, "
        f"unpack {spread(unpack_ms)} ms), "
        "both placements simulated micro-batch by micro-batch "
        "(`harness/advise/schedule.py`: credits seen at the poll's ticks, a step's micro-batches taken together, "
        f"a drafter rank's receiving thread taking turns with its loop, the processes computing at each moment "
        f"sharing the {os.cpu_count()} cores) over the runs' own first steps; nothing measured "
        "in the runs below was used to fit anything. Each run is compared with the prediction made just before it (a "
        "shared machine's speed drifts by more than the goal over a round's minutes); the table gives medians over "
        "rounds: predicted, measured (the runs' `tokens_per_second`) and the error of each round."
    )


def placement_table(strategies, predicted: list[dict], measured, stages, split_key: str) -> tuple[str, str]:
    """The table of predicted against measured placements and its verdict lines (the ±15% goal on the split, the
    order of the placements wherever their measured rounds do not overlap). ``predicted[r]``: round ``r``'s
    predictions, compared with the ``r``-th measured run of each placement; each error is the median over rounds of
    a round's prediction against its measurement."""
    rows, errors, split_errors, ordered, separated = [], [], [], 0, 0
    for s in strategies:
        co_runs, split_runs = measured[(s, "colocated")], measured[(s, split_key)]
        rounds = [p[s] for p in predicted]
        if len(rounds) != len(co_runs) or len(rounds) != len(split_runs):
            raise ValueError(f"{s}: {len(rounds)} rounds predicted, {len(co_runs)} colocated and "
                             f"{len(split_runs)} split runs measured")
        co, split = statistics.median(co_runs), statistics.median(split_runs)
        co_predicted = statistics.median(p["colocated"] for p in rounds)
        split_predicted = statistics.median(p["tokens_per_second"] for p in rounds)
        co_error = statistics.median(p["colocated"] / m - 1 for p, m in zip(rounds, co_runs))
        split_error = statistics.median(p["tokens_per_second"] / m - 1 for p, m in zip(rounds, split_runs))
        errors.append(abs(co_error))
        split_errors.append(abs(split_error))
        apart = min(split_runs) > max(co_runs) or min(co_runs) > max(split_runs)
        if apart:
            separated += 1
            ordered += (split_predicted > co_predicted) == (split > co)
        busy, waiting = (statistics.median(b for b, _ in stages[s]), statistics.median(w for _, w in stages[s]))
        target_busy = statistics.median(p["target_busy"] for p in rounds)
        drafter_waiting = statistics.median(1 - p["drafter_busy"] for p in rounds)
        rows.append(
            f"| {s} | {co_predicted:,.0f} | {co:,.0f} | {100 * co_error:+.1f}% | {split_predicted:,.0f} | "
            f"{split:,.0f} | {100 * split_error:+.1f}% | {'PASS' if abs(split_error) <= SPLIT_GOAL else 'FAIL'} | "
            f"{split_predicted / co_predicted:.2f}× | {split / co:.2f}× | {'yes' if apart else 'no'} | "
            f"{100 * target_busy:.0f}% / {100 * drafter_waiting:.0f}% | "
            f"{100 * busy:.0f}% / {100 * waiting:.0f}% |")
    table = ("| strategy | colocated tok/s, predicted | measured | error | split tok/s, predicted | measured | error | "
             f"within ±{100 * SPLIT_GOAL:.0f}% | split / colocated, predicted | measured | rounds apart | "
             "predicted: target busy / drafter waiting | measured |\n"
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    worst = max(split_errors)
    verdict = (f"- split: worst error {100 * worst:.1f}% — {'PASS' if worst <= SPLIT_GOAL else 'FAIL'} "
               f"(goal ±{100 * SPLIT_GOAL:.0f}%); colocated: worst error {100 * max(errors):.1f}%\n"
               f"- order of the placements: of the {separated} strategies whose colocated and split rounds do not "
               f"overlap, {ordered} are predicted in the measured order "
               f"({'PASS' if ordered == separated else 'FAIL'}; the others differ by less than the round-to-round "
               "spread)")
    return table, verdict


if __name__ == "__main__":
    main()
