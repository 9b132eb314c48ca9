"""Update one section of ``benchmarks/RESULTS.md`` and leave the other benchmarks' sections alone."""

from __future__ import annotations

from pathlib import Path

RESULTS_PATH = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(section: str, title: str, path: Path = RESULTS_PATH) -> None:
    """Replace the section headed ``title`` (up to the next ``## `` heading) with ``section``, or append it."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == title), None)
    if start is None:
        new_text = text.rstrip("\n") + "\n\n" + section
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        tail = "".join(lines[end:])
        new_text = "".join(lines[:start]) + section + ("\n" + tail if tail else "")
    path.write_text(new_text)
