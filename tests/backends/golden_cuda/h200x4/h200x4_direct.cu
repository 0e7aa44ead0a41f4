// h200x4_direct.cu: one-hop dispatch/combine of schedule 'h200x4' (schedules/h200x4.sched),
// lowered by epcc 0.1.0 (backends/cuda/direct.py); do not edit, regenerate with
// `epcc compile schedules/h200x4.sched --target cuda`.
//
// Plan steps lowered here:
//   dispatch step 'meta' (schedules/h200x4.sched:48): counts per rank and expert -> meta_kernel (counts and ranks on the GPU, exchanged through peer memory)
//   dispatch step 'push' (schedules/h200x4.sched:49): send each token once to every peer that needs it -> dispatch_kernel senders (TMA, one store per destination GPU) + receivers (replication)
//   dispatch step 'keep' (schedules/h200x4.sched:51): own tokens to local experts -> dispatch_kernel senders with this rank as destination (local permute)
//   combine step 'keep' (schedules/h200x4.sched:51): own tokens to local experts -> combine_kernel: home-side sum of the partials (own partial included)
//   combine step 'push' (schedules/h200x4.sched:49): send each token once to every peer that needs it -> combine_kernel: weighted partial per (token, GPU) into the home GPU's staging
//
// Kernels (one stream, in this order; every cross-GPU wait is bounded, see wait_geq):
//   meta_count_kernel, meta_finish_kernel
//                    routing -> per-expert ranks and counts, per-destination dedup indices and
//                    channel ranges; counts and ranges written into every peer's meta area, then
//                    one release flag per peer (no host round trip).
//   dispatch_kernel  cooperative: blocks [0, C) are senders (channel c = a contiguous token range),
//                    blocks [C, C + NR) receivers.  A sender's driver thread TMA-loads each token row
//                    once into a shared-memory ring and TMA-stores it once per destination GPU, into
//                    that GPU's expert-major output at the row of the token's first expert there
//                    (permute fused, one copy per (token, GPU) on NVLink); feeder warps write the
//                    weights of every (token, expert) row and a record {token, n, rows} per (token,
//                    GPU).  Receivers replicate a record's first row into its other rows (a token
//                    that picked several experts of the GPU) as the records' tails advance.
//   combine_kernel   cooperative: blocks [0, NS) reduce each received record (its rows weighted,
//                    fp32) into one bf16 partial and store it into the home GPU's staging area;
//                    blocks [NS, NS + ND) sum the partials of each home token in fp32, write bf16.
// Epochs live in device memory (CUDA-graph capturable): a kernel's last block advances them.
#include <cstdint>
#include <cstdio>
#include <cstddef>
#include <cstring>
#include <cuda_runtime.h>
#include <cuda_bf16.h>

namespace {

constexpr int R = 4;            // ranks (GPUs), one IPC domain
constexpr int E = 256;              // experts
constexpr int EPR = 64;   // experts per rank
constexpr int K = 8;                 // top-k
constexpr int KL = 8;           // most rows one token can have on one rank: min(K, EPR)
constexpr int H = 7168;               // hidden size
constexpr int TMAX = 4096;        // tokens per rank (capacity)
constexpr int CMAX = 128;      // most sender channels
constexpr int RI = 12;         // ints per record: token, n, rows[KL], padding
constexpr int XB = 14336;             // payload bytes per row (bf16)
constexpr int SB = 0;         // fp32 scale bytes per row (fp8: one per 128 channels)
constexpr int STAGE = 14336;      // shared-memory stage: XB + SB, 128-byte aligned
constexpr int SMAX = 14;        // most stages
constexpr int DR = 64;           // descriptor ring entries (multiple of 32)
constexpr int DW = (R > KL + 1) ? R : KL + 1;   // descriptor width
constexpr int ALLOW = 16;    // store groups left in flight when publishing tails
constexpr int PUB = 32;      // a sender publishes its tails every PUB tokens
constexpr int HW = 48;             // tail history ring (> ALLOW)
constexpr int QMAX = 128;       // most (source, channel) queues per receiver block
constexpr int RA = 4;          // bulk-store groups that may still be reading shared memory
constexpr int NFW = 3;       // feeder warps per sender block
constexpr int DTHREADS = 128;
constexpr int CTHREADS = 512;
constexpr int MTHREADS = 256;
constexpr bool BLOCKED = true;
constexpr bool FP8 = false;
static_assert(R <= 32, "a warp writes one count per rank");
static_assert(DR % 32 == 0 && DR >= SMAX, "descriptor ring");
static_assert(HW > ALLOW, "tail history");
static_assert(SMAX > RA, "stages must exceed the reading store groups");

// Peer region layout (byte offsets; identical on every rank, decided in direct.py)
constexpr unsigned long long OFF_STATE = 0ULL;
constexpr unsigned long long OFF_META = 4096ULL;
constexpr unsigned long long OFF_DTAIL = 28672ULL;
constexpr unsigned long long OFF_CTAIL = 32768ULL;
constexpr unsigned long long OFF_RANK_TJ = 36864ULL;
constexpr unsigned long long OFF_DEDUP = 167936ULL;
constexpr unsigned long long OFF_MYCHAN = 233472ULL;
constexpr unsigned long long OFF_CHUNKS = 237568ULL;
constexpr unsigned long long OFF_RECORDS = 258048ULL;
constexpr unsigned long long OFF_RECV_W = 1044480ULL;
constexpr unsigned long long OFF_RECV_X = 1601536ULL;
constexpr unsigned long long OFF_RECV_S = 1997172736ULL;
constexpr unsigned long long OFF_CSTAGE = 1997172736ULL;
constexpr unsigned long long META_STRIDE = 12288ULL;
constexpr unsigned long long META_FLAGS = 0ULL;
constexpr unsigned long long META_COUNTS = 256ULL;
constexpr unsigned long long META_CHANNELS = 4352ULL;
constexpr unsigned long long OFF_END = 2232053760ULL;

struct State {                       // OFF_STATE, this rank only
  unsigned long long disp_epoch;     // dispatches finished (the next one is disp_epoch + 1)
  unsigned long long comb_epoch;
  unsigned int meta_done, disp_done, comb_done, pad0;
  int last_T, last_C, last_align;
  int bad_token;                     // first token whose top-k names an expert out of range or twice, else -1
  int recv_count[EPR];               // rows received per local expert (unpadded)
  int recv_offset[EPR + 1];          // first row of each local expert, then the total (padded)
};

static_assert(sizeof(State) <= OFF_META - OFF_STATE, "State overlaps the meta area");

struct ErrorRecord {                 // host-mapped; the first failing thread fills it
  int code, rank, where, a, b, pad;
  unsigned long long value, target, waited_ns;
};

struct Args {                        // mirrors direct_runtime.py's ctypes structure: all 64-bit
  unsigned long long base[R];        // every rank's peer region (own included)
  long long me, T, C, NR, S, align;
  unsigned long long timeout_ns;
  unsigned long long err;            // ErrorRecord*, device view of host-mapped memory
  unsigned long long x, scales, topk_idx, topk_w;
  long long idx_int32, has_weights;
  unsigned long long y, out;
  long long NS, ND;
};

enum Where : int {
  WHERE_META = 1,  // dispatch: metadata flag of rank a
  WHERE_SEND_STAGE = 2,  // dispatch sender: a token row to land in shared memory
  WHERE_SEND_DESC = 3,  // dispatch sender: the feeders' descriptor of a token (channel a)
  WHERE_SEND_RING = 4,  // dispatch sender feeder: room in the descriptor ring (channel a)
  WHERE_RECV_TAIL = 5,  // dispatch receiver: records of rank a, channel b
  WHERE_RECV_RING = 6,  // dispatch receiver feeder: room in the descriptor ring (queue a)
  WHERE_RECV_DESC = 7,  // dispatch receiver: the next replication descriptor
  WHERE_RECV_STAGE = 8,  // dispatch receiver: a row to land in shared memory
  WHERE_COMBINE_TAIL = 9,  // combine: partials from rank a, channel b
};

__device__ __forceinline__ int rank_of(int e) { return BLOCKED ? e / EPR : e % R; }
__device__ __forceinline__ int expert_at(int d, int l) { return BLOCKED ? d * EPR + l : l * R + d; }

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ int ld_volatile(const int* p) { return *reinterpret_cast<const volatile int*>(p); }
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __noinline__ void fail(const Args& a, int where, int x, int y, unsigned long long value,
                                  unsigned long long target, unsigned long long waited) {
  ErrorRecord* r = reinterpret_cast<ErrorRecord*>(a.err);
  if (atomicCAS(&r->code, 0, 1) == 0) {
    r->rank = (int)a.me; r->where = where; r->a = x; r->b = y;
    r->value = value; r->target = target; r->waited_ns = waited;
    __threadfence_system();
  }
  printf("epcc: wait timed out after %.3f s: rank %d, wait %d, (%d, %d): value 0x%llx, waiting for >= 0x%llx\n",
         waited * 1e-9, (int)a.me, where, x, y, value, target);
  __trap();
}

// Spin (acquire, system scope) until *p >= target; trap with a report after a.timeout_ns.
__device__ __forceinline__ unsigned long long wait_geq(const Args& a, const unsigned long long* p,
                                                       unsigned long long target, int where, int x, int y) {
  unsigned long long v = ld_acquire_sys(p);
  if (v >= target) return v;
  const unsigned long long t0 = now_ns();
  for (;;) {
    v = ld_acquire_sys(p);
    if (v >= target) return v;
    const unsigned long long dt = now_ns() - t0;
    if (dt > a.timeout_ns) fail(a, where, x, y, v, target, dt);
  }
}

// Spin on a shared-memory int until it is >= target (block-local progress; bounded too).
__device__ __forceinline__ void wait_smem_geq(const Args& a, const volatile int* p, int target, int where, int x) {
  if (*p >= target) return;
  const unsigned long long t0 = now_ns();
  while (*p < target) {
    const unsigned long long dt = now_ns() - t0;
    if (dt > a.timeout_ns) fail(a, where, x, target, (unsigned long long)*p, (unsigned long long)target, dt);
  }
}

// ---- TMA (bulk async copy) helpers ---------------------------------------------------------
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(const Args& a, unsigned long long* bar, unsigned phase, int where) {
  unsigned done = 0;
  const unsigned long long t0 = now_ns();
  for (;;) {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(phase) : "memory");
    if (done) return;
    const unsigned long long dt = now_ns() - t0;
    if (dt > a.timeout_ns) fail(a, where, (int)phase, 0, 0, 1, dt);
  }
}
__device__ __forceinline__ void tma_load(void* dst_smem, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst_smem)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void tma_store(void* dst, const void* src_smem, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
               ::"l"(dst), "r"(smem_addr(src_smem)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tma_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void tma_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void tma_wait_done() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// ---- region accessors -----------------------------------------------------------------------
__device__ __forceinline__ char* region(const Args& a, int r) { return reinterpret_cast<char*>(a.base[r]); }
__device__ __forceinline__ State* state(const Args& a) { return reinterpret_cast<State*>(region(a, (int)a.me) + OFF_STATE); }
// meta area of rank r, parity p: flags [R] u64, counts [R][E] int, channels [R][CMAX][2] int
__device__ __forceinline__ unsigned long long* meta_flag(const Args& a, int r, int p, int src) {
  return reinterpret_cast<unsigned long long*>(region(a, r) + OFF_META + p * META_STRIDE + META_FLAGS) + src;
}
__device__ __forceinline__ int* meta_cnt(const Args& a, int r, int p) {
  return reinterpret_cast<int*>(region(a, r) + OFF_META + p * META_STRIDE + META_COUNTS);
}
__device__ __forceinline__ int* meta_chan(const Args& a, int r, int p) {
  return reinterpret_cast<int*>(region(a, r) + OFF_META + p * META_STRIDE + META_CHANNELS);
}
__device__ __forceinline__ unsigned long long* dtail(const Args& a, int r, int src, int c) {
  return reinterpret_cast<unsigned long long*>(region(a, r) + OFF_DTAIL) + src * CMAX + c;
}
__device__ __forceinline__ unsigned long long* ctail(const Args& a, int r, int src, int c) {
  return reinterpret_cast<unsigned long long*>(region(a, r) + OFF_CTAIL) + src * CMAX + c;
}
__device__ __forceinline__ int* record(const Args& a, int r, int src, int i) {
  return reinterpret_cast<int*>(region(a, r) + OFF_RECORDS) + ((long long)src * TMAX + i) * RI;
}
__device__ __forceinline__ int load_idx(const Args& a, int t, int j) {
  if (a.idx_int32) return reinterpret_cast<const int*>(a.topk_idx)[(long long)t * K + j];
  return (int)reinterpret_cast<const long long*>(a.topk_idx)[(long long)t * K + j];
}
// The K entries of token t, each kept or replaced by -1 when it is empty (-1), out of range, or
// repeats an earlier entry (such tokens are also reported through State::bad_token).
// Returns whether an entry was dropped for being bad (not for being -1).
__device__ __forceinline__ bool load_experts(const Args& a, int t, int (&ex)[K]) {
  bool bad = false;
#pragma unroll
  for (int j = 0; j < K; ++j) ex[j] = load_idx(a, t, j);
#pragma unroll
  for (int j = 0; j < K; ++j) {
    bool drop = ex[j] >= E || ex[j] < -1;
#pragma unroll
    for (int i = 0; i < j; ++i) drop |= ex[j] >= 0 && ex[i] == ex[j];
    bad |= drop;
    if (drop || ex[j] < 0) ex[j] = -1;
  }
  return bad;
}
__device__ __forceinline__ int tokens_per_channel(int T, int C) { return T > 0 ? (T + C - 1) / C : 1; }

// =============================================================================================
// Metadata: step 'meta' (schedules/h200x4.sched:48), two kernels over chunks of MC tokens.
// meta_count_kernel (block b = chunk b): each lane holds the experts of NB tokens in registers;
//   warp w takes experts w, w + 8, ...: a ballot per 32 tokens gives each (token, slot) its rank
//   among the chunk's tokens of that expert, and the chunk's count; warps also take the
//   destination ranks (dedup: a token's position among the chunk's tokens bound for rank d).
// meta_finish_kernel (block b = chunk b): adds the counts of earlier chunks (token order across
//   the whole batch), writes each channel's first dedup index; the last block to finish sends
//   the per-expert counts and the channel ranges to every peer and raises this rank's flag there.
// =============================================================================================
constexpr int MC = 256;          // tokens per metadata chunk
constexpr int NB = MC / 32;                     // tokens per lane

__device__ __forceinline__ int* chunk_counts(const Args& a) {  // [MAXCHUNKS][E + R + 1]: experts, ranks, bad
  return reinterpret_cast<int*>(region(a, (int)a.me) + OFF_CHUNKS);
}

__global__ void __launch_bounds__(MTHREADS) meta_count_kernel(const Args a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, b = blockIdx.x;
  const int T = (int)a.T, tb = b * MC;
  char* my = region(a, (int)a.me);
  int* rank_tj = reinterpret_cast<int*>(my + OFF_RANK_TJ);   // [TMAX][K]: rank within the chunk (finished later)
  int* dedup = reinterpret_cast<int*>(my + OFF_DEDUP);       // [TMAX][R]: pos in chunk, or -(pos + 1) if absent
  int* cc = chunk_counts(a) + b * (E + R + 1);
  const unsigned lt = (1u << lane) - 1;
  __shared__ int s_bad;
  if (threadIdx.x == 0) s_bad = T;
  __syncthreads();
  int ex[NB][K];
  int bad = T;
#pragma unroll
  for (int q = 0; q < NB; ++q) {
    const int t = tb + q * 32 + lane;
    if (t < T) {
      if (load_experts(a, t, ex[q])) bad = min(bad, t);
    } else {
#pragma unroll
      for (int j = 0; j < K; ++j) ex[q][j] = -1;
    }
  }
  for (int e = warp; e < E; e += MTHREADS / 32) {
    int run = 0;
#pragma unroll
    for (int q = 0; q < NB; ++q) {
      int jm = -1;
#pragma unroll
      for (int j = 0; j < K; ++j) jm = ex[q][j] == e ? j : jm;
      const unsigned bal = __ballot_sync(~0u, jm >= 0);
      if (jm >= 0) rank_tj[(tb + q * 32 + lane) * K + jm] = run + __popc(bal & lt);
      run += __popc(bal);
    }
    if (lane == 0) cc[e] = run;
  }
  for (int d = warp; d < R; d += MTHREADS / 32) {
    int run = 0;
#pragma unroll
    for (int q = 0; q < NB; ++q) {
      bool has = false;
#pragma unroll
      for (int j = 0; j < K; ++j) has |= ex[q][j] >= 0 && rank_of(ex[q][j]) == d;
      const unsigned bal = __ballot_sync(~0u, has);
      const int pos = run + __popc(bal & lt);
      const int t = tb + q * 32 + lane;
      if (t < T) dedup[t * R + d] = has ? pos : -(pos + 1);
      run += __popc(bal);
    }
    if (lane == 0) cc[E + d] = run;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) bad = min(bad, __shfl_xor_sync(~0u, bad, o));
  if (lane == 0) atomicMin(&s_bad, bad);
  __syncthreads();
  if (threadIdx.x == 0) cc[E + R] = s_bad < T ? s_bad : -1;
}

__global__ void __launch_bounds__(MTHREADS) meta_finish_kernel(const Args a) {
  const int b = blockIdx.x, G = gridDim.x, tid = threadIdx.x;
  const int me = (int)a.me, T = (int)a.T, C = (int)a.C, Tc = tokens_per_channel(T, C), tb = b * MC;
  char* my = region(a, me);
  State* st = state(a);
  const unsigned long long e = st->disp_epoch + 1;
  const int p = (int)(e & 1);
  int* rank_tj = reinterpret_cast<int*>(my + OFF_RANK_TJ);
  int* dedup = reinterpret_cast<int*>(my + OFF_DEDUP);
  int* mych = reinterpret_cast<int*>(my + OFF_MYCHAN);       // [CMAX + 1][R]: first dedup index of each channel
  const int* cc = chunk_counts(a);
  __shared__ int base[E + R];
  __shared__ int s_last;
  for (int i = tid; i < E + R; i += blockDim.x) {
    int sum = 0;
    for (int q = 0; q < b; ++q) sum += cc[q * (E + R + 1) + i];
    base[i] = sum;
  }
  __syncthreads();
  for (int t = tb + tid; t < min(T, tb + MC); t += blockDim.x) {
    int ex[K];
    load_experts(a, t, ex);
#pragma unroll
    for (int j = 0; j < K; ++j)
      if (ex[j] >= 0) rank_tj[t * K + j] += base[ex[j]];
#pragma unroll
    for (int d = 0; d < R; ++d) {
      const int v = dedup[t * R + d];
      dedup[t * R + d] = v >= 0 ? base[E + d] + v : -1;
      if (t % Tc == 0) mych[(t / Tc) * R + d] = base[E + d] + (v >= 0 ? v : -v - 1);
    }
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(&st->meta_done, 1u) == (unsigned)(G - 1);
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  // ---- last block: totals to every peer, channel ranges to each destination, then the flags
  for (int i = tid; i < E + R; i += blockDim.x) {
    int sum = 0;
    for (int q = 0; q < G; ++q) sum += cc[q * (E + R + 1) + i];
    base[i] = sum;
    if (i < E) {
#pragma unroll
      for (int d = 0; d < R; ++d) meta_cnt(a, d, p)[me * E + i] = sum;
    }
  }
  __syncthreads();
  for (int i = tid; i < C * R; i += blockDim.x) {
    const int c = i / R, d = i % R;
    const int s0 = (c * Tc < T) ? mych[c * R + d] : base[E + d];
    const int s1 = (c + 1 < C && (c + 1) * Tc < T) ? mych[(c + 1) * R + d] : base[E + d];
    int* ch = meta_chan(a, d, p) + (me * CMAX + c) * 2;
    ch[0] = s0;
    ch[1] = s1 - s0;
  }
  if (tid == 0) {
    int bad = -1;
    for (int q = 0; q < G; ++q) {
      const int v = cc[q * (E + R + 1) + E + R];
      if (v >= 0 && (bad < 0 || v < bad)) bad = v;
    }
    st->bad_token = bad;
  }
  __threadfence_system();
  __syncthreads();
  if (tid == 0) {
    st->meta_done = 0;
    for (int d = 0; d < R; ++d) st_release_sys(meta_flag(a, d, p, me), e);
  }
}

// ---- shared memory of the dispatch kernel -----------------------------------------------------
struct DispatchShared {
  unsigned long long full[SMAX];     // mbarriers: stage loaded
  int off[E];                        // sender: first row of (this rank, expert e) on e's rank
  int tot[E];
  int seg[E];
  int desc[DR][DW];                   // sender: first row per rank; receiver: n, rows
  int ready[DR];                     // ring position whose descriptor is in place
  int consumed;                      // descriptors the driver has taken
  int produced_total;                // receiver: descriptors in all (-1 while feeding)
  int hist[HW][R];                   // sender: records per rank after each token
  int q_start[QMAX], q_count[QMAX], q_done[QMAX];  // receiver: its queues' records: first, count, taken
};

__device__ void dispatch_offsets(const Args& a, DispatchShared& sh, int p) {
  const int me = (int)a.me;
  const int* cnt = meta_cnt(a, me, p);
  const int align = (int)a.align;
  for (int ex = threadIdx.x; ex < E; ex += blockDim.x) {
    int tot = 0, pre = 0;
#pragma unroll
    for (int s = 0; s < R; ++s) {
      const int c = ld_volatile(cnt + s * E + ex);
      tot += c;
      if (s < me) pre += c;
    }
    sh.tot[ex] = (tot + align - 1) / align * align;
    sh.off[ex] = pre;
    if (blockIdx.x == 0 && rank_of(ex) == me) {
      const int l = BLOCKED ? ex % EPR : ex / R;
      state(a)->recv_count[l] = tot;
    }
  }
  __syncthreads();
  if (threadIdx.x < R) {
    const int d = threadIdx.x;
    int acc = 0;
    for (int l = 0; l < EPR; ++l) {
      const int ex = expert_at(d, l);
      sh.seg[ex] = acc;
      if (d == me && blockIdx.x == 0) state(a)->recv_offset[l] = acc;
      acc += sh.tot[ex];
    }
    if (d == me && blockIdx.x == 0) state(a)->recv_offset[EPR] = acc;
  }
  __syncthreads();
  for (int ex = threadIdx.x; ex < E; ex += blockDim.x) sh.off[ex] += sh.seg[ex];
  __syncthreads();
}

// Sender of channel c: step 'push' (schedules/h200x4.sched:49) and its local part
// 'keep' (own tokens into own experts: the same code with this rank as destination).
__device__ void dispatch_send(const Args& a, DispatchShared& sh, unsigned char* stages, unsigned long long e) {
  const int me = (int)a.me, T = (int)a.T, C = (int)a.C, S = (int)a.S, c = blockIdx.x;
  const int Tc = tokens_per_channel(T, C);
  const int t0 = c * Tc, n = max(0, min(T, t0 + Tc) - t0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const char* my = region(a, me);
  const int* rank_tj = reinterpret_cast<const int*>(my + OFF_RANK_TJ);
  const int* dedup = reinterpret_cast<const int*>(my + OFF_DEDUP);
  if (warp == 0) {
    if (lane != 0) return;
    // ---- driver: TMA ring, one load per token, one store per destination rank
    int counts[R];
#pragma unroll
    for (int d = 0; d < R; ++d) counts[d] = 0;
    int published[R];
#pragma unroll
    for (int d = 0; d < R; ++d) published[d] = 0;
    auto load = [&](int i) {
      unsigned char* stg = stages + (size_t)(i % S) * STAGE;
      mbar_expect_tx(&sh.full[i % S], XB + SB);
      tma_load(stg, reinterpret_cast<const char*>(a.x) + (long long)(t0 + i) * XB, XB, &sh.full[i % S]);
      if (FP8) tma_load(stg + XB, reinterpret_cast<const char*>(a.scales) + (long long)(t0 + i) * SB, SB, &sh.full[i % S]);
    };
    auto publish = [&](const int* upto) {
      fence_proxy_async();
      __threadfence_system();
#pragma unroll
      for (int d = 0; d < R; ++d) {
        if (upto[d] != published[d]) {
          st_release_sys(dtail(a, d, me, c), (e << 32) | (unsigned long long)upto[d]);
          published[d] = upto[d];
        }
      }
    };
    const int D = S - RA;  // loads run D tokens ahead; RA store groups may still be reading their stages
    for (int i = 0; i < min(D, n); ++i) load(i);
    for (int i = 0; i < n; ++i) {
      mbar_wait(a, &sh.full[i % S], (unsigned)((i / S) & 1), WHERE_SEND_STAGE);
      wait_smem_geq(a, &sh.ready[i % DR], i, WHERE_SEND_DESC, c);
      __threadfence_block();  // acquire: the descriptor after its ready mark
      int first[R];
#pragma unroll
      for (int d = 0; d < R; ++d) first[d] = ld_volatile(&sh.desc[i % DR][d]);
      __threadfence_block();
      *reinterpret_cast<volatile int*>(&sh.consumed) = i + 1;
      const unsigned char* stg = stages + (size_t)(i % S) * STAGE;
#pragma unroll
      for (int d = 0; d < R; ++d) {
        if (first[d] < 0) continue;
        char* dst = region(a, d);
        tma_store(dst + OFF_RECV_X + (long long)first[d] * XB, stg, XB);
        if (FP8) tma_store(dst + OFF_RECV_S + (long long)first[d] * SB, stg + XB, SB);
        counts[d] += 1;
      }
      tma_commit();
#pragma unroll
      for (int d = 0; d < R; ++d) sh.hist[i % HW][d] = counts[d];
      if (i + D < n) {
        if (i + D >= S) tma_wait_read<RA>();  // token i + D - S = i - RA has been read out of its stage
        load(i + D);
      }
      if (i >= ALLOW && (i + 1) % PUB == 0) {
        tma_wait_done<ALLOW>();  // tokens <= i - ALLOW are in place on their ranks
        publish(sh.hist[(i - ALLOW) % HW]);
      }
    }
    tma_wait_done<0>();
    publish(counts);
    return;
  }
  // ---- feeders: rows of every (token, expert), weights, records; one descriptor per token
  for (int b = (warp - 1) * 32; b < n; b += NFW * 32) {
    const int i = b + lane;
    const bool valid = i < n;
    const int t = t0 + i;
    if (valid) wait_smem_geq(a, reinterpret_cast<volatile int*>(&sh.consumed), i - DR + 1, WHERE_SEND_RING, c);
    int ex[K], slot[K];
    float w[K];
    if (valid) {
      load_experts(a, t, ex);
    } else {
#pragma unroll
      for (int j = 0; j < K; ++j) ex[j] = -1;
    }
#pragma unroll
    for (int j = 0; j < K; ++j) {
      slot[j] = ex[j] >= 0 ? sh.off[ex[j]] + rank_tj[t * K + j] : -1;
      w[j] = (ex[j] >= 0 && a.has_weights) ? reinterpret_cast<const float*>(a.topk_w)[(long long)t * K + j] : 1.f;
    }
#pragma unroll
    for (int d = 0; d < R; ++d) {
      int first = -1, cnt = 0;
      int* rec = nullptr;
      if (valid) {
        const int di = dedup[t * R + d];
        if (di >= 0) rec = record(a, d, me, di);
      }
#pragma unroll
      for (int j = 0; j < K; ++j) {
        if (ex[j] >= 0 && rank_of(ex[j]) == d) {
          reinterpret_cast<float*>(region(a, d) + OFF_RECV_W)[slot[j]] = w[j];
          if (first < 0) first = slot[j];
          if (rec) rec[2 + cnt] = slot[j];
          ++cnt;
        }
      }
      if (rec) { rec[0] = t; rec[1] = cnt; }
      if (valid) sh.desc[i % DR][d] = first;
    }
    __threadfence_system();  // weights and records before the driver's tail release
    if (valid) *reinterpret_cast<volatile int*>(&sh.ready[i % DR]) = i;
  }
}

// Receiver: replicate each record's first row into its other rows, queue by queue (src, channel).
__device__ void dispatch_recv(const Args& a, DispatchShared& sh, unsigned char* stages, unsigned long long e, int p) {
  const int me = (int)a.me, C = (int)a.C, NR = (int)a.NR, S = (int)a.S, rb = blockIdx.x - C;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  char* my = region(a, me);
  const int* chan = meta_chan(a, me, p);
  if (warp == 1) {
    // ---- feeder: poll this block's queues round robin (queue q: channel q / R, source q % R, so
    // every block has queues of every stage of the senders' progress), take whatever records have
    // landed, push those with more than one row
    int g = 0;
    const unsigned lt = (1u << lane) - 1;
    int nq = 0;
    for (int q = rb; q < R * C; q += NR) {
      if (lane == 0) {
        const int s = q % R, c = q / R;
        sh.q_start[nq] = ld_volatile(chan + (s * CMAX + c) * 2);
        sh.q_count[nq] = ld_volatile(chan + (s * CMAX + c) * 2 + 1);
        sh.q_done[nq] = 0;
      }
      ++nq;
    }
    __syncwarp();
    int left = 0;
    for (int k = 0; k < nq; ++k) left += sh.q_count[k] > 0;
    unsigned long long idle_since = now_ns();
    while (left > 0) {
      bool progress = false;
      for (int k = 0; k < nq; ++k) {
        const int q = rb + k * NR, s = q % R, c = q / R;
        const int count = sh.q_count[k], done = sh.q_done[k];
        if (done >= count) continue;
        int avail = 0;
        if (lane == 0) {
          const unsigned long long v = ld_acquire_sys(dtail(a, me, s, c));  // (epoch << 32) | records
          avail = v >= (e << 32) ? (int)(v & 0xffffffffULL) : 0;
        }
        avail = __shfl_sync(~0u, avail, 0);
        if (avail <= done) continue;
        const int take = min(avail - done, 32);
        const int r = done + lane;
        int nrows = 0;
        const int* rec = nullptr;
        if (lane < take) {
          rec = record(a, me, s, sh.q_start[k] + r);
          nrows = __ldcg(rec + 1);
        }
        const unsigned bal = __ballot_sync(~0u, nrows > 1);
        if (nrows > 1) {
          const int pos = g + __popc(bal & lt);
          wait_smem_geq(a, reinterpret_cast<volatile int*>(&sh.consumed), pos - DR + 1, WHERE_RECV_RING, q);
          sh.desc[pos % DR][0] = nrows;
          for (int k2 = 0; k2 < nrows; ++k2) sh.desc[pos % DR][1 + k2] = __ldcg(rec + 2 + k2);
          __threadfence_block();
          *reinterpret_cast<volatile int*>(&sh.ready[pos % DR]) = pos;
        }
        g += __popc(bal);
        __syncwarp();
        if (lane == 0) sh.q_done[k] = done + take;
        __syncwarp();
        if (done + take >= count) --left;
        progress = true;
      }
      if (progress) {
        idle_since = now_ns();
      } else if (now_ns() - idle_since > a.timeout_ns) {
        int k = 0;
        while (sh.q_done[k] >= sh.q_count[k]) ++k;
        const int q = rb + k * NR;
        if (lane == 0)
          fail(a, WHERE_RECV_TAIL, q % R, q / R, ld_acquire_sys(dtail(a, me, q % R, q / R)),
               (e << 32) | (unsigned long long)(sh.q_done[k] + 1), now_ns() - idle_since);
      }
    }
    if (lane == 0) {
      __threadfence_block();
      *reinterpret_cast<volatile int*>(&sh.produced_total) = g;
    }
    return;
  }
  if (warp != 0 || lane != 0) return;
  // ---- driver: TMA load the first row, TMA store it into the others
  int i = 0, li = 0;
  unsigned long long t_start = now_ns();
  for (;;) {
    while (li < i + S - RA && ld_volatile(&sh.ready[li % DR]) == li) {
      __threadfence_block();  // acquire: the descriptor after its ready mark
      if (li >= S) tma_wait_read<RA>();  // the stage's previous descriptor, li - S < i - RA, is read out
      fence_proxy_async();
      const int first = ld_volatile(&sh.desc[li % DR][1]);
      unsigned char* stg = stages + (size_t)(li % S) * STAGE;
      mbar_expect_tx(&sh.full[li % S], XB + SB);
      tma_load(stg, my + OFF_RECV_X + (long long)first * XB, XB, &sh.full[li % S]);
      if (FP8) tma_load(stg + XB, my + OFF_RECV_S + (long long)first * SB, SB, &sh.full[li % S]);
      ++li;
    }
    if (i == li) {
      const int total = ld_volatile(&sh.produced_total);
      if (total >= 0 && i == total) break;
      const unsigned long long dt = now_ns() - t_start;
      if (dt > a.timeout_ns) fail(a, WHERE_RECV_DESC, i, total, 0, 0, dt);
      continue;
    }
    mbar_wait(a, &sh.full[i % S], (unsigned)((i / S) & 1), WHERE_RECV_STAGE);
    const int nrows = ld_volatile(&sh.desc[i % DR][0]);
    const unsigned char* stg = stages + (size_t)(i % S) * STAGE;
    for (int k = 1; k < nrows; ++k) {
      const long long row = ld_volatile(&sh.desc[i % DR][1 + k]);
      tma_store(my + OFF_RECV_X + row * XB, stg, XB);
      if (FP8) tma_store(my + OFF_RECV_S + row * SB, stg + XB, SB);
    }
    tma_commit();
    __threadfence_block();
    *reinterpret_cast<volatile int*>(&sh.consumed) = i + 1;
    ++i;
    t_start = now_ns();
  }
  tma_wait_done<0>();
}

__global__ void __launch_bounds__(DTHREADS, 1) dispatch_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char stages[];
  __shared__ DispatchShared sh;
  const int me = (int)a.me;
  State* st = state(a);
  const unsigned long long e = st->disp_epoch + 1;
  const int p = (int)(e & 1);
  if (threadIdx.x == 0) {
    for (int s = 0; s < SMAX; ++s) mbar_init(&sh.full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    sh.consumed = 0;
    sh.produced_total = -1;
  }
  for (int i = threadIdx.x; i < DR; i += blockDim.x) sh.ready[i] = -1;
  if (threadIdx.x < R) wait_geq(a, meta_flag(a, me, p, threadIdx.x), e, WHERE_META, (int)threadIdx.x, 0);
  __syncthreads();
  dispatch_offsets(a, sh, p);
  if (blockIdx.x < a.C) dispatch_send(a, sh, stages, e);
  else dispatch_recv(a, sh, stages, e, p);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned prev = atomicAdd(&st->disp_done, 1u);
    if (prev == gridDim.x - 1) {
      st->disp_done = 0;
      st->last_T = (int)a.T;
      st->last_C = (int)a.C;
      st->last_align = (int)a.align;
      __threadfence();
      st->disp_epoch = e;
    }
  }
}

// =============================================================================================
// combine_kernel: step 'push' (schedules/h200x4.sched:49) and 'keep'
// =============================================================================================
__device__ __forceinline__ void bf16x8_fma(float (&acc)[8], const uint4 v, float w) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(h[q]);
    acc[2 * q] = fmaf(w, f.x, acc[2 * q]);
    acc[2 * q + 1] = fmaf(w, f.y, acc[2 * q + 1]);
  }
}
__device__ __forceinline__ uint4 pack_bf16x8(const float (&acc)[8]) {
  uint4 r;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
  for (int q = 0; q < 4; ++q) h[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
  return r;
}

constexpr int HV = H / 8;  // 16-byte vectors per bf16 row
constexpr int CU = 4;
constexpr int CB = 4;  // records per warp between two tail releases

__global__ void __launch_bounds__(CTHREADS, 1) combine_kernel(const Args a) {
  const int me = (int)a.me, NS = (int)a.NS, ND = (int)a.ND;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, NW = CTHREADS / 32;
  State* st = state(a);
  const unsigned long long ce = st->comb_epoch + 1;
  const unsigned long long e = st->disp_epoch;
  const int p = (int)(e & 1), T = st->last_T, C = st->last_C;
  char* my = region(a, me);
  const uint4* y = reinterpret_cast<const uint4*>(a.y);
  if ((int)blockIdx.x < NS) {
    // ---- expert side: one weighted partial per record, into the home rank's staging
    const int* chan = meta_chan(a, me, p);
    const float* rw = reinterpret_cast<const float*>(my + OFF_RECV_W);
    for (int q = blockIdx.x; q < R * C; q += NS) {  // channel-major: every home rank's partials early
      const int s = q % R, c = q / R;
      const int start = ld_volatile(chan + (s * CMAX + c) * 2), count = ld_volatile(chan + (s * CMAX + c) * 2 + 1);
      uint4* stage_s = reinterpret_cast<uint4*>(region(a, s) + OFF_CSTAGE) + (long long)me * TMAX * HV;
      for (int r0 = 0; r0 < count; r0 += NW * CB) {
       for (int rq = 0; rq < CB; ++rq) {
        const int r = r0 + rq * NW + warp;
        if (r < count) {
          const int* rec = record(a, me, s, start + r);
          const int t = rec[0], nrows = rec[1];
          int rows[KL];
          float w[KL];
#pragma unroll
          for (int k = 0; k < KL; ++k) {
            rows[k] = k < nrows ? rec[2 + k] : 0;
            w[k] = k < nrows ? rw[rows[k]] : 0.f;
          }
          uint4* dst = stage_s + (long long)t * HV;
          for (int v0 = lane; v0 < HV; v0 += 32 * CU) {
            float acc[CU][8];
#pragma unroll
            for (int u = 0; u < CU; ++u)
#pragma unroll
              for (int q8 = 0; q8 < 8; ++q8) acc[u][q8] = 0.f;
#pragma unroll
            for (int k = 0; k < KL; ++k) {
              if (k < nrows) {
                uint4 v[CU];
#pragma unroll
                for (int u = 0; u < CU; ++u) {
                  const int vi = v0 + u * 32;
                  if (vi < HV) v[u] = __ldg(y + (long long)rows[k] * HV + vi);
                }
#pragma unroll
                for (int u = 0; u < CU; ++u)
                  if (v0 + u * 32 < HV) bf16x8_fma(acc[u], v[u], w[k]);
              }
            }
#pragma unroll
            for (int u = 0; u < CU; ++u) {
              const int vi = v0 + u * 32;
              if (vi < HV) dst[vi] = pack_bf16x8(acc[u]);
            }
          }
        }
       }
        __syncthreads();
        if (threadIdx.x == 0) {
          __threadfence_system();
          st_release_sys(ctail(a, s, me, c), (ce << 32) | (unsigned long long)min(count, r0 + NW * CB));
        }
      }
    }
  } else {
    // ---- home side: sum the partials of each token over the ranks that hold it
    const int* dedup = reinterpret_cast<const int*>(my + OFF_DEDUP);
    const int* mych = reinterpret_cast<const int*>(my + OFF_MYCHAN);
    const uint4* stage = reinterpret_cast<const uint4*>(my + OFF_CSTAGE);
    uint4* out = reinterpret_cast<uint4*>(a.out);
    const int Tc = tokens_per_channel(T, C);
    for (int c = (int)blockIdx.x - NS; c < C; c += ND) {
      const int t0 = c * Tc, t1 = min(T, t0 + Tc);
      for (int t = t0 + warp; t < t1; t += NW) {
        int di[R];
#pragma unroll
        for (int d = 0; d < R; ++d) {
          di[d] = dedup[t * R + d];
          if (di[d] >= 0 && lane == 0)
            wait_geq(a, ctail(a, me, d, c), (ce << 32) | (unsigned long long)(di[d] - mych[c * R + d] + 1),
                     WHERE_COMBINE_TAIL, d, c);
        }
        __syncwarp();
        for (int v0 = lane; v0 < HV; v0 += 32 * CU) {
          float acc[CU][8];
#pragma unroll
          for (int u = 0; u < CU; ++u)
#pragma unroll
            for (int q8 = 0; q8 < 8; ++q8) acc[u][q8] = 0.f;
#pragma unroll
          for (int d = 0; d < R; ++d) {
            if (di[d] < 0) continue;
            uint4 v[CU];
#pragma unroll
            for (int u = 0; u < CU; ++u)
              if (v0 + u * 32 < HV) v[u] = __ldcg(stage + ((long long)d * TMAX + t) * HV + v0 + u * 32);
#pragma unroll
            for (int u = 0; u < CU; ++u)
              if (v0 + u * 32 < HV) bf16x8_fma(acc[u], v[u], 1.f);
          }
#pragma unroll
          for (int u = 0; u < CU; ++u)
            if (v0 + u * 32 < HV) out[(long long)t * HV + v0 + u * 32] = pack_bf16x8(acc[u]);
        }
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned prev = atomicAdd(&st->comb_done, 1u);
    if (prev == gridDim.x - 1) {
      st->comb_done = 0;
      __threadfence();
      st->comb_epoch = ce;
    }
  }
}

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
int epcc_direct_abi(void) { return 1; }
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
  out8[7] = 0;
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

// Once per process and device: allow the dispatch kernel its dynamic shared memory.
int epcc_direct_init(int max_stages) {
  if (max_stages <= RA || max_stages > SMAX) {
    snprintf(g_error, sizeof g_error, "stages must lie in [%d, %d], got %d", RA + 1, SMAX, max_stages);
    return 2;
  }
  cudaError_t err = cudaFuncSetAttribute(dispatch_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         max_stages * STAGE);
  return err == cudaSuccess ? 0 : set_error(err, "cudaFuncSetAttribute(dispatch_kernel)");
}

int epcc_direct_dispatch(const void* args, unsigned long long stream) {
  const Args* a = static_cast<const Args*>(args);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const int chunks = a->T > 0 ? (int)((a->T + MC - 1) / MC) : 1;
  cudaError_t err = launch(reinterpret_cast<const void*>(meta_count_kernel), chunks, MTHREADS, 0, false, *a, s);
  if (err != cudaSuccess) return set_error(err, "launch meta_count_kernel");
  err = launch(reinterpret_cast<const void*>(meta_finish_kernel), chunks, MTHREADS, 0, false, *a, s);
  if (err != cudaSuccess) return set_error(err, "launch meta_finish_kernel");
  err = launch(reinterpret_cast<const void*>(dispatch_kernel), (int)(a->C + a->NR), DTHREADS,
               (size_t)a->S * STAGE, true, *a, s);
  if (err != cudaSuccess) return set_error(err, "launch dispatch_kernel");
  return 0;
}

int epcc_direct_combine(const void* args, unsigned long long stream) {
  const Args* a = static_cast<const Args*>(args);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  cudaError_t err = launch(reinterpret_cast<const void*>(combine_kernel), (int)(a->NS + a->ND), CTHREADS, 0, true,
                           *a, s);
  return err == cudaSuccess ? 0 : set_error(err, "launch combine_kernel");
}

}  // extern "C"
