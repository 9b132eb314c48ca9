"""Target + drafter end to end: packed, padded and each document alone give the same loss and gradients."""

import copy
import dataclasses

import pytest
import torch

from harness.models.anchors import FlatDocuments, sample_anchors
from harness.models.compare import max_relative_difference
from harness.models.drafter import DFlashDrafter, load_drafter_config
from harness.models.layout import TokenBatch
from harness.models.target import HybridTarget

# Length 1 (no anchor), lengths that are not multiples of the GDN chunk size 64, and exactly 64.
LENGTHS = [9, 1, 70, 33, 64]
TOLERANCE = 1e-5  # fp32, relative to the largest magnitude of the reference



@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    config = load_drafter_config("conf/drafter/tiny.yaml")
    target = HybridTarget("conf/target/tiny.yaml", tap_layer_ids=config.target_layer_ids)
    drafter = DFlashDrafter.from_target(target, config)
    return target, drafter


@pytest.fixture(scope="module")
def documents():
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 256, (n,), generator=generator) for n in LENGTHS]
    loss_masks = [torch.ones(n, dtype=torch.long) for n in LENGTHS]
    for mask in loss_masks:
        mask[: min(4, mask.numel() - 1)] = 0  # a prompt the drafter is not trained on
    return tokens, loss_masks



def loss_and_grads(target, drafter, tokens, loss_masks, layout, anchors):
    batch = TokenBatch.from_documents(tokens, layout, loss_masks)
    result = drafter.compute_loss(batch, target(batch), anchors=anchors)
    # a document without anchors contributes no block: its gradient is zero (materialised)
    grads = torch.autograd.grad(
        result.weighted_ce_sum, list(drafter.parameters()), allow_unused=True, materialize_grads=True
    )
    return result, grads


def packed_anchors(drafter, tokens, loss_masks, seed=2):
    flat = FlatDocuments.from_batch(TokenBatch.from_documents(tokens, "packed", loss_masks))
    return sample_anchors(flat, drafter.config.num_anchors, torch.Generator().manual_seed(seed),
                          block_size=drafter.block_size)


def test_packed_padded_and_separate_runs_agree(models, documents):
    target, drafter = models
    tokens, loss_masks = documents
    anchors = packed_anchors(drafter, tokens, loss_masks)
    assert anchors[1].numel() == 0 and anchors[2].numel() == drafter.config.num_anchors
    packed, packed_grads = loss_and_grads(target, drafter, tokens, loss_masks, "packed", anchors)
    padded, padded_grads = loss_and_grads(target, drafter, tokens, loss_masks, "padded", anchors)
    alone = [loss_and_grads(target, drafter, [t], [m], "packed", [a]) for t, m, a in zip(tokens, loss_masks, anchors)]
    separate = alone[0][0]
    for result, _ in alone[1:]:
        separate = separate + result
    separate_grads = [sum(grads[i] for _, grads in alone) for i in range(len(packed_grads))]
    assert packed.block_count.item() == sum(a.numel() for a in anchors)
    assert packed.weight_sum.item() > 0
    for result in (packed, padded):
        for name in ("weighted_ce_sum", "weight_sum", "correct_sum", "label_count", "tau_sum", "block_count"):
            assert max_relative_difference(getattr(result, name), getattr(separate, name)) <= TOLERANCE, name
    for grads in (packed_grads, padded_grads):
        for name, grad, reference in zip((n for n, _ in drafter.named_parameters()), grads, separate_grads):
            assert reference.abs().max() > 0, name
            assert max_relative_difference(grad, reference) <= TOLERANCE, name


def test_the_same_generator_state_draws_the_same_anchors_in_both_layouts(models, documents):
    target, drafter = models
    tokens, loss_masks = documents
    results = []
    for layout in ("padded", "packed"):
        batch = TokenBatch.from_documents(tokens, layout, loss_masks)
        with torch.no_grad():
            output = drafter(batch, target(batch), generator=torch.Generator().manual_seed(7))
        results.append((output, drafter.loss(output)))
    (padded, padded_loss), (packed, packed_loss) = results
    assert all(torch.equal(a, b) for a, b in zip(padded.anchors, packed.anchors))
    assert max_relative_difference(packed_loss.weighted_ce_sum, padded_loss.weighted_ce_sum) <= TOLERANCE
    # labels of blocks never come from another document
    for doc, positions in enumerate(packed.anchors):
        assert bool((positions + 1 < LENGTHS[doc]).all())
    rows = packed.layout.doc_index
    assert bool((packed.layout.anchor + 1 < torch.tensor(LENGTHS)[rows]).all())


def block_logits(target, drafter, tokens, anchors):
    batch = TokenBatch.from_documents(tokens, "packed")
    with torch.no_grad():
        return drafter(batch, target(batch), anchors=anchors).logits


def test_tokens_at_or_after_the_label_window_start_do_not_reach_a_block(models, documents):
    target, drafter = models
    tokens, _ = documents
    no_anchor = torch.tensor([], dtype=torch.long)
    anchors = [torch.tensor([3]), no_anchor, torch.tensor([30, 50]), torch.tensor([10]), torch.tensor([5])]
    base = block_logits(target, drafter, tokens, anchors)
    row = 1  # document 2, anchor 30

    def with_token(doc, position):
        changed = [t.clone() for t in tokens]
        changed[doc][position] = (changed[doc][position] + 1) % 256
        return block_logits(target, drafter, changed, anchors)

    for position in (31, 35):  # label positions of the block: its context must not see them
        assert max_relative_difference(with_token(2, position)[row], base[row]) <= 1e-6
    assert max_relative_difference(with_token(2, 29)[row], base[row]) > 1e-3  # just before the anchor
    assert max_relative_difference(with_token(2, 30)[row], base[row]) > 1e-3  # the anchor token itself
    other_doc = with_token(0, 8)  # last token of the previous document in the packed row
    assert max_relative_difference(other_doc[1:], base[1:]) <= 1e-6


def test_a_target_that_leaks_state_across_documents_breaks_the_parity(models, documents):
    target, drafter = models
    tokens, loss_masks = documents
    anchors = packed_anchors(drafter, tokens, loss_masks)
    honest, honest_grads = loss_and_grads(target, drafter, tokens, loss_masks, "packed", anchors)
    target.leak_across_documents = True
    try:
        leaky, leaky_grads = loss_and_grads(target, drafter, tokens, loss_masks, "packed", anchors)
    finally:
        target.leak_across_documents = False
    fc = [n for n, _ in drafter.named_parameters()].index("fc.weight")
    assert max_relative_difference(leaky_grads[fc], honest_grads[fc]) > 100 * TOLERANCE


# ----------------------------------------------------------------------------- flex attention path


def drafter_with_backend(drafter, backend):
    """A copy of ``drafter`` (same weights) whose attention runs on ``backend``."""
    clone = copy.deepcopy(drafter)
    clone.config = dataclasses.replace(drafter.config, attention_backend=backend)
    return clone


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_flex_attention_path_matches_the_dense_path(models, documents, layout):
    """Same blocks, same logits: the FlexAttention mask admits exactly what the dense path admits.

    Forward only: FlexAttention has no backward on CPU (the GPU test below compares gradients).
    ``blocks_per_document`` adds padding blocks, whose rows see nothing in both paths.
    """
    target, drafter = models
    tokens, loss_masks = documents
    batch = TokenBatch.from_documents(tokens, layout, loss_masks)
    anchors = packed_anchors(drafter, tokens, loss_masks)
    with torch.no_grad():
        features = target(batch)
        dense = drafter_with_backend(drafter, "dense")(batch, features, anchors=anchors, blocks_per_document=20)
        flex = drafter_with_backend(drafter, "flex")(batch, features, anchors=anchors, blocks_per_document=20)
    assert not bool(flex.layout.keep.all()), "the test needs padding blocks"
    assert max_relative_difference(flex.logits, dense.logits) <= TOLERANCE


def test_flex_block_mask_is_the_visibility_rule(models, documents):
    """Evaluate the mask at every (slot, key) pair and compare with context_visible per document."""
    from harness.models.anchors import build_block_layout, context_visible
    from harness.models.drafter import block_attention_mask

    _, drafter = models
    tokens, loss_masks = documents
    flat = FlatDocuments.from_batch(TokenBatch.from_documents(tokens, "packed", loss_masks))
    anchors = packed_anchors(drafter, tokens, loss_masks)
    block = drafter.block_size
    layout = build_block_layout(flat, anchors, block, blocks_per_document=20)
    mask = block_attention_mask(flat, layout, torch.device("cpu"))
    slots, keys = layout.num_blocks * block, flat.num_tokens + layout.num_blocks * block
    zero = torch.zeros((), dtype=torch.long)
    seen = mask.mask_mod(zero, zero, torch.arange(slots)[:, None], torch.arange(keys)[None, :])

    expected = torch.zeros(slots, keys, dtype=torch.bool)
    starts = flat.doc_starts.tolist()
    for n in range(layout.num_blocks):
        doc, keep = int(layout.doc_index[n]), bool(layout.keep[n])
        length = int(flat.doc_lengths[doc])
        visible = context_visible(layout.anchor[n:n + 1], layout.keep[n:n + 1], length)[0]
        rows = slice(n * block, (n + 1) * block)
        expected[rows, starts[doc]:starts[doc] + length] = visible
        own = flat.num_tokens + n * block
        expected[rows, own:own + block] = keep
    assert torch.equal(seen, expected)


def test_unknown_drafter_attention_backend_is_refused(models, documents):
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        load_drafter_config({"attention_backend": "flash"})
    target, drafter = models
    tokens, loss_masks = documents
    batch = TokenBatch.from_documents(tokens, "packed", loss_masks)
    with pytest.raises(ValueError, match="cannot train on cpu: FlexAttention has no backward"):
        drafter_with_backend(drafter, "flex").compute_loss(batch, target(batch), generator=torch.Generator())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_flex_path_matches_dense_loss_and_gradients(models, documents):
    """On CUDA the drafter defaults to compiled FlexAttention: same loss and gradients as dense (fp32)."""
    target, drafter = models
    tokens, loss_masks = documents
    anchors = [a.cuda() for a in packed_anchors(drafter, tokens, loss_masks)]
    cuda_target = copy.deepcopy(target).cuda()
    batch = TokenBatch.from_documents(tokens, "packed", loss_masks).to("cuda")
    features = cuda_target(batch)
    results = {}
    for backend in ("dense", "flex"):
        config = dataclasses.replace(drafter.config, attention_backend=backend)
        cuda_drafter = DFlashDrafter.from_target(cuda_target, config)
        cuda_drafter.load_state_dict(drafter.state_dict())
        # padding blocks see nothing: their rows must come out as zeros, not NaN, on the fused kernel
        result = cuda_drafter.compute_loss(batch, features, anchors=anchors, blocks_per_document=20)
        grads = torch.autograd.grad(result.weighted_ce_sum, list(cuda_drafter.parameters()),
                                    allow_unused=True, materialize_grads=True)
        results[backend] = (result.weighted_ce_sum.detach(), grads)
    assert max_relative_difference(results["flex"][0], results["dense"][0]) <= 1e-4
    for grad, reference in zip(results["flex"][1], results["dense"][1]):
        assert max_relative_difference(grad, reference) <= 1e-4


def test_a_micro_batch_without_blocks_gives_every_parameter_a_zero_gradient(models):
    """Documents of length 1 hold no anchor: the loss is 0 and every trainable parameter gets a zero
    gradient (not None), as data-parallel reduction needs the same parameters on every rank."""
    target, drafter = models
    batch = TokenBatch.from_documents([torch.tensor([5]), torch.tensor([7])], "packed")
    result = drafter.compute_loss(batch, target(batch), generator=torch.Generator())
    assert result.block_count.item() == 0 and result.weighted_ce_sum.item() == 0.0
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    grads = torch.autograd.grad(result.weighted_ce_sum, trainable, allow_unused=True)
    assert all(g is not None and not bool(g.any()) for g in grads)


@pytest.mark.filterwarnings("ignore")
def test_compiled_flex_paths_trace_with_dynamic_shapes(models, monkeypatch):
    """The CUDA path compiles FlexAttention (dynamic shapes). On CPU, compile it with the aot_eager
    backend, which runs the same dynamo/AOT tracing without CUDA code generation: target and drafter
    stay equal to their uncompiled paths over batches of changing shapes, without recompiling for
    every new shape."""
    import torch._dynamo

    import harness.models.attention as attention_module

    target, drafter = models
    torch._dynamo.reset()
    compiled = attention_module._compiled_flex_attention("aot_eager")  # the CUDA path's settings
    monkeypatch.setattr(attention_module, "flex_attention_kernel", lambda device: compiled)
    flex_target = copy.deepcopy(target)
    flex_target.attention_backend = "flex"
    dense, flex = drafter_with_backend(drafter, "dense"), drafter_with_backend(drafter, "flex")
    generator = torch.Generator().manual_seed(9)
    for draw in range(5):
        lengths = torch.randint(1, 200, (draw + 1,), generator=generator).tolist()
        batch = TokenBatch.from_documents([torch.randint(0, 256, (n,), generator=generator) for n in lengths],
                                          "packed")
        with torch.no_grad():
            reference, features = target(batch), flex_target(batch)
            for a, b in zip(features.hidden_states, reference.hidden_states):
                assert max_relative_difference(a, b) <= TOLERANCE, lengths
            seed = torch.Generator().manual_seed(draw)
            expected = dense(batch, reference, generator=seed, blocks_per_document=20).logits
            got = flex(batch, reference, generator=torch.Generator().manual_seed(draw), blocks_per_document=20).logits
        assert max_relative_difference(got, expected) <= TOLERANCE, lengths
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 0 < graphs <= 6, f"{graphs} graphs for 5 batches: recompiling for every shape"


# ----------------------------------------------------------------------------- fused (sdpa) path
@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("chunk_slots", [None, 24])  # the default; 3 blocks a chunk (many chunks a document)
def test_sdpa_path_matches_the_dense_path_with_gradients(models, documents, layout, chunk_slots, monkeypatch):
    """The fused path gives the dense path's loss and gradients (padding blocks included: their rows
    see only their own slots in the fused call and come out zeroed, as in the dense path)."""
    import harness.models.drafter_attention as attention_module

    if chunk_slots is not None:
        monkeypatch.setattr(attention_module, "SDPA_CHUNK_SLOTS", chunk_slots)
    target, drafter = models
    tokens, loss_masks = documents
    batch = TokenBatch.from_documents(tokens, layout, loss_masks)
    anchors = packed_anchors(drafter, tokens, loss_masks)
    features = target(batch)
    results = {}
    for backend in ("dense", "sdpa"):
        clone = drafter_with_backend(drafter, backend)
        result = clone.compute_loss(batch, features, anchors=anchors, blocks_per_document=20)
        trainable = [p for p in clone.parameters() if p.requires_grad]
        results[backend] = (result, torch.autograd.grad(result.weighted_ce_sum, trainable))
    (dense, dense_grads), (fused, fused_grads) = results["dense"], results["sdpa"]
    with torch.no_grad():
        layout_used = drafter(batch, features, anchors=anchors, blocks_per_document=20).layout
    assert not bool(layout_used.keep.all()), "the test needs padding blocks"
    assert max_relative_difference(fused.weighted_ce_sum, dense.weighted_ce_sum) <= TOLERANCE
    assert torch.equal(fused.correct_sum, dense.correct_sum) and torch.equal(fused.tau_sum, dense.tau_sum)
    for got, reference in zip(fused_grads, dense_grads):
        assert max_relative_difference(got, reference) <= TOLERANCE


def saved_for_backward_bytes(drafter, batch, features, anchors):
    """Bytes of the tensors autograd keeps for the backward of the drafter's loss (storages counted once):
    the activation memory of a training step, measured exactly rather than through the process's RSS."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = drafter.compute_loss(batch, features, anchors=anchors)
    result.weighted_ce_sum.backward()
    return sum(storages.values())


def test_one_8k_document_trains_in_flat_attention_memory(models):
    """One 8,192-token document with 512 blocks (the reference data's longest), the tiny drafter: the
    fused path keeps under 256 MiB for the backward (158 MiB measured: activations linear in the tokens
    and blocks, and one additive mask of slots x keys, shared by the layers and heads), the dense path
    over 1 GiB (2.1 GiB measured: its scores and probabilities, slots x heads x context, per layer)."""
    target, drafter = models
    generator = torch.Generator().manual_seed(0)
    document = torch.randint(0, 256, (8192,), generator=generator)
    batch = TokenBatch.from_documents([document], "packed")
    with torch.no_grad():
        features = target(batch)
    anchors = [torch.arange(0, 8192 - drafter.block_size, 16)[:512]]
    saved = {backend: saved_for_backward_bytes(drafter_with_backend(drafter, backend), batch, features, anchors)
             for backend in ("sdpa", "dense")}
    print({k: f"{v / 2**20:.0f} MiB" for k, v in saved.items()})
    assert saved["sdpa"] < 256 * 2**20, saved
    assert saved["dense"] > 1024 * 2**20, saved  # the bound tells the paths apart
