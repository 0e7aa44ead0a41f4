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
constexpr int CMAX = 1024;      // most sender channels
constexpr int RI = 12;         // ints per record: token, n, rows[KL], padding
constexpr int XB = 14336;             // payload bytes per row (bf16)
constexpr int SB = 0;         // fp32 scale bytes per row (fp8: one per 128 channels)
constexpr int PUB = 4;      // a sender warp publishes its tails every PUB tokens
constexpr int DTHREADS = 512;
constexpr int CTHREADS = 512;
constexpr int MTHREADS = 256;   // metadata block: one token per thread
constexpr bool BLOCKED = true;
constexpr bool FP8 = false;
static_assert(R <= 32, "a warp writes one count per rank");
static_assert(K <= 32 && RI <= 32, "a lane per top-k slot and per int of a record");

// Peer region layout (byte offsets; identical on every rank, decided in direct.py)
constexpr unsigned long long OFF_STATE = 0ULL;
constexpr unsigned long long OFF_META = 4096ULL;
constexpr unsigned long long OFF_DTAIL = 86016ULL;
constexpr unsigned long long OFF_CTAIL = 118784ULL;
constexpr unsigned long long OFF_RANK_TJ = 151552ULL;
constexpr unsigned long long OFF_DEDUP = 282624ULL;
constexpr unsigned long long OFF_MYCHAN = 348160ULL;
constexpr unsigned long long OFF_CHUNKS = 368640ULL;
constexpr unsigned long long OFF_RECORDS = 389120ULL;
constexpr unsigned long long OFF_RECV_W = 1175552ULL;
constexpr unsigned long long OFF_RECV_X = 1732608ULL;
constexpr unsigned long long OFF_RECV_S = 1997303808ULL;
constexpr unsigned long long OFF_CSTAGE = 1997303808ULL;
constexpr unsigned long long META_STRIDE = 40960ULL;
constexpr unsigned long long META_FLAGS = 0ULL;
constexpr unsigned long long META_COUNTS = 256ULL;
constexpr unsigned long long META_CHANNELS = 4352ULL;
constexpr unsigned long long OFF_END = 2232184832ULL;

struct State {                       // OFF_STATE, this rank only
  unsigned long long disp_epoch;     // dispatches finished (the next one is disp_epoch + 1)
  unsigned long long comb_epoch;
  unsigned int meta_done, disp_done, comb_done, pad0;
  unsigned int send_next, recv_next, part_next, home_next;  // work counters: items taken beyond the first per slot
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

struct Args {                        // mirrors cuda_direct/library.py's ctypes structure: all 64-bit
  unsigned long long base[R];        // every rank's peer region (own included)
  long long me, T, C, NR, W, align;  // C channels; NR replicator blocks (besides the NSB senders)
  unsigned long long timeout_ns;
  unsigned long long err;            // ErrorRecord*, device view of host-mapped memory
  unsigned long long x, scales, topk_idx, topk_w;
  long long idx_int32, has_weights;
  unsigned long long y, out;
  long long NS, ND;                  // combine: partial blocks, home-only blocks (both sum partials)
  unsigned long long timeline;       // 0, or [2][TL_BLOCKS][TL_WORDS] u64 %globaltimer stamps (see stamp)
  long long NSB;                     // dispatch sender blocks
};

enum Where : int {
  WHERE_META = 1,  // dispatch: metadata flag of rank a
  WHERE_RECV_TAIL = 2,  // dispatch receiver: records of rank a, channel b
  WHERE_COMBINE_TAIL = 3,  // combine: partials from rank a, channel b
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

// The report of a wait that gave up; takes values, not the Args block (a reference to the kernel's
// parameters would give every kernel a local copy of them).
__device__ __noinline__ void fail_report(unsigned long long err, int me, int where, int x, int y,
                                         unsigned long long value, unsigned long long target, unsigned long long waited) {
  ErrorRecord* r = reinterpret_cast<ErrorRecord*>(err);
  if (atomicCAS(&r->code, 0, 1) == 0) {
    r->rank = me; r->where = where; r->a = x; r->b = y;
    r->value = value; r->target = target; r->waited_ns = waited;
    __threadfence_system();
  }
  printf("epcc: wait timed out after %.3f s: rank %d, wait %d, (%d, %d): value 0x%llx, waiting for >= 0x%llx\n",
         waited * 1e-9, me, where, x, y, value, target);
  __trap();
}
__device__ __forceinline__ void fail(const Args& a, int where, int x, int y, unsigned long long value,
                                     unsigned long long target, unsigned long long waited) {
  fail_report(a.err, (int)a.me, where, x, y, value, target, waited);
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

// ---- role timeline (bench/ep_bench.py): per block its start, per warp the end of its role ------
constexpr int TL_BLOCKS = 256;         // blocks per kernel that stamp
constexpr int TL_WORDS = 17;           // start, then the end of each of (at most) 16 warps
static_assert(TL_WORDS == 1 + DTHREADS / 32 && TL_WORDS == 1 + CTHREADS / 32, "a timeline word per warp");
__device__ __forceinline__ void stamp(const Args& a, int kernel, int word) {
  if (a.timeline && blockIdx.x < TL_BLOCKS)
    reinterpret_cast<unsigned long long*>(a.timeline)[(kernel * TL_BLOCKS + blockIdx.x) * TL_WORDS + word] = now_ns();
}

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
__device__ __forceinline__ bool clean_experts(int (&ex)[K]) {
  bool bad = false;
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
__device__ __forceinline__ bool load_experts(const Args& a, int t, int (&ex)[K]) {
#pragma unroll
  for (int j = 0; j < K; ++j) ex[j] = load_idx(a, t, j);
  return clean_experts(ex);
}
__device__ __forceinline__ int tokens_per_channel(int T, int C) { return T > 0 ? (T + C - 1) / C : 1; }

// =============================================================================================
// Metadata: step 'meta' (schedules/h200x4.sched:49), over chunks of MC tokens, warp w of a block
// holding the chunk's tokens [32w, 32w + 32), one per lane.
// meta_count (meta_count_kernel's block b = chunk b): every (token, slot) sets the token's bit in
//   the shared mask of (warp, expert), every token its bit in (warp, destination rank); a token's
//   rank among the chunk's tokens of an expert (token order) is the bits of that expert's masks of
//   earlier warps plus the bits below its lane, the chunk's counts are all of them (the same for
//   dedup positions per destination).  With one chunk (T <= MC: decode) that is final, and the
//   block goes on to publish (meta_publish); that block is dispatch_kernel's block 0 when its
//   first MC threads can count (meta_in_dispatch): no metadata kernel at all.  The metadata
//   threads meet at named barrier 1 (meta_sync), never __syncthreads, so the dispatch block's
//   other warps go straight on to wait for the flags.
// meta_finish_kernel (block b = chunk b, when there are several): adds the counts of earlier
//   chunks (token order across the whole batch), writes each channel's first dedup index; the
//   last block to finish publishes.
// meta_publish: the per-expert counts and the channel ranges to every peer, then this rank's
//   flag there (release, system scope).
// =============================================================================================
constexpr int MW = MTHREADS / 32;               // warps per metadata block
constexpr int MC = 256;          // tokens per metadata chunk: 32 per warp
static_assert(MC == 32 * MW, "a metadata warp holds 32 tokens, one per lane");
static_assert((MW + 1) * (E + R) * 4 + 64 <= 49152, "the metadata masks fit in shared memory (direct.py meta_shared_bytes)");

// The MC metadata threads of a block (the whole meta kernel block; the first MC of dispatch block 0).
__device__ __forceinline__ void meta_sync() { asm volatile("bar.sync 1, %0;" ::"n"(MTHREADS) : "memory"); }

struct MetaShared {
  unsigned mask[MW][E + R];  // bit l of [w][i]: token 32w + l of the chunk picked expert i (i < E)
                             // or has rows on rank i - E
  int tot[E + R];            // the chunk's tokens per expert, then per destination rank
  int bad;
};

// One metadata chunk (decode) and dispatch blocks of at least MC threads: dispatch_kernel's block 0
// counts and publishes, and epcc_direct_dispatch launches no metadata kernel.
__host__ __device__ __forceinline__ bool meta_in_dispatch(const Args& a) { return a.T <= MC && a.W * 32 >= MTHREADS; }

__device__ __forceinline__ int* chunk_counts(const Args& a) {  // [MAXCHUNKS][E + R + 1]: experts, ranks, bad
  return reinterpret_cast<int*>(region(a, (int)a.me) + OFF_CHUNKS);
}

// The MC metadata threads of the last metadata block: tot[0, E) this rank's tokens per expert, tot[E, E + R)
// per destination rank; the channels' first dedup indices are in mych.  Sends the counts to every
// peer and each destination its channel ranges, stores the first bad token, raises the flags.
__device__ void meta_publish(const Args& a, const int* tot, int bad, int p, unsigned long long e) {
  const int me = (int)a.me, T = (int)a.T, C = (int)a.C, Tc = tokens_per_channel(T, C), tid = threadIdx.x;
  const int* mych = reinterpret_cast<const int*>(region(a, me) + OFF_MYCHAN);
  State* st = state(a);
  for (int i = tid; i < E; i += MTHREADS) {
    const int v = tot[i];
#pragma unroll
    for (int d = 0; d < R; ++d) meta_cnt(a, d, p)[me * E + i] = v;
  }
  for (int i = tid; i < C * R; i += MTHREADS) {
    const int c = i / R, d = i % R;
    const int s0 = (c * Tc < T) ? mych[c * R + d] : tot[E + d];
    const int s1 = (c + 1 < C && (c + 1) * Tc < T) ? mych[(c + 1) * R + d] : tot[E + d];
    int* ch = meta_chan(a, d, p) + (me * CMAX + c) * 2;
    ch[0] = s0;
    ch[1] = s1 - s0;
  }
  if (tid == 0) st->bad_token = bad;
  __threadfence_system();
  meta_sync();
  if (tid == 0) {
    st->meta_done = 0;
    for (int d = 0; d < R; ++d) st_release_sys(meta_flag(a, d, p, me), e);
  }
}

// Chunk b's counts, by threads [0, MC) of the calling block; with `single` (one chunk) also the
// final ranks and the publishing.
__device__ void meta_count(const Args& a, MetaShared& sm, int b, bool single) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int T = (int)a.T, C = (int)a.C, Tc = tokens_per_channel(T, C), t = b * MC + warp * 32 + lane;
  char* my = region(a, (int)a.me);
  int* rank_tj = reinterpret_cast<int*>(my + OFF_RANK_TJ);   // [TMAX][K]: rank within the chunk (finished later)
  int* dedup = reinterpret_cast<int*>(my + OFF_DEDUP);       // [TMAX][R]: pos in chunk, or -(pos + 1) if absent
  int* mych = reinterpret_cast<int*>(my + OFF_MYCHAN);       // [CMAX + 1][R]: first dedup index of each channel
  int* cc = chunk_counts(a) + b * (E + R + 1);
  const unsigned lt = (1u << lane) - 1;
  auto& s_mask = sm.mask;
  int* s_tot = sm.tot;
  int& s_bad = sm.bad;
  for (int i = threadIdx.x; i < MW * (E + R); i += MTHREADS) (&s_mask[0][0])[i] = 0u;
  if (threadIdx.x == 0) s_bad = T;
  meta_sync();
  int ex[K];
  bool bad = false;
  if (t < T) {
    bad = load_experts(a, t, ex);
  } else {
#pragma unroll
    for (int j = 0; j < K; ++j) ex[j] = -1;
  }
  unsigned dst = 0;                        // bit d: the token has an expert on rank d
#pragma unroll
  for (int j = 0; j < K; ++j)
    if (ex[j] >= 0) {
      atomicOr(&s_mask[warp][ex[j]], 1u << lane);
      dst |= 1u << rank_of(ex[j]);
    }
#pragma unroll
  for (int d = 0; d < R; ++d) {
    const unsigned m = __ballot_sync(~0u, (dst >> d) & 1u);
    if (lane == 0) s_mask[warp][E + d] = m;
  }
  if (bad) atomicMin(&s_bad, t);
  meta_sync();
  for (int i = threadIdx.x; i < E + R; i += MTHREADS) {
    int n = 0;
#pragma unroll
    for (int w = 0; w < MW; ++w) n += __popc(s_mask[w][i]);
    s_tot[i] = n;
    cc[i] = n;
  }
  // the token's rank among the chunk's tokens of mask i: earlier warps' tokens, then lanes below
  auto before = [&](int i) {
    int n = __popc(s_mask[warp][i] & lt);
    for (int w = 0; w < warp; ++w) n += __popc(s_mask[w][i]);
    return n;
  };
  if (t < T) {
#pragma unroll
    for (int j = 0; j < K; ++j)
      if (ex[j] >= 0) rank_tj[t * K + j] = before(ex[j]);
#pragma unroll
    for (int d = 0; d < R; ++d) {
      const int pos = before(E + d);
      dedup[t * R + d] = (dst >> d) & 1u ? pos : single ? -1 : -(pos + 1);
      if (single && t % Tc == 0) mych[(t / Tc) * R + d] = pos;
    }
  }
  meta_sync();
  const int first_bad = s_bad < T ? s_bad : -1;
  if (threadIdx.x == 0) cc[E + R] = first_bad;
  if (single) {
    const unsigned long long e = state(a)->disp_epoch + 1;
    meta_publish(a, s_tot, first_bad, (int)(e & 1), e);
  }
}

__global__ void __launch_bounds__(MTHREADS) meta_count_kernel(const Args a) {
  __shared__ MetaShared sm;
  meta_count(a, sm, (int)blockIdx.x, gridDim.x == 1);
}

__global__ void __launch_bounds__(MTHREADS) meta_finish_kernel(const Args a) {
  const int b = blockIdx.x, G = gridDim.x, tid = threadIdx.x;
  const int me = (int)a.me, T = (int)a.T, C = (int)a.C, Tc = tokens_per_channel(T, C), tb = b * MC;
  char* my = region(a, me);
  State* st = state(a);
  const unsigned long long e = st->disp_epoch + 1;
  int* rank_tj = reinterpret_cast<int*>(my + OFF_RANK_TJ);
  int* dedup = reinterpret_cast<int*>(my + OFF_DEDUP);
  int* mych = reinterpret_cast<int*>(my + OFF_MYCHAN);
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
  // ---- last block: the totals over all chunks, the first bad token, then publish
  __shared__ int s_bad;
  for (int i = tid; i < E + R; i += blockDim.x) {
    int sum = 0;
    for (int q = 0; q < G; ++q) sum += cc[q * (E + R + 1) + i];
    base[i] = sum;
  }
  if (tid == 0) {
    int bad = -1;
    for (int q = 0; q < G; ++q) {
      const int v = cc[q * (E + R + 1) + E + R];
      if (v >= 0 && (bad < 0 || v < bad)) bad = v;
    }
    s_bad = bad;
  }
  __syncthreads();
  meta_publish(a, base, s_bad, (int)(e & 1), e);
}

// Work items of a role of B blocks x W warps (S = B x W slots).  Slot k = warp x B + block takes
// item k first: consecutive items land on different SMs, so a batch with fewer items than slots
// (decode: 128 channels for 192 or 384 sender warps) spreads over every SM of the role instead
// of filling the first blocks to arrive (one SM writes ~46 GB/s whatever its warps: sm_probe).
// Items S, S + 1, ... are then taken in increasing order from a per-rank counter, so uneven
// items (tokens to more or fewer GPUs, records with more or fewer rows) even out.
__device__ __forceinline__ int slot_of(int block, int blocks, int warp) { return warp * blocks + block; }
__device__ __forceinline__ int take(unsigned int* counter, int slots, int lane) {
  int v = 0;
  if (lane == 0) v = (int)atomicAdd(counter, 1u);
  return slots + __shfl_sync(~0u, v, 0);
}

// ---- warp-level row copies ------------------------------------------------------------------
// sm_probe (bench/sm_probe.cu) on 4x H200: one SM writes ~46 GB/s to peers with 16-byte warp
// stores but ~31 GB/s with bulk (TMA) copies issued by one thread, and reads ~170 GB/s with warp
// loads; so rows move by warps, each lane holding U vectors of the row between load and stores.
constexpr int XV = XB / 16;            // 16-byte vectors of a row's payload
constexpr int SV = SB / 16;            // 16-byte vectors of a row's scales (fp8)
constexpr int DU = 4;                  // vectors per lane in flight per dispatch copy step
static_assert(XB % 16 == 0 && SB % 16 == 0, "rows are copied in 16-byte vectors");

// Loads of a row written in this kernel by a peer: L2 only (never a stale L1 line).
__device__ __forceinline__ uint4 ld_row(const uint4* p) { return __ldcg(p); }
// Loads of the caller's inputs, read-only for the kernel's life.
__device__ __forceinline__ uint4 ld_in(const uint4* p) { return __ldg(p); }

// arr[i] = v with i known only at run time, without moving arr to local memory.
template <int N, typename P>
__device__ __forceinline__ void put_at(P (&arr)[N], int i, P v) {
#pragma unroll
  for (int k = 0; k < N; ++k)
    if (k == i) arr[k] = v;
}

// Copy one row (NV vectors) from src to the rows of dst[0..n): warp-wide, DU vectors per lane per
// step, loaded once and stored n times; the next step's loads go out before this step's stores,
// so a row costs about one load latency, not one per step (what a decode-sized batch waits for).
template <int NV, int MAXN, bool INPUT>
__device__ __forceinline__ void copy_row(const uint4* src, uint4* const (&dst)[MAXN], int n, int lane) {
  constexpr int STEP = 32 * DU;
  auto load = [&](uint4 (&v)[DU], int v0) {
#pragma unroll
    for (int u = 0; u < DU; ++u)
      if (v0 + 32 * u < NV) v[u] = INPUT ? ld_in(src + v0 + 32 * u) : ld_row(src + v0 + 32 * u);
  };
  uint4 cur[DU], nxt[DU];
  load(cur, lane);
  for (int v0 = lane; v0 < NV; v0 += STEP) {
    if (v0 + STEP < NV) load(nxt, v0 + STEP);
#pragma unroll
    for (int k = 0; k < MAXN; ++k) {
      if (k < n) {
#pragma unroll
        for (int u = 0; u < DU; ++u)
          if (v0 + 32 * u < NV) dst[k][v0 + 32 * u] = cur[u];
      }
    }
#pragma unroll
    for (int u = 0; u < DU; ++u) cur[u] = nxt[u];
  }
}

// ---- dispatch -----------------------------------------------------------------------------------
struct DispatchShared {
  int off[E];                        // first row of (this rank, expert e) on e's rank
  int tot[E];
  int seg[E];
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
  // each destination's expert segments, in local expert order: a warp-wide scan per 32 experts
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int d = warp; d < R; d += blockDim.x >> 5) {
    int acc = 0;
    for (int l0 = 0; l0 < EPR; l0 += 32) {
      const int l = l0 + lane, ex = expert_at(d, min(l, EPR - 1));
      const int v = l < EPR ? sh.tot[ex] : 0;
      int incl = v;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(~0u, incl, o);
        if (lane >= o) incl += y;
      }
      if (l < EPR) {
        sh.seg[ex] = acc + incl - v;
        if (d == me && blockIdx.x == 0) state(a)->recv_offset[l] = acc + incl - v;
      }
      acc += __shfl_sync(~0u, incl, 31);
    }
    if (d == me && blockIdx.x == 0 && lane == 0) state(a)->recv_offset[EPR] = acc;
  }
  __syncthreads();
  for (int ex = threadIdx.x; ex < E; ex += blockDim.x) sh.off[ex] += sh.seg[ex];
  __syncthreads();
}

// Sender warps take channels c (contiguous token ranges) one per slot, then in order (slot_of, take): step 'push' (schedules/h200x4.sched:50) and
// its local part 'keep'.  Per token: lane j < K takes top-k slot j (expert,
// row on the expert's rank, weight); per destination GPU the warp writes the weights of its rows,
// a record {token, n, rows} and the row itself, loaded once: remote GPUs get it once, at the
// token's first row there (their receivers replicate it), this GPU gets it in every row.  Lane d
// publishes the records of destination d (a release at system scope after the warp's barrier:
// rows, weights and records before the count) every PUB tokens and at the end.
__device__ void dispatch_channel(const Args& a, const DispatchShared& sh, int c, unsigned long long e) {
  const int me = (int)a.me, T = (int)a.T, C = (int)a.C, lane = threadIdx.x & 31;
  const int Tc = tokens_per_channel(T, C);
  const int t0 = c * Tc, t1 = min(T, t0 + Tc);
  const char* my = region(a, me);
  const int* rank_tj = reinterpret_cast<const int*>(my + OFF_RANK_TJ);
  const int* dedup = reinterpret_cast<const int*>(my + OFF_DEDUP);
  const unsigned lt = (1u << lane) - 1;
  int count = 0, published = 0;      // lane d < R: records written to / published at rank d
  // the next token's inputs are loaded before this token's row moves (no load latency per token)
  int raw[K], rtj = 0, di_lane = -1;
  float w_in = 1.f;
  auto fetch = [&](int t) {
    if (t < t1 && lane < K) {
#pragma unroll
      for (int j = 0; j < K; ++j) raw[j] = load_idx(a, t, j);
      rtj = rank_tj[t * K + lane];
      w_in = a.has_weights ? reinterpret_cast<const float*>(a.topk_w)[(long long)t * K + lane] : 1.f;
    }
    if (t < t1 && lane < R) di_lane = dedup[t * R + lane];
  };
  fetch(t0);
  for (int t = t0; t < t1; ++t) {
    int ex = -1, slot = -1, dj = -1;
    const float w = w_in;
    if (lane < K) {
      clean_experts(raw);
#pragma unroll
      for (int j = 0; j < K; ++j)
        if (j == lane) ex = raw[j];
      if (ex >= 0) {
        slot = sh.off[ex] + rtj;
        dj = rank_of(ex);
      }
    }
    const int di_tok = di_lane;
    uint4* xdst[K];                  // at most K rows in all: own rows plus one per peer
    uint4* sdst[K];
    int nd = 0;
#pragma unroll
    for (int d = 0; d < R; ++d) {
      const unsigned m = __ballot_sync(~0u, dj == d);
      if (!m) continue;
      const int di = __shfl_sync(~0u, di_tok, d);
      char* base = region(a, d);
      int* rec = record(a, d, me, di);
      if (dj == d) {
        reinterpret_cast<float*>(base + OFF_RECV_W)[slot] = w;
        rec[2 + __popc(m & lt)] = slot;
      }
      if (lane == 0) { rec[0] = t; rec[1] = __popc(m); }
      if (lane == d) ++count;
      // destinations of the row: this rank's every row, a peer's first row
      for (unsigned mm = m; mm; mm &= mm - 1) {
        const int row = __shfl_sync(~0u, slot, __ffs(mm) - 1);
        put_at(xdst, nd, reinterpret_cast<uint4*>(base + OFF_RECV_X + (long long)row * XB));
        put_at(sdst, nd, reinterpret_cast<uint4*>(base + OFF_RECV_S + (long long)row * SB));
        ++nd;
        if (d != me) break;
      }
    }
    fetch(t + 1);
    copy_row<XV, K, true>(reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(a.x) + (long long)t * XB), xdst,
                          nd, lane);
    if (FP8)
      copy_row<SV, K, true>(
          reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(a.scales) + (long long)t * SB), sdst, nd, lane);
    if ((t - t0 + 1) % PUB == 0 || t + 1 == t1) {
      __syncwarp();
      if (lane < R && lane != me && count != published) {
        st_release_sys(dtail(a, lane, me, c), (e << 32) | (unsigned long long)count);
        published = count;
      }
    }
  }
}

__device__ void dispatch_send(const Args& a, const DispatchShared& sh, unsigned long long e) {
  const int lane = threadIdx.x & 31, NB = (int)a.NSB, slots = NB * (int)(blockDim.x >> 5);
  for (int c = slot_of((int)blockIdx.x, NB, threadIdx.x >> 5); c < (int)a.C; c = take(&state(a)->send_next, slots, lane))
    dispatch_channel(a, sh, c, e);
}

// Replication: the (R - 1) x C queues j = c x (R - 1) + the source's index among the peers
// (channel-major, the order the peers' senders fill them).  Every warp of the kernel replicates:
// a sender block's warps once no channel is left to send, a replicator block's (NR, usually 0)
// from the start, so no SM idles while another still has rows to write (one SM writes ~46 GB/s:
// a fixed sender/receiver split leaves one side waiting on the other).  Warp slot k, counted
// from the last slot (slot_of: spread over the SMs, and away from the first senders), takes queue
// k first, then the counter hands out the rest.  Per queue the warp copies each record's first row
// into its other rows as the source's tail advances (bounded wait).  This rank's own channels
// have no queue: their senders wrote every row.
__device__ void dispatch_replicate(const Args& a, unsigned long long e, int p) {
  const int me = (int)a.me, C = (int)a.C, lane = threadIdx.x & 31;
  const int slots = (int)gridDim.x * (int)(blockDim.x >> 5);
  char* my = region(a, me);
  const int* chan = meta_chan(a, me, p);
  constexpr int PEERS = R > 1 ? R - 1 : 1;
  const int Q = (R - 1) * C;
  for (int j = slots - 1 - slot_of((int)blockIdx.x, (int)gridDim.x, threadIdx.x >> 5); j < Q;
       j = take(&state(a)->recv_next, slots, lane)) {
    const int c = j / PEERS, s = j % PEERS < me ? j % PEERS : j % PEERS + 1;
    const int start = ld_volatile(chan + (s * CMAX + c) * 2), count = ld_volatile(chan + (s * CMAX + c) * 2 + 1);
    for (int done = 0; done < count;) {
      const unsigned long long v =
          wait_geq(a, dtail(a, me, s, c), (e << 32) | (unsigned long long)(done + 1), WHERE_RECV_TAIL, s, c);
      const int avail = min(count, (int)(v & 0xffffffffULL));
      int cur = lane < RI ? __ldcg(record(a, me, s, start + done) + lane) : 0;  // lane k: int k of the record
      for (int r = start + done; r < start + avail; ++r) {
        const int nxt = (r + 1 < start + avail && lane < RI) ? __ldcg(record(a, me, s, r + 1) + lane) : 0;
        const int rec_l = cur;
        cur = nxt;
        const int n = __shfl_sync(~0u, rec_l, 1);
        if (n < 2) continue;
        const int row_l = __shfl_sync(~0u, rec_l, (2 + lane) & 31);
        const int first = __shfl_sync(~0u, row_l, 0);
        uint4* xdst[KL] = {};
        uint4* sdst[KL] = {};
#pragma unroll
        for (int k = 1; k < KL; ++k) {
          const int row = __shfl_sync(~0u, row_l, k);
          xdst[k - 1] = reinterpret_cast<uint4*>(my + OFF_RECV_X + (long long)row * XB);
          sdst[k - 1] = reinterpret_cast<uint4*>(my + OFF_RECV_S + (long long)row * SB);
        }
        copy_row<XV, KL, false>(reinterpret_cast<const uint4*>(my + OFF_RECV_X + (long long)first * XB), xdst, n - 1, lane);
        if (FP8)
          copy_row<SV, KL, false>(reinterpret_cast<const uint4*>(my + OFF_RECV_S + (long long)first * SB), sdst, n - 1,
                                  lane);
      }
      done = avail;
    }
  }
}

__global__ void __launch_bounds__(DTHREADS, 1) dispatch_kernel(const Args a) {
  __shared__ union {  // the metadata's masks (block 0, one chunk) are done before the offsets start
    MetaShared meta;
    DispatchShared disp;
  } smem;
  DispatchShared& sh = smem.disp;
  const int me = (int)a.me, warp = threadIdx.x >> 5;
  State* st = state(a);
  const unsigned long long e = st->disp_epoch + 1;
  const int p = (int)(e & 1);
  if (meta_in_dispatch(a) && blockIdx.x == 0 && threadIdx.x < MTHREADS) meta_count(a, smem.meta, 0, true);
  if (threadIdx.x < R) wait_geq(a, meta_flag(a, me, p, threadIdx.x), e, WHERE_META, (int)threadIdx.x, 0);
  __syncthreads();
  if (threadIdx.x == 0) stamp(a, 0, 0);
  const int SBK = (int)a.NSB;  // sender blocks
  if ((int)blockIdx.x < SBK) {
    dispatch_offsets(a, sh, p);
    dispatch_send(a, sh, e);
  }
  dispatch_replicate(a, e, p);
  if ((threadIdx.x & 31) == 0) stamp(a, 0, 1 + warp);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned prev = atomicAdd(&st->disp_done, 1u);
    if (prev == gridDim.x - 1) {
      st->disp_done = 0;
      st->send_next = 0;
      st->recv_next = 0;
      st->last_T = (int)a.T;
      st->last_C = (int)a.C;
      st->last_align = (int)a.align;
      __threadfence();
      st->disp_epoch = e;
    }
  }
}

// =============================================================================================
// combine_kernel: step 'push' (schedules/h200x4.sched:50) and 'keep'
// Expert side (the warps of blocks [0, NS)): take the (channel, source) queues q = c * R + s
//   (slot_of, then in order; channel-major, so every home rank gets its early channels first); per
//   record a warp reduces the record's rows, weighted, in fp32 (row order), stores one bf16
//   partial into the home rank's staging row of the token, and publishes the queue's progress
//   every CB records (release, sys).
// Home side (every warp, once no queue is left; blocks [NS, NS + ND) from the start): take
//   channels (slot_of counted from the last slot, then in order); per token lane d waits for rank
//   d's partial (bounded), then the warp sums the partials in rank order, fp32, and writes bf16.
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
constexpr int CB = 4;  // records a warp reduces between two releases of its queue's progress
constexpr int RING = 24;  // 16-byte vectors per lane in a combine warp's shared-memory ring
constexpr int COMBINE_SMEM = CTHREADS * RING * 16;  // the combine kernel's dynamic shared memory
static_assert(COMBINE_SMEM <= 232448, "combine rings exceed a block's shared memory");

// This warp's ring in the combine kernel's dynamic shared memory.
__device__ __forceinline__ uint4* warp_ring() {
  extern __shared__ uint4 combine_ring[];
  return combine_ring + (threadIdx.x >> 5) * 32 * RING;
}

// sum_k w[k] * src[k] over N rows, fp32 in row order, into dst (bf16).  Step i covers vector
// lane + 32 i of every row; its N 16-byte loads go to the lane's slot (i mod S) of the warp's
// shared-memory ring by cp.async (L2, never L1: partials written by peers during the kernel are
// read fresh), S - 1 steps ahead of the step being summed.  The loads in flight hold no registers,
// so a lane keeps (S - 1) x N of them going (registers held ~6 for the old unrolled loads).  A lane
// reads only the slots it filled: no barrier, only cp.async.wait_group.
__device__ __forceinline__ void cp_async16(uint4* smem, const uint4* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(smem))),
               "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory"); }

template <int N, int NMAX, int S>
__device__ __forceinline__ void reduce_rows(const uint4* const (&src)[NMAX], const float (&w)[NMAX], uint4* dst, int lane,
                                            uint4* ring) {
  constexpr int STEPS = (HV + 31) / 32;
  auto issue = [&](int i) {
    const int v = lane + 32 * i;
    if (i < STEPS && v < HV) {
#pragma unroll
      for (int k = 0; k < N; ++k) cp_async16(ring + ((i % S) * N + k) * 32 + lane, src[k] + v);
    }
    cp_async_commit();  // every lane commits every step (empty groups too): the wait counts stay in step
  };
#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue(i);
  for (int i = 0; i < STEPS; ++i) {
    issue(i + S - 1);
    cp_async_wait<S - 1>();  // groups complete in order: step i's loads have landed
    const int v = lane + 32 * i;
    if (v < HV) {
      float acc[8];
#pragma unroll
      for (int q8 = 0; q8 < 8; ++q8) acc[q8] = 0.f;
#pragma unroll
      for (int k = 0; k < N; ++k) bf16x8_fma(acc, ring[((i % S) * N + k) * 32 + lane], w[k]);
      dst[v] = pack_bf16x8(acc);
    }
  }
}

// reduce_<side>(n, ...): reduce_rows with S(n) ring slots (direct.py: as many as RING vectors per
// lane hold, S(n) x n <= RING).
__device__ __forceinline__ void reduce_expert(int n, const uint4* const (&src)[KL], const float (&w)[KL],
                                              uint4* dst, int lane, uint4* ring) {
  switch (n) {
    case 1: reduce_rows<1, KL, 24>(src, w, dst, lane, ring); break;
    case 2: reduce_rows<2, KL, 12>(src, w, dst, lane, ring); break;
    case 3: reduce_rows<3, KL, 8>(src, w, dst, lane, ring); break;
    case 4: reduce_rows<4, KL, 6>(src, w, dst, lane, ring); break;
    case 5: reduce_rows<5, KL, 4>(src, w, dst, lane, ring); break;
    case 6: reduce_rows<6, KL, 4>(src, w, dst, lane, ring); break;
    case 7: reduce_rows<7, KL, 3>(src, w, dst, lane, ring); break;
    case 8: reduce_rows<8, KL, 3>(src, w, dst, lane, ring); break;
    default: break;
  }
}
__device__ __forceinline__ void reduce_home(int n, const uint4* const (&src)[R], const float (&w)[R],
                                              uint4* dst, int lane, uint4* ring) {
  switch (n) {
    case 1: reduce_rows<1, R, 24>(src, w, dst, lane, ring); break;
    case 2: reduce_rows<2, R, 12>(src, w, dst, lane, ring); break;
    case 3: reduce_rows<3, R, 8>(src, w, dst, lane, ring); break;
    case 4: reduce_rows<4, R, 6>(src, w, dst, lane, ring); break;
    default: break;
  }
}

// The expert side of one warp (blocks [0, NS)): its records' partials, queue by queue.
__device__ void combine_partials(const Args& a, unsigned long long ce, int p, int C) {
  const int me = (int)a.me, NS = (int)a.NS, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  State* st = state(a);
  const uint4* y = reinterpret_cast<const uint4*>(a.y);
  const int* chan = meta_chan(a, me, p);
  const float* rw = reinterpret_cast<const float*>(region(a, me) + OFF_RECV_W);
  const int slots = NS * (CTHREADS / 32);
  for (int q = slot_of((int)blockIdx.x, NS, warp); q < R * C; q = take(&st->part_next, slots, lane)) {
    const int c = q / R, s = q % R;
    const int start = ld_volatile(chan + (s * CMAX + c) * 2), count = ld_volatile(chan + (s * CMAX + c) * 2 + 1);
    uint4* stage_s = reinterpret_cast<uint4*>(region(a, s) + OFF_CSTAGE) + (long long)me * TMAX * HV;
    int cur = (count > 0 && lane < RI) ? record(a, me, s, start)[lane] : 0;  // lane k: int k of the record
    for (int r = 0; r < count; ++r) {
      const int rec_l = cur;
      cur = (r + 1 < count && lane < RI) ? record(a, me, s, start + r + 1)[lane] : 0;
      const int t = __shfl_sync(~0u, rec_l, 0), n = __shfl_sync(~0u, rec_l, 1);
      const int row_l = __shfl_sync(~0u, rec_l, (2 + lane) & 31);
      const float w_l = lane < n ? rw[row_l] : 0.f;
      const uint4* src[KL];
      float w[KL];
#pragma unroll
      for (int k = 0; k < KL; ++k) {
        src[k] = y + (long long)__shfl_sync(~0u, row_l, k) * HV;
        w[k] = __shfl_sync(~0u, w_l, k);
      }
      reduce_expert(n, src, w, stage_s + (long long)t * HV, lane, warp_ring());
      if ((r + 1) % CB == 0 || r + 1 == count) {
        __syncwarp();
        if (lane == 0) st_release_sys(ctail(a, s, me, c), (ce << 32) | (unsigned long long)(r + 1));
      }
    }
  }
}

// The home side of one warp (every block, after its partials): the sums of its channels' tokens.
// Reads the epoch and the batch from State again rather than keeping them live through the
// partials' loop (one register more there spills; they do not change during the kernel).
__device__ void combine_sums(const Args& a) {
  const int me = (int)a.me, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  State* st = state(a);
  const unsigned long long ce = st->comb_epoch + 1;
  const int T = st->last_T, C = st->last_C;
  const char* my = region(a, me);
  const int* dedup = reinterpret_cast<const int*>(my + OFF_DEDUP);
  const int* mych = reinterpret_cast<const int*>(my + OFF_MYCHAN);
  const uint4* stage = reinterpret_cast<const uint4*>(my + OFF_CSTAGE);
  uint4* out = reinterpret_cast<uint4*>(a.out);
  const int Tc = tokens_per_channel(T, C);
  const int slots = (int)gridDim.x * (CTHREADS / 32);
  for (int c = slots - 1 - slot_of((int)blockIdx.x, (int)gridDim.x, warp); c < C; c = take(&st->home_next, slots, lane)) {
    const int t0 = c * Tc, t1 = min(T, t0 + Tc);
    const int base_l = lane < R ? mych[c * R + lane] : 0;
    for (int t = t0; t < t1; ++t) {
      const int di = lane < R ? dedup[t * R + lane] : -1;
      if (di >= 0)
        wait_geq(a, ctail(a, me, lane, c), (ce << 32) | (unsigned long long)(di - base_l + 1), WHERE_COMBINE_TAIL,
                 lane, c);
      const unsigned m = __ballot_sync(~0u, di >= 0);
      const uint4* src[R];
      float w[R];
      int n = 0;
#pragma unroll
      for (int d = 0; d < R; ++d) {
        src[d] = stage;
        w[d] = 1.f;
      }
#pragma unroll
      for (int d = 0; d < R; ++d)
        if (m & (1u << d)) put_at(src, n++, stage + ((long long)d * TMAX + t) * HV);
      if (n == 0) {
        for (int v = lane; v < HV; v += 32) out[(long long)t * HV + v] = make_uint4(0, 0, 0, 0);
      } else {
        reduce_home(n, src, w, out + (long long)t * HV, lane, warp_ring());
      }
    }
  }
}

__global__ void __launch_bounds__(CTHREADS, 1) combine_kernel(const Args a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  State* st = state(a);
  const unsigned long long ce = st->comb_epoch + 1;
  if (threadIdx.x == 0) stamp(a, 1, 0);
  if ((int)blockIdx.x < (int)a.NS) combine_partials(a, ce, (int)(st->disp_epoch & 1), st->last_C);
  combine_sums(a);
  if (lane == 0) stamp(a, 1, 1 + warp);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned prev = atomicAdd(&st->comb_done, 1u);
    if (prev == gridDim.x - 1) {
      st->comb_done = 0;
      st->part_next = 0;
      st->home_next = 0;
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
int epcc_direct_abi(void) { return 2; }
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
  cudaError_t err = cudaFuncSetAttribute(reinterpret_cast<const void*>(combine_kernel),
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, COMBINE_SMEM);
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
  cudaError_t err;
  if (!meta_in_dispatch(*a)) {
    const int chunks = a->T > 0 ? (int)((a->T + MC - 1) / MC) : 1;
    err = launch(reinterpret_cast<const void*>(meta_count_kernel), chunks, MTHREADS, 0, false, *a, s);
    if (err != cudaSuccess) return set_error(err, "launch meta_count_kernel");
    if (chunks > 1) {  // one chunk: meta_count_kernel finished and published itself
      err = launch(reinterpret_cast<const void*>(meta_finish_kernel), chunks, MTHREADS, 0, false, *a, s);
      if (err != cudaSuccess) return set_error(err, "launch meta_finish_kernel");
    }
  }
  err = launch(reinterpret_cast<const void*>(dispatch_kernel), (int)(a->NSB + a->NR), (int)a->W * 32, 0, true, *a, s);
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
  cudaError_t err = launch(reinterpret_cast<const void*>(combine_kernel), (int)(a->NS + a->ND), CTHREADS, COMBINE_SMEM,
                           true, *a, s);
  return err == cudaSuccess ? 0 : set_error(err, "launch combine_kernel");
}

}  // extern "C"
