"""The options that name a user's conversations and their tokenizer, shared by ``batchlab-plan`` and
``batchlab-advise`` (``batchlab-train`` takes the same as ``data.tokenizer`` and ``data.bad_rows``), and their
messages in these options' words."""

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


#: the library's and the run config's names for what plan's and advise's options set
FLAG_NAMES = {"pass oversize='truncate' or oversize='drop'": "pass --oversize truncate or --oversize drop",
              "raise max_tokens to": "raise --max-tokens to", "set data.bad_rows=drop": "pass --bad-rows drop"}


def named_as_flags(message: str) -> str:
    """``message`` naming the commands' options where it names the settings they set."""
    for setting, flag in FLAG_NAMES.items():
        message = message.replace(setting, flag)
    return message
