"""``batchlab-pretrain-target``: pretrain the tiny target on the embedded corpus (cached), report its perplexity.

    batchlab-pretrain-target                          # default data (800 definitions, vocab 1024)
    batchlab-pretrain-target --max-documents 40 --vocab-size 300 --tokens 50000 --json
    batchlab-pretrain-target --out checkpoints/tiny   # also copy the checkpoint directory there

The checkpoint is built once under the batchlab cache directory (``$BATCHLAB_CACHE`` or
``~/.cache/batchlab``) and reused while the data, tokenizer, target config and settings stay the
same. Prints where it is and its held-out loss and perplexity before and after training
(``--json``: the whole ``meta.json`` plus ``path`` and ``built``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness.cli.process_exit import exits_fast
from harness.command_errors import OneLineParser, add_verbose, at_least, one_line_errors

DEFAULT_TARGET = Path(__file__).resolve().parents[2] / "conf" / "target" / "tiny.yaml"


def _documents(value: str) -> int | None:
    if value.lower() in ("all", "none"):
        return None
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give a positive number of documents, or 'all'") from None
    if number < 1:
        raise argparse.ArgumentTypeError("give a positive number of documents, or 'all'")
    return number


def build_parser() -> argparse.ArgumentParser:
    from harness.pretrain.target import IMPLEMENTATIONS, PretrainConfig

    default = PretrainConfig()
    parser = OneLineParser(
        prog="batchlab-pretrain-target",
        description="Pretrain the tiny Qwen3.5-style hybrid target on the embedded corpus's training split "
                    "(next-token LM), cached as a local Hugging Face checkpoint; report held-out perplexity.",
    )
    data = parser.add_argument_group("data (the embedded stdlib corpus)")
    data.add_argument("--max-documents", type=_documents, default=800,
                      help="seeded subset of definitions, or 'all' (default 800)")
    data.add_argument("--vocab-size", type=at_least(int, 258), default=1024, help="BPE vocabulary size (default 1024)")
    data.add_argument("--cache-dir", default=None, help="cache directory (default $BATCHLAB_CACHE or ~/.cache/batchlab)")
    parser.add_argument("--target", default=str(DEFAULT_TARGET),
                        help="target config YAML (default conf/target/tiny.yaml); vocab_size follows the data")
    train = parser.add_argument_group("pretraining")
    train.add_argument("--tokens", type=at_least(int, 1), default=default.tokens, help=f"training tokens (default {default.tokens:,})")
    train.add_argument("--steps", type=at_least(int, 1), default=None, help="optimizer steps (overrides --tokens)")
    train.add_argument("--lr", type=at_least(float, 0, above=True), default=default.lr, help=f"peak learning rate (default {default.lr})")
    train.add_argument("--max-tokens", type=at_least(int, 2), default=default.max_tokens,
                       help=f"tokens per batch and longest window (default {default.max_tokens})")
    train.add_argument("--seed", type=int, default=default.seed, help="init and batch-order seed")
    train.add_argument("--implementation", choices=IMPLEMENTATIONS, default=default.implementation,
                       help="batchlab (packed rows, default: faster on CPU) or transformers (padded)")
    parser.add_argument("--threads", type=at_least(int, 1), default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", default=None, help="copy the checkpoint directory here too")
    parser.add_argument("--json", action="store_true", help="print meta.json (plus path, built) as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_verbose(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit status 0; 2 with one line on stderr for bad input (``--verbose``: and its traceback)."""
    args = build_parser().parse_args(argv)
    return one_line_errors("batchlab-pretrain-target", lambda: pretrain(args), verbose=args.verbose)


def pretrain(args: argparse.Namespace) -> int:
    from harness.data.config import DataConfig
    from harness.pretrain.target import PretrainConfig, copy_checkpoint, pretrained_target, read_target_kwargs

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    data = DataConfig(max_documents=args.max_documents, vocab_size=args.vocab_size, cache_dir=args.cache_dir)
    target_kwargs = read_target_kwargs(args.target, DEFAULT_TARGET)
    settings = PretrainConfig(tokens=args.tokens, steps=args.steps, lr=args.lr, max_tokens=args.max_tokens,
                              seed=args.seed, implementation=args.implementation)
    result = pretrained_target(data, target_kwargs, settings, progress=not args.no_progress)
    path = copy_checkpoint(result.path, args.out) if args.out else result.path
    if args.json:
        print(json.dumps({"path": str(path), "cache_entry": str(result.path), "built": result.built, **result.meta},
                         indent=2, sort_keys=True))
    else:
        print_result(result, path)
    return 0


def print_result(result, path: Path) -> None:
    """Where the checkpoint is, how it was trained, and its held-out loss and perplexity before and after."""
    held = result.meta["heldout"]
    training = result.meta["training"]
    verb = "trained" if result.built else "cached"
    print(f"pretrained target ({verb}): {path}")
    print(f"  {training['steps']} steps, {training['tokens']:,} tokens ({training['epochs']:.1f} epochs) "
          f"in {training['seconds']:.0f} s ({training['tokens_per_second']:,.0f} tok/s, "
          f"{result.meta['settings']['implementation']})")
    if held.get("loss") is None:
        print("  no held-out rows (data.heldout_fraction=0): no perplexity")
        return
    print(f"  held-out loss {held['untrained_loss']:.4f} -> {held['loss']:.4f} nats/token "
          f"(perplexity {held['untrained_perplexity']:.1f} -> {held['perplexity']:.2f}; "
          f"unigram {held['unigram_loss']:.4f}) on {held['labels']:,} tokens of "
          f"{result.meta['heldout_rows']} held-out definitions")
    if held.get("completion_loss") is not None:
        print(f"  completion tokens only: loss {held['completion_loss']:.4f}, "
              f"perplexity {held['completion_perplexity']:.2f}")


if __name__ == "__main__":  # pragma: no cover
    exits_fast(main)()
