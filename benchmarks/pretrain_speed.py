"""Target pretraining speed on CPU: transformers' Qwen3_5ForCausalLM against batchlab's layers with gradients.

One training step = forward, next-token loss, backward, gradient clip and AdamW step, as
``harness.pretrain.target`` runs it. The same real tokens (a seeded draw of training windows of the
embedded default data: 800 stdlib definitions, vocab 1024, windows <= ``--max-tokens``) are trained on
three ways, each from the same initial weights:

* ``transformers, padded``: ``Qwen3_5ForCausalLM`` (torch fallback: no fla on CPU) on length-sorted
  right-padded batches (``strategies``' ``sorted`` plan, rows x longest <= ``--max-tokens``). It cannot
  take packed rows without fla (its GDN layers would carry state across documents);
* ``batchlab, padded``: ``HybridTarget.compute_logits`` on the very same padded batches (the
  implementation effect alone);
* ``batchlab, packed``: ``HybridTarget.compute_logits`` on packed rows (``packed`` plan, first-fit into
  rows of ``--max-tokens``; GDN state, short conv and attention restart at every document).

Layouts run back to back in a rotating order every repeat (same machine load); a layout's time is
the median over repeats after one warm-up round. Throughput is real (non-pad) tokens per second.
The loss of the first padded batch is compared across implementations (same weights) as a check.

    .venv/bin/python benchmarks/pretrain_speed.py            # print
    .venv/bin/python benchmarks/pretrain_speed.py --write    # also update benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from results_file import cpu_model, write_section

from harness.data.config import DataConfig
from harness.data.samples import heldout_split, load_samples
from harness.models.config import load_target_config
from harness.pretrain import lm
from harness.pretrain.target import (
    PretrainConfig,
    initial_model,
    make_optimizer,
    trainable_model,
)

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Target pretraining speed (CPU)"
THREADS_NOTE = (
    '- Measured at one torch thread (`--threads`, default 1). With two threads on this shared 2-core machine (load average 3-4 from other jobs at the time) every layout ran 3-10x slower and the ratio between implementations swung from 0.3x to 1.3x between runs: each of the many small ops waits at an OpenMP barrier for a descheduled thread, so those numbers measured the load, not the code. Separate per-batch timings at two threads under the same load put batchlab at 0.8-1.2x transformers.'
)
LAYOUTS = {  # name -> (implementation, layout)
    "transformers, padded": ("transformers", "padded"),
    "batchlab, padded": ("batchlab", "padded"),
    "batchlab, packed": ("batchlab", "packed"),
}


def chosen_windows(windows: lm.Windows, tokens: int, seed: int) -> lm.Windows:
    """A seeded draw of windows holding at least ``tokens`` real tokens."""
    order = np.random.default_rng(seed).permutation(len(windows))
    picked, total = [], 0
    for i in order.tolist():
        if total >= tokens:
            break
        picked.append(i)
        total += windows.ids[i].size
    return lm.Windows(ids=[windows.ids[i] for i in picked], masks=[windows.masks[i] for i in picked],
                      rows=windows.rows[picked])


def one_pass(model, implementation: str, batches, settings: PretrainConfig) -> float:
    """Seconds to train on every batch once (fresh optimizer)."""
    optimizer = make_optimizer(model, settings)
    params = [p for p in model.parameters() if p.requires_grad]
    started = time.perf_counter()
    for batch in batches:
        loss, _ = lm.mean_loss(model, batch, implementation)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        optimizer.step()
    return time.perf_counter() - started


def run(tokens: int, max_tokens: int, repeats: int, threads: int, seed: int, max_documents: int | None,
        vocab_size: int) -> dict:
    torch.set_num_threads(threads)
    data = DataConfig(max_documents=max_documents, vocab_size=vocab_size)
    samples = load_samples(data, progress=False)
    train_rows, _ = heldout_split(len(samples), data)
    windows = chosen_windows(lm.windows_of(samples, train_rows, max_tokens), tokens, seed)
    kwargs = dict(yaml.safe_load((REPO / "conf" / "target" / "tiny.yaml").read_text()))
    kwargs["vocab_size"] = samples.vocab_size
    config = load_target_config(kwargs)
    settings = PretrainConfig(max_tokens=max_tokens)
    reference = initial_model(config, seed)
    state = copy.deepcopy(reference.state_dict())
    batches = {}
    for name, (_, layout) in LAYOUTS.items():
        batches[name] = [lm.batch_of(windows, idx, layout)
                         for idx in lm.epoch_batches(windows, layout, max_tokens, seed, 0)]

    def fresh(implementation: str):
        reference.load_state_dict(state)
        return trainable_model(copy.deepcopy(reference), implementation)

    # parity check: the first padded batch's loss under both implementations, and packed
    first = batches["transformers, padded"][0]
    packed_first = lm.batch_of(windows, lm.epoch_batches(windows, "padded", max_tokens, seed, 0)[0], "packed")
    with torch.no_grad():
        losses = {
            "transformers": float(lm.mean_loss(fresh("transformers"), first, "transformers")[0]),
            "batchlab": float(lm.mean_loss(fresh("batchlab"), first, "batchlab")[0]),
            "batchlab packed": float(lm.mean_loss(fresh("batchlab"), packed_first, "batchlab")[0]),
        }

    names = list(LAYOUTS)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats + 1):  # round 0 warms up
        order = names[round_index % len(names):] + names[: round_index % len(names)]
        for name in order:
            implementation, _ = LAYOUTS[name]
            seconds = one_pass(fresh(implementation), implementation, batches[name], settings)
            if round_index:
                times[name].append(seconds)
    real = windows.num_tokens
    stats = {}
    for name in names:
        seconds = statistics.median(times[name])
        slots = sum(int(b.input_ids.numel()) for b in batches[name])
        stats[name] = {"batches": len(batches[name]), "slots": slots, "padding_efficiency": real / slots,
                       "seconds": seconds, "tokens_per_second": real / seconds,
                       "best_tokens_per_second": real / min(times[name]), "all_seconds": times[name]}
    return {"real_tokens": real, "windows": len(windows), "stats": stats, "losses": losses, "threads": threads,
            "max_tokens": max_tokens, "repeats": repeats, "vocab_size": samples.vocab_size,
            "source": samples.source}


def format_section(result: dict, command: str, load: tuple[float, float, float]) -> str:
    stats = result["stats"]
    base = stats["transformers, padded"]["tokens_per_second"]
    lines = [
        SECTION, "",
        f"Command: `{command}`  ",
        f"Date: {dt.date.today().isoformat()}  ",
        f"Machine: {cpu_model()}, {os.cpu_count()} CPU cores, {platform.system()} {platform.release()}, "
        f"torch {torch.__version__}, Python {platform.python_version()}, {result['threads']} torch thread(s)  ",
        f"Load average at start (1/5/15 min): {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}",
        "",
        f"One pretraining step (forward, next-token loss over all real tokens, backward, clip, AdamW) of "
        f"`conf/target/tiny.yaml` with vocab {result['vocab_size']}, fp32, over the same "
        f"{result['real_tokens']:,} real tokens ({result['windows']} training windows of the embedded default "
        f"data, <= {result['max_tokens']} tokens each) from the same initial weights; batches of at most "
        f"{result['max_tokens']} token slots. transformers' Qwen3_5ForCausalLM runs its torch fallback (no fla "
        "on CPU) and cannot take packed rows; batchlab is HybridTarget.compute_logits. Median of "
        f"{result['repeats']} repeats after one warm-up, layouts interleaved.",
        "",
        "| implementation, layout | batches | computed slots | padding efficiency | seconds | real tokens/s | best repeat tokens/s | vs transformers |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, s in stats.items():
        lines.append(f"| {name} | {s['batches']} | {s['slots']:,} | {s['padding_efficiency']:.1%} | "
                     f"{s['seconds']:.2f} | {s['tokens_per_second']:,.0f} | {s['best_tokens_per_second']:,.0f} | "
                     f"{s['tokens_per_second'] / base:.2f}x |")
    fastest = max(stats, key=lambda n: stats[n]["tokens_per_second"])
    losses = result["losses"]
    lines += [
        "",
        f"- Fastest: **{fastest}** ({stats[fastest]['tokens_per_second'] / base:.2f}x transformers, padded); "
        f"`PretrainConfig.implementation` defaults to `{PretrainConfig().implementation}` "
        f"({'packed rows' if PretrainConfig().implementation == 'batchlab' else 'padded batches'}).",
        f"- Same weights, first padded batch: loss {losses['transformers']:.6f} (transformers), "
        f"{losses['batchlab']:.6f} (batchlab, padded), {losses['batchlab packed']:.6f} (batchlab, the same "
        "documents packed).",
    ]
    if result["threads"] == 1:
        lines.append(THREADS_NOTE)
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=40_000, help="real tokens per measurement")
    parser.add_argument("--max-tokens", type=int, default=PretrainConfig().max_tokens)
    parser.add_argument("--repeats", type=int, default=3)
    # one thread by default: on a shared 2-core machine two OpenMP threads wait at every op's barrier
    # for a descheduled thread, and the many small ops of a tiny model then measure the load, not the code
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-documents", type=int, default=800)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    load = os.getloadavg()
    result = run(args.tokens, args.max_tokens, args.repeats, args.threads, args.seed, args.max_documents,
                 args.vocab_size)
    command = "python benchmarks/pretrain_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])
    section = format_section(result, command.strip(), load)
    print(section)
    if args.write:
        write_section(section, SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
