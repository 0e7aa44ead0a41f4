// epcc_direct_config.cuh: the numbers the direct kernels of schedule 'h200x4'
// (schedules/h200x4.sched) are compiled with, decided by epcc 0.1.0 (backends/cuda/direct.py);
// do not edit, regenerate with `epcc compile schedules/h200x4.sched --target cuda`.
// h200x4_direct.cu includes it first, then the static headers epcc/direct/*.cuh.
//
// The plan's steps, and the part of the kernels that lowers each:
//   META_STEP          dispatch step 'meta' (schedules/h200x4.sched:49)
//                        -> meta.cuh: meta_count_kernel, meta_finish_kernel (or tok_dispatch_kernel's block 0), meta_publish
//   PUSH_STEP          dispatch step 'push' (schedules/h200x4.sched:50)
//                        -> token.cuh: tok_dispatch_kernel's senders (tok_channel): each token once per destination GPU
//   KEEP_STEP          dispatch step 'keep' (schedules/h200x4.sched:52)
//                        -> token.cuh: tok_channel's row on the sender's own rank
//   COMBINE_PUSH_STEP  combine step 'push' (schedules/h200x4.sched:50)
//                        -> token.cuh: tok_combine_kernel's expert side (tok_partials): rows to their home's staging
//   COMBINE_KEEP_STEP  combine step 'keep' (schedules/h200x4.sched:52)
//                        -> token.cuh: tok_combine_kernel's home side (tok_sums): unweighted sums
#pragma once
#define EPCC_DIRECT_CONFIG 1
#define EPCC_DIRECT_TOKEN_MAJOR 1  // DeepEP's token-major output: host.cuh runs the kernels of epcc/direct/token.cuh

namespace {

constexpr int ABI = 2;                          // the host API's version (the manifest's direct.abi)
constexpr int R = 4;                            // ranks (GPUs), one IPC domain
constexpr int E = 256;                          // experts
constexpr int EPR = 64;                         // experts per rank
constexpr int K = 8;                            // top-k
constexpr int KL = 8;                           // most rows one token can have on one rank: min(K, EPR)
constexpr int H = 7168;                         // hidden size
constexpr int TMAX = 4096;                      // tokens per rank (capacity)
constexpr int ALIGN_MAX = 128;                  // largest expert alignment a dispatch may ask for
constexpr int CMAX = 1024;                      // most sender channels
constexpr int RI = 12;                          // ints per record: token, n, rows[KL], padding
constexpr int XB = 7168;                        // payload bytes per row (fp8)
constexpr int SB = 224;                         // fp32 scale bytes per row (fp8: one per 128 channels)
constexpr int PUB = 4;                          // a sender warp publishes its tails every PUB tokens
constexpr int DTHREADS = 512;                   // threads per dispatch block, at most
constexpr int CTHREADS = 512;                   // threads per combine block
constexpr int MTHREADS = 256;                   // metadata block: one token per thread
constexpr int MC = 256;                         // tokens per metadata chunk: 32 per warp
constexpr int META_SHARED = 49152;              // a metadata block's static shared memory (meta_shared_bytes)
constexpr int CB = 4;                           // records a warp reduces between two releases of its queue's progress
constexpr int RING = 24;                        // 16-byte vectors per lane in a combine warp's shared-memory ring
constexpr int MAX_SMEM = 232448;                // dynamic shared memory one block may have
constexpr int TL_BLOCKS = 256;                  // blocks per kernel that stamp the role timeline
constexpr int TL_WORDS = 17;                    // a block's start, then the end of each of (at most) 16 warps
constexpr int SENDER_INTS = 2;                  // ints a sender publishes beside its counts: channels, expert alignment
constexpr bool BLOCKED = true;                  // expert placement: blocked
constexpr bool FP8 = true;                      // dispatch dtype: fp8
constexpr int EXPERT_STAGES[KL] = {24, 12, 8, 6, 4, 4, 3, 3}; // ring slots S(n) of a reduction of n = 1..KL rows (expert side)
constexpr int HOME_STAGES[R] = {24, 12, 8, 6};  // ring slots S(n) of a reduction of n = 1..R rows (home side)

// Peer region layout (byte offsets; identical on every rank)
constexpr unsigned long long OFF_STATE      = 0ULL;
constexpr unsigned long long OFF_META       = 4096ULL;
constexpr unsigned long long OFF_DTAIL      = 86016ULL;
constexpr unsigned long long OFF_CTAIL      = 118784ULL;
constexpr unsigned long long OFF_RANK_TJ    = 151552ULL;
constexpr unsigned long long OFF_DEDUP      = 282624ULL;
constexpr unsigned long long OFF_MYCHAN     = 348160ULL;
constexpr unsigned long long OFF_CHUNKS     = 368640ULL;
constexpr unsigned long long OFF_RECORDS    = 389120ULL;
constexpr unsigned long long OFF_RECV_W     = 389120ULL;
constexpr unsigned long long OFF_RECV_IDX   = 913408ULL;
constexpr unsigned long long OFF_ROW_TOKEN  = 1961984ULL;
constexpr unsigned long long OFF_RECV_X     = 2027520ULL;
constexpr unsigned long long OFF_RECV_S     = 119468032ULL;
constexpr unsigned long long OFF_CSTAGE     = 123138048ULL;
constexpr unsigned long long META_STRIDE    = 40960ULL;
constexpr unsigned long long META_FLAGS     = 0ULL;
constexpr unsigned long long META_COUNTS    = 256ULL;
constexpr unsigned long long META_CHANNELS  = 4352ULL;
constexpr unsigned long long META_SENDERS   = 37120ULL;
constexpr unsigned long long OFF_END        = 358019072ULL;

// The bounded waits (ErrorRecord::where; the manifest's `waits` in this order), each with the
// step whose data it waits for
enum Where : int {
  WHERE_META = 1,            // dispatch: metadata flag of rank a
                             //   dispatch step 'meta' (schedules/h200x4.sched:49)
  WHERE_RECV_TAIL = 2,       // dispatch receiver: records of rank a, channel b
                             //   dispatch step 'push' (schedules/h200x4.sched:50)
  WHERE_COMBINE_TAIL = 3,    // combine: partials from rank a, channel b
                             //   combine step 'push' (schedules/h200x4.sched:50)
};

}  // namespace
