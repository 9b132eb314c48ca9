"""``batchlab-regenerate``: the target's own completions of a data source's prompts, cached
(:mod:`harness.eval.regenerate` does the work); prints the dataset directory to pass as ``data.source=``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.cli.process_exit import exits_fast
from harness.command_errors import OneLineParser, add_verbose, at_least, one_line_errors
from harness.data.config import DataConfig
from harness.eval.regenerate import DECODERS, RegenerateSettings, checked_target, regenerate


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="batchlab-regenerate",
        description="Regenerate the completions of a data source with the target (greedy or sampled), cached; "
                    "prints the dataset directory to pass as data.source=...")
    parser.add_argument("--source", default="stdlib", help="data.source (default: the embedded corpus)")
    parser.add_argument("--max-documents", type=at_least(int, 0), default=DataConfig.max_documents,
                        help="data.max_documents of the embedded corpus (default %(default)s; 0: all)")
    parser.add_argument("--vocab-size", type=int, default=DataConfig.vocab_size, help="data.vocab_size")
    parser.add_argument("--tokenizer", default=None,
                        help="data.tokenizer: conversations only, the local tokenizer directory or .gguf file whose chat "
                             "template is applied (default: the --target checkpoint's own, when it has one)")
    parser.add_argument("--cache-dir", default=None, help="data.cache_dir (default: $BATCHLAB_CACHE or ~/.cache/batchlab)")
    parser.add_argument("--target", default=str(Path(__file__).resolve().parents[2] / "conf" / "target" / "tiny.yaml"),
                        help="a target checkpoint directory, or a target config (random weights); default conf/target/tiny.yaml")
    parser.add_argument("--max-new-tokens", type=at_least(int, 1), default=RegenerateSettings.max_new_tokens,
                        help="cap on a regenerated completion (else as long as the original)")
    parser.add_argument("--max-prompt-tokens", type=at_least(int, 1), default=None, help="keep the last N prompt tokens")
    parser.add_argument("--temperature", type=at_least(float, 0), default=0.0, help="0 (default): greedy; > 0: sampled")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--eos-id", type=int, default=None, help="stop a completion after this token")
    parser.add_argument("--batch-size", type=at_least(int, 1), default=32, help="rows decoded together")
    parser.add_argument("--decoder", choices=DECODERS, default="hf",
                        help="hf: transformers generate with a cache (default); recompute: full forward per token")
    parser.add_argument("--no-progress", action="store_true")
    add_verbose(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the dataset directory; exit status 2 with one line on stderr for bad input."""
    args = build_parser().parse_args(argv)
    return one_line_errors("batchlab-regenerate", lambda: _regenerate_command(args), verbose=args.verbose)


def _regenerate_command(args: argparse.Namespace) -> int:
    target = checked_target(args.target)
    from harness.data.hf_tokenizer import checkpoint_tokenizer

    tokenizer = args.tokenizer if args.tokenizer is not None else checkpoint_tokenizer(target)
    data = DataConfig(source=args.source, max_documents=args.max_documents or None, vocab_size=args.vocab_size,
                      cache_dir=args.cache_dir, tokenizer=tokenizer)
    settings = RegenerateSettings(max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                                  temperature=args.temperature, seed=args.seed, eos_id=args.eos_id)
    path, meta, built = regenerate(data, args.target, settings, batch_size=args.batch_size,
                                   progress=not args.no_progress, decoder=args.decoder)
    state = "built" if built else "cached"
    print(f"{state}: {meta['rows']} rows, {meta['regenerated_tokens']} regenerated tokens -> {path}", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    exits_fast(main)()
