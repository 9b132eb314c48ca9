"""The drafter's training path: per-sample anchors, host-prepared DrafterInputs, chunked loss, memory."""

import numpy as np
import pytest
import torch
from torch import nn

from harness.models.drafter import DFlashDrafter, DrafterConfig, load_drafter_config
from harness.models.drafter_inputs import DrafterInputs, anchor_candidates, document_anchors
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
