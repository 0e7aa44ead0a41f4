// h200x4_direct.cu: one-hop dispatch/combine of schedule 'h200x4' (schedules/h200x4.sched),
// lowered by epcc 0.1.0 (backends/cuda/direct.py); do not edit, regenerate with
// `epcc compile schedules/h200x4.sched --target cuda`.
//
// Plan steps lowered here:
//   dispatch step 'meta' (schedules/h200x4.sched:49): counts per rank and expert -> meta_count_kernel (+ meta_finish_kernel above one chunk): counts, tokens per destination and dedup ranks on the GPU, exchanged through peer memory (none for a cached handle)
//   dispatch step 'push' (schedules/h200x4.sched:50): send each token once to every peer that needs it -> tok_dispatch_kernel: warps store each token once per destination GPU, in (source rank, token) order
//   dispatch step 'keep' (schedules/h200x4.sched:52): own tokens to local experts -> tok_dispatch_kernel senders with this rank as destination (its own token-major rows)
//   combine step 'keep' (schedules/h200x4.sched:52): own tokens to local experts -> tok_combine_kernel: home-side unweighted sum of a token's rows (its own read in place)
//   combine step 'push' (schedules/h200x4.sched:50): send each token once to every peer that needs it -> tok_combine_kernel: each received row copied into its home GPU's staging (first)
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
//   epcc/direct/token.cuh
#include "epcc_direct_config.cuh"
#include "epcc/direct/host.cuh"
