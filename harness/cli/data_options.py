"""The options that name a user's conversations and their tokenizer, shared by ``batchlab-plan`` and
``batchlab-advise`` (``batchlab-train`` takes the same as ``data.tokenizer`` and ``data.bad_rows``)."""

from __future__ import annotations

import argparse

from harness.data.config import BAD_ROWS_CHOICES


def add_tokenizer_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tokenizer", metavar="PATH",
        help="conversations (a 'messages' or 'conversations' column; JSON lines, a JSON array, parquet or "
             "save_to_disk): each rendered whole with this tokenizer's chat template and its tokens counted (cached, "
             "as batchlab-train tokenizes them); a Hugging Face tokenizer directory or a .gguf checkpoint file")
    parser.add_argument(
        "--bad-rows", choices=BAD_ROWS_CHOICES, default="refuse",
        help="with --tokenizer: every unusable conversation reported in one message (refuse, the default), or left "
             "out and counted (drop)")
