"""Next-token language modelling on tokenized samples: windows, batches, labels and losses.

Shared by the pretraining loop (:mod:`harness.pretrain.target`) and its speed benchmark
(``benchmarks/pretrain_speed.py``), for both implementations of the model:

* ``batchlab``: :class:`~harness.models.target.HybridTarget` with gradients
  (:meth:`~harness.models.target.HybridTarget.compute_logits`) on packed ``[1, T]`` rows, documents
  kept apart exactly (GDN state, short conv and attention restart at every ``cu_seqlens`` boundary);
* ``transformers``: ``Qwen3_5ForCausalLM`` (its torch fallback on CPU) on right-padded ``[B, L]``
  batches, which it handles exactly; it cannot keep the documents of a packed row apart without fla.

A sample longer than the window (``max_tokens``) is cut into consecutive windows of at most that
many tokens, each modelled on its own from position 0 (the drafter trainer drops samples over its
own ``max_tokens``, so no window is longer than anything the target later sees). The label of
position ``t`` is the token at ``t + 1`` of the same window; the last position of a window, and pads,
have none. Every real token but a window's first is a label: the whole document (prompt and
completion) is language-modelled, since the target reads both as context when it verifies drafts.
The completion-only loss (labels whose ``loss_mask`` is 1) is reported besides.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from harness.models.layout import TokenBatch

IGNORE = -100
LAYOUT_OF = {"batchlab": "packed", "transformers": "padded"}


@dataclass(eq=False)
class Windows:
    """Token windows of some sample rows, each modelled on its own.

    Attributes:
        ids: int64 token ids of every window.
        masks: bool loss masks (``True`` on completion tokens) of every window.
        rows: int64 sample row each window comes from.
    """

    ids: list[np.ndarray]
    masks: list[np.ndarray]
    rows: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return np.array([w.size for w in self.ids], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def num_labels(self) -> int:
        """Tokens that are next-token targets (all but each window's first)."""
        return self.num_tokens - len(self)


def windows_of(samples, rows: Sequence[int] | np.ndarray, max_length: int) -> Windows:
    """The rows ``rows`` of ``samples`` cut into windows of at most ``max_length`` tokens.

    Windows of a single token (no label) are left out.
    """
    if max_length < 2:
        raise ValueError(f"max_length={max_length}: a window needs at least 2 tokens to hold a label")
    ids, masks, owners = [], [], []
    rows = np.asarray(rows, dtype=np.int64)
    for row, (tokens, mask) in zip(rows.tolist(), samples.samples(rows)):
        for start in range(0, tokens.size, max_length):
            stop = min(start + max_length, tokens.size)
            if stop - start < 2:
                continue
            ids.append(np.ascontiguousarray(tokens[start:stop], dtype=np.int64))
            masks.append(np.ascontiguousarray(mask[start:stop], dtype=bool))
            owners.append(row)
    return Windows(ids=ids, masks=masks, rows=np.array(owners, dtype=np.int64))


def epoch_batches(windows: Windows, layout: str, max_tokens: int, seed: int, epoch: int) -> list[np.ndarray]:
    """Window indices of every batch of one epoch, in order.

    ``packed``: ``strategies``' ``packed`` plan (random order, first-fit into rows of ``max_tokens``);
    ``padded``: its ``sorted`` plan (length-sorted, rows x longest <= ``max_tokens``, batch order
    shuffled each epoch), the least padding a padded layout can have.
    """
    from strategies import Budget, plan

    strategy = {"packed": "packed", "padded": "sorted"}[layout]
    epoch_plan = plan(windows.lengths, Budget(max_tokens), strategy=strategy, seed=seed, epoch=epoch)
    return [mb[0] for _, mb in epoch_plan.rank_steps(0) if mb[0].size]


def batch_of(windows: Windows, indices: Sequence[int], layout: str) -> TokenBatch:
    """A :class:`TokenBatch` of windows ``indices`` (``loss_mask`` = the completion mask)."""
    docs = [torch.from_numpy(windows.ids[i]) for i in indices]
    masks = [torch.from_numpy(windows.masks[i].astype(np.int64)) for i in indices]
    return TokenBatch.from_documents(docs, layout, loss_masks=masks)


def next_token_labels(batch: TokenBatch) -> torch.Tensor:
    """``labels[..., t]`` = the token at ``t + 1`` of the same document, else ``IGNORE`` (-100)."""
    ids = batch.input_ids
    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = ids[:, 1:]
    if batch.cu_seqlens is not None:
        bounds = batch.packed_documents().bounds
        ends = torch.tensor([stop - 1 for stop in bounds[1:]], dtype=torch.long)
        labels[0, ends] = IGNORE  # a document's last token has no next token in the document
    else:
        real_next = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
        real_next[:, :-1] = batch.attention_mask[:, 1:].bool()
        labels = labels.masked_fill(~real_next, IGNORE)
    return labels


def completion_labels(batch: TokenBatch) -> torch.Tensor:
    """``True`` where the label (the next token) is a completion token (its ``loss_mask`` is 1)."""
    nxt = torch.zeros_like(batch.loss_mask, dtype=torch.bool)
    nxt[:, :-1] = batch.loss_mask[:, 1:].bool()
    return nxt & (next_token_labels(batch) != IGNORE)


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-position negative log-likelihood (fp32), 0 where the label is ``IGNORE``."""
    flat = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE, reduction="none")
    return flat.reshape(labels.shape)


def model_logits(model: torch.nn.Module, batch: TokenBatch, implementation: str) -> torch.Tensor:
    """Logits of ``batch`` (autograd recorded where parameters require grad) for either implementation."""
    if implementation == "batchlab":
        return model.compute_logits(batch)
    if implementation == "transformers":
        if batch.cu_seqlens is not None:
            raise ValueError(
                "transformers' Qwen3_5ForCausalLM cannot keep the documents of a packed row apart without "
                "flash-linear-attention: give it padded batches"
            )
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                     position_ids=batch.position_ids).logits
    raise ValueError(f"implementation={implementation!r}: choose 'batchlab' or 'transformers'")


def mean_loss(model: torch.nn.Module, batch: TokenBatch, implementation: str) -> tuple[torch.Tensor, int]:
    """(mean next-token NLL over the batch's labels, number of labels)."""
    labels = next_token_labels(batch)
    nll = token_nll(model_logits(model, batch, implementation), labels)
    count = int((labels != IGNORE).sum())
    return nll.sum() / max(count, 1), count


@torch.no_grad()
def evaluate(logits_fn, windows: Windows, max_tokens: int) -> dict[str, float | int | None]:
    """Mean next-token NLL over every label of ``windows`` (all tokens, and completion tokens only).

    ``logits_fn(batch)`` gives the logits of a packed batch (e.g. ``HybridTarget.logits``).
    """
    if len(windows) == 0:
        return {"loss": None, "perplexity": None, "completion_loss": None, "completion_perplexity": None,
                "labels": 0, "completion_labels": 0}
    total = completion = 0.0
    count = completion_count = 0
    for indices in epoch_batches(windows, "packed", max_tokens, seed=0, epoch=0):
        batch = batch_of(windows, indices, "packed")
        labels = next_token_labels(batch)
        nll = token_nll(logits_fn(batch), labels)
        done = completion_labels(batch)
        total += float(nll.double().sum())
        count += int((labels != IGNORE).sum())
        completion += float(nll.double()[done].sum())
        completion_count += int(done.sum())
    loss = total / count
    completion_loss = completion / completion_count if completion_count else None
    return {
        "loss": loss,
        "perplexity": float(np.exp(loss)),
        "completion_loss": completion_loss,
        "completion_perplexity": None if completion_loss is None else float(np.exp(completion_loss)),
        "labels": count,
        "completion_labels": completion_count,
    }


def unigram_loss(train: Windows, heldout: Windows, vocab_size: int) -> float | None:
    """Held-out NLL of the training labels' unigram distribution (add-one smoothed): the bar to beat."""
    if len(heldout) == 0 or len(train) == 0:
        return None
    counts = np.ones(vocab_size, dtype=np.float64)
    for ids in train.ids:
        counts += np.bincount(ids[1:], minlength=vocab_size)[:vocab_size]
    logp = np.log(counts / counts.sum())
    labels = np.concatenate([ids[1:] for ids in heldout.ids])
    return float(-logp[labels].mean())


def iterate_steps(windows: Windows, layout: str, max_tokens: int, seed: int, steps: int,
                  ) -> Iterator[tuple[int, np.ndarray]]:
    """``(epoch, window indices)`` of ``steps`` consecutive batches, epoch after epoch."""
    done, epoch = 0, 0
    while done < steps:
        batches = epoch_batches(windows, layout, max_tokens, seed, epoch)
        if not batches:
            raise ValueError("no batch to train on: the training split has no window of 2 or more tokens")
        for indices in batches:
            if done == steps:
                return
            yield epoch, indices
            done += 1
        epoch += 1
