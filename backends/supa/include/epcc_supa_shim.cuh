// epcc_supa_shim.cuh: SUPA on CUDA.  The SUPA built-ins and runtime calls epcc's SUPA sources use
// (through epcc/prelude/supa.suh and epcc_supa_api.h), each with the signature docs/supa.md
// records for it, defined over CUDA, so that nvcc compiles every emitted .su as CUDA
// (`nvcc -x cu -DEPCC_SUPA_SHIM`, with -DEPCC_SUPA_API_V1 for the SDK 1.x names) and the kernels
// run on NVIDIA GPUs.  Both runtime generations are defined here: su* (SDK 1.x) and supa*
// (torch_supa era).  This verifies what the sources ask of SUPA (names, argument orders, types
// the wrappers pass) against the surveyed signatures, and runs the kernels' logic; it says
// nothing of brcc or of Biren hardware.
#pragma once

#if !defined(__CUDACC__)
#error "epcc_supa_shim.cuh maps SUPA onto CUDA: compile with nvcc -x cu"
#endif

#include <cuda/atomic>
#include <cuda_runtime.h>

#include <cstring>

// ---------------------------------------------------------------------------------- device built-ins
// SDK 1.x spells the thread and block indices thread_idx, block_idx, block_dim, grid_dim [G].
#define thread_idx threadIdx
#define block_idx blockIdx
#define block_dim blockDim
#define grid_dim gridDim

// torch_supa's system-scope atomics [T]: supa::atomic_ref<T, supa::thread_scope_system> and
// supa::std::memory_order_*, as libcu++'s cuda:: ones they mirror.
namespace supa {
using ::cuda::atomic_ref;
using ::cuda::thread_scope_system;
namespace std {
using ::cuda::std::memory_order_acquire;
using ::cuda::std::memory_order_relaxed;
using ::cuda::std::memory_order_release;
}  // namespace std
}  // namespace supa

// ---------------------------------------------------------------------------------- SDK 1.x: su*
typedef cudaError_t suError_t;
constexpr suError_t suSuccess = cudaSuccess;
constexpr suError_t suErrorInvalidValue = cudaErrorInvalidValue;
typedef cudaStream_t suStream_t;
typedef cudaIpcMemHandle_t suIpcMemHandle_t;
typedef cudaMemcpyKind suMemcpyKind;
constexpr suMemcpyKind suMemcpyHostToDevice = cudaMemcpyHostToDevice;
constexpr suMemcpyKind suMemcpyDeviceToHost = cudaMemcpyDeviceToHost;
constexpr suMemcpyKind suMemcpyDeviceToDevice = cudaMemcpyDeviceToDevice;
constexpr suMemcpyKind suMemcpyDefault = cudaMemcpyDefault;
constexpr unsigned int suIpcMemLazyEnablePeerAccess = cudaIpcMemLazyEnablePeerAccess;
enum suDeviceAttr { suDevAttrClockRate = cudaDevAttrClockRate };

// The fields of suDeviceProp that sources show [D, H].
struct suDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  int major, minor, multiProcessorCount, warpSize;
};

inline const char* suGetErrorString(suError_t e) { return cudaGetErrorString(e); }
inline suError_t suGetLastError() { return cudaGetLastError(); }
inline suError_t suSetDevice(int device) { return cudaSetDevice(device); }
inline suError_t suGetDeviceProperties(suDeviceProp* prop, int device) {
  cudaDeviceProp c;
  const cudaError_t e = cudaGetDeviceProperties(&c, device);
  if (e != cudaSuccess) return e;
  std::memcpy(prop->name, c.name, sizeof prop->name);
  prop->totalGlobalMem = c.totalGlobalMem;
  prop->major = c.major;
  prop->minor = c.minor;
  prop->multiProcessorCount = c.multiProcessorCount;
  prop->warpSize = c.warpSize;
  return cudaSuccess;
}
inline suError_t suDeviceGetAttribute(int* value, suDeviceAttr attr, int device) {
  return cudaDeviceGetAttribute(value, static_cast<cudaDeviceAttr>(attr), device);
}
inline suError_t suMallocDevice(void** ptr, size_t bytes) { return cudaMalloc(ptr, bytes); }
inline suError_t suFree(void* ptr) { return cudaFree(ptr); }
inline suError_t suMemset(void* ptr, int value, size_t bytes) { return cudaMemset(ptr, value, bytes); }
inline suError_t suMemsetAsync(void* ptr, int value, size_t bytes, suStream_t stream) {
  return cudaMemsetAsync(ptr, value, bytes, stream);
}
inline suError_t suMemcpy(void* dst, const void* src, size_t bytes, suMemcpyKind kind = suMemcpyDefault) {
  return cudaMemcpy(dst, src, bytes, kind);
}
// SDK 1.x order: the stream before the kind [G, D, H, M1].
inline suError_t suMemcpyAsync(void* dst, const void* src, size_t bytes, suStream_t stream = nullptr,
                               suMemcpyKind kind = suMemcpyDefault) {
  return cudaMemcpyAsync(dst, src, bytes, kind, stream);
}
inline suError_t suStreamSynchronize(suStream_t stream) { return cudaStreamSynchronize(stream); }
constexpr unsigned int suStreamNonBlocking = cudaStreamNonBlocking;
inline suError_t suStreamCreateWithFlags(suStream_t* stream, unsigned int flags) {
  return cudaStreamCreateWithFlags(stream, flags);
}
inline suError_t suStreamDestroy(suStream_t stream) { return cudaStreamDestroy(stream); }
typedef cudaEvent_t suEvent_t;
inline suError_t suEventCreate(suEvent_t* event) { return cudaEventCreate(event); }
inline suError_t suEventDestroy(suEvent_t event) { return cudaEventDestroy(event); }
inline suError_t suEventRecord(suEvent_t event, suStream_t stream = nullptr) { return cudaEventRecord(event, stream); }
// SDK 1.x: suStreamWaitEvent(stream, event), no flags [G, D].
inline suError_t suStreamWaitEvent(suStream_t stream, suEvent_t event) { return cudaStreamWaitEvent(stream, event, 0); }
inline suError_t suIpcGetMemHandle(suIpcMemHandle_t* handle, void* ptr) { return cudaIpcGetMemHandle(handle, ptr); }
inline suError_t suIpcOpenMemHandle(void** ptr, suIpcMemHandle_t handle, unsigned int flags) {
  return cudaIpcOpenMemHandle(ptr, handle, flags);
}
inline suError_t suIpcCloseMemHandle(void* ptr) { return cudaIpcCloseMemHandle(ptr); }

// suLaunchKernel(fn, grid, block, shmem, stream, args...) [G, B]: the arguments by value, packed
// here as cudaLaunchKernel takes them.  Returns nothing (its return type is UNVERIFIED): the
// status is suGetLastError()'s.
template <class... P, class... A>
inline void suLaunchKernel(void (*kernel)(P...), dim3 grid, dim3 block, unsigned int shared_bytes, suStream_t stream,
                           A... args) {
  static_assert(sizeof...(P) == sizeof...(A), "suLaunchKernel: the argument count differs from the kernel's");
  void* argv[sizeof...(A) > 0 ? sizeof...(A) : 1] = {static_cast<void*>(&args)...};
  (void)cudaLaunchKernel(reinterpret_cast<const void*>(kernel), grid, block, argv, shared_bytes, stream);
}

// ---------------------------------------------------------------------------------- newer: supa*
typedef cudaError_t supaError_t;
constexpr supaError_t supaSuccess = cudaSuccess;
typedef cudaStream_t supaStream_t;
typedef cudaIpcMemHandle_t supaIpcMemHandle_t;
typedef cudaMemcpyKind supaMemcpyKind;
constexpr supaMemcpyKind supaMemcpyHostToDevice = cudaMemcpyHostToDevice;
constexpr supaMemcpyKind supaMemcpyDeviceToHost = cudaMemcpyDeviceToHost;
constexpr supaMemcpyKind supaMemcpyDeviceToDevice = cudaMemcpyDeviceToDevice;
constexpr supaMemcpyKind supaMemcpyDefault = cudaMemcpyDefault;
constexpr unsigned int supaIpcMemLazyEnablePeerAccess = cudaIpcMemLazyEnablePeerAccess;
enum supaDeviceAttr { supaDevAttrClockRate = cudaDevAttrClockRate };
typedef suDeviceProp supaDeviceProp;

inline const char* supaGetErrorString(supaError_t e) { return cudaGetErrorString(e); }
inline supaError_t supaGetLastError() { return cudaGetLastError(); }
inline supaError_t supaSetDevice(int device) { return cudaSetDevice(device); }
inline supaError_t supaGetDeviceProperties(supaDeviceProp* prop, int device) {
  return suGetDeviceProperties(prop, device);
}
inline supaError_t supaDeviceGetAttribute(int* value, supaDeviceAttr attr, int device) {
  return cudaDeviceGetAttribute(value, static_cast<cudaDeviceAttr>(attr), device);
}
inline supaError_t supaMalloc(void** ptr, size_t bytes) { return cudaMalloc(ptr, bytes); }
inline supaError_t supaFree(void* ptr) { return cudaFree(ptr); }
inline supaError_t supaMemset(void* ptr, int value, size_t bytes) { return cudaMemset(ptr, value, bytes); }
inline supaError_t supaMemsetAsync(void* ptr, int value, size_t bytes, supaStream_t stream) {
  return cudaMemsetAsync(ptr, value, bytes, stream);
}
inline supaError_t supaMemcpy(void* dst, const void* src, size_t bytes, supaMemcpyKind kind) {
  return cudaMemcpy(dst, src, bytes, kind);
}
// CUDA's order [T].
inline supaError_t supaMemcpyAsync(void* dst, const void* src, size_t bytes, supaMemcpyKind kind, supaStream_t stream) {
  return cudaMemcpyAsync(dst, src, bytes, kind, stream);
}
inline supaError_t supaStreamSynchronize(supaStream_t stream) { return cudaStreamSynchronize(stream); }
// Signatures of CUDA's (UNVERIFIED for supa*: docs/supa.md).
constexpr unsigned int supaStreamNonBlocking = cudaStreamNonBlocking;
inline supaError_t supaStreamCreateWithFlags(supaStream_t* stream, unsigned int flags) {
  return cudaStreamCreateWithFlags(stream, flags);
}
inline supaError_t supaStreamDestroy(supaStream_t stream) { return cudaStreamDestroy(stream); }
typedef cudaEvent_t supaEvent_t;
inline supaError_t supaEventCreate(supaEvent_t* event) { return cudaEventCreate(event); }
inline supaError_t supaEventDestroy(supaEvent_t event) { return cudaEventDestroy(event); }
inline supaError_t supaEventRecord(supaEvent_t event, supaStream_t stream) { return cudaEventRecord(event, stream); }
inline supaError_t supaStreamWaitEvent(supaStream_t stream, supaEvent_t event, unsigned int flags) {
  return cudaStreamWaitEvent(stream, event, flags);
}
inline supaError_t supaIpcGetMemHandle(supaIpcMemHandle_t* handle, void* ptr) { return cudaIpcGetMemHandle(handle, ptr); }
inline supaError_t supaIpcOpenMemHandle(void** ptr, supaIpcMemHandle_t handle, unsigned int flags) {
  return cudaIpcOpenMemHandle(ptr, handle, flags);
}
inline supaError_t supaIpcCloseMemHandle(void* ptr) { return cudaIpcCloseMemHandle(ptr); }
// supaLaunchKernel(fn, grid, block, void** args, shmem, stream) [T].
inline supaError_t supaLaunchKernel(const void* kernel, dim3 grid, dim3 block, void** args, size_t shared_bytes,
                                    supaStream_t stream) {
  return cudaLaunchKernel(kernel, grid, block, args, shared_bytes, stream);
}

// ---------------------------------------------------------------------------------- duplicate mode
// epcc_supa_api.h's EPCC_SUPA_LAUNCH_DIES over CUDA, where each die of a card is a GPU: the kernel
// on device0's stream with arg0, then on device1's with arg1, from one call.
template <class P, class A>
inline cudaError_t epcc_shim_launch_dies(void (*kernel)(P), dim3 grid, dim3 block, size_t shared_bytes, int device0,
                                         cudaStream_t stream0, const A& arg0, int device1, cudaStream_t stream1,
                                         const A& arg1) {
  const int devices[2] = {device0, device1};
  cudaStream_t streams[2] = {stream0, stream1};
  A args[2] = {arg0, arg1};
  for (int die = 0; die < 2; ++die) {
    cudaError_t e = cudaSetDevice(devices[die]);
    void* argv[1] = {static_cast<void*>(&args[die])};
    if (e == cudaSuccess) e = cudaLaunchKernel(reinterpret_cast<const void*>(kernel), grid, block, argv, shared_bytes,
                                               streams[die]);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}
#define EPCC_SUPA_LAUNCH_DIES epcc_shim_launch_dies
