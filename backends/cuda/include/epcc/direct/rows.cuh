// epcc/direct/rows.cuh: how warps share work (slot_of, take; the dispatch kernels' channels,
// for_send_channels and for_peer_channels) and move rows (copy_row): the dispatch's senders and
// replicators and the combine's two sides use both.
//
// A static source of the epcc CUDA backend, copied unchanged into every bundle with direct kernels.
#pragma once

#include "common.cuh"

namespace {

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

// This rank's channels over the sender warps of blocks [0, NB) (slot_of, then in order from
// State::send_next): send(c) for each.
template <typename F>
__device__ __forceinline__ void for_send_channels(const Args& a, int NB, F&& send) {
  const int lane = threadIdx.x & 31, slots = NB * (int)(blockDim.x >> 5);
  for (int c = slot_of((int)blockIdx.x, NB, threadIdx.x >> 5); c < (int)a.C; c = take(&state(a)->send_next, slots, lane))
    send(c);
}

// The peers' channels that land on this rank (dispatch of parity p), over every warp of the kernel:
// queue j = c x (R - 1) + the source's index among the peers (channel-major, the order the peers'
// senders fill them), c up to the most channels a peer has.  Warp slot k, counted from the last
// slot (slot_of: spread over the SMs, and away from the first senders), takes queue k first, then
// the counter State::recv_next hands out the rest.  visit(s, c) for source s's channel c; a queue
// beyond its source's channels (a peer with fewer tokens has fewer) is skipped.
template <typename F>
__device__ __forceinline__ void for_peer_channels(const Args& a, int p, F&& visit) {
  const int me = (int)a.me, lane = threadIdx.x & 31;
  const int slots = (int)gridDim.x * (int)(blockDim.x >> 5);
  constexpr int PEERS = R > 1 ? R - 1 : 1;
  const int chans_l = sender_channels(a, p, lane);  // lane s: source s's channels
  const int Q = (R - 1) * __reduce_max_sync(~0u, lane == me ? 0 : chans_l);
  for (int j = slots - 1 - slot_of((int)blockIdx.x, (int)gridDim.x, threadIdx.x >> 5); j < Q;
       j = take(&state(a)->recv_next, slots, lane)) {
    const int c = j / PEERS, s = j % PEERS < me ? j % PEERS : j % PEERS + 1;
    if (c < __shfl_sync(~0u, chans_l, s)) visit(s, c);
  }
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

}  // namespace
