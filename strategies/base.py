"""The base class of every strategy and the declaration of its command-line options.

A new strategy subclasses :class:`Strategy` (see its docstring for what it declares) and registers
itself with :func:`strategies.register_strategy`; ``strategies/builtin.py`` holds the built-in ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar, Optional

import numpy as np

from ._assemble import MicroBatches, assemble
from .balance import RankBalance
from .epoch_plan import MAX_BUDGET_TOKENS, Budget, Layout, Plan, segment_reduce
from .kernels import token_step_cuts
from .validate import (
    PreparedLengths,
    check_oversize_policy,
    check_run_shape,
    coerce_budget,
    prepare_lengths,
)


class _NoConst:
    """``CliOption.const`` of an option that takes a value (not a switch)."""

    def __repr__(self) -> str:
        return "NO_CONST"


NO_CONST: Any = _NoConst()


@dataclass(frozen=True)
class CliOption:
    """One option of a strategy exposed as a flag of ``batchlab-plan`` (:attr:`Strategy.cli_options`).

    ``flag`` (``"--num-buckets"``) sets the strategy's field ``field``; a flag left out keeps the
    field's default. The text given is converted by ``type`` while the command line is parsed (a bad
    value is then argparse's usage error), or by ``parse`` afterwards, whose ``ValueError`` message
    follows the flag in the command's error line (``--edges 'x' is neither ...``). With ``const`` set
    the flag is a switch without a value that sets the field to ``const``. Several strategies may
    declare the same flag (a subclass inherits its parent's): it then sets the field of each.
    """

    flag: str
    field: str
    help: str
    type: Optional[Callable[[str], Any]] = None
    parse: Optional[Callable[[str], Any]] = None
    const: Any = NO_CONST

    def __post_init__(self) -> None:
        if not self.flag.startswith("--"):
            raise ValueError(f"CliOption flag {self.flag!r} must start with '--'")
        if self.type is not None and self.parse is not None:
            raise ValueError(f"CliOption {self.flag}: give type or parse, not both")
        if self.is_switch and (self.type is not None or self.parse is not None):
            raise ValueError(f"CliOption {self.flag}: a switch (const) takes no value to convert")

    @property
    def is_switch(self) -> bool:
        return self.const is not NO_CONST

    def value(self, given: Any) -> Any:
        """The field's value for what the command line gave (the text, or ``const`` for a switch)."""
        return self.parse(given) if self.parse is not None else given


@dataclass(frozen=True)
class Strategy:
    """Base of every strategy: validation, then micro-batches, then steps/ranks (see ``plan``).

    A strategy is a frozen dataclass whose fields are its options, each documented by a docstring right under
    it (its first line is the option's line in the config reference); it implements
    :meth:`micro_batches` and declares, as class attributes:

    - ``name``: its registry name (also its Hydra file ``conf/strategy/<name>.yaml``);
    - ``layout``: ``"padded"`` (default) or ``"packed"``;
    - ``cli_options``: the options ``batchlab-plan`` exposes as flags (:class:`CliOption`);
    - ``report_rank``: its place in reports, sweeps and the report's colours (lower first); None
      (default) puts it after the ranked strategies, in registration order. The built-ins are
      ranked so that ``sorted``, the defect under study, comes first and ``shuffle``, the random
      extreme, last.
    - ``epoch_composition``: how its micro-batches' samples change from one epoch to the next, a
      claim the generated tests (``tests/strategies/test_strategy_claims.py``) measure on its plans: ``"fixed"``
      (the same micro-batches every epoch), ``"reshuffled"`` (drawn anew: most micro-batches new) or
      ``"bounded"`` (new, with a composition recurrence of at most its ``max_recurrence`` option).
      The order of the micro-batches changes every epoch in every strategy.
    """

    name: ClassVar[str] = ""
    layout: ClassVar[Layout] = "padded"
    cli_options: ClassVar[tuple[CliOption, ...]] = ()
    report_rank: ClassVar[Optional[int]] = None
    epoch_composition: ClassVar[str] = ""

    def plan(
        self,
        lengths: Any,
        budget: Budget | int,
        seed: int = 0,
        epoch: int = 0,
        world_size: int = 1,
        grad_accum: int = 1,
        oversize: str = "error",
        balance: RankBalance | dict[str, Any] | None = None,
        step_tokens: int | None = None,
    ) -> Plan:
        """Plan one epoch.

        Args:
            lengths: length (tokens) of every sample, 1-D positive integers.
            budget: a :class:`Budget` (or a bare ``max_tokens``) shared by every micro-batch.
            seed, epoch: the plan is a pure function of them (and of the other arguments).
            world_size, grad_accum: each optimizer step has ``world_size * grad_accum`` micro-batches.
            oversize: ``"error"``, ``"truncate"`` or ``"drop"`` for samples longer than max_tokens.
            balance: None, a :class:`RankBalance`, or a mapping of its fields.
            step_tokens: None (fixed accumulation, as above), or the real tokens of every optimizer
                step (equal-token steps): the micro-batches are made as without it, then consecutive
                ones are grouped into steps by :meth:`token_steps` and spread round-robin over the
                ranks. Needs ``grad_accum=1``; the plan's ``grad_accum`` is then the most micro-batches
                any rank holds in a step (``Plan.rank_step_counts`` gives the real ones), and
                ``balance`` places micro-batches inside each step only (``window_steps=1``).
        """
        step_tokens = checked_step_tokens(step_tokens, grad_accum, balance)
        budget, seed, epoch, world_size, grad_accum, balance, prepared = self.checked_inputs(
            lengths, budget, seed, epoch, world_size, grad_accum, oversize, balance)
        if step_tokens is None:
            micro = self.micro_batches(prepared, budget, seed, epoch, world_size * grad_accum)
        else:
            micro = self.micro_batches(prepared, budget, seed, epoch, 1)
            micro = self.token_steps(micro, prepared, step_tokens, seed, epoch)
        micro.info["options"] = self.options()
        return assemble(
            self.name, self.layout, prepared, micro, budget, seed, epoch, world_size, grad_accum, balance, oversize,
            step_tokens,
        )

    def checked_inputs(self, lengths, budget, seed, epoch, world_size, grad_accum, oversize, balance):
        """The arguments of :meth:`plan` validated and coerced: ``(budget, seed, epoch, world_size,
        grad_accum, balance, prepared lengths)`` (also what ``plan_remainder`` checks first)."""
        budget = coerce_budget(budget)
        self.check_budget(budget)
        world_size, grad_accum, seed, epoch = check_run_shape(world_size, grad_accum, seed, epoch)
        check_oversize_policy(oversize)
        balance = RankBalance.coerce(balance)
        return budget, seed, epoch, world_size, grad_accum, balance, prepare_lengths(lengths, budget, oversize)

    def check_budget(self, budget: Budget) -> None:
        """Refuse budgets the strategy cannot plan (none by default)."""

    def options(self) -> dict[str, Any]:
        """The strategy's options as plain data."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}

    def micro_batches(
        self, prepared: PreparedLengths, budget: Budget, seed: int, epoch: int, per_step: int
    ) -> MicroBatches:
        """The epoch's micro-batches and their order (implemented by each strategy).

        ``per_step`` is the micro-batches of an optimizer step, ``world_size * grad_accum``; with
        equal-token steps it varies and ``per_step`` is 1 (then :meth:`token_steps` makes the steps).
        """
        raise NotImplementedError

    def token_steps(
        self, micro: MicroBatches, prepared: PreparedLengths, step_tokens: int, seed: int, epoch: int
    ) -> MicroBatches:
        """Equal-token steps: ``micro`` with ``step_offsets`` grouping its sequence into optimizer steps.

        Default: the micro-batches in the strategy's order, cut by the cut rule of
        :func:`cut_token_steps`. A strategy that shapes its steps (bucketed's ``same_bucket_steps``)
        overrides it.
        """
        tokens = micro_batch_real_tokens(prepared.lengths, micro)
        return replace(micro, step_offsets=cut_token_steps(tokens[micro.sequence], step_tokens))


def micro_batch_real_tokens(lengths: np.ndarray, micro: MicroBatches) -> np.ndarray:
    """Real tokens of every micro-batch id of ``micro``."""
    return segment_reduce(np.add, lengths[micro.order], micro.offsets)


def cut_token_steps(
    tokens_in_order: np.ndarray, step_tokens: int, group_offsets: np.ndarray | None = None
) -> np.ndarray:
    """Step offsets into micro-batches in order (their real tokens given): the equal-token cut rule.

    A step takes micro-batches while its tokens stay ``<= step_tokens`` (``T``); at the one that
    would pass ``T`` it closes before or after it, whichever brings the running total of the steps
    so far closer to their number times ``T`` (a tie: before); the last step (of each group in
    ``group_offsets``, which no step crosses) holds what is left. With every micro-batch's real
    tokens ``<= t <= T``: every step but the last of its group holds more than ``T - t`` and at most
    ``T + t`` tokens, and after ``k`` steps the running total is within ``t / 2`` of ``k * T``, so the
    step count is ``total / T`` up to ``-t / (2T)`` and ``+1 + t / (2T)`` whatever the micro-batches.
    A micro-batch over ``T`` is a step alone (docs/design/data-flow.md).
    """
    if group_offsets is None:
        group_offsets = np.array([0, tokens_in_order.size], dtype=np.int64)
    return token_step_cuts(tokens_in_order.astype(np.int64), group_offsets, int(step_tokens))


def checked_step_tokens(step_tokens: Any, grad_accum: Any, balance: Any) -> int | None:
    """``step_tokens`` validated against the run shape: None, or a positive int with ``grad_accum=1``
    and no balance windows."""
    if step_tokens is None:
        return None
    if (
        isinstance(step_tokens, (bool, np.bool_))
        or not isinstance(step_tokens, (int, np.integer))
        or not 1 <= step_tokens <= MAX_BUDGET_TOKENS
    ):
        raise ValueError(
            f"step_tokens={step_tokens!r} must be a positive integer (real tokens per optimizer step, at most "
            "2**40) or None for a fixed number of micro-batches per step"
        )
    if isinstance(grad_accum, (bool, np.bool_)) or grad_accum != 1:
        raise ValueError(
            f"step_tokens={step_tokens} sets how many micro-batches each step takes, so grad_accum must be 1, "
            f"got grad_accum={grad_accum!r}; the plan's grad_accum then reports the most micro-batches a rank holds"
        )
    balance = RankBalance.coerce(balance)
    if balance is not None and balance.window_steps != 1:
        raise ValueError(
            f"balance window_steps={balance.window_steps} regroups micro-batches between steps, which would change "
            "the tokens of equal-token steps (step_tokens); use window_steps=1 (placement inside each step)"
        )
    return int(step_tokens)
