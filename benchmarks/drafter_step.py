"""The DFlash drafter's training step per attention path: tokens/s and peak memory, side by side.

One step = the drafter's forward on synthetic target features, the decayed loss, backward, gradient
clipping and AdamW (fp32, one thread), on three shapes:

* ``demo``: the tiny drafter of ``make demo`` (2 layers, hidden 64, block 8) on 2,048-token packed rows
  of lognormal documents (median 170 tokens), 16 anchors a document;
* ``large``: one layer at hidden 1,024 (8 heads, 2 KV heads, head dim 128), block 16, on an 8,192-token
  row of 10 lognormal documents with 512 blocks;
* ``large-8k``: the same model on one 8,192-token document with 512 blocks (the reference data's longest).

Paths: ``sdpa`` (fused attention per chunk of a document's blocks, the CPU default), ``dense`` (the
einsum reference that keeps every score for the backward) and ``speculators``: vLLM speculators' DFlash step
(its ``sdpa`` attention on CPU, FlexAttention on CUDA; its own KL loss to the verifier's logits) on the same
weights, tokens, features and
anchors (``benchmarks/speculators_peer.py``; installed on first use into ``.speculators-site/``, never a
batchlab dependency); its hidden states are checked against batchlab's before timing. Each (shape, path)
runs in a fresh process (peak RSS is per process): setup (every step's inputs built beforehand, as the
trainer's DataLoader workers do), one warm-up step, then ``--steps`` timed steps;
the step's memory is the peak RSS over the warm-up and the steps minus the RSS before them (the AdamW state
included, the same for every path). Rounds alternate the paths; ratios are per round, the median reported.
``--device cuda``: the same on the GPU (paths flex, sdpa, dense; memory is the peak allocated by the steps).

    python benchmarks/drafter_step.py                       # print the table
    python benchmarks/drafter_step.py --write               # also rewrite its section of RESULTS.md
    python benchmarks/drafter_step.py --shapes demo --rounds 5
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
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
CUDA_TITLE = "## Drafter training step per attention path (CUDA)"
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
PATHS = ("sdpa", "dense", "speculators")
PEER = "speculators"
#: the drafter-memory issue's goals against the peer, per shape: (batchlab's tokens/s at least this many times the
#: peer's, batchlab's step memory at most this many times the peer's or None)
GOALS = {"large-8k": (1.0, 1.0), "large": (2.0, None), "demo": (2.0, None)}


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


def measure(shape_name: str, path: str, steps: int, seed: int, device_name: str = "cpu") -> dict:
    """One (shape, path) in this process: tokens/s over ``steps`` steps and the steps' peak memory (on CUDA: the
    peak allocated by the steps, ``torch.cuda.max_memory_allocated``; on CPU: the peak RSS)."""
    import torch
    from torch import nn

    from harness.models.drafter import DFlashDrafter, load_drafter_config
    from harness.models.drafter_inputs import DrafterInputs
    from harness.models.layout import TokenBatch

    device = torch.device(device_name)
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(seed)
    shape = SHAPES[shape_name]
    hidden, vocab = shape["hidden"], shape["vocab"]
    # an existing token as MASK: speculators has no extra MASK embedding (the same for every path)
    config = load_drafter_config({**shape["drafter"], "attention_backend": "sdpa" if path == PEER else path,
                                  "mask_token_id": vocab - 1, "target_layer_ids": list(range(1, shape["taps"] + 1))})
    embed, head = nn.Embedding(vocab, hidden).to(device), nn.Linear(hidden, vocab, bias=False).to(device)
    drafter = DFlashDrafter(config, embed, head, shape["taps"] + 2).to(device)
    lengths = document_lengths(shape["row_tokens"], shape["documents"], seed)
    generator = torch.Generator().manual_seed(seed)
    batch = TokenBatch.from_documents([torch.randint(0, vocab, (n,), generator=generator) for n in lengths], "packed")
    tokens = sum(lengths)
    features = [torch.randn(1, tokens, hidden, generator=generator).to(device) for _ in range(shape["taps"])]
    last_hidden = torch.randn(1, tokens, hidden, generator=generator).to(device)  # the peer's verifier targets

    def inputs_for(draw: int) -> DrafterInputs:
        """The training path's inputs, built as the collate builds them (anchors per sample, max_blocks cap)."""
        return DrafterInputs.build(batch, list(range(len(lengths))), block_size=config.block_size,
                                   num_anchors=config.num_anchors, mask_token_id=drafter.mask_token_id,
                                   loss_decay_gamma=drafter.loss_decay_gamma, max_blocks=config.max_blocks,
                                   seed=seed, epoch=draw).to(device)

    # every step's inputs built before timing (the trainer collates in its DataLoader workers)
    prepared = [inputs_for(draw) for draw in range(steps + 1)]
    agreement = None
    if path == PEER:
        from speculators_peer import PeerStep, build_peer

        model = build_peer(drafter, embed, head, shape["taps"], device).to(device)
        concatenated = torch.cat(features, dim=-1)  # the peer's input layout, once

        def loss_of(inputs: DrafterInputs) -> torch.Tensor:
            return PeerStep(model, inputs, concatenated, last_hidden, drafter.loss_decay_gamma).loss()

        with torch.no_grad():  # the same blocks give the same hidden states (the losses differ by design)
            agreement = float((PeerStep(model, prepared[0], concatenated, last_hidden, drafter.loss_decay_gamma)
                               .hidden() - drafter.forward_prepared(prepared[0], features)).abs().max())
    else:
        model = drafter

        def loss_of(inputs: DrafterInputs) -> torch.Tensor:
            result = drafter.prepared_loss(inputs, drafter.forward_prepared(inputs, features))
            return result.weighted_ce_sum / result.weight_sum.clamp(min=1e-9)

    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=1e-4)

    def step(draw: int) -> None:
        loss = loss_of(prepared[draw])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) / 1024
    else:
        before = current_rss_kib()  # ru_maxrss is the process's peak so far: the step's peak is measured from here
    step(0)  # warm-up (creates the optimizer state: counted in the step's memory, alike for every path)
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for draw in range(1, steps + 1):
        step(draw)
    if cuda:
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    if cuda:
        peak = torch.cuda.max_memory_allocated(device) / 1024
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    blocks = prepared[1].layout.num_blocks
    return {"shape": shape_name, "path": path, "tokens_per_second": tokens * steps / elapsed, "blocks": blocks,
            "step_memory_mb": (peak - before) / 1024, "peak_mb": peak / 1024, "documents": len(lengths),
            "tokens": tokens, "max_abs_difference": agreement}


def run_in_process(shape: str, path: str, steps: int, seed: int, device: str) -> dict:
    env = dict(os.environ)
    if path == PEER:  # only this child sees speculators
        from speculators_peer import ensure_site

        env["PYTHONPATH"] = os.pathsep.join([str(ensure_site()), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    output = subprocess.run([sys.executable, __file__, "--child", shape, path, str(steps), str(seed), device],
                            capture_output=True, text=True, cwd=REPO, env=env)
    if output.returncode:
        raise RuntimeError(f"{shape} on {path} failed:\n{output.stderr[-3000:]}")
    return json.loads(output.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes")
    parser.add_argument("--paths", default=None, help="comma-separated attention paths (default: "
                        f"{','.join(PATHS)} on cpu, flex,sdpa,dense on cuda)")
    parser.add_argument("--skip", default="", help="comma-separated shape:path pairs not to run (e.g. one that "
                                                   "does not fit in memory)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process")
    parser.add_argument("--write", action="store_true", help="rewrite this benchmark's section of RESULTS.md")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the paths on the GPU (memory: the peak allocated by the steps)")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        shape, path, steps, seed, device = args.child
        print(json.dumps(measure(shape, path, int(steps), int(seed), device)))
        return
    cuda = args.device == "cuda"
    shapes = args.shapes.split(",")
    paths = (args.paths or ("flex,sdpa,dense" if cuda else ",".join(PATHS))).split(",")
    reference = "flex" if cuda else "sdpa"  # each device's default path
    skip = {tuple(pair.split(":")) for pair in args.skip.split(",") if pair}
    results: dict[tuple[str, str], list[dict]] = {}
    failed: dict[tuple[str, str], str] = {}
    for round_index in range(args.rounds):
        for shape in shapes:
            order = paths if round_index % 2 == 0 else paths[::-1]
            for path in order:
                if (shape, path) in skip or (shape, path) in failed:  # a failure is not retried
                    continue
                try:
                    result = run_in_process(shape, path, args.steps, seed=0, device=args.device)
                except RuntimeError as error:  # one (shape, path) failing (out of memory, say) leaves the others
                    failed.setdefault((shape, path), str(error).splitlines()[-1][:300])
                    print(f"round {round_index + 1} {shape:9s} {path:6s} failed: {failed[(shape, path)]}", flush=True)
                    continue
                results.setdefault((shape, path), []).append(result)
                print(f"round {round_index + 1} {shape:9s} {path:6s} {result['tokens_per_second']:9.0f} tok/s "
                      f"step memory {result['step_memory_mb']:8.0f} MB", flush=True)
    rows = [f"| shape | documents, tokens, blocks | path | tokens/s (median) | {reference} ÷ this path, tokens/s "
            f"(median of rounds) | step memory MB (median) | this path ÷ {reference}, step memory | hidden states vs "
            "batchlab (max abs) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for shape in shapes:
        for path in paths:
            runs = results.get((shape, path))
            if not runs:
                continue
            speed = memory = "—"
            ours = results.get((shape, reference))
            if path != reference and ours:  # per round: the runs of a round ran side by side
                ratios = [a["tokens_per_second"] / b["tokens_per_second"] for a, b in zip(ours, runs)]
                speed = f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})"
                memory_ratio = (statistics.median(r["step_memory_mb"] for r in runs)
                                / statistics.median(r["step_memory_mb"] for r in ours))
                memory = f"{memory_ratio:.2f}×"
            differences = [r["max_abs_difference"] for r in runs if r.get("max_abs_difference") is not None]
            documents = runs[0]["documents"]
            rows.append(f"| {shape} | {documents} doc{'s' if documents > 1 else ''}, {runs[0]['tokens']:,} tokens, "
                        f"{runs[0]['blocks']} blocks | {path} | "
                        f"{statistics.median(r['tokens_per_second'] for r in runs):,.0f} | {speed} | "
                        f"{statistics.median(r['step_memory_mb'] for r in runs):,.0f} | {memory} | "
                        f"{f'{max(differences):.1e}' if differences else '—'} |")
    goals = []
    for shape, (speed_goal, memory_goal) in GOALS.items():
        ours, peer = results.get((shape, reference)), results.get((shape, PEER))
        if not ours or not peer:
            continue
        speed = statistics.median(a["tokens_per_second"] / b["tokens_per_second"] for a, b in zip(ours, peer))
        memory = (statistics.median(r["step_memory_mb"] for r in ours)
                  / statistics.median(r["step_memory_mb"] for r in peer))
        met = speed >= speed_goal and (memory_goal is None or memory <= memory_goal)
        goals.append(f"- {shape}: {reference} at {speed:.2f}× the peer's tokens/s (goal ≥ {speed_goal:.1f}×) and "
                     f"{memory:.2f}× its step memory" + (f" (goal ≤ {memory_goal:.1f}×)" if memory_goal else "")
                     + f" — {'PASS' if met else 'FAIL'}")
    command = " ".join(["python benchmarks/drafter_step.py", *sys.argv[1:]])
    skipped = "" if not skip else f" Not run: {', '.join(f'{s} on {p}' for s, p in sorted(skip))}."
    skipped += "".join(f" Failed: {s} on {p} ({why})." for (s, p), why in sorted(failed.items()))
    if cuda:
        import torch

        machine, title = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}", CUDA_TITLE
    else:
        machine, title = f"{cpu_model()}, 1 thread", TITLE
    section = "\n".join([
        title, "",
        f"`{command}` — {datetime.date.today().isoformat()}, {machine}, fp32; forward, decayed loss, "
        f"backward, clip and AdamW; {args.rounds} rounds × {args.steps} steps, each (shape, path) in a fresh process, "
        f"paths alternated.{skipped}", "",
        *rows, "", *([f"Against `{PEER}` (the issue's goals, ratios per round, median):", *goals, ""] if goals else []),
        "Step memory: the peak " + ("allocated GPU memory" if cuda else "RSS") + " over the warm-up and the "
        "timed steps minus " + ("what was allocated" if cuda else "the RSS") + " before them (what a "
        "step adds, AdamW's state included alike for every path). `speculators` is vLLM speculators' DFlash "
        "step (`benchmarks/speculators_peer.py`: on CPU its `sdpa` attention with a dense boolean mask; its KL loss to "
        "the verifier's logits) on the same weights, tokens, features and anchors; its last column is its "
        "hidden states against batchlab's on the same blocks. The `dense` path keeps every score of a "
        "document's slots × heads × context for the backward, per layer; `sdpa` keeps one additive mask of "
        "slots × keys per chunk, shared by the layers and heads "
        "(`tests/harness/models/test_drafter_packing.py::test_one_8k_document_trains_in_flat_attention_memory`).", "",
    ])
    print(section)
    if args.write:
        write_section(section, title)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
