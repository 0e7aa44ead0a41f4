// epcc_supa_api.h: the one header through which epcc's emitted SUPA host code (the launcher and
// the metadata driver) reaches the SUPA runtime.  Emitted code calls only the epcc_rt_* names
// declared here; which runtime they reach is chosen when the bundle is compiled:
//
//   EPCC_SUPA_API_V1   the BIRENSUPA SDK 1.x runtime: su* names, <supa.h>, libsupa-runtime
//   (default)          the torch_supa-era runtime: supa* names, <supa_runtime.h>, libsupart
//   EPCC_SUPA_SHIM     either of the two, through epcc_supa_shim.cuh (the su* and supa* names
//                      on CUDA): nvcc compiles the bundle and it runs on NVIDIA GPUs
//
// Every wrapper returns the runtime's own status (epcc_rt_status_t; EPCC_RT_OK is success).  The
// arguments are in CUDA's order; the wrappers reorder where a generation differs (SDK 1.x's
// suMemcpyAsync takes the stream before the copy kind).  Each runtime name, its source and
// whether its signature is verified: docs/supa.md.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <tuple>
#include <type_traits>
#include <utility>

#if defined(EPCC_SUPA_SHIM)
#include "epcc_supa_shim.cuh"
#elif defined(EPCC_SUPA_API_V1)
#include <supa.h>
#else
#include <supa_runtime.h>
#endif

#if defined(EPCC_SUPA_API_V1)
#define EPCC_RT_API "su (BIRENSUPA SDK 1.x)"
typedef suError_t epcc_rt_status_t;
typedef suStream_t epcc_rt_stream_t;
typedef suIpcMemHandle_t epcc_rt_ipc_handle_t;
typedef suDeviceProp epcc_rt_device_prop_t;
typedef suEvent_t epcc_rt_event_t;
#define EPCC_RT_OK suSuccess
#define EPCC_RT_H2D suMemcpyHostToDevice
#define EPCC_RT_D2H suMemcpyDeviceToHost
#define EPCC_RT_D2D suMemcpyDeviceToDevice
#else
#define EPCC_RT_API "supa (torch_supa runtime)"
typedef supaError_t epcc_rt_status_t;
typedef supaStream_t epcc_rt_stream_t;
typedef supaIpcMemHandle_t epcc_rt_ipc_handle_t;
typedef supaDeviceProp epcc_rt_device_prop_t;
typedef supaEvent_t epcc_rt_event_t;
#define EPCC_RT_OK supaSuccess
#define EPCC_RT_H2D supaMemcpyHostToDevice
#define EPCC_RT_D2H supaMemcpyDeviceToHost
#define EPCC_RT_D2D supaMemcpyDeviceToDevice
#endif

// ------------------------------------------------------------------------------------------ errors
static inline const char* epcc_rt_error_string(epcc_rt_status_t e) {
#if defined(EPCC_SUPA_API_V1)
  return suGetErrorString(e);
#else
  return supaGetErrorString(e);
#endif
}

// The last error of this host thread (and clears it), e.g. after an asynchronous launch.
static inline epcc_rt_status_t epcc_rt_last_error(void) {
#if defined(EPCC_SUPA_API_V1)
  return suGetLastError();
#else
  return supaGetLastError();
#endif
}

// ------------------------------------------------------------------------------------------ devices
static inline epcc_rt_status_t epcc_rt_set_device(int device) {
#if defined(EPCC_SUPA_API_V1)
  return suSetDevice(device);
#else
  return supaSetDevice(device);
#endif
}

// The device's warp width and compute units (CUs), from its properties: never assumed.
static inline epcc_rt_status_t epcc_rt_device_shape(int device, int* warp_size, int* compute_units) {
  epcc_rt_device_prop_t prop;
#if defined(EPCC_SUPA_API_V1)
  const epcc_rt_status_t e = suGetDeviceProperties(&prop, device);
#else
  const epcc_rt_status_t e = supaGetDeviceProperties(&prop, device);
#endif
  if (e != EPCC_RT_OK) return e;
  *warp_size = prop.warpSize;
  *compute_units = prop.multiProcessorCount;
  return EPCC_RT_OK;
}

// The device clock in kHz (what turns clock64() ticks into time on the SDK 1.x path).
static inline epcc_rt_status_t epcc_rt_clock_khz(int device, int* khz) {
#if defined(EPCC_SUPA_API_V1)
  return suDeviceGetAttribute(khz, suDevAttrClockRate, device);
#else
  return supaDeviceGetAttribute(khz, supaDevAttrClockRate, device);
#endif
}

// ------------------------------------------------------------------------------------------ memory
template <class T>
static inline epcc_rt_status_t epcc_rt_malloc(T** ptr, size_t bytes) {
#if defined(EPCC_SUPA_API_V1)
  return suMallocDevice(reinterpret_cast<void**>(ptr), bytes);
#else
  return supaMalloc(reinterpret_cast<void**>(ptr), bytes);
#endif
}

static inline epcc_rt_status_t epcc_rt_free(void* ptr) {
#if defined(EPCC_SUPA_API_V1)
  return suFree(ptr);
#else
  return supaFree(ptr);
#endif
}

static inline epcc_rt_status_t epcc_rt_memset(void* ptr, int value, size_t bytes) {
#if defined(EPCC_SUPA_API_V1)
  return suMemset(ptr, value, bytes);
#else
  return supaMemset(ptr, value, bytes);
#endif
}

static inline epcc_rt_status_t epcc_rt_memset_async(void* ptr, int value, size_t bytes, epcc_rt_stream_t stream) {
#if defined(EPCC_SUPA_API_V1)
  return suMemsetAsync(ptr, value, bytes, stream);
#else
  return supaMemsetAsync(ptr, value, bytes, stream);
#endif
}

template <class Kind>
static inline epcc_rt_status_t epcc_rt_memcpy(void* dst, const void* src, size_t bytes, Kind kind) {
#if defined(EPCC_SUPA_API_V1)
  return suMemcpy(dst, src, bytes, kind);
#else
  return supaMemcpy(dst, src, bytes, kind);
#endif
}

// Stream-ordered copy, CUDA's argument order; SDK 1.x takes the stream before the kind [G, D, H].
template <class Kind>
static inline epcc_rt_status_t epcc_rt_memcpy_async(void* dst, const void* src, size_t bytes, Kind kind,
                                                    epcc_rt_stream_t stream) {
#if defined(EPCC_SUPA_API_V1)
  return suMemcpyAsync(dst, src, bytes, stream, kind);
#else
  return supaMemcpyAsync(dst, src, bytes, kind, stream);
#endif
}

static inline epcc_rt_status_t epcc_rt_stream_synchronize(epcc_rt_stream_t stream) {
#if defined(EPCC_SUPA_API_V1)
  return suStreamSynchronize(stream);
#else
  return supaStreamSynchronize(stream);
#endif
}

// ------------------------------------------------------------------------------------------ streams, events
// A stream that never waits for the legacy default stream (the DMA lanes run beside a kernel
// that may have been launched there, and wait for it through counters, not stream order).
static inline epcc_rt_status_t epcc_rt_stream_create_nonblocking(epcc_rt_stream_t* stream) {
#if defined(EPCC_SUPA_API_V1)
  return suStreamCreateWithFlags(stream, suStreamNonBlocking);
#else
  return supaStreamCreateWithFlags(stream, supaStreamNonBlocking);
#endif
}

static inline epcc_rt_status_t epcc_rt_stream_destroy(epcc_rt_stream_t stream) {
#if defined(EPCC_SUPA_API_V1)
  return suStreamDestroy(stream);
#else
  return supaStreamDestroy(stream);
#endif
}

static inline epcc_rt_status_t epcc_rt_event_create(epcc_rt_event_t* event) {
#if defined(EPCC_SUPA_API_V1)
  return suEventCreate(event);
#else
  return supaEventCreate(event);
#endif
}

static inline epcc_rt_status_t epcc_rt_event_destroy(epcc_rt_event_t event) {
#if defined(EPCC_SUPA_API_V1)
  return suEventDestroy(event);
#else
  return supaEventDestroy(event);
#endif
}

static inline epcc_rt_status_t epcc_rt_event_record(epcc_rt_event_t event, epcc_rt_stream_t stream) {
#if defined(EPCC_SUPA_API_V1)
  return suEventRecord(event, stream);
#else
  return supaEventRecord(event, stream);
#endif
}

// Work queued on `stream` after this call waits until `event` (as last recorded) has completed.
static inline epcc_rt_status_t epcc_rt_stream_wait_event(epcc_rt_stream_t stream, epcc_rt_event_t event) {
#if defined(EPCC_SUPA_API_V1)
  return suStreamWaitEvent(stream, event);
#else
  return supaStreamWaitEvent(stream, event, 0);
#endif
}

// ------------------------------------------------------------------------------------------ IPC
static inline epcc_rt_status_t epcc_rt_ipc_get_handle(epcc_rt_ipc_handle_t* handle, void* ptr) {
#if defined(EPCC_SUPA_API_V1)
  return suIpcGetMemHandle(handle, ptr);
#else
  return supaIpcGetMemHandle(handle, ptr);
#endif
}

// Maps a peer process's allocation here, enabling peer access as it is needed.
static inline epcc_rt_status_t epcc_rt_ipc_open_handle(void** ptr, epcc_rt_ipc_handle_t handle) {
#if defined(EPCC_SUPA_API_V1)
  return suIpcOpenMemHandle(ptr, handle, suIpcMemLazyEnablePeerAccess);
#else
  return supaIpcOpenMemHandle(ptr, handle, supaIpcMemLazyEnablePeerAccess);
#endif
}

static inline epcc_rt_status_t epcc_rt_ipc_close_handle(void* ptr) {
#if defined(EPCC_SUPA_API_V1)
  return suIpcCloseMemHandle(ptr);
#else
  return supaIpcCloseMemHandle(ptr);
#endif
}

// ------------------------------------------------------------------------------------------ launch
// epcc_rt_launch(kernel, grid, block, shared_bytes, stream, args...): each argument converted to
// the kernel's parameter type first (a literal 0 for a uint64_t parameter is passed as 8 bytes).
template <class... P, class... A>
static inline epcc_rt_status_t epcc_rt_launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t shared_bytes,
                                              epcc_rt_stream_t stream, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "epcc_rt_launch: the argument count differs from the kernel's");
#if defined(EPCC_SUPA_API_V1)
  // SDK 1.x: suLaunchKernel(fn, grid, block, shmem, stream, args...) [G, B]; its return type is
  // UNVERIFIED, so the status is read back with suGetLastError(), as SDK 1.x code does.
  suLaunchKernel(kernel, grid, block, static_cast<unsigned int>(shared_bytes), stream,
                 static_cast<typename std::decay<P>::type>(std::forward<A>(args))...);
  return suGetLastError();
#else
  // supaLaunchKernel(fn, grid, block, void** args, shmem, stream) [T]
  std::tuple<typename std::decay<P>::type...> values(std::forward<A>(args)...);
  void* argv[sizeof...(P) > 0 ? sizeof...(P) : 1] = {};
  std::apply([&argv](auto&... v) {
    size_t i = 0;
    ((argv[i++] = static_cast<void*>(&v)), ...);
  }, values);
  return supaLaunchKernel(reinterpret_cast<const void*>(kernel), grid, block, argv, shared_bytes, stream);
#endif
}

// ------------------------------------------------------------------------------------------ duplicate mode
// epcc_rt_launch_dies(kernel, grid, block, shared_bytes, device0, stream0, arg0, device1, stream1,
// arg1): one call that launches `kernel` on both dies of a card (a plan's duplicate pair,
// manifest "duplicate"), die 0 with arg0 on device0 / stream0, die 1 with arg1 on device1 / stream1.
//
// No public SUPA runtime launches one kernel on a card's two dies with an argument per die: SDK
// 1.x's suLaunchKernel2DieDup [G] passes both dies the same arguments (each die finds its data in
// its own partition of UMA16 memory) and is documented only for dies that exchange no data,
// which epcc's dies do over D2D; the newer runtime shows no duplicate launch at all.  So this is
// the one place a per-die duplicate launch plugs in: an SDK that has one defines
// EPCC_SUPA_LAUNCH_DIES(kernel, grid, block, shared_bytes, device0, stream0, arg0, device1,
// stream1, arg1) to it (the shim defines it over CUDA: a GPU per die).  Without it the call launches
// the two dies one after the other through epcc_rt_launch, each die as its own device.
template <class P, class A>
static inline epcc_rt_status_t epcc_rt_launch_dies(void (*kernel)(P), dim3 grid, dim3 block, size_t shared_bytes,
                                                   int device0, epcc_rt_stream_t stream0, const A& arg0, int device1,
                                                   epcc_rt_stream_t stream1, const A& arg1) {
#if defined(EPCC_SUPA_LAUNCH_DIES)
  return EPCC_SUPA_LAUNCH_DIES(kernel, grid, block, shared_bytes, device0, stream0, arg0, device1, stream1, arg1);
#else
  epcc_rt_status_t e = epcc_rt_set_device(device0);
  if (e == EPCC_RT_OK) e = epcc_rt_launch(kernel, grid, block, shared_bytes, stream0, arg0);
  if (e == EPCC_RT_OK) e = epcc_rt_set_device(device1);
  if (e == EPCC_RT_OK) e = epcc_rt_launch(kernel, grid, block, shared_bytes, stream1, arg1);
  return e;
#endif
}
