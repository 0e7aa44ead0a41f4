#!/usr/bin/env bash
# The GPU targets' measurements on one GPU machine, in phases of at most 10 minutes each:
#
#   bench/acceptance.sh GPUS BUNDLES OUT tests   # tests/gpu/test_gpu.py (EP4, or EP4 on 2 shared GPUs; EP2; proxy)
#   bench/acceptance.sh GPUS BUNDLES OUT bench   # ep_bench on the default configuration -> OUT/default
#   bench/acceptance.sh GPUS BUNDLES OUT tuned   # epcc tune, ep_bench on its pick -> OUT/tuned, targets
#
# GPUS is 2 or 4; BUNDLES the directory tests/gpu/bundles.py wrote on a CPU machine (it holds
# h200x{GPUS}, h200x{GPUS}_fp8 and h200x{GPUS}_t128); OUT where the logs and reports go (the device
# call's $OUT).  The tuned phase tunes copies of the bundles under /tmp (BUNDLES is left as it is):
# the 4096-token bundle over TUNE_SMS (default 16,24,32,48,64) at 16 warps, its pick copied to the
# fp8 bundle, the 128-token bundle over TUNE_SMS_DECODE (16,24,32,48,64,96) at 8 and 16 warps.  It
# ends with bench/targets.py on OUT/default (when the bench phase ran before, in this OUT or copied
# there) and OUT/tuned.
set -u -o pipefail

usage() { echo "usage: bench/acceptance.sh GPUS BUNDLES OUT tests|bench|tuned" >&2; exit 2; }
[ $# -eq 4 ] || usage
G=$1 B=$2 OUT=$3 PHASE=$4
case "$G" in 2|4) ;; *) echo "bench/acceptance.sh: GPUS must be 2 or 4, got '$G'" >&2; exit 2 ;; esac
for s in "" _fp8 _t128; do
  [ -f "$B/h200x$G$s/cuda/manifest.json" ] || {
    echo "bench/acceptance.sh: no bundle $B/h200x$G$s (run tests/gpu/bundles.py $B on a CPU machine)" >&2; exit 1; }
done
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
# The GPU machine has no package index: without an installed epcc, install this checkout (no
# dependencies; the runtime needs none beyond torch) into a folder of its own for `-m epcc...`.
if ! python3 -c "import epcc.runtime" 2>/dev/null; then
  SITE=/tmp/epcc_acceptance_site
  rm -rf "$SITE"
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$SITE" . || exit 1
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# NVLink multicast stays off on the shared hosts (ep_bench and the tests force it too).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
BENCH=(torchrun --standalone --nproc-per-node "$G" bench/ep_bench.py --iters 40 --warmup 5 --kernel-timeout 6)

# the table of an ep_bench log (the lines from its header on), without torch's warnings
table() { grep -v '^W1\|CUDAEvent' "$1" | sed -n '/^bundle  /,$p'; }

case "$PHASE" in
tests)
  EPCC_GPU_BUNDLES="$B" python3 -m pytest -q -rA tests/gpu/test_gpu.py > "$OUT/tests.log" 2>&1
  rc=$?
  grep -v '^W1\|CUDAEvent' "$OUT/tests.log" | grep 'GPU checks\|passed\|failed\|FAIL\|rror\|timed out\|measured\|simulated\|epcc ok'
  exit $rc ;;
bench)
  "${BENCH[@]}" --out "$OUT/default" --bundles "$B/h200x$G" "$B/h200x${G}_fp8" "$B/h200x${G}_t128" \
    > "$OUT/default.log" 2>&1
  rc=$?
  table "$OUT/default.log"
  exit $rc ;;
tuned)
  T=/tmp/epcc_acceptance_tuned
  rm -rf "$T" && mkdir -p "$T"
  for s in "" _fp8 _t128; do cp -r "$B/h200x$G$s" "$T/h200x$G$s"; done
  TUNE=(torchrun --standalone --nproc-per-node "$G" -m epcc.runtime.tune --iters 10)
  "${TUNE[@]}" "$T/h200x$G" --sms "${TUNE_SMS:-16,24,32,48,64}" --warps 16 > "$OUT/tune.log" 2>&1 || {
    tail -20 "$OUT/tune.log"; exit 1; }
  cp "$T/h200x$G/cuda/tuned.json" "$T/h200x${G}_fp8/cuda/tuned.json"
  "${TUNE[@]}" "$T/h200x${G}_t128" --sms "${TUNE_SMS_DECODE:-16,24,32,48,64,96}" --warps 8,16 \
    > "$OUT/tune_t128.log" 2>&1 || { tail -20 "$OUT/tune_t128.log"; exit 1; }
  grep -h '^best\|^wrote' "$OUT/tune.log" "$OUT/tune_t128.log"
  "${BENCH[@]}" --out "$OUT/tuned" --bundles "$T/h200x$G" "$T/h200x${G}_fp8" "$T/h200x${G}_t128" \
    > "$OUT/tuned.log" 2>&1
  rc=$?
  table "$OUT/tuned.log"
  [ $rc -eq 0 ] || exit $rc
  if [ -f "$OUT/default/ep_bench.json" ]; then
    python3 bench/targets.py "$OUT/default/ep_bench.json" "$OUT/tuned/ep_bench.json"
  else
    python3 bench/targets.py "$OUT/tuned/ep_bench.json"
  fi ;;
*) usage ;;
esac
