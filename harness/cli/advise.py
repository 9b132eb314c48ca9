"""``batchlab-advise``: which strategy, at what real tokens/s, finishing when — on this data, machine and world size.

    batchlab-advise --lengths my_dataset/ --max-tokens 16384 --world-size 8 --tokens 2e9
    batchlab-advise --profile chat-902k --max-tokens 16384 --world-size 8 --json
    batchlab-advise --lengths data.jsonl --max-tokens 2048 --target tiny --drafter tiny --report-dir advice/
    batchlab-advise --lengths sharegpt.json --tokenizer SmolLM2.gguf --bad-rows drop --max-tokens 4096
    batchlab-advise --lengths data.jsonl --max-tokens 2048 --drafter multirun/strategies/strategy=packed,seed=0
    batchlab-advise --experiment reference_8gpu --set target.num_hidden_layers=4 --device cuda --dtype bf16 \
        --profile chat-902k --max-tokens 16384 --world-size 8

1. Calibrates the step-cost model on this machine (:mod:`harness.advise.calibrate`: the run's own target
   forward and drafter step timed on a design of shapes, cached per machine, device, dtype, budget and
   configs; ``--recalibrate`` measures again).
2. Predicts for every strategy (:mod:`harness.advise.predict`): real tokens/s, time per epoch and to
   ``--tokens``, beside padding, recurrence, step recurrence, length-mix excess and rank imbalance; on two
   or more ranks, every split into target and drafter ranks against colocated (:mod:`harness.advise.stages`,
   on the target and drafter stages calibrated apart). On several GPUs, ``--allreduce-gbps`` adds the drafter's
   gradient all-reduce to every step (one GPU's calibration cannot time it; without it, a note says so).
3. Recommends in one paragraph, with what a finished sweep measured (``--sweep DIR``: only the differences
   the report's Holm-corrected tests keep). ``--json`` prints it all; ``--report-dir`` adds a figure (predicted
   tokens/s against recurrence, one point per strategy) and ``advice.json``.

Bad input is one line on stderr and exit status 2 (``--verbose``: and its traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.cli.data_options import add_tokenizer_options, named_as_flags
from harness.command_errors import OneLineParser, add_verbose, at_least, one_line_errors

#: trainer settings this command sets from its own options
OWN_OPTIONS = {"trainer.max_tokens": "--max-tokens", "trainer.device": "--device", "trainer.precision": "--dtype",
               "trainer.nproc": "--world-size"}


#: the prediction table: (title, Prediction field, width); docs/commands/batchlab-advise.md explains each (a test
#: keeps it so)
TABLE_COLUMNS = (("strategy", "strategy", 16), ("tokens/s", "tokens_per_second", 11), ("epoch", "epoch_seconds", 10),
                 ("steps", "steps", 7), ("padding", "padding_pct", 9), ("recur.", "recurrence", 8),
                 ("step rec.", "step_recurrence", 10), ("mix exc.", "length_mix_excess", 9),
                 ("imbal.", "rank_imbalance", 8), ("to --tokens", "seconds_to_budget", 13))


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="batchlab-advise", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--lengths", metavar="PATH", help="dataset (save_to_disk, .parquet, .jsonl, .npy, .txt)")
    source.add_argument("--profile", metavar="NAME", help="bundled length profile, e.g. chat-902k")
    parser.add_argument("--column", help="column holding the lengths or token lists")
    add_tokenizer_options(parser)
    parser.add_argument("--split", help="split of a saved DatasetDict")
    parser.add_argument("--max-tokens", type=at_least(int, 64), required=True, help="token slots per micro-batch")
    parser.add_argument("--world-size", type=at_least(int, 1), default=1, help="data-parallel ranks (default 1)")
    parser.add_argument("--grad-accum", type=at_least(int, 1), default=1, help="micro-batches per step (default 1)")
    parser.add_argument("--step-tokens", type=at_least(int, 1), default=None, help="equal-token steps of this size")
    parser.add_argument("--strategies", default=None, help="comma-separated (default: all)")
    parser.add_argument("--target", default=None,
                        help="conf/target/ option (default tiny), or a target checkpoint directory")
    parser.add_argument("--experiment", default=None,
                        help="conf/experiment/ option whose target, drafter and trainer settings to calibrate (e.g. "
                             "reference_8gpu; its placement is modelled, not used)")
    parser.add_argument("--drafter", default=None,
                        help="conf/drafter/ option (default tiny), or a batchlab-train run directory (its drafter)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="a batchlab-train override of the target, drafter or trainer config, repeatable (e.g. "
                             "--set drafter.num_hidden_layers=5 --set target.num_hidden_layers=4)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--tokens", type=lambda t: int(float(t)), default=None, help="token budget: time to reach it")
    parser.add_argument("--allreduce-gbps", type=float, default=None, metavar="BUSBW",
                        help="cuda: the GPUs' all-reduce bus bandwidth in GB/s (nccl-tests' busbw): adds the drafter's "
                             "gradient all-reduce to every step, not overlapped with the backward (at most what it "
                             "costs; one GPU's calibration cannot time it)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the plans (default 0)")
    parser.add_argument("--max-recurrence", type=float, default=0.1, help="the recommendation's recurrence bound")
    parser.add_argument("--sweep", nargs="+", metavar="SWEEP_DIR",
                        help="a batchlab-train -m sweep of these strategies: its measured differences (only those "
                             "the report's Holm-corrected tests keep) join the recommendation")
    parser.add_argument("--recalibrate", action="store_true", help="measure again, even with a cached calibration")
    parser.add_argument("--json", action="store_true", help="print everything as JSON")
    parser.add_argument("--report-dir", help="also write advice.json and the figure here")
    parser.add_argument("--cache-dir", default=None, help="default $BATCHLAB_CACHE or ~/.cache/batchlab")
    add_verbose(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return one_line_errors("batchlab-advise", lambda: _with_flags(args), verbose=args.verbose)


def _with_flags(args: argparse.Namespace) -> int:
    """:func:`advise`, its bad input naming this command's options where it names the settings they set."""
    try:
        return advise(args)
    except ValueError as error:
        message = named_as_flags(str(error))
        if message == str(error):
            raise
        raise ValueError(message) from error


def advise(args: argparse.Namespace) -> int:
    import numpy as np

    import strategies
    from harness.advise.calibrate import (
        CACHE_SUBDIR,
        available_bytes,
        calibrate,
        is_cached,
        target_bytes,
    )
    from harness.advise.predict import (
        calibration_ranks,
        predict,
        recommendation,
        shared_cores,
    )
    from harness.cli.overrides import check_override, group_options
    from harness.cli.plan import select_strategies
    from harness.data.config import DataConfig
    from harness.data.lengths import user_lengths
    from harness.train.config import compose_run_config, run_config_from_dict

    if args.experiment is not None and args.experiment not in group_options("experiment"):
        raise ValueError(f"--experiment {args.experiment}: no conf/experiment/{args.experiment}.yaml; choose one of "
                         f"{', '.join(group_options('experiment'))}")
    if args.experiment is not None and (args.target is not None or args.drafter is not None):
        raise ValueError(f"--experiment {args.experiment} sets its own target and drafter; change them with --set "
                         "(e.g. --set target.num_hidden_layers=4) instead of --target/--drafter")
    # an experiment's settings, each rank with both stages (the placements are modelled from the calibration)
    experiment = [f"experiment={args.experiment}", "topology=colocated"] if args.experiment else []
    target = [] if args.target is None else [f"target={args.target}"]
    if args.target is not None and args.target not in group_options("target") and Path(args.target).is_dir():
        target = ["target=tiny", f"target.pretrained={Path(args.target).resolve()}"]  # a checkpoint's own weights
    drafter, drafter_section = ([] if args.drafter is None else [f"drafter={args.drafter}"]), None
    if args.drafter is not None and args.drafter not in group_options("drafter") and (
            Path(args.drafter) / "config.json").is_file():
        drafter_section, run_target = _run_drafter(Path(args.drafter))  # a run's own drafter (--set wins)
        chosen = {override.split("=", 1)[0] for override in args.overrides}
        drafter = ["drafter=tiny", *(f"drafter.{key}={json.dumps(value)}" for key, value in drafter_section.items()
                                     if f"drafter.{key}" not in chosen)]
        if args.target is None:  # the drafter's width and vocabulary are its target's: the run's own target
            if not run_target:
                raise ValueError(f"--drafter {args.drafter}: the run's config names no target checkpoint "
                                 "(target.pretrained); give the target it trained against with --target")
            target = ["target=tiny", f"target.pretrained={run_target}"]
    for group, option, other in (("target", args.target, args.target is not None and Path(args.target).is_dir()),
                                 ("drafter", args.drafter, drafter_section is not None)):
        if option is not None and option not in group_options(group) and not other:
            raise ValueError(f"--{group} {option}: no conf/{group}/{option}.yaml"
                             + (" and no checkpoint directory" if group == "target" else
                                " and no batchlab-train run directory (one holding config.json)")
                             + f"; choose one of {', '.join(group_options(group))}")
    if args.allreduce_gbps is not None and (args.device != "cuda" or not args.allreduce_gbps > 0):
        raise ValueError(f"--allreduce-gbps {args.allreduce_gbps}: " + (
            "give the GPUs' bus bandwidth in GB/s, above 0" if args.device == "cuda" else
            "only with --device cuda (CPU ranks are calibrated together, their all-reduce inside the measured step)"))
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible here; calibrate on the GPU machine or use cpu")
    names = select_strategies(args.strategies, strategies.available_strategies())
    lengths, words = user_lengths(args.lengths if args.lengths is not None else "profile:" + args.profile,
                                  column=args.column, split=args.split, tokenizer=args.tokenizer,
                                  bad_rows=args.bad_rows, cache_dir=args.cache_dir and Path(args.cache_dir),
                                  progress=not args.json and sys.stderr.isatty())
    if words:
        print(f"batchlab-advise: {words}", file=sys.stderr)
    if lengths.size == 0:
        raise ValueError("the dataset has no samples to plan; give one with at least one non-empty row")
    over = int((lengths > args.max_tokens).sum())
    if over == lengths.size:
        raise ValueError(f"every sample is longer than --max-tokens {args.max_tokens} (the shortest has "
                         f"{int(lengths.min())} tokens); raise --max-tokens")
    target_name = args.target or (f"(experiment {args.experiment})" if args.experiment else "tiny")
    for override in args.overrides:
        key = override.split("=", 1)[0]
        if not key.startswith(("target.", "drafter.", "trainer.")) or "=" not in override:
            raise ValueError(f"--set {override}: give KEY=VALUE with a target., drafter. or trainer. key, e.g. "
                             "--set drafter.num_hidden_layers=5")
        if key in OWN_OPTIONS:
            raise ValueError(f"--set {override}: {key} is this command's {OWN_OPTIONS[key]}; use that option")
        problem = check_override(override)  # batchlab-train's own check: the setting exists, or a did-you-mean
        if problem:
            raise ValueError(f"--set {problem}")
    from hydra.errors import HydraException

    try:
        config = compose_run_config([*experiment, *target, *drafter, "trainer.nproc=1",
                                     f"trainer.max_tokens={args.max_tokens}", f"trainer.device={args.device}",
                                     f"trainer.precision={args.dtype}", "logger=none", *args.overrides])
    except HydraException as error:  # a value Hydra cannot parse or type (--set, or a run's drafter)
        given = " ".join(f"--set {o}" for o in args.overrides) if args.overrides else f"--drafter {args.drafter}"
        raise ValueError(f"{given}: {' '.join(str(error).split())}") from None
    if drafter_section is not None:
        try:
            run_config_from_dict(config)
        except ValueError as error:
            raise ValueError(f"--drafter {args.drafter}: its drafter config does not build with --target "
                             f"{target_name}: {error}") from None
    if args.tokenizer is not None:  # a random-weight target calibrated at the data's vocabulary, as a run builds it
        from harness.train.launch.run import with_tokenizer_vocabulary

        config = with_tokenizer_vocabulary(run_config_from_dict(config),
                                           {**config, "data": {**config["data"], "tokenizer": args.tokenizer}})
    # CPU ranks share this machine and are measured together (cores and the gradients' all-reduce shared), each
    # with its own copy of the target, up to one a core (more ranks than cores are simulated sharing them)
    local_ranks = calibration_ranks(args.world_size, args.device)
    cores = shared_cores(args.device)
    cache_dir = DataConfig(cache_dir=args.cache_dir).resolved_cache_dir()
    weights, free = target_bytes(config), available_bytes(args.device)
    if weights * local_ranks > free and (args.recalibrate or not is_cached(config, cache_dir, local_ranks)):
        copies = "" if local_ranks == 1 else (f" on each of the {local_ranks} CPU ranks that calibrate together "
                                              f"({local_ranks * weights / 2**30:,.1f} GiB in all)")
        raise ValueError(f"--target {target_name} needs {weights / 2**30:,.1f} GiB for its weights alone at "
                         f"{args.dtype}{copies}, "
                         f"more than the {free / 2**30:,.1f} GiB free on {args.device}; calibrate on a machine that "
                         "holds it (or a smaller target config: the fit is per configuration)")
    if args.recalibrate:
        for path in (cache_dir / CACHE_SUBDIR).glob("*.json*"):  # each calibration and its checksum sidecar
            path.unlink()
    calibration, measured = calibrate(config, cache_dir, progress=not args.json, local_ranks=local_ranks)
    logging.getLogger("strategies.validate").setLevel(logging.ERROR)  # the note below says it once, not per plan
    allreduce, allreduce_note = _gradient_allreduce(config, args)
    link = None
    if args.device == "cpu" and args.world_size > 1:  # a split's link measured by two ranks, its protocol simulated
        from harness.advise.link import calibrate_link
        from harness.advise.predict import LinkModel

        link = LinkModel(calibrate_link(config, cache_dir, progress=not args.json)[0], cores=cores)
    predictions = predict(lengths, names, calibration, world_size=args.world_size, grad_accum=args.grad_accum,
                          step_tokens=args.step_tokens, seed=args.seed, tokens=args.tokens, allreduce=allreduce,
                          link=link, cores=cores)
    paragraph = recommendation(predictions, args.max_recurrence)
    if args.sweep:
        paragraph += " " + measured_evidence(args.sweep)
    notes = [allreduce_note] if allreduce_note else []
    if over:
        notes.append(f"{over:,} of {lengths.size:,} samples ({100 * over / lengths.size:.1f}%) are longer than "
                     f"--max-tokens {args.max_tokens} (the longest {int(lengths.max()):,}): a run drops them "
                     f"(trainer.oversize=drop, counted) or truncates them (truncate); raise --max-tokens to "
                     f"{int(lengths.max())} to keep them whole. The predictions leave them out.")
    result = {"calibration": {**calibration.to_json(), "measured_now": measured},
              "predictions": [p.as_dict() for p in predictions], "recommendation": paragraph, "notes": notes,
              "settings": {k: v for k, v in vars(args).items() if k not in ("json", "verbose")}}
    if args.report_dir:
        _write_report(Path(args.report_dir), result, predictions)
    if args.json:
        print(json.dumps(result, indent=2, default=float))
        return 0
    vocabulary = "" if calibration.vocab_size is None else f", vocabulary {int(calibration.vocab_size):,}"
    print(f"calibration ({'measured now' if measured else 'cached'}; {calibration.machine['cpu']}, "
          f"{args.device}, {args.dtype}{vocabulary}): a={calibration.a:.3g} s/slot, b={calibration.b:.3g} s/len², "
          f"c={calibration.c:.3g} s/block, {1e3 * calibration.micro_batch_s:.2f} ms a micro-batch, "
          f"{1e3 * calibration.step_s:.2f} ms a step; worst fit error {100 * calibration.worst_error():.0f}% "
          f"over {len(calibration.shapes)} shapes")
    print("".join(f"{title:<{width}}" if title == "strategy" else f"{title:>{width}}"
                  for title, _, width in TABLE_COLUMNS if title != "to --tokens" or args.tokens))
    for p in predictions:
        row = (f"{p.strategy:<16}{p.tokens_per_second:>11,.0f}{_duration(p.epoch_seconds):>10}{p.steps:>7}"
               f"{p.padding_pct:>8.1f}%{p.recurrence:>8.2f}{p.step_recurrence:>10.2f}{p.length_mix_excess:>9.3f}"
               f"{p.rank_imbalance:>8.2f}")
        print(row + (f"{_duration(p.seconds_to_budget):>13}" if args.tokens else ""))
    _print_placements(predictions, args.world_size)
    print(paragraph)
    for note in notes:
        print(note)
    if np.isfinite(calibration.worst_error()) and calibration.worst_error() > 0.25:
        print(f"note: the calibration fits one shape {100 * calibration.worst_error():.0f}% off: a busy machine? "
              "--recalibrate on a quiet one", file=sys.stderr)
    return 0


def _gradient_allreduce(config: dict, args: argparse.Namespace) -> tuple[Any, str]:
    """The drafter's gradient all-reduce a step (:func:`~harness.advise.predict.ring_allreduce_seconds`) and the
    note that says what was assumed, or that it is left out; nothing to add on CPU (measured) or one rank."""
    from harness.advise.calibrate import drafter_gradient_bytes
    from harness.advise.predict import no_allreduce, ring_allreduce_seconds

    if args.device != "cuda" or args.world_size < 2:
        return no_allreduce, ""
    gradient_bytes = drafter_gradient_bytes(config)
    size = f"{gradient_bytes / 1e9:,.2f} GB of fp32 gradients a step"
    if args.allreduce_gbps is None:
        return no_allreduce, (f"The step was timed on one GPU: the drafter's gradient all-reduce across "
                              f"{args.world_size} GPUs ({size}) is not in these numbers; --allreduce-gbps BUSBW "
                              "(nccl-tests' bus bandwidth of these GPUs) adds it.")
    allreduce = ring_allreduce_seconds(gradient_bytes, args.allreduce_gbps)
    return allreduce, (f"Every step includes the drafter's gradient all-reduce ({size}) at {args.allreduce_gbps:g} "
                       f"GB/s bus bandwidth: {1e3 * allreduce(args.world_size):,.1f} ms on {args.world_size} GPUs "
                       "(assumed, not measured; at most, since DDP overlaps part of it with the backward).")


def measured_evidence(sweep_dirs: list[str]) -> str:
    """What a finished sweep says: the differences that survive Holm–Bonferroni over every pair and headline
    metric (the report's own tests), or that none does."""
    from analysis.compare import run_metrics
    from analysis.load import SweepError, load_sweeps
    from analysis.stats import compare_pairs, surviving_sentence, timing_check

    try:
        sweep = load_sweeps(sweep_dirs)
    except SweepError as error:
        raise ValueError(f"--sweep: {error}") from None
    per_run = run_metrics(sweep)
    tests = compare_pairs(per_run, timing=timing_check(per_run))
    where = f"Measured in {', '.join(sweep_dirs)} ({len(sweep.runs)} runs, {len(sweep.seeds)} seeds)"
    survivors = [t for t in tests if t.survives]
    if survivors:
        return f"{where}, differences that survive Holm–Bonferroni: " + "; ".join(map(surviving_sentence, survivors)) + "."
    if any(t.tested for t in tests):
        return f"{where}: no difference between strategies survives Holm–Bonferroni; convergence does not separate them."
    return f"{where}: too few paired seeds to test a difference (3 or more are needed)."


def _run_drafter(run_dir: Path) -> tuple[dict, str | None]:
    """The drafter section of a batchlab-train run's ``config.json`` (the keys this version knows), and the
    target checkpoint it trained against when that directory exists."""
    import dataclasses

    from harness.train.config import DrafterSchema

    try:
        config = json.loads((run_dir / "config.json").read_text())
        section = config["drafter"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"--drafter {run_dir}: its config.json is not a batchlab-train run's config (no drafter "
                         "section); give the run directory itself, or a conf/drafter/ option") from None
    known = {f.name for f in dataclasses.fields(DrafterSchema)}
    pretrained = (config.get("target") or {}).get("pretrained")
    return ({k: v for k, v in section.items() if k in known},
            str(pretrained) if pretrained and Path(str(pretrained)).is_dir() else None)


def _print_placements(predictions: list, world_size: int) -> None:
    """Colocated against every target/drafter split (tokens/s relative to colocated, target ranks busy)."""
    labels = [row["split"] for row in (predictions[0].placement or {}).get("splits", [])] if predictions else []
    if not labels:
        return
    simulated = (predictions[0].placement or {}).get("simulated", False)
    print(f"placement on {world_size} ranks, target + drafter ranks (× colocated, target ranks busy; "
          + ("simulated: the link's protocol and measured costs):" if simulated else
             "modelled on the stage fits, an upper bound: perfect overlap, transfers left out):"))
    print(f"{'strategy':<16}" + "".join(f"{label:>15}" for label in labels) + f"{'best':>11}")
    for p in predictions:
        cells = "".join(f"{r['vs_colocated']:>7.2f}× ({100 * r['target_busy']:>3.0f}%)" for r in p.placement["splits"])
        print(f"{p.strategy:<16}{cells}{p.placement['best']:>11}")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s"


def _write_report(out: Path, result: dict, predictions: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "advice.json").write_text(json.dumps(result, indent=2, default=float))
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for p in predictions:
        ax.scatter(p.recurrence, p.tokens_per_second, s=40)
        ax.annotate(p.strategy, (p.recurrence, p.tokens_per_second), textcoords="offset points", xytext=(5, 4),
                    fontsize=9)
    ax.set(xlabel="composition recurrence between epochs (lower: more diverse)",
           ylabel="predicted real tokens/s", title="Predicted throughput against diversity")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "advice.png", dpi=150)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
