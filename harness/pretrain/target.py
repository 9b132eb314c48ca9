"""Pretrain the tiny hybrid target on the embedded corpus, and cache it as a local HF checkpoint.

``ensure_pretrained_target(data, target_kwargs, settings)`` returns the directory of a Hugging Face
checkpoint (``config.json``, ``model.safetensors``, ``tokenizer.json``, ``meta.json``) of a
``Qwen3_5ForCausalLM`` trained as a next-token language model on the training split of ``data``
(never on its held-out rows: :func:`~harness.data.samples.heldout_split`, the split every drafter
run evaluates on). It loads with :meth:`HybridTarget.from_pretrained
<harness.models.target.HybridTarget.from_pretrained>` and with transformers'
``Qwen3_5ForCausalLM.from_pretrained``.

The entry lives under the batchlab cache directory (``data.resolved_cache_dir()``) as
``target-<hash>/``; the hash covers the data's fingerprint, the tokenizer file, the target config,
the held-out split, every :class:`PretrainConfig` field and :data:`FORMAT_VERSION`. It is built once,
atomically (:func:`harness.data.cache.ensure_entry`: a crash leaves no half entry; concurrent ranks
wait for the first), and reused while none of those change.

What is trained (see :mod:`harness.pretrain.lm`): samples cut into windows of at most
``max_tokens`` tokens, every real token but a window's first a label (prompt and completion: the
target reads both as context when it verifies drafts), a token-weighted mean loss per batch, AdamW
with linear warm-up and cosine decay, gradient clipping. ``meta.json`` records the held-out loss and
perplexity of the untrained and the trained model (the latter measured on the saved checkpoint, read
back through ``HybridTarget.from_pretrained``), the completion-only loss, and the held-out loss of
the training tokens' unigram distribution, the level a model that ignores context reaches.

Implementations (``PretrainConfig.implementation``, measured side by side by
``benchmarks/pretrain_speed.py``, results in ``benchmarks/RESULTS.md``): ``batchlab`` (default;
:class:`~harness.models.target.HybridTarget` with gradients on packed rows, documents exactly
isolated) or ``transformers`` (``Qwen3_5ForCausalLM``'s torch fallback on length-sorted padded
batches).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.data import cache
from harness.data.config import DataConfig
from harness.pretrain import lm

__all__ = [
    "FORMAT_VERSION",
    "PREFIX",
    "PretrainConfig",
    "PretrainedTarget",
    "copy_checkpoint",
    "ensure_pretrained_target",
    "pretrained_target",
    "read_pretrain_meta",
    "read_target_kwargs",
]

# Bump when the training recipe, the checkpoint layout or meta.json change meaning.
FORMAT_VERSION = 1
PREFIX = "target"
TOKENIZER_FILE = "tokenizer.json"
IMPLEMENTATIONS = ("batchlab", "transformers")
# Config keys that say nothing about the model (they change with the transformers release).
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype",
                         "id2label", "label2id")


@dataclass(frozen=True)
class PretrainConfig:
    """How the target is pretrained. Every field is part of the cache key.

    Attributes:
        tokens: real tokens to train on (epochs over the training split until reached); ignored
            when ``steps`` is set.
        steps: optimizer steps (overrides ``tokens``).
        max_tokens: tokens per batch (a packed row's capacity, or rows x longest row padded); also
            the window a longer sample is cut into.
        lr: peak learning rate (AdamW).
        min_lr_ratio: the cosine decay ends at ``lr * min_lr_ratio``.
        warmup_steps: linear warm-up steps (capped at a tenth of the run).
        weight_decay: AdamW weight decay of matrices (not of norms, biases, A_log, dt_bias).
        beta1, beta2: AdamW betas.
        grad_clip: global gradient-norm clip (0: none).
        seed: initialisation (transformers' ``Qwen3_5ForCausalLM`` init) and batch order.
        implementation: ``batchlab`` (packed rows, the faster on CPU) or ``transformers`` (padded).
    """

    tokens: int = 1_500_000
    steps: int | None = None
    max_tokens: int = 2048
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    implementation: str = "batchlab"

    def __post_init__(self) -> None:
        for name in ("tokens", "max_tokens", "warmup_steps", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"pretrain.{name}={value!r}: give a non-negative integer")
        if self.steps is not None and (isinstance(self.steps, bool) or not isinstance(self.steps, int)
                                       or self.steps < 1):
            raise ValueError(f"pretrain.steps={self.steps!r}: give a positive integer, or None to use tokens")
        if self.steps is None and self.tokens < 1:
            raise ValueError("pretrain.tokens must be >= 1 when pretrain.steps is None")
        if self.max_tokens < 2:
            raise ValueError(f"pretrain.max_tokens={self.max_tokens}: give at least 2 tokens per batch")
        if not self.lr > 0:
            raise ValueError(f"pretrain.lr={self.lr!r}: give a positive learning rate")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"pretrain.min_lr_ratio={self.min_lr_ratio!r}: give a number in [0, 1]")
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"pretrain.implementation={self.implementation!r}: choose one of {IMPLEMENTATIONS}")


@dataclass(frozen=True)
class PretrainedTarget:
    """A pretrained-target cache entry: its checkpoint directory, ``meta.json``, and whether this call built it."""

    path: Path
    meta: dict
    built: bool


def ensure_pretrained_target(
    data: DataConfig,
    target_kwargs: dict,
    settings: PretrainConfig = PretrainConfig(),
    progress: bool = True,
) -> Path:
    """The checkpoint directory of the target pretrained on ``data``'s training split (built once).

    Args:
        data: the run's data config (the embedded corpus by default); its held-out rows are never
            trained on.
        target_kwargs: ``Qwen3_5TextConfig`` keyword arguments (e.g. ``conf/target/tiny.yaml``'s keys);
            ``vocab_size`` defaults to the data's vocabulary and may not be smaller than it. A
            ``pretrained`` key is ignored.
        settings: the pretraining recipe.
        progress: a tqdm progress bar on stderr while training.
    """
    return pretrained_target(data, target_kwargs, settings, progress).path


def pretrained_target(
    data: DataConfig,
    target_kwargs: dict,
    settings: PretrainConfig = PretrainConfig(),
    progress: bool = True,
) -> PretrainedTarget:
    """:func:`ensure_pretrained_target`, also returning ``meta.json`` and whether this call trained."""
    from harness.data.samples import heldout_split, load_samples, validation_split

    samples = load_samples(data, progress=progress)
    config = _target_config(target_kwargs, samples.vocab_size)
    train_rows, heldout_rows = heldout_split(len(samples), data)
    train_rows, _ = validation_split(train_rows, data)  # the drafter's validation rows are the target's unseen too
    tokenizer = Path(samples.tokenizer_path) if samples.tokenizer_path else None
    payload = {
        "format": FORMAT_VERSION,
        "data": samples.fingerprint,
        "heldout": {"fraction": data.heldout_fraction, "max": data.max_heldout, "seed": data.heldout_seed,
                    "rows": len(samples)},
        # only with a validation split (a target built before the setting existed keeps its key)
        **({"validation": {"fraction": data.validation_fraction, "max": data.max_validation}}
           if data.validation_fraction > 0 else {}),
        "tokenizer": (None if tokenizer is None else _file_sha256(tokenizer) if tokenizer.is_file()
                      else cache.digest(cache.tree_signature(tokenizer))),  # a chat tokenizer's directory
        "target": _config_identity(config),
        "settings": dataclasses.asdict(settings),
    }
    key = cache.digest(payload)

    def build(tmp: Path) -> dict:
        return _build(tmp, samples, train_rows, heldout_rows, config, tokenizer, settings, progress)

    path, meta, built = cache.ensure_entry(data.resolved_cache_dir(), PREFIX, key, build)
    return PretrainedTarget(path=path, meta=meta, built=built)


def read_pretrain_meta(path: str | Path) -> dict:
    """``meta.json`` of a pretrained-target checkpoint directory."""
    meta = cache.read_meta(Path(path))
    if meta is None:
        raise FileNotFoundError(f"{path} has no readable meta.json: not a pretrained-target cache entry")
    return meta


def read_target_kwargs(path: str | Path, example: str | Path) -> dict:
    """The target config keys in the YAML at ``path``, less ``vocab_size`` (the data's vocabulary); a missing file or
    one that is not a mapping raises naming ``example``, a target config to copy."""
    import yaml

    if not Path(path).is_file():
        raise FileNotFoundError(f"--target {path}: no such target config; give a YAML of target keys such "
                                f"as {example}")
    target_kwargs = yaml.safe_load(Path(path).read_text())
    if not isinstance(target_kwargs, dict):
        raise ValueError(f"--target {path}: not a mapping of target config keys; see {example}")
    target_kwargs.pop("vocab_size", None)  # the data's vocabulary
    return target_kwargs


def copy_checkpoint(path: Path, out: str | Path) -> Path:
    """A copy of the checkpoint directory ``path`` at ``out`` (replacing what is there); ``out``."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(path, out)
    return out


# ----------------------------------------------------------------------------- internals
def _target_config(target_kwargs: dict, data_vocab: int | None):
    from harness.models.config import load_target_config

    kwargs = {k: _plain(v) for k, v in dict(target_kwargs).items() if k != "pretrained"}
    if data_vocab is not None:
        given = kwargs.get("vocab_size")
        if given is None:
            kwargs["vocab_size"] = int(data_vocab)
        elif int(given) < data_vocab:
            raise ValueError(
                f"target vocab_size={given} is smaller than the data's vocabulary ({data_vocab} tokens); "
                f"set target.vocab_size={data_vocab} (conf/train.yaml uses ${{data.vocab_size}})"
            )
    elif kwargs.get("vocab_size") is None:
        raise ValueError("the data source has no tokenizer vocabulary: give target_kwargs['vocab_size']")
    return load_target_config(kwargs)


def _plain(value):
    """Plain dicts and lists (e.g. from Hydra's DictConfig / ListConfig): JSON-able, equal keys for equal values."""
    from collections.abc import Mapping, Sequence

    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    return value


def _config_identity(config) -> dict:
    values = config.to_dict()
    for name in _VOLATILE_CONFIG_KEYS:
        values.pop(name, None)
    return values


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def initial_model(config, seed: int):
    """transformers' ``Qwen3_5ForCausalLM`` with its own initialisation under ``seed`` (fp32)."""
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(config).float()


def trainable_model(reference, implementation: str) -> torch.nn.Module:
    """The model that trains: ``reference`` itself (transformers) or a HybridTarget holding its weights."""
    if implementation == "transformers":
        return reference.train()
    from harness.models.target import HybridTarget

    model = HybridTarget(reference.config)
    model.load_state_dict(reference.state_dict())
    return model.requires_grad_(True)


def make_optimizer(model: torch.nn.Module, settings: PretrainConfig) -> torch.optim.Optimizer:
    """AdamW: weight decay on matrices only (norm weights, biases, A_log and dt_bias are vectors)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    keep = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": keep, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(settings.beta1, settings.beta2))


def learning_rate(step: int, total: int, settings: PretrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    warmup = min(settings.warmup_steps, max(1, total // 10))
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup - 1)
    floor = settings.lr * settings.min_lr_ratio
    return floor + (settings.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _planned_steps(windows: lm.Windows, settings: PretrainConfig) -> int:
    if settings.steps is not None:
        return settings.steps
    layout = lm.LAYOUT_OF[settings.implementation]
    first_epoch = lm.epoch_batches(windows, layout, settings.max_tokens, settings.seed, 0)
    per_epoch_tokens = windows.num_tokens
    return max(1, math.ceil(settings.tokens / per_epoch_tokens * len(first_epoch)))


def _train(model: torch.nn.Module, train: lm.Windows, settings: PretrainConfig, progress: bool) -> dict:
    """Run the optimizer; returns the training summary for ``meta.json``."""
    from tqdm.auto import tqdm

    layout = lm.LAYOUT_OF[settings.implementation]
    total = _planned_steps(train, settings)
    optimizer = make_optimizer(model, settings)
    params = [p for p in model.parameters() if p.requires_grad]
    tokens = labels_seen = 0
    smoothed = None
    epochs = 0
    started = time.perf_counter()
    bar = tqdm(total=total, desc="pretraining target", unit="step", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    try:
        for step, (epoch, indices) in enumerate(lm.iterate_steps(train, layout, settings.max_tokens,
                                                                  settings.seed, total)):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, total, settings)
            batch = _training_batch(train, indices, layout)
            loss, count = lm.mean_loss(model, batch, settings.implementation)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if settings.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
            optimizer.step()
            value = float(loss.detach())
            if not math.isfinite(value):
                raise FloatingPointError(f"pretraining loss is {value} at step {step}; lower pretrain.lr")
            smoothed = value if smoothed is None else 0.95 * smoothed + 0.05 * value
            tokens += int(sum(train.ids[i].size for i in indices))
            labels_seen += count
            epochs = epoch + 1
            elapsed = time.perf_counter() - started
            bar.set_postfix(loss=f"{smoothed:.3f}", epoch=epoch, tok_s=f"{tokens / max(elapsed, 1e-9):,.0f}",
                            refresh=False)
            bar.update(1)
    finally:
        bar.close()
    seconds = time.perf_counter() - started
    return {
        "steps": total,
        "epochs": round(tokens / max(train.num_tokens, 1), 3),  # passes over the training windows
        "epochs_started": epochs,
        "tokens": tokens,
        "labels": labels_seen,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens / max(seconds, 1e-9), 1),
        "final_loss_smoothed": smoothed,
        "threads": torch.get_num_threads(),
    }


def _training_batch(train: lm.Windows, indices: np.ndarray, layout: str):
    """The batch of one optimizer step: windows of the training split only."""
    return lm.batch_of(train, indices, layout)


def _build(tmp: Path, samples, train_rows: np.ndarray, heldout_rows: np.ndarray, config, tokenizer: Path | None,
           settings: PretrainConfig, progress: bool) -> dict[str, Any]:
    import transformers

    from harness.models.target import HybridTarget

    train = lm.windows_of(samples, train_rows, settings.max_tokens)
    heldout = lm.windows_of(samples, heldout_rows, settings.max_tokens)
    if set(train.rows.tolist()) & set(heldout_rows.tolist()):  # pragma: no cover - heldout_split is disjoint
        raise AssertionError("a held-out row reached the training windows")
    for name, windows in (("training", train), ("held-out", heldout)):
        top = max((int(w.max()) for w in windows.ids), default=-1)
        if top >= config.vocab_size:
            raise ValueError(f"a {name} token id {top} is outside the target's vocabulary ({config.vocab_size})")

    reference = initial_model(config, settings.seed)
    model = trainable_model(reference, settings.implementation)
    # the untrained model, evaluated on the packed eval path
    untrained_eval = HybridTarget(config)
    untrained_eval.load_state_dict(reference.state_dict())
    untrained = lm.evaluate(untrained_eval.logits, heldout, settings.max_tokens)
    del untrained_eval

    training = _train(model, train, settings, progress)

    # a real transformers checkpoint: save_pretrained of a Qwen3_5ForCausalLM holding the weights
    if settings.implementation != "transformers":
        reference.load_state_dict(model.state_dict())
    reference.eval()
    reference.config.use_cache = False
    reference.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        shutil.copyfile(tokenizer, tmp / TOKENIZER_FILE)
        _write_tokenizer_config(tmp)

    # held-out numbers of what was saved, read back as the trainer will read it
    saved = HybridTarget.from_pretrained(tmp)
    trained = lm.evaluate(saved.logits, heldout, settings.max_tokens)
    return {
        "format": FORMAT_VERSION,
        "kind": "pretrained-target",
        "source": samples.source,
        "data_fingerprint": samples.fingerprint,
        "tokenizer": TOKENIZER_FILE if tokenizer is not None else None,
        "vocab_size": config.vocab_size,
        "settings": dataclasses.asdict(settings),
        "target_config": _config_identity(config),
        "parameters": int(sum(p.numel() for p in reference.parameters())),
        "train_rows": int(train_rows.size),
        "heldout_rows": int(heldout_rows.size),
        "train_windows": len(train),
        "train_tokens_per_epoch": train.num_tokens,
        "heldout_windows": len(heldout),
        "training": training,
        "heldout": {
            **trained,
            "untrained_loss": untrained["loss"],
            "untrained_perplexity": untrained["perplexity"],
            "unigram_loss": lm.unigram_loss(train, heldout, config.vocab_size),
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def _write_tokenizer_config(directory: Path) -> None:
    """``tokenizer_config.json`` so that ``AutoTokenizer.from_pretrained(directory)`` works too."""
    import json

    from harness.data.tokenizer import EOS_TOKEN, PAD_TOKEN

    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": PAD_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": 1 << 20,
    }, indent=2) + "\n")
