// epcc_table_meta.cu: the metadata of a table-driven plan on the GPU, per dispatch, without the
// host: every rank's routing exchanged over peer memory, then this rank's table blobs of both
// programs written by the metadata kernels (epcc/table/meta.cuh).  Shipped with epcc and copied
// into every bundle of a plan the metadata kernels cover; built into the bundle's library beside
// the generated launcher (runtime/engines/cuda_table/meta.py drives it).
//
// The exchange: every rank's gather area (peer memory, mapped by every rank) holds, per rank r,
// r's token count, top-k indices and weights, and r's flag.  A rank writes its own into every
// area (its slot), fences, raises its flag in every area to the exchange's epoch (release,
// system scope), then waits until every rank's flag in its own area reached the epoch (acquire,
// bounded: past the timeout it writes the error word and traps).  The epoch lives in device
// memory (a CUDA graph replays the launches unchanged).  The next exchange cannot overwrite an
// area a peer still reads: a rank only starts it after its previous dispatch kernel, which meets
// every peer at its entry barrier after their metadata kernels.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstdio>

#include "epcc/table/meta.cuh"

namespace {

using epcc::meta::Args;
using epcc::meta::kBlock;
using epcc::meta::kMaxRanks;
using epcc::meta::kScan;

// The layout of EpccTableMeta and Args that runtime/engines/cuda_table/meta.py writes with ctypes:
// changed whenever they change, checked by the runtime at load (epcc_table_meta_abi).
constexpr int kMetaAbi = 2;

struct Exchange {
  uint64_t areas[kMaxRanks];  // every rank's gather area, as mapped here
  uint64_t own;               // this rank's gather area
  const int64_t* routing;     // this rank's top-k indices [tokens][k], int64 or int32 (topk_int32)
  const float* weights;       // [tokens][topk] or null (weight 1)
  uint64_t* epoch;            // device counter
  int* error;                 // host-mapped: {code, rank waited for}; code 1: the exchange timed out
  uint64_t timeout_ns;
  int rank, num_ranks, max_tokens, k, tokens, topk_int32;
};

// Offsets inside a gather area: flags [R] u64, tokens [R] int (16-byte padded), topk [R][T][K] int,
// weights [R][T][K] float.
__host__ __device__ inline uint64_t area_tokens(const Exchange& x) { return 8ull * x.num_ranks; }
__host__ __device__ inline uint64_t area_topk(const Exchange& x) {
  return area_tokens(x) + ((4ull * x.num_ranks + 15) / 16) * 16;
}
__host__ __device__ inline uint64_t area_weights(const Exchange& x) {
  return area_topk(x) + 4ull * x.num_ranks * x.max_tokens * x.k;
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace

extern "C" {
// What epcc_table_meta runs with (runtime/engines/cuda_table/meta.py fills it with ctypes).
struct EpccTableMeta {
  Exchange exchange;
  Args args;                    // args.tokens / topk / weights: this rank's gather area
  const uint8_t* templ[2];      // the blobs' static bytes (device)
  uint64_t templ_bytes[2];      // how many: the blob up to its row arrays (the rows are all written)
  int64_t scratch_words;
  int grid_count, grid_rows, grid_items, grid_copy;
};
}

namespace {

// This rank's routing into every rank's area (padded with -1 / 0 to max_tokens); on the side,
// what the metadata kernels start from: the scratch zero, the blobs' static fields in place, no
// bad token yet.
__global__ void gather_copy(EpccTableMeta m) {
  const Exchange& x = m.exchange;
  const uint64_t first = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = first; i < static_cast<uint64_t>(m.scratch_words); i += step) m.args.scratch[i] = 0;
  for (int p = 0; p < 2; ++p) {
    const uint64_t n16 = m.templ_bytes[p] / 16;  // placement.py aligns every section to 16 bytes
    for (uint64_t i = first; i < n16; i += step)
      reinterpret_cast<uint4*>(m.args.blob[p])[i] = reinterpret_cast<const uint4*>(m.templ[p])[i];
  }
  if (first == 0) *m.args.bad = INT_MAX;
  const uint64_t n = static_cast<uint64_t>(x.max_tokens) * x.k;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n * x.num_ranks; i += stride) {
    const int r = static_cast<int>(i / n);
    const uint64_t k = i % n;
    const bool have = k < static_cast<uint64_t>(x.tokens) * x.k;
    int e = -1;
    float w = 0.f;
    if (have) {
      e = x.topk_int32 ? reinterpret_cast<const int32_t*>(x.routing)[k] : static_cast<int>(x.routing[k]);
      w = x.weights ? x.weights[k] : 1.f;
    }
    uint8_t* area = reinterpret_cast<uint8_t*>(x.areas[r]);
    reinterpret_cast<int*>(area + area_topk(x))[static_cast<uint64_t>(x.rank) * n + k] = e;
    reinterpret_cast<float*>(area + area_weights(x))[static_cast<uint64_t>(x.rank) * n + k] = w;
    if (k == 0) reinterpret_cast<int*>(area + area_tokens(x))[x.rank] = x.tokens;
  }
  __threadfence_system();
}

// One block: raise this rank's flag in every area, then wait for every rank's flag here.
__global__ void gather_signal_wait(Exchange x) {
  const uint64_t e = *x.epoch + 1;
  const int r = static_cast<int>(threadIdx.x);
  __threadfence_system();
  if (r < x.num_ranks) st_release_sys(reinterpret_cast<uint64_t*>(x.areas[r]) + x.rank, e);
  if (r < x.num_ranks) {
    const uint64_t* flag = reinterpret_cast<const uint64_t*>(x.own) + r;
    const uint64_t t0 = globaltimer();
    while (ld_acquire_sys(flag) < e) {
      if (globaltimer() - t0 > x.timeout_ns) {
        if (atomicCAS(x.error, 0, 1) == 0) x.error[1] = r;
        __threadfence_system();
        printf("epcc: metadata exchange timed out after %.3f s: rank %d has no routing from rank %d (epoch %llu)\n",
               x.timeout_ns * 1e-9, x.rank, r, static_cast<unsigned long long>(e));
        __trap();
      }
      __nanosleep(64);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) *x.epoch = e;
}

// The combine's partial buffers of this rank (its ZeroDesc list), cleared before the combine.
__global__ void zero_partials(const uint8_t* blob, const uint64_t* buffers) {
  const auto* h = reinterpret_cast<const uint32_t*>(blob);
  uint64_t off_zero;
  memcpy(&off_zero, blob + 104, 8);  // TableHeader.off_zero
  const uint32_t num_zero = h[11];   // TableHeader.num_zero
  for (uint32_t z = 0; z < num_zero; ++z) {
    uint32_t buf;
    uint64_t bytes;
    memcpy(&buf, blob + off_zero + 16ull * z, 4);
    memcpy(&bytes, blob + off_zero + 16ull * z + 8, 8);
    uint4* p = reinterpret_cast<uint4*>(buffers[buf]);
    const uint64_t n = bytes / 16;
    for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<uint64_t>(gridDim.x) * blockDim.x)
      p[i] = make_uint4(0, 0, 0, 0);
  }
}

// The first *count rows of `row_bytes` (a multiple of 16) from src to dst: a copy whose length
// only the GPU knows (the rows a low-latency dispatch received).
__global__ void copy_rows(uint4* dst, const uint4* src, const int* count, uint64_t row_vecs) {
  const uint64_t n = static_cast<uint64_t>(*count) * row_vecs;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

thread_local char g_error[512];

int fail(cudaError_t e, const char* what) {
  snprintf(g_error, sizeof g_error, "%s: %s", what, cudaGetErrorString(e));
  return 1;
}

}  // namespace

extern "C" {

const char* epcc_table_meta_error(void) { return g_error; }

int epcc_table_meta_abi(void) { return kMetaAbi; }

// Load every kernel of this file now (the launcher does the same for its own, epcc_cuda_create):
// with lazy loading the first launch of a kernel loads it, and loading waits for the device while
// holding the context, so a zero_partials first launched behind a dispatch kernel that waits for
// the GPU proxy would block the proxy thread's CUDA calls, and the dispatch, for good.
int epcc_table_meta_load(void) {
  cudaFuncAttributes attr;
  cudaError_t e;
  if ((e = cudaFuncGetAttributes(&attr, gather_copy)) != cudaSuccess ||
      (e = cudaFuncGetAttributes(&attr, gather_signal_wait)) != cudaSuccess ||
      (e = cudaFuncGetAttributes(&attr, zero_partials)) != cudaSuccess ||
      (e = cudaFuncGetAttributes(&attr, copy_rows)) != cudaSuccess ||
      (e = cudaFuncGetAttributes(&attr, epcc::meta::meta_count)) != cudaSuccess ||
      (e = cudaFuncGetAttributes(&attr, epcc::meta::meta_scan)) != cudaSuccess ||
      (e = cudaFuncGetAttributes(&attr, epcc::meta::meta_rows)) != cudaSuccess ||
      (e = cudaFuncGetAttributes(&attr, epcc::meta::meta_items)) != cudaSuccess)
    return fail(e, "load the metadata kernels");
  return 0;
}

// The layout of a gather area: out[0] its bytes, out[1..3] the offsets of the token counts, the
// top-k indices and the weights (the flags are at 0).
void epcc_table_meta_area(int num_ranks, int max_tokens, int topk, uint64_t* out) {
  Exchange x{};
  x.num_ranks = num_ranks;
  x.max_tokens = max_tokens;
  x.k = topk;
  out[0] = area_weights(x) + 4ull * num_ranks * max_tokens * topk;
  out[1] = area_tokens(x);
  out[2] = area_topk(x);
  out[3] = area_weights(x);
}

// The scratch's words; `layout` (epcc::meta::kLayout words, may be null) where its regions start.
int64_t epcc_table_meta_scratch_words(const int64_t* prog_host, int64_t* layout) {
  return epcc::meta::scratch_words(reinterpret_cast<const long long*>(prog_host),
                                   reinterpret_cast<long long*>(layout));
}

// The exchange and the metadata kernels of one dispatch, on `stream`.
int epcc_table_meta(const EpccTableMeta* m, uint64_t stream) {
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  cudaError_t e;
  gather_copy<<<m->grid_copy, 256, 0, s>>>(*m);
  if ((e = cudaGetLastError()) != cudaSuccess) return fail(e, "launch gather_copy");
  gather_signal_wait<<<1, 64, 0, s>>>(m->exchange);
  if ((e = cudaGetLastError()) != cudaSuccess) return fail(e, "launch gather_signal_wait");
  epcc::meta::meta_count<<<m->grid_count, kBlock, 0, s>>>(m->args);
  epcc::meta::meta_scan<<<1, kScan, 0, s>>>(m->args);
  epcc::meta::meta_rows<<<m->grid_rows + m->grid_count, kBlock, 0, s>>>(m->args);  // rows, received rows
  if (m->grid_items) epcc::meta::meta_items<<<m->grid_items, kBlock, 0, s>>>(m->args);
  if ((e = cudaGetLastError()) != cudaSuccess) return fail(e, "launch the metadata kernels");
  return 0;
}

// The first *count rows (row_bytes each, a multiple of 16) of src into dst, on `stream`.
int epcc_table_meta_copy_rows(uint64_t dst, uint64_t src, uint64_t count, uint64_t row_bytes, uint64_t stream) {
  copy_rows<<<264, 256, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src), reinterpret_cast<const int*>(count),
      row_bytes / 16);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : fail(e, "launch copy_rows");
}

// The combine's partial buffers of this rank, cleared (before the combine kernel, on its stream).
int epcc_table_meta_zero(const uint8_t* combine_blob, const uint64_t* buffers, uint64_t stream) {
  zero_partials<<<264, 256, 0, reinterpret_cast<cudaStream_t>(stream)>>>(combine_blob, buffers);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : fail(e, "launch zero_partials");
}

}  // extern "C"
