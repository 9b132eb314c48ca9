# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv and install batchlab into it first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
# Where there is no CUDA, take the CPU build of torch (a bare `torch` pulls a multi-GB CUDA build).
CPU_TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.installed

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@# 1) a torch wheel already on this machine (pip's find-links), 2) the CPU index when there is
	@# no GPU, 3) PyPI's default (CUDA) build when there is one.
	$(PIP) install "torch==$(TORCH_VERSION)" --no-index \
	  || { command -v nvidia-smi >/dev/null 2>&1 && $(PIP) install "torch==$(TORCH_VERSION)"; } \
	  || $(PIP) install "torch==$(TORCH_VERSION)" --index-url $(CPU_TORCH_INDEX)
	$(PIP) install -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/batchlab-plan --profile chat-902k --max-tokens 16384 --world-size 8 --epochs 2 --report-dir outputs/plan-report

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/plan_speed.py --write
	$(PY) benchmarks/target_throughput.py --write

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
