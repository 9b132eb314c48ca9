"""``batchlab-check`` in-process: passes on exact packing, fails (exit 1) when packing leaks."""

import json
import math

import pytest
import torch

from harness.models import packing_check as check
from harness.cli.check import main
from harness.models import compare

SMALL = ["--lengths", "1,17,65,70", "--seed", "3"]



def run_json(capsys, *argv):
    status = main(["--json", "--device", "cpu", *SMALL, *argv])
    return status, json.loads(capsys.readouterr().out)


def test_exact_packing_passes_with_every_row(capsys):
    status, report = run_json(capsys)
    assert status == 0 and report["ok"] is True
    assert report["document_lengths"] == [1, 17, 65, 70] and report["blocks"] > 0
    rows = {(c["name"], c["comparison"]): c for c in report["checks"]}
    for layout in ("padded", "packed"):
        comparison = f"{layout} vs separate"
        for name in ("target layer 1 (linear_attention)", "target layer 2 (full_attention)",
                     "drafter loss (sum w*CE, sum w)", "drafter gradients"):
            row = rows[(name, comparison)]
            assert row["ok"] and 0 <= row["max_rel_diff"] <= 1e-5 and row["tolerance"] == 1e-4
    assert len(report["checks"]) == 8
    assert any("fla vs torch-chunk skipped" in note for note in report["notes"])


def test_a_leaking_target_fails_with_exit_status_1(capsys):
    status, report = run_json(capsys, "--negative-control")
    assert status == 1 and report["ok"] is False
    failed = {(c["name"], c["comparison"]) for c in report["checks"] if not c["ok"]}
    assert ("target layer 1 (linear_attention)", "packed vs separate") in failed
    assert ("drafter gradients", "packed vs separate") in failed
    assert all(comparison == "packed vs separate" for _, comparison in failed)


def test_the_table_names_the_verdict(capsys):
    assert main(["--device", "cpu", "--lengths", "1,9", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "max rel diff" in out and "drafter gradients" in out
    assert out.rstrip().endswith("ok: every difference within tolerance")


def test_a_non_finite_difference_fails_and_the_json_stays_strict(capsys, monkeypatch):
    for value in (math.nan, math.inf):
        row = check.CheckRow("drafter loss (sum w*CE, sum w)", "packed vs separate", value, 1e-4)
        assert not row.ok and row.to_dict()["max_rel_diff"] is None
    # NaN in the difference of every check (e.g. a model that overflows): not ok, exit 1, strict JSON
    monkeypatch.setattr(compare, "max_relative_difference", lambda value, reference: math.nan)
    status = main(["--json", "--device", "cpu", "--lengths", "1,9"])
    report = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
    assert status == 1 and report["ok"] is False
    assert all(c["max_rel_diff"] is None and not c["ok"] for c in report["checks"])
    assert main(["--device", "cpu", "--lengths", "1,9"]) == 1
    table = capsys.readouterr().out
    assert "not finite" in table and table.rstrip().endswith("NOT OK: 8 of 8 checks exceed their tolerance")


def test_documents_without_anchors_are_named(capsys):
    status, report = run_json(capsys, "--lengths", "1,1")
    assert status == 0 and report["blocks"] == 0
    assert any("no document has an anchor" in note for note in report["notes"])


def test_bad_input_exits_2_with_the_value(capsys):
    assert main(["--lengths", "5,0"]) == 2
    assert "--lengths '5,0'" in capsys.readouterr().err
    assert main(["--drafter", "conf/drafter/missing.yaml", "--device", "cpu"]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    assert main(["--dtype", "float16"]) == 2  # argparse choices
    assert main(["--device", "gpu0"]) == 2
    assert "--device 'gpu0' is not a device" in capsys.readouterr().err
    assert main(["--tf32", "--device", "cpu"]) == 2
    assert "--tf32 needs --device cuda" in capsys.readouterr().err


def test_fla_rows_compare_two_backends(monkeypatch):
    # No GPU here: stand fla in with the recurrent oracle to exercise the comparison end to end.
    from harness.models import target as target_module
    from harness.models.gdn import gated_delta
    from harness.models.drafter import DFlashDrafter, load_drafter_config
    from harness.models.layout import TokenBatch
    from harness.models.target import HybridTarget

    real_rule = gated_delta.gated_delta_rule

    def rule_with_fla_standin(*args, backend="auto", **kwargs):
        return real_rule(*args, backend="torch-recurrent" if backend == "fla" else backend, **kwargs)

    monkeypatch.setattr(gated_delta, "gated_delta_rule", rule_with_fla_standin)
    monkeypatch.setattr(target_module, "gated_delta_rule", rule_with_fla_standin)
    torch.manual_seed(0)
    config = load_drafter_config("conf/drafter/tiny.yaml")
    target = HybridTarget("conf/target/tiny.yaml", tap_layer_ids=config.target_layer_ids)
    drafter = DFlashDrafter.from_target(target, config)
    lengths = [1, 20, 70]
    packed = TokenBatch.from_documents([torch.randint(0, 256, (n,)) for n in lengths], "packed")
    rows = check._fla_rows(target, drafter, packed, lengths, tolerance=2e-3, seed=0)
    assert [row.comparison for row in rows] == ["fla vs torch-chunk"] * 2 + ["packed fla vs torch-chunk"] * 2
    assert all(row.ok and row.max_rel_diff < 1e-4 for row in rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_check_passes_on_the_gpu(capsys, dtype):
    status = main(["--json", "--device", "cuda", "--dtype", dtype])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["ok"] is True, [c for c in report["checks"] if not c["ok"]]


def _write_checkpoint(directory, seed=0, drop=None):
    """A local checkpoint of the tiny target (config.json + model.safetensors), as transformers writes one."""
    from safetensors.torch import save_file

    from harness.models.target import HybridTarget

    torch.manual_seed(seed)
    target = HybridTarget(check.REPO_ROOT / "conf" / "target" / "tiny.yaml")
    state = {name: tensor.contiguous() for name, tensor in target.state_dict().items() if name != drop}
    save_file(state, str(directory / "model.safetensors"))
    target.config.save_pretrained(directory)
    return target


def test_a_checkpoint_directory_is_checked_with_its_own_weights(capsys, tmp_path, monkeypatch):
    from harness.models.target import HybridTarget

    saved = _write_checkpoint(tmp_path, seed=11)
    loaded = []
    original = HybridTarget.from_pretrained.__func__

    def recording(cls, *args, **kwargs):
        loaded.append(original(cls, *args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(HybridTarget, "from_pretrained", classmethod(recording))
    status, report = run_json(capsys, "--target", str(tmp_path))
    assert status == 0 and report["ok"] is True
    assert report["target_weights"] == f"checkpoint {tmp_path}"
    assert len(loaded) == 1 and torch.equal(loaded[0].lm_head.weight, saved.lm_head.weight)

    status, report = run_json(capsys, "--target", str(tmp_path), "--random-weights")
    assert status == 0 and report["target_weights"] == "random (seed 3)" and len(loaded) == 1


def test_a_checkpoint_with_missing_weights_is_bad_input(capsys, tmp_path):
    _write_checkpoint(tmp_path, drop="lm_head.weight")
    status = main(["--json", "--device", "cpu", *SMALL, "--target", str(tmp_path)])
    assert status == 2
    assert "missing ['lm_head.weight']" in capsys.readouterr().err


def test_batchlab_check_compares_a_llama_targets_layouts_and_refuses_an_encoder_in_one_line(capsys, tmp_path):
    """batchlab-check and batchlab-train used to read a Llama's config as a broken Qwen3.5 target: a Llama is a
    target now (any transformers causal LM; its padded and packed rows checked against each document alone), and
    an encoder is refused in one line, exit 2, naming what it is, before a run writes anything."""
    import transformers

    from harness.train.config import compose_run_config
    from harness.train.launch.run import BadInput, prepared_config

    for name in ("Llama", "Qwen2"):  # two architectures, nothing of either named in the code
        small = getattr(transformers, f"{name}Config")(hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                                                       num_key_value_heads=2, intermediate_size=64, vocab_size=300)
        torch.manual_seed(0)
        getattr(transformers, f"{name}ForCausalLM")(small).save_pretrained(tmp_path / name)
        capsys.readouterr()
        assert main(["--json", "--device", "cpu", *SMALL, "--target", str(tmp_path / name)]) == 0, name
        report = json.loads(capsys.readouterr().out)
        assert report["ok"] and report["target_weights"] == f"checkpoint {tmp_path / name}"
        assert {row["comparison"] for row in report["checks"]} == {"padded vs separate", "packed vs separate"}
        assert sum(row["name"].startswith("target layer ") for row in report["checks"]) == 2 * 2  # 2 taps, 2 layouts
        assert "fla vs torch-chunk skipped: the target has no Gated DeltaNet layers" in report["notes"]
    assert main(["--device", "cpu", *SMALL, "--target", str(tmp_path / "Llama"), "--negative-control"]) == 2
    assert "is a causal LM without such layers" in capsys.readouterr().err

    bert = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                   vocab_size=300)
    bert.architectures = ["BertModel"]
    transformers.BertModel(bert).save_pretrained(tmp_path / "bert")
    capsys.readouterr()  # transformers' own bar while it saved
    kind = "'bert' checkpoint (BertModel), not a decoder-only causal LM"
    assert main(["--device", "cpu", *SMALL, "--target", str(tmp_path / "bert")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and kind in lines[0], lines
    with pytest.raises(BadInput, match=kind.replace("(", r"\(").replace(")", r"\)")):  # before a file is written
        prepared_config(compose_run_config([f"target.pretrained={tmp_path / 'bert'}", "logger=none"]))
    from support.train import train_cli  # the command itself: one line, exit 2, no run directory left behind

    refused = train_cli([f"target.pretrained={tmp_path / 'bert'}", "logger=none", "hydra.run.dir=runs/bert"],
                        cwd=tmp_path)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1 and kind in lines[0], refused.stderr[-2000:]
    assert not (tmp_path / "runs").exists()