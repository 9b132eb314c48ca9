"""The README's "Use the strategies in your own training" block runs as written and trains on packed batches."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from support.process import run_process

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_block(heading: str) -> str:
    section = README.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"the section {heading!r} should hold one python block"
    return blocks[0]


def test_the_readme_block_trains_a_causal_lm_with_the_trainer_on_packed_batches(tmp_path):
    block = readme_block("Use the strategies in your own training")
    assert 8 <= len(block.strip().splitlines()) <= 14  # about ten lines
    (tmp_path / "block.py").write_text(block)
    result = run_process([sys.executable, "block.py"], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    efficiency = float(result.stdout.strip().splitlines()[-1])
    assert 0.9 < efficiency <= 1.0  # packed rows are nearly full
    checkpoint = max((tmp_path / "outputs/hf-packed").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert (checkpoint / "batchlab_sampler.json").is_file()


def test_every_block_of_the_use_in_your_training_page_runs_as_written(tmp_path, monkeypatch):
    """docs/use-in-your-training.md's blocks, each run with the page's stated context: a small ``train``,
    ``epochs`` and ``model``."""
    import numpy as np
    import transformers

    page = README.parent / "docs" / "use-in-your-training.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    assert len(blocks) >= 2
    rng = np.random.default_rng(0)
    train = [{"input_ids": rng.integers(1, 128, n).tolist()} for n in rng.integers(8, 300, 64)]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        namespace = {"train": train, "epochs": 2, "model": model}
        exec(compile(block, str(page), "exec"), namespace)
    assert namespace["trainer"].state.global_step == namespace["trainer"].run_batches.steps > 0
