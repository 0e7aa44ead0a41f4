#!/usr/bin/env bash
# The GPU targets' measurements on one GPU machine of 2, 4 or 8 GPUs, one phase per device call,
# each within 10 minutes (every long command runs under `timeout`, so a hang costs its own bound, not
# the phase).  The times below are the estimates it was planned with; measured on 4 x H200
# (2026-11-27, ITERS=20, results/2026-11-27_4xH200.md): tests 3.0 min, tests-proxy 3.0, bench 1.1
# (DeepEP built beforehand: ~3.5 min beside the tests on 64 cores), tuned 2.0, tokens 1.5,
# multihop 1.6 -- three device calls held all six:
#
#   bench/acceptance.sh GPUS BUNDLES OUT tests        # ~5 min: tests/gpu/test_gpu.py, GPUS ranks (one GPU each):
#                                                     #   direct, token-major and multi-hop bundles through Buffer,
#                                                     #   uneven token counts, the collective-metadata bundle
#   bench/acceptance.sh GPUS BUNDLES OUT tests-proxy  # ~5 min: the same file's proxy-path cases (emulated and
#                                                     #   nvshmem transports) and the SUPA shim's
#   bench/acceptance.sh GPUS BUNDLES OUT bench        # ~5 min: ep_bench, default configuration -> OUT/default
#   bench/acceptance.sh GPUS BUNDLES OUT tuned        # ~9 min: epcc tune, ep_bench on its pick -> OUT/tuned, targets
#   bench/acceptance.sh GPUS BUNDLES OUT tokens       # ~6 min: ep_bench on the token-major bundles -> OUT/tokens
#   bench/acceptance.sh GPUS BUNDLES OUT multihop     # ~5 min: the vnode plans, fresh routing: ep_worker checks,
#                                                     #   then ep_bench (epcc rows) -> OUT/multihop
#
# GPUS is 2, 4 or 8; BUNDLES the directory tests/gpu/bundles.py wrote on a CPU machine; OUT where
# the logs and reports go (the device call's $OUT).
# Each phase first compiles every library its bundles need at once (python -m epcc.runtime.prebuild,
# all cores; OUT/prebuild.log): 40 libraries in 28 s on a fresh 4 x H100 machine (2026-11-27),
# instead of one at a time inside the bounds of the runs that first use them.  The bench phases (bench, tuned, tokens) time
# epcc beside bare NCCL all_to_all, torch+NCCL and, where DEEPEP_SRC names a folder holding
# DeepEP-1.2.1.tar.gz and deepep-intranode-build.patch, DeepEP: built in the background at the
# phase's start under a temporary folder (log: OUT/deepep_build.log) and put on PYTHONPATH;
# a line says when it did not build.  bench, tokens and multihop end with bench/sim_check.py on
# their report (`epcc simulate` against the measured times, 10 %) where the compiler imports (else a
# line gives the command for the CPU machine); tuned ends with bench/targets.py instead (the
# simulator predicts the plan's SMs, not tune's pick).
#
# Bundles per phase (G = GPUS): bench h200xG, _fp8, _t128; tuned the same, tuned on copies (the
# 4096-token bundle over TUNE_SMS, default 16,24,32,48,64, at 16 warps, its pick copied to the fp8
# bundle; the 128-token one over TUNE_SMS_DECODE, 16,24,32,48,64,96, at 8 and 16 warps); tokens
# h200xG_tok, _tok_fp8, _tok_t128 at TOKEN_SMS (24,48) epcc and DeepEP SMs; multihop
# h200x2_2vnode_50 (2), h200x4_2vnode_50 and h200x4_ubb2x2_50 (4), h200x8_2vnode_50 and
# h200x8_ubb4x2_50 (8), each with its proxy-path twins in ep_bench (_proxy_dev: tables
# written on the GPU, the default; _proxy: laid out on the host).  The tests phases select the cases
# of G ranks (`pytest -k`; with 2, also the 4-rank bundles time-sliced on 2 GPUs where only 2 are
# present) and fail where a case was skipped for a missing bundle or too few GPUs.
#
# Settings (environment): ITERS / WARMUP ep_bench's timed and warm-up iterations (40 / 5);
# BENCH_BOUND_S / PYTEST_BOUND_S the bound of one ep_bench run / of a tests phase's pytest, s;
# BENCH_SMS the SM counts the bench phase runs epcc's direct bundles and DeepEP at (e.g. 24,64;
# default: the bundles' own configuration and DeepEP at 24); DEEPEP_DIR a folder DeepEP is built in
# and kept (a later phase or call on the same machine finds it built there and skips the build;
# default: the phase's temporary folder).
#
# DRY=1 prints the commands instead of running them (no GPU needed; nothing is written).
set -u -o pipefail

PHASES="tests|tests-proxy|bench|tuned|tokens|multihop"
DEEPEP_PID=
usage() { echo "usage: bench/acceptance.sh GPUS BUNDLES OUT $PHASES" >&2; exit 2; }
die() { echo "bench/acceptance.sh: $*" >&2; exit 1; }
[ $# -eq 4 ] || usage
G=$1 B=$2 OUT=$3 PHASE=$4
DRY=${DRY:-}
case "$G" in 2|4|8) ;; *) echo "bench/acceptance.sh: GPUS must be 2, 4 or 8, got '$G'" >&2; exit 2 ;; esac
case "$PHASE" in tests|tests-proxy|bench|tuned|tokens|multihop) ;; *) usage ;; esac

# the multi-hop vnode plans of G GPUs (tests/gpu/bundles.py RDMA_VARIANTS at 50 GB/s)
case "$G" in
  2) MULTIHOP=(h200x2_2vnode_50) ;;
  4) MULTIHOP=(h200x4_2vnode_50 h200x4_ubb2x2_50) ;;
  8) MULTIHOP=(h200x8_2vnode_50 h200x8_ubb4x2_50) ;;
esac
case "$PHASE" in
  tests|tests-proxy) NEED=("h200x$G") ;;
  bench|tuned) NEED=("h200x$G" "h200x${G}_fp8" "h200x${G}_t128") ;;
  tokens) NEED=("h200x${G}_tok" "h200x${G}_tok_fp8" "h200x${G}_tok_t128") ;;
  multihop) NEED=(); for m in "${MULTIHOP[@]}"; do NEED+=("$m" "${m}_proxy_dev" "${m}_proxy"); done ;;
esac
for n in "${NEED[@]}"; do
  [ -f "$B/$n/cuda/manifest.json" ] || die "no bundle $B/$n (run tests/gpu/bundles.py $B on a CPU machine)"
done

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1

# show CMD...: the command as a shell line ("+ ..."), arguments with spaces or shell characters quoted
show() {
  local a line="+"
  for a in "$@"; do
    case "$a" in
      *[[:space:]\(\)\'\"\$\*\;\&\|\<\>]*|'') line+=" '${a//\'/\'\\\'\'}'" ;;
      *) line+=" $a" ;;
    esac
  done
  echo "$line"
}
# logged LOG CMD...: run CMD with stdout and stderr into LOG (DRY: print it); its exit status
logged() {
  local log=$1; shift
  if [ -n "$DRY" ]; then echo "$(show "$@") > $log 2>&1"; return 0; fi
  "$@" > "$log" 2>&1
}
# x CMD...: run CMD (DRY: print it)
x() { if [ -n "$DRY" ]; then show "$@"; else "$@"; fi; }
# the table of an ep_bench log (the lines from its header on), without torch's warnings
table() { [ -n "$DRY" ] || grep -v '^W1\|CUDAEvent' "$1" | sed -n '/^bundle  /,$p'; }

if [ -n "$DRY" ]; then
  WORK='$WORK'
  echo "+ WORK=\$(mktemp -d -t epcc_acceptance.XXXXXX)"
else
  mkdir -p "$OUT" || exit 1
  WORK=$(mktemp -d -t epcc_acceptance.XXXXXX) || exit 1
  # at the end: a DeepEP build still running stops, the temporary folder goes
  trap '[ -z "$DEEPEP_PID" ] || kill "$DEEPEP_PID" 2>/dev/null; rm -rf "$WORK"' EXIT
fi
# The GPU machine has no package index: without an installed epcc, install this checkout (no
# dependencies; the runtime needs none beyond torch) into a folder of its own for `-m epcc...`.
if [ -n "$DRY" ] || ! python3 -c "import epcc.runtime" 2>/dev/null; then
  x python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$WORK/site" . || exit 1
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# NVLink multicast stays off on the shared hosts (ep_bench and the tests force it too).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
TORCHRUN=(torchrun --standalone --nproc-per-node "$G")
BENCH=("${TORCHRUN[@]}" bench/ep_bench.py --iters "${ITERS:-40}" --warmup "${WARMUP:-5}" --kernel-timeout 6
       --child-timeout 150)
# The bounds (s), which add up to less than 10 minutes per phase: DeepEP's build (bench, tokens:
# before ep_bench; tuned: beside the tuning), one ep_bench run (each of its child runs also bounded
# by --child-timeout), a tuning, a worker run of one vnode plan (multihop), sim_check, targets.py,
# the pytest run of a tests phase and one torchrun in it; `timeout -k 20` kills 20 s after asking.
PREBUILD_S=80 DEEPEP_BUILD_S=150 BENCH_S=330 TUNE_S=100 WORKER_S=70 CHECK_S=60 TARGETS_S=30 PYTEST_S=450 TORCHRUN_S=400
case "$PHASE" in tuned) BENCH_S=200 ;; multihop) BENCH_S=200 ;; esac
# a caller fitting several phases into one call sets tighter bounds for ep_bench and pytest
BENCH_S=${BENCH_BOUND_S:-$BENCH_S} PYTEST_S=${PYTEST_BOUND_S:-$PYTEST_S}

# DeepEP v1.2.1, intranode only (docs/benchmarking.md, "DeepEP beside epcc"): deepep_start builds it
# in the background from $DEEPEP_SRC, deepep_wait puts it on PYTHONPATH or says why not.
deepep_start() {
  local src=${DEEPEP_SRC:-} dst=${DEEPEP_DIR:-"$WORK/deepep"} jobs
  if [ -z "$DRY" ] && compgen -G "$dst/DeepEP-1.2.1/deep_ep_cpp*.so" > /dev/null; then
    echo "DeepEP: already built in $dst"; DEEPEP_PID=; return 0
  fi
  if [ -z "$src" ]; then echo "DeepEP: DEEPEP_SRC not set: ep_bench runs without DeepEP"; return 0; fi
  if [ -z "$DRY" ]; then
    if [ ! -f "$src/DeepEP-1.2.1.tar.gz" ] || [ ! -f "$src/deepep-intranode-build.patch" ]; then
      echo "DeepEP: NOT built: $src lacks DeepEP-1.2.1.tar.gz or deepep-intranode-build.patch"; return 0
    fi
    src=$(cd "$src" && pwd)
  fi
  jobs=$(nproc 2>/dev/null || echo 8)
  local build="rm -rf '$dst/DeepEP-1.2.1' && mkdir -p '$dst' && tar xzf '$src/DeepEP-1.2.1.tar.gz' -C '$dst' && cd '$dst/DeepEP-1.2.1' \
&& patch -p1 < '$src/deepep-intranode-build.patch' && MAX_JOBS=$jobs python3 setup.py build \
&& cp build/lib.*/deep_ep_cpp*.so ."
  if [ -n "$DRY" ]; then
    echo "$(show timeout "$DEEPEP_BUILD_S" bash -c "$build") > $OUT/deepep_build.log 2>&1 &"
    return 0
  fi
  timeout "$DEEPEP_BUILD_S" bash -c "$build" > "$OUT/deepep_build.log" 2>&1 &
  DEEPEP_PID=$!
}
deepep_wait() {
  local dir=${DEEPEP_DIR:-"$WORK/deepep"}/DeepEP-1.2.1
  [ -n "${DEEPEP_SRC:-}" ] || return 0
  if [ -n "$DRY" ]; then echo "+ wait  # DeepEP's build; then PYTHONPATH=$dir:\$PYTHONPATH"; return 0; fi
  local rc=0
  if [ -n "$DEEPEP_PID" ]; then wait "$DEEPEP_PID" || rc=$?
  elif ! compgen -G "$dir/deep_ep_cpp*.so" > /dev/null; then return 0; fi
  DEEPEP_PID=
  if [ $rc -eq 0 ] && PYTHONPATH="$dir:$PYTHONPATH" python3 -c "import deep_ep" >> "$OUT/deepep_build.log" 2>&1; then
    export PYTHONPATH="$dir:$PYTHONPATH"
    echo "DeepEP: built ($dir), timed beside epcc"
  else
    echo "DeepEP: NOT built (exit $rc, or it does not import; OUT/deepep_build.log): ep_bench runs without DeepEP"
    tail -5 "$OUT/deepep_build.log"
  fi
}

# simcheck REPORT: `epcc simulate` against the report's epcc rows, where the compiler imports here
simcheck() {
  if [ -z "$DRY" ] && [ ! -f "$1" ]; then echo "sim_check: no report $1"; return 0; fi
  if [ -z "$DRY" ] && ! python3 -c "import epcc.cli.simulate" 2>/dev/null; then
    echo "sim_check: the compiler (lark, MLIR) does not import here; on the CPU machine:" \
      ".venv/bin/python bench/sim_check.py OUT/${1#"$OUT"/}"
    return 0
  fi
  x timeout "$CHECK_S" python3 bench/sim_check.py "$1"
}

# bench NAME [EP_BENCH ARGS...] -- BUNDLES...: ep_bench -> OUT/NAME, its log OUT/NAME.log; prints the table
bench() {
  local name=$1; shift
  local args=() rc=0
  while [ "$1" != "--" ]; do args+=("$1"); shift; done; shift
  logged "$OUT/$name.log" timeout -k 20 "$BENCH_S" "${BENCH[@]}" "${args[@]}" --out "$OUT/$name" --bundles "$@" || rc=$?
  table "$OUT/$name.log"
  if [ $rc -eq 124 ]; then
    echo "ep_bench: stopped after $BENCH_S s (timeout): the table above is what it finished"
  elif [ $rc -ne 0 ]; then
    echo "ep_bench: exit $rc (OUT/$name.log):"; tail -5 "$OUT/$name.log"
  fi
  return $rc
}

# pytests SELECTION: tests/gpu/test_gpu.py's cases of G ranks matching SELECTION (pytest -k), each
# torchrun bounded by EPCC_GPU_TIMEOUT (TORCHRUN_S), the whole run by PYTEST_S
pytests() {
  local log="$OUT/$PHASE.log" rc=0 ranks
  case "$G" in
    2) ranks="(not ep4 and not ep8 or shared or collective)" ;;
    4) ranks="(ep4 and not shared or collective)" ;;
    8) ranks="(ep8 or collective)" ;;
  esac
  logged "$log" timeout -k 20 "$PYTEST_S" env EPCC_GPU_BUNDLES="$B" EPCC_GPU_TIMEOUT="$TORCHRUN_S" \
    python3 -m pytest -q -rA tests/gpu/test_gpu.py -k "$ranks and $1" || rc=$?
  [ -n "$DRY" ] && return 0
  grep -v '^W1\|CUDAEvent' "$log" | grep 'GPU checks\|passed\|failed\|FAIL\|SKIP\|rror\|timed out\|measured\|simulated\|epcc ok'
  [ $rc -eq 124 ] && echo "pytest: stopped after $PYTEST_S s (timeout)"
  if grep -q 'bundles missing under\|no bundle directory\|case needs [0-9]* GPUs\|needs >= 2 GPUs\|nvcc not found\|torchrun not found' "$log"; then
    echo "bench/acceptance.sh: a case of $G ranks was skipped (missing bundles or GPUs): not accepted" >&2
    [ $rc -ne 0 ] || rc=1
  fi
  return $rc
}

# multihop_checks: ep_worker.py's checks on each vnode plan, fresh routings, one bounded run per plan
multihop_checks() {
  local m rc=0
  for m in "${MULTIHOP[@]}"; do
    logged "$OUT/worker_$m.log" timeout -k 20 "$WORKER_S" env EPCC_GPU_ROUTINGS="${MULTIHOP_ROUTINGS:-uniform,zipf:1.2,all-to-one}" \
      EPCC_GPU_ITERS="${MULTIHOP_ITERS:-2}" "${TORCHRUN[@]}" tests/gpu/ep_worker.py "$B/$m" || rc=1
    [ -n "$DRY" ] || grep 'GPU checks\|FAIL' "$OUT/worker_$m.log" || echo "$m: no result (OUT/worker_$m.log)"
  done
  return $rc
}

# prebuild: every library the phase's bundles need, compiled at once (all cores) before anything is
# timed or bounded.  A Buffer builds its bundle's libraries on first use, one after another, inside
# the bound of its run: on a fresh machine that nvcc time, not the kernels, filled a tests phase's
# bound.  The bench phases run it while DeepEP builds.
prebuild() {
  local pre=()
  case "$PHASE" in
    tests|tests-proxy) pre=("$B"/*/) ;;
    *) for n in "${NEED[@]}"; do pre+=("$B/$n"); done ;;
  esac
  logged "$OUT/prebuild.log" timeout -k 10 "$PREBUILD_S" python3 -m epcc.runtime.prebuild -j "$(nproc 2>/dev/null || echo 8)" \
    --transports emulated,nvshmem "${pre[@]}" || echo "prebuild: not every library built (OUT/prebuild.log); the runs build what is missing"
  [ -n "$DRY" ] || tail -1 "$OUT/prebuild.log"
}

rc=0
case "$PHASE" in
tests) prebuild; pytests "not proxy and not supa" || rc=$? ;;
tests-proxy) prebuild; pytests "(proxy or supa)" || rc=$? ;;
bench)
  deepep_start
  prebuild
  deepep_wait
  bench default ${BENCH_SMS:+--epcc-sms "$BENCH_SMS" --deepep-sms "$BENCH_SMS"} -- "$B/h200x$G" "$B/h200x${G}_fp8" "$B/h200x${G}_t128" || rc=$?
  simcheck "$OUT/default/ep_bench.json" ;;
tuned)
  T="$WORK/tuned"
  deepep_start
  prebuild
  x mkdir -p "$T"
  for s in "" _fp8 _t128; do x cp -r "$B/h200x$G$s" "$T/h200x$G$s"; done
  TUNE=(timeout -k 20 "$TUNE_S" "${TORCHRUN[@]}" -m epcc.runtime.tune --iters 10)
  logged "$OUT/tune.log" "${TUNE[@]}" "$T/h200x$G" --sms "${TUNE_SMS:-16,24,32,48,64}" --warps 16 || {
    tail -20 "$OUT/tune.log"; exit 1; }
  x cp "$T/h200x$G/cuda/tuned.json" "$T/h200x${G}_fp8/cuda/tuned.json"
  logged "$OUT/tune_t128.log" "${TUNE[@]}" "$T/h200x${G}_t128" --sms "${TUNE_SMS_DECODE:-16,24,32,48,64,96}" \
    --warps 8,16 || { tail -20 "$OUT/tune_t128.log"; exit 1; }
  [ -n "$DRY" ] || grep -h '^best\|^wrote' "$OUT/tune.log" "$OUT/tune_t128.log"
  for s in "" _t128; do x cp "$T/h200x$G$s/cuda/tuned.json" "$OUT/tuned_h200x$G$s.json"; done  # tune's picks, kept
  deepep_wait
  bench tuned -- "$T/h200x$G" "$T/h200x${G}_fp8" "$T/h200x${G}_t128" || exit $?
  if [ -n "$DRY" ] || [ ! -f "$OUT/default/ep_bench.json" ]; then
    x timeout "$TARGETS_S" python3 bench/targets.py "$OUT/tuned/ep_bench.json"
  else
    x timeout "$TARGETS_S" python3 bench/targets.py "$OUT/default/ep_bench.json" "$OUT/tuned/ep_bench.json"
  fi || rc=$? ;;
tokens)
  deepep_start
  prebuild
  deepep_wait
  bench tokens --epcc-sms "${TOKEN_SMS:-24,48}" --deepep-sms "${TOKEN_SMS:-24,48}" -- \
    "$B/h200x${G}_tok" "$B/h200x${G}_tok_fp8" "$B/h200x${G}_tok_t128" || rc=$?
  simcheck "$OUT/tokens/ep_bench.json" ;;
multihop)
  prebuild
  multihop_checks || rc=1
  MH=()
  for m in "${MULTIHOP[@]}"; do MH+=("$B/$m" "$B/${m}_proxy_dev" "$B/${m}_proxy"); done
  bench multihop --methods epcc -- "${MH[@]}" || rc=$?
  simcheck "$OUT/multihop/ep_bench.json" ;;
esac
exit $rc
