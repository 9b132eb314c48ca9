"""The reduced draft vocabulary (harness/models/draft_vocab.py): its mapping, its misses, and the drafter's loss on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.models.draft_vocab import DraftVocabulary
from harness.models.drafter import DFlashDrafter
from harness.models.drafter_config import DrafterConfig
from harness.models.layout import TokenBatch


def test_the_most_frequent_labels_are_kept_ties_by_the_lower_id_and_unseen_tokens_never():
    counts = np.array([5, 0, 9, 9, 1, 0])
    assert DraftVocabulary.most_frequent(counts, 2).draft_ids.tolist() == [2, 3]
    assert DraftVocabulary.most_frequent(counts, 3).draft_ids.tolist() == [0, 2, 3]
    assert DraftVocabulary.most_frequent(counts, 6).draft_ids.tolist() == [0, 2, 3, 4]  # tokens 1 and 5 never seen
    vocab = DraftVocabulary([4, 0, 2], target_vocab_size=6)
    assert vocab.draft_ids.tolist() == [0, 2, 4] and len(vocab) == 3
    assert vocab.d2t.tolist() == [0, 1, 2]  # draft index i is target token i + d2t[i]
    assert (torch.arange(3) + vocab.d2t).tolist() == [0, 2, 4]
    assert vocab.t2d.tolist() == [True, False, True, False, True, False]
    assert vocab.to_target(torch.tensor([[2, 0], [1, 1]])).tolist() == [[4, 0], [2, 2]]
    with pytest.raises(ValueError, match=r"must lie in 0\.\.5"):
        DraftVocabulary([6], target_vocab_size=6)
    with pytest.raises(ValueError, match="draft_vocab_size=0"):
        DraftVocabulary.most_frequent(counts, 0)
    samples = [(np.array([1, 2, 2, 3]), np.array([0, 1, 1, 1], dtype=bool)), (np.array([1, 1]), np.array([1, 0]))]
    assert DraftVocabulary.from_samples(samples, 6, 2).draft_ids.tolist() == [1, 2]  # labels only: 2 twice, 1 once


def test_a_label_outside_the_vocabulary_weighs_nothing_and_counts_as_a_miss():
    vocab = DraftVocabulary([0, 2, 4], target_vocab_size=6)
    labels = torch.tensor([[2, 3], [5, 4]])
    valid = torch.tensor([[True, True], [False, True]])
    mapped = vocab.map_labels(labels, valid, torch.tensor([[1.0, 0.5], [0.25, 0.125]]))
    assert mapped.labels.tolist() == [[1, 0], [0, 2]]
    assert mapped.loss_weights.tolist() == [[1.0, 0.0], [0.0, 0.125]]
    assert mapped.misses.tolist() == [[False, True], [False, False]]  # token 5 is not counted: no miss
    assert (valid & ~mapped.misses).tolist() == [[True, False], [False, True]]  # the labels an argmax can hit
    assert vocab.map_labels(labels, valid).loss_weights is None  # labels alone (materialised logits' loss)


def _drafter(vocab_size=40, draft_vocab=None, seed=0):
    torch.manual_seed(seed)
    embed, head = torch.nn.Embedding(vocab_size, 32), torch.nn.Linear(32, vocab_size, bias=False)
    config = DrafterConfig(block_size=4, num_anchors=8, target_layer_ids=[0], loss_chunk_blocks=3, loss_decay_gamma=3.0)
    torch.manual_seed(seed + 1)
    return DFlashDrafter(config, embed, head, num_target_layers=2, draft_vocab=draft_vocab)


def test_the_drafters_loss_is_the_cross_entropy_over_the_vocabularys_rows_and_its_misses_are_counted():
    generator = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 40, (n,), generator=generator) for n in (12, 9, 15)]
    batch = TokenBatch.from_documents(docs, "padded")
    features = [torch.randn(3, 15, 32, generator=generator)]
    anchors = [torch.tensor([1, 4]), torch.tensor([2]), torch.tensor([0, 5, 9])]
    full = _drafter()
    everything = _drafter(draft_vocab=DraftVocabulary(range(40), 40))  # every token: the same drafter
    reference = full.compute_loss(batch, features, anchors=anchors)
    same = everything.compute_loss(batch, features, anchors=anchors)
    torch.testing.assert_close(same.weighted_ce_sum, reference.weighted_ce_sum, rtol=1e-6, atol=0)
    assert float(same.draft_vocab_misses) == 0 and float(same.correct_sum) == float(reference.correct_sum)

    counts = np.bincount(torch.cat(docs).numpy(), minlength=40)
    vocab = DraftVocabulary.most_frequent(counts, 12)
    reduced = _drafter(draft_vocab=vocab)
    assert reduced.lm_head.out_features == 12 and not reduced.lm_head.weight.requires_grad
    torch.testing.assert_close(reduced.lm_head.weight, full.lm_head.weight[vocab.draft_ids])
    sums = reduced.compute_loss(batch, features, anchors=anchors)
    output = reduced(batch, features, anchors=anchors)  # the materialised logits over the 12 rows
    assert output.logits.shape[-1] == 12
    by_hand_ce, by_hand_weight, misses = 0.0, 0.0, 0
    decay = torch.exp(-torch.arange(3, dtype=torch.float64) / reduced.loss_decay_gamma)
    for block, slot in torch.nonzero(output.label_valid).tolist():
        label = int(output.labels[block, slot])
        if not bool(vocab.t2d[label]):
            misses += 1
            continue
        log_probs = torch.log_softmax(output.logits[block, slot].detach().double(), dim=-1)
        weight = float(decay[slot])
        by_hand_ce += -weight * float(log_probs[int(torch.nonzero(vocab.draft_ids == label))])
        by_hand_weight += weight
    assert misses > 0 and float(sums.draft_vocab_misses) == misses
    assert float(sums.weighted_ce_sum.detach()) == pytest.approx(by_hand_ce, rel=1e-5)
    assert float(sums.weight_sum) == pytest.approx(by_hand_weight, rel=1e-6)
    assert float(sums.label_count) == float(output.label_valid.sum())  # the misses still count as labels
    loss = reduced.loss(output)  # the materialised path gives the same sums
    torch.testing.assert_close(loss.weighted_ce_sum.double(), sums.weighted_ce_sum.double(), rtol=1e-5, atol=0)
    assert float(loss.correct_sum) == float(sums.correct_sum) and float(loss.draft_vocab_misses) == misses
    drafts = reduced.draft_tokens(output.logits)
    assert bool(vocab.t2d[drafts].all())  # drafts are target ids, always inside the vocabulary
