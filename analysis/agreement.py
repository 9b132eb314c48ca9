"""Where one design's planned verdicts agree with another's: the real-model study (SmolLM2 × ShareGPT) beside the
embedded default's main job, contrast by contrast.

Both designs declare the same planned contrasts (``conf/preregistration/study_real.yaml`` and ``strategies.yaml``).
For each contrast the two verdicts (better / worse / no difference found / equivalent / not equivalent /
inconclusive, :mod:`analysis.planned`) are set side by side with their effects and intervals. They *agree* when the
verdicts are the same and *conflict* when both are decisive and differ; where one is undecided (inconclusive) the
line says whether its effect points the way of the other's verdict. An undecided verdict is never counted as a
disagreement. The effects are in each design's own units
(nats of its own held-out loss): their sizes are not compared, only their verdicts and signs.
"""

from __future__ import annotations

from collections.abc import Sequence

from analysis.planned import PlannedResult


def verdict_kind(result: PlannedResult) -> str:
    """The verdict without anything after a dash (a stored one may read "inconclusive — needs 9 seeds": the
    observed-power wording the verdicts no longer carry)."""
    return result.verdict.split(" — ")[0]


#: verdicts that decide nothing
UNDECIDED = ("inconclusive", "no difference found")


def relation(result: PlannedResult, other: PlannedResult) -> str:
    """``agrees``, ``conflicts`` (both decisive, different), ``one inconclusive, same direction`` (a superiority
    contrast whose undecided effect has the decisive effect's sign) or ``one inconclusive``."""
    mine, theirs = verdict_kind(result), verdict_kind(other)
    if mine == theirs:
        return "agrees"
    if mine not in UNDECIDED and theirs not in UNDECIDED:
        return "conflicts"
    if mine in UNDECIDED and theirs in UNDECIDED:
        return "agrees"
    same_sign = result.mean_difference * other.mean_difference > 0
    return "one inconclusive, same direction" if result.contrast.kind == "superiority" and same_sign else \
        "one inconclusive"


def _effect(result: PlannedResult) -> str:
    low, high = result.interval
    return f"{result.verdict}, {result.mean_difference:+.3f} [{low:+.3f}, {high:+.3f}] over {len(result.seeds)} seeds"


def _paired(results: Sequence[PlannedResult],
            reference: Sequence[PlannedResult]) -> list[tuple[PlannedResult, PlannedResult | None]]:
    """Each result with the reference's result for the same contrast (None when the reference lacks it)."""
    by_contrast = {(r.contrast.a, r.contrast.b, r.contrast.kind): r for r in reference}
    return [(r, by_contrast.get((r.contrast.a, r.contrast.b, r.contrast.kind))) for r in results]


def agreement_lines(results: Sequence[PlannedResult], reference: Sequence[PlannedResult], name: str,
                    reference_name: str) -> list[str]:
    """One line per contrast of ``results`` (this design, called ``name``): its verdict and the ``reference``
    design's for the same contrast, and whether they agree; a contrast the reference lacks says so."""
    lines = []
    for result, other in _paired(results, reference):
        c = result.contrast
        if other is None:
            lines.append(f"{c.a} vs {c.b} ({c.kind}): {name} {_effect(result)}; not a contrast of {reference_name}.")
            continue
        lines.append(f"{c.a} vs {c.b} ({c.kind}): **{relation(result, other)}** — {name} {_effect(result)}; "
                     f"{reference_name} {_effect(other)}.")
    return lines


def agreement_section(results: Sequence[PlannedResult], reference: Sequence[PlannedResult], name: str,
                      reference_name: str, source: str) -> list[str]:
    """The summary's lines: a heading sentence naming the reference's runs, then :func:`agreement_lines`."""
    relations = [relation(r, o) for r, o in _paired(results, reference) if o is not None]
    undecided = sum(r.startswith("one inconclusive") for r in relations)
    head = (f"Against {reference_name} (its runs: `{source}`), the verdicts agree on {relations.count('agrees')} of "
            f"{len(results)} planned contrasts and conflict on {relations.count('conflicts')}")
    if undecided:
        head += (f"; on {undecided} one design is inconclusive, {relations.count('one inconclusive, same direction')} "
                 "of them with its effect in the other's direction")
    head += " (effects in each design's own nats; verdicts and directions are compared, not sizes):"
    return [head, ""] + [f"- {line}" for line in agreement_lines(results, reference, name, reference_name)]


def with_agreement(answer: Sequence[str], results: Sequence[PlannedResult],
                   reference: tuple[Sequence[PlannedResult], str, str] | None) -> list[str]:
    """``answer``'s lines followed by :func:`agreement_section` against ``reference`` (its results, name and runs'
    file); ``answer`` alone without one."""
    if reference is None:
        return list(answer)
    return [*answer, *([""] if answer else []), *agreement_section(results, reference[0], "here", *reference[1:])]
