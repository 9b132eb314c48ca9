"""Shared test settings."""

import sys

import pytest


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The model tests use tiny tensors: one intra-op thread avoids oversubscribing a small CPU
    (several times slower otherwise). Tests that never import torch do not pay for importing it."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
