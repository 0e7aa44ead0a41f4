// epcc/direct/combine.cuh: the combine kernel (the config's COMBINE_PUSH_STEP and
// COMBINE_KEEP_STEP): each received record's rows reduced into one weighted bf16 partial on the
// expert's GPU and stored into the home GPU's staging area, then the home GPU's sums of the
// partials, both through per-warp shared-memory rings of cp.async loads.
//
// A static source of the epcc CUDA backend, copied unchanged into every bundle with direct kernels.
#pragma once

#include "common.cuh"
#include "rows.cuh"

namespace {

// =============================================================================================
// combine_kernel: the config's COMBINE_PUSH_STEP and COMBINE_KEEP_STEP
// Expert side (the warps of blocks [0, NS)): take the (channel, source) queues q = c * R + s
//   (slot_of, then in order; channel-major, so every home rank gets its early channels first), c
//   up to the most channels a source has, skipping those beyond its source's own count; per
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
constexpr int COMBINE_SMEM = CTHREADS * RING * 16;  // the combine kernel's dynamic shared memory
static_assert(COMBINE_SMEM <= MAX_SMEM, "combine rings exceed a block's shared memory");

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

// reduce_n<NMAX, STAGES>(n, ...): reduce_rows for n = 1..NMAX rows with STAGES[n - 1] ring slots
// (the config's tables, from direct.py: as many as RING vectors per lane hold, S(n) x n <= RING);
// one case per row count a warp can meet, the ones beyond NMAX compiled out.
template <int NMAX, const int* STAGES>
__device__ __forceinline__ void reduce_n(int n, const uint4* const (&src)[NMAX], const float (&w)[NMAX], uint4* dst,
                                         int lane, uint4* ring) {
  static_assert(NMAX >= 1 && NMAX <= 12, "a ring double-buffers at most RING / 2 rows (direct.py ring_stages)");
  switch (n) {
    case 1: reduce_rows<1, NMAX, STAGES[0]>(src, w, dst, lane, ring); break;
    case 2: if constexpr (NMAX >= 2) reduce_rows<2, NMAX, STAGES[1]>(src, w, dst, lane, ring); break;
    case 3: if constexpr (NMAX >= 3) reduce_rows<3, NMAX, STAGES[2]>(src, w, dst, lane, ring); break;
    case 4: if constexpr (NMAX >= 4) reduce_rows<4, NMAX, STAGES[3]>(src, w, dst, lane, ring); break;
    case 5: if constexpr (NMAX >= 5) reduce_rows<5, NMAX, STAGES[4]>(src, w, dst, lane, ring); break;
    case 6: if constexpr (NMAX >= 6) reduce_rows<6, NMAX, STAGES[5]>(src, w, dst, lane, ring); break;
    case 7: if constexpr (NMAX >= 7) reduce_rows<7, NMAX, STAGES[6]>(src, w, dst, lane, ring); break;
    case 8: if constexpr (NMAX >= 8) reduce_rows<8, NMAX, STAGES[7]>(src, w, dst, lane, ring); break;
    case 9: if constexpr (NMAX >= 9) reduce_rows<9, NMAX, STAGES[8]>(src, w, dst, lane, ring); break;
    case 10: if constexpr (NMAX >= 10) reduce_rows<10, NMAX, STAGES[9]>(src, w, dst, lane, ring); break;
    case 11: if constexpr (NMAX >= 11) reduce_rows<11, NMAX, STAGES[10]>(src, w, dst, lane, ring); break;
    case 12: if constexpr (NMAX >= 12) reduce_rows<12, NMAX, STAGES[11]>(src, w, dst, lane, ring); break;
    default: break;
  }
}
__device__ __forceinline__ void reduce_expert(int n, const uint4* const (&src)[KL], const float (&w)[KL], uint4* dst,
                                              int lane, uint4* ring) {
  reduce_n<KL, EXPERT_STAGES>(n, src, w, dst, lane, ring);
}
__device__ __forceinline__ void reduce_home(int n, const uint4* const (&src)[R], const float (&w)[R], uint4* dst,
                                            int lane, uint4* ring) {
  reduce_n<R, HOME_STAGES>(n, src, w, dst, lane, ring);
}

// The expert side of one warp (blocks [0, NS)): its records' partials, queue by queue, over each
// source's channels (its home side waits for every one of them).
__device__ void combine_partials(const Args& a, unsigned long long ce, int p) {
  const int me = (int)a.me, NS = (int)a.NS, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  State* st = state(a);
  const uint4* y = reinterpret_cast<const uint4*>(a.y);
  const int* chan = meta_chan(a, me, p);
  const float* rw = reinterpret_cast<const float*>(region(a, me) + OFF_RECV_W);
  const int slots = NS * (CTHREADS / 32);
  const int chans_l = sender_channels(a, p, lane);  // lane s: source s's channels
  const int Q = R * __reduce_max_sync(~0u, chans_l);
  for (int q = slot_of((int)blockIdx.x, NS, warp); q < Q; q = take(&st->part_next, slots, lane)) {
    const int c = q / R, s = q % R;
    if (c >= __shfl_sync(~0u, chans_l, s)) continue;
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
// OWN_IN_PLACE (the token-major kernels, token.cuh): this rank's own row of a token is not staged
// but read in place from the expert outputs (a.y, row src_offset[me] + the token's dedup rank here).
template <bool OWN_IN_PLACE>
__device__ void combine_sums(const Args& a) {
  const int me = (int)a.me, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  State* st = state(a);
  const unsigned long long ce = st->comb_epoch + 1;
  const int T = st->last_T, C = st->last_C;
  const char* my = region(a, me);
  const int* dedup = reinterpret_cast<const int*>(my + OFF_DEDUP);
  const int* mych = reinterpret_cast<const int*>(my + OFF_MYCHAN);
  const uint4* stage = reinterpret_cast<const uint4*>(my + OFF_CSTAGE);
  const uint4* own = OWN_IN_PLACE ? reinterpret_cast<const uint4*>(a.y) + (long long)st->src_offset[me] * HV : stage;
  uint4* out = reinterpret_cast<uint4*>(a.out);
  const int Tc = tokens_per_channel(T, C);
  const int slots = (int)gridDim.x * (CTHREADS / 32);
  for (int c = slots - 1 - slot_of((int)blockIdx.x, (int)gridDim.x, warp); c < C; c = take(&st->home_next, slots, lane)) {
    const int t0 = c * Tc, t1 = min(T, t0 + Tc);
    const int base_l = lane < R ? mych[c * R + lane] : 0;
    for (int t = t0; t < t1; ++t) {
      const int di = lane < R ? dedup[t * R + lane] : -1;
      if (di >= 0 && !(OWN_IN_PLACE && lane == me))
        wait_geq(a, ctail(a, me, lane, c), (ce << 32) | (unsigned long long)(di - base_l + 1), WHERE_COMBINE_TAIL,
                 lane, c);
      const unsigned m = __ballot_sync(~0u, di >= 0);
      const int di_me = __shfl_sync(~0u, di, me);
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
        if (m & (1u << d))
          put_at(src, n++, OWN_IN_PLACE && d == me ? own + (long long)di_me * HV : stage + ((long long)d * TMAX + t) * HV);
      if (n == 0) {
        for (int v = lane; v < HV; v += 32) out[(long long)t * HV + v] = make_uint4(0, 0, 0, 0);
      } else {
        reduce_home(n, src, w, out + (long long)t * HV, lane, warp_ring());
      }
    }
  }
}

// The end of a combine kernel, every block: the last block to finish resets the work counters
// and advances the combine epoch.
__device__ __forceinline__ void combine_end(State* st, unsigned long long ce) {
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

__global__ void __launch_bounds__(CTHREADS, 1) combine_kernel(const Args a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  State* st = state(a);
  const unsigned long long ce = st->comb_epoch + 1;
  if (threadIdx.x == 0) stamp(a, 1, 0);
  if ((int)blockIdx.x < (int)a.NS) combine_partials(a, ce, (int)st->meta_parity);
  combine_sums<false>(a);
  if (lane == 0) stamp(a, 1, 1 + warp);
  combine_end(st, ce);
}

}  // namespace
