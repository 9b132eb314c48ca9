#!/usr/bin/env bash
# GPU checks of the models on a CUDA machine that already has torch, triton and transformers:
# the GPU tests (fla vs the PyTorch reference, packed vs separate on CUDA, the drafter's FlexAttention
# path vs its dense one), batchlab-check in fp32, TF32 and bf16, the target's forward throughput
# per layout in bf16, the drafter's training step per attention path, a 200-step bf16 training run and
# the reference run's shape shrunk to one period
# of layers (when hydra-core and datasets are there). Results land in OUT (default ./gpu-check) as logs, JSON and markdown.
#
#   bash benchmarks/gpu_check.sh [OUT]
#
# flash-linear-attention is needed for the fla paths; with no network, put its wheels (and any
# missing dependency) in a folder and set WHEELS=that/folder (default: .whl when it exists), e.g.
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 -d .whl flash-linear-attention fla-core
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
if [ -z "${WHEELS:-}" ] && [ -d .whl ]; then WHEELS=.whl; fi
if [ -n "${WHEELS:-}" ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/batchlab-site \
    "$WHEELS"/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/batchlab-site"
fi
"$py" - <<'PY' | tee "$out/env.txt"
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
print("transformers", transformers.__version__)
try:
    import fla
    print("fla", fla.__version__)
except Exception as err:  # noqa: BLE001 - report whatever stops the import
    print("fla missing:", err)
PY
# Each step has its own time limit (seconds: STEP_LIMIT, default 240 for the tests, 120 per check,
# 180 for the throughput), so that a hang in one still leaves the others' results in OUT.
limit="${STEP_LIMIT:-}"
status=0
step() { echo "[$(date +%T)] $*" | tee -a "$out/summary.txt"; }
step "GPU tests"
timeout "${limit:-240}" "$py" -m pytest -q -m gpu tests/test_gpu_kernels.py tests/test_target_packing.py tests/test_drafter_packing.py \
  tests/test_check_cli.py 2>&1 | tee "$out/gpu_tests.log" || status=1
for variant in "--dtype float32" "--dtype float32 --tf32" "--dtype bfloat16"; do
  name=$(echo "$variant" | tr -d ' -' )
  step "batchlab-check $variant"
  timeout "${limit:-120}" "$py" -m harness.cli.check --device cuda $variant --json > "$out/check_$name.json" 2> "$out/check_$name.err" || status=1
  "$py" - "$out/check_$name.json" "$variant" <<'PY' | tee -a "$out/summary.txt"
import json, sys
try:
    verdict = "ok" if json.load(open(sys.argv[1]))["ok"] else "NOT ok"
except (OSError, ValueError, KeyError):
    verdict = "did not run (see the .err file)"
print(f"batchlab-check {sys.argv[2]}: {verdict}")
PY
done
# Forward throughput of one 27B-shaped period (3 x GDN + 1 x attention) in bf16, layouts side by side.
step "target throughput"
timeout "${limit:-180}" "$py" benchmarks/target_throughput.py --device cuda --dtype bfloat16 \
  --config conf/target/qwen3.6-27b.yaml --layers 4 --scale 1 --tokens 131072 --max-tokens 16384 --repeats 3 \
  > "$out/throughput_cuda.md" 2>&1 || status=1
tail -4 "$out/throughput_cuda.md" | tee -a "$out/summary.txt"
# The drafter's training step per attention path on the GPU (flex, the CUDA default, against sdpa and the
# dense reference): tokens/s and peak allocated memory at the demo shape, 10 documents and one 8K document.
step "drafter step per attention path (CUDA)"
timeout "${limit:-300}" "$py" benchmarks/drafter_step.py --device cuda --rounds 2 --steps 3 \
  > "$out/drafter_step_cuda.md" 2>&1 || status=1
grep -E "^\| (demo|large)" "$out/drafter_step_cuda.md" | tee -a "$out/summary.txt"
# A short bf16 training run (fla kernels, flex drafter, 1 GPU): 200 optimizer steps of the default packed run.
step "bf16 training run (200 steps)"
if "$py" -c "import hydra, datasets, tokenizers, wandb" 2>/dev/null; then
  timeout "${limit:-300}" "$py" -m harness.cli.train strategy=packed trainer.device=cuda trainer.precision=bf16 \
    trainer.stop_tokens=400000 trainer.eval_every_tokens=200000 trainer.num_workers=2 logger=none \
    trainer.progress=false "hydra.run.dir=$out/train-bf16" > "$out/train_bf16.log" 2>&1 || status=1
  "$py" - "$out/train-bf16/summary.json" <<'PY' | tee -a "$out/summary.txt"
import json, sys
try:
    s = json.load(open(sys.argv[1]))
    print(f"bf16 training: {s['steps']} steps, {s['tokens_per_second']:.0f} real tok/s, final loss "
          f"{s['final_loss']:.4f}, held-out loss {s['eval_loss']:.4f}, tau {s['eval_tau']:.3f}")
except (OSError, ValueError, KeyError) as err:
    print(f"bf16 training: did not finish ({err}); see train_bf16.log")
PY
  # The reference run's shape (experiment=reference_8gpu: 27B-class target, 5-layer drafter, block 16,
  # max_tokens 16384) shrunk to one period of layers (3 GDN + 1 attention), colocated on this one GPU.
  step "reference_8gpu shrunk to one period, 1 GPU, bf16"
  timeout "${limit:-300}" "$py" -m harness.cli.train experiment=reference_8gpu topology=colocated trainer.nproc=1 \
    target.num_hidden_layers=4 trainer.stop_tokens=150000 trainer.eval_every_tokens=150000 \
    trainer.eval_real_prompts=0 trainer.num_workers=2 logger=none trainer.progress=false \
    "hydra.run.dir=$out/reference-1gpu" > "$out/reference_1gpu.log" 2>&1 || status=1
  "$py" - "$out/reference-1gpu/summary.json" <<'PY' | tee -a "$out/summary.txt"
import json, sys
try:
    s = json.load(open(sys.argv[1]))
    print(f"reference shape, one period: {s['steps']} steps, {s['tokens_per_second']:.0f} real tok/s, "
          f"peak {s['peak_memory_mb']:.0f} MB, padding {s['padding_ratio']:.3f}, final loss {s['final_loss']:.4f}")
except (OSError, ValueError, KeyError) as err:
    print(f"reference shape: did not finish ({err}); see reference_1gpu.log")
PY
  # batchlab-advise on the GPU: its predictions against real runs (tiny configs, 1 GPU), then the 8-GPU reference
  # shape predicted from this one GPU's calibration (one period of the 27B-class target's layers, bf16)
  step "batchlab-advise: predicted against measured, 1 GPU"
  timeout "${limit:-300}" "$py" benchmarks/advise_accuracy.py --device cuda --nproc 1 --rounds 1 --tokens 400000 \
    > "$out/advise_accuracy_cuda.md" 2>&1 || status=1
  grep -E "^\| [a-z_]+ \||worst error|ranking" "$out/advise_accuracy_cuda.md" | tee -a "$out/summary.txt"
  step "batchlab-advise: 8 GPUs of the reference shape (one period of layers) predicted from this GPU"
  timeout "${limit:-300}" "$py" -m harness.cli.advise --experiment reference_8gpu --set target.num_hidden_layers=4 \
    --device cuda --dtype bf16 --profile chat-902k --max-tokens 16384 --world-size 8 --tokens 2e9 \
    --cache-dir "$out/cache" --report-dir "$out/advise-8gpu" > "$out/advise_8gpu.txt" 2>&1 || status=1
  tail -12 "$out/advise_8gpu.txt" | tee -a "$out/summary.txt"
else
  echo "bf16 training runs skipped: hydra-core, datasets, tokenizers or wandb is not installed here (carry their wheels in WHEELS)" | tee -a "$out/summary.txt"
fi
step "done, status $status"
exit $status
