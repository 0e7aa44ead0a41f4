// epcc/direct/host.cuh: the direct kernels' host API (extern "C", loaded with ctypes by the
// runtime's cuda_direct engine): allocation and CUDA IPC of the peer region, the error record, and
// the launches of one dispatch and one combine.  It includes every kernel; a bundle's
// <schedule>_direct.cu is the plan's config followed by this header.
//
// Kernels (one stream, in this order; every cross-GPU wait is bounded, see wait_geq):
//   meta_count_kernel, meta_finish_kernel (the latter only with more than MC tokens; neither up
//                    to MC tokens with blocks of >= MC threads, when dispatch_kernel's block 0
//                    counts: decode is one launch, see meta_in_dispatch)
//                    routing -> per-expert ranks and counts, per-destination dedup indices and
//                    channel ranges; counts and ranges written into every peer's meta area, then
//                    one release flag per peer (no host round trip).
//   dispatch_kernel  cooperative, W warps per block: the warps of blocks [0, NSB) take channels
//                    (contiguous token ranges; the first one per warp spread over the SMs, see
//                    slot_of) and send them: a warp loads each token row once and stores it once
//                    per destination GPU, into that GPU's expert-major output at the row of the
//                    token's first expert there (permute fused, one copy per (token, GPU) on
//                    NVLink; into every row of its experts on its own GPU), with the weights of
//                    every (token, expert) row and a record {token, n, rows} per (token, GPU).
//                    Then every warp (blocks [NSB, NSB + NR) from the start; NR is usually 0)
//                    replicates the peers' records' first rows into their other rows (a token
//                    that picked several experts of this GPU) as the records' tails advance.
//   combine_kernel   cooperative: the warps of blocks [0, NS) reduce each received record (its
//                    rows weighted, fp32) into one bf16 partial and store it into the home GPU's
//                    staging area; then every warp (blocks [NS, NS + ND) from the start) sums
//                    the partials of home tokens in fp32 and writes bf16.
// No SM waits for a role it was not given: one SM writes ~46 GB/s by any path (sm_probe), so a
// fixed split between sending and replicating (or partials and sums) left one side idle.
// Dispatch rows move by 16-byte warp loads and stores (bench/sm_probe.cu measured why: not bulk
// copies); the combine's loads go through per-warp shared-memory rings by cp.async, so that the
// rows in flight hold no registers (reduce_rows).
// Epochs live in device memory (CUDA-graph capturable): a kernel's last block advances them.
// A cached dispatch (Args::cached: the routing of the last metadata again) launches no metadata
// kernel and reads the meta area the last metadata wrote (State::meta_parity).
// Token-major bundles (the config defines EPCC_DIRECT_TOKEN_MAJOR) run tok_dispatch_kernel and
// tok_combine_kernel (token.cuh) in place of dispatch_kernel and combine_kernel, after the same
// metadata kernels.
//
// A static source of the epcc CUDA backend, copied unchanged into every bundle with direct kernels.
#pragma once

#include "common.cuh"
#include "meta.cuh"
#include "dispatch.cuh"
#include "combine.cuh"
#ifdef EPCC_DIRECT_TOKEN_MAJOR
#include "token.cuh"
#endif

namespace {

// The kernels this bundle's layout runs: token-major (token.cuh) or expert-major.
#ifdef EPCC_DIRECT_TOKEN_MAJOR
const void* const DISPATCH_KERNEL = reinterpret_cast<const void*>(tok_dispatch_kernel);
const void* const COMBINE_KERNEL = reinterpret_cast<const void*>(tok_combine_kernel);
#else
const void* const DISPATCH_KERNEL = reinterpret_cast<const void*>(dispatch_kernel);
const void* const COMBINE_KERNEL = reinterpret_cast<const void*>(combine_kernel);
#endif

thread_local char g_error[512];

int set_error(cudaError_t err, const char* what) {
  snprintf(g_error, sizeof g_error, "%s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
  return 1;
}

cudaError_t launch(const void* fn, int grid, int block, size_t smem, bool cooperative, const Args& a,
                   cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = cooperative ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  void* args[] = {const_cast<Args*>(&a)};
  return cudaLaunchKernelExC(&cfg, fn, args);
}

}  // namespace

extern "C" {

const char* epcc_direct_last_error(void) { return g_error; }
int epcc_direct_abi(void) { return ABI; }
unsigned long long epcc_direct_region_bytes(void) { return OFF_END; }
int epcc_direct_args_bytes(void) { return (int)sizeof(Args); }
int epcc_direct_state_bytes(void) { return (int)sizeof(State); }
int epcc_direct_state_layout(int* out8) {  // byte offsets of State fields the host reads
  out8[0] = (int)offsetof(State, disp_epoch);
  out8[1] = (int)offsetof(State, comb_epoch);
  out8[2] = (int)offsetof(State, bad_token);
  out8[3] = (int)offsetof(State, recv_count);
  out8[4] = (int)offsetof(State, recv_offset);
  out8[5] = (int)sizeof(ErrorRecord);
  out8[6] = (int)offsetof(State, last_T);
  out8[7] = (int)offsetof(State, src_offset);
  return 0;
}

int epcc_direct_malloc(unsigned long long bytes, unsigned long long* out) {
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err != cudaSuccess) return set_error(err, "cudaMalloc");
  err = cudaMemset(p, 0, bytes);
  if (err != cudaSuccess) return set_error(err, "cudaMemset");
  *out = reinterpret_cast<unsigned long long>(p);
  return 0;
}
int epcc_direct_free(unsigned long long p) {
  cudaError_t err = cudaFree(reinterpret_cast<void*>(p));
  return err == cudaSuccess ? 0 : set_error(err, "cudaFree");
}
int epcc_direct_ipc_handle(unsigned long long p, void* out64) {
  cudaIpcMemHandle_t h;
  cudaError_t err = cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(p));
  if (err != cudaSuccess) return set_error(err, "cudaIpcGetMemHandle");
  memcpy(out64, &h, sizeof h);
  return 0;
}
int epcc_direct_ipc_open(const void* in64, unsigned long long* out) {
  cudaIpcMemHandle_t h;
  memcpy(&h, in64, sizeof h);
  void* p = nullptr;
  cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) return set_error(err, "cudaIpcOpenMemHandle");
  *out = reinterpret_cast<unsigned long long>(p);
  return 0;
}
int epcc_direct_ipc_close(unsigned long long p) {
  cudaError_t err = cudaIpcCloseMemHandle(reinterpret_cast<void*>(p));
  return err == cudaSuccess ? 0 : set_error(err, "cudaIpcCloseMemHandle");
}
int epcc_direct_free_host(unsigned long long host) {
  cudaError_t err = cudaFreeHost(reinterpret_cast<void*>(host));
  return err == cudaSuccess ? 0 : set_error(err, "cudaFreeHost");
}
int epcc_direct_host_error_record(unsigned long long* host, unsigned long long* dev) {
  void* h = nullptr;
  cudaError_t err = cudaHostAlloc(&h, sizeof(ErrorRecord), cudaHostAllocMapped);
  if (err != cudaSuccess) return set_error(err, "cudaHostAlloc");
  memset(h, 0, sizeof(ErrorRecord));
  void* d = nullptr;
  err = cudaHostGetDevicePointer(&d, h, 0);
  if (err != cudaSuccess) return set_error(err, "cudaHostGetDevicePointer");
  *host = reinterpret_cast<unsigned long long>(h);
  *dev = reinterpret_cast<unsigned long long>(d);
  return 0;
}

// Once per process and device: check the warps a dispatch block may have (no CUDA call).
int epcc_direct_init(int warps) {
  if (warps < 1 || warps > DTHREADS / 32) {
    snprintf(g_error, sizeof g_error, "warps must lie in [1, %d], got %d", DTHREADS / 32, warps);
    return 2;
  }
  return 0;
}

// Once per process and device, on that device, before the first launch: the combine kernel's rings
// take more shared memory than a kernel gets without asking.
int epcc_direct_prepare(void) {
  cudaError_t err = cudaFuncSetAttribute(COMBINE_KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, COMBINE_SMEM);
  return err == cudaSuccess ? 0 : set_error(err, "cudaFuncSetAttribute(combine_kernel, max dynamic shared memory)");
}

int epcc_direct_dispatch(const void* args, unsigned long long stream) {
  const Args* a = static_cast<const Args*>(args);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  // checked before anything is launched: metadata flags raised at the peers with no dispatch kernel
  // behind them would leave the peers waiting
  if (a->W < 1 || a->W > DTHREADS / 32 || a->C < 1 || a->C > CMAX || a->NSB < 1 || a->NR < 0) {
    snprintf(g_error, sizeof g_error, "bad launch configuration: %lld channels, %lld sender and %lld "
             "replicator blocks of %lld warps", a->C, a->NSB, a->NR, a->W);
    return 2;
  }
  if (a->T < 0 || a->T > TMAX || a->align < 1 || a->align > ALIGN_MAX) {  // the peers lay out rows by both
    snprintf(g_error, sizeof g_error, "bad arguments: %lld tokens (at most %d), expert alignment %lld (1 to %d)", a->T,
             TMAX, a->align, ALIGN_MAX);
    return 2;
  }
  cudaError_t err;
  if (a->cached != 0 && a->cached != 1) {
    snprintf(g_error, sizeof g_error, "bad arguments: cached is %lld (0 or 1)", a->cached);
    return 2;
  }
  if (!a->cached && !meta_in_dispatch(*a)) {  // a cached dispatch reuses the last metadata
    const int chunks = a->T > 0 ? (int)((a->T + MC - 1) / MC) : 1;
    err = launch(reinterpret_cast<const void*>(meta_count_kernel), chunks, MTHREADS, 0, false, *a, s);
    if (err != cudaSuccess) return set_error(err, "launch meta_count_kernel");
    if (chunks > 1) {  // one chunk: meta_count_kernel finished and published itself
      err = launch(reinterpret_cast<const void*>(meta_finish_kernel), chunks, MTHREADS, 0, false, *a, s);
      if (err != cudaSuccess) return set_error(err, "launch meta_finish_kernel");
    }
  }
  err = launch(DISPATCH_KERNEL, (int)(a->NSB + a->NR), (int)a->W * 32, 0, true, *a, s);
  if (err != cudaSuccess) return set_error(err, "launch dispatch_kernel");
  return 0;
}

int epcc_direct_combine(const void* args, unsigned long long stream) {
  const Args* a = static_cast<const Args*>(args);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (a->NS < 1 || a->ND < 0) {
    snprintf(g_error, sizeof g_error, "bad launch configuration: %lld partial and %lld home-only blocks", a->NS, a->ND);
    return 2;
  }
  cudaError_t err = launch(COMBINE_KERNEL, (int)(a->NS + a->ND), CTHREADS, COMBINE_SMEM, true, *a, s);
  return err == cudaSuccess ? 0 : set_error(err, "launch combine_kernel");
}

}  // extern "C"
