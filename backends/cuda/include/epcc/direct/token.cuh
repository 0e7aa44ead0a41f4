// epcc/direct/token.cuh: the token-major kernels (the workload's `layout token`, DeepEP's
// intranode output): dispatch stores each token once per destination GPU, into rows ordered by
// (source rank, token), with each row's top-k as DeepEP returns it (local expert ids, -1 where the
// expert is on another rank; the weight there, 0 elsewhere); combine is its adjoint, each token's
// rows summed unweighted at its home rank.
//
// Row layout on rank d: the rows of source s are [src_offset[s], src_offset[s + 1]), one per token
// of s with an expert on d, in token order; token t of s is row src_offset[s] + its dedup rank
// among the tokens of s for d (the metadata's dedup index).  A sender places its rows on d after
// the rows of the ranks before it there, from the tokens per (sender, destination) every sender
// publishes with its metadata (META_TOKENS).
//
// tok_dispatch_kernel (cooperative): the warps of blocks [0, NSB) take channels (slot_of, then in
//   order); per token a warp loads the row once and stores it into every destination's row (its own
//   GPU's included), with the row's top-k ids and weights and its token (what the combine needs);
//   per destination lane d publishes the channel's rows at the channel's end (a release at system
//   scope).  Then every warp waits for the peers' channels (bounded) so that the kernel ends when
//   every row of this rank has landed.  No replication: a token-major row is written once.
// tok_combine_kernel (cooperative): the warps of blocks [0, NS) copy each received row of a peer's
//   token into that peer's staging row (this rank, token) and publish the (channel, source) queue's
//   progress every CB rows; then every warp sums its channels' tokens (combine.cuh's
//   combine_sums<true>): lane d waits for rank d's row, the warp adds the rows (this rank's own read
//   in place from the expert outputs) in rank order in fp32 and writes bf16.
//
// A static source of the epcc CUDA backend, copied only into token-major bundles (their config
// defines EPCC_DIRECT_TOKEN_MAJOR; host.cuh includes this header then).
#pragma once

#include "common.cuh"
#include "meta.cuh"
#include "rows.cuh"
#include "dispatch.cuh"
#include "combine.cuh"

namespace {

__device__ __forceinline__ int local_of(int e) { return BLOCKED ? e % EPR : e / R; }

struct TokShared {
  int dst_row[R];  // first row of this rank's tokens on each destination
};

// The first row of this rank's tokens on every destination; block 0 also records where each
// source's rows start on this rank (State::src_offset) and the tokens per local expert, rounded up
// to the expert alignment (DeepEP's num_recv_tokens_per_expert_list).
__device__ void tok_offsets(const Args& a, TokShared& sh, int p) {
  const int me = (int)a.me;
  const int* nt = meta_tokens(a, me, p);  // [sender][destination]
  if (threadIdx.x < R) {
    int off = 0;
    for (int s = 0; s < me; ++s) off += ld_volatile(nt + s * R + threadIdx.x);
    sh.dst_row[threadIdx.x] = off;
  }
  if (blockIdx.x == 0) {
    State* st = state(a);
    if (threadIdx.x == 0) {
      int acc = 0;
      for (int s = 0; s < R; ++s) {
        st->src_offset[s] = acc;
        acc += ld_volatile(nt + s * R + me);
      }
      st->src_offset[R] = acc;
    }
    const int* cnt = meta_cnt(a, me, p);
    const int align = (int)a.align;
    for (int l = threadIdx.x; l < EPR; l += blockDim.x) {
      const int ex = expert_at(me, l);
      int tot = 0;
#pragma unroll
      for (int s = 0; s < R; ++s) tot += ld_volatile(cnt + s * E + ex);
      st->recv_count[l] = (tot + align - 1) / align * align;
    }
  }
  __syncthreads();
}

// One channel of this rank's tokens (the config's PUSH_STEP and KEEP_STEP).  Lane j < K holds top-k
// slot j (expert, weight), lane d < R the token's dedup rank for destination d (-1: no expert there).
__device__ void tok_channel(const Args& a, const TokShared& sh, int c, unsigned long long e) {
  const int me = (int)a.me, lane = threadIdx.x & 31;
  const int2 span = channel_tokens(a, c);
  const int t0 = span.x, t1 = span.y;
  const int* dedup = reinterpret_cast<const int*>(region(a, me) + OFF_DEDUP);
  const int row0_l = lane < R ? sh.dst_row[lane] : 0;
  int count = 0;  // lane d < R: rows written to rank d
  TokenIn in;  // the next token's inputs, loaded before this token's row moves
  load_token(a, dedup, t0, t1, lane, in);
  for (int t = t0; t < t1; ++t) {
    int ex = -1, dj = -1;
    const float w = in.w;
    if (lane < K) {
      ex = lane_expert(in.raw, lane);
      if (ex >= 0) dj = rank_of(ex);
    }
    const int row_l = in.dedup >= 0 ? row0_l + in.dedup : -1;  // lane d: the token's row on rank d
    const unsigned dests = __ballot_sync(~0u, lane < R && row_l >= 0);
    uint4* xdst[R];
    uint4* sdst[R];
    int nd = 0;
#pragma unroll
    for (int d = 0; d < R; ++d) {
      if (!((dests >> d) & 1u)) continue;
      const int row = __shfl_sync(~0u, row_l, d);
      char* base = region(a, d);
      if (lane < K) {
        const bool here = dj == d;
        reinterpret_cast<long long*>(base + OFF_RECV_IDX)[(long long)row * K + lane] = here ? local_of(ex) : -1;
        reinterpret_cast<float*>(base + OFF_RECV_W)[(long long)row * K + lane] = here ? w : 0.f;
      }
      if (lane == 0) reinterpret_cast<int*>(base + OFF_ROW_TOKEN)[row] = t;
      put_at(xdst, nd, reinterpret_cast<uint4*>(base + OFF_RECV_X + (long long)row * XB));
      put_at(sdst, nd, reinterpret_cast<uint4*>(base + OFF_RECV_S + (long long)row * SB));
      ++nd;
    }
    if (lane < R && row_l >= 0) ++count;
    load_token(a, dedup, t + 1, t1, lane, in);
    if (t + 1 >= t1) in.dedup = -1;
    copy_row<XV, R, true>(reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(a.x) + (long long)t * XB), xdst,
                          nd, lane);
    if (FP8)
      copy_row<SV, R, true>(reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(a.scales) + (long long)t * SB),
                            sdst, nd, lane);
  }
  __syncwarp();
  if (lane < R && lane != me && count > 0) st_release_sys(dtail(a, lane, me, c), (e << 32) | (unsigned long long)count);
}

// Every warp, after sending: wait until every peer's channel has landed here (its tail at the
// channel's row count), queue by queue as dispatch.cuh's replication (for_peer_channels); a queue
// beyond its source's channels, or of no rows, is skipped without a wait.
__device__ void tok_wait_peers(const Args& a, unsigned long long e, int p) {
  const int me = (int)a.me, lane = threadIdx.x & 31;
  const int* chan = meta_chan(a, me, p);
  for_peer_channels(a, p, [&](int s, int c) {
    const int count = ld_volatile(chan + (s * CMAX + c) * 2 + 1);
    if (count > 0 && lane == 0)
      wait_geq(a, dtail(a, me, s, c), (e << 32) | (unsigned long long)count, WHERE_RECV_TAIL, s, c);
    __syncwarp();
  });
}

__global__ void __launch_bounds__(DTHREADS, 1) tok_dispatch_kernel(const Args a) {
  __shared__ union {  // the metadata's masks (block 0, one chunk) are done before the offsets start
    MetaShared meta;
    TokShared tok;
  } smem;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  State* st = state(a);
  const unsigned long long e = st->disp_epoch + 1;
  const int p = dispatch_parity(a);
  dispatch_begin(a, smem.meta, e, p);
  if ((int)blockIdx.x < (int)a.NSB) {
    tok_offsets(a, smem.tok, p);
    for_send_channels(a, (int)a.NSB, [&](int c) { tok_channel(a, smem.tok, c, e); });
  }
  tok_wait_peers(a, e, p);
  if (lane == 0) stamp(a, 0, 1 + warp);
  dispatch_end(a, st, e, p);
}

// ---- combine ---------------------------------------------------------------------------------
// The expert side of one warp (blocks [0, NS)): each peer's rows, queue (channel, source) by queue,
// copied into the source's staging row (this rank, token).  This rank's own rows stay in place:
// the home side reads them from the expert outputs.
__device__ void tok_partials(const Args& a, unsigned long long ce, int p) {
  const int me = (int)a.me, NS = (int)a.NS, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  State* st = state(a);
  const uint4* y = reinterpret_cast<const uint4*>(a.y);
  const int* chan = meta_chan(a, me, p);
  const int* row_token = reinterpret_cast<const int*>(region(a, me) + OFF_ROW_TOKEN);
  const int slots = NS * (CTHREADS / 32);
  const int chans_l = sender_channels(a, p, lane);
  const int Q = R * __reduce_max_sync(~0u, lane == me ? 0 : chans_l);
  for (int q = slot_of((int)blockIdx.x, NS, warp); q < Q; q = take(&st->part_next, slots, lane)) {
    const int c = q / R, s = q % R;
    if (s == me || c >= __shfl_sync(~0u, chans_l, s)) continue;
    const int start = ld_volatile(chan + (s * CMAX + c) * 2), count = ld_volatile(chan + (s * CMAX + c) * 2 + 1);
    const int row0 = ld_volatile(&st->src_offset[s]) + start;
    uint4* stage_s = reinterpret_cast<uint4*>(region(a, s) + OFF_CSTAGE) + (long long)me * TMAX * HV;
    for (int r0 = 0; r0 < count; r0 += 32) {
      const int tok_l = r0 + lane < count ? row_token[row0 + r0 + lane] : 0;  // lane i: row r0 + i's token
      const int n = min(32, count - r0);
      for (int i = 0; i < n; ++i) {
        const int t = __shfl_sync(~0u, tok_l, i);
        uint4* dst[1] = {stage_s + (long long)t * HV};
        copy_row<HV, 1, true>(y + (long long)(row0 + r0 + i) * HV, dst, 1, lane);
        const int r = r0 + i;
        if ((r + 1) % CB == 0 || r + 1 == count) {
          __syncwarp();
          if (lane == 0) st_release_sys(ctail(a, s, me, c), (ce << 32) | (unsigned long long)(r + 1));
        }
      }
    }
  }
}

__global__ void __launch_bounds__(CTHREADS, 1) tok_combine_kernel(const Args a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  State* st = state(a);
  const unsigned long long ce = st->comb_epoch + 1;
  if (threadIdx.x == 0) stamp(a, 1, 0);
  if ((int)blockIdx.x < (int)a.NS) tok_partials(a, ce, (int)st->meta_parity);
  combine_sums<true>(a);  // this rank's own rows read in place from the expert outputs
  if (lane == 0) stamp(a, 1, 1 + warp);
  combine_end(st, ce);
}

}  // namespace
