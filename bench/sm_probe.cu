// sm_probe: how many bytes per second one SM moves, by the copy methods epcc's kernels use, so that
// SM budgets are set against measured per-SM rates instead of guesses.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/sm_probe bench/sm_probe.cu
//   /tmp/sm_probe [--gpus N] [--mib M] [--blocks 1,2,4,8,16,24,32] [--only st,ld,red]
//
// One process drives every GPU (peer access enabled between all pairs).  In each trial every GPU
// runs the same kernel at once with B blocks (one per SM); each block copies its share of M MiB
// from a local source buffer in rows of 14336 bytes (one 7168-channel bf16 token) to:
//   peers  the row goes to the next peer GPU round robin (remote NVLink writes; what dispatch does)
//   self   the row goes to another buffer of the same GPU (HBM to HBM; what replication does)
// by one of:
//   st     every warp copies rows with 16-byte loads and stores, U (4, 8 or 16) vectors in flight
//          per lane (the loads of a round are all issued before its stores)
//   tma    one thread per block: bulk copy (cp.async.bulk) of the row into a shared-memory ring,
//          then a bulk store of it to the destination; DEPTH stores may still be reading
// and also the read side alone:
//   ld     every warp reads rows with 16-byte loads (and folds them, so they are not dead)
//   tmald  one thread per block bulk-loads rows into the shared-memory ring
// and the combine's reduction of bf16 rows into fp32, K = 4 rows per token (the expected expert
// rows of a token on a rank), a token's rows a quarter of the buffer apart (as in expert-major order):
//   red    every warp adds each bf16 row into its token's fp32 row with red.global.add.v4.f32
//          (what the table-driven combine roles do), UNROLL vectors in flight per lane
//   gather every warp reads a token's K rows, adds them in registers and writes its fp32 row once
//          (no atomics)
//   gred   what the combine roles do: a warp gathers a token's KK (2 or 4) rows, adds them and issues one
//          red.add per 4 channels into the token's fp32 row, on this GPU (self) or the next (peers)
// Reported for red/gather/gred: bf16 bytes read per second (the unit of `sm ... reduce` rates).
// Time: CUDA events around the kernel on each GPU, all GPUs launched together; the slowest GPU
// counts.  Reported: GB/s written (or read) per GPU, and per SM.  Bytes to self are counted only in
// the `self` rows.  Rows are 16-byte aligned; sizes are exact multiples of the row.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      fprintf(stderr, "sm_probe: %s: %s (%s:%d)\n", #x, cudaGetErrorString(e_), __FILE__, __LINE__); \
      exit(1);                                                                                \
    }                                                                                         \
  } while (0)

constexpr int ROW = 14336;          // bytes per row: 7168 bf16
constexpr int SMAX = 14;            // shared-memory ring stages (14 x 14336 = 196 KB)
constexpr int MAXG = 8;

struct Targets {
  char* dst[MAXG];                  // destination buffer of each GPU (peer pointers)
  int ndst;                          // destinations this GPU writes to, in dst order
  int order[MAXG];                   // which dst entries, round robin
};

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// One warp copies row r of src to its destination: U 16-byte vectors per lane loaded, then stored.
template <int U>
__device__ __forceinline__ void st_row(const char* __restrict__ src, const Targets& t, long long r, int lane) {
  constexpr int V = ROW / 16;
  const uint4* s = reinterpret_cast<const uint4*>(src + r * ROW);
  uint4* d = reinterpret_cast<uint4*>(t.dst[t.order[r % t.ndst]] + r * ROW);
  for (int v = lane; v < V; v += 32 * U) {
    uint4 x[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (v + 32 * u < V) x[u] = __ldg(s + v + 32 * u);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (v + 32 * u < V) d[v + 32 * u] = x[u];
  }
}

template <int U>
__global__ void __launch_bounds__(512, 1) copy_st(const char* __restrict__ src, Targets t, long long rows_per_block) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const long long r0 = blockIdx.x * rows_per_block;
  for (long long r = r0 + warp; r < r0 + rows_per_block; r += nw) st_row<U>(src, t, r, lane);
}

__global__ void __launch_bounds__(512, 1) read_ld(const char* __restrict__ src, long long rows_per_block, unsigned* sink) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const long long r0 = blockIdx.x * rows_per_block;
  constexpr int V = ROW / 16;
  unsigned acc = 0;
  for (long long r = r0 + warp; r < r0 + rows_per_block; r += nw) {
    const uint4* s = reinterpret_cast<const uint4*>(src + r * ROW);
    for (int v = lane; v < V; v += 128) {
      uint4 x[4];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (v + 32 * u < V) x[u] = __ldg(s + v + 32 * u);
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (v + 32 * u < V) acc ^= x[u].x ^ x[u].y ^ x[u].z ^ x[u].w;
    }
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // practically never: keeps the loads alive
}

// One thread: rows [r0, r0 + n) through a ring of S stages (ring, full: its shared memory and
// mbarriers); loads run S - depth ahead; `store` false = loads only.
__device__ void tma_rows(const char* __restrict__ src, const Targets& t, long long r0, long long n, int S, int depth,
                         int store, unsigned char* ring, unsigned long long* full) {
  for (int s = 0; s < S; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(&full[s])), "r"(1) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const int D = store ? S - depth : S;
  auto load = [&](long long i) {
    const int s = (int)(i % S);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&full[s])), "r"(ROW) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(ring + (size_t)s * ROW)), "l"(src + (r0 + i) * ROW), "r"(ROW), "r"(smem_addr(&full[s]))
                 : "memory");
  };
  for (long long i = 0; i < (D < n ? D : n); ++i) load(i);
  for (long long i = 0; i < n; ++i) {
    const int s = (int)(i % S);
    const unsigned phase = (unsigned)((i / S) & 1);
    unsigned done = 0;
    while (!done)
      asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                   : "=r"(done) : "r"(smem_addr(&full[s])), "r"(phase) : "memory");
    if (store) {
      const long long r = r0 + i;
      char* d = t.dst[t.order[r % t.ndst]] + r * ROW;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   ::"l"(d), "r"(smem_addr(ring + (size_t)s * ROW)), "r"(ROW) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    if (i + D < n) {
      if (store && i + D >= S) {
        switch (depth) {  // store i + D - S = i - depth has read its stage
          case 1: asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory"); break;
          case 2: asm volatile("cp.async.bulk.wait_group.read 2;" ::: "memory"); break;
          case 4: asm volatile("cp.async.bulk.wait_group.read 4;" ::: "memory"); break;
          case 8: asm volatile("cp.async.bulk.wait_group.read 8;" ::: "memory"); break;
          default: asm volatile("cp.async.bulk.wait_group.read 12;" ::: "memory"); break;
        }
      }
      load(i + D);
    }
  }
  if (store) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__global__ void __launch_bounds__(32, 1) copy_tma(const char* __restrict__ src, Targets t, long long rows_per_block,
                                                  int S, int depth, int store) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ unsigned long long full[SMAX];
  if (threadIdx.x != 0) return;
  tma_rows(src, t, blockIdx.x * rows_per_block, rows_per_block, S, depth, store, ring, full);
}

// Both copy paths of one SM at once: warps [0, SW) copy the first st_rows rows of the block's
// share with 16-byte loads and stores (4 in flight per lane); NI more warps each have one
// thread bulk-copy (TMA) a contiguous part of the rest through its own ring of S stages.  SW = 0
// is TMA alone from NI issuing threads.
__global__ void __launch_bounds__(512, 1) copy_mix(const char* __restrict__ src, Targets t, long long rows_per_block,
                                                   long long st_rows, int SW, int NI, int S, int depth) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ unsigned long long full[SMAX];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long r0 = blockIdx.x * rows_per_block;
  if (warp < SW) {
    for (long long r = r0 + warp; r < r0 + st_rows; r += SW) st_row<4>(src, t, r, lane);
  } else if (warp < SW + NI && lane == 0) {
    const int i = warp - SW;
    const long long rest = rows_per_block - st_rows, per = (rest + NI - 1) / NI;
    const long long a = r0 + st_rows + i * per, n = per < r0 + rows_per_block - a ? per : r0 + rows_per_block - a;
    if (n > 0) tma_rows(src, t, a, n, S, depth, 1, ring + (size_t)i * S * ROW, full + i * S);
  }
}

__device__ __forceinline__ void bf16x8_to_f32(const uint4& v, float* f) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ void red_add_v4(float* p, const float* x) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(x[0]), "f"(x[1]), "f"(x[2]), "f"(x[3])
               : "memory");
}

constexpr int K = 4;  // rows per token

// bf16 row r adds into fp32 token row r % q (q = rows / K): a token's rows are q apart.
template <int U>
__global__ void __launch_bounds__(512, 1) reduce_red(const char* __restrict__ src, char* dst, long long rows_per_block,
                                                     long long q) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const long long r0 = blockIdx.x * rows_per_block;
  constexpr int V = ROW / 16;
  for (long long r = r0 + warp; r < r0 + rows_per_block; r += nw) {
    const uint4* s = reinterpret_cast<const uint4*>(src + r * ROW);
    float* d = reinterpret_cast<float*>(dst + (r % q) * 2 * ROW);
    for (int v = lane; v < V; v += 32 * U) {
      uint4 x[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (v + 32 * u < V) x[u] = __ldcg(s + v + 32 * u);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (v + 32 * u >= V) break;
        float f[8];
        bf16x8_to_f32(x[u], f);
        red_add_v4(d + 8 * (v + 32 * u), f);
        red_add_v4(d + 8 * (v + 32 * u) + 4, f + 4);
      }
    }
  }
}

// acc = the sum of KK rows' 8 bf16 channels, in fp32.
template <int KK>
__device__ __forceinline__ void sum_bf16x8(const uint4 (&x)[KK], float (&acc)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;
#pragma unroll
  for (int j = 0; j < KK; ++j) {
    float f[8];
    bf16x8_to_f32(x[j], f);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] += f[i];
  }
}

// fp32 token row t = the sum of bf16 rows t, t + q, ..., t + (K - 1) q, written once.
__global__ void __launch_bounds__(512, 1) reduce_gather(const char* __restrict__ src, char* dst,
                                                        long long tokens_per_block, long long q) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const long long t0 = blockIdx.x * tokens_per_block;
  constexpr int V = ROW / 16;
  for (long long t = t0 + warp; t < t0 + tokens_per_block; t += nw) {
    float4* d = reinterpret_cast<float4*>(dst + t * 2 * ROW);
    for (int v = lane; v < V; v += 64) {
      uint4 x[2][K];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < K; ++j)
          if (v + 32 * h < V) x[h][j] = __ldcg(reinterpret_cast<const uint4*>(src + (t + j * q) * ROW) + v + 32 * h);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (v + 32 * h >= V) break;
        float acc[8];
        sum_bf16x8<K>(x[h], acc);
        d[2 * (v + 32 * h)] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        d[2 * (v + 32 * h) + 1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
      }
    }
  }
}

// The combine roles as they run now: a warp reads a token's KK rows, adds them in registers and adds
// the sum into the token's fp32 row with one red.global.add.v4.f32 per 4 channels: at `dst`, on
// this GPU (self) or on the next one over NVLink (peer: what intra/fwd/rdma roles do).
template <int KK>
__global__ void __launch_bounds__(512, 1) reduce_gred(const char* __restrict__ src, char* dst,
                                                      long long tokens_per_block, long long q) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const long long t0 = blockIdx.x * tokens_per_block;
  constexpr int V = ROW / 16;
  for (long long t = t0 + warp; t < t0 + tokens_per_block; t += nw) {
    float* d = reinterpret_cast<float*>(dst + t * 2 * ROW);
    for (int v = lane; v < V; v += 32) {
      uint4 x[KK];
#pragma unroll
      for (int j = 0; j < KK; ++j) x[j] = __ldcg(reinterpret_cast<const uint4*>(src + (t + j * q) * ROW) + v);
      float acc[8];
      sum_bf16x8<KK>(x, acc);
      red_add_v4(d + 8 * v, acc);
      red_add_v4(d + 8 * v + 4, acc + 4);
    }
  }
}

struct Gpu {
  char* src = nullptr;
  char* dst = nullptr;
  unsigned* sink = nullptr;
  cudaStream_t stream;
  cudaEvent_t a, b;
};

static std::vector<int> parse_list(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    v.push_back(atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return v;
}

int main(int argc, char** argv) {
  int ngpu = 0, mib = 512;
  std::vector<int> blocks = {1, 2, 4, 8, 16, 24, 32, 48};
  std::string only;                 // --only: a comma-separated list of methods to run
  CK(cudaGetDeviceCount(&ngpu));
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--gpus") && i + 1 < argc) ngpu = std::min(ngpu, atoi(argv[++i]));
    else if (!strcmp(argv[i], "--mib") && i + 1 < argc) mib = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--blocks") && i + 1 < argc) blocks = parse_list(argv[++i]);
    else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else { fprintf(stderr, "usage: sm_probe [--gpus N] [--mib M] [--blocks 1,2,4] [--only st,ld]\n"); return 1; }
  }
  if (ngpu < 2) { fprintf(stderr, "sm_probe: needs at least 2 GPUs, found %d\n", ngpu); return 1; }
  ngpu = std::min(ngpu, MAXG);
  const long long rows = (long long)mib * 1024 * 1024 / ROW;
  std::vector<Gpu> g(ngpu);
  for (int d = 0; d < ngpu; ++d) {
    CK(cudaSetDevice(d));
    for (int p = 0; p < ngpu; ++p)
      if (p != d) {
        cudaError_t e = cudaDeviceEnablePeerAccess(p, 0);
        if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) CK(e);
        cudaGetLastError();
      }
    CK(cudaMalloc(&g[d].src, rows * ROW));
    CK(cudaMalloc(&g[d].dst, rows * ROW));
    CK(cudaMalloc(&g[d].sink, 64));
    CK(cudaMemset(g[d].src, d + 1, rows * ROW));
    CK(cudaStreamCreateWithFlags(&g[d].stream, cudaStreamNonBlocking));
    CK(cudaEventCreate(&g[d].a));
    CK(cudaEventCreate(&g[d].b));
    CK(cudaFuncSetAttribute(copy_tma, cudaFuncAttributeMaxDynamicSharedMemorySize, SMAX * ROW));
    CK(cudaFuncSetAttribute(copy_mix, cudaFuncAttributeMaxDynamicSharedMemorySize, SMAX * ROW));
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("sm_probe: %d x %s, %d SMs each, %lld rows of %d B (%d MiB) per GPU per trial\n", ngpu, prop.name,
         prop.multiProcessorCount, rows, ROW, mib);
  printf("%-6s %-6s %-12s %6s %10s %12s %10s\n", "method", "to", "ring", "blocks", "ms", "GB/s/GPU", "GB/s/SM");

  struct Trial { const char* method; bool peers; int S, depth; };
  std::vector<Trial> trials = {
      {"st", true, 4, 0},  {"st", true, 8, 0},  {"st", true, 16, 0}, {"tma", true, 8, 4}, {"tma", true, 14, 12}, {"tma", true, 4, 2},
      {"st", false, 4, 0}, {"st", false, 8, 0}, {"st", false, 16, 0}, {"tma", false, 8, 4}, {"tma", false, 14, 12},
      {"ld", false, 0, 0}, {"tmald", false, 8, 0}, {"tmald", false, 14, 0},
      {"red", false, 4, 0}, {"red", false, 8, 0}, {"gather", false, 0, 0},
      {"gred", false, 2, 0}, {"gred", true, 2, 0}, {"gred", false, 4, 0}, {"gred", true, 4, 0},
      // copy_mix: S = TMA issuers (NI), depth = st warps (SW); TMA alone, then with the st warps
      {"tmaN", true, 1, 0}, {"tmaN", true, 2, 0}, {"tmaN", true, 4, 0},
      {"tmaN", false, 1, 0}, {"tmaN", false, 2, 0}, {"tmaN", false, 4, 0},
      {"mix", true, 4, 12}, {"mix", false, 4, 12}, {"mix", true, 2, 14}, {"mix", false, 2, 14},
  };
  for (const Trial& tr : trials) {
    if (!only.empty() && ("," + only + ",").find(std::string(",") + tr.method + ",") == std::string::npos) continue;
    for (int B : blocks) {
      if (B > prop.multiProcessorCount) continue;
      const long long q = rows / K;  // tokens (red, gather)
      const bool gred = !strcmp(tr.method, "gred");
      const bool reduce = !strcmp(tr.method, "red") || !strcmp(tr.method, "gather") || gred;
      const long long per = reduce ? q / B * K : rows / B;  // rows per block
      float worst = 0.f;
      float best_of[3];
      for (int rep = 0; rep < 3; ++rep) {
        for (int d = 0; d < ngpu; ++d) {
          CK(cudaSetDevice(d));
          Targets t{};
          for (int p = 0; p < ngpu; ++p) t.dst[p] = g[p].dst;
          t.ndst = 0;
          if (tr.peers) {
            for (int k = 1; k < ngpu; ++k) t.order[t.ndst++] = (d + k) % ngpu;
          } else {
            t.order[t.ndst++] = d;
          }
          CK(cudaEventRecord(g[d].a, g[d].stream));
          if (!strcmp(tr.method, "st") && tr.S == 4) copy_st<4><<<B, 512, 0, g[d].stream>>>(g[d].src, t, per);
          else if (!strcmp(tr.method, "st") && tr.S == 8) copy_st<8><<<B, 512, 0, g[d].stream>>>(g[d].src, t, per);
          else if (!strcmp(tr.method, "st")) copy_st<16><<<B, 512, 0, g[d].stream>>>(g[d].src, t, per);
          else if (!strcmp(tr.method, "ld")) read_ld<<<B, 512, 0, g[d].stream>>>(g[d].src, per, g[d].sink);
          else if (!strcmp(tr.method, "red") && tr.S == 4) reduce_red<4><<<B, 512, 0, g[d].stream>>>(g[d].src, g[d].dst, per, q);
          else if (!strcmp(tr.method, "red")) reduce_red<8><<<B, 512, 0, g[d].stream>>>(g[d].src, g[d].dst, per, q);
          else if (!strcmp(tr.method, "gather")) reduce_gather<<<B, 512, 0, g[d].stream>>>(g[d].src, g[d].dst, per / K, q);
          else if (gred) {  // rows t, t + q, ... of a token; KK of them; its fp32 row here or on the next GPU
            char* out = tr.peers ? g[(d + 1) % ngpu].dst : g[d].dst;
            const long long toks = per / K;
            if (tr.S == 2) reduce_gred<2><<<B, 512, 0, g[d].stream>>>(g[d].src, out, toks, q);
            else reduce_gred<4><<<B, 512, 0, g[d].stream>>>(g[d].src, out, toks, q);
          }
          else if (!strcmp(tr.method, "tmaN") || !strcmp(tr.method, "mix")) {
            const int NI = tr.S, SW = tr.depth, S = SMAX / NI >= 6 ? 6 : SMAX / NI;  // stages per issuer
            // rows by st in proportion to the rates alone (46 : 31 per TMA issuer, probe), all by TMA when SW = 0
            const long long st_rows = SW ? per * 46 / (46 + 31 * NI) : 0;
            copy_mix<<<B, 512, (size_t)NI * S * ROW, g[d].stream>>>(g[d].src, t, per, st_rows, SW, NI, S, S / 2);
          }
          else copy_tma<<<B, 32, (size_t)tr.S * ROW, g[d].stream>>>(g[d].src, t, per, tr.S, tr.depth,
                                                                   strcmp(tr.method, "tma") == 0);
          CK(cudaGetLastError());
          CK(cudaEventRecord(g[d].b, g[d].stream));
        }
        float ms = 0.f;
        for (int d = 0; d < ngpu; ++d) {
          CK(cudaSetDevice(d));
          CK(cudaEventSynchronize(g[d].b));
          float x;
          CK(cudaEventElapsedTime(&x, g[d].a, g[d].b));
          ms = std::max(ms, x);
        }
        best_of[rep] = ms;
      }
      worst = std::min(best_of[1], best_of[2]);  // the first is a warm-up
      const double bytes = gred ? (double)(per / K) * tr.S * B * ROW : (double)per * B * ROW;
      char ring[32] = "-";
      if (!strcmp(tr.method, "tma") || !strcmp(tr.method, "tmald")) snprintf(ring, sizeof ring, "S%d/d%d", tr.S, tr.depth);
      if (!strcmp(tr.method, "red") || !strcmp(tr.method, "st")) snprintf(ring, sizeof ring, "unroll %d", tr.S);
      if (gred) snprintf(ring, sizeof ring, "%d rows/tok", tr.S);
      if (!strcmp(tr.method, "tmaN") || !strcmp(tr.method, "mix")) snprintf(ring, sizeof ring, "%d tma+%d st", tr.S, tr.depth);
      printf("%-6s %-6s %-12s %6d %10.3f %12.1f %10.2f\n", tr.method, tr.peers ? "peers" : "self", ring, B, worst,
             bytes / worst / 1e6, bytes / worst / 1e6 / B);
      fflush(stdout);
    }
  }
  for (int d = 0; d < ngpu; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaFree(g[d].src));
    CK(cudaFree(g[d].dst));
    CK(cudaFree(g[d].sink));
  }
  return 0;
}
