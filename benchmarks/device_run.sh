#!/usr/bin/env bash
# The one command for a lent GPU machine: benchmarks/gpu_check.sh with what benchmarks/device_kit.py gathered
# into .device/ (its wheels installed into /tmp/batchlab-site, the training steps on its copy of the default
# run's data, so that nothing is built there), results packed as they come.
#
#   python benchmarks/device_kit.py          # here first
#   bash benchmarks/device_run.sh            # there, carrying .device; BUDGET, STEPS, TWO_RANK_TOKENS as in gpu_check.sh
#
# Leaves gpu-check.tar.gz (every log, JSON, markdown and RESULTS.md with the rewritten sections) and summary.txt
# in $OUT (the device tool's folder of returned files), else in ./gpu-check-out.
set -uo pipefail
cd "$(dirname "$0")/.."
kit="${KIT:-$PWD/.device}"  # KIT: another kit folder (tests)
if [ ! -d "$kit/wheels" ]; then
  echo "device_run: no $kit/wheels: run python benchmarks/device_kit.py here first, and carry .device" >&2
  exit 2
fi
destination="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$destination"
work=/tmp/gpu-check
rm -rf "$work"
run_set=""
if [ -d "$kit/data" ]; then
  run_set="data.source=$kit/data"
fi
RUN_SET="$run_set" WHEELS="$kit/wheels" PACK_TO="$destination/gpu-check.tar.gz" bash benchmarks/gpu_check.sh "$work"
status=$?
cp "$work/summary.txt" "$destination/summary.txt" 2>/dev/null
echo "--- summary.txt"
cat "$work/summary.txt" 2>/dev/null
exit $status
