// h200x4_direct.cu: one-hop dispatch/combine of schedule 'h200x4' (schedules/h200x4.sched),
// lowered by epcc 0.1.0 (backends/cuda/direct.py); do not edit, regenerate with
// `epcc compile schedules/h200x4.sched --target cuda`.
//
// Plan steps lowered here:
//   dispatch step 'meta' (schedules/h200x4.sched:49): counts per rank and expert -> meta_count_kernel (+ meta_finish_kernel above one chunk; up to 256 tokens dispatch_kernel's block 0): counts and ranks on the GPU, exchanged through peer memory
//   dispatch step 'push' (schedules/h200x4.sched:50): send each token once to every peer that needs it -> dispatch_kernel: warps send (one row store per destination GPU), then replicate received rows
//   dispatch step 'keep' (schedules/h200x4.sched:52): own tokens to local experts -> dispatch_kernel senders with this rank as destination (local permute)
//   combine step 'keep' (schedules/h200x4.sched:52): own tokens to local experts -> combine_kernel: home-side sum of the partials (own partial included; every warp, after its partials)
//   combine step 'push' (schedules/h200x4.sched:50): send each token once to every peer that needs it -> combine_kernel: weighted partial per (token, GPU) into the home GPU's staging (first)
//
// The plan's numbers, which part of the kernels lowers which step, the waits:
//   epcc_direct_config.cuh (generated)
// The kernels and their host API, static sources of the epcc CUDA backend copied beside this file
// (host.cuh tells how the kernels run):
//   epcc/direct/common.cuh
//   epcc/direct/meta.cuh
//   epcc/direct/rows.cuh
//   epcc/direct/dispatch.cuh
//   epcc/direct/combine.cuh
//   epcc/direct/host.cuh
#include "epcc_direct_config.cuh"
#include "epcc/direct/host.cuh"
