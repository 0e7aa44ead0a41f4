// epcc/prelude/cuda.cuh: the device prelude of the CUDA target (sm_90a).  The table-driven kernels
// (the generated device header) and the metadata kernels use these names wherever CUDA and SUPA
// differ; epcc/prelude/supa.suh defines the same names for SUPA (backends/target.py lists what
// differs).  Shipped with epcc, copied unchanged into every bundle that includes it.
//
//   EPCC_TID, EPCC_BID, EPCC_BDIM, EPCC_GDIM   threadIdx.x, blockIdx.x, blockDim.x, gridDim.x
//   EPCC_GRID_CONSTANT                          a kernel parameter the kernel does not write
//   epcc::bf16, bf16x2, V16, V8, F4             bf16 scalar and pair; 16-, 8-byte vectors; 4 floats
//   epcc::ld_ro / ld_cg / ld_cs                  read-only (__ldg), L2-only (__ldcg), streaming (__ldcs) loads
//   epcc::globaltimer()                          nanoseconds (%globaltimer)
//   epcc::ld_acquire_sys, st_release_sys, red_release_sys_add   counters and flags, system scope
//   epcc::ld_relaxed_sys                          a word a peer stores whole (data with its own tag), system scope
//   epcc::ld_acquire_gpu (u64, s32)               counters read by this GPU's own blocks, GPU scope (CUDA only)
//   epcc::red_add_f32, _f32x2, _f32x4            fp32 accumulate, relaxed, system scope
//   epcc::backoff(ns), trap(), lane0_broadcast(v), popc(v)
//   epcc::ballot(p), EPCC_HAS_BALLOT              the full warp's predicates as a 32-bit word (SUPA: none)
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#define EPCC_TID threadIdx.x
#define EPCC_BID blockIdx.x
#define EPCC_BDIM blockDim.x
#define EPCC_GDIM gridDim.x
#define EPCC_GRID_CONSTANT __grid_constant__

namespace epcc {

using bf16 = __nv_bfloat16;
using bf16x2 = __nv_bfloat162;
using V16 = int4;
using V8 = int2;
using F4 = float4;

__host__ __device__ __forceinline__ float bf16_to_f32(bf16 b) { return __bfloat162float(b); }
__host__ __device__ __forceinline__ bf16 f32_to_bf16(float x) { return __float2bfloat16_rn(x); }
__device__ __forceinline__ bf16x2 f32x2_to_bf16x2(float a, float b) { return __floats2bfloat162_rn(a, b); }

template <class T>
__device__ __forceinline__ T ld_ro(const T* p) { return __ldg(p); }
template <class T>
__device__ __forceinline__ T ld_cg(const T* p) { return __ldcg(p); }
template <class T>
__device__ __forceinline__ T ld_cs(const T* p) { return __ldcs(p); }

__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t ld_acquire_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int32_t ld_acquire_gpu(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void red_release_sys_add(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void red_add_f32(float* p, float v) {
  asm volatile("red.relaxed.sys.global.add.f32 [%0], %1;" : : "l"(p), "f"(v) : "memory");
}

__device__ __forceinline__ void red_add_f32x2(float* p, float x, float y) {
  asm volatile("red.relaxed.sys.global.add.v2.f32 [%0], {%1, %2};" : : "l"(p), "f"(x), "f"(y) : "memory");
}

__device__ __forceinline__ void red_add_f32x4(float* p, float x, float y, float z, float w) {
  asm volatile("red.relaxed.sys.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
               : : "l"(p), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
}

__device__ __forceinline__ void backoff(uint32_t ns) { __nanosleep(ns); }

__device__ __forceinline__ void trap() { __trap(); }

// Lane 0's value in every lane of the (full) warp.
__device__ __forceinline__ uint32_t lane0_broadcast(uint32_t v) { return __shfl_sync(0xffffffffu, v, 0); }

__device__ __forceinline__ int popc(unsigned v) { return __popc(v); }

// Lane i's predicate as bit i, every lane of the (full) warp taking part.
#define EPCC_HAS_BALLOT 1
__device__ __forceinline__ uint32_t ballot(bool p) { return __ballot_sync(0xffffffffu, p); }

}  // namespace epcc
