// submit_probe.cu - which CUDA calls of a second host thread wait while a first thread is inside a
// copy into pageable memory that is queued behind a running kernel.
//
// This is the situation of the GPU proxy path (docs/rdma.md): a kernel waits for a host thread
// (the proxy) that must submit CUDA work, while the caller reads a result into pageable memory.
// A kernel spins on one GPU until a host-mapped word says stop; the first thread copies from the
// device into pageable (or, for comparison, waits on the stream); the second tries each call in
// turn and reports whether it returned within 0.5 s.  The kernel is stopped once every call was
// tried, so every blocked call returns in the end.
//
//   nvcc -O2 -std=c++17 -arch=sm_90 -o submit_probe bench/submit_probe.cu
//   ./submit_probe pageable legacy       # the copy on the legacy default stream (PyTorch's default)
//   ./submit_probe pageable legacy-wait  # the kernel on a stream of its own, the default stream waiting on its event
//   ./submit_probe pageable own          # the kernel and the copy on a created non-blocking stream
//   ./submit_probe sync legacy           # the first thread synchronizes the default stream instead
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

__global__ void spin(volatile int* stop) {
  while (*stop == 0) __nanosleep(1000);
}

__global__ void copy_kernel(const int4* src, int4* dst, size_t n) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] = src[i];
}

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static int usage() {
  std::fprintf(stderr, "usage: submit_probe {pageable|sync} {legacy|legacy-wait|own}\n");
  return 2;
}

#define CHECK(x)                                                                                   \
  do {                                                                                             \
    cudaError_t e_ = (x);                                                                          \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "submit_probe: %s: %s\n", #x, cudaGetErrorString(e_));                  \
      return 1;                                                                                    \
    }                                                                                              \
  } while (0)

int main(int argc, char** argv) {
  if (argc != 3) return usage();
  const bool pageable = !std::strcmp(argv[1], "pageable");
  const char* where = argv[2];
  if ((!pageable && std::strcmp(argv[1], "sync")) ||
      (std::strcmp(where, "legacy") && std::strcmp(where, "legacy-wait") && std::strcmp(where, "own")))
    return usage();
  CHECK(cudaSetDevice(0));
  int* stop_host;
  int* stop_dev;
  CHECK(cudaHostAlloc(&stop_host, sizeof(int), cudaHostAllocMapped));
  *stop_host = 0;
  CHECK(cudaHostGetDevicePointer(&stop_dev, stop_host, 0));
  const size_t bytes = 1 << 20;
  void *a, *b, *pinned;
  CHECK(cudaMalloc(&a, bytes));
  CHECK(cudaMalloc(&b, bytes));
  CHECK(cudaHostAlloc(&pinned, bytes, 0));
  cudaStream_t own, other;
  CHECK(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  cudaEvent_t ev, spun;
  CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CHECK(cudaEventCreateWithFlags(&spun, cudaEventDisableTiming));
  copy_kernel<<<1, 32, 0, other>>>(static_cast<int4*>(a), static_cast<int4*>(b), 16);  // loaded before
  CHECK(cudaStreamSynchronize(other));

  cudaStream_t spin_stream = !std::strcmp(where, "legacy") ? nullptr : own;
  cudaStream_t wait_stream = !std::strcmp(where, "own") ? own : nullptr;
  spin<<<1, 1, 0, spin_stream>>>(stop_dev);
  if (!std::strcmp(where, "legacy-wait")) {
    CHECK(cudaEventRecord(spun, own));
    CHECK(cudaStreamWaitEvent(nullptr, spun, 0));
  }
  std::vector<char> host(bytes);
  std::atomic<bool> started{false};
  std::thread first([&] {
    started = true;
    const double t0 = now();
    const cudaError_t e = pageable ? cudaMemcpyAsync(host.data(), a, bytes, cudaMemcpyDeviceToHost, wait_stream)
                                   : cudaStreamSynchronize(wait_stream);
    std::printf("first thread (%s, %s): returned after %.3f s (%s)\n", argv[1], where, now() - t0,
                cudaGetErrorString(e));
  });
  while (!started) std::this_thread::yield();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));

  const std::vector<std::pair<const char*, std::function<cudaError_t()>>> calls = {
      {"cudaEventRecord", [&] { return cudaEventRecord(ev, other); }},
      {"cudaEventQuery", [&] { return cudaEventQuery(ev); }},
      {"cudaStreamQuery", [&] { return cudaStreamQuery(other); }},
      {"kernel launch", [&] {
         copy_kernel<<<4, 256, 0, other>>>(static_cast<int4*>(a), static_cast<int4*>(b), bytes / 16);
         return cudaGetLastError();
       }},
      {"cudaMemcpyAsync D2D", [&] { return cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, other); }},
      {"cudaMemcpyAsync H2D pinned", [&] { return cudaMemcpyAsync(a, pinned, 8, cudaMemcpyHostToDevice, other); }},
      {"cudaMemcpyAsync D2H pinned", [&] { return cudaMemcpyAsync(pinned, a, 8, cudaMemcpyDeviceToHost, other); }},
      {"cudaStreamSynchronize", [&] { return cudaStreamSynchronize(other); }},
  };
  std::vector<std::thread> blocked;
  for (const auto& call : calls) {
    auto done = std::make_shared<std::atomic<bool>>(false);
    auto rc = std::make_shared<cudaError_t>(cudaSuccess);
    const double t0 = now();
    std::thread t([done, rc, f = call.second] {
      *rc = f();
      *done = true;
    });
    while (!*done && now() - t0 < 0.5) std::this_thread::sleep_for(std::chrono::microseconds(50));
    if (*done) {
      std::printf("  %-28s returned in %8.1f us (%s)\n", call.first, (now() - t0) * 1e6, cudaGetErrorString(*rc));
      t.join();
    } else {
      std::printf("  %-28s BLOCKED > 0.5 s\n", call.first);
      blocked.push_back(std::move(t));
    }
  }
  *stop_host = 1;
  for (auto& t : blocked) t.join();
  first.join();
  CHECK(cudaDeviceSynchronize());
  return 0;
}
