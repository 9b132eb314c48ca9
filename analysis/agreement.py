"""Where one design's planned verdicts agree with another's: the real-model study (SmolLM2 × ShareGPT) beside the
embedded default's main job, contrast by contrast.

Both designs declare the same planned contrasts (``conf/preregistration/study_real.yaml`` and ``strategies.yaml``).
For each contrast the two verdicts (better / worse / no difference found / equivalent / not equivalent /
inconclusive, :mod:`analysis.planned`) are set side by side with their effects and intervals; they *agree* when the
verdicts are the same, and otherwise the line says which way each went. The effects are in each design's own units
(nats of its own held-out loss): their sizes are not compared, only their verdicts and signs.
"""

from __future__ import annotations

from collections.abc import Sequence

from analysis.planned import PlannedResult


def verdict_kind(result: PlannedResult) -> str:
    """The verdict without anything after a dash (a stored one may read "inconclusive — needs 9 seeds": the
    observed-power wording the verdicts no longer carry)."""
    return result.verdict.split(" — ")[0]


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
        same = verdict_kind(result) == verdict_kind(other)
        lines.append(f"{c.a} vs {c.b} ({c.kind}): **{'agrees' if same else 'differs'}** — {name} {_effect(result)}; "
                     f"{reference_name} {_effect(other)}.")
    return lines


def agreement_section(results: Sequence[PlannedResult], reference: Sequence[PlannedResult], name: str,
                      reference_name: str, source: str) -> list[str]:
    """The summary's lines: a heading sentence naming the reference's runs, then :func:`agreement_lines`."""
    agree = sum(o is not None and verdict_kind(r) == verdict_kind(o) for r, o in _paired(results, reference))
    head = (f"Against {reference_name} (its runs: `{source}`), the verdicts agree on {agree} of "
            f"{len(results)} planned contrasts (effects in each design's own nats; only verdicts are compared):")
    return [head, ""] + [f"- {line}" for line in agreement_lines(results, reference, name, reference_name)]


def with_agreement(answer: Sequence[str], results: Sequence[PlannedResult],
                   reference: tuple[Sequence[PlannedResult], str, str] | None) -> list[str]:
    """``answer``'s lines followed by :func:`agreement_section` against ``reference`` (its results, name and runs'
    file); ``answer`` alone without one."""
    if reference is None:
        return list(answer)
    return [*answer, *([""] if answer else []), *agreement_section(results, reference[0], "here", *reference[1:])]
