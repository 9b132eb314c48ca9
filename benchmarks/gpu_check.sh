#!/usr/bin/env bash
# GPU checks on a CUDA machine that already has torch, triton and transformers, as named steps run in
# order within one time budget, so that a lease of a few minutes returns what matters first:
#
#   two_rank    two short training runs on 2 ranks (2 GPUs; skipped, and said so, with fewer): colocated (each
#               rank target + drafter, DDP over both) and disaggregated 1+1 (a target rank feeding a drafter
#               rank, grad_accum 2), each with gradient statistics and an eval at its end
#   drafter     the drafter's training step per attention path (flex, sdpa, dense): tokens/s, peak memory
#   advise      batchlab-advise's predictions against real runs (tiny configs, 1 GPU)
#   advise8     the 8-GPU reference shape (one period of layers) predicted from this GPU's calibration
#   tests       the GPU tests: fla vs the PyTorch reference, packed vs separate on CUDA, the drafter's
#               FlexAttention path vs its dense one, batchlab-check on the GPU
#   check       batchlab-check in fp32, TF32 and bf16
#   throughput  the target's forward per layout, one 27B-shaped period in bf16
#   train       a 200-step bf16 training run of the default packed run (fla kernels, flex drafter)
#   reference   the reference run's shape shrunk to one period of layers, colocated on this GPU
#
#   bash benchmarks/gpu_check.sh [OUT]                   # every step, in the order above
#   STEPS="check train" bash benchmarks/gpu_check.sh     # some steps, in the order given
#
# Results land in OUT (default ./gpu-check): a log per step, JSON and markdown, summary.txt (a line per step,
# what it measured) and RESULTS.md (benchmarks/RESULTS.md with the sections the steps rewrote).
# BUDGET (seconds, default 520: the device tool's 600 s a call, less the install, a killed step's 20 s of grace
# and the packing) bounds the whole script: each step gets its own limit or what is left of the budget, whichever
# is less (then SIGTERM, SIGKILL 20 s later), and a step with under a minute left is skipped and named in
# summary.txt (run it in a second call: STEPS="the skipped ones").
# PACK_TO=FILE: OUT packed into FILE (tar.gz) after every step, so that a run cut short still returns its results.
# RUN_SET="KEY=VALUE ...": batchlab-train overrides for the steps that train (benchmarks/device_run.sh points
# them at the carried copy of the default run's data, so that nothing is built on the GPU machine).
# TWO_RANK_TOKENS: the real tokens each of two_rank's runs trains on (default 200000; the CPU test shrinks it).
#
# Where hydra-core or datasets is missing, the training steps are skipped, and said so; flash-linear-attention
# is needed for the fla paths. With no network, put their wheels in a folder and set WHEELS=that/folder
# (benchmarks/device_kit.py makes .device/wheels; benchmarks/device_run.sh installs them and calls this).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
budget="${BUDGET:-520}"
# DEVICE=cpu rehearses the script where there is no GPU (every step on the CPU, cut by its limit, nothing written
# into benchmarks/RESULTS.md): what fails there for another reason than time would fail on the GPU too
device="${DEVICE:-cuda}"
write=""
if [ "$device" = cuda ]; then write="--write"; fi
steps="${STEPS:-two_rank drafter advise advise8 tests check throughput train reference}"
read -r -a run_set <<< "${RUN_SET:-}"
started=$SECONDS
if [ -n "${WHEELS:-}" ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/batchlab-site \
    "$WHEELS"/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/batchlab-site"
fi
"$py" - <<'PY' | tee "$out/env.txt"
import importlib
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("transformers", "triton", "fla", "hydra", "datasets", "pyarrow"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as err:  # noqa: BLE001 - report whatever stops the import
        print(f"{name} missing: {type(err).__name__}: {err}")
PY
can_train=1
"$py" -c "import hydra, datasets, tokenizers" 2>/dev/null || can_train=0
status=0
note() { echo "[$(date +%T) +$((SECONDS - started))s] $*" | tee -a "$out/summary.txt"; }
# (with RESULTS.md as the steps left it; checkpoints stay out: the reference shape's drafter with its AdamW state
# is tens of GB, and the device tool returns files of at most 16 MiB)
pack() {
  cp benchmarks/RESULTS.md "$out/RESULTS.md"
  if [ -n "${PACK_TO:-}" ]; then
    tar czf "$PACK_TO" --exclude=checkpoints -C "$(dirname "$out")" "$(basename "$out")" 2>/dev/null
    if [ "$(stat -c %s "$PACK_TO")" -gt $((15 * 1024 * 1024)) ]; then
      note "$PACK_TO is over 15 MiB: it may not come back from the GPU machine"
    fi
  fi
}
# limit OWN: this step's limit in seconds, what is left of the budget when that is less; 0 when under a minute is left
limit() {
  local left=$((budget - (SECONDS - started)))
  if [ "$left" -lt 60 ]; then echo 0; elif [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}
# summarize FILE PYTHON: the step's line(s) for summary.txt from a JSON or markdown result
summarize() { "$py" - "$@" 2>&1 | tee -a "$out/summary.txt"; }
# summarize_run LABEL RUN_DIR LOG: a training run's line from its summary.json (or where to look when it has none)
summarize_run() {
  summarize "$2/summary.json" "$1" "$3" <<'PY'
import json, sys
path, label, log = sys.argv[1:]
try:
    s = json.load(open(path))
    held_out = "" if s.get("eval_loss") is None else f", held-out loss {s['eval_loss']:.4f}, tau {s['eval_tau']:.3f}"
    print(f"{label}, {s['status']}: {s['steps']} steps, {s['tokens_per_second']:.0f} real tok/s, peak "
          f"{s['peak_memory_mb']:.0f} MB, padding {s['padding_ratio']:.3f}, final loss {s['final_loss']:.4f}{held_out}")
except (OSError, ValueError, KeyError) as err:
    print(f"{label}: did not finish ({err}); see {log}")
PY
}

step_tests() {
  timeout -k 20 "$1" "$py" -m pytest -q -m gpu tests/harness/models/test_gpu_kernels.py tests/harness/models/test_target_packing.py \
    tests/harness/models/test_drafter_packing.py tests/harness/cli/test_check_cli.py 2>&1 | tee "$out/gpu_tests.log" | tail -3
}

step_check() {
  local variant name each=$(($1 / 3)) ok=0 rc
  for variant in "--dtype float32" "--dtype float32 --tf32" "--dtype bfloat16"; do
    name=$(echo "$variant" | tr -d ' -')
    timeout -k 20 "$each" "$py" -m harness.cli.check --device "$device" $variant --json > "$out/check_$name.json" \
      2> "$out/check_$name.err"
    rc=$?
    if [ "$rc" = 124 ]; then ok=124; elif [ "$rc" != 0 ] && [ "$ok" = 0 ]; then ok=1; fi
    summarize "$out/check_$name.json" "$variant" <<'PY'
import json, sys
try:
    verdict = "ok" if json.load(open(sys.argv[1]))["ok"] else "NOT ok"
except (OSError, ValueError, KeyError):
    verdict = "did not run (see the .err file)"
print(f"batchlab-check {sys.argv[2]}: {verdict}")
PY
  done
  return $ok
}

step_throughput() {
  timeout -k 20 "$1" "$py" benchmarks/target_throughput.py --device "$device" --dtype bfloat16 \
    --config conf/target/qwen3.6-27b.yaml --layers 4 --scale 1 --tokens 131072 --max-tokens 16384 --repeats 3 \
    > "$out/throughput_cuda.md" 2>&1
  local rc=$?
  tail -4 "$out/throughput_cuda.md" | tee -a "$out/summary.txt"
  return $rc
}

step_drafter() {
  timeout -k 20 "$1" "$py" benchmarks/drafter_step.py --device "$device" --rounds 2 --steps 3 $write \
    > "$out/drafter_step_cuda.md" 2>&1
  local rc=$?
  grep -E "^\| (demo|large)|failed" "$out/drafter_step_cuda.md" | tee -a "$out/summary.txt"
  return $rc
}

step_train() {
  timeout -k 20 "$1" "$py" -m harness.cli.train strategy=packed "trainer.device=$device" trainer.precision=bf16 \
    trainer.stop_tokens=400000 eval.every_tokens=200000 loader.num_workers=2 logger=none \
    trainer.progress=false "${run_set[@]}" "hydra.run.dir=$out/train-bf16" > "$out/train_bf16.log" 2>&1
  local rc=$?
  summarize_run "bf16 training" "$out/train-bf16" train_bf16.log
  return $rc
}

# The reference run's shape (experiment=reference_8gpu: 27B-class target, 5-layer drafter, block 16,
# max_tokens 16384) shrunk to one period of layers (3 GDN + 1 attention), colocated on this one GPU.
step_reference() {
  timeout -k 20 "$1" "$py" -m harness.cli.train experiment=reference_8gpu topology=colocated trainer.nproc=1 \
    "trainer.device=$device" target.num_hidden_layers=4 trainer.stop_tokens=150000 eval.every_tokens=150000 \
    eval.real_prompts=0 loader.num_workers=2 logger=none trainer.progress=false \
    "${run_set[@]}" "hydra.run.dir=$out/reference-1gpu" > "$out/reference_1gpu.log" 2>&1
  local rc=$?
  rm -rf "$out/reference-1gpu/checkpoints"  # its final checkpoint: tens of GB of the machine's disk
  summarize_run "reference shape, one period" "$out/reference-1gpu" reference_1gpu.log
  return $rc
}

# Two ranks (on CUDA one a GPU, NCCL, bf16; on the CPU gloo ranks, fp32): the default packed run colocated (each
# rank target + drafter, DDP over both) and disaggregated 1+1 (a target rank sends its features to a drafter rank,
# 2 micro-batches a step), TWO_RANK_TOKENS each, gradient statistics every 2nd step, the eval at the end. The two
# share the step's limit: the first gets half of it, the second what is left.
step_two_rank() {
  local tokens="${TWO_RANK_TOKENS:-200000}" began=$SECONDS colocated disaggregated
  local two_rank_env=() two_rank_set=(strategy=packed "trainer.device=$device" trainer.nproc=2
    "trainer.stop_tokens=$tokens" "eval.every_tokens=$tokens" grad_stats.every=2 loader.num_workers=2
    logger=none trainer.progress=false)
  if [ "$device" = cuda ]; then
    two_rank_env=(NCCL_DEBUG=WARN)  # a failing collective says why in the run's log
    two_rank_set+=(trainer.precision=bf16)
  fi
  two_rank_run colocated $(($1 / 2)) "two ranks colocated" topology=colocated
  colocated=$?
  local left=$(($1 - (SECONDS - began)))
  two_rank_run disaggregated $((left > 1 ? left : 1)) "two ranks disaggregated 1+1" topology=disaggregated \
    topology.target_ranks=1 topology.drafter_ranks=1 trainer.grad_accum=2
  disaggregated=$?
  if [ "$colocated" = 124 ] || [ "$disaggregated" = 124 ]; then return 124; fi
  [ "$colocated" = 0 ] && [ "$disaggregated" = 0 ]
}

# two_rank_run NAME SECONDS LABEL OVERRIDE...: one of two_rank's runs (with step_two_rank's two_rank_env and
# two_rank_set) in OUT/two-rank-NAME, its log OUT/two_rank_NAME.log, its line in summary.txt; its exit status, 124
# when its limit stopped it
two_rank_run() {
  local name=$1 seconds=$2 label=$3 began=$SECONDS rc
  shift 3
  timeout -k 20 "$seconds" env "${two_rank_env[@]}" "$py" -m harness.cli.train "${two_rank_set[@]}" "$@" \
    "${run_set[@]}" "hydra.run.dir=$out/two-rank-$name" > "$out/two_rank_$name.log" 2>&1
  rc=$?
  if [ "$rc" = 137 ] && [ $((SECONDS - began)) -ge "$seconds" ]; then rc=124; fi  # killed 20 s after the SIGTERM
  summarize_run "$label" "$out/two-rank-$name" "two_rank_$name.log"
  return $rc
}

# batchlab-advise on the GPU: its predictions against real runs (tiny configs, 1 GPU; two rounds, so that the
# ranking is judged only on pairs the round-to-round spread separates)
step_advise() {
  local sets=() kv
  for kv in "${run_set[@]}"; do sets+=(--set "$kv"); done
  timeout -k 20 "$1" "$py" benchmarks/advise_accuracy.py --device "$device" --nproc 1 --rounds 2 --tokens 200000 $write \
    --set eval.real_prompts=0 "${sets[@]}" > "$out/advise_accuracy_cuda.md" 2>&1
  local rc=$?
  grep -E "^\| [a-z_]+ \||worst error|ranking" "$out/advise_accuracy_cuda.md" | tee -a "$out/summary.txt"
  return $rc
}

# the 8-GPU reference shape predicted from this one GPU's calibration (one period of the 27B-class target's layers)
step_advise8() {
  timeout -k 20 "$1" "$py" -m harness.cli.advise --experiment reference_8gpu --set target.num_hidden_layers=4 \
    --device "$device" --dtype bf16 --profile chat-902k --max-tokens 16384 --world-size 8 --tokens 2e9 \
    --cache-dir "$out/cache" --report-dir "$out/advise-8gpu" > "$out/advise_8gpu.txt" 2>&1
  local rc=$?
  tail -12 "$out/advise_8gpu.txt" | tee -a "$out/summary.txt"
  return $rc
}

# the CUDA devices torch sees (0 when it cannot say)
gpu_count() {
  local count
  count=$("$py" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null | tail -1)
  if [[ "$count" =~ ^[0-9]+$ ]]; then echo "$count"; else echo 0; fi
}

declare -A own_limit=([two_rank]=150 [drafter]=200 [advise]=200 [advise8]=150 [tests]=150 [check]=240
                      [throughput]=150 [train]=180 [reference]=180)
declare -A trains=([two_rank]=1 [advise]=1 [advise8]=1 [train]=1 [reference]=1)
for name in $steps; do
  if [ -z "${own_limit[$name]:-}" ]; then
    note "unknown step '$name' (steps: ${!own_limit[*]})"; status=1; continue
  fi
  if [ "$name" = two_rank ] && [ "$device" = cuda ]; then
    gpus=$(gpu_count)
    if [ "$gpus" -lt 2 ]; then  # one rank a GPU: NCCL refuses two ranks on one device
      note "two_rank: skipped, $gpus GPU$([ "$gpus" = 1 ] || echo s) here (needs 2)"; continue
    fi
  fi
  if [ -n "${trains[$name]:-}" ] && [ "$can_train" = 0 ]; then
    note "$name: skipped, hydra-core, datasets or tokenizers is not installed here (carry their wheels: WHEELS)"
    status=1; continue
  fi
  seconds=$(limit "${own_limit[$name]}")
  if [ "$seconds" = 0 ]; then
    note "$name: skipped, the budget of $budget s is spent (run it again with STEPS=\"$name\")"; status=1; continue
  fi
  note "$name (limit $seconds s)"
  step_began=$SECONDS
  "step_$name" "$seconds"
  rc=$?
  [ "$rc" = 0 ] || status=1
  note "$name: exit $rc$([ "$rc" = 124 ] && echo ' (its time limit)') after $((SECONDS - step_began)) s"
  pack
done
note "done, status $status"
pack
exit $status
