"""The base class of every strategy and the declaration of its command-line options.

A new strategy subclasses :class:`Strategy` (see its docstring for what it declares) and registers
itself with :func:`strategies.register_strategy`; ``strategies/builtin.py`` holds the built-in ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Optional

from ._assemble import MicroBatches, assemble
from .balance import RankBalance
from .epoch_plan import Budget, Layout, Plan
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

    A strategy is a frozen dataclass whose fields are its options; it implements
    :meth:`micro_batches` and declares, as class attributes:

    - ``name``: its registry name (also its Hydra file ``conf/strategy/<name>.yaml``);
    - ``layout``: ``"padded"`` (default) or ``"packed"``;
    - ``cli_options``: the options ``batchlab-plan`` exposes as flags (:class:`CliOption`);
    - ``report_rank``: its place in reports, sweeps and the report's colours (lower first); None
      (default) puts it after the ranked strategies, in registration order. The built-ins are
      ranked so that ``sorted``, the defect under study, comes first and ``shuffle``, the random
      extreme, last.
    """

    name: ClassVar[str] = ""
    layout: ClassVar[Layout] = "padded"
    cli_options: ClassVar[tuple[CliOption, ...]] = ()
    report_rank: ClassVar[Optional[int]] = None

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
    ) -> Plan:
        """Plan one epoch.

        Args:
            lengths: length (tokens) of every sample, 1-D positive integers.
            budget: a :class:`Budget` (or a bare ``max_tokens``) shared by every micro-batch.
            seed, epoch: the plan is a pure function of them (and of the other arguments).
            world_size, grad_accum: each optimizer step has ``world_size * grad_accum`` micro-batches.
            oversize: ``"error"``, ``"truncate"`` or ``"drop"`` for samples longer than max_tokens.
            balance: None, a :class:`RankBalance`, or a mapping of its fields.
        """
        budget, seed, epoch, world_size, grad_accum, balance, prepared = self.checked_inputs(
            lengths, budget, seed, epoch, world_size, grad_accum, oversize, balance)
        micro = self.micro_batches(prepared, budget, seed, epoch, world_size * grad_accum)
        micro.info["options"] = self.options()
        return assemble(
            self.name, self.layout, prepared, micro, budget, seed, epoch, world_size, grad_accum, balance, oversize
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
        """The epoch's micro-batches and their order (implemented by each strategy)."""
        raise NotImplementedError
