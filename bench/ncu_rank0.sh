#!/bin/bash
# Nsight Compute on rank 0 of a torchrun job, the other ranks unprofiled:
#
#   NCU_OUT=/tmp/ncu torchrun --nproc-per-node 4 --no-python bench/ncu_rank0.sh \
#       python3 bench/kernel_times.py BUNDLE --no-cupti --iters 4
#
# epcc's kernels wait on their peers, so they cannot be replayed one at a time (a replayed pass
# would wait for peer writes that already happened, until its bounded wait traps): only metrics
# that ncu collects in ONE pass are asked for (NCU_METRICS overrides the list), and ncu must
# report "1 pass".  NCU_KERNELS (regex) picks the kernels, NCU_SKIP the launches to skip (warm-up).
set -euo pipefail
if [ "${LOCAL_RANK:-0}" != "0" ]; then
    exec "$@"
fi
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
METRICS=${NCU_METRICS:-gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,sm__cycles_active.avg}
mkdir -p "${NCU_OUT:-/tmp/ncu}"
exec "$NCU" --target-processes all --kernel-name "regex:${NCU_KERNELS:-dispatch_kernel|combine_kernel}" \
    --launch-skip "${NCU_SKIP:-6}" --launch-count "${NCU_COUNT:-2}" --metrics "$METRICS" \
    --print-units base --csv --log-file "${NCU_OUT:-/tmp/ncu}/ncu_rank0.csv" "$@"
