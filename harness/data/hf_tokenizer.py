"""A Hugging Face tokenizer from a local directory or a ``.gguf`` checkpoint file, loaded once per process."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from harness.data import cache


class TokenizerError(ValueError):
    """A tokenizer batchlab cannot load as given."""


#: files that make a checkpoint directory a Hugging Face tokenizer too
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def checkpoint_tokenizer(checkpoint: str | Path | None) -> str | None:
    """``checkpoint`` when it holds a Hugging Face tokenizer (a target checkpoint's own, the default for the data):
    a directory with tokenizer files, or a GGUF file (which carries its tokenizer); else None."""
    if not checkpoint:
        return None
    location = Path(str(checkpoint))
    if location.suffix.lower() == GGUF_SUFFIX:
        return str(location) if location.is_file() else None
    return str(location) if any((location / name).is_file() for name in TOKENIZER_FILES) else None


GGUF_SUFFIX = ".gguf"


def load_hf_tokenizer(path: str | Path) -> Any:
    """The Hugging Face tokenizer of a local tokenizer directory or a ``.gguf`` checkpoint file (transformers reads a
    GGUF's tokenizer with the ``gguf`` package)."""
    location = Path(path).expanduser().resolve()
    if location.is_file() and location.suffix.lower() == GGUF_SUFFIX:
        require_gguf(location)
    if location.is_dir() or (location.is_file() and location.suffix.lower() == GGUF_SUFFIX):
        # one load per process while the files are unchanged: a run asks for it while checking its config (twice)
        # and again for its data, and a GGUF file takes seconds to read
        return _loaded_tokenizer(str(location), cache.digest(cache.path_signature(location)))
    raise FileNotFoundError(f"data.tokenizer={str(path)!r} is neither a directory nor a .gguf file; give a local "
                            "Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json), e.g. the "
                            "target checkpoint's, or a .gguf checkpoint file")


@functools.lru_cache(maxsize=4)
def _loaded_tokenizer(location: str, signature: str) -> Any:
    from transformers import AutoTokenizer

    path = Path(location)
    if path.is_file():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return AutoTokenizer.from_pretrained(location, local_files_only=True)


def require_gguf(location: Path) -> None:
    """Refuse a GGUF tokenizer when the ``gguf`` package that transformers reads it with is missing."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise TokenizerError(f"data.tokenizer={str(location)!r} is a GGUF file, which transformers reads with the "
                             "gguf package: pip install gguf (or pip install 'batchlab[gguf]')")
