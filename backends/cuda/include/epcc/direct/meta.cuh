// epcc/direct/meta.cuh: the metadata kernels (the plan's metadata exchange step, or the push
// step's where the plan has none: see the config's step list): per-expert ranks and counts,
// per-destination dedup indices and channel ranges, published to every peer with one release
// flag per peer.
//
// A static source of the epcc CUDA backend, copied unchanged into every bundle with direct kernels.
#pragma once

#include "common.cuh"

namespace {

// =============================================================================================
// Metadata: the config's META_STEP, over chunks of MC tokens, warp w of a block
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
// meta_publish: the per-expert counts, the tokens per destination and the channel ranges to every
//   peer, then this rank's flag there (release, system scope), into the meta area the last
//   metadata did not use (fresh_parity: a cached dispatch may still read that one).
// =============================================================================================
constexpr int MW = MTHREADS / 32;               // warps per metadata block
static_assert(MC == 32 * MW, "a metadata warp holds 32 tokens, one per lane");
static_assert((MW + 1) * (E + R) * 4 + 64 <= META_SHARED, "the metadata masks fit in shared memory (direct.py meta_shared_bytes)");

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
// per destination rank; the channels' first dedup indices are in mych.  Sends the counts, this
// rank's shape (channels, expert alignment) to every peer and each destination its channel
// ranges, stores the first bad token, raises the flags.
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
  if (tid < R) {
    int* shape = meta_sender(a, tid, p) + me * SENDER_INTS;
    shape[SENDER_CHANNELS] = C;
    shape[SENDER_ALIGN] = (int)a.align;
  }
  for (int i = tid; i < R * R; i += MTHREADS) meta_tokens(a, i / R, p)[me * R + i % R] = tot[E + i % R];
  if (tid == 0) {
    st->bad_token = bad;
    st->meta_done = 0;
  }
  // Every metadata thread's stores above happen before the barrier, and a release is cumulative:
  // thread d's release of peer d's flag makes them visible to whoever acquires that flag.  One
  // thread per peer, in parallel: each release waits for the system-scope fence it implies (~1.5 us
  // on H100), which one thread raising every flag in turn paid once per peer (measured 2 x H100,
  // 2026-11-27: 5.5 us from the counts' end to the flags', of a 29 us decode dispatch).
  meta_sync();
  if (tid < R) st_release_sys(meta_flag(a, tid, p, me), e);
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
    meta_publish(a, s_tot, first_bad, fresh_parity(a), e);
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
  meta_publish(a, base, s_bad, fresh_parity(a), e);
}

}  // namespace
