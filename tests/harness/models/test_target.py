"""The hybrid target matches transformers' Qwen3.5 model, loads its checkpoints, and rejects bad input.

Covers ``harness/models/config.py`` (config loading, the DFlash tap rule), ``harness/models/target.py``
(parity with ``Qwen3_5ForCausalLM`` hidden states, checkpoint loading, frozen features, input errors)
and the throughput benchmark's bookkeeping. Packing and padding exactness live in
``tests/harness/models/test_target_packing.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3_5ForCausalLM

from harness.models.compare import max_relative_difference
from harness.models.config import build_target_layer_ids, load_target_config
from harness.models.layout import TokenBatch
from harness.models.target import HybridTarget, TargetFeatures

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "conf" / "target" / "tiny.yaml"
TINY_DEEP = REPO / "conf" / "target" / "tiny-deep.yaml"
TOLERANCE = 1e-5



def reference_model(config_path: Path = TINY, seed: int = 0, **overrides) -> Qwen3_5ForCausalLM:
    """transformers' model with random weights, including non-trivial norm weights (zero at init)."""
    config = load_target_config(config_path)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.2)
    return model


def reference_hidden_states(model: Qwen3_5ForCausalLM, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return model(input_ids=input_ids, output_hidden_states=True).hidden_states


def assert_matches_reference(features: TargetFeatures, reference: tuple[torch.Tensor, ...],
                             final_norm: torch.nn.Module, num_layers: int) -> None:
    """Entry i equals transformers' hidden_states[layer + 1] (the last one is after the final norm there)."""
    for layer, hidden in zip(features.layer_ids, features.hidden_states):
        ours = final_norm(hidden) if layer == num_layers - 1 else hidden
        error = max_relative_difference(ours, reference[layer + 1])
        assert error <= TOLERANCE, f"layer {layer}: relative error {error:.2e} > {TOLERANCE}"


# ----------------------------------------------------------------------------- config


def test_tiny_config_has_the_design_shape() -> None:
    config = load_target_config(TINY)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (256, 64, 128)
    assert config.layer_types == ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (2, 4)
    assert (config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim) == (16, 16, 4)
    assert config.use_cache is False


def test_27b_config_has_qwen36_27b_shape() -> None:
    config = load_target_config(REPO / "conf" / "target" / "qwen3.6-27b.yaml")
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (5120, 64, 17408)
    assert config.layer_types.count("full_attention") == 16
    assert all(kind == "full_attention" for kind in config.layer_types[3::4])
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (16, 48)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (24, 4, 256)
    assert int(config.head_dim * config.rope_parameters["partial_rotary_factor"]) == 64
    with torch.device("meta"):  # shapes only, no memory: the text model is the 27B's size
        parameters = sum(p.numel() for p in HybridTarget(config).parameters())
    assert 26.0e9 <= parameters <= 27.5e9, f"{parameters / 1e9:.2f}B parameters"


def test_unknown_yaml_key_is_named() -> None:
    with pytest.raises(ValueError, match="hiden_size"):
        load_target_config({"hiden_size": 64})


def test_unsupported_layer_type_is_named() -> None:
    with pytest.raises(ValueError, match=r"layer_types\[1\]='sliding_attention'"):
        load_target_config({"num_hidden_layers": 2, "layer_types": ["linear_attention", "sliding_attention"]})


def test_multimodal_checkpoint_config_uses_text_config(tmp_path: Path) -> None:
    text = load_target_config(TINY).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5", "text_config": text, "vision_config": {"depth": 2}, "image_token_id": 5,
         "tie_word_embeddings": False}
    ))
    config = load_target_config(tmp_path)
    assert config.hidden_size == 64 and config.layer_types == text["layer_types"]


@pytest.mark.parametrize(
    ("num_target", "num_draft", "expected"),
    [(64, 5, [1, 16, 31, 46, 61]), (36, 5, [1, 9, 17, 25, 33]), (8, 2, [1, 5]), (8, 3, [1, 3, 5]),
     (4, 1, [2]), (64, 1, [32]), (4, 2, [1, 1])],
)
def test_dflash_tap_rule(num_target: int, num_draft: int, expected: list[int]) -> None:
    assert build_target_layer_ids(num_target, num_draft) == expected


def test_tap_rule_rejects_shallow_targets() -> None:
    with pytest.raises(ValueError, match="num_target_layers=3"):
        build_target_layer_ids(3, 2)


# ----------------------------------------------------------------------------- parity with transformers


def test_every_layer_matches_transformers_hidden_states() -> None:
    reference = reference_model()
    target = HybridTarget(reference.config, tap_layer_ids=range(4))
    target.load_state_dict(reference.state_dict())
    input_ids = torch.randint(0, 256, (2, 150), generator=torch.Generator().manual_seed(1))
    features = target(TokenBatch.from_documents(list(input_ids), "padded"))
    assert features.layer_ids == [0, 1, 2, 3]
    assert features.hidden_states[0].shape == (2, 150, 64)
    assert_matches_reference(features, reference_hidden_states(reference, input_ids), target.model.norm, 4)


def test_dflash_taps_match_transformers_and_stop_at_the_deepest_tap() -> None:
    reference = reference_model(TINY_DEEP, seed=3)
    target = HybridTarget(TINY_DEEP, num_draft_layers=2)
    target.load_state_dict(reference.state_dict())
    assert target.tap_layer_ids == [1, 5]
    ran = []
    for index, layer in enumerate(target.model.layers):
        layer.register_forward_hook(lambda *_, index=index: ran.append(index))
    input_ids = torch.randint(0, 256, (1, 97), generator=torch.Generator().manual_seed(2))
    features = target(TokenBatch.from_documents(list(input_ids), "packed"))
    assert ran == [0, 1, 2, 3, 4, 5]
    assert features.layer_ids == [1, 5]
    assert features.concatenated().shape == (1, 97, 128)
    assert_matches_reference(features, reference_hidden_states(reference, input_ids), target.model.norm, 8)


def test_frozen_outputs_feed_a_trainable_head() -> None:
    target = HybridTarget(TINY, tap_layer_ids=[0, 2])
    assert not any(p.requires_grad for p in target.parameters())
    target.train()
    assert not target.training
    batch = TokenBatch.from_documents([torch.arange(10), torch.arange(5)], "packed")
    features = target(batch)
    assert not features.hidden_states[0].requires_grad
    head = torch.nn.Linear(2 * 64, 64, bias=False)
    head(features.concatenated()).square().mean().backward()
    assert head.weight.grad is not None and float(head.weight.grad.abs().sum()) > 0


def test_bf16_forward_stays_close_to_fp32() -> None:
    target = HybridTarget(TINY, tap_layer_ids=[3])
    low = HybridTarget(TINY, tap_layer_ids=[3], dtype=torch.bfloat16)
    low.load_state_dict(target.state_dict())
    batch = TokenBatch.from_documents([torch.arange(40) % 256, torch.arange(70) % 256], "packed")
    out32, out16 = target(batch).hidden_states[0], low(batch).hidden_states[0]
    assert out16.dtype == torch.bfloat16
    assert max_relative_difference(out16.float(), out32) < 5e-2


def test_bf16_target_keeps_rope_frequencies_in_fp32() -> None:
    """Regression: casting to bf16 rounded inv_freq (0.01 -> 0.01001), off by 0.04 rad at position 4000."""
    exact = HybridTarget(TINY).model.rotary_emb
    hidden, positions = torch.zeros(1, 1, 64), torch.tensor([[[4000]]]).expand(3, -1, -1)  # [3, B, L] mRoPE ids
    exact_cos, exact_sin = exact(hidden, positions)
    for target in (HybridTarget(TINY, dtype=torch.bfloat16), HybridTarget(TINY).to(torch.bfloat16)):
        rotary = target.model.rotary_emb
        assert target.dtype == torch.bfloat16
        assert rotary.inv_freq.dtype == torch.float32 and torch.equal(rotary.inv_freq, exact.inv_freq)
        assert torch.equal(rotary.original_inv_freq, exact.original_inv_freq)
        cos, sin = rotary(hidden.bfloat16(), positions)
        assert cos.dtype == torch.bfloat16
        # only the final bf16 rounding of values in [-1, 1] (<= 2**-9) remains
        assert float((cos.float() - exact_cos).abs().max()) <= 2**-8
        assert float((sin.float() - exact_sin).abs().max()) <= 2**-8


# ----------------------------------------------------------------------------- checkpoints


def _features_of(model: HybridTarget, input_ids: torch.Tensor) -> TargetFeatures:
    return model(TokenBatch.from_documents(list(input_ids), "padded"), tap_layer_ids=[0, 1, 2, 3])


@pytest.mark.parametrize("shard", [False, True])
def test_from_pretrained_loads_a_transformers_checkpoint(tmp_path: Path, shard: bool) -> None:
    reference = reference_model(seed=4)
    reference.save_pretrained(tmp_path, **({"max_shard_size": "40KB"} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    target = HybridTarget.from_pretrained(tmp_path)
    assert target.device.type == "cpu" and target.dtype == torch.float32
    assert not any(p.requires_grad for p in target.parameters())
    assert torch.equal(target.lm_head.weight, reference.lm_head.weight)
    input_ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(5))
    assert_matches_reference(_features_of(target, input_ids), reference_hidden_states(reference, input_ids),
                             target.model.norm, 4)


def test_from_pretrained_ties_lm_head_when_the_config_says_so(tmp_path: Path) -> None:
    reference = reference_model(seed=6, tie_word_embeddings=True)
    reference.tie_weights()
    reference.save_pretrained(tmp_path)
    target = HybridTarget.from_pretrained(tmp_path)
    assert target.lm_head.weight is target.embed_tokens.weight
    assert torch.equal(target.lm_head.weight, reference.model.embed_tokens.weight)


def test_from_pretrained_reads_a_multimodal_checkpoint(tmp_path: Path) -> None:
    reference = reference_model(seed=7)
    state = {}
    for name, tensor in reference.state_dict().items():
        state[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = tensor
    state["model.visual.patch_embed.proj.weight"] = torch.zeros(3, 3)
    state["mtp.fc.weight"] = torch.zeros(2, 2)
    half = sorted(state)[: len(state) // 2]
    save_file({k: state[k].contiguous() for k in half}, str(tmp_path / "part-1.safetensors"))
    save_file({k: state[k].contiguous() for k in state if k not in half}, str(tmp_path / "part-2.safetensors"))
    weight_map = {k: "part-1.safetensors" if k in half else "part-2.safetensors" for k in state}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5", "text_config": reference.config.to_dict(), "vision_config": {"depth": 1}}
    ))
    target = HybridTarget.from_pretrained(tmp_path)
    input_ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(8))
    assert_matches_reference(_features_of(target, input_ids), reference_hidden_states(reference, input_ids),
                             target.model.norm, 4)


def test_from_pretrained_names_missing_tensors(tmp_path: Path) -> None:
    reference = reference_model(seed=9)
    state = {k: v for k, v in reference.state_dict().items() if k != "model.layers.2.self_attn.k_proj.weight"}
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    reference.config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"missing \['model.layers.2.self_attn.k_proj.weight'\]"):
        HybridTarget.from_pretrained(tmp_path)


# ----------------------------------------------------------------------------- bad input


def test_token_id_at_or_above_vocab_is_named() -> None:
    target = HybridTarget(TINY)
    docs = [torch.tensor([1, 2, 3]), torch.tensor([4, 256, 6])]
    with pytest.raises(ValueError, match=r"input_ids\[0, 4\]=256 .*vocab_size=256"):
        target(TokenBatch.from_documents(docs, "packed"))
    with pytest.raises(ValueError, match=r"input_ids\[1, 1\]=256"):
        target(TokenBatch.from_documents(docs, "padded"))


def test_negative_token_id_is_named_but_pad_ids_are_ignored() -> None:
    target = HybridTarget(TINY, tap_layer_ids=[0])
    with pytest.raises(ValueError, match=r"input_ids\[0, 1\]=-3"):
        target(TokenBatch.from_documents([torch.tensor([5, -3])], "packed"))
    documents = [torch.tensor([5, 6, 7]), torch.tensor([8])]
    padded = TokenBatch.from_documents(documents, "padded", pad_token_id=-100)
    unchecked = TokenBatch.from_documents(documents, "padded", pad_token_id=-100)
    unchecked.token_id_range = None  # a batch built elsewhere: the target checks (and zeroes) the pads itself
    for batch in (padded, unchecked):
        features = target(batch).hidden_states[0]
        assert features.shape == (2, 3, 64)
        # the -100 pads change nothing at the real positions: each row equals its document run alone
        for row, document in enumerate(documents):
            alone = target(TokenBatch.from_documents([document], "packed")).hidden_states[0]
            torch.testing.assert_close(features[row, : len(document)], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("bounds", "message"), [([1, 4, 9], "start at 0"), ([0, 4, 8], "end at the packed length")])
def test_bad_cu_seqlens_are_rejected(bounds: list[int], message: str) -> None:
    target = HybridTarget(TINY)
    batch = TokenBatch.from_documents([torch.arange(4), torch.arange(5)], "packed")
    batch.cu_seqlens = torch.tensor(bounds, dtype=torch.int32)  # corrupted after construction
    with pytest.raises(ValueError, match=message):
        target(batch)


def test_tap_layer_out_of_range_is_named() -> None:
    target = HybridTarget(TINY)
    with pytest.raises(ValueError, match="tap layer id 4 is out of range"):
        target(TokenBatch.from_documents([torch.arange(4)], "packed"), tap_layer_ids=[1, 4])


# ----------------------------------------------------------------------------- benchmark bookkeeping


def test_benchmark_reports_every_layout_and_rewrites_its_section(tmp_path: Path, monkeypatch) -> None:
    import importlib.util

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # as when run as a script
    spec = importlib.util.spec_from_file_location("target_throughput", REPO / "benchmarks" / "target_throughput.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    lengths = bench.chat_like_lengths(600, scale=16.0, seed=0)
    assert sum(lengths) >= 600 and max(lengths) <= 512
    equal = bench.near_equal_lengths(lengths, seed=0)
    assert sum(equal) == sum(lengths) and max(equal) <= 1.2 * min(equal)
    result = bench.run(str(TINY), tokens=300, scale=16.0, repeats=1, seed=0, gdn_backend="auto",
                       thread_counts=[1], max_tokens=256)
    stats = result["by_threads"][1]["stats"]
    assert set(stats) == set(bench.LAYOUTS)
    assert all(s["slots"] >= result["real_tokens"] and s["seconds"] > 0 for s in stats.values())
    assert stats["packed plan"]["padding_efficiency"] == 1.0 and stats["packed, one row"]["micro_batches"] == 1
    assert stats["shuffle plan"]["padding_efficiency"] < 1.0
    assert stats["packed plan"]["micro_batches"] >= result["real_tokens"] / 256
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\n## Planning\n\nkeep me\n")
    bench.write_section(bench.SECTION + "\n\nfirst\n", bench.SECTION, results)
    bench.write_section(bench.SECTION + "\n\nsecond\n", bench.SECTION, results)
    text = results.read_text()
    assert "keep me" in text and "second" in text and "first" not in text
    assert text.count(bench.SECTION) == 1
