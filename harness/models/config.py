"""Target model configuration: build a ``Qwen3_5TextConfig`` and choose which target layers to tap.

The config object is transformers' own ``Qwen3_5TextConfig`` so that a Hugging Face checkpoint's
``config.json`` and this project's YAML files (``conf/target/*.yaml``, keys = config keyword
arguments) describe the target in the same terms. ``build_target_layer_ids`` is DFlash's rule for
which target layers feed the drafter (docs/design/target-and-drafter.md).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from transformers import Qwen3_5TextConfig

SUPPORTED_LAYER_TYPES = ("linear_attention", "full_attention")

# Keyword arguments Qwen3_5TextConfig accepts besides its dataclass fields (consumed in __post_init__).
EXTRA_CONFIG_KWARGS = frozenset({"full_attention_interval", "partial_rotary_factor", "model_type"})


def _config_field_names() -> frozenset[str]:
    return frozenset(field.name for field in dataclasses.fields(Qwen3_5TextConfig)) | EXTRA_CONFIG_KWARGS


def _text_part(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The text-model part of a config dict: ``text_config`` of a multimodal ``Qwen3_5Config``, else itself."""
    if "text_config" not in raw:
        return dict(raw)
    text = raw["text_config"]
    if not isinstance(text, Mapping):
        raise ValueError(f"text_config must be a mapping, got {type(text).__name__}")
    text = dict(text)
    # A multimodal config may keep tie_word_embeddings at the top level only.
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return text


def _read_mapping(path: Path) -> tuple[dict[str, Any], bool]:
    """Read a YAML file, a JSON file or a checkpoint directory; return (mapping, is_hf_checkpoint_config)."""
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(
                f"checkpoint directory {path} has no config.json; point at a Hugging Face checkpoint directory "
                "or at a YAML file from conf/target/"
            )
        return json.loads(config_file.read_text()), True
    if not path.is_file():
        raise FileNotFoundError(f"target config {path} does not exist")
    if path.suffix == ".json":
        return json.loads(path.read_text()), True
    if path.suffix in (".yaml", ".yml"):
        loaded = yaml.safe_load(path.read_text())
        if not isinstance(loaded, Mapping):
            raise ValueError(f"target config {path} must hold a mapping of config keys, got {type(loaded).__name__}")
        return dict(loaded), False
    if path.suffix.lower() == ".gguf":
        raise ValueError(f"target {path} is a GGUF file (llama.cpp's format), not a target batchlab can build; give "
                         "a Hugging Face checkpoint directory of model_type 'qwen3_5' or 'qwen3_5_text', or a YAML file "
                         "from conf/target/ (a GGUF file can be data.tokenizer)")
    raise ValueError(f"target config {path} must be a .yaml/.yml/.json file or a checkpoint directory")


def load_target_config(source: str | Path | Mapping[str, Any] | Qwen3_5TextConfig) -> Qwen3_5TextConfig:
    """Build the target's ``Qwen3_5TextConfig`` from a YAML file, a dict, a config.json or a checkpoint dir.

    YAML files and dicts use the config's keyword arguments as keys; unknown keys are rejected (a typo
    would otherwise silently fall back to a 9B-size default). A Hugging Face ``config.json`` (or the
    directory holding it) may carry extra keys, and may be a multimodal ``Qwen3_5Config`` whose
    ``text_config`` holds the text model. Only ``linear_attention`` and ``full_attention`` layers are
    supported.
    """
    if isinstance(source, Qwen3_5TextConfig):
        config = source
    else:
        if isinstance(source, Mapping):
            raw, from_checkpoint = dict(source), False
        else:
            raw, from_checkpoint = _read_mapping(Path(source))
        if from_checkpoint:
            _check_model_type(raw, source)
        kwargs = _text_part(raw)
        if not from_checkpoint:
            unknown = sorted(set(kwargs) - _config_field_names())
            if unknown:
                raise ValueError(
                    f"unknown target config key(s) {unknown}; use Qwen3_5TextConfig keyword arguments "
                    f"(e.g. hidden_size, layer_types, linear_num_value_heads)"
                )
        kwargs.pop("model_type", None)
        config = Qwen3_5TextConfig(**kwargs)
    _check_supported(config)
    return config


#: the ``model_type`` of the checkpoints the target is (a Qwen3.5 hybrid, multimodal or its text model)
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


def _check_model_type(raw: Mapping[str, Any], source: Any) -> None:
    """A checkpoint of another architecture (a Llama, an encoder) is refused naming what it is, before its keys are
    read as a Qwen3.5 config (which made a Llama look like a broken Qwen3.5 target)."""
    found = [raw.get("model_type"), (raw.get("text_config") or {}).get("model_type")]
    declared = [kind for kind in found if kind is not None]
    unsupported = [kind for kind in declared if kind not in SUPPORTED_MODEL_TYPES]
    if unsupported:
        architectures = raw.get("architectures") or []
        raise ValueError(
            f"{source} is a {unsupported[0]!r} checkpoint{f' ({architectures[0]})' if architectures else ''}; the "
            f"target is a Qwen3.5-style hybrid (Gated DeltaNet + full attention): give a checkpoint of model_type "
            f"{' or '.join(map(repr, SUPPORTED_MODEL_TYPES))}, or a YAML file from conf/target/")


def _check_supported(config: Qwen3_5TextConfig) -> None:
    bad = [(i, kind) for i, kind in enumerate(config.layer_types) if kind not in SUPPORTED_LAYER_TYPES]
    if bad:
        index, kind = bad[0]
        raise ValueError(
            f"layer_types[{index}]={kind!r} is not supported; every layer must be one of {SUPPORTED_LAYER_TYPES}"
        )
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ValueError(
            f"linear_num_value_heads={config.linear_num_value_heads} must be a multiple of "
            f"linear_num_key_heads={config.linear_num_key_heads}"
        )
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={config.num_attention_heads} must be a multiple of "
            f"num_key_value_heads={config.num_key_value_heads}"
        )


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's choice of target layers to tap: one per drafter layer.

    One draft layer taps ``[num_target_layers // 2]``; otherwise the taps are evenly spaced from layer 1
    to layer ``num_target_layers - 3`` and rounded (Python ``round``, as in DFlash). Taps may repeat on
    very shallow targets (4 layers, 2 draft layers gives ``[1, 1]``).
    """
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
    if num_target_layers < 1:
        raise ValueError(f"num_target_layers must be >= 1, got {num_target_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(
            f"num_target_layers={num_target_layers} is too shallow for {num_draft_layers} draft layers: the DFlash "
            "rule spaces taps from layer 1 to num_target_layers - 3; use >= 4 target layers or 1 draft layer"
        )
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def check_tap_layer_ids(layer_ids: Sequence[int], num_target_layers: int) -> list[int]:
    """Return ``layer_ids`` as a list of ints after checking each names a decoder layer of the target."""
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise ValueError("tap_layer_ids is empty; give at least one target layer index")
    for i in ids:
        if not 0 <= i < num_target_layers:
            raise ValueError(
                f"tap layer id {i} is out of range: the target has layers 0..{num_target_layers - 1}"
            )
    return ids
