"""Which optional kernel libraries this process can use: flash-linear-attention, flash-attn, Triton's interpreter."""

from __future__ import annotations

import importlib.util
import os


def fla_available() -> bool:
    """True when flash-linear-attention can be imported (it needs Triton and, to run, a GPU)."""
    return importlib.util.find_spec("fla") is not None


def flash_attn_available() -> bool:
    """Whether the flash-attn package (with ``flash_attn_varlen_func``) can be imported."""
    return importlib.util.find_spec("flash_attn") is not None


def triton_interpreter_enabled() -> bool:
    """True under ``TRITON_INTERPRET=1``: Triton kernels then run on CPU tensors, slowly, in Python.

    Only for checking how fla is called without a GPU (``benchmarks/fla_interpreter_check.py``); the
    ``auto`` backends never pick fla on CPU.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
