// epcc/direct/dispatch.cuh: the dispatch kernel (the config's PUSH_STEP and KEEP_STEP): sender
// warps send their channels' tokens once per destination GPU, then every warp replicates the
// peers' rows into their other expert rows as the peers' tails advance.
//
// A static source of the epcc CUDA backend, copied unchanged into every bundle with direct kernels.
#pragma once

#include "common.cuh"
#include "meta.cuh"
#include "rows.cuh"

namespace {

// ---- dispatch -----------------------------------------------------------------------------------
struct DispatchShared {
  int off[E];                        // first row of (this rank, expert e) on e's rank
  int tot[E];
  int seg[E];
};

// The rows of (this rank, expert e) on e's rank: after the rows of the ranks before it, in e's
// segment, which the experts before e on that rank fill, each padded to the expert alignment of
// that rank (it lays out its receive buffer; ranks may pass different alignments).
__device__ void dispatch_offsets(const Args& a, DispatchShared& sh, int p) {
  const int me = (int)a.me;
  const int* cnt = meta_cnt(a, me, p);
  const int* shape = meta_sender(a, me, p);
  for (int ex = threadIdx.x; ex < E; ex += blockDim.x) {
    const int align = ld_volatile(shape + rank_of(ex) * SENDER_INTS + SENDER_ALIGN);
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

// Sender warps take channels c (contiguous token ranges) one per slot, then in order (slot_of, take): the
// config's PUSH_STEP and its local part KEEP_STEP.  Per token: lane j < K takes top-k slot j (expert,
// row on the expert's rank, weight); per destination GPU the warp writes the weights of its rows,
// a record {token, n, rows} and the row itself, loaded once: remote GPUs get it once, at the
// token's first row there (their receivers replicate it), this GPU gets it in every row.  Lane d
// publishes the records of destination d (a release at system scope after the warp's barrier:
// rows, weights and records before the count) every PUB tokens and at the end.
__device__ void dispatch_channel(const Args& a, const DispatchShared& sh, int c, unsigned long long e) {
  const int me = (int)a.me, lane = threadIdx.x & 31;
  const int2 span = channel_tokens(a, c);
  const int t0 = span.x, t1 = span.y;
  const char* my = region(a, me);
  const int* rank_tj = reinterpret_cast<const int*>(my + OFF_RANK_TJ);
  const int* dedup = reinterpret_cast<const int*>(my + OFF_DEDUP);
  const unsigned lt = (1u << lane) - 1;
  int count = 0, published = 0;      // lane d < R: records written to / published at rank d
  // the next token's inputs (and lane j's row rank among expert j's rows) before this token's row moves
  TokenIn in;
  int rtj = 0;
  auto fetch = [&](int t) {
    load_token(a, dedup, t, t1, lane, in);
    if (t < t1 && lane < K) rtj = rank_tj[t * K + lane];
  };
  fetch(t0);
  for (int t = t0; t < t1; ++t) {
    int ex = -1, slot = -1, dj = -1;
    const float w = in.w;
    if (lane < K) {
      ex = lane_expert(in.raw, lane);
      if (ex >= 0) {
        slot = sh.off[ex] + rtj;
        dj = rank_of(ex);
      }
    }
    const int di_tok = in.dedup;
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
  for_send_channels(a, (int)a.NSB, [&](int c) { dispatch_channel(a, sh, c, e); });
}

// Replication: the peers' channels queue by queue (for_peer_channels: a queue beyond its source's
// channels is skipped without a wait).  Every warp of the kernel replicates: a sender block's warps
// once no channel is left to send, a replicator block's (NR, usually 0) from the start, so no SM
// idles while another still has rows to write (one SM writes ~46 GB/s: a fixed sender/receiver
// split leaves one side waiting on the other).  Per queue the warp copies each record's first row
// into its other rows as the source's tail advances (bounded wait).  This rank's own channels have
// no queue: their senders wrote every row.
__device__ void dispatch_replicate(const Args& a, unsigned long long e, int p) {
  const int me = (int)a.me, lane = threadIdx.x & 31;
  char* my = region(a, me);
  const int* chan = meta_chan(a, me, p);
  for_peer_channels(a, p, [&](int s, int c) {
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
  });
}

// The start of a dispatch kernel, every block: the metadata (block 0 counts it where the batch is
// one chunk, meta_in_dispatch) and the wait for every sender's flag, unless the dispatch is cached
// (the metadata of its routing is in place, parity p).
__device__ __forceinline__ void dispatch_begin(const Args& a, MetaShared& meta, unsigned long long e, int p) {
  if (!a.cached) {
    if (meta_in_dispatch(a) && blockIdx.x == 0 && threadIdx.x < MTHREADS) meta_count(a, meta, 0, true);
    if (threadIdx.x < R) wait_geq(a, meta_flag(a, (int)a.me, p, threadIdx.x), e, WHERE_META, (int)threadIdx.x, 0);
  }
  __syncthreads();
  if (threadIdx.x == 0) stamp(a, 0, 0);
}

// The end of a dispatch kernel, every block: the last block to finish resets the work counters,
// records the batch (the combine reads it) and the meta area used, and advances the epoch.
__device__ __forceinline__ void dispatch_end(const Args& a, State* st, unsigned long long e, int p) {
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
      st->meta_parity = (unsigned)p;
      __threadfence();
      st->disp_epoch = e;
    }
  }
}

__global__ void __launch_bounds__(DTHREADS, 1) dispatch_kernel(const Args a) {
  __shared__ union {  // the metadata's masks (block 0, one chunk) are done before the offsets start
    MetaShared meta;
    DispatchShared disp;
  } smem;
  DispatchShared& sh = smem.disp;
  const int warp = threadIdx.x >> 5;
  State* st = state(a);
  const unsigned long long e = st->disp_epoch + 1;
  const int p = dispatch_parity(a);
  dispatch_begin(a, smem.meta, e, p);
  const int SBK = (int)a.NSB;  // sender blocks
  if ((int)blockIdx.x < SBK) {
    dispatch_offsets(a, sh, p);
    dispatch_send(a, sh, e);
  }
  dispatch_replicate(a, e, p);
  if ((threadIdx.x & 31) == 0) stamp(a, 0, 1 + warp);
  dispatch_end(a, st, e, p);
}

}  // namespace
