"""Next-token labels never cross a document, and both implementations compute the same loss and gradients.

Covers :mod:`harness.pretrain.lm`: labels of packed and padded batches, windows, and the loss and
gradients of batchlab's packed path (``HybridTarget.compute_logits``) against transformers'
``Qwen3_5ForCausalLM`` on padded rows, same weights.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen3_5ForCausalLM

from harness.models.compare import max_relative_difference
from harness.models.config import load_target_config
from harness.models.layout import TokenBatch
from harness.pretrain import lm
from harness.pretrain.target import PretrainConfig, learning_rate, trainable_model

TINY = Path(__file__).resolve().parents[3] / "conf" / "target" / "tiny.yaml"


def test_labels_stop_at_every_document_end() -> None:
    docs = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    masks = [torch.tensor([0, 1, 1]), torch.tensor([0, 1])]
    packed = TokenBatch.from_documents(docs, "packed", loss_masks=masks)
    assert lm.next_token_labels(packed).tolist() == [[6, 7, -100, 9, -100]]
    assert lm.completion_labels(packed).tolist() == [[True, True, False, True, False]]
    padded = TokenBatch.from_documents(docs, "padded", loss_masks=masks)
    assert lm.next_token_labels(padded).tolist() == [[6, 7, -100], [9, -100, -100]]
    assert lm.completion_labels(padded).tolist() == [[True, True, False], [True, False, False]]


class _Rows:
    """A stand-in for TokenizedSamples: ``samples(rows)`` gives (ids, mask) pairs."""

    def __init__(self, lengths):
        self.rows = [(np.arange(n, dtype=np.int64), np.ones(n, dtype=bool)) for n in lengths]

    def samples(self, rows):
        return [self.rows[r] for r in rows]


def test_windows_cut_long_samples_and_keep_their_rows() -> None:
    windows = lm.windows_of(_Rows([5, 12, 1, 9]), [0, 1, 2, 3], max_length=4)
    # row 0 -> 4 (+ a lone 5th token: no label, dropped); row 1 -> 4 + 4 + 4; row 2 (1 token) dropped;
    # row 3 -> 4 + 4 (+ a lone token)
    assert windows.rows.tolist() == [0, 1, 1, 1, 3, 3]
    assert windows.lengths.tolist() == [4] * 6
    assert windows.ids[2].tolist() == [4, 5, 6, 7]  # row 1's second window starts at its token 4
    assert windows.num_labels == 6 * 3


def test_batchlab_packed_loss_and_gradients_equal_transformers_padded() -> None:
    torch.manual_seed(0)
    reference = Qwen3_5ForCausalLM(load_target_config(TINY))
    ours = trainable_model(reference, "batchlab")
    generator = torch.Generator().manual_seed(4)
    docs = [torch.randint(0, 256, (n,), generator=generator) for n in (40, 97, 12)]
    loss_ref, count_ref = lm.mean_loss(reference.train(), TokenBatch.from_documents(docs, "padded"), "transformers")
    loss_ours, count_ours = lm.mean_loss(ours, TokenBatch.from_documents(docs, "packed"), "batchlab")
    assert count_ref == count_ours == 40 + 97 + 12 - 3
    assert abs(float(loss_ours.detach()) - float(loss_ref.detach())) <= 1e-5 * float(loss_ref.detach())
    loss_ref.backward()
    loss_ours.backward()
    theirs = dict(reference.named_parameters())
    names = sorted(theirs)
    flat_ours = torch.cat([dict(ours.named_parameters())[n].grad.flatten() for n in names])
    flat_theirs = torch.cat([theirs[n].grad.flatten() for n in names])
    assert max_relative_difference(flat_ours, flat_theirs) <= 1e-5
    # Per tensor, against its own scale floored at 1e-3 of the largest gradient: at transformers' init
    # some GDN heads forget almost everything each token (A up to 16), and their A_log / dt_bias
    # gradients (~1e-6, sums of per-token terms that nearly cancel) are fp32 noise in both
    # implementations (batchlab's chunked form matches its token-by-token recurrence there).
    floor = 1e-3 * float(flat_theirs.abs().max())
    for name, param in ours.named_parameters():
        reference_grad = theirs[name].grad
        error = float((param.grad - reference_grad).abs().max()) / max(float(reference_grad.abs().max()), floor)
        assert error <= 1e-3, f"{name}: gradient relative error {error:.2e}"


def test_learning_rate_warms_up_then_decays_to_the_floor() -> None:
    settings = PretrainConfig(lr=1e-3, min_lr_ratio=0.1, warmup_steps=10)
    rates = [learning_rate(step, 100, settings) for step in range(100)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in itertools.pairwise(rates[9:]))
    assert abs(rates[-1] - 1e-4) < 1e-12
