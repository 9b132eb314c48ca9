"""Calibrate the step-cost model on this machine: time the real micro-batch and optimizer step, fit seconds.

A micro-batch costs ``a·slots + b·Σlen² + c·blocks + m`` seconds (:class:`strategies.CostModel`'s three terms
plus a fixed cost per micro-batch) and an optimizer step ``s`` more. The calibration times the run's own
code on a design of shapes at the run's budget — padded rows of one length and of mixed lengths (slots ≠
tokens), packed rows of 1 to many documents (the same slots, other Σlen² and blocks) — each micro-batch
as the trainer runs it (its collate, the frozen target's forward of the tapped layers, then the drafter's
forward and backward), warm-up first and the median of repeats, and fits ``a, b, c, m ≥ 0`` by least squares,
reporting each shape's error. ``s`` is the median time of gradient clipping, ``AdamW.step`` and
``zero_grad``. The two stages are also timed apart (the collate and the target's forward, then the drafter's
forward and backward) and fitted each on the same four terms: the stage costs a disaggregated placement balances
(:mod:`harness.advise.stages`).

The fit is cached (``$BATCHLAB_CACHE/advise/``) per machine (CPU model, cores, threads, torch), device,
dtype, budget and target / drafter configs. Measurements are saved shape by shape as they are taken, so
an interrupted calibration resumes where it stopped, and the fit is written atomically: never a corrupt
cache.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness.data import cache
from strategies.cost import drafter_blocks

FORMAT_VERSION = 5  # 2: the stages timed and fitted apart; 3: every concurrent rank's runs; 4: stages started together;
# 5: the target stage includes the micro-batch's collate
CACHE_SUBDIR = "advise"
#: shapes timed per calibration, and runs of each (after one warm-up run)
REPEATS = 3
#: how far (a factor either way) a fit may miss one of its own shapes before it is refused: a shared machine's fits
#: miss by up to ~20%; a factor of 3 means the timings were disturbed, or the terms do not describe this machine
MAX_FIT_FACTOR = 3.0


class DegenerateFit(ValueError):
    """A calibration whose fit cannot predict anything: never cached, the measurements discarded."""


@dataclass(frozen=True)
class Shape:
    """One micro-batch of the design: its layout and its documents' lengths."""

    layout: str
    lengths: tuple[int, ...]

    def terms(self, block_size: int, num_anchors: int, max_tokens: int,
              max_blocks: int | None = None) -> tuple[float, float, float]:
        """``(slots, Σlen², blocks)`` as :class:`strategies.CostModel` counts them, blocks capped at the drafter's
        ``max_blocks`` a micro-batch (what it runs)."""
        lengths = np.asarray(self.lengths, dtype=np.float64)
        blocks = float(drafter_blocks(np.asarray(self.lengths), block_size, num_anchors).sum())
        if max_blocks is not None:
            blocks = min(blocks, float(max_blocks))
        if self.layout == "packed":
            return float(max_tokens), float((lengths ** 2).sum()), blocks
        longest = float(lengths.max())
        return float(lengths.size * longest), float(lengths.size * longest ** 2), blocks


def design(max_tokens: int, block_size: int) -> list[Shape]:
    """The calibration's shapes at budget ``max_tokens``: padded rows of one length and of mixed lengths, and
    packed rows of 1 to 16 documents."""
    shortest = max(2 * block_size, 16)
    shapes = []
    for fraction, rows in ((1, 1), (2, 1), (2, 2), (4, 4), (8, 8), (4, 1), (8, 2)):
        length = max_tokens // fraction
        if length >= shortest:
            shapes.append(Shape("padded", (length,) * rows))
    for longest, short, count in ((max_tokens // 2, max_tokens // 8, 3), (max_tokens // 4, max_tokens // 16, 3)):
        if short >= shortest:
            shapes.append(Shape("padded", (longest,) + (short,) * count))  # slots far above tokens
    for documents in (1, 2, 4, 8, 16):
        length = max_tokens // documents
        if length >= shortest:
            shapes.append(Shape("packed", (length,) * documents))
    return shapes


@dataclass(frozen=True)
class Calibration:
    """Seconds per micro-batch term and per optimizer step on this machine, and how well they fit."""

    a: float  # per computed slot of the target
    b: float  # per unit of Σlen² (full attention)
    c: float  # per drafter block
    micro_batch_s: float  # fixed per micro-batch
    step_s: float  # per optimizer step (clip, AdamW, zero_grad)
    block_size: int
    num_anchors: int
    max_tokens: int
    key: str
    machine: dict
    shapes: list  # [{"layout", "lengths", "measured_s", "fitted_s", "error", "target_s", "drafter_s"}]
    target_stage: list  # [a, b, c, m] of the target's forward alone
    drafter_stage: list  # [a, b, c, m] of the drafter's forward and backward alone
    max_blocks: int | None = None  # the drafter's cap on blocks a micro-batch (the c term counts capped blocks)
    measured_on: dict | None = None  # what was timed (dtype, max_tokens, target and drafter configs): the cache key's

    @property
    def vocab_size(self) -> int | None:
        """The target's vocabulary the calibration ran at (None: a checkpoint's own, or an older calibration)."""
        target = (self.measured_on or {}).get("target") or {}
        return None if target.get("pretrained") else target.get("vocab_size")

    def stage_costs(self) -> tuple[Any, Any]:
        """``(target, drafter)`` :class:`~harness.advise.stages.StageCost` of the stage fits (seconds)."""
        return self._stage(self.target_stage), self._stage(self.drafter_stage)

    def micro_batch_cost(self) -> Any:
        """The whole micro-batch's fit (``a, b, c, m``) as a :class:`~harness.advise.stages.StageCost`."""
        return self._stage([self.a, self.b, self.c, self.micro_batch_s])

    def _stage(self, coefficients: list) -> Any:
        from harness.advise.stages import StageCost

        return StageCost(*coefficients, block_size=self.block_size, num_anchors=self.num_anchors,
                         max_blocks=self.max_blocks)

    def cost_model(self) -> Any:
        """The fit as a :class:`strategies.CostModel` (seconds; the fixed terms are :attr:`micro_batch_s`,
        :attr:`step_s`)."""
        from strategies import CostModel

        return CostModel(a=self.a, b=self.b, c=self.c, block_size=self.block_size, num_anchors=self.num_anchors)

    def worst_error(self) -> float:
        return max((abs(shape["error"]) for shape in self.shapes), default=float("nan"))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, values: dict) -> Calibration:
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})


def fit(terms: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Non-negative least squares of ``seconds ≈ terms @ x`` (columns slots, Σlen², blocks, 1), relative
    error weighted (each shape counts alike, small or large).

    By hand: exact for a handful of columns (every subset of columns solved by ``numpy.linalg.lstsq``, the
    best non-negative one kept); scipy's ``nnls`` would do the same but scipy is not a dependency."""
    weights = 1.0 / np.maximum(seconds, 1e-12)
    design_matrix, target = terms * weights[:, None], seconds * weights
    scale = np.maximum(np.abs(design_matrix).max(axis=0), 1e-300)  # columns of very different sizes
    best, best_residual = np.zeros(terms.shape[1]), np.inf
    for size in range(1, terms.shape[1] + 1):
        for columns in itertools.combinations(range(terms.shape[1]), size):
            sub = design_matrix[:, columns] / scale[list(columns)]
            solution, *_ = np.linalg.lstsq(sub, target, rcond=None)
            if (solution < 0).any():
                continue
            residual = float(((sub @ solution - target) ** 2).sum())
            if residual < best_residual:
                best_residual = residual
                best = np.zeros(terms.shape[1])
                best[list(columns)] = solution / scale[list(columns)]
    return best


def machine_identity(device: str) -> dict:
    """What a calibration's timings depend on besides the configs."""
    import torch

    from harness.machine import cpu_model

    identity = {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                "device": device}
    if device == "cuda" and torch.cuda.is_available():
        identity["gpu"] = torch.cuda.get_device_name(0)
    return identity


def drafter_identity(drafter: dict) -> dict:
    """The drafter's settings as the calibration and link caches key them: ``distill_weight`` only when set (the
    keys of drafters without soft labels stay those from before the setting existed)."""
    return {k: v for k, v in drafter.items() if not (k == "distill_weight" and not v)}


def calibration_key(machine: dict, dtype: str, max_tokens: int, target: dict, drafter: dict) -> str:
    return cache.digest({"format": FORMAT_VERSION, "machine": machine, "dtype": dtype, "max_tokens": max_tokens,
                         "target": target, "drafter": drafter_identity(drafter), "repeats": REPEATS})


#: shapes measured per start of the concurrent ranks (their results are saved after each group)
CONCURRENT_GROUP = 5


def calibrate(config_dict: dict[str, Any], cache_dir: Path, progress: bool = True,
              measure: Callable[..., tuple[list[float], list[float], float]] | None = None,
              local_ranks: int = 1) -> tuple[Calibration, bool]:
    """The calibration for ``config_dict``'s target, drafter, device, dtype and ``trainer.max_tokens``:
    ``(calibration, measured_now)``, from the cache when there. ``measure`` (tests): replaces the timing; it
    returns a shape's micro-batch times, its target stage's times (the same runs) and the step's time.

    ``local_ranks > 1`` (CPU ranks sharing this machine): that many processes measure every shape at the same
    time, each with its share of the cores, and their optimizer step includes the all-reduce of the drafter's
    gradients over gloo, as the training ranks do; every rank's runs of a shape count."""
    trainer = config_dict["trainer"]
    drafter = config_dict["drafter"]
    machine, final = _cache_entry(config_dict, cache_dir, local_ranks)
    key, directory = final.stem, final.parent
    partial = directory / f"{key}.partial.json"
    stored = cache.read_json_checked(final, "calibration")
    if stored is not None:
        return Calibration.from_json(stored), False
    directory.mkdir(parents=True, exist_ok=True)
    block_size, num_anchors = int(drafter["block_size"]), int(drafter["num_anchors"])
    max_blocks = None if drafter.get("max_blocks") is None else int(drafter["max_blocks"])
    shapes = design(int(trainer["max_tokens"]), block_size)
    done = cache.read_json_checked(partial, "partial calibration") or {"shapes": {}, "step_s": None}
    todo = [shape for shape in shapes if _name(shape) not in done["shapes"]]  # the rest after an interruption
    if local_ranks > 1 and measure is None:
        groups = [todo[i:i + CONCURRENT_GROUP] for i in range(0, len(todo), CONCURRENT_GROUP)]
    else:
        measure = measure or _measurer(config_dict)
        groups = [[shape] for shape in todo]
    from tqdm import tqdm

    with tqdm(total=len(shapes), initial=len(shapes) - len(todo), desc="batchlab-advise: calibrating",
              unit=" shapes", disable=not progress, leave=False) as bar:
        for group in groups:
            bar.set_postfix_str(", ".join(f"{s.layout} {len(s.lengths)} × {max(s.lengths)}" for s in group))
            if measure is None:
                from harness.train.distributed import launch

                results = launch(concurrent_rank, (config_dict, group), local_ranks,
                                 run_id=f"batchlab-advise-{os.getpid()}-{time.time_ns()}")
            else:
                results = [measure(shape) for shape in group]
            for shape, (times, target_times, step_s) in zip(group, results):
                done["shapes"][_name(shape)] = {
                    "total": statistics.median(times), "target": statistics.median(target_times),
                    "drafter": statistics.median([t - u for t, u in zip(times, target_times)])}
                done["step_s"] = step_s if done["step_s"] is None else min(done["step_s"], step_s)
            _write_atomic(partial, done)
            bar.update(len(group))
    max_tokens = int(trainer["max_tokens"])
    terms = np.array([[*shape.terms(block_size, num_anchors, max_tokens, max_blocks), 1.0] for shape in shapes])
    seconds = {part: np.array([done["shapes"][_name(s)][part] for s in shapes])
               for part in ("total", "target", "drafter")}
    a, b, c, m = fit(terms, seconds["total"])
    fitted = terms @ np.array([a, b, c, m])
    rows = [{"layout": s.layout, "lengths": list(s.lengths), "measured_s": float(t), "fitted_s": float(f),
             "error": float(f / t - 1), "target_s": float(u), "drafter_s": float(d)}
            for s, t, f, u, d in zip(shapes, seconds["total"], fitted, seconds["target"], seconds["drafter"])]
    problem = degenerate(np.array([a, b, c, m]), rows)
    if problem:
        partial.unlink(missing_ok=True)  # its timings would give the same fit again
        cache.checksum_path(partial).unlink(missing_ok=True)
        raise DegenerateFit(f"the calibration's fit is unusable ({problem}); nothing was cached. The timings were "
                            "probably disturbed (another job on the machine): run batchlab-advise again when it "
                            "is quieter, or give a stored calibration")
    stages = [[float(x) for x in fit(terms, np.maximum(seconds[part], 1e-9))] for part in ("target", "drafter")]
    measured_on = {"dtype": stage_precisions(trainer), "max_tokens": max_tokens, "target": config_dict["target"],
                   "drafter": drafter}
    calibration = Calibration(float(a), float(b), float(c), float(m), float(done["step_s"]), block_size, num_anchors,
                              max_tokens, key, machine, rows, *stages, max_blocks, measured_on)
    _write_atomic(final, calibration.to_json())
    partial.unlink(missing_ok=True)
    cache.checksum_path(partial).unlink(missing_ok=True)
    return calibration, True


def degenerate(coefficients: np.ndarray, rows: list[dict]) -> str | None:
    """Why a fit ``(a, b, c, m)`` with its ``rows`` (each shape's measured and fitted seconds) cannot predict
    anything, or None: a coefficient not finite, no per-token term (every micro-batch would cost the same), a
    shape that took no time, or a fit far from its own points."""
    a, b, c, m = (float(x) for x in coefficients)
    if not all(np.isfinite([a, b, c, m])):
        return f"a={a}, b={b}, c={c}, m={m}: not finite"
    if a <= 0 and b <= 0 and c <= 0:
        return f"CostModel(a={a}, b={b}, c={c}): no term grows with the micro-batch"
    if any(not row["measured_s"] > 0 for row in rows):
        return "a shape was timed at 0 s"

    def factor(row: dict) -> float:
        ratio = row["fitted_s"] / row["measured_s"]
        return max(ratio, 1 / ratio) if ratio > 0 else np.inf

    worst = max(rows, key=factor)
    if factor(worst) > MAX_FIT_FACTOR:
        return (f"it puts its own {worst['layout']} shape of {len(worst['lengths'])} × {max(worst['lengths'])} "
                f"tokens at {worst['fitted_s']:.3g} s where it took {worst['measured_s']:.3g} s, off by more than "
                f"a factor of {MAX_FIT_FACTOR:g}")
    return None


def stage_precisions(trainer: dict[str, Any]) -> str:
    """The stages' precision as a calibration names it: ``trainer.precision``, with the drafter's own after it
    when ``trainer.drafter_precision`` differs (a bf16 drafter's stage is faster than an fp32 one's)."""
    drafter = trainer.get("drafter_precision")
    return trainer["precision"] if drafter in (None, trainer["precision"]) else f"{trainer['precision']}/drafter-{drafter}"


def _cache_entry(config_dict: dict[str, Any], cache_dir: Path, local_ranks: int) -> tuple[dict[str, Any], Path]:
    """This machine's identity and the cache file of ``config_dict``'s calibration by ``local_ranks`` ranks."""
    trainer = config_dict["trainer"]
    machine = machine_identity(trainer["device"])
    machine["threads_per_rank"] = trainer.get("threads_per_rank")  # a rank's share of the cores
    machine["local_ranks"] = local_ranks
    key = calibration_key(machine, stage_precisions(trainer), int(trainer["max_tokens"]), config_dict["target"],
                          config_dict["drafter"])
    return machine, Path(cache_dir) / CACHE_SUBDIR / f"{key}.json"


def is_cached(config_dict: dict[str, Any], cache_dir: Path, local_ranks: int = 1) -> bool:
    """Whether :func:`calibrate` would read this calibration from the cache (and allocate nothing)."""
    path = _cache_entry(config_dict, cache_dir, local_ranks)[1]
    return path.is_file() and cache.checksum_problem(path) is None


def _target_source(config: Any) -> Any:
    """What the run's target is built from: its checkpoint directory, else its config's keyword arguments."""
    pretrained = config.target.pretrained
    return pretrained if pretrained and Path(str(pretrained)).is_dir() else config.target_kwargs


def target_bytes(config_dict: dict[str, Any]) -> int:
    """The frozen target's weights in bytes at the run's precision, counted without allocating them (meta
    device): what must fit before a calibration can start."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    from harness.models.config import load_target_config
    from harness.train.config import run_config_from_dict

    config = run_config_from_dict(config_dict)
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(load_target_config(_target_source(config)))
    width = 2 if config.trainer.precision == "bf16" else 4
    return sum(p.numel() for p in model.parameters()) * width


def drafter_gradient_bytes(config_dict: dict[str, Any]) -> int:
    """The bytes of gradients the drafter's ranks all-reduce every step: its trainable parameters (the target's
    embedding and head are shared and frozen) in fp32, the master weights' dtype; counted on the meta device."""
    import torch

    from harness.models.drafter import DFlashDrafter
    from harness.models.target import HybridTarget
    from harness.train.config import run_config_from_dict

    config = run_config_from_dict(config_dict)
    drafter_config = config.drafter_config
    with torch.device("meta"):
        target = HybridTarget(_target_source(config), tap_layer_ids=drafter_config.target_layer_ids,
                              num_draft_layers=drafter_config.num_hidden_layers)
        drafter = DFlashDrafter(drafter_config, target.embed_tokens, target.lm_head, target.num_layers,
                                final_norm=target.final_norm)
    return sum(p.numel() for p in drafter.parameters() if p.requires_grad) * 4


def available_bytes(device: str) -> int:
    """Memory free for the target now: the GPU's free memory, or the machine's available memory."""
    if device == "cuda":
        import torch

        return int(torch.cuda.mem_get_info()[0])
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _name(shape: Shape) -> str:
    return f"{shape.layout}:{','.join(map(str, shape.lengths))}"


def concurrent_rank(config_dict: dict[str, Any], shapes: list[Shape]) -> list[tuple[list[float], list[float], float]]:
    """One of the ranks measuring together (started by torch elastic): every shape after a barrier, the step
    with the gradients' all-reduce; returns every rank's runs of each shape together (the median is then a
    typical rank's: with more ranks than cores, which one gets a core first is the scheduler's choice, and one
    rank's own times can be those of a rank that mostly had a core to itself), and the ranks' median step."""
    from harness.train.distributed import (
        Collectives,
        RankEnv,
        destroy_process_group,
        external_launch_env,
        init_process_group,
    )

    env = external_launch_env() or RankEnv()
    init_process_group(env, config_dict["trainer"]["device"], 600)
    try:
        measure = _measurer(config_dict, env)
        mine = [measure(shape) for shape in shapes]
        ranks = Collectives(env).all_gather_object(mine)
        return [([t for rank in ranks for t in rank[i][0]], [t for rank in ranks for t in rank[i][1]],
                 statistics.median(rank[i][2] for rank in ranks)) for i in range(len(shapes))]
    finally:
        destroy_process_group()


def _write_atomic(path: Path, values: dict) -> None:
    """``values`` at ``path`` atomically, with its checksum sidecar (read back by :func:`cache.read_json_checked`)."""
    cache.write_json_checked(path, values, indent=1, sort_keys=True)


def _measurer(config_dict: dict[str, Any],
              env: Any = None) -> Callable[[Shape], tuple[list[float], list[float], float]]:
    """Times a shape's micro-batch as the trainer runs it (and its target forward alone), on the run's own target
    and drafter, with the threads a rank of ``env`` gets (its share of the cores; None: one rank). With several
    ranks the step sums the gradients over the process group first, as DDP does."""
    import torch

    from harness.train.config import run_config_from_dict
    from harness.train.distributed import Collectives, RankEnv
    from harness.train.launch.compose import models_config
    from harness.train.rank_models import DrafterModel, rank_device

    config = run_config_from_dict(config_dict)
    env = env or RankEnv()
    all_reduce = env.distributed
    comm = Collectives(env)
    device = rank_device(config.trainer, env)
    model = DrafterModel(models_config(config), device)
    optimizer = torch.optim.AdamW(model.parameters, lr=1e-4)
    vocab = int(model.target.embed_tokens.num_embeddings)
    drafter = model.drafter

    def measure(shape: Shape) -> tuple[list[float], list[float], float]:
        collate = shape_collate(shape, config, drafter, vocab)
        times, target_times, steps = [], [], []
        for repeat in range(REPEATS + 1):
            if all_reduce:
                comm.barrier()  # the ranks run each micro-batch together, sharing the cores as in training
            model.synchronize()
            started = time.perf_counter()
            # the target stage starts with the collate: a rank collates its own micro-batches (a target rank always,
            # a colocated rank when its loader has no workers, as on CPU; with workers it overlaps, and the stage
            # is then pessimistic by the collate's few milliseconds a micro-batch)
            batch = collate().to(device)
            with torch.no_grad():
                features = model.target(batch.tokens, gdn_backend=config.trainer.gdn_backend,
                                         tap_layer_ids=list(drafter.target_layer_ids))
            model.synchronize()
            targeted = time.perf_counter()
            if all_reduce:
                # the drafter stage starts together too: each stage is timed with every rank running it, as many
                # processes sharing the cores as the job has (else the ranks drift apart within a micro-batch and a
                # rank's drafter stage runs while others wait at the next barrier, faster than in a job)
                comm.barrier()
            drafter_started = time.perf_counter()
            with model.autocast():
                sums = model.objective(batch, features)
            (sums.weighted_ce_sum / max(batch.weight_sum, 1.0)).backward()
            model.synchronize()
            stepped = time.perf_counter()
            if all_reduce:
                comm.all_reduce_sum(torch.ones(1, dtype=torch.float64))  # the step's loss weight, as the trainer sums it
                grads = [p.grad for p in model.parameters if p.grad is not None]
                flat = torch.cat([g.flatten() for g in grads])  # one bucket, as DDP sends a small model's grads
                comm.all_reduce_sum(flat)
                torch._utils._unflatten_dense_tensors(flat, grads)
            torch.nn.utils.clip_grad_norm_(model.parameters, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            model.synchronize()
            if repeat:  # the first run warms up
                times.append((targeted - started) + (stepped - drafter_started))
                target_times.append(targeted - started)
                steps.append(time.perf_counter() - stepped)
        return times, target_times, statistics.median(steps)

    return measure


def shape_batch(shape: Shape, config: Any, drafter: Any, vocab: int) -> Any:
    """The host :class:`~harness.train.batch.TrainingBatch` of one design shape, collated as the run collates (its
    drafter's blocks, anchors and mask token), on synthetic samples."""
    return shape_collate(shape, config, drafter, vocab)()


def shape_collate(shape: Shape, config: Any, drafter: Any, vocab: int) -> Callable[[], Any]:
    """What collates one design shape's micro-batch as the run does (its samples read, anchors drawn, blocks laid
    out): called, it returns the host :class:`~harness.train.batch.TrainingBatch` (:func:`shape_batch`)."""
    from harness.train.batch import BatchCollator

    collate = BatchCollator(_synthetic_samples(shape.lengths, vocab), shape.layout, block_size=drafter.block_size,
                            num_anchors=config.drafter_config.num_anchors, mask_token_id=drafter.mask_token_id,
                            loss_decay_gamma=drafter.loss_decay_gamma, max_blocks=config.drafter_config.max_blocks,
                            anchor_seed=0)
    rows, lengths = np.arange(len(shape.lengths)), np.asarray(shape.lengths)
    return lambda: collate(rows, lengths, epoch=0)


def _synthetic_samples(lengths: tuple[int, ...], vocab: int) -> Any:
    """Samples of the given lengths, random ids (seeded), every token but the first supervised."""
    import pyarrow as pa
    from datasets import Dataset
    from datasets.table import InMemoryTable

    from harness.data.samples import TokenizedSamples

    rng = np.random.default_rng(0)
    ids = [rng.integers(1, vocab, size=length).tolist() for length in lengths]
    masks = [[0] + [1] * (length - 1) for length in lengths]
    table = pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32())),
                      "loss_mask": pa.array(masks, type=pa.list_(pa.int8()))})
    return TokenizedSamples(Dataset(InMemoryTable(table)), np.asarray(lengths, dtype=np.int64), "calibration",
                            "0" * 64)
