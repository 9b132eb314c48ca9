"""A training rank's models: the frozen target, the drafter with fp32 master weights, and the objective DDP wraps."""

from __future__ import annotations

import contextlib
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from harness.models.drafter_config import DrafterConfig
from harness.train.config import TrainerConfig

if TYPE_CHECKING:  # the models import transformers' modeling code: the ranks build them, the launcher
    # (which reads EMBEDDED_TARGET and pretrained_target_path only) starts faster without
    from harness.models.drafter import DFlashDrafter
    from harness.models.drafter_loss import DrafterLoss
    from harness.models.causal_lm_target import CausalLMTarget
    from harness.models.target import HybridTarget
    from harness.train.batch import TrainingBatch

#: seed of the random-weight target: the same target for every strategy and seed of a sweep
TARGET_INIT_SEED = 0
#: ``target.pretrained: embedded``: the tiny target pretrained on this run's data (built once, cached)
EMBEDDED_TARGET = "embedded"


@dataclass(frozen=True)
class TargetSpec:
    """The frozen target: where its weights come from, its architecture, and its attention kernels."""

    pretrained: Optional[str] = None
    """``target.pretrained``: a checkpoint, ``bundled``, ``embedded``, or None for random weights."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """The architecture (``Qwen3_5TextConfig`` keyword arguments) of a random-weight or embedded target."""
    data: Any = None
    """The run's ``data`` section: the rows an ``embedded`` target pretrains on."""
    attention_backend: str = "auto"
    """``trainer.target_attention_backend``."""


@dataclass(frozen=True)
class ModelsConfig:
    """A rank's models: the frozen target, the drafter's shape and seed, and their precisions."""

    target: TargetSpec
    """The frozen target."""
    drafter: DrafterConfig
    """The drafter's shape (its tapped target layers included)."""
    seed: int = 0
    """The drafter's initialisation seed (the run's seed)."""
    precision: str = "fp32"
    """``trainer.precision``: the target's and, by default, the drafter's activations."""
    drafter_precision: Optional[str] = None
    """``trainer.drafter_precision``: the drafter's activations when they differ from the target's."""


def pretrained_target_path(target: TargetSpec, progress: bool = False) -> str:
    """The checkpoint directory ``target.pretrained`` names; ``embedded`` builds or finds the cached one; ``bundled`` is
    the one shipped with the package."""
    if target.pretrained == EMBEDDED_TARGET:
        from harness.pretrain.target import ensure_pretrained_target

        return str(ensure_pretrained_target(target.data, target.kwargs, progress=progress))
    from harness.data import bundled

    if target.pretrained == bundled.BUNDLED:  # the shipped one (prepared configs already name its directory)
        bundled.verify()
        return str(bundled.target_dir())
    from harness.data import cache

    given = Path(str(target.pretrained)).expanduser()
    meta = cache.read_meta(given) if given.is_dir() else None
    if meta is not None and not cache.predates_checksums(meta):  # a batchlab cache entry named by its path
        cache.verified_meta(given)
    return str(target.pretrained)


def rank_device(trainer: TrainerConfig, env: Any) -> torch.device:
    """This rank's device (``cuda:LOCAL_RANK`` or the CPU); sets torch's intra-op threads to its share of the cores.

    ``env`` is this rank's place in the whole job: every process of the job on this machine shares its cores (a
    disaggregated drafter rank as much as the target ranks beside it)."""
    torch.set_num_threads(trainer.threads_per_rank or cpu_threads_per_rank(env))
    return torch.device(f"cuda:{env.local_rank}" if trainer.device == "cuda" else "cpu")


def cpu_threads_per_rank(env: Any) -> int:
    """This machine's cores over the job's processes on it (``LOCAL_WORLD_SIZE``: torch elastic's, or srun's tasks
    on this node; else the job's world size), at least 1."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or env.world_size)
    return max(1, (os.cpu_count() or 1) // max(1, local))


def precision_dtype(precision: str) -> torch.dtype:
    """The activations' dtype of a precision setting (``trainer.precision``: ``bf16`` or ``fp32``)."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def build_target(target: TargetSpec, drafter: DrafterConfig, dtype: torch.dtype,
                 device: torch.device) -> HybridTarget | CausalLMTarget:
    """The run's frozen target (fixed init seed for a random-weight one), tapped where ``drafter`` reads it: the
    same on every rank and strategy."""
    from harness.models.target import HybridTarget

    torch.manual_seed(TARGET_INIT_SEED)
    if target.pretrained:  # a Qwen3.5-style hybrid checkpoint, or any transformers causal LM (or GGUF file)
        from harness.models.causal_lm_target import load_target

        return load_target(
            pretrained_target_path(target), dtype=dtype, device=device, tap_layer_ids=drafter.target_layer_ids,
            num_draft_layers=drafter.num_hidden_layers, attention_backend=target.attention_backend)
    return HybridTarget(target.kwargs, tap_layer_ids=drafter.target_layer_ids,
                        num_draft_layers=drafter.num_hidden_layers, dtype=dtype,
                        attention_backend=target.attention_backend).to(device)


def draft_vocabulary(size: int | None, target_vocab_size: int, training_samples: Any = None) -> Any:
    """The run's :class:`~harness.models.draft_vocab.DraftVocabulary` of ``size`` tokens (``drafter.draft_vocab_size``;
    None: the whole vocabulary): the most frequent labels of ``training_samples``, or the first tokens when none
    are given."""
    if size is None:
        return None
    from harness.models.draft_vocab import DraftVocabulary

    if size > target_vocab_size:
        raise ValueError(f"drafter.draft_vocab_size={size} exceeds the target's vocabulary of {target_vocab_size} "
                         "tokens; give a smaller size, or null for the whole vocabulary")
    if training_samples is None:
        return DraftVocabulary(range(size), target_vocab_size)
    return DraftVocabulary.from_samples(training_samples, target_vocab_size, size)


class DrafterObjective(torch.nn.Module):
    """The drafter's loss sums for one micro-batch (the module DDP wraps)."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, batch: TrainingBatch, features: Any) -> DrafterLoss:
        if batch.empty:
            return self.drafter.empty_loss(self.drafter.fc.weight.device)
        hidden = self.drafter.forward_prepared(batch.drafter, features)
        return self.drafter.prepared_loss(batch.drafter, hidden, features)


class DrafterModel:
    """The target (frozen; a disaggregated drafter rank keeps a copy for eval only) and the drafter being trained.

    :meth:`distribute` wraps the objective in DDP over the training ranks' group with the summing
    communication hook (the loss is already normalised by the global step's weight)."""

    def __init__(self, config: ModelsConfig, device: torch.device, training_samples: Any = None) -> None:
        """``training_samples``: the run's training rows as ``(input_ids, loss_mask)`` pairs, from which a draft
        vocabulary (``drafter.draft_vocab_size``) takes its most frequent labels; without them (a calibration)
        any rows of the head cost the same, and the first ones are taken."""
        self.device = device
        self.dtype = precision_dtype(config.precision)
        self.drafter_dtype = precision_dtype(config.drafter_precision or config.precision)
        self.target = build_target(config.target, config.drafter, self.dtype, device)
        from harness.models.drafter import DFlashDrafter

        draft_vocab = draft_vocabulary(config.drafter.draft_vocab_size, self.target.lm_head.out_features,
                                       training_samples)
        torch.manual_seed(config.seed)
        # fp32 master weights whatever the target's dtype; bf16 runs use autocast
        self.drafter = DFlashDrafter(config.drafter, self.target.embed_tokens, self.target.lm_head,
                                     self.target.num_layers, draft_vocab, self.target.final_norm
                                     ).to(device=device, dtype=torch.float32)
        self.objective: torch.nn.Module = DrafterObjective(self.drafter)
        self.parameters = [p for p in self.drafter.parameters() if p.requires_grad]
        self.distributed = False

    def distribute(self, comm: Any, hook_state: Any, hook: Any) -> None:
        """DDP over ``comm``'s group (nothing on one rank), its buckets reduced by ``hook(hook_state, bucket)``
        (the gradient statistics' summing hook, which records gradient norms on measured steps)."""
        if not comm.env.distributed:
            return
        # the drafter's only buffers are its fixed rotary frequencies: nothing to sync per forward
        buffers = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(
            DistributedDataParallel.__init__).parameters else {"broadcast_buffers": False})
        self.objective = DistributedDataParallel(
            self.objective, device_ids=[comm.env.local_rank] if self.device.type == "cuda" else None,
            process_group=comm.group, **buffers)
        self.objective.register_comm_hook(hook_state, hook)
        self.distributed = True

    def no_sync(self, skip: bool) -> contextlib.AbstractContextManager:
        """DDP's ``no_sync`` when ``skip`` (every accumulation micro-batch but the last)."""
        return self.objective.no_sync() if (self.distributed and skip) else contextlib.nullcontext()

    def autocast(self) -> contextlib.AbstractContextManager:
        """The drafter's autocast (bf16 when ``drafter_dtype`` is); wraps drafter work only, never the target's."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.drafter_dtype == torch.bfloat16)

    def target_autocast(self) -> contextlib.AbstractContextManager:
        """The target's autocast (bf16 when ``trainer.precision`` is), where it runs under the evaluator: an fp32
        target never computes in bf16, whatever the drafter's precision; the drafter's work inside it takes
        :meth:`autocast` (which overrides it both ways)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16)

    def synchronize(self) -> None:
        """Wait for the device (stage times on CUDA)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
