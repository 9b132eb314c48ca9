"""batchlab-regenerate: prompts kept, completions are the target's greedy ones, cached, trainable."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from datasets import Dataset
from datasets.table import InMemoryTable

from harness.data import samples as samples_module
from harness.data.config import DataConfig
from harness.data.samples import TokenizedSamples, heldout_split, load_samples
from harness.cli.regenerate import build_parser
from harness.eval.regenerate import RegenerateSettings, regenerate
from harness.eval.speculative import greedy_decode
from harness.models.target import HybridTarget

TINY = Path(__file__).resolve().parents[3] / "conf" / "target" / "tiny.yaml"


def samples_of(ids: list[list[int]], masks: list[list[int]], fingerprint: str) -> TokenizedSamples:
    """In-memory samples of the given rows."""
    table = pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32())),
                      "loss_mask": pa.array(masks, type=pa.list_(pa.int8()))})
    dataset = Dataset(InMemoryTable(table))
    return TokenizedSamples(dataset, samples_module._lengths(dataset), "test rows", fingerprint)


@pytest.mark.parametrize("decoder", ["hf", "recompute"])
def test_regenerated_dataset(tmp_path, decoder):
    ids = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17, 18, 19, 20, 21], [22, 23, 24]]
    masks = [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1], [0, 1, 1]]
    samples = samples_of(ids, masks, "1" * 64)
    torch.manual_seed(0)
    target = HybridTarget(TINY)
    data = DataConfig(source="stdlib", cache_dir=str(tmp_path))
    settings = RegenerateSettings(max_new_tokens=3)
    path, meta, built = regenerate(data, TINY, settings, batch_size=3, progress=False, samples=samples, target=target,
                                   decoder=decoder)
    assert built and meta["rows"] == 4 and meta["rows_copied_without_prompt"] == 1
    again, _, built_again = regenerate(data, TINY, settings, batch_size=3, progress=False, samples=samples,
                                       target=target, decoder=decoder)
    assert again == path and not built_again  # cached
    loaded = load_samples(DataConfig(source=str(path), cache_dir=str(tmp_path)), progress=False)
    rows = loaded.samples(range(4))
    for (new_ids, new_mask), old_ids, old_mask in zip(rows, ids, masks):
        cut = old_mask.index(1)
        if cut == 0:  # no prompt: copied unchanged
            assert new_ids.tolist() == old_ids and new_mask.tolist() == [bool(m) for m in old_mask]
            continue
        completion_length = min(len(old_ids) - cut, 3)
        assert new_ids[:cut].tolist() == old_ids[:cut]
        assert new_ids[cut:].tolist() == greedy_decode(target, old_ids[:cut], completion_length)
        assert new_mask.tolist() == [False] * cut + [True] * completion_length
    # same row count: the held-out split holds out the same rows
    cfg = DataConfig()
    assert np.array_equal(heldout_split(len(loaded), cfg)[1], heldout_split(len(samples), cfg)[1])
    sampled, _, _ = regenerate(data, TINY, RegenerateSettings(max_new_tokens=3, temperature=1.0), progress=False,
                               samples=samples, target=target, decoder=decoder)
    assert sampled != path  # other settings, another cache entry


def test_cli_parser_defaults():
    args = build_parser().parse_args(["--max-new-tokens", "8", "--temperature", "0.7"])
    assert args.max_new_tokens == 8 and args.temperature == 0.7 and args.source == "stdlib"


@pytest.mark.parametrize("decoder", ["hf", "recompute"])
def test_sampled_regeneration_draws_from_the_targets_tempered_distribution(decoder):
    """``--temperature T``: the first tokens of many copies of one prompt follow softmax(logits / T)
    (chi-square over the tokens expected 5+ times, at the 0.05% level); the draws repeat with the seed
    and change with another one."""
    from harness.eval.regenerate import decode_rows
    from harness.models.layout import TokenBatch

    torch.manual_seed(0)
    target = HybridTarget(TINY)
    prompt, draws, temperature = [5, 6, 7, 8], 4000, 0.7
    with torch.no_grad():
        hidden = target(TokenBatch.from_documents([torch.tensor(prompt)], "padded"),
                        tap_layer_ids=[target.num_layers - 1]).hidden_states[0][0, -1]
        probabilities = torch.softmax(target.lm_head(target.model.norm(hidden)).double() / temperature, dim=-1).numpy()
    settings = RegenerateSettings(max_new_tokens=1, temperature=temperature, seed=3)
    tokens = [row[0] for row in decode_rows(target, [prompt] * draws, [1] * draws, settings, batch_size=draws,
                                            decoder=decoder)]
    observed = np.bincount(tokens, minlength=probabilities.size).astype(np.float64)
    expected = draws * probabilities
    bins = expected >= 5
    observed = np.append(observed[bins], observed[~bins].sum())
    expected = np.append(expected[bins], expected[~bins].sum())
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    dof = observed.size - 1
    critical = dof * (1 - 2 / (9 * dof) + 3.29 * math.sqrt(2 / (9 * dof))) ** 3  # Wilson-Hilferty, p = 0.0005
    greedy = int(np.argmax(probabilities))
    assert chi_square < critical, (chi_square, critical, dof)
    assert 0 < tokens.count(greedy) < draws  # sampled, not greedy
    again = decode_rows(target, [prompt] * 50, [4] * 50, settings, batch_size=50, decoder=decoder)
    assert again == decode_rows(target, [prompt] * 50, [4] * 50, settings, batch_size=50, decoder=decoder)
    other = RegenerateSettings(max_new_tokens=1, temperature=temperature, seed=4)
    assert again != decode_rows(target, [prompt] * 50, [4] * 50, other, batch_size=50, decoder=decoder)


@pytest.mark.parametrize("decoder", ["hf", "recompute"])
def test_every_assistant_turn_is_regenerated_given_the_regenerated_turns_before_it(tmp_path, decoder):
    """A conversation's assistant turns (supervised spans) are regenerated first to last: turn 2 continues the
    row as it now reads (prompt, regenerated turn 1, the user's turn 2), each stops at the end-of-turn token,
    the user's turns and the closing tokens stay, and only the replies are supervised."""
    eos = 3
    ids = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24]]
    masks = [[0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    samples = samples_of(ids, masks, "2" * 64)
    torch.manual_seed(0)
    target = HybridTarget(TINY)
    settings = RegenerateSettings(max_new_tokens=8, eos_id=eos)
    path, meta, _ = regenerate(DataConfig(source="stdlib", cache_dir=str(tmp_path)), TINY, settings, progress=False,
                               samples=samples, target=target, decoder=decoder)
    assert meta["turns_regenerated"] == 3
    (row_ids, row_mask), (single_ids, single_mask) = load_samples(
        DataConfig(source=str(path), cache_dir=str(tmp_path)), progress=False).samples(range(2))
    row_ids, row_mask = row_ids.tolist(), [int(m) for m in row_mask]

    def turn(prefix, length):
        tokens = greedy_decode(target, prefix, length)
        return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens

    first = turn([5, 6], 3)
    second = turn([5, 6, *first, 10, 11, 12], 3)
    assert row_ids == [5, 6, *first, 10, 11, 12, *second, 16]
    assert row_mask == [0, 0] + [1] * len(first) + [0, 0, 0] + [1] * len(second) + [0]
    assert single_ids.tolist() == [20, 21, *turn([20, 21], 3)]  # one completion: the prompt and the reply
