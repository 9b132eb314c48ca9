"""The DFlash drafter's training step per attention path: tokens/s and peak memory, side by side.

One step = the drafter's forward on synthetic target features, the decayed loss, backward, gradient
clipping and AdamW (fp32, one thread), on three shapes:

* ``demo``: the tiny drafter of ``make demo`` (2 layers, hidden 64, block 8) on 2,048-token packed rows
  of lognormal documents (median 170 tokens), 16 anchors a document;
* ``large``: one layer at hidden 1,024 (8 heads, 2 KV heads, head dim 128), block 16, on an 8,192-token
  row of 10 lognormal documents with 512 blocks;
* ``large-8k``: the same model on one 8,192-token document with 512 blocks (the reference data's longest).

Paths: ``sdpa`` (fused attention per chunk of a document's blocks, the CPU default) and ``dense`` (the
einsum reference that keeps every score for the backward). Each (shape, path) runs in a fresh process
(peak RSS is per process): setup, one warm-up step, then ``--steps`` timed steps; the step's memory is
the peak RSS over the warm-up and the steps minus the RSS before them (the AdamW state included, the
same for every path). Rounds alternate the paths; ratios are per round,
the median reported.

    python benchmarks/drafter_step.py                       # print the table
    python benchmarks/drafter_step.py --write               # also rewrite its section of RESULTS.md
    python benchmarks/drafter_step.py --shapes demo --rounds 5
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from results_file import cpu_model, write_section  # noqa: E402

TITLE = "## Drafter training step per attention path (CPU)"
SHAPES = {
    "demo": {"drafter": {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                         "intermediate_size": 128, "block_size": 8, "num_anchors": 16},
             "hidden": 64, "vocab": 257, "taps": 2, "row_tokens": 2048, "documents": None},
    "large": {"drafter": {"num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
                          "intermediate_size": 3072, "block_size": 16, "num_anchors": 512, "max_blocks": 512},
              "hidden": 1024, "vocab": 8192, "taps": 3, "row_tokens": 8192, "documents": 10},
    "large-8k": {"drafter": {"num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 2,
                             "head_dim": 128, "intermediate_size": 3072, "block_size": 16, "num_anchors": 512,
                             "max_blocks": 512},
                 "hidden": 1024, "vocab": 8192, "taps": 3, "row_tokens": 8192, "documents": 1},
}
PATHS = ("sdpa", "dense")


def document_lengths(row_tokens: int, documents: int | None, seed: int) -> list[int]:
    """Lognormal document lengths filling one row: ``documents`` of them scaled to the row, or as many
    as fit (median 170) when None."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if documents == 1:
        return [row_tokens]
    if documents is not None:
        draws = rng.lognormal(0.0, 1.0, documents)
        lengths = np.maximum(2, np.floor(draws / draws.sum() * row_tokens)).astype(int)
        lengths[-1] += row_tokens - lengths.sum()
        return lengths.tolist()
    lengths, total = [], 0
    while True:
        length = int(np.clip(round(rng.lognormal(np.log(170), 1.0)), 13, row_tokens))
        if total + length > row_tokens:
            break
        lengths.append(length)
        total += length
    return lengths


def current_rss_kib() -> int:
    """This process's resident memory now, KiB (Linux)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() // 1024


def measure(shape_name: str, path: str, steps: int, seed: int) -> dict:
    """One (shape, path) in this process: tokens/s over ``steps`` steps and the steps' peak memory."""
    import torch
    from torch import nn

    from harness.models.drafter import DFlashDrafter, load_drafter_config
    from harness.models.drafter_inputs import DrafterInputs
    from harness.models.layout import TokenBatch

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    shape = SHAPES[shape_name]
    hidden, vocab = shape["hidden"], shape["vocab"]
    config = load_drafter_config({**shape["drafter"], "attention_backend": path,
                                  "target_layer_ids": list(range(1, shape["taps"] + 1))})
    embed, head = nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab, bias=False)
    drafter = DFlashDrafter(config, embed, head, shape["taps"] + 2)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)
    lengths = document_lengths(shape["row_tokens"], shape["documents"], seed)
    generator = torch.Generator().manual_seed(seed)
    batch = TokenBatch.from_documents([torch.randint(0, vocab, (n,), generator=generator) for n in lengths], "packed")
    tokens = sum(lengths)
    features = [torch.randn(1, tokens, hidden, generator=generator) for _ in range(shape["taps"])]

    def inputs_for(draw: int) -> DrafterInputs:
        """The training path's inputs, built as the collate builds them (anchors per sample, max_blocks cap)."""
        return DrafterInputs.build(batch, list(range(len(lengths))), block_size=config.block_size,
                                   num_anchors=config.num_anchors, mask_token_id=drafter.mask_token_id,
                                   loss_decay_gamma=drafter.loss_decay_gamma, max_blocks=config.max_blocks,
                                   seed=seed, epoch=draw)

    def step(draw: int) -> None:
        inputs = inputs_for(draw)
        result = drafter.prepared_loss(inputs, drafter.forward_prepared(inputs, features))
        loss = result.weighted_ce_sum / result.weight_sum.clamp(min=1e-9)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()

    before = current_rss_kib()  # ru_maxrss is the process's peak so far: the step's peak is measured from here
    step(0)  # warm-up (creates the optimizer state: counted in the step's memory, alike for every path)
    start = time.perf_counter()
    for draw in range(1, steps + 1):
        step(draw)
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    blocks = inputs_for(1).layout.num_blocks
    return {"shape": shape_name, "path": path, "tokens_per_second": tokens * steps / elapsed, "blocks": blocks,
            "step_memory_mb": (peak - before) / 1024, "peak_rss_mb": peak / 1024, "documents": len(lengths),
            "tokens": tokens}


def run_in_process(shape: str, path: str, steps: int, seed: int) -> dict:
    output = subprocess.run([sys.executable, __file__, "--child", shape, path, str(steps), str(seed)],
                            capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(output.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes")
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated attention paths")
    parser.add_argument("--skip", default="", help="comma-separated shape:path pairs not to run (e.g. one that "
                                                   "does not fit in memory)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process")
    parser.add_argument("--write", action="store_true", help="rewrite this benchmark's section of RESULTS.md")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        shape, path, steps, seed = args.child
        print(json.dumps(measure(shape, path, int(steps), int(seed))))
        return
    shapes, paths = args.shapes.split(","), args.paths.split(",")
    skip = {tuple(pair.split(":")) for pair in args.skip.split(",") if pair}
    results: dict[tuple[str, str], list[dict]] = {}
    for round_index in range(args.rounds):
        for shape in shapes:
            order = paths if round_index % 2 == 0 else paths[::-1]
            for path in order:
                if (shape, path) in skip:
                    continue
                result = run_in_process(shape, path, args.steps, seed=0)
                results.setdefault((shape, path), []).append(result)
                print(f"round {round_index + 1} {shape:9s} {path:6s} {result['tokens_per_second']:9.0f} tok/s "
                      f"step memory {result['step_memory_mb']:8.0f} MB", flush=True)
    rows = ["| shape | documents, tokens, blocks | path | tokens/s (median) | sdpa / dense tokens/s (median of rounds) "
            "| step memory MB (median) |", "| --- | --- | --- | --- | --- | --- |"]
    for shape in shapes:
        for path in paths:
            runs = results.get((shape, path))
            if not runs:
                continue
            ratio = "—"
            if path == "sdpa" and results.get((shape, "dense")):
                ratios = [a["tokens_per_second"] / b["tokens_per_second"]
                          for a, b in zip(runs, results[(shape, "dense")])]
                ratio = f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})"
            rows.append(f"| {shape} | {runs[0]['documents']} doc{'s' if runs[0]['documents'] > 1 else ''}, {runs[0]['tokens']:,} tokens, {runs[0]['blocks']} blocks | {path} | "
                        f"{statistics.median(r['tokens_per_second'] for r in runs):,.0f} | {ratio} | "
                        f"{statistics.median(r['step_memory_mb'] for r in runs):,.0f} |")
    command = " ".join(["python benchmarks/drafter_step.py", *sys.argv[1:]])
    skipped = "" if not skip else f" Not run: {', '.join(f'{s} on {p}' for s, p in sorted(skip))}."
    section = "\n".join([
        TITLE, "",
        f"`{command}` — {datetime.date.today().isoformat()}, {cpu_model()}, 1 thread, fp32; forward, decayed loss, "
        f"backward, clip and AdamW; {args.rounds} rounds × {args.steps} steps, each (shape, path) in a fresh process, "
        f"paths alternated.{skipped}", "",
        *rows, "",
        "Step memory: the peak RSS over the warm-up and the timed steps minus the RSS before them (what a "
        "step adds, AdamW's state included alike for both paths). The `dense` path keeps every score of a "
        "document's slots × heads × context for the backward, per layer; `sdpa` keeps one additive mask of "
        "slots × keys per chunk, shared by the layers and heads "
        "(`tests/test_drafter_packing.py::test_one_8k_document_trains_in_flat_attention_memory`).", "",
    ])
    print(section)
    if args.write:
        write_section(section, TITLE)


if __name__ == "__main__":
    main()
