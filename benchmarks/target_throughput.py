"""Target forward throughput on CPU: a sorted-like padded batch, a shuffle-like padded batch and a packed row.

Draws document lengths from a scaled-down version of the chat-902k lognormal (DESIGN.md section 7:
median 600, sigma 1.0, cap 8192; here divided by ``--scale``) until ``--tokens`` real tokens, then
runs the tiny target (``conf/target/tiny.yaml``, random weights) over three batches with the same
number of documents and the same number of real tokens:

* ``sorted``: what a length-sorted batch looks like on a large dataset - documents of near-equal
  length (the mean length, +-5%), right-padded to the longest, so almost no padding;
* ``shuffle``: the lognormal documents in one right-padded batch, padded to the longest;
* ``packed``: the same lognormal documents in one ``[1, T]`` row with ``cu_seqlens`` (exact
  per-document GDN and attention).

Every repeat runs the three batches back to back in a rotating order so they see the same machine
load; the reported time of a batch is the median over repeats (after one warm-up round).
Throughput is real (non-pad) tokens per second. The goal: packed >= sorted.

    .venv/bin/python benchmarks/target_throughput.py            # print
    .venv/bin/python benchmarks/target_throughput.py --write    # also update benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from harness.models.layout import TokenBatch
from harness.models.target import HybridTarget

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "RESULTS.md"
SECTION = "## Target forward throughput (CPU)"
LAYOUTS = ("sorted", "shuffle", "packed")


def chat_like_lengths(total_tokens: int, scale: float, seed: int) -> list[int]:
    """Lognormal lengths (median 600/scale, sigma 1.0, cap 8192/scale, >= 1) drawn until ``total_tokens``."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < total_tokens:
        draw = rng.lognormal(mean=np.log(600 / scale), sigma=1.0)
        lengths.append(int(min(max(1, round(draw)), 8192 / scale)))
    return lengths


def near_equal_lengths(lengths: list[int], seed: int, spread: float = 0.05) -> list[int]:
    """As many lengths as ``lengths``, each within ``spread`` of their mean, with exactly the same sum."""
    rng = np.random.default_rng(seed)
    mean = sum(lengths) / len(lengths)
    equal = [max(1, int(round(mean * f))) for f in rng.uniform(1 - spread, 1 + spread, len(lengths))]
    equal[int(np.argmin(equal))] += sum(lengths) - sum(equal)  # fix the total on the shortest one
    if min(equal) < 1:
        raise ValueError(f"cannot make {len(lengths)} near-equal lengths summing to {sum(lengths)}")
    return equal


def build_layouts(lengths: list[int], vocab_size: int, seed: int) -> dict[str, TokenBatch]:
    """Sorted-like padded, shuffle-like padded and packed batches with the same real-token count."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]
    equal_docs = [torch.randint(0, vocab_size, (n,), generator=gen) for n in near_equal_lengths(lengths, seed)]
    return {
        "sorted": TokenBatch.from_documents(equal_docs, "padded"),
        "shuffle": TokenBatch.from_documents(docs, "padded"),
        "packed": TokenBatch.from_documents(docs, "packed"),
    }


def run(config: str, tokens: int, scale: float, repeats: int, seed: int, gdn_backend: str) -> dict:
    """Time the three layouts side by side; return lengths, per-layout stats and the packed/sorted ratio."""
    torch.manual_seed(seed)
    model = HybridTarget(config)
    last_layer = model.num_layers - 1
    lengths = chat_like_lengths(tokens, scale, seed)
    layouts = build_layouts(lengths, model.config.vocab_size, seed)
    real = sum(lengths)
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for round_index in range(repeats + 1):  # round 0 is the warm-up
        shift = round_index % len(LAYOUTS)
        for name in LAYOUTS[shift:] + LAYOUTS[:shift]:
            start = time.perf_counter()
            model(layouts[name], tap_layer_ids=[last_layer], gdn_backend=gdn_backend)
            if round_index:
                times[name].append(time.perf_counter() - start)
    stats = {}
    for name in LAYOUTS:
        slots = layouts[name].input_ids.numel()
        seconds = statistics.median(times[name])
        stats[name] = {
            "slots": slots,
            "shape": "x".join(str(d) for d in layouts[name].input_ids.shape),
            "padding_efficiency": real / slots,
            "seconds": seconds,
            "real_tokens_per_s": real / seconds,
        }
    return {
        "lengths": lengths,
        "real_tokens": real,
        "stats": stats,
        "packed_over_sorted": stats["packed"]["real_tokens_per_s"] / stats["sorted"]["real_tokens_per_s"],
    }


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else the platform's processor string."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def format_section(result: dict, args: argparse.Namespace, command: str) -> str:
    """The RESULTS.md section (heading included) for one run."""
    lengths = np.array(result["lengths"])
    load = os.getloadavg()
    lines = [
        SECTION,
        "",
        f"Command: `{command}`  ",
        f"Date: {dt.date.today().isoformat()}  ",
        f"Machine: {cpu_model()}, {os.cpu_count()} CPU cores, {platform.system()} {platform.release()}, "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads, Python {platform.python_version()}  ",
        f"Load average at start (1/5/15 min): {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
        + ("; the machine was shared with other jobs during the run, so absolute numbers are noisy - "
           "the layouts ran interleaved, so compare the ratios." if args.shared else ""),
        "",
        f"Target `{args.config}` (random weights, fp32, forward to the last layer, GDN backend "
        f"`{args.gdn_backend}`). {len(lengths)} documents, {result['real_tokens']} real tokens, lengths "
        f"lognormal median {600 / args.scale:.0f}, sigma 1.0, cap {8192 / args.scale:.0f} (chat-902k / "
        f"{args.scale:g}); observed min {lengths.min()}, median {int(np.median(lengths))}, max {lengths.max()}. "
        f"The sorted-like batch has as many documents and real tokens, each of near-equal length (mean +-5%). "
        f"Median of {args.repeats} repeats after one warm-up, layouts interleaved.",
        "",
        "| layout | shape | computed slots | padding efficiency | seconds | real tokens/s |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for name in LAYOUTS:
        s = result["stats"][name]
        lines.append(
            f"| {name} | {s['shape']} | {s['slots']} | {s['padding_efficiency']:.1%} | "
            f"{s['seconds']:.3f} | {s['real_tokens_per_s']:,.0f} |"
        )
    shuffle_ratio = result["stats"]["shuffle"]["real_tokens_per_s"] / result["stats"]["sorted"]["real_tokens_per_s"]
    goal = "met" if result["packed_over_sorted"] >= 1.0 else "NOT met"
    lines += [
        "",
        f"packed / sorted real tokens/s: **{result['packed_over_sorted']:.2f}x** (goal >= 1: {goal}); "
        f"shuffle / sorted: {shuffle_ratio:.2f}x.",
        "",
    ]
    return "\n".join(lines)


def write_section(section: str, path: Path = RESULTS) -> None:
    """Replace this benchmark's section of RESULTS.md (up to the next ``## `` heading), or append it."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == SECTION), None)
    if start is None:
        new_text = text.rstrip("\n") + "\n\n" + section
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        tail = "".join(lines[end:])
        new_text = "".join(lines[:start]) + section + ("\n" + tail if tail else "")
    path.write_text(new_text)


def main(argv: list[str] | None = None) -> dict:
    """Command-line entry point; returns the result dict."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="conf/target/tiny.yaml")
    parser.add_argument("--tokens", type=int, default=8192, help="real tokens to draw (at least)")
    parser.add_argument("--scale", type=float, default=8.0, help="divide chat-902k's median and cap by this")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gdn-backend", default="auto")
    parser.add_argument("--shared", action="store_true", help="note in RESULTS.md that the machine was shared")
    parser.add_argument("--write", action="store_true", help="update the section in benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    result = run(args.config, args.tokens, args.scale, args.repeats, args.seed, args.gdn_backend)
    command = "python benchmarks/target_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:])
    section = format_section(result, args, command.strip())
    print(section)
    if args.write:
        write_section(section)
    return result


if __name__ == "__main__":
    main()
