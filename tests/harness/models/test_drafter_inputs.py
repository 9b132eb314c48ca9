"""The drafter's training path: per-sample anchors, host-prepared DrafterInputs, chunked loss, memory."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import harness.models.drafter_inputs as drafter_inputs_module
from harness.models.anchors import (
    FlatDocuments,
    block_input_ids,
    block_targets,
    build_block_layout,
    context_visible,
    sample_anchors,
    valid_anchor_mask,
)
from harness.models.drafter import DFlashDrafter, DrafterConfig, load_drafter_config
from harness.models.drafter_inputs import (
    ANCHOR_PURPOSE,
    DenseSlice,
    DrafterInputs,
    anchor_candidates,
    document_anchors,
    document_weight_sum,
)
from harness.models.drafter_loss import DrafterLoss, chunked_drafter_loss, drafter_loss
from harness.models.layout import TokenBatch

VOCAB, HIDDEN, TARGET_LAYERS, BLOCK, GAMMA = 64, 32, 4, 4, 3.0
TOLERANCE = 1e-5


def make_drafter(vocab=VOCAB, hidden=HIDDEN, **overrides):
    torch.manual_seed(0)
    options = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   intermediate_size=48, block_size=BLOCK, num_anchors=6, loss_decay_gamma=GAMMA,
                   target_layer_ids=[1, 2], initializer_range=0.2, attention_backend="dense")
    options.update(overrides)
    drafter = DFlashDrafter(DrafterConfig(**options), nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab, bias=False),
                            TARGET_LAYERS)
    for param in drafter.parameters():  # norms away from 1 so that every weight matters
        if param.dim() == 1:
            param.data.uniform_(0.5, 1.5)
    return drafter


def corpus(lengths, seed=0, prompt=2):
    """Documents with a loss mask that skips a prompt and one token in the middle."""
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, VOCAB, (n,), generator=generator) for n in lengths]
    masks = []
    for n in lengths:
        mask = torch.ones(n, dtype=torch.long)
        mask[: min(prompt, n)] = 0
        if n > 8:
            mask[n // 2] = 0
        masks.append(mask)
    return tokens, masks


def features_for(batch, per_document):
    """Tapped target features laid out like ``batch`` from per-document ``[n, D]`` tensors."""
    states = []
    for layer in range(2):
        docs = [f[layer] for f in per_document]
        if batch.cu_seqlens is not None:
            states.append(torch.cat(docs)[None])
        else:
            out = torch.zeros(*batch.input_ids.shape, docs[0].shape[-1])
            for row, doc in enumerate(docs):
                out[row, : doc.shape[0]] = doc
            states.append(out)
    return states


def random_features(lengths, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, HIDDEN, generator=generator) for _ in range(2)] for n in lengths]


def build(batch, samples, drafter=None, **overrides):
    options = dict(block_size=BLOCK, num_anchors=6, mask_token_id=VOCAB if drafter is None else drafter.mask_token_id,
                   loss_decay_gamma=GAMMA, max_blocks=None, seed=7, epoch=0)
    options.update(overrides)
    return DrafterInputs.build(batch, samples, **options)


def anchors_by_document(inputs):
    layout = inputs.layout
    return [layout.anchor[layout.doc_index == d].tolist() for d in range(inputs.documents.num_documents)]


def relative(a, b):
    a, b = a.detach(), b.detach()
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


# ----------------------------------------------------------------------------- anchors


def test_anchor_candidates_follow_specforges_rule():
    mask = np.array([0, 1, 1, 1, 0, 1, 1, 1, 1, 1], dtype=bool)
    # p needs mask[p] and mask[p + 1] and p <= 10 - 4 = 6
    assert anchor_candidates(mask, 4).tolist() == [1, 2, 5, 6]
    assert anchor_candidates(mask, 2).tolist() == [1, 2, 5, 6, 7, 8]
    assert anchor_candidates(np.ones(3, dtype=bool), 4).tolist() == []  # shorter than a block
    assert anchor_candidates(np.ones(4, dtype=bool), 4).tolist() == [0]  # exactly one block
    positions, keys = document_anchors(np.ones(3), block_size=4, num_anchors=5, seed=0, epoch=0, sample_index=0)
    assert positions.size == 0 and keys.size == 0


def test_document_anchors_are_a_function_of_seed_epoch_and_sample_only():
    lengths = [30, 3, 25, 41, 12]
    tokens, masks = corpus(lengths)
    samples = [100, 5, 17, 3, 64]
    direct = {s: document_anchors(m.numpy(), block_size=BLOCK, num_anchors=6, seed=7, epoch=0, sample_index=s)[0]
              .tolist() for s, m in zip(samples, masks)}
    # Every layout, every neighbourhood (order, other documents, alone) gives each sample the same anchors.
    groupings = [list(range(5)), [3, 0, 4], [2], [4, 1, 2, 0, 3], [1, 3]]
    for group in groupings:
        for layout in ("padded", "packed"):
            batch = TokenBatch.from_documents([tokens[i] for i in group], layout, [masks[i] for i in group])
            inputs = build(batch, [samples[i] for i in group])
            for i, anchors in zip(group, anchors_by_document(inputs)):
                assert anchors == direct[samples[i]], (group, layout, i)
            assert inputs.documents_without_anchor == sum(lengths[i] < BLOCK for i in group)
    # the rule holds, and the document shorter than a block has no anchor
    for s, m, n in zip(samples, masks, lengths):
        assert direct[s] == sorted(direct[s]) and len(set(direct[s])) == len(direct[s])
        assert all(m[p] and m[p + 1] and p <= n - BLOCK for p in direct[s])
        assert len(direct[s]) == min(6, anchor_candidates(m.numpy(), BLOCK).size)
    assert direct[5] == []
    # another epoch (or seed) draws again; the same epoch repeats
    again = document_anchors(masks[3].numpy(), block_size=BLOCK, num_anchors=6, seed=7, epoch=0, sample_index=3)
    other_epoch = document_anchors(masks[3].numpy(), block_size=BLOCK, num_anchors=6, seed=7, epoch=1, sample_index=3)
    other_seed = document_anchors(masks[3].numpy(), block_size=BLOCK, num_anchors=6, seed=8, epoch=0, sample_index=3)
    assert again[0].tolist() == direct[3]
    assert other_epoch[0].tolist() != direct[3] and other_seed[0].tolist() != direct[3]
    assert again[1].dtype == np.float64 and bool(((again[1] >= 0) & (again[1] < 1)).all())


def test_document_anchors_are_uniform_over_candidates():
    mask = np.ones(40, dtype=bool)
    counts = np.zeros(40)
    for epoch in range(300):
        counts[document_anchors(mask, block_size=BLOCK, num_anchors=5, seed=1, epoch=epoch, sample_index=0)[0]] += 1
    assert counts[37:].sum() == 0
    assert counts[:37].min() > 15 and counts[:37].max() < 70  # expected 300 * 5 / 37 = 40.5 each


# ----------------------------------------------------------------------------- max_blocks


def test_max_blocks_keeps_the_smallest_keys_across_documents():
    lengths = [40, 40, 40, 5]
    tokens, masks = corpus(lengths)
    batch = TokenBatch.from_documents(tokens, "packed", masks)
    samples = [11, 12, 13, 14]
    uncapped = build(batch, samples, num_anchors=8)
    total = uncapped.num_blocks
    assert total == uncapped.num_blocks_candidates == 8 * 3 and uncapped.num_blocks_capped == 0
    assert uncapped.documents_without_anchor == 1  # 5 tokens, a 2-token prompt: no whole block
    capped = build(batch, samples, num_anchors=8, max_blocks=10)
    assert capped.num_blocks == 10 and capped.num_blocks_capped == total - 10
    assert capped.num_blocks_candidates == total
    per_doc = anchors_by_document(capped)
    assert sum(1 for anchors in per_doc if anchors) >= 2, "the cap must not take every block from one document"
    full = anchors_by_document(uncapped)
    # the kept blocks are the 10 smallest keys of the micro-batch
    drawn = [document_anchors(m.numpy(), block_size=BLOCK, num_anchors=8, seed=7, epoch=0, sample_index=s)
             for m, s in zip(masks, samples)]
    keyed = sorted((k, d, int(p)) for d, (ps, ks) in enumerate(drawn) for p, k in zip(ps, ks))[:10]
    expected = [sorted(p for _, d, p in keyed if d == doc) for doc in range(4)]
    assert per_doc == expected
    assert all(set(a) <= set(f) for a, f in zip(per_doc, full))
    assert capped.weight_sum == pytest.approx(float(capped.loss_weights.double().sum()))
    # a cap that does not bind changes nothing
    for cap in (total, total + 50):
        same = build(batch, samples, num_anchors=8, max_blocks=cap)
        assert same.num_blocks_capped == 0
        for name in ("block_input_ids", "labels", "label_valid", "loss_weights"):
            assert torch.equal(getattr(same, name), getattr(uncapped, name)), name
        assert torch.equal(same.layout.anchor, uncapped.layout.anchor)


def test_max_blocks_spreads_fairly_on_average():
    lengths = [200, 200, 200, 200]
    tokens, masks = corpus(lengths, prompt=0)
    batch = TokenBatch.from_documents(tokens, "packed", masks)
    per_doc = np.zeros(4)
    for epoch in range(40):
        inputs = build(batch, [0, 1, 2, 3], num_anchors=64, max_blocks=32, epoch=epoch)
        per_doc += inputs.layout.blocks_per_document.numpy()
    assert per_doc.sum() == 40 * 32
    assert per_doc.min() > 0.15 * per_doc.sum()  # 25% each on average


# ----------------------------------------------------------------------------- equality with the check path


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_prepared_path_equals_forward_and_unchunked_loss(layout, chunk):
    lengths = [13, 2, 22, 9]
    tokens, masks = corpus(lengths)
    drafter = make_drafter(loss_chunk_blocks=chunk)
    batch = TokenBatch.from_documents(tokens, layout, masks)
    states = features_for(batch, random_features(lengths))
    inputs = build(batch, [4, 3, 2, 1], drafter)
    assert inputs.num_blocks > 3 and inputs.documents_without_anchor == 1
    params = [p for p in drafter.parameters() if p.requires_grad]

    prepared = drafter.prepared_loss(inputs, drafter.forward_prepared(inputs, states))
    prepared_grads = torch.autograd.grad(prepared.weighted_ce_sum, params)
    anchors = [torch.tensor(a, dtype=torch.long) for a in anchors_by_document(inputs)]
    output = drafter(batch, states, anchors=anchors)  # full logits, unchunked drafter_loss
    reference = drafter.loss(output)
    reference_grads = torch.autograd.grad(reference.weighted_ce_sum, params)
    check = drafter.compute_loss(batch, states, anchors=anchors)  # the check path, chunked

    assert torch.equal(output.labels, inputs.labels) and torch.equal(output.label_valid, inputs.label_valid)
    for name in ("weighted_ce_sum", "weight_sum", "correct_sum", "label_count", "tau_sum", "block_count",
                 "blocks_computed", "correct_per_position", "count_per_position"):
        for result in (prepared, check):
            assert relative(getattr(result, name), getattr(reference, name)) <= TOLERANCE, name
    assert inputs.weight_sum == pytest.approx(float(reference.weight_sum), rel=1e-6)
    for (name, _), got, want in zip(drafter.named_parameters(), prepared_grads, reference_grads):
        assert want.abs().max() > 0, name
        assert relative(got, want) <= TOLERANCE, name


def test_chunked_loss_matches_unchunked_in_float64_with_a_trainable_biased_head():
    generator = torch.Generator().manual_seed(0)
    blocks, slots, width, vocab = 7, 3, 8, 50
    head = nn.Linear(width, vocab).double()  # trainable here, with a bias: both gradients
    hidden = torch.randn(blocks, slots, width, generator=generator, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (blocks, slots), generator=generator)
    valid = torch.rand(blocks, slots, generator=generator) < 0.8
    keep = torch.ones(blocks, dtype=torch.bool)
    keep[-1], valid[-1] = False, False
    from harness.models.drafter_loss import slot_decay

    weights = valid.float() * slot_decay(slots + 1, 2.0)
    reference = drafter_loss(head(hidden), labels, valid, keep, 2.0)
    ref_grads = torch.autograd.grad(reference.weighted_ce_sum, [hidden, head.weight, head.bias])
    for chunk in (1, 3, 100):
        got = chunked_drafter_loss(hidden, head, labels, weights, valid, keep, chunk)
        grads = torch.autograd.grad(got.weighted_ce_sum * 2.5, [hidden, head.weight, head.bias])
        torch.testing.assert_close(got.weighted_ce_sum, reference.weighted_ce_sum, rtol=1e-12, atol=1e-12)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, 2.5 * r, rtol=1e-10, atol=1e-12)
        for name in ("correct_sum", "label_count", "tau_sum", "block_count", "correct_per_position"):
            torch.testing.assert_close(getattr(got, name), getattr(reference, name))
    with torch.no_grad():
        assert not chunked_drafter_loss(hidden, head, labels, weights, valid, keep, 2).weighted_ce_sum.requires_grad


def test_per_position_accuracy_sums_to_the_total_and_adds():
    labels = torch.tensor([[1, 2, 3], [1, 2, 3]])
    valid = torch.tensor([[True, True, True], [True, False, True]])
    logits = torch.nn.functional.one_hot(torch.tensor([[1, 2, 0], [1, 2, 3]]), 4).float() * 30.0
    result = drafter_loss(logits, labels, valid, torch.tensor([True, True]), loss_decay_gamma=2.0)
    assert result.correct_per_position.tolist() == [2, 1, 1] and result.count_per_position.tolist() == [2, 1, 2]
    assert result.accuracy_per_position == [1.0, 1.0, 0.5]
    both = result + result
    assert isinstance(both, DrafterLoss) and both.count_per_position.tolist() == [4, 2, 4]


# ----------------------------------------------------------------------------- memory


def _measure(function):
    """Bytes saved for backward and the largest LM head output while running ``function()``."""
    saved, largest = [0], [0]

    def pack(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    def record(module, args, output):
        largest[0] = max(largest[0], output.numel() * output.element_size())

    return saved, largest, pack, record


def test_loss_memory_stays_flat_as_blocks_grow():
    vocab, width, chunk = 8192, 64, 16
    drafter = make_drafter(vocab=vocab, hidden=width, loss_chunk_blocks=chunk, num_hidden_layers=1)
    head = drafter.lm_head
    slots = BLOCK - 1
    chunk_logits = chunk * slots * vocab * 4
    measured = {}
    for num_docs in (1, 16):  # 64 and 1024 blocks
        tokens = [torch.randint(0, vocab, (80,)) for _ in range(num_docs)]
        batch = TokenBatch.from_documents(tokens, "packed")
        inputs = build(batch, list(range(num_docs)), drafter, num_anchors=64)
        blocks = inputs.num_blocks
        assert blocks == 64 * num_docs
        hidden = torch.randn(blocks, slots, width, requires_grad=True)
        for name, run in (
            ("chunked", lambda: drafter.prepared_loss(inputs, hidden)),
            ("unchunked", lambda: drafter_loss(head(hidden), inputs.labels, inputs.label_valid, inputs.layout.keep,
                                               GAMMA)),
        ):
            saved, largest, pack, record = _measure(run)
            handle = head.register_forward_hook(record)
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    result = run()
                result.weighted_ce_sum.backward()
            finally:
                handle.remove()
            measured[name, blocks] = (saved[0], largest[0])
    for blocks in (64, 1024):
        saved, largest = measured["chunked", blocks]
        assert largest == chunk_logits, blocks  # one chunk of logits at a time
        assert saved <= chunk_logits, blocks  # only the hidden-sized gradient is kept for backward
        unchunked_saved, unchunked_largest = measured["unchunked", blocks]
        assert unchunked_largest == blocks * slots * vocab * 4
        assert unchunked_saved >= blocks * slots * vocab * 4  # the test can tell the two apart
    assert measured["chunked", 1024][1] == measured["chunked", 64][1]
    assert measured["unchunked", 1024][0] >= 10 * measured["unchunked", 64][0]  # linear in the blocks


# ----------------------------------------------------------------------------- no blocks, devices, config


def test_a_micro_batch_without_blocks_gives_zero_loss_and_zero_gradients():
    drafter = make_drafter()
    tokens, masks = corpus([3, 1, 2])
    batch = TokenBatch.from_documents(tokens, "packed", masks)
    inputs = build(batch, [0, 1, 2], drafter)
    assert inputs.num_blocks == 0 and inputs.documents_without_anchor == 3 and inputs.weight_sum == 0.0
    states = features_for(batch, random_features([3, 1, 2]))
    result = drafter.prepared_loss(inputs, drafter.forward_prepared(inputs, states))
    assert result.weighted_ce_sum.item() == 0.0 and result.block_count.item() == 0
    assert result.correct_per_position.shape == (BLOCK - 1,)
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    grads = torch.autograd.grad(result.weighted_ce_sum, trainable, allow_unused=True)
    assert all(g is not None and not bool(g.any()) for g in grads)


def test_the_device_path_reads_nothing_back():
    """forward_prepared, prepared_loss and backward run on the meta device, where any read of a
    value back to the host (.item(), .tolist(), bool()) raises: the device path never syncs."""
    drafter = make_drafter(loss_chunk_blocks=2)
    meta = DFlashDrafter(drafter.config, nn.Embedding(VOCAB, HIDDEN).to("meta"),
                         nn.Linear(HIDDEN, VOCAB, bias=False).to("meta"), TARGET_LAYERS).to("meta")
    tokens, masks = corpus([13, 2, 22])
    for layout in ("packed", "padded"):
        batch = TokenBatch.from_documents(tokens, layout, masks)
        inputs = build(batch, [0, 1, 2], meta).to("meta")
        states = [torch.randn(*batch.input_ids.shape, HIDDEN, device="meta") for _ in range(2)]
        result = meta.prepared_loss(inputs, meta.forward_prepared(inputs, states))
        result.weighted_ce_sum.backward()
        assert all(p.grad is not None for p in meta.parameters())


def test_to_moves_without_validation_and_a_raw_batch_is_still_checked(monkeypatch):
    import harness.models.layout as layout_module
    from harness.models.target import HybridTarget

    tokens, masks = corpus([9, 5, 12])
    batch = TokenBatch.from_documents(tokens, "packed", masks)
    inputs = build(batch, [0, 1, 2])
    target = HybridTarget("conf/target/tiny.yaml", tap_layer_ids=[1])

    def refuse(*args, **kwargs):
        raise AssertionError("validated again")

    monkeypatch.setattr(layout_module, "validate_cu_seqlens", refuse)
    moved = batch.to("cpu", non_blocking=True)
    assert moved.cu_seqlens_host == batch.cu_seqlens_host == (0, 9, 14, 26)
    assert torch.equal(moved.cu_seqlens, batch.cu_seqlens)
    moved_inputs = inputs.to("cpu")
    assert torch.equal(moved_inputs.labels, inputs.labels) and moved_inputs.dense_slices == inputs.dense_slices
    target(moved)  # the trusted host copy: no check, no read back
    monkeypatch.undo()
    raw = TokenBatch.from_documents(tokens, "packed", masks)
    raw.cu_seqlens = torch.tensor([0, 9, 14, 25], dtype=torch.int32)  # corrupted: the host copy is dropped
    assert raw.cu_seqlens_host is None
    with pytest.raises(ValueError, match="end at the packed length"):
        target(raw.to("cpu"))
    with pytest.raises(ValueError, match="disagrees with cu_seqlens"):
        TokenBatch(batch.input_ids, batch.position_ids, batch.loss_mask, cu_seqlens=batch.cu_seqlens,
                   cu_seqlens_host=(0, 9, 15, 26))


def test_pin_memory_pins_every_tensor_when_an_accelerator_is_present():
    tokens, masks = corpus([9, 5, 12])
    for layout in ("packed", "padded"):
        batch = TokenBatch.from_documents(tokens, layout, masks)
        inputs = build(batch, [0, 1, 2])
        pinned_batch, pinned_inputs = batch.pin_memory(), inputs.pin_memory()
        assert pinned_inputs.weight_sum == inputs.weight_sum
        assert torch.equal(pinned_inputs.block_input_ids, inputs.block_input_ids)
        if not torch.cuda.is_available():
            continue  # nothing can be pinned without an accelerator: the objects come back unchanged
        tensors = [pinned_batch.input_ids, pinned_batch.loss_mask, pinned_inputs.labels, pinned_inputs.loss_weights,
                   pinned_inputs.layout.anchor, pinned_inputs.documents.source_index]
        assert all(t.is_pinned() for t in tensors)
        on_device = pinned_inputs.to("cuda")
        assert on_device.labels.is_cuda and on_device.documents.doc_of_token.is_cuda


def test_build_checks_its_input():
    tokens, masks = corpus([9, 5])
    batch = TokenBatch.from_documents(tokens, "packed", masks)
    with pytest.raises(ValueError, match="1 sample indices for 2 documents"):
        build(batch, [0])
    with pytest.raises(ValueError, match="sample_index must be >= 0"):
        build(batch, [0, -1])
    with pytest.raises(ValueError, match="token id 70 at position 0 of document 1"):
        bad = TokenBatch.from_documents([tokens[0], tokens[1] * 0 + 70], "packed", masks)
        build(bad, [0, 1], vocab_size=VOCAB)
    drafter = make_drafter()
    wrong = build(batch, [0, 1], mask_token_id=3)
    with pytest.raises(ValueError, match="inputs were prepared for block_size=4, mask_token_id=3"):
        drafter.forward_prepared(wrong, features_for(batch, random_features([9, 5])))


def test_config_takes_the_memory_knobs():
    config = load_drafter_config("conf/drafter/tiny.yaml")
    assert config.max_blocks is None and config.loss_chunk_blocks == 256
    assert load_drafter_config({"max_blocks": 4096, "loss_chunk_blocks": 64}).max_blocks == 4096
    with pytest.raises(ValueError, match="max_blocks must be at least 1"):
        DrafterConfig(max_blocks=0)
    with pytest.raises(ValueError, match="loss_chunk_blocks must be at least 1"):
        DrafterConfig(loss_chunk_blocks=0)


def test_batches_carry_their_host_token_id_range_and_edits_drop_it():
    from harness.models.target import HybridTarget

    target = HybridTarget("conf/target/tiny.yaml", tap_layer_ids=[0])
    for layout in ("packed", "padded"):
        batch = TokenBatch.from_documents([torch.tensor([5, 9, 2]), torch.tensor([7])], layout, pad_token_id=-100)
        assert batch.token_id_range == (2, 9) and batch.to("cpu").token_id_range == (2, 9)
        bad = TokenBatch.from_documents([torch.tensor([5, 300])], layout)
        assert bad.token_id_range == (5, 300)
        with pytest.raises(ValueError, match=r"input_ids\[0, 1\]=300 is not a token id"):
            target(bad)  # the host range says out of vocabulary: the device check names the position
        batch.input_ids = batch.input_ids.clone()
        assert batch.token_id_range is None  # edited by hand: checked on the device again
        batch.input_ids[0, 0] = 256
        with pytest.raises(ValueError, match=r"input_ids\[0, 0\]=256 is not a token id"):
            target(batch)


def test_chunked_loss_in_bfloat16_stays_close_to_the_unchunked_one():
    torch.manual_seed(0)
    head = nn.Linear(32, 300, bias=False).to(torch.bfloat16)
    hidden = torch.randn(20, 3, 32, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 300, (20, 3))
    valid = torch.ones(20, 3, dtype=torch.bool)
    keep = torch.ones(20, dtype=torch.bool)
    from harness.models.drafter_loss import slot_decay

    weights = valid.float() * slot_decay(4, 3.0)
    reference = drafter_loss(head(hidden), labels, valid, keep, 3.0)
    (ref_grad,) = torch.autograd.grad(reference.weighted_ce_sum, [hidden])
    got = chunked_drafter_loss(hidden, head, labels, weights, valid, keep, 7)
    (grad,) = torch.autograd.grad(got.weighted_ce_sum, [hidden])
    assert got.weighted_ce_sum.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert relative(got.weighted_ce_sum, reference.weighted_ce_sum) <= 1e-5  # the same bf16 logits, CE in fp32
    assert relative(grad, ref_grad) <= 1e-2


# ----------------------------------------------------------------------------- anchors: exact values and edges


def three_documents(layout="packed"):
    """Lengths 6, 5 and 1 (the one-token document last), token == 10 * (document + 1) + position."""
    tokens = [torch.arange(10, 16), torch.arange(20, 25), torch.tensor([30])]
    masks = [torch.ones(6, dtype=torch.long), torch.tensor([1, 1, 0, 1, 1]), torch.ones(1, dtype=torch.long)]
    return FlatDocuments.from_batch(TokenBatch.from_documents(tokens, layout, masks))


def test_padded_rows_may_be_left_padded_or_one_token_long():
    documents = [torch.tensor([5]), torch.tensor([6, 7, 8]), torch.tensor([9, 10])]
    right = TokenBatch.from_documents(documents, "padded")
    ids, real = torch.zeros(3, 3, dtype=torch.long), torch.zeros(3, 3, dtype=torch.long)
    for row, doc in enumerate(documents):  # the same documents at the end of their rows
        ids[row, 3 - doc.numel():], real[row, 3 - doc.numel():] = doc, 1
    left = TokenBatch(ids, ids * 0, real.clone(), attention_mask=real)
    packed = TokenBatch.from_documents(documents, "packed")
    sources = {"right": [0, 3, 4, 5, 6, 7], "left": [2, 3, 4, 5, 7, 8], "packed": [0, 1, 2, 3, 4, 5]}
    for name, batch in (("right", right), ("left", left), ("packed", packed)):
        flat = FlatDocuments.from_batch(batch)
        assert flat.token_ids.tolist() == [5, 6, 7, 8, 9, 10], name
        assert flat.doc_starts.tolist() == [0, 1, 4] and flat.doc_lengths.tolist() == [1, 3, 2], name
        assert flat.doc_of_token.tolist() == [0, 1, 1, 1, 2, 2], name
        assert flat.position_in_document.tolist() == [0, 0, 1, 2, 0, 1], name
        assert flat.source_index.tolist() == sources[name], name
        assert flat.loss_mask.dtype == torch.bool and bool(flat.loss_mask.all()), name
        for field in ("token_ids", "doc_starts", "doc_lengths", "source_index", "doc_of_token"):
            assert getattr(flat, field).dtype == torch.int64, (name, field)
        assert flat.gather(batch.input_ids[..., None] * 2).tolist() == [[10], [12], [14], [16], [18], [20]], name


def test_bad_padded_rows_are_named():
    def padded(real):
        real = torch.tensor(real)
        return TokenBatch(real * 7, real * 0, real.clone(), attention_mask=real)

    # row 0 holds one token, rows 1 and 2 none: the first bad row is named
    with pytest.raises(ValueError, match=r"^attention_mask row 1 has no real token; drop empty rows from the batch$"):
        FlatDocuments.from_batch(padded([[1, 0, 0], [0, 0, 0], [0, 0, 0]]))
    # row 0 is left-padded (fine), rows 1 and 2 have holes
    with pytest.raises(ValueError, match=r"^attention_mask row 1 has holes between real tokens; a padded row must "
                                         r"hold one document in consecutive positions$"):
        FlatDocuments.from_batch(padded([[0, 1, 1], [1, 0, 1], [1, 0, 1]]))
    batch = TokenBatch.from_documents([torch.arange(4), torch.arange(3)], "padded")
    batch.loss_mask = batch.loss_mask[:, :-1]
    with pytest.raises(ValueError, match=r"^loss_mask has shape \(2, 3\) but input_ids has \(2, 4\); give one "
                                         r"loss_mask entry per token$"):
        FlatDocuments.from_batch(batch)


def test_block_layout_values_with_padding_blocks_and_a_one_token_document():
    for layout_name in ("packed", "padded"):
        flat = three_documents(layout_name)
        anchors = [torch.tensor([1, 4], dtype=torch.int32), torch.tensor([0, 3]), torch.zeros(0, dtype=torch.long)]
        layout = build_block_layout(flat, anchors, block_size=3, blocks_per_document=3)
        assert layout.doc_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        assert layout.anchor.tolist() == [1, 4, 0, 0, 3, 0, 0, 0, 0] and layout.anchor.dtype == torch.int64
        assert layout.keep.tolist() == [True, True, False, True, True, False, False, False, False]
        assert layout.blocks_per_document.tolist() == [3, 3, 3] and layout.blocks_per_document.dtype == torch.int64
        assert layout.num_blocks == 9 and layout.num_kept == 4
        assert layout.slot_positions()[:5].tolist() == [[1, 2, 3], [4, 5, 6], [0, 1, 2], [0, 1, 2], [3, 4, 5]]
        assert block_input_ids(flat, layout, 99).tolist() == [[11, 99, 99], [14, 99, 99], [99, 99, 99],
                                                              [20, 99, 99], [23, 99, 99]] + [[99, 99, 99]] * 4
        targets = block_targets(flat, layout)
        # slot k of the block at a is the token at a + k; past the document end (a + k == length
        # included) or where loss_mask is 0 it does not count; unused blocks never count
        assert targets.labels.tolist() == [[12, 13], [15, 0], [0, 0], [21, 0], [24, 0]] + [[0, 0]] * 4
        assert targets.valid.tolist() == [[True, True], [True, False], [False, False], [True, False],
                                          [True, False]] + [[False, False]] * 4
        visible = context_visible(layout.anchor[:3], layout.keep[:3], 6)
        assert visible.tolist() == [[True] + [False] * 5, [True] * 4 + [False] * 2, [False] * 6]
        inputs = DrafterInputs.from_layout(flat, layout, token_shape=tuple(flat.token_ids.shape) + (1,),
                                           mask_token_id=99, loss_decay_gamma=2.0)
        decay = math.exp(-0.5)
        expected = [[1.0, 1.0], [1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [1.0, 0.0]] + [[0.0, 0.0]] * 4
        expected[0][1] = decay
        assert inputs.loss_weights.dtype == torch.float32
        torch.testing.assert_close(inputs.loss_weights, torch.tensor(expected), rtol=0, atol=1e-7)
        assert inputs.weight_sum == pytest.approx(4 + decay, rel=1e-7)
        assert inputs.num_blocks_candidates == 4 and inputs.num_blocks_capped == 0
        assert inputs.documents_without_anchor == 1  # the one-token document holds padding blocks only
        # the unused blocks see no context: the one-token document's blocks see none at all
        assert inputs.dense_slices == (DenseSlice(0, 3, 0, 4), DenseSlice(3, 6, 6, 3), DenseSlice(6, 9, 11, 0))


def test_dense_slices_skip_documents_without_blocks():
    tokens = [torch.arange(8), torch.arange(3), torch.arange(6), torch.arange(7)]
    flat = FlatDocuments.from_batch(TokenBatch.from_documents(tokens, "packed"))
    anchors = [torch.tensor([2, 5]), torch.zeros(0, dtype=torch.long), torch.tensor([3]), torch.tensor([0, 4])]
    layout = build_block_layout(flat, anchors, block_size=2)
    inputs = DrafterInputs.from_layout(flat, layout, token_shape=(1, 24), mask_token_id=0, loss_decay_gamma=1.0,
                                       num_blocks_candidates=9, num_blocks_capped=4, documents_without_anchor=3)
    assert inputs.dense_slices == (DenseSlice(0, 2, 0, 5), DenseSlice(2, 3, 11, 3), DenseSlice(3, 5, 17, 4))
    assert (inputs.num_blocks_candidates, inputs.num_blocks_capped, inputs.documents_without_anchor) == (9, 4, 3)
    assert inputs.token_shape == (1, 24) and inputs.block_size == 2 and inputs.num_blocks == 5


def test_block_layout_bounds_are_inclusive_and_bad_anchors_are_named():
    flat = three_documents()
    empty = torch.zeros(0, dtype=torch.long)
    # block_size 2 and an anchor at length - 2 (one label, the document's last token) are fine
    layout = build_block_layout(flat, [torch.tensor([4]), torch.tensor([0, 3]), empty], block_size=2)
    assert block_targets(flat, layout).labels.tolist() == [[15], [21], [24]]
    assert build_block_layout(flat, [torch.tensor([4]), empty, empty], 2, blocks_per_document=1).num_blocks == 3
    with pytest.raises(ValueError, match=r"^block_size must be at least 2 \(slot 0 holds the anchor, slots 1\.\. are "
                                         r"predicted\), got 1$"):
        build_block_layout(flat, [empty] * 3, block_size=1)
    with pytest.raises(ValueError, match=r"^anchors has 2 entries but the batch holds 3 documents; give one tensor "
                                         r"of anchor positions per document$"):
        build_block_layout(flat, [empty] * 2, block_size=2)
    for anchors, message in (
        ([torch.tensor([[1, 2]]), empty, empty], r"anchors\[0\] must be a 1-D integer tensor, got shape \(1, 2\) "
                                                 r"dtype torch.int64"),
        ([empty, torch.tensor([1.0]), empty], r"anchors\[1\] must be a 1-D integer tensor, got shape \(1,\) "
                                              r"dtype torch.float32"),
        ([torch.tensor([0, 5]), empty, empty], r"anchors\[0\] holds position 5 but document 0 has 6 tokens; an "
                                               r"anchor must lie in \[0, 4\] so that its block has a label inside "
                                               r"the same document"),
        # the lowest is named when it is out of range, even when the highest sits exactly on the bound
        ([torch.tensor([-1, 4]), empty, empty], r"anchors\[0\] holds position -1 but document 0 has 6 tokens"),
        ([empty, empty, torch.tensor([0])], r"anchors\[2\] holds position 0 but document 2 has 1 tokens; an anchor "
                                            r"must lie in \[0, -1\]"),
    ):
        with pytest.raises(ValueError, match="^" + message):
            build_block_layout(flat, anchors, block_size=3)
    with pytest.raises(ValueError, match=r"^blocks_per_document=1 is smaller than the 2 anchors of one document; "
                                         r"raise it to at least 2 or leave it unset$"):
        build_block_layout(flat, [empty, torch.tensor([0, 3]), empty], block_size=3, blocks_per_document=1)


def test_a_micro_batch_without_documents_prepares_no_blocks():
    ids = torch.zeros(0, 4, dtype=torch.long)
    batch = TokenBatch(ids, ids.clone(), ids.clone(), attention_mask=ids.clone())
    flat = FlatDocuments.from_batch(batch)
    for per_document in (None, 0):
        layout = build_block_layout(flat, [], block_size=4, blocks_per_document=per_document)
        assert layout.num_blocks == 0 and layout.blocks_per_document.dtype == torch.int64
    inputs = build(batch, [])
    assert inputs.num_blocks == 0 and inputs.weight_sum == 0.0 and inputs.dense_slices == ()
    assert inputs.labels.shape == (0, BLOCK - 1) and inputs.documents_without_anchor == 0


def test_valid_anchor_mask_with_blocks_of_two_reaches_the_last_pair():
    tokens = [torch.arange(4), torch.arange(3)]
    masks = [torch.tensor([1, 1, 0, 1]), torch.tensor([0, 1, 1])]
    flat = FlatDocuments.from_batch(TokenBatch.from_documents(tokens, "packed", masks))
    # p needs loss_mask[p] and loss_mask[p + 1] of the same document, and p <= length - 2
    assert valid_anchor_mask(flat, 2).tolist() == [True, False, False, False, False, True, False]
    assert valid_anchor_mask(flat, 3).tolist() == [True, False, False, False, False, False, False]
    assert anchor_candidates(masks[1].numpy(), 2).tolist() == [1]
    with pytest.raises(ValueError, match=r"^block_size must be at least 2, got 1$"):
        valid_anchor_mask(flat, 1)
    with pytest.raises(ValueError, match=r"^block_size must be at least 2, got 1$"):
        anchor_candidates(masks[0].numpy(), 1)
    anchors = sample_anchors(flat, 1, torch.Generator().manual_seed(0), block_size=2)
    assert [a.tolist() for a in anchors] == [[0], [1]]
    with pytest.raises(ValueError, match=r"^num_anchors must be at least 1, got 0$"):
        sample_anchors(flat, 0, torch.Generator(), block_size=2)


def test_sample_anchors_keep_the_smallest_float64_keys_of_each_document():
    lengths = [30, 3, 25, 12, 41]
    tokens, masks = corpus(lengths)
    flat = FlatDocuments.from_batch(TokenBatch.from_documents(tokens, "packed", masks))
    valid = valid_anchor_mask(flat, BLOCK)
    # one uniform float64 key per flat token, drawn from the generator in order
    keys = torch.rand(flat.num_tokens, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    drawn = sample_anchors(flat, 5, torch.Generator().manual_seed(3), block_size=BLOCK)
    for doc, (start, length) in enumerate(zip(flat.doc_starts.tolist(), flat.doc_lengths.tolist())):
        candidates = [p for p in range(length) if valid[start + p]]
        expected = sorted(sorted(candidates, key=lambda p: float(keys[start + p]))[:5])
        assert drawn[doc].tolist() == expected and drawn[doc].dtype == torch.int64, doc
    assert [a.numel() for a in drawn] == [5, 0, 5, 5, 5]


def test_everything_is_made_on_the_batchs_device_not_torchs_default():
    """Under a default device of ``meta``, every tensor still lands on the batch's (CPU) device."""
    tokens, masks = corpus([13, 2, 22, 9])
    for layout_name in ("packed", "padded"):
        batch = TokenBatch.from_documents(tokens, layout_name, masks)
        reference_flat = FlatDocuments.from_batch(batch)
        reference_anchors = sample_anchors(reference_flat, 3, torch.Generator().manual_seed(1), block_size=BLOCK)
        reference = build(batch, [0, 1, 2, 3], num_anchors=3, max_blocks=5)
        with torch.device("meta"):
            flat = FlatDocuments.from_batch(batch)
            anchors = sample_anchors(flat, 3, torch.Generator().manual_seed(1), block_size=BLOCK)
            layout = build_block_layout(flat, anchors, BLOCK, blocks_per_document=4)
            made = [*(getattr(flat, f.name) for f in dataclasses.fields(flat)), flat.position_in_document,
                    valid_anchor_mask(flat, BLOCK), *anchors, layout.doc_index, layout.anchor, layout.keep,
                    layout.blocks_per_document, layout.slot_positions(), block_input_ids(flat, layout, 99),
                    block_targets(flat, layout).labels, context_visible(layout.anchor, layout.keep, 5)]
            inputs = build(batch, [0, 1, 2, 3], num_anchors=3, max_blocks=5)
        assert all(t.device.type == "cpu" for t in made), layout_name
        for f in dataclasses.fields(flat):
            assert torch.equal(getattr(flat, f.name), getattr(reference_flat, f.name)), (layout_name, f.name)
        assert [a.tolist() for a in anchors] == [a.tolist() for a in reference_anchors], layout_name
        assert inputs.dense_slices == reference.dense_slices and inputs.weight_sum == reference.weight_sum
        for name in ("block_input_ids", "labels", "label_valid", "loss_weights", "context_positions"):
            assert torch.equal(getattr(inputs, name), getattr(reference, name)), (layout_name, name)
        assert torch.equal(inputs.layout.doc_index, reference.layout.doc_index), layout_name


def test_document_weight_sum_is_the_built_weight_sum_of_one_document():
    mask = np.array([0, 1, 1, 0, 1, 1, 1], dtype=np.int64)
    # block 4, gamma 2: slots weigh 1, e^-1/2, e^-1; the block at 1 loses its slot 2 (masked), the
    # block at 4 its slot 3 (past the end)
    expected = (1 + math.exp(-1.0)) + (1 + math.exp(-0.5))
    assert document_weight_sum(mask, np.array([1, 4]), block_size=4, loss_decay_gamma=2.0) == pytest.approx(
        expected, rel=1e-7)
    assert document_weight_sum(torch.from_numpy(mask), [4], block_size=4, loss_decay_gamma=2.0) == pytest.approx(
        1 + math.exp(-0.5), rel=1e-7)
    assert document_weight_sum(mask[None], np.array([[1, 4]]), block_size=4,
                               loss_decay_gamma=2.0) == pytest.approx(expected, rel=1e-7)  # flattened
    assert document_weight_sum(mask, np.zeros(0, dtype=np.int64), block_size=4, loss_decay_gamma=2.0) == 0.0
    assert document_weight_sum(mask, [5], block_size=2, loss_decay_gamma=2.0) == 1.0
    assert document_weight_sum(np.ones(1), [0], block_size=3, loss_decay_gamma=2.0) == 0.0  # wholly past the end
    # the same sum as DrafterInputs.build, document by document, for drawn anchors
    tokens, masks = corpus([30, 3, 25, 12])
    batch = TokenBatch.from_documents(tokens, "packed", masks)
    for gamma in (1.5, 7.0):
        inputs = build(batch, [4, 3, 2, 1], loss_decay_gamma=gamma)
        sums = [document_weight_sum(m.numpy(), a, block_size=BLOCK, loss_decay_gamma=gamma)
                for m, a in zip(masks, anchors_by_document(inputs))]
        assert sums[1] == 0.0 and min(sums[0], sums[2], sums[3]) > 1.0
        assert sum(sums) == pytest.approx(inputs.weight_sum, rel=1e-12)


def test_document_anchors_returns_every_candidate_with_its_key_when_few():
    mask = np.array([1, 1, 1, 0, 1, 1, 1, 1])
    candidates = anchor_candidates(mask, 3)
    assert candidates.tolist() == [0, 1, 4, 5] and candidates.dtype == np.int64
    assert anchor_candidates(mask[None], 3).tolist() == [0, 1, 4, 5]  # a [1, n] row is flattened
    entropy = np.random.SeedSequence([9, 2, 40, ANCHOR_PURPOSE])
    keys = np.random.default_rng(entropy).random(4)
    for num_anchors in (4, 10):
        positions, got = document_anchors(mask, block_size=3, num_anchors=num_anchors, seed=9, epoch=2,
                                          sample_index=40)
        assert positions.tolist() == [0, 1, 4, 5] and got.tolist() == keys.tolist()
    positions, got = document_anchors(mask, block_size=3, num_anchors=1, seed=9, epoch=2, sample_index=40)
    assert positions.tolist() == [int(candidates[np.argmin(keys)])] and got.tolist() == [keys.min()]
    only, only_keys = document_anchors(mask[:3], block_size=3, num_anchors=2, seed=9, epoch=2, sample_index=40)
    assert only.tolist() == [0] and only_keys.tolist() == keys[:1].tolist()  # a single candidate keeps its key
    none, none_keys = document_anchors(mask[:2], block_size=3, num_anchors=2, seed=9, epoch=2, sample_index=40)
    assert none.dtype == np.int64 and none_keys.dtype == np.float64 and none.size == none_keys.size == 0
    with pytest.raises(ValueError, match=r"^num_anchors must be at least 1, got 0$"):
        document_anchors(mask, block_size=3, num_anchors=0, seed=9, epoch=2, sample_index=40)
    for name in ("seed", "epoch", "sample_index"):
        parts = {"seed": 9, "epoch": 2, "sample_index": 40, name: -3}
        with pytest.raises(ValueError, match=rf"^{name} must be >= 0 \(it seeds the anchor draw\), got -3$"):
            document_anchors(mask, block_size=3, num_anchors=2, **parts)


def test_key_ties_go_to_the_earlier_position_and_then_the_earlier_document(monkeypatch):
    """Ties between keys (never in practice) break by position, then document: a stable sort, the same on every
    platform (numpy's default sort is not stable, and its order differs between CPUs)."""
    tied = np.tile([0.5, 0.25, 0.75, 0.25], 3)

    class TiedGenerator:
        def random(self, size):
            return tied[:size].copy()

    with monkeypatch.context() as patch:
        patch.setattr(np.random, "default_rng", lambda seed: TiedGenerator())
        positions, keys = document_anchors(np.ones(14), block_size=3, num_anchors=3, seed=0, epoch=0, sample_index=0)
    assert positions.tolist() == [1, 3, 5] and keys.tolist() == [0.25] * 3

    def tied_anchors(loss_mask, **kwargs):
        return np.arange(4, dtype=np.int64), tied[:4].copy()

    monkeypatch.setattr(drafter_inputs_module, "document_anchors", tied_anchors)
    batch = TokenBatch.from_documents([torch.arange(8)] * 3, "packed")
    capped = build(batch, [0, 1, 2], max_blocks=3)
    assert anchors_by_document(capped) == [[1, 3], [1], []] and capped.num_blocks_capped == 9
    assert capped.documents_without_anchor == 0  # every document had candidates; the cap took the last one's


def test_the_cap_never_counts_a_document_as_without_anchor():
    tokens, masks = corpus([40, 40, 5])
    batch = TokenBatch.from_documents(tokens, "packed", masks)
    capped = build(batch, [0, 1, 2], num_anchors=8, max_blocks=1)
    assert capped.num_blocks == 1 and capped.num_blocks_capped == 15 and capped.num_blocks_candidates == 16
    assert capped.documents_without_anchor == 1  # the 5-token document; the one the cap emptied had candidates
    one = build(batch, [0, 1, 2], num_anchors=8, max_blocks=16)  # as many as drawn: nothing capped
    assert one.num_blocks == 16 and one.num_blocks_capped == 0


def test_build_refuses_device_batches_and_bad_caps_and_checks_the_vocabulary_bounds():
    tokens, masks = corpus([9, 5])
    batch = TokenBatch.from_documents(tokens, "packed", masks)
    with pytest.raises(ValueError, match=r"^DrafterInputs.build prepares micro-batches on the host; got a batch on "
                                         r"meta$"):
        build(batch.to("meta"), [0, 1])
    with pytest.raises(ValueError, match=r"^max_blocks must be at least 1 or None, got 0$"):
        build(batch, [0, 1], max_blocks=0)
    assert build(batch, [0, 1], max_blocks=1).num_blocks == 1
    with pytest.raises(ValueError, match=r"^3 sample indices for 2 documents in the batch; give one sample index per "
                                         r"document, in batch order$"):
        build(batch, [0, 1, 2])
    edge = [torch.tensor([0, 5, VOCAB - 1, 2]), torch.tensor([1, 2, VOCAB, VOCAB])]
    assert build(TokenBatch.from_documents(edge[:1], "packed"), [0], vocab_size=VOCAB).num_blocks == 1
    with pytest.raises(ValueError, match=rf"^token id {VOCAB} at position 2 of document 1 is outside the target "
                                         rf"vocabulary \[0, {VOCAB}\); tokenize with the target's tokenizer$"):
        build(TokenBatch.from_documents(edge, "padded"), [0, 1], vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"^token id -1 at position 1 of document 0"):
        build(TokenBatch.from_documents([torch.tensor([3, -1, 4])], "packed"), [0], vocab_size=VOCAB)


class _RecordCopies(TorchFunctionMode):
    """Records every ``Tensor.to`` (device, non_blocking) and turns ``Tensor.pin_memory`` into a recorded clone."""

    def __init__(self):
        super().__init__()
        self.moves, self.pinned = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.pin_memory:
            self.pinned.append(args[0].clone())
            return self.pinned[-1]
        if func is torch.Tensor.to:
            self.moves.append((str(args[1]), bool(kwargs.get("non_blocking", False))))
        return func(*args, **kwargs)


def _tensor_fields(obj):
    return [getattr(obj, f.name) for f in dataclasses.fields(obj) if isinstance(getattr(obj, f.name), torch.Tensor)]


def test_to_moves_every_tensor_once_with_the_requested_non_blocking():
    tokens, masks = corpus([9, 5, 12])
    inputs = build(TokenBatch.from_documents(tokens, "padded", masks), [0, 1, 2])
    parts = (inputs.documents, inputs.layout)
    total = sum(len(_tensor_fields(obj)) for obj in (inputs, *parts))
    assert [len(_tensor_fields(obj)) for obj in parts] == [6, 4] and total == 15
    for obj, args, count, non_blocking in ((inputs.documents, (), 6, False), (inputs.documents, (True,), 6, True),
                                           (inputs.layout, (), 4, False), (inputs, (), total, True),
                                           (inputs, (False,), total, False)):
        with _RecordCopies() as record:
            moved = obj.to("meta", *args)
        assert record.moves == [("meta", non_blocking)] * count, (type(obj).__name__, args)
        assert type(moved) is type(obj)
        for inner in (moved, *((moved.documents, moved.layout) if obj is inputs else ())):
            assert all(t.device.type == "meta" for t in _tensor_fields(inner))
    moved = inputs.to("meta")
    assert moved.layout.block_size == BLOCK and moved.weight_sum == inputs.weight_sum
    assert moved.dense_slices == inputs.dense_slices and moved.layout.anchor.shape == inputs.layout.anchor.shape


def test_pin_memory_pins_every_tensor_only_where_memory_can_be_pinned(monkeypatch):
    import harness.models.layout as layout_module

    tokens, masks = corpus([9, 5, 12])
    inputs = build(TokenBatch.from_documents(tokens, "packed", masks), [0, 1, 2])
    for can_pin in (False, True):
        monkeypatch.setattr(layout_module, "_can_pin", lambda: can_pin)
        monkeypatch.setattr(drafter_inputs_module, "_can_pin", lambda: can_pin)
        for obj in (inputs, inputs.documents, inputs.layout):
            with _RecordCopies() as record:
                pinned = obj.pin_memory()
            if not can_pin:
                assert pinned is obj and record.pinned == []
                continue
            objects = (pinned, pinned.documents, pinned.layout) if obj is inputs else (pinned,)
            fields = [t for o in objects for t in _tensor_fields(o)]
            originals = [t for o in ((obj, obj.documents, obj.layout) if obj is inputs else (obj,))
                         for t in _tensor_fields(o)]
            assert len(fields) == len(originals) == len(record.pinned)
            assert all(any(t is p for p in record.pinned) for t in fields)
            assert all(torch.equal(a, b) for a, b in zip(fields, originals))
            kept = [f.name for f in dataclasses.fields(obj) if not isinstance(getattr(obj, f.name), torch.Tensor)]
            assert all(getattr(pinned, name) == getattr(obj, name) for name in kept
                       if name not in ("documents", "layout"))
