// epcc/direct/common.cuh: what every part of the direct kernels shares: the State, ErrorRecord and
// Args blocks, acquire/release memory operations, the bounded wait and its report, the role
// timeline's stamps, the peer region's accessors and the top-k loads.
//
// A static source of the epcc CUDA backend, copied unchanged into every bundle with direct kernels
// (backends/cuda/direct.py).  The plan's numbers (R, E, K, H, TMAX, the region offsets, the waits)
// come from the generated epcc_direct_config.cuh, which a translation unit includes first.
#pragma once

#ifndef EPCC_DIRECT_CONFIG
#error "include the plan's epcc_direct_config.cuh (written by epcc compile --target cuda) first"
#endif

#include <cstdint>
#include <cstdio>
#include <cstddef>
#include <cstring>
#include <cuda_runtime.h>
#include <cuda_bf16.h>

namespace {

static_assert(R <= 32, "a warp writes one count per rank");
static_assert(K <= 32 && RI <= 32, "a lane per top-k slot and per int of a record");

struct State {                       // OFF_STATE, this rank only
  unsigned long long disp_epoch;     // dispatches finished (the next one is disp_epoch + 1)
  unsigned long long comb_epoch;
  unsigned int meta_done, disp_done, comb_done, pad0;
  unsigned int send_next, recv_next, part_next, home_next;  // work counters: items taken beyond the first per slot
  int last_T, last_C, last_align;
  int bad_token;                     // first token whose top-k names an expert out of range or twice, else -1
  int recv_count[EPR];               // rows received per local expert (unpadded)
  int recv_offset[EPR + 1];          // first row of each local expert, then the total (padded)
  unsigned int meta_parity;          // the meta area (0 or 1) of the last metadata computed: a cached
                                     // dispatch and the combine read it, the next metadata the other
  int src_offset[R + 1];             // token-major: first row of each source rank, then the total
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
  long long cached;                  // 1: the routing of the last metadata again (a cached handle): no metadata
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
static_assert(TL_WORDS == 1 + DTHREADS / 32 && TL_WORDS == 1 + CTHREADS / 32, "a timeline word per warp");
__device__ __forceinline__ void stamp(const Args& a, int kernel, int word) {
  if (a.timeline && blockIdx.x < TL_BLOCKS)
    reinterpret_cast<unsigned long long*>(a.timeline)[(kernel * TL_BLOCKS + blockIdx.x) * TL_WORDS + word] = now_ns();
}

// ---- region accessors -----------------------------------------------------------------------
__device__ __forceinline__ char* region(const Args& a, int r) { return reinterpret_cast<char*>(a.base[r]); }
__device__ __forceinline__ State* state(const Args& a) { return reinterpret_cast<State*>(region(a, (int)a.me) + OFF_STATE); }
// meta area of rank r, parity p, per sender: flags [R] u64, counts [R][E] int, channel ranges
// [R][CMAX][2] int, shapes [R][SENDER_INTS] int (its channels, its expert alignment)
__device__ __forceinline__ unsigned long long* meta_flag(const Args& a, int r, int p, int src) {
  return reinterpret_cast<unsigned long long*>(region(a, r) + OFF_META + p * META_STRIDE + META_FLAGS) + src;
}
__device__ __forceinline__ int* meta_cnt(const Args& a, int r, int p) {
  return reinterpret_cast<int*>(region(a, r) + OFF_META + p * META_STRIDE + META_COUNTS);
}
__device__ __forceinline__ int* meta_chan(const Args& a, int r, int p) {
  return reinterpret_cast<int*>(region(a, r) + OFF_META + p * META_STRIDE + META_CHANNELS);
}
__device__ __forceinline__ int* meta_sender(const Args& a, int r, int p) {
  return reinterpret_cast<int*>(region(a, r) + OFF_META + p * META_STRIDE + META_SENDERS);
}
// tokens per (sender, destination) [R][R], after the senders' shapes in the same meta area: every
// sender publishes its row to every rank (a token-major sender places its rows on a destination
// after those of the ranks before it there)
constexpr unsigned long long META_TOKENS = META_SENDERS + R * SENDER_INTS * 4;
static_assert(META_TOKENS + R * R * 4 <= META_STRIDE, "the meta area holds the tokens per (sender, destination)");
__device__ __forceinline__ int* meta_tokens(const Args& a, int r, int p) {
  return reinterpret_cast<int*>(region(a, r) + OFF_META + p * META_STRIDE + META_TOKENS);
}
// The meta area the next metadata writes (the one the last metadata did not), and the one a
// dispatch reads: the last one's for a cached dispatch, else the next.
__device__ __forceinline__ int fresh_parity(const Args& a) { return (int)(state(a)->meta_parity ^ 1u); }
__device__ __forceinline__ int dispatch_parity(const Args& a) {
  return a.cached ? (int)state(a)->meta_parity : fresh_parity(a);
}
constexpr int SENDER_CHANNELS = 0, SENDER_ALIGN = 1;  // the ints of a sender's shape
static_assert(SENDER_INTS == 2, "a sender's shape: its channels, its expert alignment");
// Ranks may dispatch different numbers of tokens, hence of channels: a loop over a peer's
// channels runs to that peer's count, as it published it.  Lane s < R: sender s's channels in the
// dispatch of parity p (0 in the other lanes).
__device__ __forceinline__ int sender_channels(const Args& a, int p, int lane) {
  return lane < R ? ld_volatile(meta_sender(a, (int)a.me, p) + lane * SENDER_INTS + SENDER_CHANNELS) : 0;
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

// ---- a sender warp's tokens (dispatch.cuh's dispatch_channel, token.cuh's tok_channel) ----------
// The tokens [x, y) of this rank's channel c.
__device__ __forceinline__ int2 channel_tokens(const Args& a, int c) {
  const int T = (int)a.T, Tc = tokens_per_channel(T, (int)a.C);
  return make_int2(c * Tc, min(T, c * Tc + Tc));
}
// What a sender warp reads of a token before its row moves (loaded one token ahead, so that no
// load latency stands between two rows): lanes j < K its K top-k entries as given and the weight
// of entry j, lane d < R its dedup rank for destination d (-1: no expert there).
struct TokenIn {
  int raw[K];
  float w = 1.f;
  int dedup = -1;
};
// Token t's inputs into `in` where t is before the channel's end t1 (else `in` is kept).
__device__ __forceinline__ void load_token(const Args& a, const int* dedup, int t, int t1, int lane, TokenIn& in) {
  if (t < t1 && lane < K) {
#pragma unroll
    for (int j = 0; j < K; ++j) in.raw[j] = load_idx(a, t, j);
    in.w = a.has_weights ? reinterpret_cast<const float*>(a.topk_w)[(long long)t * K + lane] : 1.f;
  }
  if (t < t1 && lane < R) in.dedup = dedup[t * R + lane];
}
// Lane j < K: top-k entry j of a token's entries `raw`, cleaned in place first (clean_experts:
// -1 where empty or refused).
__device__ __forceinline__ int lane_expert(int (&raw)[K], int lane) {
  clean_experts(raw);
  int ex = -1;
#pragma unroll
  for (int j = 0; j < K; ++j)
    if (j == lane) ex = raw[j];
  return ex;
}

}  // namespace
