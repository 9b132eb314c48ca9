"""Planning benchmark: every strategy against Hugging Face's ``LengthGroupedSampler``, side by side.

On the ``chat-902k`` profile at ``max_tokens=16384`` and world size 8, in one run:

1. plan time of one epoch per strategy (median of ``--repeats`` runs after one warm-up run on the
   full data; the time of that first full-size run, which also computes bucket edges, is shown as
   "first run"; numba kernels are compiled before either, on a few samples) against the time the
   sampler takes to order the same lengths (same protocol);
2. padding efficiency, lag-1 ACF of the step mean length, composition recurrence (epochs 0 and 1)
   and rank imbalance of each plan and of the sampler's batches — 16 samples per batch, batch
   ``i`` on rank ``i % 8`` (how a distributed data loader deals them), so that 8 consecutive
   batches make one optimizer step and the ACF is measured per step (docs/design/metrics.md);
3. padding efficiency of ``bucketed`` with dp (budget-aware), dp_upper (the budget-free dp),
   quantile and equal_tokens edges at 4 to 64 buckets (edges computed by ``bucket_edges`` at the
   benchmark's budget and passed explicitly, so every column is the method named), and the time to
   compute each method's edges (cache cleared);
4. peak memory of planning 1M lengths per strategy, in a fresh subprocess: peak resident set size
   (``VmHWM`` after resetting it through ``/proc/self/clear_refs``) minus the resident size just
   before planning (after imports, the lengths and a warm-up on a few samples). Resident size,
   not tracemalloc, because numba's allocations are invisible to tracemalloc.

5. the small-dataset case: the top-level definitions of the running interpreter's standard library
   (profile ``stdlib-defs``, lengths = characters / 4, no tokenizer needed) at the same budget and
   world size — padding efficiency, micro-batch recurrence, step recurrence and length-mix excess
   of every strategy, and of ``bucketed`` at 2 to 64 dp buckets with and without its
   ``max_recurrence`` bound;
6. bucketed's default against ``length_grouped`` (Hugging Face's rule under the budget) on every
   dataset of the benchmark (``chat-902k``, a bimodal chat + reasoning mix, ``stdlib-defs``);
7. rank balance of ``bucketed`` on ``chat-902k``: ``same_bucket_steps`` and balance windows, with
   target, drafter and total rank imbalance and what each costs in step-level length mix.

Prints a markdown report with PASS/FAIL per goal of the planning issues; ``--write`` replaces the
"Planning (strategies)" section of ``benchmarks/RESULTS.md`` with it (command, machine, date).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO_ROOT))

import strategies  # noqa: E402
from harness.data.profiles import lognormal_lengths, profile_lengths  # noqa: E402
from strategies.edges import cached_edges, bucket_edges  # noqa: E402
from strategies.metrics import plan_metrics  # noqa: E402
from results_file import cpu_model, write_section  # noqa: E402

RESULTS_PATH = REPO_ROOT / "benchmarks" / "RESULTS.md"
SECTION_TITLE = "## Planning (strategies)"
PROFILE = "chat-902k"
MAX_TOKENS = 16384
WORLD_SIZE = 8
SAMPLER_BATCH_SIZE = 16
STRATEGY_NAMES = tuple(strategies.report_order())  # every registered strategy
SMALL_PROFILE = "stdlib-defs"
SMALL_BUCKET_COUNTS = (2, 4, 8, 16, 32, 64)
BALANCE_WINDOWS = (1, 4, 16)
EDGE_BUCKET_COUNTS = (4, 8, 16, 32, 64)
#: edge methods of the bucket-edge table, with their column labels
EDGE_TABLE_METHODS = {
    "dp": "dp (budget-aware)",
    "dp_upper": "dp_upper (sum of upper edges)",
    "quantile": "quantile",
    "equal_tokens": "equal_tokens",
}
MEMORY_SAMPLES = 1_000_000
WARMUP_SAMPLES = 4096
SHARED_MACHINE_NOTE = (
    "The machine was shared with other jobs while this ran, so absolute times are noisy; the "
    "comparisons were measured side by side in the same run."
)

# Goals of the planning issue.
MAX_PLAN_SECONDS = 0.5
MIN_SPEEDUP_VS_SAMPLER = 2.0
MIN_PACKED_EFFICIENCY = 0.995
MIN_BUCKETED_EFFICIENCY = 0.95
MAX_BUCKETED_ABS_ACF = 0.05
MIN_SORTED_EFFICIENCY = 0.99
MAX_PEAK_MEGABYTES = 200.0
# Goals of the small-dataset / diversity issue.
MAX_SMALL_RECURRENCE = 0.10
MIN_SMALL_EFFICIENCY = 0.80
MIN_CHAT_BUCKETED_EFFICIENCY = 0.97
MAX_CHAT_BUCKETED_RECURRENCE = 0.01
MAX_CHAT_BUCKETED_IMBALANCE = 1.04


def timed_runs(run: Callable[[int], Any], repeats: int) -> tuple[float, list[float], Any]:
    """``(first, repeats, last result)``: seconds of a first call, then of ``repeats`` more."""
    seconds = []
    result = None
    for attempt in range(repeats + 1):
        started = time.perf_counter()
        result = run(attempt)
        seconds.append(time.perf_counter() - started)
    return seconds[0], seconds[1:], result


def plan_strategy(lengths: np.ndarray, name: str, epoch: int, **options: Any) -> strategies.Plan:
    """One epoch of ``name`` at the benchmark's budget and world size."""
    return strategies.plan(
        lengths, strategies.Budget(MAX_TOKENS), strategy=name, seed=0, epoch=epoch, world_size=WORLD_SIZE, **options
    )


def sampler_order(length_list: list[int], seed: int) -> np.ndarray:
    """Indices in the order Hugging Face's ``LengthGroupedSampler`` yields them."""
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    generator = torch.Generator().manual_seed(seed)
    sampler = LengthGroupedSampler(SAMPLER_BATCH_SIZE, lengths=length_list, generator=generator)
    return np.fromiter(iter(sampler), dtype=np.int64, count=len(length_list))


def sampler_plan(lengths: np.ndarray, order: np.ndarray, epoch: int, world_size: int = WORLD_SIZE) -> strategies.Plan:
    """The sampler's batches as a plan: 16 per batch, batch ``i`` on rank ``i % world_size``, padded.

    The sampler has no token budget; ``Budget`` records the largest possible batch only.
    """
    num_batches = -(-order.size // SAMPLER_BATCH_SIZE)
    slots = -(-num_batches // world_size) * world_size
    offsets = np.minimum(np.arange(slots + 1, dtype=np.int64) * SAMPLER_BATCH_SIZE, order.size)
    return strategies.Plan(
        strategy="hf-length-grouped",
        layout="padded",
        lengths=lengths,
        sample_indices=order,
        micro_batch_offsets=offsets,
        budget=strategies.Budget(SAMPLER_BATCH_SIZE * int(lengths.max())),
        seed=0,
        epoch=epoch,
        world_size=world_size,
        grad_accum=1,
    )


def measure_strategies(lengths: np.ndarray, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for name in STRATEGY_NAMES:
        plan_strategy(lengths[:WARMUP_SAMPLES], name, 0)  # compiles the kernels
        first, runs, epoch0 = timed_runs(lambda attempt, name=name: plan_strategy(lengths, name, 0), repeats)
        epoch1 = plan_strategy(lengths, name, 1)
        metrics = plan_metrics(epoch0, next_epoch_plan=epoch1)
        info = {k: v for k, v in epoch0.info.items() if k != "edges"} if epoch0.info else {}
        if epoch0.info.get("edges") is not None:
            info["buckets"] = len(epoch0.info["edges"])
        rows.append({"name": name, "first": first, "median": statistics.median(runs), "info": info, **metrics})
    return rows


def measure_sampler(lengths: np.ndarray, repeats: int) -> dict[str, Any]:
    length_list = lengths.tolist()  # the sampler keeps a Python list; converting is not timed
    first, runs, order0 = timed_runs(lambda attempt: sampler_order(length_list, seed=0), repeats)
    order1 = sampler_order(length_list, seed=1)  # the next epoch reseeds the sampler
    metrics = plan_metrics(sampler_plan(lengths, order0, 0), next_epoch_plan=sampler_plan(lengths, order1, 1))
    # the same batches one per step (one rank): the per-batch ACF that single-GPU training sees
    per_batch_acf = plan_metrics(sampler_plan(lengths, order0, 0, world_size=1))["lag1_acf"]
    return {
        "name": "HF LengthGroupedSampler (16/batch)",
        "first": first,
        "median": statistics.median(runs),
        "per_batch_lag1_acf": per_batch_acf,
        **metrics,
    }


def measure_edges(lengths: np.ndarray) -> tuple[dict[tuple[str, int], float], dict[tuple[str, int], float]]:
    """``(efficiency, seconds)`` per (method, buckets): real padding efficiency of ``bucketed`` with
    those edges, and the time to compute the edges from the lengths with an empty cache."""
    budget = strategies.Budget(MAX_TOKENS)
    bucket_edges(lengths[:WARMUP_SAMPLES], 4, "dp", budget=budget)  # compiles the kernels
    efficiency, seconds = {}, {}
    for method in EDGE_TABLE_METHODS:
        for buckets in EDGE_BUCKET_COUNTS:
            cached_edges.cache_clear()
            started = time.perf_counter()
            edges = bucket_edges(lengths, buckets, method, budget=budget)
            seconds[(method, buckets)] = time.perf_counter() - started
            plan = plan_strategy(lengths, "bucketed", 0, num_buckets=buckets, edges=edges.tolist())
            efficiency[(method, buckets)] = float(plan.micro_batch_tokens().sum() / plan.micro_batch_slots().sum())
    return efficiency, seconds


MEMORY_PROBE = """
import json, resource, sys
import numpy as np
import strategies
from harness.data.profiles import lognormal_lengths

def resident_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field + " not in /proc/self/status")

name, samples = sys.argv[1], int(sys.argv[2])
lengths = lognormal_lengths(samples, median=600.0, sigma=1.0, min_length=16, max_length=8192, seed=1)
budget = strategies.Budget(16384)
strategies.plan(lengths[:4096], budget, strategy=name, world_size=8)
baseline = resident_kib("VmRSS")
try:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset the peak resident size (VmHWM) to the current one
    method = "VmHWM after clear_refs"
except OSError:
    method = "ru_maxrss (peak since start; may include start-up)"
plan = strategies.plan(lengths, budget, strategy=name, world_size=8)
peak = resident_kib("VmHWM") if method.startswith("VmHWM") else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
plan_bytes = plan.sample_indices.nbytes + plan.micro_batch_offsets.nbytes + plan.lengths.nbytes
print(json.dumps({"baseline_kib": baseline, "peak_kib": peak, "plan_bytes": plan_bytes, "method": method}))
"""


def bimodal_lengths() -> np.ndarray:
    """A chat + reasoning mix: 600K chat-like lengths (lognormal median 600, sigma 1.0) and 300K
    reasoning traces (median 4000, sigma 0.5), both clipped to [16, 8192], seeded."""
    chat = lognormal_lengths(600_000, median=600.0, sigma=1.0, min_length=16, max_length=8192, seed=11)
    reasoning = lognormal_lengths(300_000, median=4000.0, sigma=0.5, min_length=16, max_length=8192, seed=12)
    return np.concatenate([chat, reasoning])


def diversity_row(lengths: np.ndarray, name: str, **options: Any) -> dict[str, Any]:
    """Plan metrics of epoch 0 with recurrences between epochs 0 and 1 (target-only rank imbalance too)."""
    epoch0 = plan_strategy(lengths, name, 0, **options)
    metrics = plan_metrics(epoch0, next_epoch_plan=plan_strategy(lengths, name, 1, **options))
    metrics["buckets"] = len(epoch0.info["edges"]) if epoch0.info.get("edges") is not None else None
    return metrics


def measure_small_dataset() -> tuple[int, list[dict[str, Any]], dict[tuple[int, str], dict[str, Any]]]:
    """Every strategy, and bucketed by bucket count with and without its bound, on ``stdlib-defs``."""
    lengths = profile_lengths(SMALL_PROFILE)
    rows = [{"name": name, **diversity_row(lengths, name)} for name in STRATEGY_NAMES]
    rows.append({"name": "length_grouped (HF order)", **diversity_row(lengths, "length_grouped", shuffle_order=False)})
    by_buckets = {}
    for buckets in SMALL_BUCKET_COUNTS:
        for label, bound in (("unbounded", None), ("max_recurrence 0.1", 0.1)):
            by_buckets[(buckets, label)] = diversity_row(lengths, "bucketed", num_buckets=buckets, max_recurrence=bound)
    return int(lengths.size), rows, by_buckets


def measure_datasets(chat: np.ndarray) -> list[dict[str, Any]]:
    """bucketed's default against length_grouped on every dataset of the benchmark."""
    rows = []
    for label, lengths in ((PROFILE, chat), ("chat + reasoning mix", bimodal_lengths()),
                           (SMALL_PROFILE, profile_lengths(SMALL_PROFILE))):
        for name in ("bucketed", "length_grouped"):
            rows.append({"dataset": label, "name": name, **diversity_row(lengths, name)})
    return rows


def measure_balance(lengths: np.ndarray) -> list[dict[str, Any]]:
    """bucketed on chat-902k: same_bucket_steps x balance windows (target-only and full cost model)."""
    target_only = strategies.CostModel(c=0.0)
    rows = []
    for same_bucket_steps in (False, True):
        for window in (None, *BALANCE_WINDOWS[1:]):
            balance = None if window is None else strategies.RankBalance(window_steps=window)
            options = {"same_bucket_steps": same_bucket_steps, "balance": balance}
            epoch0 = plan_strategy(lengths, "bucketed", 0, **options)
            epoch1 = plan_strategy(lengths, "bucketed", 1, **options)
            metrics = plan_metrics(epoch0, next_epoch_plan=epoch1)
            metrics["target_only_imbalance"] = plan_metrics(epoch0, cost_model=target_only)["rank_imbalance"]
            rows.append({"same_bucket_steps": same_bucket_steps, "window": window, **metrics})
    return rows


def measure_memory(name: str) -> dict[str, Any]:
    completed = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, name, str(MEMORY_SAMPLES)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        check=True,
        timeout=300,
    )
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    result["delta_mb"] = (result["peak_kib"] - result["baseline_kib"]) / 1024
    return result


def machine_description() -> str:
    load = ", load average {:.1f} at start".format(os.getloadavg()[0]) if hasattr(os, "getloadavg") else ""
    return (
        f"{os.cpu_count()} CPU cores ({cpu_model()}), {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}{load}"
    )


def diversity_goals(
    small: list[dict], by_buckets: dict, datasets: list[dict], rows: list[dict]
) -> list[tuple[str, str, bool | str]]:
    """Goals of the small-dataset / diversity issue."""
    goals = []
    small_bucketed = next(row for row in small if row["name"] == "bucketed")
    best_unbounded = max(
        (row["padding_efficiency"] for (buckets, label), row in by_buckets.items()
         if label == "unbounded" and row["recurrence"] <= MAX_SMALL_RECURRENCE),
        default=float("nan"),
    )
    goals.append((
        f"{SMALL_PROFILE}: bucketed default recurrence <= {MAX_SMALL_RECURRENCE}",
        f"{small_bucketed['recurrence']:.3f}", small_bucketed["recurrence"] <= MAX_SMALL_RECURRENCE,
    ))
    goals.append((
        f"{SMALL_PROFILE}: bucketed default efficiency >= {MIN_SMALL_EFFICIENCY:.0%} (best unbounded dp at that "
        f"recurrence: {best_unbounded:.1%})",
        f"{small_bucketed['padding_efficiency']:.2%}", small_bucketed["padding_efficiency"] >= MIN_SMALL_EFFICIENCY,
    ))
    chat = next(row for row in rows if row["name"] == "bucketed")
    goals.append((f"{PROFILE}: bucketed default efficiency >= {MIN_CHAT_BUCKETED_EFFICIENCY:.0%}",
                  f"{chat['padding_efficiency']:.2%}", chat["padding_efficiency"] >= MIN_CHAT_BUCKETED_EFFICIENCY))
    goals.append((f"{PROFILE}: bucketed default recurrence <= {MAX_CHAT_BUCKETED_RECURRENCE}",
                  f"{chat['recurrence']:.4f}", chat["recurrence"] <= MAX_CHAT_BUCKETED_RECURRENCE))
    goals.append((f"{PROFILE}: bucketed default rank imbalance (target terms) <= {MAX_CHAT_BUCKETED_IMBALANCE}",
                  f"{chat['target_imbalance']:.3f}", chat["target_imbalance"] <= MAX_CHAT_BUCKETED_IMBALANCE))
    for label in dict.fromkeys(row["dataset"] for row in datasets):
        pair = {row["name"]: row for row in datasets if row["dataset"] == label}
        bucketed, grouped = pair["bucketed"], pair["length_grouped"]
        wins = bucketed["padding_efficiency"] >= grouped["padding_efficiency"] and bucketed["recurrence"] <= grouped["recurrence"]
        grouped_wins = grouped["padding_efficiency"] > bucketed["padding_efficiency"] and grouped["recurrence"] <= bucketed["recurrence"]
        verdict = "PASS" if wins else (
            "length_grouped better: batchlab-plan notes it" if grouped_wins
            else "trade-off: see docs/design/which-strategy.md"
        )
        goals.append((
            f"{label}: bucketed default pads no more than length_grouped at no higher recurrence "
            "(else docs/design/which-strategy.md and batchlab-plan say which to prefer); efficiency / recurrence",
            f"{bucketed['padding_efficiency']:.2%} / {bucketed['recurrence']:.4f} vs "
            f"{grouped['padding_efficiency']:.2%} / {grouped['recurrence']:.4f}",
            verdict,
        ))
    return goals


def goal_rows(rows: list[dict], sampler: dict, memory: dict[str, dict]) -> list[tuple[str, str, bool]]:
    by_name = {row["name"]: row for row in rows}
    goals = []
    for row in rows:
        goals.append((f"{row['name']}: plan one epoch <= {MAX_PLAN_SECONDS} s", f"{row['median']:.3f} s", row["median"] <= MAX_PLAN_SECONDS))
        speedup = sampler["median"] / row["median"]
        goals.append((f"{row['name']}: >= {MIN_SPEEDUP_VS_SAMPLER:g}x faster than the sampler", f"{speedup:.1f}x", speedup >= MIN_SPEEDUP_VS_SAMPLER))
    packed, bucketed, sorted_row = by_name["packed"], by_name["bucketed"], by_name["sorted"]
    goals.append((f"packed: efficiency >= {MIN_PACKED_EFFICIENCY:.1%}", f"{packed['padding_efficiency']:.2%}", packed["padding_efficiency"] >= MIN_PACKED_EFFICIENCY))
    goals.append((f"bucketed (dp): efficiency >= {MIN_BUCKETED_EFFICIENCY:.0%}", f"{bucketed['padding_efficiency']:.2%}", bucketed["padding_efficiency"] >= MIN_BUCKETED_EFFICIENCY))
    goals.append((f"bucketed (dp): abs(lag-1 ACF) <= {MAX_BUCKETED_ABS_ACF} (~0 by construction: the order is shuffled)", f"{bucketed['lag1_acf']:+.3f}", abs(bucketed["lag1_acf"]) <= MAX_BUCKETED_ABS_ACF))
    goals.append((f"sorted: efficiency >= {MIN_SORTED_EFFICIENCY:.0%}", f"{sorted_row['padding_efficiency']:.2%}", sorted_row["padding_efficiency"] >= MIN_SORTED_EFFICIENCY))
    for name, result in memory.items():
        goals.append((f"{name}: peak memory planning 1M lengths <= {MAX_PEAK_MEGABYTES:g} MB", f"{result['delta_mb']:.0f} MB", result["delta_mb"] <= MAX_PEAK_MEGABYTES))
    return goals


def _diversity_cells(row: dict) -> str:
    return (
        f"{row['padding_efficiency']:.2%} | {row['recurrence']:.4f} | {row['step_recurrence']:.4f} | "
        f"{row['length_mix_excess']:+.3f} | {row['lag1_acf']:+.3f}"
    )


def _verdict(ok: bool | str) -> str:
    return ok if isinstance(ok, str) else ("PASS" if ok else "FAIL")


def render_diversity(small_size: int, small: list[dict], by_buckets: dict, datasets: list[dict], balance: list[dict]) -> list[str]:
    """The small-dataset, baseline and rank-balance tables."""
    lines = [f"### Small dataset — `{SMALL_PROFILE}` ({small_size:,} top-level definitions of Python "
             f"{platform.python_version()}'s standard library, lengths = characters / 4), max_tokens={MAX_TOKENS}, "
             f"world_size={WORLD_SIZE}", ""]
    lines.append(
        "Recurrence: pairs sharing a micro-batch in epoch 0 that share one in epoch 1; step recurrence: the same "
        "for optimizer steps; mix excess: length-mix KL minus its random-reassignment baseline. "
        f"With {small_size:,} samples the epoch has only a few dozen steps, so the lag-1 ACF is noise "
        "(95% band about ±0.4)."
    )
    lines.append("")
    lines.append("| batching | padding efficiency | recurrence | step recurrence | mix excess | lag-1 ACF (step) | dp buckets used |")
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in small:
        lines.append(f"| {row['name']} | {_diversity_cells(row)} | {row['buckets'] or '-'} |")
    lines.append("")
    lines.append("`bucketed` by bucket count (dp edges, other options at their defaults; `unbounded` = `max_recurrence=None`, no minimum bucket population):")
    lines.append("")
    lines.append("| buckets (most) | bound | padding efficiency | recurrence | step recurrence | mix excess | lag-1 ACF (step) | buckets used |")
    lines.append("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (buckets, label), row in by_buckets.items():
        lines.append(f"| {buckets} | {label} | {_diversity_cells(row)} | {row['buckets']} |")
    lines.append("")
    lines.append("### bucketed (default) against length_grouped (Hugging Face's rule under the same budget), every dataset")
    lines.append("")
    lines.append("| dataset | batching | padding efficiency | recurrence | step recurrence | mix excess | lag-1 ACF (step) | micro-batches | rank imb. (target) |")
    lines.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in datasets:
        lines.append(f"| {row['dataset']} | {row['name']} | {_diversity_cells(row)} | {row['micro_batches']:,} | {row['target_imbalance']:.3f} |")
    lines.append("")
    lines.append(f"### Rank balance of bucketed — `{PROFILE}`, world_size={WORLD_SIZE}, grad_accum=1")
    lines.append("")
    lines.append(
        "Rank imbalance = mean over steps of max / mean rank cost. `target` = the target's terms only "
        "(`a·slots + b·Σlen²`, the figure before the drafter term), `drafter` = estimated drafter blocks alone, "
        "`total` = the full cost model (`+ c·blocks`). Balance windows regroup the micro-batches of w steps by "
        "total cost (`RankBalance(window_steps=w)`)."
    )
    lines.append("")
    lines.append("| same_bucket_steps | balance window | rank imb. target | drafter | total | step recurrence | mix excess | lag-1 ACF (step) |")
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in balance:
        lines.append(
            f"| {row['same_bucket_steps']} | {row['window'] or 'off'} | {row['target_only_imbalance']:.3f} | "
            f"{row['drafter_imbalance']:.3f} | {row['rank_imbalance']:.3f} | {row['step_recurrence']:.4f} | "
            f"{row['length_mix_excess']:+.3f} | {row['lag1_acf']:+.3f} |"
        )
    lines.append("")
    return lines


def render(rows, sampler, edges, edge_seconds, memory, goals, repeats: int, command: str, diversity: list[str] | None = None) -> str:
    lines = [SECTION_TITLE, ""]
    lines.append(f"Command: `{command}` · machine: {machine_description()} · date: {dt.date.today().isoformat()}.")
    lines.append(SHARED_MACHINE_NOTE)
    lines.append("")
    lines.append(
        f"### Plan time and quality — `{PROFILE}` (902,000 lengths), max_tokens={MAX_TOKENS}, world_size={WORLD_SIZE}"
    )
    lines.append("")
    lines.append(
        f"Time: median of {repeats} runs after one warm-up run (\"first run\"; kernels compiled beforehand on "
        f"{WARMUP_SAMPLES} samples). The sampler is timed ordering the same lengths (list already built), "
        f"{SAMPLER_BATCH_SIZE} samples per batch, batch i on rank i % {WORLD_SIZE}; its ACF is per optimizer step."
    )
    lines.append("")
    lines.append("| batching | plan s (median) | first run s | speed-up vs sampler | padding efficiency | lag-1 ACF (step) | recurrence e0→e1 | step recurrence | mix excess | rank imb. (target) | drafter imb. | micro-batches | steps |")
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in [*rows, sampler]:
        speedup = sampler["median"] / row["median"]
        label = row["name"] + (f" ({row['info']['buckets']} dp buckets)" if row.get("info", {}).get("buckets") else "")
        lines.append(
            f"| {label} | {row['median']:.3f} | {row['first']:.3f} | {speedup:.1f}× | {row['padding_efficiency']:.2%} | "
            f"{row['lag1_acf']:+.3f} | {row['recurrence']:.4f} | {row['step_recurrence']:.4f} | {row['length_mix_excess']:+.3f} | "
            f"{row['target_imbalance']:.3f} | {row['drafter_imbalance']:.3f} | {row['micro_batches']:,} | {row['steps']:,} |"
        )
    lines.append("")
    lines.append(
        f"The sampler's lag-1 ACF per batch (its batches one per step, world size 1): "
        f"{sampler['per_batch_lag1_acf']:+.3f}; per optimizer step of {WORLD_SIZE} batches (table): "
        f"{sampler['lag1_acf']:+.3f}."
    )
    lines.append("")
    lines.append("Anchors (docs/design/reference-numbers.md): sampler 0.70 s, 92.2% efficiency, lag-1 ACF 0.63; "
                 "random batches 25%.")
    lines.append("")
    lines.append("### Bucket edges — padding efficiency of `bucketed`, same data, budget and world size")
    lines.append("")
    lines.append(
        "Edges from `bucket_edges(lengths, buckets, method, budget=Budget(max_tokens))`, passed to `bucketed` "
        "explicitly. `dp` minimises the padded slots expected at the budget; `dp_upper` (the dp before "
        "the budget-aware objective) minimises the sum of upper edges."
    )
    lines.append("")
    lines.append("| buckets | " + " | ".join(EDGE_TABLE_METHODS.values()) + " |")
    lines.append("| ---: | " + " | ".join("---:" for _ in EDGE_TABLE_METHODS) + " |")
    for buckets in EDGE_BUCKET_COUNTS:
        lines.append(f"| {buckets} | " + " | ".join(f"{edges[(m, buckets)]:.2%}" for m in EDGE_TABLE_METHODS) + " |")
    lines.append(
        "| edges s (4 / 64 buckets) | "
        + " | ".join(
            f"{edge_seconds[(m, EDGE_BUCKET_COUNTS[0])]:.3f} / {edge_seconds[(m, EDGE_BUCKET_COUNTS[-1])]:.3f}"
            for m in EDGE_TABLE_METHODS
        )
        + " |"
    )
    lines.append("")
    lines.append("### Peak memory of planning 1,000,000 lengths (fresh process per strategy)")
    lines.append("")
    method = next(iter(memory.values()))["method"] if memory else "-"
    lines.append(f"Peak resident size during `plan()` minus resident size just before it ({method}).")
    lines.append("")
    lines.append("| strategy | peak above baseline MB | plan arrays MB |")
    lines.append("| --- | ---: | ---: |")
    for name, result in memory.items():
        lines.append(f"| {name} | {result['delta_mb']:.0f} | {result['plan_bytes'] / 2**20:.0f} |")
    lines.append("")
    lines.extend(diversity or [])
    lines.append("### Goals")
    lines.append("")
    lines.append("| goal | measured | result |")
    lines.append("| --- | ---: | --- |")
    for goal, measured, ok in goals:
        lines.append(f"| {goal} | {measured} | {_verdict(ok)} |")
    return "\n".join(lines) + "\n"



def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the markdown report; ``--write`` also updates RESULTS.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up (default 3)")
    parser.add_argument("--skip-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--write", action="store_true", help=f"update the planning section of {RESULTS_PATH.name}")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    lengths = profile_lengths(PROFILE)
    print(f"planning {lengths.size:,} lengths ...", file=sys.stderr)
    rows = measure_strategies(lengths, args.repeats)
    print("Hugging Face sampler ...", file=sys.stderr)
    sampler = measure_sampler(lengths, args.repeats)
    print("bucket edges ...", file=sys.stderr)
    edges, edge_seconds = measure_edges(lengths)
    memory = {}
    if not args.skip_memory:
        for name in STRATEGY_NAMES:
            print(f"peak memory: {name} ...", file=sys.stderr)
            memory[name] = measure_memory(name)
    print(f"small dataset ({SMALL_PROFILE}), baselines, rank balance ...", file=sys.stderr)
    small_size, small, by_buckets = measure_small_dataset()
    datasets = measure_datasets(lengths)
    balance = measure_balance(lengths)
    goals = goal_rows(rows, sampler, memory) + diversity_goals(small, by_buckets, datasets, rows)
    command = "python benchmarks/plan_speed.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    diversity = render_diversity(small_size, small, by_buckets, datasets, balance)
    section = render(rows, sampler, edges, edge_seconds, memory, goals, args.repeats, command, diversity)
    print(section)
    for goal, measured, ok in goals:
        print(f"{_verdict(ok)}: {goal} ({measured})", file=sys.stderr)
    if args.write:
        write_section(section, SECTION_TITLE, RESULTS_PATH)
        print(f"updated {RESULTS_PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
