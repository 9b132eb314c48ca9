"""The docs site builds with `mkdocs build --strict` and no warning; the README's answer table is the results pages'
own numbers; the README's links resolve; the plan API block of the batchlab-plan page runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = {"main job": REPO / "docs" / "results" / "main-job.md", "real model": REPO / "docs" / "results" / "real-model.md"}


def test_the_site_builds_strict_with_no_warning(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "WARNING" not in output, output[-4000:]
    for page in ("index.html", "results/main-job/index.html", "reference/api/index.html", "design/metrics/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert 'id="strategies.plan"' in api and 'id="batchlab.StrategyBatchSampler"' in api  # mkdocstrings rendered


def _planned_lines(page: Path) -> dict[str, str]:
    """The planned contrasts' sentences of a results page's pasted block, by contrast."""
    block = page.read_text().split("<!-- summary.md of make", 1)[1].split("<!-- end of summary.md -->", 1)[0]
    planned = block.split("\n\n", 2)[1]  # the opening line, then the contrasts' sentences
    return {line[2:].split(" (", 1)[0]: line for line in planned.splitlines() if line.startswith("- ")}


def test_the_readme_answer_table_is_the_results_pages_own_numbers():
    """Every verdict and interval of the README's table is the one in its study's pasted block, linked to that page."""
    rows = _readme_tables()[0][2:]
    blocks = {study: _planned_lines(page) for study, page in PAGES.items()}
    assert len(rows) == len(blocks["main job"]) == len(blocks["real model"]) == 4
    for row in rows:
        contrast, *cells = [cell.strip() for cell in row.strip("|").split("|")]
        contrast = contrast.split(" (", 1)[0]
        for (study, page), cell in zip(PAGES.items(), cells, strict=True):
            verdict, target = re.match(r"\[\*\*(.+?)\*\*\]\((.+?)\)", cell).groups()
            assert REPO / target == page, (contrast, study, target)
            effect = cell.split(": ", 1)[1]
            line = blocks[study][contrast]
            assert f"**{verdict}**" in line and effect in line.replace("final_eval_loss ", ""), (contrast, study, cell)


def _readme_tables() -> list[list[str]]:
    """The README answer section's tables, each as its lines (header and rule included)."""
    section = (REPO / "README.md").read_text().split("## The answer", 1)[1].split("\n## ", 1)[0]
    tables, current = [], []
    for line in section.splitlines() + [""]:
        if line.startswith("| "):
            current.append(line)
        elif current:
            tables, current = [*tables, current], []
    return tables


def test_the_readmes_design_power_is_the_results_pages_own():
    """The README's design-time power and seeds needed, for each planned contrast and study, are those its results
    page prints beside the verdict (from the pilot, before the confirmatory runs)."""
    on_page = re.compile(r"^- (.+?) \((?:superiority|equivalence)[^)]*\):.*; design \(pilot seeds [^)]*\): .*power "
                         r"([0-9.]+) at (\d+) seeds; 80% power needs (.+?) seeds \(95% interval of the pilot: (.+?)\)\.$")
    design = {study: {m.group(1): m.groups()[1:] for line in page.read_text().splitlines()
                      if (m := on_page.match(line))} for study, page in PAGES.items()}
    rows = _readme_tables()[1][2:]
    assert len(rows) == len(design["main job"]) == len(design["real model"]) == 4
    for row in rows:
        contrast, *cells = [cell.strip() for cell in row.strip("|").split("|")]
        contrast = contrast.split(" (", 1)[0]
        for study, cell in zip(PAGES, cells, strict=True):
            shown = re.fullmatch(r"([0-9.]+) at (\d+) seeds; needs (.+?) \((.+)\)", cell).groups()
            assert shown == design[study][contrast], (contrast, study, cell)


def test_the_readmes_amended_table_is_its_pages_own_numbers():
    """The README's table for the amended design (fresh seeds, τ real declared): each cell's verdict and interval is
    the primary's or the secondary's sentence in docs/results/amended.md's pasted block."""
    page = REPO / "docs" / "results" / "amended.md"
    block = page.read_text().split("<!-- summary.md of make", 1)[1].split("<!-- end of summary.md -->", 1)[0]
    primary = _planned_lines(page)
    secondary_part = block.split("Secondary endpoint (declared in", 1)[1].split("\n\n", 2)[1]
    secondary = {line[2:].split(" (", 1)[0]: line for line in secondary_part.splitlines() if line.startswith("- ")}
    rows = _readme_tables()[2][2:]
    assert len(rows) == len(primary) == len(secondary) == 4
    for row in rows:
        contrast, *cells = [cell.strip() for cell in row.strip("|").split("|")]
        contrast = contrast.split(" (", 1)[0]
        for lines, endpoint, cell in zip((primary, secondary), ("final_eval_loss", "final_eval_tau_real"), cells,
                                         strict=True):
            verdict, target = re.match(r"\[\*\*(.+?)\*\*\]\((.+?)\)", cell).groups()
            assert REPO / target == page, (contrast, target)
            line = lines[contrast]
            assert f"**{verdict}**" in line and cell.split(": ", 1)[1] in line.replace(f"{endpoint} ", ""), \
                (contrast, endpoint, cell)


def test_the_readmes_links_resolve():
    readme = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert len(targets) > 10
    for target in targets:
        assert (REPO / target).exists(), target


def test_the_plan_pages_python_block_runs_as_written(tmp_path):
    page = (REPO / "docs" / "commands" / "batchlab-plan.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert len(blocks) == 1
    (tmp_path / "block.py").write_text(blocks[0] + "\nprint(step, len(indices))\n")
    result = subprocess.run([sys.executable, "block.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-4000:]
    efficiency, last = result.stdout.strip().splitlines()[-2:]
    assert 0.9 < float(efficiency) <= 1.0
    step, samples = map(int, last.split())
    assert step >= 120 and samples > 0  # the loop resumed at step 120 and ran to the epoch's end
