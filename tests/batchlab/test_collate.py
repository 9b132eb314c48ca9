"""The collators on random Llama and Qwen2 checkpoints: a packed row (and padded rows) give the loss and gradients of
the same documents run one by one, within 1e-5; labels never cross a document's edge; the keys are transformers' own."""

from __future__ import annotations

import pytest
import torch

from batchlab import EMPTY_KEY, PackedCollator, PaddedCollator, empty_loss, use_varlen_attention

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5
DOC_LENGTHS = (7, 1, 23, 12, 40)


def tiny(family: str, attention: str) -> torch.nn.Module:
    torch.manual_seed(0)
    shape = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    if family == "llama":
        config = transformers.LlamaConfig(**shape)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**shape)
        model = transformers.Qwen2ForCausalLM(config)
    if attention == "batchlab_varlen":
        return use_varlen_attention(model).eval()
    model.config._attn_implementation = attention
    return model.eval()


def documents() -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(1, 101, (n,), generator=generator).tolist()} for n in DOC_LENGTHS]


def targets(docs) -> int:
    """Tokens with a next-token label: each document's own, none across an edge."""
    return sum(len(d["input_ids"]) - 1 for d in docs)


def loss_and_grads(model, batches, items):
    model.zero_grad()
    total = sum(model(**batch, num_items_in_batch=items).loss for batch in batches)
    total.backward()
    return total.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def one_by_one(model, docs, items):
    batches = [{"input_ids": torch.tensor([d["input_ids"]]), "labels": torch.tensor([d["input_ids"]])} for d in docs]
    return loss_and_grads(model, batches, items)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager", "batchlab_varlen"])
def test_a_packed_row_gives_the_loss_and_gradients_of_its_documents_run_one_by_one(family, attention):
    model, docs = tiny(family, attention), documents()
    packed = PackedCollator()(docs)
    assert packed["input_ids"].shape == (1, sum(DOC_LENGTHS)) and "attention_mask" not in packed
    items = targets(docs)
    assert int((packed["labels"][:, 1:] != -100).sum()) == items  # what the Trainer counts as num_items_in_batch
    loss, grads = loss_and_grads(model, [packed], items)
    alone_loss, alone_grads = one_by_one(model, docs, items)
    torch.testing.assert_close(loss, alone_loss, atol=TOLERANCE, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, alone_grads[name], atol=TOLERANCE, rtol=0, msg=name)


@pytest.mark.parametrize("leak", ["positions that do not restart", "a cache (the config's use_cache)"])
def test_the_check_can_fail_a_row_whose_documents_see_each_other(leak):
    """transformers finds the documents from the positions only when no cache exists: a Llama config's
    ``use_cache=True`` makes one even in training, so the collator passes ``use_cache=False``."""
    model, docs = tiny("llama", "sdpa"), documents()
    model.train()
    leaky = PackedCollator(use_cache=None)(docs) if "cache" in leak else PackedCollator()(docs)
    if "positions" in leak:
        leaky["position_ids"] = torch.arange(leaky["input_ids"].shape[1])[None]
    loss, _ = loss_and_grads(model, [leaky], targets(docs))
    alone, _ = one_by_one(model, docs, targets(docs))
    assert abs(float(loss - alone)) > 10 * TOLERANCE


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("attention", ["sdpa", "batchlab_varlen"])
def test_padded_rows_give_the_loss_and_gradients_of_their_documents_run_one_by_one(family, side, attention):
    model, docs = tiny(family, attention), documents()
    padded = PaddedCollator(pad_token_id=0, padding_side=side)(docs)
    assert padded["input_ids"].shape == (len(DOC_LENGTHS), max(DOC_LENGTHS))
    if side == "left":  # a left-padded row's positions must count from its first real token
        padded["position_ids"] = (padded["attention_mask"].cumsum(1) - 1).clamp(min=0)
    items = targets(docs)
    loss, grads = loss_and_grads(model, [padded], items)
    alone_loss, alone_grads = one_by_one(model, docs, items)
    torch.testing.assert_close(loss, alone_loss, atol=TOLERANCE, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, alone_grads[name], atol=TOLERANCE, rtol=0, msg=name)


def test_the_packed_keys_are_the_installed_transformers_flattening_collators():
    docs = documents()
    reference = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(docs)
    ours = PackedCollator(flash_attn_kwargs=True, seq_idx=True)(docs)
    assert set(ours) == set(reference) | {"use_cache"} and ours["use_cache"] is False
    for key, value in reference.items():
        assert torch.equal(torch.as_tensor(ours[key]), torch.as_tensor(value)), key
    starts = [0, *torch.tensor(DOC_LENGTHS).cumsum(0)[:-1].tolist()]
    assert ours["labels"][0, starts].eq(-100).all()  # no label across a document's edge
    assert ours["position_ids"][0, starts].eq(0).all()
    assert ours["cu_seq_lens_q"].tolist() == [0, *torch.tensor(DOC_LENGTHS).cumsum(0).tolist()]


def test_samples_over_the_budget_are_cut_to_it_with_their_labels():
    docs = [{"input_ids": list(range(1, 31)), "labels": list(range(101, 131))}, {"input_ids": [5, 6]}]
    packed = PackedCollator(max_tokens=10)([docs[0]])
    assert packed["input_ids"].tolist() == [list(range(1, 11))] and packed["labels"][0, 1:].tolist() == list(range(102, 111))
    padded = PaddedCollator(max_tokens=10)(docs)
    assert padded["input_ids"].shape == (2, 10) and padded["labels"][0].tolist() == [-100, *range(102, 111)]


@pytest.mark.parametrize("collator", [PackedCollator(), PaddedCollator()])
def test_an_empty_micro_batch_joins_the_backward_with_a_zero_loss_and_zero_gradients(collator):
    model = tiny("llama", "sdpa")
    batch = collator([])
    assert batch[EMPTY_KEY]
    model.zero_grad()
    loss = empty_loss(model, batch)
    loss.backward()
    assert loss.item() == 0.0
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and not g.any() for g in grads)  # every parameter took part, with nothing to add


def test_the_varlen_attention_runs_per_document_on_a_packed_row_and_as_sdpa_on_padded_rows(monkeypatch):
    import batchlab.varlen_attention as varlen

    model, docs = tiny("llama", "batchlab_varlen"), documents()
    assert model.config._attn_implementation == varlen.NAME
    documents_seen = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, *args, **kwargs):
        documents_seen.append(query.shape[2])
        return real_sdpa(query, *args, **kwargs)

    monkeypatch.setattr(varlen.F, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        model(**PackedCollator()(docs))
    assert documents_seen == list(DOC_LENGTHS) * model.config.num_hidden_layers  # one call per document and layer
    documents_seen.clear()
    with torch.no_grad():
        model(**PaddedCollator()(docs))
    assert documents_seen == [max(DOC_LENGTHS)] * model.config.num_hidden_layers  # padded: sdpa over the whole rows
