"""``batchlab-advise``'s work (:mod:`harness.cli.advise` is the command): the run config to calibrate from the
chosen experiment, target and drafter, the dataset's lengths, the calibration on this machine and the predictions.

Bad input raises a ValueError naming the option and the fix.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Models:
    """What to calibrate: the Hydra overrides choosing the experiment, target and drafter, a run's drafter section
    (None unless ``--drafter`` names a run directory) and the target in words."""

    overrides: list[str]
    drafter_section: dict | None
    target_name: str


def model_overrides(args: argparse.Namespace) -> Models:
    """The experiment, target and drafter that ``--experiment``, ``--target`` and ``--drafter`` choose, checked."""
    from harness.train.config import group_options

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
        drafter_section, run_target = run_drafter(Path(args.drafter))  # a run's own drafter (--set wins)
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
    target_name = args.target or (f"(experiment {args.experiment})" if args.experiment else "tiny")
    return Models([*experiment, *target, *drafter], drafter_section, target_name)


def check_device(args: argparse.Namespace) -> None:
    """``--device`` is there, and ``--allreduce-gbps`` goes with it."""
    if args.allreduce_gbps is not None and (args.device != "cuda" or not args.allreduce_gbps > 0):
        raise ValueError(f"--allreduce-gbps {args.allreduce_gbps}: " + (
            "give the GPUs' bus bandwidth in GB/s, above 0" if args.device == "cuda" else
            "only with --device cuda (CPU ranks are calibrated together, their all-reduce inside the measured step)"))
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible here; calibrate on the GPU machine or use cpu")


def read_lengths(args: argparse.Namespace) -> tuple[np.ndarray, str]:
    """The dataset's sample lengths (``--lengths`` or ``--profile``) and what reading them said, if anything."""
    from harness.data.lengths import user_lengths

    return user_lengths(args.lengths if args.lengths is not None else "profile:" + args.profile,
                        column=args.column, split=args.split, tokenizer=args.tokenizer,
                        bad_rows=args.bad_rows, cache_dir=args.cache_dir and Path(args.cache_dir),
                        progress=not args.json and sys.stderr.isatty())


def oversize(lengths: np.ndarray, max_tokens: int) -> int:
    """How many samples are longer than ``max_tokens``; a ValueError when none is left to plan."""
    if lengths.size == 0:
        raise ValueError("the dataset has no samples to plan; give one with at least one non-empty row")
    over = int((lengths > max_tokens).sum())
    if over == lengths.size:
        raise ValueError(f"every sample is longer than --max-tokens {max_tokens} (the shortest has "
                         f"{int(lengths.min())} tokens); raise --max-tokens")
    return over


def oversize_note(over: int, lengths: np.ndarray, max_tokens: int) -> str:
    return (f"{over:,} of {lengths.size:,} samples ({100 * over / lengths.size:.1f}%) are longer than "
            f"--max-tokens {max_tokens} (the longest {int(lengths.max()):,}): a run drops them "
            f"(trainer.oversize=drop, counted) or truncates them (truncate); raise --max-tokens to "
            f"{int(lengths.max())} to keep them whole. The predictions leave them out.")


def run_config(args: argparse.Namespace, models: Models) -> dict:
    """The run config to calibrate: ``models`` on one rank at the command's budget, device and dtype, with
    ``--set``'s overrides (and, with ``--tokenizer``, a random-weight target at the data's vocabulary)."""
    from hydra.errors import HydraException

    from harness.train.config import compose_run_config, run_config_from_dict

    try:
        config = compose_run_config([*models.overrides, "trainer.nproc=1",
                                     f"trainer.max_tokens={args.max_tokens}", f"trainer.device={args.device}",
                                     f"trainer.precision={args.dtype}", "logger=none", *args.overrides])
    except HydraException as error:  # a value Hydra cannot parse or type (--set, or a run's drafter)
        given = " ".join(f"--set {o}" for o in args.overrides) if args.overrides else f"--drafter {args.drafter}"
        raise ValueError(f"{given}: {' '.join(str(error).split())}") from None
    if models.drafter_section is not None:
        try:
            run_config_from_dict(config)
        except ValueError as error:
            raise ValueError(f"--drafter {args.drafter}: its drafter config does not build with --target "
                             f"{models.target_name}: {error}") from None
    if args.tokenizer is not None:  # a random-weight target calibrated at the data's vocabulary, as a run builds it
        from harness.train.launch.run import with_tokenizer_vocabulary

        config = with_tokenizer_vocabulary(run_config_from_dict(config),
                                           {**config, "data": {**config["data"], "tokenizer": args.tokenizer}})
    return config


def calibrate_here(config: dict, args: argparse.Namespace, target_name: str) -> tuple[Any, bool, Path]:
    """The step-cost calibration of ``config`` on this machine (cached unless ``--recalibrate``), whether it was
    measured now, and the cache directory; a ValueError when measuring it would not fit in memory."""
    from harness.advise.calibrate import CACHE_SUBDIR, available_bytes, calibrate, is_cached, target_bytes
    from harness.advise.predict import calibration_ranks
    from harness.data.config import DataConfig

    # CPU ranks share this machine and are measured together (cores and the gradients' all-reduce shared), each
    # with its own copy of the target, up to one a core (more ranks than cores are simulated sharing them)
    local_ranks = calibration_ranks(args.world_size, args.device)
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
    return calibration, measured, cache_dir


def predict_strategies(config: dict, args: argparse.Namespace, lengths: np.ndarray, names: list[str],
                       calibration: Any, cache_dir: Path) -> tuple[list, str]:
    """Every strategy's prediction (:func:`~harness.advise.predict.predict`), and the gradient all-reduce's note."""
    from harness.advise.predict import predict, shared_cores

    cores = shared_cores(args.device)
    logging.getLogger("strategies.validate").setLevel(logging.ERROR)  # the note below says it once, not per plan
    allreduce, allreduce_note = gradient_allreduce(config, args)
    link = None
    if args.device == "cpu" and args.world_size > 1:  # a split's link measured by two ranks, its protocol simulated
        from harness.advise.link import calibrate_link
        from harness.advise.predict import LinkModel

        link = LinkModel(calibrate_link(config, cache_dir, progress=not args.json)[0], cores=cores)
    predictions = predict(lengths, names, calibration, world_size=args.world_size, grad_accum=args.grad_accum,
                          step_tokens=args.step_tokens, seed=args.seed, tokens=args.tokens, allreduce=allreduce,
                          link=link, cores=cores)
    return predictions, allreduce_note


def gradient_allreduce(config: dict, args: argparse.Namespace) -> tuple[Any, str]:
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


def run_drafter(run_dir: Path) -> tuple[dict, str | None]:
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
