"""Equal-token optimizer steps (``step_tokens``): planning time, step counts and spread per strategy.

On ``chat-902k`` at ``max_tokens=16384``, world size 8, and ``step_tokens = 8 x 16384`` (a global
batch of eight full micro-batches), in one run:

1. plan time of one epoch per strategy with fixed accumulation and with ``step_tokens`` (median of
   ``--repeats`` runs after a warm-up run on the full data; kernels compiled before, on a few
   samples), the steps of each, the grid width (``grad_accum`` of the equal-token plan) and the
   share of its slots that are padding, the real tokens per step (cv, min, max, all steps but the
   last) and micro-batches per step, and the longest same-bucket streak;
2. the step counts of the cut rule batchlab uses (a step closes before or after the micro-batch
   that takes it past ``step_tokens``, whichever keeps the running total nearer ``k x step_tokens``)
   against the rule that makes each step alone closest to ``step_tokens``, which it replaced: on
   micro-batches of similar size the latter rounds every step the same way, on ``chat-902k`` and on
   ``stdlib-defs``.

Prints a markdown section; ``--write`` replaces the "Equal-token steps (strategies)" section of
``benchmarks/RESULTS.md`` with it (command, machine, date).
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO_ROOT))

import strategies  # noqa: E402
from harness.data.profiles import profile_lengths  # noqa: E402
from plan_speed import SHARED_MACHINE_NOTE, machine_description, timed_runs  # noqa: E402
from results_file import write_section  # noqa: E402
from strategies.metrics import plan_metrics  # noqa: E402

SECTION_TITLE = "## Equal-token steps (strategies)"
MAX_TOKENS = 16384
WORLD_SIZE = 8
STEP_TOKENS = 8 * MAX_TOKENS
WARMUP_SAMPLES = 4096
STRATEGY_NAMES = tuple(strategies.report_order())
#: (profile, max_tokens, world_size, step_tokens) of the step-count comparison
COUNT_CASES = (
    ("chat-902k", MAX_TOKENS, WORLD_SIZE, STEP_TOKENS),
    ("stdlib-defs", 8192, 2, 16384),
)


def plan_one(lengths: np.ndarray, name: str, budget: int, world_size: int, step_tokens: int | None) -> strategies.Plan:
    return strategies.plan(lengths, strategies.Budget(budget), strategy=name, seed=0, epoch=0, world_size=world_size,
                           step_tokens=step_tokens)


def measure_speed(lengths: np.ndarray, repeats: int) -> list[dict]:
    rows = []
    for name in STRATEGY_NAMES:
        row: dict = {"strategy": name}
        for mode, step_tokens in (("fixed", None), ("equal", STEP_TOKENS)):
            plan_one(lengths[:WARMUP_SAMPLES], name, MAX_TOKENS, WORLD_SIZE, step_tokens)
            _, seconds, plan = timed_runs(lambda _: plan_one(lengths, name, MAX_TOKENS, WORLD_SIZE, step_tokens),
                                          repeats)
            row[f"{mode}_seconds"] = statistics.median(seconds)
            row[f"{mode}_metrics"] = plan_metrics(plan)
        rows.append(row)
    return rows


def local_rule_steps(tokens_in_order: np.ndarray, step_tokens: int) -> int:
    """Steps of the replaced rule: each step alone closes at the cut nearest ``step_tokens`` (ties: before)."""
    steps, total = 0, 0
    for tokens in tokens_in_order.tolist():
        if total > 0 and total + tokens > step_tokens:
            steps += 1
            total = tokens if step_tokens - total <= total + tokens - step_tokens else 0
        else:
            total += tokens
    return steps + (total > 0)


def measure_counts() -> list[dict]:
    rows = []
    for profile, budget, world_size, step_tokens in COUNT_CASES:
        lengths = profile_lengths(profile)
        for name in STRATEGY_NAMES:
            equal = plan_one(lengths, name, budget, world_size, step_tokens)
            # the strategy's micro-batches in its order (world 1, one per step), cut by the replaced rule
            order = plan_one(lengths, name, budget, 1, None).micro_batch_tokens()
            rows.append({
                "profile": profile, "budget": budget, "world_size": world_size, "step_tokens": step_tokens,
                "strategy": name, "ideal": lengths.sum() / step_tokens,
                "fixed": plan_one(lengths, name, budget, world_size, None).num_steps,
                "running": equal.num_steps, "local": local_rule_steps(order, step_tokens),
            })
    return rows


def render(speed: list[dict], counts: list[dict], repeats: int, command: str) -> str:
    lines = [
        SECTION_TITLE, "",
        f"Command: `{command}` · machine: {machine_description()} · date: {dt.date.today().isoformat()}.",
        SHARED_MACHINE_NOTE, "",
        f"### `chat-902k`, max_tokens={MAX_TOKENS}, world_size={WORLD_SIZE}, step_tokens={STEP_TOKENS:,}", "",
        f"Plan time: median of {repeats} runs after a warm-up run. Step tokens and micro-batches per step: every "
        "step but the last; without a mode named, of the equal-token plan. Grid: the equal-token plan's "
        "`grad_accum` (most micro-batches of a rank in a step) and the share of its slots that are padding. "
        "Streak: longest run of consecutive single-bucket steps (bucketed: its own edges; others: 8 equal-count "
        "length bins).", "",
        "| strategy | plan s fixed | plan s equal | steps fixed | steps equal | step tokens fixed (mean · cv) | "
        "grid grad_accum | padding slots | step tokens cv | min | max | micro-batches / step (min · mean · max) | "
        "streak fixed | streak equal |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in speed:
        fixed, equal = row["fixed_metrics"], row["equal_metrics"]
        slots = equal["micro_batches"] + equal["empty_micro_batches"]
        lines.append(
            f"| {row['strategy']} | {row['fixed_seconds']:.3f} | {row['equal_seconds']:.3f} | {fixed['steps']:,} | "
            f"{equal['steps']:,} | {fixed['step_tokens_mean']:,.0f} · {fixed['step_tokens_cv']:.3f} | "
            f"{equal['grad_accum']} | {equal['empty_micro_batches'] / slots:.1%} | "
            f"{equal['step_tokens_cv']:.4f} | {equal['step_tokens_min']:,} | {equal['step_tokens_max']:,} | "
            f"{equal['micro_batches_per_step_min']} · {equal['micro_batches_per_step_mean']:.2f} · "
            f"{equal['micro_batches_per_step_max']} | {fixed['longest_bucket_streak']} | "
            f"{equal['longest_bucket_streak']} |"
        )
    lines += [
        "", "### Step counts: running-total cut rule against each step alone nearest step_tokens", "",
        "ideal = real tokens / step_tokens. `running`: batchlab's rule; `local`: the strategy's micro-batches in "
        "its order (world 1; bucketed: without its same-bucket steps), each step closed at the cut nearest "
        "step_tokens on its own (the rule first proposed).", "",
        "| profile | max_tokens | world | step_tokens | strategy | ideal | steps fixed | steps running | "
        "steps local | local − ideal |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in counts:
        lines.append(
            f"| {row['profile']} | {row['budget']} | {row['world_size']} | {row['step_tokens']:,} | "
            f"{row['strategy']} | "
            f"{row['ideal']:.1f} | {row['fixed']:,} | {row['running']:,} | {row['local']:,} | "
            f"{(row['local'] - row['ideal']) / row['ideal']:+.1%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up (default 3)")
    parser.add_argument("--write", action="store_true", help="update the equal-token section of RESULTS.md")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    speed = measure_speed(profile_lengths("chat-902k"), args.repeats)
    counts = measure_counts()
    command = "python benchmarks/step_tokens_speed.py" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    section = render(speed, counts, args.repeats, command)
    print(section)
    if args.write:
        write_section(section, SECTION_TITLE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
