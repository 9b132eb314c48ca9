"""Update one section of ``benchmarks/RESULTS.md`` (other benchmarks' sections stay), and name the machine."""

from __future__ import annotations

import platform
import statistics
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


def median_table(label: str, times: dict[str, list[float]]) -> list[str]:
    """Markdown rows: each variant (first column headed ``label``) with its median wall time and every run's."""
    return [f"| {label} | median wall s | runs (s) |", "|---|---:|---|",
            *(f"| {name} | {statistics.median(values):.2f} | {', '.join(f'{v:.2f}' for v in values)} |"
              for name, values in times.items())]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else the platform's processor string."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def stop_words(trainer: dict) -> str:
    """A run's stop condition in words, from its resolved ``trainer`` config: "880,890 tokens" or "6 epochs"."""
    if trainer["stop_tokens"] is not None:
        return f"{trainer['stop_tokens']:,} tokens"
    return f"{trainer['stop_epochs']:g} epochs"
