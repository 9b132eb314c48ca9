"""Batching strategies for variable-length data: plan the micro-batches of an epoch from lengths.

Pure numpy (and numba); never imports torch. Every strategy maps ``(lengths, budget, seed, epoch,
world_size, grad_accum)`` to a :class:`Plan`: the optimizer steps of one epoch, each made of
``world_size * grad_accum`` micro-batches of sample indices, with a layout (``padded`` or
``packed``)::

    import numpy as np
    from strategies import Budget, plan

    lengths = np.array([12, 700, 35, 4096, 80, 512])
    p = plan(lengths, Budget(8192), strategy="bucketed", seed=0, epoch=0, world_size=2)
    for step, micro_batches in p.rank_steps(rank=0):        # one rank's view (resume: start_step=)
        ...
    p.exactly_once()                                         # every index once this epoch -> True

API:

- ``plan(lengths, budget, strategy="bucketed", seed=0, epoch=0, world_size=1, grad_accum=1,
  oversize="error", balance=None, step_tokens=None, **strategy_options) -> Plan``.
- ``step_tokens``: None (every step ``world_size * grad_accum`` micro-batches), or the real tokens
  of every optimizer step (equal-token steps, docs/design/data-flow.md; needs ``grad_accum=1``): the
  strategy's micro-batches, in its order, are cut into steps of about that many real tokens
  (``Strategy.token_steps``) and spread round-robin over the ranks; ``Plan.grad_accum`` is then the
  most micro-batches a rank holds in a step, the slots after a rank's real ones are empty padding,
  and ``Plan.rank_step_counts()`` / ``Plan.rank_steps(rank, start_step, skip_padding=True)`` give the
  real ones (or one empty micro-batch for a rank with none in a step).
- ``plan_remainder(strategy, lengths, consumed, budget, seed, epoch, world_size, grad_accum, oversize,
  balance, step_tokens) -> Plan``: the rest of an epoch, for resuming on another world size: every kept
  sample not in ``consumed`` (a boolean mask or indices), planned by the same strategy from
  ``(seed, epoch)``, indices in the original sample positions, ``Plan.consumed`` set (see
  :mod:`strategies.remainder`).
- ``build_strategy(name, **options)`` → a strategy object with
  ``.plan(lengths, budget, seed, epoch, world_size, grad_accum, oversize, balance, step_tokens)`` (for Hydra);
  ``available_strategies()`` → the registered names, sorted; ``report_order()`` → the same in the
  order reports and sweeps show them; ``register_strategy(cls)`` adds one (a :class:`Strategy`
  subclass: see its docstring and docs/design/strategies.md, "Adding a strategy").
- ``Budget(max_tokens, max_samples=None)``: computed token slots of a micro-batch (``rows x max_len``
  padded, the row capacity packed) and an optional cap on its samples.
- ``balance``: None or ``RankBalance(cost_model=CostModel(a, b, c, block_size, num_anchors),
  window_steps=1)`` (or a dict of the same fields): inside every step, micro-batches are placed on
  ranks (``grad_accum`` each) to minimise the costliest rank under
  ``a * slots + b * sum(len^2) + c * drafter blocks`` (blocks from the lengths and the drafter's
  anchor rule, :mod:`strategies.cost`); never worse than unbalanced.
- ``oversize``: what to do with a sample longer than ``max_tokens``: ``"error"`` (default),
  ``"truncate"`` or ``"drop"``; affected indices land in ``Plan.truncated`` / ``Plan.dropped`` and
  are logged. Bad input raises before any work (:class:`LengthsError` for lengths, ``ValueError``
  otherwise), naming the sample index, its value and the fix.
- ``bucket_edges(lengths, num_buckets, method="dp"|"quantile"|"equal_tokens", budget=None,
  max_recurrence=None)``.

Strategies (docs/design/strategies.md), all under the same budget:

- ``sorted``: sort by length (ties by a seeded permutation), greedy fill, shuffle the micro-batch
  order each epoch. Micro-batch composition never changes between epochs.
- ``shuffle``: a random permutation each epoch, then the same greedy fill.
- ``bucketed(num_buckets=64, edges="dp", same_bucket_steps=True, max_recurrence=0.1)``: shuffle
  inside each length bucket, fill inside a bucket, shuffle the order; ``same_bucket_steps`` keeps a
  step's micro-batches in one bucket (ranks balanced, steps length-homogeneous);
  ``max_recurrence`` bounds every dp bucket's recurrence by a minimum population, so the number of
  buckets used follows the dataset; with ``step_tokens`` the equal-token steps stay in one bucket.
- ``length_grouped(mega_batch_mult=50, batch_size=None, shuffle_order=True)``: Hugging Face's
  ``LengthGroupedSampler`` rule (random permutation, megabatches of ``mega_batch_mult x batch_size``
  samples sorted longest first), each megabatch split greedily under the budget; the micro-batch
  order is shuffled each epoch unless ``shuffle_order=False`` (Hugging Face's own order). The
  baseline users would otherwise pick.
- ``packed(fit="first"|"best")``: random order, then first-fit/best-fit of whole samples into rows
  of ``max_tokens`` (layout ``packed``: one flat row per micro-batch, cu_seqlens from the lengths).

Greedy fill (padded layout): a micro-batch grows while ``rows * max_len <= max_tokens`` and
``rows <= max_samples``. Every kept index appears exactly once per epoch across ranks and
micro-batches; a short final step gets empty micro-batches. A plan is a pure function of its
arguments: same ``(seed, epoch)`` → the same plan (random streams from
``SeedSequence([seed, epoch, purpose])``), so resuming is ``plan(...).rank_steps(rank, start_step)``.
"""

from ._assemble import MicroBatches  # what a strategy's micro_batches() returns (the plugin API)
from ._random import STATIC_EPOCH, Purpose, generator  # a strategy's seeded random choices (the plugin API)
from .balance import RankBalance
from .base import CliOption, Strategy
from .builtin import padded_fill  # fill padded micro-batches in a given order (the plugin API)
from .builtin import (
    DEFAULT_NUM_BUCKETS,
    BucketedStrategy,
    LengthGroupedStrategy,
    PackedStrategy,
    ShuffleStrategy,
    SortedStrategy,
)
from .cost import CostModel
from .edges import bucket_edges, expected_padded_slots
from .epoch_plan import Budget, Plan
from .validate import LengthsError
from .registry import (
    available_strategies,
    build_strategy,
    plan,
    register_strategy,
    report_order,
    strategy_class,
    strategy_options,
    unregister_strategy,
)
from .remainder import plan_remainder

__all__ = [
    "Budget",
    "Plan",
    "CostModel",
    "RankBalance",
    "LengthsError",
    "plan",
    "plan_remainder",
    "build_strategy",
    "available_strategies",
    "report_order",
    "register_strategy",
    "unregister_strategy",
    "strategy_class",
    "strategy_options",
    "bucket_edges",
    "expected_padded_slots",
    "Strategy",
    "CliOption",
    "SortedStrategy",
    "ShuffleStrategy",
    "BucketedStrategy",
    "PackedStrategy",
    "LengthGroupedStrategy",
    "DEFAULT_NUM_BUCKETS",
    "MicroBatches",
    "Purpose",
    "STATIC_EPOCH",
    "generator",
    "padded_fill",
]
