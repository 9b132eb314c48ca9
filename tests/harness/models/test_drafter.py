"""The DFlash drafter on random context features: masks, labels, anchors, loss and bad input."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import rotate_half

from harness.models.anchors import (
    FlatDocuments,
    block_input_ids,
    block_targets,
    build_block_layout,
    sample_anchors,
    valid_anchor_mask,
)
from harness.models.drafter import DFlashDrafter, DrafterConfig, load_drafter_config
from harness.models.drafter_loss import DrafterLoss, drafter_loss, resolve_loss_decay_gamma, slot_decay
from harness.models.layout import TokenBatch

VOCAB, HIDDEN, TARGET_LAYERS = 64, 32, 4



def make_drafter(block_size: int = 4, layers: int = 2, mask_token_id: int | None = None) -> DFlashDrafter:
    torch.manual_seed(0)
    config = DrafterConfig(
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=48, block_size=block_size, num_anchors=6, loss_decay_gamma=3.0,
        mask_token_id=mask_token_id, target_layer_ids=[1, 2], initializer_range=0.2,
    )
    embed, head = nn.Embedding(VOCAB, HIDDEN).double(), nn.Linear(HIDDEN, VOCAB, bias=False).double()
    drafter = DFlashDrafter(config, embed, head, TARGET_LAYERS)
    for param in drafter.parameters():  # norms away from 1 so that every weight matters
        if param.dim() == 1:
            param.data.uniform_(0.5, 1.5)
    return drafter.double()


def random_features(lengths: list[int], seed: int = 1) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, HIDDEN, generator=generator, dtype=torch.float64) for _ in range(2)] for n in lengths]


def packed_inputs(documents, features):
    batch = TokenBatch.from_documents(documents, "packed")
    return batch, [torch.cat([f[layer] for f in features])[None] for layer in range(2)]


def logits_of(drafter, documents, features, anchors):
    batch, states = packed_inputs(documents, features)
    return drafter(batch, states, anchors=anchors).logits


def dense_reference_logits(drafter, documents, features, anchors):
    """The drafter written the way fixed-shape trainers write it: one dense mask over all keys.

    Keys are [all context tokens of all documents ; all blocks]; a query of block j sees context
    tokens of its own document strictly before its anchor, and its own block. Independent of the
    per-document attention in the drafter (and of its context fusion), it checks that code against
    the docs/design/target-and-drafter.md rule: context = hidden_norm(fc(tapped layers concatenated on the feature
    axis)).
    """
    batch, states = packed_inputs(documents, features)
    flat = FlatDocuments.from_batch(batch)
    layout = build_block_layout(flat, anchors, drafter.block_size)
    context = drafter.hidden_norm(drafter.fc(torch.cat([layer[0] for layer in states], dim=-1)))
    hidden = drafter.embed(block_input_ids(flat, layout, drafter.mask_token_id))
    nb, bs, _ = hidden.shape
    q_doc = layout.doc_index.repeat_interleave(bs)
    q_anchor = layout.anchor.repeat_interleave(bs)
    q_block = torch.arange(nb).repeat_interleave(bs)
    sees_context = (flat.doc_of_token[None] == q_doc[:, None]) & (flat.position_in_document[None] < q_anchor[:, None])
    sees_blocks = q_block[:, None] == q_block[None]
    mask = torch.cat([sees_context, sees_blocks], dim=1)
    positions = torch.cat([flat.position_in_document, layout.slot_positions().reshape(-1)])
    cos, sin = drafter.rotary_emb(hidden, positions[None])
    cos, sin = cos[0][:, None], sin[0][:, None]  # [context + blocks, 1, head_dim]

    def rotate(x):  # RoPE at the positions of the last x.shape[0] keys
        return x * cos[-x.shape[0]:] + rotate_half(x) * sin[-x.shape[0]:]

    hidden = hidden.reshape(nb * bs, -1)
    for layer in drafter.layers:
        attn = layer.self_attn
        normed = layer.input_layernorm(hidden)
        q = rotate(attn.q_norm(attn.q_proj(normed).view(nb * bs, attn.num_heads, -1)))
        keys_in = torch.cat([context, normed])
        k = attn.k_norm(attn.k_proj(keys_in).view(keys_in.shape[0], attn.num_kv_heads, -1))
        k = rotate(k)
        v = attn.v_proj(keys_in).view(keys_in.shape[0], attn.num_kv_heads, -1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
        )
        hidden = hidden + attn.o_proj(out.transpose(0, 1).reshape(nb * bs, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return drafter.lm_head(drafter.norm(hidden)).view(nb, bs, -1)[:, 1:]


DOCS_LENGTHS = [9, 1, 14, 6]


def documents_and_anchors():
    generator = torch.Generator().manual_seed(3)
    documents = [torch.randint(0, VOCAB, (n,), generator=generator) for n in DOCS_LENGTHS]
    # Overlapping blocks (anchors 2 and 3), an anchor at 0 (empty context), an anchor whose block
    # runs past the document end, and a document too short for any anchor.
    anchors = [torch.tensor([2, 3, 7]), torch.tensor([], dtype=torch.long), torch.tensor([0, 5, 12]), torch.tensor([4])]
    return documents, anchors


def test_per_document_attention_matches_a_dense_mask_reference():
    drafter = make_drafter()
    documents, anchors = documents_and_anchors()
    features = random_features(DOCS_LENGTHS)
    fast = logits_of(drafter, documents, features, anchors)
    reference = dense_reference_logits(drafter, documents, features, anchors)
    assert fast.shape == (7, drafter.block_size - 1, VOCAB)
    # float64 weights, but transformers' RMSNorm and RoPE compute in float32: agree to float32 rounding
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-6)


def block_rows(anchors, doc, index):
    """Row of block `index` of document `doc` in the flat block layout."""
    return sum(a.numel() for a in anchors[:doc]) + index


@pytest.mark.parametrize("offset", [0, 1, 3])
def test_context_at_or_after_the_anchor_is_invisible(offset):
    drafter = make_drafter()
    documents, anchors = documents_and_anchors()
    features = random_features(DOCS_LENGTHS)
    base = logits_of(drafter, documents, features, anchors)
    row = block_rows(anchors, 2, 1)  # document 2, anchor 5
    changed = random_features(DOCS_LENGTHS)
    for layer in range(2):
        changed[2][layer][5 + offset] += 10.0  # offset 0 is the `<= anchor` bug
    after = logits_of(drafter, documents, changed, anchors)
    torch.testing.assert_close(after[row], base[row], rtol=0, atol=0)


def test_context_strictly_before_the_anchor_is_visible():
    drafter = make_drafter()
    documents, anchors = documents_and_anchors()
    features = random_features(DOCS_LENGTHS)
    base = logits_of(drafter, documents, features, anchors)
    changed = random_features(DOCS_LENGTHS)
    changed[2][0][4] += 1.0  # anchor 5 sees position 4 (and 0 .. 3)
    after = logits_of(drafter, documents, changed, anchors)
    row = block_rows(anchors, 2, 1)
    assert (after[row] - base[row]).abs().max() > 1e-3
    # the block anchored at 0 sees no context at all
    first = block_rows(anchors, 2, 0)
    torch.testing.assert_close(after[first], base[first], rtol=0, atol=0)


def test_blocks_never_see_each_other_even_when_they_overlap():
    drafter = make_drafter()
    documents, anchors = documents_and_anchors()
    features = random_features(DOCS_LENGTHS)
    base = logits_of(drafter, documents, features, anchors)
    # Blocks at anchors 2 and 3 of document 0 overlap. Changing the anchor token of the block at 3
    # changes that block's input; the block at 2 (whose labels cover position 3) must not notice.
    changed_docs = [d.clone() for d in documents]
    changed_docs[0][3] = (changed_docs[0][3] + 1) % VOCAB
    after = logits_of(drafter, changed_docs, features, anchors)
    assert (after[1] - base[1]).abs().max() > 1e-3
    torch.testing.assert_close(after[0], base[0], rtol=0, atol=0)
    torch.testing.assert_close(after[2:], base[2:], rtol=0, atol=0)


def test_documents_never_see_each_other():
    drafter = make_drafter()
    documents, anchors = documents_and_anchors()
    features = random_features(DOCS_LENGTHS)
    base = logits_of(drafter, documents, features, anchors)
    changed = random_features(DOCS_LENGTHS)
    changed_docs = [d.clone() for d in documents]
    for layer in range(2):
        changed[0][layer] += 5.0  # every context position of document 0
    changed_docs[0] = (changed_docs[0] + 7) % VOCAB  # and every token
    after = logits_of(drafter, changed_docs, changed, anchors)
    assert (after[:3] - base[:3]).abs().max() > 1e-3
    torch.testing.assert_close(after[3:], base[3:], rtol=0, atol=0)


def test_labels_are_the_tokens_at_anchor_plus_slot_not_shifted():
    documents = [torch.arange(10), torch.arange(20, 25)]  # token == 20 * doc + position
    batch = TokenBatch.from_documents(documents, "padded")
    flat = FlatDocuments.from_batch(batch)
    anchors = [torch.tensor([0, 4, 8]), torch.tensor([1])]
    layout = build_block_layout(flat, anchors, block_size=4)
    targets = block_targets(flat, layout)
    inputs = block_input_ids(flat, layout, mask_token_id=99)
    assert inputs.tolist() == [[0, 99, 99, 99], [4, 99, 99, 99], [8, 99, 99, 99], [21, 99, 99, 99]]
    assert targets.labels.tolist() == [[1, 2, 3], [5, 6, 7], [9, 0, 0], [22, 23, 24]]
    assert targets.valid.tolist() == [[True] * 3, [True] * 3, [True, False, False], [True] * 3]


def test_a_label_whose_loss_mask_is_zero_does_not_count():
    documents = [torch.arange(10), torch.arange(20, 25)]
    loss_masks = [torch.ones(10, dtype=torch.long), torch.ones(5, dtype=torch.long)]
    loss_masks[0][6] = 0  # e.g. a second user turn inside an assistant answer
    loss_masks[1][3] = 0
    for layout_name in ("padded", "packed"):
        flat = FlatDocuments.from_batch(TokenBatch.from_documents(documents, layout_name, loss_masks))
        layout = build_block_layout(flat, [torch.tensor([0, 4]), torch.tensor([1])], block_size=4)
        targets = block_targets(flat, layout)
        # slot k of the block at a is masked exactly where loss_mask[a + k] is 0
        assert targets.valid.tolist() == [[True] * 3, [True, False, True], [True, False, True]], layout_name
        assert targets.labels.tolist() == [[1, 2, 3], [5, 0, 7], [22, 0, 24]], layout_name


def test_a_planted_perfect_predictor_scores_full_accuracy_and_tau():
    drafter = make_drafter(block_size=4)
    documents, anchors = documents_and_anchors()
    batch, states = packed_inputs(documents, random_features(DOCS_LENGTHS))
    output = drafter(batch, states, anchors=anchors)
    # Logits that put all mass on the token at anchor + k, read straight from the documents.
    flat = FlatDocuments.from_batch(batch)
    positions = output.layout.slot_positions()[:, 1:]
    inside = positions < flat.doc_lengths[output.layout.doc_index][:, None]
    truth = flat.token_ids[flat.doc_starts[output.layout.doc_index][:, None] + torch.where(inside, positions, 0)]
    perfect = F.one_hot(truth, VOCAB).double() * 50.0
    result = drafter_loss(perfect, output.labels, output.label_valid, output.layout.keep, 3.0)
    assert result.accuracy == 1.0
    assert result.loss().item() < 1e-12
    # tau: blocks whose labels all lie inside the document accept every slot; others stop at the end
    expected_tau = (1 + output.label_valid.long().cumprod(dim=1).sum(dim=1)).double().mean().item()
    assert result.mean_tau == pytest.approx(expected_tau, abs=1e-12)
    shifted = F.one_hot(torch.roll(truth, 1, dims=1), VOCAB).double() * 50.0
    assert drafter_loss(shifted, output.labels, output.label_valid, output.layout.keep, 3.0).accuracy < 0.5


def test_loss_weights_decay_and_tau_counts_leading_matches():
    assert slot_decay(8, 4.0).tolist() == pytest.approx([math.exp(-k / 4.0) for k in range(7)], abs=1e-7)
    assert resolve_loss_decay_gamma(16, None) == 7.0 and resolve_loss_decay_gamma(10, None) == 5.0
    assert resolve_loss_decay_gamma(8, None) == 4.0
    labels = torch.tensor([[1, 2, 3], [1, 2, 3]])
    valid = torch.tensor([[True, True, True], [True, False, True]])
    predicted = torch.tensor([[1, 2, 0], [1, 2, 3]])  # block 0 misses slot 3; block 1 has a masked slot 2
    logits = F.one_hot(predicted, 4).float() * 30.0
    result = drafter_loss(logits, labels, valid, torch.tensor([True, True]), loss_decay_gamma=2.0)
    assert result.tau_sum.item() == 3 + 2  # 1 + two matches; 1 + one match (slot 2 does not count)
    assert result.correct_sum.item() == 4 and result.label_count.item() == 5
    decay = slot_decay(4, 2.0)
    assert result.weight_sum.item() == pytest.approx(float(decay.sum() + decay[0] + decay[2]), rel=1e-6)
    ce_miss = F.cross_entropy(logits[0, 2][None], labels[0, 2][None]).item()
    assert result.weighted_ce_sum.item() == pytest.approx(decay[2].item() * ce_miss, rel=1e-5)
    both = result + result
    assert both.weight_sum.item() == pytest.approx(2 * result.weight_sum.item())
    assert both.mean_tau == pytest.approx(result.mean_tau)


def test_padding_blocks_see_nothing_and_change_no_sum():
    drafter = make_drafter()
    documents, anchors = documents_and_anchors()
    batch, states = packed_inputs(documents, random_features(DOCS_LENGTHS))
    plain = drafter.compute_loss(batch, states, anchors=anchors)
    padded_output = drafter(batch, states, anchors=anchors, blocks_per_document=5)
    padded = drafter.loss(padded_output)
    assert padded_output.logits.shape[0] == 20 and not torch.isnan(padded_output.logits).any()
    assert padded.blocks_computed.item() == 20 and padded.block_count.item() == 7
    assert padded.slot_efficiency == pytest.approx(7 / 20)
    for name in ("weighted_ce_sum", "weight_sum", "correct_sum", "label_count", "tau_sum", "block_count"):
        torch.testing.assert_close(getattr(padded, name), getattr(plain, name), rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(padded.weighted_ce_sum, list(drafter.parameters()))
    assert all(torch.isfinite(g).all() for g in grads)
    # A padding block sees nothing, not even its own slots: its attention output is exactly zero, so
    # its logits are those of the residual path through the MLPs alone.
    hidden = drafter.embed(torch.full((1, drafter.block_size), drafter.mask_token_id))
    for layer in drafter.layers:
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    attention_free = drafter.lm_head(drafter.norm(hidden[:, 1:]))[0]
    padding_logits = padded_output.logits[~padded_output.layout.keep]
    assert padding_logits.shape[0] == 13
    torch.testing.assert_close(padding_logits, attention_free.expand_as(padding_logits), rtol=1e-12, atol=1e-12)


def test_anchors_follow_the_loss_mask_and_keep_a_whole_block_inside_their_document():
    # The anchor rule of SpecForge: loss_mask[p], loss_mask[p + 1] and p <= length - block_size.
    block = 4
    generator = torch.Generator().manual_seed(0)
    lengths = [1, 2, 7, 40, 3, 4]
    documents = [torch.randint(0, VOCAB, (n,), generator=generator) for n in lengths]
    loss_masks = [(torch.rand(n, generator=generator) < 0.7).long() for n in lengths]
    loss_masks[3][:] = 1
    loss_masks[5][:] = 1  # exactly one block: anchor 0 only
    flats = [
        FlatDocuments.from_batch(TokenBatch.from_documents(documents, layout, loss_masks))
        for layout in ("padded", "packed")
    ]
    expected_valid = [bool(m[p] and p <= n - block and m[p + 1]) for m, n in zip(loss_masks, lengths)
                      for p in range(n)]
    assert valid_anchor_mask(flats[1], block).tolist() == expected_valid
    draws = [sample_anchors(flat, 5, torch.Generator().manual_seed(11), block_size=block) for flat in flats]
    for a_padded, a_packed in zip(*draws):  # same documents, same generator state: same anchors
        assert torch.equal(a_padded, a_packed)
    for doc, (positions, mask, n) in enumerate(zip(draws[0], loss_masks, lengths)):
        valid = [p for p in range(n - block + 1) if mask[p] and mask[p + 1]]
        assert positions.numel() == min(5, len(valid)), doc
        assert set(positions.tolist()) <= set(valid) and positions.unique().numel() == positions.numel()
        assert bool((positions + block <= n).all())
    assert [d.numel() for d in draws[0][:2]] == [0, 0] and draws[0][4].numel() == 0  # shorter than a block
    assert draws[0][5].tolist() == [0]
    # fresh draws differ and cover the valid positions uniformly
    generator = torch.Generator().manual_seed(5)
    counts = torch.zeros(40)
    for _ in range(400):
        counts[sample_anchors(flats[1], 5, generator, block_size=block)[3]] += 1
    assert counts[37:].sum() == 0  # a block anchored there would run past the document end
    assert counts[:37].min() > 20 and counts[:37].max() < 90  # expected 400 * 5 / 37 = 54 each


def test_bad_input_is_named():
    drafter = make_drafter()
    documents, anchors = documents_and_anchors()
    batch, states = packed_inputs(documents, random_features(DOCS_LENGTHS))
    with pytest.raises(ValueError, match="block_size must be at least 2"):
        DrafterConfig(block_size=1)
    wrong_mask = TokenBatch.from_documents(documents, "packed")
    wrong_mask.loss_mask = wrong_mask.loss_mask[:, :-1]
    with pytest.raises(ValueError, match="loss_mask has shape"):
        drafter(wrong_mask, states, anchors=anchors)
    with pytest.raises(ValueError, match="loss mask of document 0 has length 3"):
        TokenBatch.from_documents(documents, "packed", [torch.ones(3)] + [torch.ones(n) for n in DOCS_LENGTHS[1:]])
    too_big = TokenBatch.from_documents([documents[0], documents[1] + VOCAB, *documents[2:]], "packed")
    bad_id = int(documents[1][0]) + VOCAB
    with pytest.raises(ValueError, match=f"token id {bad_id} at position 0 of document 1 is outside"):
        drafter(too_big, states, anchors=anchors)
    with pytest.raises(ValueError, match="anchors\\[0\\] holds position 8 but document 0 has 9 tokens"):
        drafter(batch, states, anchors=[torch.tensor([8]), *anchors[1:]])
    with pytest.raises(ValueError, match="anchors\\[0\\] must be a 1-D integer tensor"):
        drafter(batch, states, anchors=[torch.tensor([True, False]), *anchors[1:]])
    with pytest.raises(ValueError, match="anchors has 2 entries but the batch holds 4 documents"):
        drafter(batch, states, anchors=anchors[:2])
    with pytest.raises(ValueError, match="target_hidden_states\\[1\\] has shape"):
        drafter(batch, [states[0], states[1][:, :-1]], anchors=anchors)
    with pytest.raises(ValueError, match="give anchors"):
        drafter(batch, states)
    with pytest.raises(ValueError, match="mask_token_id=64 is outside"):
        make_drafter(mask_token_id=VOCAB)
    with pytest.raises(ValueError, match="loss_decay_gamma is not set and block_size=12"):
        DrafterConfig(block_size=12)
    with pytest.raises(ValueError, match="unknown drafter config keys \\['blok_size'\\]"):
        load_drafter_config({"blok_size": 8})


def test_target_embeddings_and_head_are_frozen_and_not_owned():
    drafter = make_drafter()
    names = {name for name, _ in drafter.named_parameters()}
    assert "mask_embedding" in names and "fc.weight" in names and "layers.1.self_attn.k_norm.weight" in names
    assert not any(name.startswith(("embed_tokens", "lm_head")) for name in names)
    assert not drafter.embed_tokens.weight.requires_grad and not drafter.lm_head.weight.requires_grad
    assert drafter.mask_token_id == VOCAB  # vocabulary extended by one
    mask_row = drafter.embed(torch.tensor([VOCAB]))[0]
    torch.testing.assert_close(mask_row, drafter.mask_embedding)
    existing = make_drafter(mask_token_id=5)
    assert existing.mask_embedding is None
    torch.testing.assert_close(existing.embed(torch.tensor([5]))[0], existing.embed_tokens.weight[5])
    # the tiny config loads and its rotary frequencies stay fp32 in bf16
    config = load_drafter_config("conf/drafter/tiny.yaml")
    assert config.block_size == 8 and config.resolved_loss_decay_gamma == 4.0
    tiny = DFlashDrafter(config, nn.Embedding(256, 64), nn.Linear(64, 256), 4).to(torch.bfloat16)
    assert tiny.rotary_emb.inv_freq.dtype == torch.float32 and tiny.fc.weight.dtype == torch.bfloat16


def test_drafter_learns_a_task_that_needs_the_visible_context():
    # Each document repeats a random period of 3 tokens, so slots 1 and 2 of a block can only be
    # predicted from context before the anchor: the loss falls only if the context path works.
    drafter = make_drafter(block_size=4, layers=1).float()
    drafter.embed_tokens.float(), drafter.lm_head.float()
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(250):
        documents = [torch.randint(0, VOCAB, (3,), generator=generator).repeat(6) for _ in range(4)]
        batch = TokenBatch.from_documents(documents, "packed")
        embedded = drafter.embed_tokens(batch.input_ids)
        result = drafter.compute_loss(batch, [embedded, embedded], generator=generator)
        optimizer.zero_grad()
        result.loss().backward()
        optimizer.step()
        losses.append(result.loss().item())
    assert isinstance(result, DrafterLoss)
    assert sum(losses[-10:]) < 0.6 * sum(losses[:10])


def make_distilling_drafter(distill_weight: float, chunk: int = 256,
                            dtype: torch.dtype = torch.float64) -> tuple[DFlashDrafter, nn.Module]:
    """A drafter whose deepest tap is the target's last layer (3), with soft labels from a stand-in final norm."""
    torch.manual_seed(0)
    config = DrafterConfig(
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        block_size=4, num_anchors=6, loss_decay_gamma=3.0, target_layer_ids=[1, TARGET_LAYERS - 1],
        initializer_range=0.2, distill_weight=distill_weight, loss_chunk_blocks=chunk,
    )
    embed, head = nn.Embedding(VOCAB, HIDDEN).to(dtype), nn.Linear(HIDDEN, VOCAB, bias=False).to(dtype)
    final_norm = nn.LayerNorm(HIDDEN).to(dtype)
    final_norm.weight.data.uniform_(0.5, 1.5)
    return DFlashDrafter(config, embed, head, TARGET_LAYERS, final_norm=final_norm).to(dtype), final_norm


def test_soft_labels_take_the_targets_prediction_at_the_position_before_each_label():
    """Slot k of the block at anchor a is labelled x[a + k]; the target predicted that token from position
    a + k - 1: the teacher is its final norm of the last layer's output there (per document of a packed row)."""
    drafter, final_norm = make_distilling_drafter(0.5)
    documents = [torch.randint(0, VOCAB, (n,)) for n in (9, 12)]
    features = random_features([9, 12], seed=3)
    batch, states = packed_inputs(documents, features)
    anchors = [torch.tensor([0, 5, 7]), torch.tensor([2, 8])]  # 7 in a 9-token document: slot 3 is past its end
    inputs, _ = drafter.prepare_inputs(batch, anchors)
    teacher = drafter.teacher_hidden(inputs, states)
    starts, lengths = [0, 9], [9, 12]
    expected = []
    for doc, doc_anchors in enumerate(anchors):
        for a in doc_anchors.tolist():
            rows = [starts[doc] + min(a + k - 1, lengths[doc] - 1) for k in range(1, 4)]
            expected.append(final_norm(states[1][0, rows]))  # the last layer's tap, not the first
    assert torch.allclose(teacher, torch.stack(expected), rtol=0, atol=1e-12)


@pytest.mark.parametrize("weight", [0.0, 0.4, 1.0])
def test_soft_labels_match_a_dense_reference_with_their_gradient(weight):
    """Σ w·[(1 - α)·CE(onehot) + α·CE(softmax(teacher logits))] and its gradient, chunked (2 blocks a chunk), equal
    autograd on the whole logits; α = 0 is the hard labels' loss exactly."""
    drafter, _ = make_distilling_drafter(weight, chunk=2) if weight else (make_drafter(layers=1), None)
    documents = [torch.randint(0, VOCAB, (n,)) for n in (10, 14)]
    features = random_features([10, 14], seed=4)
    batch, states = packed_inputs(documents, features)
    anchors = [torch.tensor([1, 4]), torch.tensor([0, 3, 9])]
    inputs, _ = drafter.prepare_inputs(batch, anchors)
    hidden = drafter.forward_prepared(inputs, states)
    sums = drafter.prepared_loss(inputs, hidden, states)
    (grad,) = torch.autograd.grad(sums.weighted_ce_sum, hidden)

    reference_hidden = hidden.detach().clone().requires_grad_(True)
    log_probs = drafter.lm_head(reference_hidden).log_softmax(-1)
    onehot = F.one_hot(inputs.labels, VOCAB).double()
    label = onehot
    if weight:
        label = (1 - weight) * onehot + weight * drafter.lm_head(drafter.teacher_hidden(inputs, states)).softmax(-1)
    reference = (-(label * log_probs).sum(-1) * inputs.loss_weights).sum()
    (reference_grad,) = torch.autograd.grad(reference, reference_hidden)
    assert float(sums.weighted_ce_sum.detach()) == pytest.approx(float(reference.detach()), rel=1e-10)
    assert torch.allclose(grad, reference_grad, rtol=1e-9, atol=1e-12)
    if weight == 1.0:  # the soft labels really differ from the hard ones (else the test proves nothing)
        hard = (-(onehot * log_probs).sum(-1) * inputs.loss_weights).sum()
        assert abs(float(hard.detach()) - float(reference.detach())) > 0.1


def test_soft_labels_need_the_targets_last_layer_and_a_weight_in_0_1():
    with pytest.raises(ValueError, match=r"distill_weight must be in \[0, 1\]"):
        DrafterConfig(distill_weight=1.5)
    config = DrafterConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=8, block_size=4,
                           loss_decay_gamma=3.0, target_layer_ids=[1, 2], distill_weight=0.5)
    with pytest.raises(ValueError, match=r"last layer \(3\).*add 3 to target_layer_ids"):
        DFlashDrafter(config, nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB), TARGET_LAYERS,
                      final_norm=nn.LayerNorm(HIDDEN))


def test_soft_labels_under_a_bf16_drafter_come_from_the_target_in_fp32():
    """Under the drafter's bf16 autocast the drafter's logits are bf16, but the target's side of the soft labels
    (its final norm, its head over the teacher's hidden states) stays at the fp32 target's precision."""
    drafter, final_norm = make_distilling_drafter(1.0, chunk=2, dtype=torch.float32)
    outputs = {"head": [], "norm": []}
    drafter.lm_head.register_forward_hook(lambda module, args, out: outputs["head"].append(out.dtype))
    final_norm.register_forward_hook(lambda module, args, out: outputs["norm"].append(out.dtype))
    documents = [torch.randint(0, VOCAB, (n,)) for n in (10, 14)]
    features = [[f.float() for f in doc] for doc in random_features([10, 14], seed=4)]
    batch, states = packed_inputs(documents, features)
    inputs, _ = drafter.prepare_inputs(batch, [torch.tensor([1, 4]), torch.tensor([0, 3, 9])])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sums = drafter.prepared_loss(inputs, drafter.forward_prepared(inputs, states), states)
    sums.weighted_ce_sum.backward()
    chunks = 3  # 5 blocks, 2 a chunk: the drafter's logits and the teacher's, once a chunk each
    assert sorted(outputs["head"], key=str) == [torch.bfloat16] * chunks + [torch.float32] * chunks
    assert outputs["norm"] == [torch.float32]
