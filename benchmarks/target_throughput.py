"""Target forward throughput: padded batches as sorted and shuffled plans make them, and packed rows.

Draws document lengths from a scaled-down version of the chat-902k lognormal (docs/design/data-flow.md and
docs/design/reference-numbers.md: median 600, sigma 1.0, cap 8192; here divided by ``--scale``) until ``--tokens`` real tokens, then
runs the tiny target (``conf/target/tiny.yaml``, random weights) over the same real tokens laid out
five ways:

* ``sorted, equal lengths``: the best case of length sorting on a large dataset - as many
  documents, each of near-equal length (the mean, +-5%), in one right-padded batch;
* ``sorted plan`` / ``shuffle plan`` / ``packed plan``: the SAME lognormal documents in the
  micro-batches that ``strategies.plan`` makes under ``Budget(--max-tokens)`` (padded batches, or
  packed rows of at most ``--max-tokens`` tokens with ``cu_seqlens``);
* ``packed, one row``: every document in one ``[1, T]`` row.

The equal-length batch has other documents than the rest: attention is quadratic in document
length, so a lognormal set costs more attention than an equal-length one with the same tokens; the
plan rows compare like with like. Every repeat runs the layouts back to back in a rotating order so
they see the same machine load; a layout's time is the median over repeats (after one warm-up round)
of the sum over its micro-batches. Throughput is real (non-pad) tokens per second. The goal: the
packed plan >= the sorted plan of the same documents.

    .venv/bin/python benchmarks/target_throughput.py            # print
    .venv/bin/python benchmarks/target_throughput.py --write    # also update benchmarks/RESULTS.md
    python benchmarks/target_throughput.py --device cuda --dtype bfloat16 \
        --config conf/target/qwen3.6-27b.yaml --layers 4 --scale 1 --tokens 262144 --max-tokens 16384

On CUDA the kernels are fla's and flash-attn's / FlexAttention's, the clock is read after a device
synchronize, and the section is "Target forward throughput (CUDA)". ``--layers`` keeps the first N
layers of a config (its layer pattern continues), e.g. one 3 x GDN + 1 x attention period of the 27B.
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
from typing import Any

import numpy as np
import torch

from harness.models.layout import TokenBatch
from harness.models.target import HybridTarget
from results_file import cpu_model, write_section

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "RESULTS.md"
SECTION = "## Target forward throughput (CPU)"
CUDA_SECTION = "## Target forward throughput (CUDA)"
LAYOUTS = ("sorted, equal lengths", "sorted plan", "shuffle plan", "packed plan", "packed, one row")


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


def planned_batches(docs: list[torch.Tensor], strategy: str, max_tokens: int, seed: int) -> list[TokenBatch]:
    """The micro-batches ``strategies.plan`` makes of ``docs`` (one epoch, one rank)."""
    import strategies

    lengths = np.array([doc.numel() for doc in docs])
    plan = strategies.plan(lengths, strategies.Budget(max_tokens), strategy=strategy, seed=seed)
    layout = plan.layout
    return [
        TokenBatch.from_documents([docs[i] for i in micro_batch], layout)
        for _, micro_batches in plan.rank_steps(0)
        for micro_batch in micro_batches
        if micro_batch.size
    ]


def build_layouts(lengths: list[int], vocab_size: int, max_tokens: int, seed: int) -> dict[str, list[TokenBatch]]:
    """Each layout of :data:`LAYOUTS` as its list of micro-batches; all hold the same number of real tokens."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]
    equal_docs = [torch.randint(0, vocab_size, (n,), generator=gen) for n in near_equal_lengths(lengths, seed)]
    return {
        "sorted, equal lengths": [TokenBatch.from_documents(equal_docs, "padded")],
        "sorted plan": planned_batches(docs, "sorted", max_tokens, seed),
        "shuffle plan": planned_batches(docs, "shuffle", max_tokens, seed),
        "packed plan": planned_batches(docs, "packed", max_tokens, seed),
        "packed, one row": [TokenBatch.from_documents(docs, "packed")],
    }


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that the host clock measures it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_layouts(model: HybridTarget, layouts: dict[str, list[TokenBatch]], repeats: int, gdn_backend: str) -> dict:
    """Median seconds per layout (all its micro-batches) over ``repeats`` interleaved rounds after a warm-up."""
    last_layer = model.num_layers - 1
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for round_index in range(repeats + 1):  # round 0 is the warm-up
        shift = round_index % len(LAYOUTS)
        for name in LAYOUTS[shift:] + LAYOUTS[:shift]:
            synchronize(model.device)
            start = time.perf_counter()
            for batch in layouts[name]:
                model(batch, tap_layer_ids=[last_layer], gdn_backend=gdn_backend)
            synchronize(model.device)
            if round_index:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(times[name]) for name in LAYOUTS}


def target_config(config: str, layers: int | None) -> Any:
    """The target config at ``config``, cut to its first ``layers`` layers when given."""
    from harness.models.config import load_target_config

    loaded = load_target_config(config)
    if layers is None:
        return loaded
    if not 1 <= layers <= loaded.num_hidden_layers:
        raise ValueError(f"--layers must be in [1, {loaded.num_hidden_layers}] for {config}, got {layers}")
    loaded.layer_types = list(loaded.layer_types[:layers])
    loaded.num_hidden_layers = layers
    return load_target_config(loaded)  # checked again


def run(config: str, tokens: int, scale: float, repeats: int, seed: int, gdn_backend: str,
        thread_counts: list[int], max_tokens: int, device: str = "cpu", dtype: str = "float32",
        layers: int | None = None) -> dict:
    """Time the layouts side by side at each thread count; per-layout stats and packed/sorted ratios."""
    torch.manual_seed(seed)
    device_ = torch.device(device)
    with device_:  # build the weights where they run (a 27B-shaped layer stack is slow to init on CPU)
        model = HybridTarget(target_config(config, layers), dtype=getattr(torch, dtype))
    lengths = chat_like_lengths(tokens, scale, seed)
    layouts = {name: [batch.to(device_) for batch in batches]
               for name, batches in build_layouts(lengths, model.config.vocab_size, max_tokens, seed).items()}
    real = sum(lengths)
    default_threads = torch.get_num_threads()
    by_threads = {}
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            seconds = time_layouts(model, layouts, repeats, gdn_backend)
            stats = {}
            for name in LAYOUTS:
                slots = sum(batch.input_ids.numel() for batch in layouts[name])
                stats[name] = {
                    "micro_batches": len(layouts[name]),
                    "slots": slots,
                    "padding_efficiency": real / slots,
                    "seconds": seconds[name],
                    "real_tokens_per_s": real / seconds[name],
                }
            by_threads[threads] = {"stats": stats}
    finally:
        torch.set_num_threads(default_threads)
    return {"lengths": lengths, "real_tokens": real, "by_threads": by_threads}


def format_section(result: dict, args: argparse.Namespace, command: str) -> str:
    """The RESULTS.md section (heading included) for one run."""
    lengths = np.array(result["lengths"])
    load = os.getloadavg()
    on_cuda = args.device.startswith("cuda")
    gpu = f"{torch.cuda.get_device_name(torch.device(args.device))}, " if on_cuda else ""
    lines = [
        CUDA_SECTION if on_cuda else SECTION,
        "",
        f"Command: `{command}`  ",
        f"Date: {dt.date.today().isoformat()}  ",
        f"Machine: {gpu}{cpu_model()}, {os.cpu_count()} CPU cores, {platform.system()} {platform.release()}, "
        f"torch {torch.__version__}, Python {platform.python_version()}  ",
        f"Load average at start (1/5/15 min): {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
        + ("; the machine was shared with other jobs during the run, so absolute numbers are noisy - "
           "the layouts ran interleaved, so compare the ratios." if args.shared else ""),
        "",
        f"Target `{args.config}`{f' cut to {args.layers} layers' if args.layers else ''} (random weights, "
        f"{args.dtype}, forward to the last layer, GDN backend "
        f"`{args.gdn_backend}`). {len(lengths)} documents, {result['real_tokens']} real tokens, lengths "
        f"lognormal median {600 / args.scale:.0f}, sigma 1.0, cap {8192 / args.scale:.0f} (chat-902k / "
        f"{args.scale:g}); observed min {lengths.min()}, median {int(np.median(lengths))}, max {lengths.max()}. "
        f"`sorted, equal lengths` holds as many documents and real tokens, each of near-equal length (mean +-5%), "
        f"in one padded batch; the `plan` layouts are the same lognormal documents in the micro-batches of "
        f"`strategies.plan(..., Budget({args.max_tokens}))` (padded batches, or packed rows of at most "
        f"{args.max_tokens} tokens); `packed, one row` holds every document in one row. Run-to-run noise on "
        f"this machine is about +-5-10% per layout. "
        f"Median of {args.repeats} repeats after one warm-up, layouts interleaved, at each torch thread count.",
        "",
        "| threads | layout | micro-batches | computed slots | padding efficiency | seconds | real tokens/s |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for threads, measured in result["by_threads"].items():
        for name in LAYOUTS:
            s = measured["stats"][name]
            lines.append(
                f"| {threads} | {name} | {s['micro_batches']} | {s['slots']} | {s['padding_efficiency']:.1%} | "
                f"{s['seconds']:.3f} | {s['real_tokens_per_s']:,.0f} |"
            )
    lines.append("")
    for threads, measured in result["by_threads"].items():
        speed = {name: measured["stats"][name]["real_tokens_per_s"] for name in LAYOUTS}
        goal = speed["packed plan"] / speed["sorted plan"]
        one_row = speed["packed, one row"] / speed["sorted, equal lengths"]
        shuffle_ratio = speed["shuffle plan"] / speed["sorted plan"]
        lines.append(
            f"- {threads} thread(s): goal packed plan / sorted plan (same documents) >= 1: **{goal:.2f}x** "
            f"({'met' if goal >= 1.0 else 'NOT met'}); for reference, packed, one row / sorted, equal lengths "
            f"{one_row:.2f}x (other documents: equal lengths spare the padded batch the long documents' "
            f"quadratic attention); shuffle plan / sorted plan {shuffle_ratio:.2f}x."
        )
    lines.append("")
    return "\n".join(lines)



def main(argv: list[str] | None = None) -> dict:
    """Command-line entry point; returns the result dict."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="conf/target/tiny.yaml")
    parser.add_argument("--tokens", type=int, default=32768, help="real tokens to draw (at least)")
    parser.add_argument("--scale", type=float, default=8.0, help="divide chat-902k's median and cap by this")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=2048, help="budget of the planned micro-batches")
    parser.add_argument(
        "--threads",
        default=f"1,{torch.get_num_threads()}",
        help="comma list of torch thread counts to measure (default: 1 and torch's default)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gdn-backend", default="auto")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--layers", type=int, default=None, help="keep only the config's first N layers")
    parser.add_argument("--shared", action="store_true", help="note in RESULTS.md that the machine was shared")
    parser.add_argument("--write", action="store_true", help="update the section in benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    try:
        thread_counts = sorted({int(part) for part in args.threads.split(",") if part.strip()})
    except ValueError:
        parser.error(f"--threads must be a comma list of positive integers, got {args.threads!r}")
    if not thread_counts or min(thread_counts) < 1:
        parser.error(f"--threads must be a comma list of positive integers, got {args.threads!r}")
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            parser.error(f"--device {args.device} needs a GPU that torch can see")
        thread_counts = [torch.get_num_threads()]  # host threads barely matter on the GPU: measure once
    result = run(args.config, args.tokens, args.scale, args.repeats, args.seed, args.gdn_backend, thread_counts,
                 args.max_tokens, args.device, args.dtype, args.layers)
    command = "python benchmarks/target_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:])
    section = format_section(result, args, command.strip())
    print(section)
    if args.write:
        write_section(section, CUDA_SECTION if args.device.startswith("cuda") else SECTION, RESULTS)
    return result


if __name__ == "__main__":
    main()
