// epcc/table/meta.cuh: the metadata kernels of the table-driven kernels -- a rank's placed table
// blobs (backends/cuda/placement.py) from the gathered routing and the plan's static
// metadata program (backends/cuda/meta_program.py encodes it; its docstring says
// what each record means).  The same arithmetic in NumPy: runtime/testing/device_tables.py.
//
// Four phases, in order, after the blobs' static fields (their template up to the row arrays)
// are in place and the scratch's regions before kZeroed are zero; each phase is a number of
// blocks of kBlock threads (phase_blocks) that depend on the phases before only:
//   count  (home rank x token block): once its tokens' slot words carry this exchange's tag (no
//          flag: a block waits for its own tokens only), each token's sets, per block the tokens
//          of each set (and the expert rows of each OUT set) and of each expert, added into each set's and each
//          (home rank, expert)'s totals; for rows, each token's record (its sets, its experts and
//          its place among each one's tokens of the block) and the sets' block masks;
//   scan   kOffsetBlocks blocks of what needs the totals only -- output rows per expert (and
//          this rank's received rows per expert), set offsets in their buffers and the zero
//          list's bytes, each part's first token and row in its copy, each copy's tokens, rows
//          and chunks and the descriptors' counts (RoleDesc, CopyDesc, DrainDesc) -- beside
//          blocks of kSeries sums over the token blocks each (each set's tokens and rows, each
//          home rank's rows of each expert; kLanes threads a sum): what comes before each block;
//   rows   (part x token block over the parts of this rank's copies, then home rank x token
//          block): each row's source handle, destination slot and weight, each chunk's first
//          row, each chunk's waits (a running maximum per producer); then the received rows'
//          weights and experts; from count's records and masks, not the routing (no shared
//          memory, no barrier);
//   items  (copy): each chunk's item at its place in the role's item order, its waits compacted
//          in flag order.
// The CUDA target runs them as one cooperative kernel, a grid-wide barrier after count and after
// scan (a rows item reads count's records once every count block stored them, then waits for the
// scan: rows_run_kind), each items block waiting for its own copy's rows work items (T_work_items,
// Scratch rows_done), each block looping over its share of a phase's blocks (epcc_table_meta.cu meta_fused); where
// there is no cooperative launch (the SUPA target) they are four launches (meta_count,
// meta_scan, meta_rows, meta_items), one block per phase block.
// What bounds them (2 x H100 and 2 x H200, 2026-11-26/27, bench/meta_time.py --profile): latency,
// not bytes -- launches, and chains of dependent loads.  Hence a block reads its home's set
// records into shared memory once, the scratch layout is computed once on the host (Args.lay),
// the prefix sums load a run of counts before they add them, the totals come from count's atomics
// (so the scan's offsets need no pass over the token blocks), and rows reads one record per
// token where it recomputed the token's sets.  Each warp runs a chain of dependent instructions with
// few warps per SM to hide it (ncu, 2 x H100, 2026-11-27): no division on it (an expert's rank by
// Div16, token counts in 32 bits), the program's header read once per thread, and a warp's bits of a
// block mask stored as its ballot, not OR-ed into one shared word lane after lane.
//
// Written once for both sides: compiled as device code (nvcc, or brcc for SUPA, after the
// target's device prelude epcc/prelude/*, whose names it uses) these are kernels (a block's
// threads run each step together, __syncthreads between steps); compiled as C++ for the host
// (EPCC_META_HOST) each block runs its steps one thread after the other, which is how the CPU
// tests run the very same code (tests/backends/test_meta_kernels.py), blocks in any order
// within a phase.
#pragma once
#include <stdint.h>
#include <string.h>

namespace epcc {
namespace meta {

typedef long long i64;

#if !defined(EPCC_META_HOST) && !defined(EPCC_TID)
#error "include the target's device prelude (epcc/prelude/cuda.cuh or supa.suh) before epcc/table/meta.cuh, or define EPCC_META_HOST"
#endif

#if !defined(EPCC_META_HOST)
#define EM_FN __device__ __forceinline__
#define EM_HD __host__ __device__ inline
#define EM_METHOD __host__ __device__ __forceinline__
#define EM_KERNEL __global__ void __launch_bounds__(kBlock)
// a kernel's Args: read where they are, in constant memory, where the target has it (a copy, by
// value, would be a local array: prog_of takes the header's address)
#define EM_ARGS const EPCC_GRID_CONSTANT Args
#define EM_SHARED __shared__
#define EM_THREADS(t) { const int t = static_cast<int>(EPCC_TID);
#define EM_SYNC } __syncthreads();
#define EM_DONE }
#define EM_BLOCK static_cast<int>(EPCC_BID)
#define EM_OR(p, v) atomicOr((p), (v))
#define EM_MAX(p, v) atomicMax((p), (v))
#define EM_MIN(p, v) atomicMin((p), (v))
#define EM_ADD(p, v) atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v))
#define EM_UNROLL _Pragma("unroll")
// a loop kept rolled: code one block runs once per dispatch, whose instructions are fetched cold
#define EM_ROLLED _Pragma("unroll 1")
#if defined(EPCC_HAS_BALLOT)
// Thread t's predicate as bit t % 32 of `word` (zero before), every thread of the block voting: the
// word is its warp's alone, so lane 0 stores the warp's ballot -- where the threads' atomicOr into one
// shared word ran one lane after the other.
#define EM_VOTE(word, t, pred) \
  do { \
    const unsigned em_v = epcc::ballot(pred); \
    if ((t) % 32 == 0) *(word) = em_v; \
  } while (0)
#else
#define EM_VOTE(word, t, pred) \
  do { \
    if (pred) atomicOr((word), 1u << ((t) % 32)); \
  } while (0)
#endif
EM_FN int em_popc(unsigned v) { return epcc::popc(v); }
// a routing slot word as a peer's store leaves it (a strong load: it does not stop at a stale L1 line)
EM_FN unsigned long long em_poll(const unsigned long long* at) {
  return epcc::ld_relaxed_sys(reinterpret_cast<const uint64_t*>(at));
}
EM_FN unsigned long long em_now() { return epcc::globaltimer(); }
#else
#define EM_FN static inline
#define EM_HD static inline
#define EM_METHOD inline
#define EM_KERNEL static inline void
#define EM_SHARED static
#define EM_THREADS(t) for (int t = 0; t < kBlock; ++t) {
#define EM_SYNC }
#define EM_DONE }
#define EM_BLOCK em_block
#define EM_OR(p, v) (*(p) |= (v))
#define EM_MAX(p, v) (*(p) = *(p) > (v) ? *(p) : (v))
#define EM_MIN(p, v) (*(p) = *(p) < (v) ? *(p) : (v))
#define EM_ADD(p, v) (*(p) += (v))
#define EM_UNROLL
#define EM_ROLLED
#define EM_VOTE(word, t, pred) \
  do { \
    if (pred) *(word) |= 1u << ((t) % 32); \
  } while (0)
EM_FN int em_popc(unsigned v) { return __builtin_popcount(v); }
EM_FN unsigned long long em_poll(const unsigned long long* at) { return *at; }
EM_FN unsigned long long em_now() { return 0; }
#endif

// What the blocks' shared memory is sized for: per bundle, defined by the generated driver before
// it includes this header (meta_program.py Capacity: the plan's most token sets of one home rank
// in 64-bit words, its most OUT sets of one home rank, its experts and top-k); a build that does
// not say gets one set word, 64 OUT sets, 1024 experts and top-16 (42.5 KB).
#ifndef EPCC_META_SET_WORDS
#define EPCC_META_SET_WORDS 1
#endif
#ifndef EPCC_META_OUT_SETS
#define EPCC_META_OUT_SETS 64
#endif
#ifndef EPCC_META_EXPERTS
#define EPCC_META_EXPERTS 1024
#endif
#ifndef EPCC_META_TOPK
#define EPCC_META_TOPK 16
#endif

constexpr int kBlock = 128;               // threads of a block, tokens of a token block (meta_program.py TOKEN_BLOCK)
constexpr int kLanes = 32;                // threads of one sum over the token blocks (a warp)
constexpr int kSeries = kBlock / kLanes;  // sums over the token blocks one scan block does (meta_program.py SCAN_SERIES)
constexpr int kOffsetBlocks = 3;          // the scan's blocks of what needs the totals only (offsets_block)
constexpr int kRun = 8;                   // counts a thread loads before it adds them
constexpr int kLayout = 21;               // regions of the scratch (scratch_words)
constexpr int kZeroed = 6;                // the regions before this one start at zero; the rest are written whole
constexpr int kWords = kBlock / 32;       // 32-bit words of a per-block token mask
constexpr int kSetWords = EPCC_META_SET_WORDS;  // 64-bit words of a token's set memberships
constexpr int kMaxSets = 64 * kSetWords;  // sets per home rank (meta_program.py SET_WORD x set_words)
constexpr int kMaxOutSets = EPCC_META_OUT_SETS;  // OUT sets per home rank
constexpr int kMaxTopk = EPCC_META_TOPK;
constexpr int kMaxExperts = EPCC_META_EXPERTS;
constexpr int kMaxRanks = 64;             // ranks of a plan the kernels cover (the exchange's too)
constexpr i64 kMagic = 0x4D455043;
constexpr i64 kVersion = 4;

// Field indices of the program's records: meta_program.py's lists, in order
// (tests/backends/test_meta_kernels.py checks they agree).
enum Header {
  H_magic, H_version, H_num_ranks, H_experts, H_topk, H_epr, H_strided, H_max_tokens, H_token_blocks, H_hidden,
  H_row_bytes, H_rank, H_num_sets, H_num_groups, H_num_copies, H_num_parts, H_num_contrib, H_num_tcopies,
  H_num_roles, H_num_drain, H_num_zero, H_num_work, H_num_prods, H_num_ramp, H_off_sets,
  H_off_groups, H_off_group_sets, H_off_copies, H_off_parts, H_off_contrib, H_off_tcopies,
  H_off_roles, H_off_drain, H_off_zero, H_off_work, H_off_prods, H_off_ramp, H_blob_bytes_d, H_blob_bytes_c,
  H_num_group_sets, H_sets_max, H_items_off_d, H_waits_off_d, H_items_off_c, H_waits_off_c,
  H_off_set_info, H_set_info_words, H_COUNT
};
enum Set { S_origin, S_kind, S_parent, S_mask, S_all, S_dst, S_group, S_bit, S_out, S_COUNT };
// a set_info record, per (home rank, bit); then H_set_info_words words of the bits its sets unite
enum SetInfoField { SI_set, SI_kind, SI_parent_bit, SI_all, SI_mask, SI_dst, SI_out, SI_COUNT };
enum Group { G_first, G_count, G_COUNT };
enum Copy {
  C_program, C_tpc, C_head, C_tail, C_first_part, C_num_parts, C_dst, C_ramp_front, C_ramp_front_n, C_ramp_back,
  C_ramp_back_n, C_ramp_front_sum, C_ramp_back_sum, C_COUNT
};
enum Part {
  P_copy, P_origin, P_kind, P_tok_set, P_src_set, P_dst_set, P_out_rank, P_srcbuf, P_producer, P_prod_part,
  P_prod_slot, P_contrib_begin, P_contrib_count, P_index, P_tcopy, P_COUNT
};
enum Contrib { K_copy, K_part, K_slot, K_COUNT };
enum TCopy {
  T_program, T_copy, T_role, T_side, T_weighted, T_src_rows, T_dst_rows, T_weights, T_rows_cap, T_chunks_cap,
  T_prod_begin, T_prod_count, T_desc_off, T_dst_buf, T_flag_id, T_flag_rank, T_step_index, T_flow_index,
  T_src_rank, T_dst_rank, T_role_rec, T_desc_index, T_scratch_waits, T_scratch_starts, T_work_items, T_COUNT
};
enum Role {
  R_program, R_item_begin, R_item_cap, R_wait_begin, R_wait_stride, R_first_tcopy, R_num_tcopies, R_desc_off,
  R_step_crc, R_COUNT
};
enum Drain { D_program, D_copy, D_desc_off, D_COUNT };
enum Zero { Z_buf, Z_group_first, Z_group_count, Z_result, Z_desc_off, Z_COUNT };
enum Work { W_part, W_block, W_COUNT };
enum SetKind { SET_SEG = 0, SET_OUT = 1, SET_LIVE = 2 };
enum PartKind { PART_D_STAGE = 0, PART_D_OUT = 1, PART_C_STAGE = 2, PART_C_OUT = 3 };
enum Side { SIDE_SM = 0, SIDE_PACK = 1, SIDE_UNPACK = 2 };

// ---------------------------------------------------------------------------------- slot words
// The routing as the exchange carries it: one 64-bit word per (rank, token, top-k slot), written by
// one store, so a reader that sees the word sees all of it -- the slot's code in the low 16 bits
// (its expert, or kSlotNone, kSlotAbsent: the rank has fewer tokens, kSlotBad: an expert the
// kernels cannot hold), the exchange's tag in the next 16, the weight's bits in the high 32.  A
// rank's words reach the peers' gather areas with no flag after them and no fence: count polls
// each token's words until they carry this exchange's tag (tag_of: its high bit set, so never the
// zeroed area's 0; no division).  A tag comes back after 32768 exchanges, and every exchange
// rewrites every word of its slot.
constexpr unsigned kSlotNone = 0xffffu, kSlotAbsent = 0xfffeu, kSlotBad = 0xfffdu;
constexpr long long kSlotExperts = 0x7ff0;  // experts a code holds (as a 16-bit signed value: >= 0)
EM_HD unsigned tag_of(unsigned long long epoch) { return 0x8000u | (static_cast<unsigned>(epoch) & 0x7fffu); }
EM_HD unsigned long long slot_word(long long e, float w, bool present, unsigned tag) {
  const unsigned code = !present ? kSlotAbsent
                        : e == -1 ? kSlotNone
                        : e >= 0 && e < kSlotExperts ? static_cast<unsigned>(e)
                                                     : kSlotBad;
  unsigned bits;
  memcpy(&bits, &w, 4);
  return static_cast<unsigned long long>(present ? bits : 0u) << 32 | static_cast<unsigned long long>(tag) << 16 |
         code;
}
// The slot's expert: >= 0, or -1 none, -2 absent (no token), -3 bad.
EM_HD int slot_expert(unsigned long long v) { return static_cast<int>(static_cast<short>(v & 0xffffu)); }
EM_HD unsigned slot_tag(unsigned long long v) { return static_cast<unsigned>(v >> 16) & 0xffffu; }
EM_HD float slot_weight(unsigned long long v) {
  const unsigned bits = static_cast<unsigned>(v >> 32);
  float w;
  memcpy(&w, &bits, 4);
  return w;
}

// Byte offsets of the descriptor fields the kernels write (backends/cuda/abi.py STRUCTS).
constexpr int kRoleItemCount = 4, kCopyNRows = 24, kDrainValue = 8, kZeroBytes = 8;
constexpr int kHeaderTokens = 60;
constexpr int kItemBytes = 24, kWaitBytes = 16;
constexpr i64 kRowBufShift = 40;

struct Args {
  const i64* prog;       // the metadata program (int64)
  i64* scratch;          // scratch_words(prog) words, its regions before kZeroed zero before count
  // every rank's routing, gathered: the kernels read it from here only, whatever moved it here and
  // however many peer-memory domains the ranks span (the driver's exchange fills it)
  const int* tokens;     // [R] tokens of every rank (this rank's is read)
  // [R][max_tokens][topk] every rank's routing, a slot word each (slot_word: expert, weight and the
  // exchange's tag): count waits until each of its tokens' words carries this exchange's tag
  const unsigned long long* routing;
  unsigned long long* epoch;  // exchanges so far (the tag: tag_of(*epoch + 1)); the rows phase adds this one
  int* error;                 // {1, rank}: the routing of `rank` never came (the wait's timeout)
  unsigned long long timeout_ns;
  uint8_t* blob[2];      // the placed blobs (dispatch, combine), holding their template
  int* bad;              // the first bad token of this rank's routing (INT_MAX: none), lowered by count
  // what recv_block (and expert_offsets) write for this rank's received rows (expert-major): the
  // routing weight and the global expert of each row, the rows per local expert and where each
  // expert's rows start
  float* recv_w;
  int64_t* recv_idx;
  int* recv_count;       // [experts per rank]
  int* recv_offset;      // [experts per rank + 1]
  // GPU proxy path (nullptr without): per program, each item's sequence number on its channel
  // (the chunks of one role between the same two ranks, in item order), what the pack and unpack
  // roles read as KernelArgs.rdma_seq; [the blob's num_items], written for RDMA items only
  uint32_t* seq[2];
  i64 lay[kLayout];      // where each scratch region starts (scratch_words(prog, lay), on the host)
  // the program's header (its first H_COUNT words), here too: the kernels' arguments are constant
  // memory, which a store to global memory cannot alias, so a loop that stores keeps what it read
  // of the header in registers instead of loading it again from the program every iteration
  i64 head[H_COUNT];
};

// The program as the kernels read it: its header from the arguments (Args::head; on the host, or
// from a bare program, the program's own first words), its records from the program.  p[H_x] is a
// header field, p + offset a record's address.
struct Prog {
  const i64* at;    // the program
  const i64* head;  // its header
  EM_METHOD i64 operator[](int field) const { return head[field]; }
  EM_METHOD const i64* operator+(i64 offset) const { return at + offset; }
};
EM_HD Prog prog_of(const i64* program) { return Prog{program, program}; }
EM_HD Prog prog_of(const Args& a) { return Prog{a.prog, a.head}; }

EM_HD const i64* rec(Prog p, int off_field, i64 index, int width) { return p + p[off_field] + index * width; }
EM_FN const i64* set_rec(Prog p, i64 i) { return rec(p, H_off_sets, i, S_COUNT); }
EM_FN const i64* part_rec(Prog p, i64 i) { return rec(p, H_off_parts, i, P_COUNT); }
EM_FN const i64* copy_rec(Prog p, i64 i) { return rec(p, H_off_copies, i, C_COUNT); }
EM_HD const i64* tcopy_rec(Prog p, i64 i) { return rec(p, H_off_tcopies, i, T_COUNT); }

// Scratch (int64 words), in the regions scratch_words lays out: first those that start at zero
// (count adds into the totals, rows raises the waits and counts its work items done), then those
// a dispatch writes whole.
struct Scratch {
  i64 *set_total, *set_rtotal;  // [S]: each set's tokens and (OUT sets) rows, added up by count
  i64* set_off;                 // [S]: where a SEG set's slots start in its buffer
  i64* home_before;             // [R][E]: rows of expert e of home h (count); then of the lower home ranks
  i64* per_tcopy;               // the per-copy regions meta_program.py laid out (waits, chunk starts)
  i64* rows_done;               // [num_tcopies]: the copy's rows work items done (meta_fused: its items wait);
                                // then count's blocks whose masks and records are stored (its rows wait)
  i64 *set_cnt, *set_rcnt, *set_base, *set_rbase;  // [S][TB]: per token block; exclusive over the blocks
  i64 *ecnt, *ebase;            // [R][TB][E] per block, exclusive over blocks
  i64* e_first;                 // [E]: expert e's first output row on its rank
  i64 *part_tok_base, *part_row_base;
  i64 *copy_tok, *copy_rows, *copy_chunks;
  // what count leaves rows (tok_words, below): [R][TB * kBlock] each token's record;
  // [S][TB] each set's block mask, [S][TB][K] each OUT set's row masks (2 words a mask)
  i64 *tok_rec, *set_mask, *row_mask;
};

// A token's record: its set bits (kSetWords words, this build's), then its top-k slots two to a
// word, each its expert in the low 16 bits (0xffff: none) and its place among the block's tokens of
// that expert in the high 16.  The rows phase reads it instead of recomputing the token's sets.
EM_HD i64 tok_words(Prog p) { return kSetWords + (p[H_topk] + 1) / 2; }

EM_HD i64 scratch_words(Prog p, i64* layout_out = nullptr) {
  const i64 S = p[H_num_sets], TB = p[H_token_blocks], R = p[H_num_ranks], E = p[H_experts];
  const i64 parts = p[H_num_parts], copies = p[H_num_copies];
  i64 tc = 0;  // the per-copy regions
  for (i64 i = 0; i < p[H_num_tcopies]; ++i) {
    const i64* t = tcopy_rec(p, i);
    const i64 prods = t[T_prod_count] > 0 ? t[T_prod_count] : 1;
    const i64 end = t[T_scratch_waits] + t[T_chunks_cap] * prods + t[T_chunks_cap] + 1;
    if (end > tc) tc = end;
  }
  const i64 sizes[kLayout] = {S, S, S, R * E, tc, p[H_num_tcopies] + 1,  // zeroed (kZeroed)
                              S * TB, S * TB, S * TB, S * TB, R * TB * E, R * TB * E, E, parts, parts,
                              copies, copies, copies, R * TB * kBlock * tok_words(p), S * TB * 2,
                              S * TB * p[H_topk] * 2};
  i64 total = 0;
  for (int i = 0; i < kLayout; ++i) {
    if (layout_out) layout_out[i] = total;
    total += sizes[i];
  }
  return total;
}

// Whether the blocks' shared memory holds the program's sets, OUT sets, experts and top-k (the
// bundle's capacity, EPCC_META_*): the host checks it before the first launch.
EM_HD bool fits(Prog p) {
  if (p[H_magic] != kMagic || p[H_version] != kVersion) return false;
  if (p[H_sets_max] > kMaxSets || p[H_experts] > kMaxExperts || p[H_topk] > kMaxTopk) return false;
  for (i64 i = 0; i < p[H_num_sets]; ++i)
    if (rec(p, H_off_sets, i, S_COUNT)[S_out] >= kMaxOutSets) return false;
  return true;
}

EM_FN Scratch scratch_of(const Args& a) {
  const i64* at = a.lay;
  i64* s = a.scratch;
  Scratch x;
  x.set_total = s + at[0]; x.set_rtotal = s + at[1]; x.set_off = s + at[2]; x.home_before = s + at[3];
  x.per_tcopy = s + at[4]; x.rows_done = s + at[5];
  x.set_cnt = s + at[6]; x.set_rcnt = s + at[7]; x.set_base = s + at[8]; x.set_rbase = s + at[9];
  x.ecnt = s + at[10]; x.ebase = s + at[11]; x.e_first = s + at[12];
  x.part_tok_base = s + at[13]; x.part_row_base = s + at[14];
  x.copy_tok = s + at[15]; x.copy_rows = s + at[16]; x.copy_chunks = s + at[17];
  x.tok_rec = s + at[18]; x.set_mask = s + at[19]; x.row_mask = s + at[20];
  return x;
}

// ---------------------------------------------------------------------------------- chunks
// plan.chunk_sizes: the ramp ends (sizes in the program), whole chunks of tpc, the remainder
// before the tail ramp; ramps only where the copy holds both ends and one whole chunk.
struct Chunking {
  i64 n, tpc, front_n, back_n, front_sum, back_sum, whole, rest;
  const i64* front;
  const i64* back;
  bool ramps;
};

// a / b and a % b for 0 <= a < 2^32 and 0 < b < 2^32 (token counts): 32-bit, a 64-bit division is
// a call of ~70 instructions on the GPU
EM_HD i64 quot32(i64 a, i64 b) { return static_cast<i64>(static_cast<unsigned>(a) / static_cast<unsigned>(b)); }
EM_HD i64 rem32(i64 a, i64 b) { return static_cast<i64>(static_cast<unsigned>(a) % static_cast<unsigned>(b)); }
// a / b for 0 <= a and 0 < b < 2^32, 32-bit where a is too
EM_HD i64 quot(i64 a, i64 b) { return static_cast<unsigned long long>(a) >> 32 ? a / b : quot32(a, b); }

// A copy's chunking as far as the program says (its chunk size and ramps), before its tokens are known.
struct ChunkSpec {
  i64 tpc, front_n, back_n, front_sum, back_sum;
  const i64* front;
  const i64* back;
};
EM_FN ChunkSpec chunk_spec(Prog p, i64 copy) {
  const i64* c = copy_rec(p, copy);
  ChunkSpec s;
  s.tpc = c[C_tpc];
  s.front = p + p[H_off_ramp] + c[C_ramp_front];
  s.back = p + p[H_off_ramp] + c[C_ramp_back];
  s.front_n = c[C_ramp_front_n];
  s.back_n = c[C_ramp_back_n];
  s.front_sum = c[C_ramp_front_sum];
  s.back_sum = c[C_ramp_back_sum];
  return s;
}

// ... and with its n tokens: no load.
EM_FN Chunking chunking(const ChunkSpec& s, i64 n) {
  Chunking k;
  k.n = n;
  k.tpc = s.tpc;
  k.front = s.front;
  k.back = s.back;
  k.ramps = k.tpc > 0 && s.front_sum + s.back_sum + k.tpc <= n;
  k.front_n = k.ramps ? s.front_n : 0;
  k.back_n = k.ramps ? s.back_n : 0;
  k.front_sum = k.ramps ? s.front_sum : 0;
  k.back_sum = k.ramps ? s.back_sum : 0;
  const i64 middle = n - k.front_sum - k.back_sum;
  k.whole = k.tpc > 0 ? quot32(middle, k.tpc) : 0;
  k.rest = k.tpc > 0 ? rem32(middle, k.tpc) : 0;
  return k;
}
EM_FN Chunking chunking(Prog p, i64 copy, i64 n) { return chunking(chunk_spec(p, copy), n); }

EM_FN i64 num_chunks(const Chunking& k) {
  if (k.n <= 0) return 0;
  if (k.tpc <= 0) return 1;
  return k.front_n + k.whole + (k.rest ? 1 : 0) + k.back_n;
}

// The sum of n counts at src[0], src[stride], ..., loaded kRun at a time.
EM_FN i64 run_sum(const i64* src, i64 n, i64 stride) {
  i64 sum = 0;
  for (i64 b0 = 0; b0 < n; b0 += kRun) {
    i64 v[kRun];
    for (int j = 0; j < kRun; ++j) v[j] = b0 + j < n ? src[(b0 + j) * stride] : 0;
    for (int j = 0; j < kRun; ++j) sum += v[j];
  }
  return sum;
}

// The sum of the n counts at src[idx[0]], src[idx[1]], ...: the indices, then the counts, kRun at a time.
EM_FN i64 run_gather(const i64* idx, const i64* src, i64 n) {
  i64 sum = 0;
  for (i64 b0 = 0; b0 < n; b0 += kRun) {
    i64 at[kRun];
    for (int j = 0; j < kRun; ++j) at[j] = b0 + j < n ? idx[b0 + j] : -1;
    for (int j = 0; j < kRun; ++j) sum += at[j] >= 0 ? src[at[j]] : 0;
  }
  return sum;
}

// A ramp's sizes are loaded kRun at a time before they are used (run_sum, ramp_find: one memory
// latency per run, not per size: a copy's tail ramp has up to 14).

// The first i < n whose ramp chunk holds token `tok`, the ramp starting at token t (-1: none).
EM_FN i64 ramp_find(const i64* r, i64 n, i64 t, i64 tok) {
  for (i64 i0 = 0; i0 < n; i0 += kRun) {
    i64 v[kRun];
    EM_UNROLL
    for (int j = 0; j < kRun; ++j) v[j] = i0 + j < n ? r[i0 + j] : 0;
    i64 found = -1;
    EM_UNROLL
    for (int j = 0; j < kRun; ++j) {
      t += v[j];  // 0 past n
      if (found < 0 && i0 + j < n && tok < t) found = i0 + j;
    }
    if (found >= 0) return found;
  }
  return -1;
}

// The first token of chunk c (c == num_chunks: n).
EM_FN i64 chunk_start(const Chunking& k, i64 c) {
  if (k.tpc <= 0) return c <= 0 ? 0 : k.n;
  i64 t = 0;
  if (c < k.front_n) return run_sum(k.front, c, 1);
  t = k.front_sum;
  c -= k.front_n;
  const i64 mid = k.whole + (k.rest ? 1 : 0);
  if (c <= k.whole) return t + c * k.tpc;
  if (c < mid || (c == mid && k.rest)) return t + k.whole * k.tpc + (c > k.whole ? k.rest : 0);
  t += k.whole * k.tpc + k.rest;
  c -= mid;
  return t + run_sum(k.back, c < k.back_n ? c : k.back_n, 1);
}

// The chunk holding token `tok` (0 <= tok < n).
EM_FN i64 chunk_of(const Chunking& k, i64 tok) {
  if (k.tpc <= 0) return 0;
  if (tok < k.front_sum) {
    const i64 i = ramp_find(k.front, k.front_n, 0, tok);
    if (i >= 0) return i;
  }
  const i64 mid_end = k.front_sum + k.whole * k.tpc + k.rest;
  if (tok < mid_end) return k.front_n + quot32(tok - k.front_sum, k.tpc);
  const i64 first_back = k.front_n + k.whole + (k.rest ? 1 : 0);
  const i64 i = ramp_find(k.back, k.back_n, mid_end, tok);
  return first_back + (i >= 0 ? i : k.back_n - 1);
}

// ---------------------------------------------------------------------------------- tokens
// Sets of one home rank by their `bit`: kSetWords words of 64 bits.
struct SetBits {
  unsigned long long w[kSetWords];
};
EM_FN void set_clear(SetBits& s) {
  for (int i = 0; i < kSetWords; ++i) s.w[i] = 0ull;
}
EM_FN bool set_has(const SetBits& s, int b) {  // each word at a constant index: bits in registers stay there
  unsigned long long w = 0;
  EM_UNROLL
  for (int i = 0; i < kSetWords; ++i) w |= i == (b >> 6) ? s.w[i] : 0ull;
  return ((w >> (b & 63)) & 1ull) != 0;
}
EM_FN void set_add(SetBits& s, int b) { s.w[b >> 6] |= 1ull << (b & 63); }
EM_FN bool sets_meet(const SetBits& a, const SetBits& b) {
  unsigned long long any = 0;
  for (int i = 0; i < kSetWords; ++i) any |= a.w[i] & b.w[i];
  return any != 0;
}

// A set of the block's home rank as the token loop needs it (its record, read once per block).
struct SetInfo {
  unsigned long long mask;     // SEG: the destination ranks it selects
  SetBits or_bits;             // LIVE: the bits of the sets it unites
  int kind;                    // SetKind; -1: past the home's last set
  int parent_bit;              // SEG, OUT: the bit of its parent set (-1: none)
  int all;                     // SEG: selects every token of its parent
  int dst;                     // OUT: its destination rank
  int out;                     // OUT: its place among the home's OUT sets (its row masks)
  int si;                      // its index among the program's sets (-1: past the home's last set)
};

// One block's tokens of one home rank: which sets each is in and, per set, expert and row masks
// (meta_program.py shared_bytes: its size).
struct Shared {
  SetInfo sets[kMaxSets];
  SetBits bits[kBlock];                   // per token: its sets (bit = the set's `bit`)
  unsigned set_words[kMaxSets][kWords];   // per set: its tokens in this block
  unsigned exp_words[kMaxExperts][kWords];  // per expert: the tokens that picked it
  unsigned row_words[kMaxOutSets][kMaxTopk][kWords];  // per OUT set: tokens with at least m + 1 rows
  short experts[kBlock][kMaxTopk];        // per token and slot: the expert (-1: none, bad or repeated)
  unsigned long long dmask[kBlock];
  int bad;                                // the block's first bad token of this rank's routing (kNoBad: none)
};
constexpr int kNoBad = 0x7fffffff;        // INT_MAX: Args::bad's "none"

// n / d for n < 2^16 (an expert, a token of a block) and 1 <= d < 2^16, without a division: the
// high word of n * m, m = ceil(2^32 / d) -- exact, since n * (m d - 2^32) < 2^16 * d <= 2^32 --
// and d = 1 (m = 0) n itself.  The kernels are latency-bound: a division is a call of ~20 dependent
// instructions, this one multiply (tests/backends/test_meta_kernels.py checks every n for every d up
// to 4096, and the larger d at their multiples).
struct Div16 {
  unsigned d, m;
};
EM_HD Div16 div16(unsigned d) {
  Div16 v;
  v.d = d;
  v.m = d > 1 ? 0xffffffffu / d + 1u : 0u;  // ceil(2^32 / d), in 32 bits
  return v;
}
EM_HD unsigned quot16(const Div16& v, unsigned n) {
  return v.m ? static_cast<unsigned>((static_cast<unsigned long long>(n) * v.m) >> 32) : n;
}
EM_HD unsigned rem16(const Div16& v, unsigned n) { return n - quot16(v, n) * v.d; }

// The ranks' experts (contiguous: rank e / epr holds e as local e % epr; strided: rank e % R as
// local e / R; on one rank either way the local order is the experts' order), read from the
// program once into registers (a lookup per slot re-read the header).
struct Experts {
  Div16 by;     // epr, or R where strided
  int strided;
  EM_METHOD int rank(int e) const {
    return static_cast<int>(strided ? rem16(by, static_cast<unsigned>(e)) : quot16(by, static_cast<unsigned>(e)));
  }
};
EM_HD Experts experts_of(Prog p) {
  Experts x;
  x.strided = static_cast<int>(p[H_strided]);
  x.by = div16(static_cast<unsigned>(x.strided ? p[H_num_ranks] : p[H_epr]));
  return x;
}
EM_FN int expert_of(Prog p, int rank, int local) {
  return p[H_strided] ? local * static_cast<int>(p[H_num_ranks]) + rank : rank * static_cast<int>(p[H_epr]) + local;
}

// The first half of filling `sh` for a token block of home rank h, which needs no routing: the
// masks zero, the home's set records read (every thread of the block; meta_fused runs it while it
// waits for the peers' routing).
EM_FN void count_prepare(const Args& a, int h, Shared& sh) {
  const Prog p = prog_of(a);
  const int E = static_cast<int>(p[H_experts]);
  const int nsets = static_cast<int>(p[H_sets_max]);
  const i64 or_words = p[H_set_info_words], width = SI_COUNT + or_words;
  const i64* info = p + p[H_off_set_info] + static_cast<i64>(h) * nsets * width;
  EM_THREADS(t)
    if (t == 0) sh.bad = kNoBad;
    for (int s = t; s < kMaxSets * kWords; s += kBlock) (&sh.set_words[0][0])[s] = 0u;
    for (int s = t; s < E * kWords; s += kBlock) (&sh.exp_words[0][0])[s] = 0u;
    for (int s = t; s < kMaxOutSets * kMaxTopk * kWords; s += kBlock) (&sh.row_words[0][0][0])[s] = 0u;
    for (int b = kBlock - 1 - t; b < kMaxSets; b += kBlock) {  // the block's last threads (meta_fused: not senders)
      // the set's record as the program lays it out for this (home, bit), every field loaded at
      // once: one memory latency (the set records, then their parents' and the united sets'
      // bits were four)
      SetInfo& in = sh.sets[b];
      const i64* r = info + b * width;
      const bool have = b < nsets;
      const i64 si = have ? r[SI_set] : -1, kind = have ? r[SI_kind] : -1, parent_bit = have ? r[SI_parent_bit] : -1;
      const i64 all = have ? r[SI_all] : 0, mask = have ? r[SI_mask] : 0;
      const i64 dst = have ? r[SI_dst] : -1, out = have ? r[SI_out] : -1;
      i64 words[kSetWords];
      for (int i = 0; i < kSetWords; ++i) words[i] = have && i < or_words ? r[SI_COUNT + i] : 0;
      in.si = static_cast<int>(si);
      in.kind = si < 0 ? -1 : static_cast<int>(kind);
      in.parent_bit = static_cast<int>(parent_bit);
      in.all = static_cast<int>(all);
      in.mask = static_cast<unsigned long long>(mask);
      in.dst = static_cast<int>(dst);
      in.out = static_cast<int>(out);
      for (int i = 0; i < kSetWords; ++i) in.or_bits.w[i] = static_cast<unsigned long long>(words[i]);
    }
  EM_SYNC
}

#if !defined(EPCC_META_HOST)
// The wait for home rank h's routing given up: the first to give up writes the error word {1, h}
// and says so; every waiter traps.  Out of line: the wait's loop keeps no room for printf.
__device__ __noinline__ void routing_timeout(const Args& a, int h, unsigned tag) {
  if (atomicCAS(a.error, 0, 1) == 0) {
    a.error[1] = h;
    __threadfence_system();
    printf("epcc: metadata exchange timed out after %.3f s: rank %d has no routing from rank %d (tag %u)\n",
           a.timeout_ns * 1e-9, static_cast<int>(a.head[H_rank]), h, tag);
  }
  epcc::trap();
}
#endif

// Thread t's token of home rank h's token block `block`: its slot words, each once it carries this
// exchange's tag (the peer's store landed; bounded: past a.timeout_ns the first to give up writes
// the error word {1, h} and says so, and every waiter traps -- on the host, where every word is in
// place before the kernels run, a word without the tag is that error at once).  `seen` (may be
// null): the time the wait ended, thread 0's.
EM_FN void await_slots(const Args& a, int h, int tok, int K, unsigned tag, unsigned long long (&v)[kMaxTopk],
                       unsigned long long* seen) {
  const Prog p = prog_of(a);
  const unsigned long long* row = a.routing + (static_cast<i64>(h) * p[H_max_tokens] + tok) * K;
  const bool have = tok < p[H_max_tokens];
#if !defined(EPCC_META_HOST)
  unsigned long long t0 = 0;
#endif
  for (bool first = true;; first = false) {
    bool all = true;
    EM_UNROLL
    for (int j = 0; j < kMaxTopk; ++j) {
      if (j < K && have && (first || slot_tag(v[j]) != tag)) v[j] = em_poll(row + j);
      all = all && (j >= K || !have || slot_tag(v[j]) == tag);
    }
    if (all) break;
#if defined(EPCC_META_HOST)
    a.error[0] = 1;
    a.error[1] = h;
    break;
#else
    if (first) t0 = em_now();
    else if (em_now() - t0 > a.timeout_ns) routing_timeout(a, h, tag);
#endif
  }
  if (seen && tok % kBlock == 0) *seen = em_now();
}

// The rest, after count_prepare for the same home: the tokens [block * kBlock, ...) of home rank h,
// each one's sets and experts into `sh` (every thread of the block), once their slot words came
// (await_slots: `tag` this exchange's, `seen` its stamp).  Marks the first bad token of this rank's
// own routing.
EM_FN void load_tokens(const Args& a, int h, int block, Shared& sh, unsigned tag, unsigned long long* seen) {
  const Prog p = prog_of(a);
  const int K = static_cast<int>(p[H_topk]), E = static_cast<int>(p[H_experts]);
  const int nsets = static_cast<int>(p[H_sets_max]);
  const Experts xp = experts_of(p);
  EM_THREADS(t)
    const int tok = block * kBlock + t;
    // the token's slot words loaded together, whatever its rank's count (the area holds max_tokens)
    unsigned long long word[kMaxTopk] = {};
    await_slots(a, h, tok, K, tag, word, seen);
    int slot[kMaxTopk];
    EM_UNROLL
    for (int j = 0; j < kMaxTopk; ++j) slot[j] = j < K && tok < p[H_max_tokens] ? slot_expert(word[j]) : -2;
    const bool present = slot[0] != -2;  // its rank has the token
    // per slot its expert (-1: none, bad or repeated) and the expert's rank, in registers: the
    // repeats and each OUT set's rows below compare these, not shared memory
    int ex[kMaxTopk], rk[kMaxTopk];
    unsigned long long d = 0;
    bool bad = false;
    EM_UNROLL
    for (int j = 0; j < kMaxTopk; ++j) {
      int e = j < K && present ? slot[j] : -1;
      if (e < -1 || e >= E) { bad = true; e = -1; }
      EM_UNROLL
      for (int i = 0; i < j; ++i)
        if (e >= 0 && ex[i] == e) { bad = true; e = -1; }
      ex[j] = e;
      rk[j] = e >= 0 ? xp.rank(e) : -1;
      sh.experts[t][j] = static_cast<short>(e);
      if (e >= 0) {
        d |= 1ull << rk[j];
        EM_OR(&sh.exp_words[e][t / 32], 1u << (t % 32));
      }
    }
    if (bad && h == static_cast<int>(p[H_rank])) EM_MIN(&sh.bad, tok);
    sh.dmask[t] = d;
    SetBits bits;
    set_clear(bits);
    for (int b = 0; b < nsets; ++b) {
      const SetInfo s = sh.sets[b];  // in registers: the stores below would have it read again per use
      if (s.kind < 0) break;
      bool in;
      if (s.kind == SET_SEG) {
        const bool base = s.parent_bit < 0 ? present : set_has(bits, s.parent_bit);
        in = base && (s.all || (d & s.mask) != 0);
      } else if (s.kind == SET_OUT) {
        in = set_has(bits, s.parent_bit) && ((d >> s.dst) & 1ull);
        int n = 0;  // its rows on the set's rank
        EM_UNROLL
        for (int j = 0; j < kMaxTopk; ++j) n += in && rk[j] == s.dst ? 1 : 0;
        for (int m = 0; m < K; ++m) EM_VOTE(&sh.row_words[s.out][m][t / 32], t, m < n);
      } else {
        in = sets_meet(bits, s.or_bits);
      }
      if (in) set_add(bits, b);
      EM_VOTE(&sh.set_words[b][t / 32], t, in);
    }
    sh.bits[t] = bits;
  EM_SYNC
}

// Tokens of a 128-bit block mask before token t, and in all.  Every word is read, at a constant
// index, so a mask in registers stays there (an index t / 32 would put it on the stack).
EM_FN int before(const unsigned (&w)[kWords], int t) {
  const int q = t / 32;
  const unsigned low = (1u << (t % 32)) - 1u;
  int n = 0;
  EM_UNROLL
  for (int i = 0; i < kWords; ++i) n += em_popc(w[i] & (i < q ? ~0u : i == q ? low : 0u));
  return n;
}
EM_FN int count(const unsigned (&w)[kWords]) {
  int n = 0;
  for (int i = 0; i < kWords; ++i) n += em_popc(w[i]);
  return n;
}

// A block mask in the scratch: two int64 words, the mask's 32-bit words low half first.
static_assert(kWords == 4, "a block mask is two int64 words");
static_assert(kMaxExperts < 0xffff && kBlock <= 0xffff, "a token's slot holds its expert and place in 16 bits each");
static_assert(kMaxExperts <= kSlotExperts, "a routing slot word's code holds every expert");
struct Mask {
  unsigned w[kWords];
};
EM_FN void put_mask(i64* at, const unsigned (&w)[kWords]) {
  at[0] = static_cast<i64>(static_cast<unsigned long long>(w[0]) | static_cast<unsigned long long>(w[1]) << 32);
  at[1] = static_cast<i64>(static_cast<unsigned long long>(w[2]) | static_cast<unsigned long long>(w[3]) << 32);
}
EM_FN Mask mask_of(i64 lo, i64 hi) {
  const unsigned long long a = static_cast<unsigned long long>(lo), b = static_cast<unsigned long long>(hi);
  Mask m;
  m.w[0] = static_cast<unsigned>(a);
  m.w[1] = static_cast<unsigned>(a >> 32);
  m.w[2] = static_cast<unsigned>(b);
  m.w[3] = static_cast<unsigned>(b >> 32);
  return m;
}
EM_FN Mask get_mask(const i64* at) { return mask_of(at[0], at[1]); }
EM_FN i64* tok_at(const Scratch& x, Prog p, int h, int block, int t) {
  return x.tok_rec + ((static_cast<i64>(h) * p[H_token_blocks] + block) * kBlock + t) * tok_words(p);
}

// A token as the rows phase reads it (its record's slots, loaded whole): per top-k slot its expert (-1:
// none) and its place among the tokens of its block that picked that expert; its sets are read
// from the record by bit (tok_has: a word at a variable index, which registers cannot hold).
struct Token {
  const i64* rec;
  int expert[kMaxTopk];
  int place[kMaxTopk];
};
// Its slot words, loaded (get_token loads them and unpacks them at once; the rows load them with
// the rest of their first round, then unpack them).
constexpr int kSlotWords = (kMaxTopk + 1) / 2;
EM_FN void load_token(const i64* r, int K, unsigned long long (&v)[kSlotWords]) {
  EM_UNROLL
  for (int i = 0; i < kSlotWords; ++i) v[i] = i < (K + 1) / 2 ? static_cast<unsigned long long>(r[kSetWords + i]) : 0ull;
}
EM_FN void unpack_token(const i64* r, int K, const unsigned long long (&v)[kSlotWords], Token& k) {
  k.rec = r;
  EM_UNROLL
  for (int j = 0; j < kMaxTopk; ++j) {
    const unsigned long long word = v[j / 2];
    const unsigned s = static_cast<unsigned>(j & 1 ? word >> 32 : word);
    k.expert[j] = j < K ? static_cast<int>(static_cast<short>(s & 0xffffu)) : -1;
    k.place[j] = static_cast<int>(s >> 16);
  }
}
EM_FN void get_token(const Scratch& x, Prog p, int h, int block, int t, Token& k) {
  const i64* r = tok_at(x, p, h, block, t);
  const int K = static_cast<int>(p[H_topk]);
  unsigned long long v[kSlotWords];
  load_token(r, K, v);
  unpack_token(r, K, v, k);
}

EM_FN bool tok_has(const Token& k, int b) {
  return ((static_cast<unsigned long long>(k.rec[b >> 6]) >> (b & 63)) & 1ull) != 0;
}

// A token's record, written by count (after load_tokens) for the rows phase.
EM_FN void put_token(const Scratch& x, Prog p, const Shared& sh, int h, int block, int t) {
  i64* r = tok_at(x, p, h, block, t);
  const int K = static_cast<int>(p[H_topk]);
  for (int i = 0; i < kSetWords; ++i) r[i] = static_cast<i64>(sh.bits[t].w[i]);
  for (int j = 0; j < K; j += 2) {
    unsigned s[2] = {0u, 0u};
    for (int i = 0; i < 2 && j + i < K; ++i) {
      const int e = sh.experts[t][j + i];
      s[i] = e < 0 ? 0xffffu : static_cast<unsigned>(e) | static_cast<unsigned>(before(sh.exp_words[e], t)) << 16;
    }
    r[kSetWords + j / 2] = static_cast<i64>(static_cast<unsigned long long>(s[0]) | static_cast<unsigned long long>(s[1]) << 32);
  }
}

// ---------------------------------------------------------------------------------- phases
enum Phase { PHASE_COUNT, PHASE_SCAN, PHASE_ROWS, PHASE_ITEMS, PHASES };

// What the scan's blocks hold in shared memory (in place of count's Shared: a block runs one phase
// at a time).
struct ScanShared {
  i64 lane_sum[kBlock];                           // per thread: its run's sum (sums_block, expert_offsets)
  i64 lane_tmp[kBlock];                           // the other half of expert_offsets' scan over the runs
  i64 e_total[kMaxExperts];  // per expert its rows (expert_offsets); the copies' rows, chunks (copy_offsets)
};
union PhaseShared {
  Shared count;
  ScanShared scan;
};
static_assert(sizeof(ScanShared) <= sizeof(Shared), "the scan's shared memory fits in count's (meta_program.py "
                                                    "shared_bytes counts Shared alone)");

// The sums over the token blocks the scan's blocks do, kSeries each: 2s and 2s + 1 set s's tokens
// and rows, 2S + h E + e home rank h's rows of expert e.
EM_HD i64 num_series(Prog p) { return 2 * p[H_num_sets] + p[H_num_ranks] * p[H_experts]; }

// Blocks of each phase (meta_program.py grids() says the same: count, scan, rows less count's, items).
EM_HD i64 phase_blocks(Prog p, int phase) {
  const i64 homes = p[H_num_ranks] * p[H_token_blocks];
  switch (phase) {
    case PHASE_COUNT: return homes;
    case PHASE_SCAN: return kOffsetBlocks + (num_series(p) + kSeries - 1) / kSeries;
    case PHASE_ROWS: return p[H_num_work] + homes;
    default: return p[H_num_tcopies];
  }
}

// The first of `phase`'s blocks that block `bid` of a grid of G runs (then every G-th): its own
// index, but for the scan, whose blocks start after the count blocks (those finish their own
// stores after counting: meta_fused), so a grid with room beyond the count blocks runs the scan's
// first blocks, the offsets (its longest chains), on blocks that did no count work.
EM_HD i64 phase_first(Prog p, int phase, i64 bid, i64 G) {
  if (phase != PHASE_SCAN) return bid;
  const i64 c = phase_blocks(p, PHASE_COUNT);
  const i64 shift = c < G ? c : 0;
  return bid >= shift ? bid - shift : bid - shift + G;
}

// ---------------------------------------------------------------------------------- count
// Block hb (home rank x token block, home rank major), after count_prepare for its home, once the
// tokens' slot words of exchange tag `tag` came (load_tokens; `seen`: when, thread 0's; may be
// null): the tokens' sets and experts; then, once `ready()` returned (every thread calls it:
// meta_fused waits there for the scratch's clear and the first bad token's reset), what the scan
// reads -- per set and per expert its tokens (and rows) of the block, added into the totals (the
// scan's offsets need nothing else), the block's first bad token into Args::bad --, then
// `counted()` (every thread: meta_fused's block arrives at the grid barrier after count there),
// then what only the rows phase reads, after the scan: each set's block mask, each OUT set's row
// masks, each token's record -- stored while the scan runs, not before the barrier lets it.
template <class Ready, class Counted>
EM_FN void count_block(const Args& a, i64 hb, Shared& sh, unsigned tag, unsigned long long* seen, Ready ready,
                       Counted counted) {
  const Prog p = prog_of(a);
  const int TB = static_cast<int>(p[H_token_blocks]);
  const int h = static_cast<int>(quot32(hb, TB)), block = static_cast<int>(rem32(hb, TB));  // 32-bit: not a call
  load_tokens(a, h, block, sh, tag, seen);
  ready();
  const Scratch x = scratch_of(a);
  const int nsets = static_cast<int>(p[H_sets_max]);
  const int E = static_cast<int>(p[H_experts]), K = static_cast<int>(p[H_topk]);
  EM_THREADS(t)
    // the sets one to a warp in turn (an OUT set's row masks are the longest work here: the other
    // warps would wait for warp 0 at the barrier), in both loops below
    const int first_set = (t % 32) * (kBlock / 32) + t / 32;
    for (int b = first_set; b < nsets; b += kBlock) {
      // what the set holds here, in registers before the stores (which, for all the compiler
      // knows, could be into shared memory: each use would read it again)
      const i64 si = sh.sets[b].si;  // read by count_prepare (meta_fused: before the routing came)
      const int kind = sh.sets[b].kind, out = sh.sets[b].out;
      if (si < 0) continue;
      Mask w;
      for (int i = 0; i < kWords; ++i) w.w[i] = sh.set_words[b][i];
      const int n = count(w.w);
      x.set_cnt[si * TB + block] = n;
      if (n) EM_ADD(x.set_total + si, n);
      int rows = 0;
      if (kind == SET_OUT)
        for (int m = 0; m < K; ++m) {
          for (int i = 0; i < kWords; ++i) w.w[i] = sh.row_words[out][m][i];
          rows += count(w.w);
        }
      x.set_rcnt[si * TB + block] = rows;
      if (rows) EM_ADD(x.set_rtotal + si, rows);
    }
    for (int e = t; e < E; e += kBlock) {
      const int n = count(sh.exp_words[e]);
      x.ecnt[(static_cast<i64>(h) * TB + block) * E + e] = n;
      if (n) EM_ADD(x.home_before + static_cast<i64>(h) * E + e, n);
    }
    if (t == 0 && sh.bad != kNoBad) EM_MIN(a.bad, sh.bad);
    counted();
    for (int b = first_set; b < nsets; b += kBlock) {
      const i64 si = sh.sets[b].si;
      const int kind = sh.sets[b].kind, out = sh.sets[b].out;
      if (si < 0) continue;
      Mask w;
      for (int i = 0; i < kWords; ++i) w.w[i] = sh.set_words[b][i];
      put_mask(x.set_mask + (si * TB + block) * 2, w.w);
      if (kind == SET_OUT)
        for (int m = 0; m < K; ++m) {
          for (int i = 0; i < kWords; ++i) w.w[i] = sh.row_words[out][m][i];
          put_mask(x.row_mask + ((si * TB + block) * K + m) * 2, w.w);
        }
    }
    put_token(x, p, sh, h, block, t);
  EM_SYNC
}

// Nothing to wait for before count's adds (the scratch was cleared before the launch), nor after them.
struct NoWait {
  EM_METHOD void operator()() const {}
};
EM_FN void count_block(const Args& a, i64 hb, Shared& sh) {
  count_block(a, hb, sh, tag_of(*a.epoch + 1), nullptr, NoWait{}, NoWait{});
}

// ---------------------------------------------------------------------------------- scan
// An exclusive prefix sum over n counts at src[0], src[stride], ...: dst[i] `sum` plus the
// counts before i, that plus all of them returned.  The counts are loaded kRun at a time before
// they are added (one memory latency per run, not per count).
EM_FN i64 prefix_run(const i64* src, i64* dst, i64 n, i64 stride, i64 sum = 0) {
  for (i64 b0 = 0; b0 < n; b0 += kRun) {
    i64 v[kRun];
    for (int j = 0; j < kRun; ++j) v[j] = b0 + j < n ? src[(b0 + j) * stride] : 0;
    for (int j = 0; j < kRun && b0 + j < n; ++j) {
      dst[(b0 + j) * stride] = sum;
      sum += v[j];
    }
  }
  return sum;
}

// The same over the counts at src[idx[0]], src[idx[1]], ... into dst[idx[i]].
EM_FN i64 prefix_gather(const i64* idx, const i64* src, i64* dst, i64 n) {
  i64 sum = 0;
  for (i64 b0 = 0; b0 < n; b0 += kRun) {
    i64 at[kRun], v[kRun];
    for (int j = 0; j < kRun; ++j) at[j] = b0 + j < n ? idx[b0 + j] : -1;
    for (int j = 0; j < kRun; ++j) v[j] = at[j] >= 0 ? src[at[j]] : 0;
    for (int j = 0; j < kRun && b0 + j < n; ++j) {
      dst[at[j]] = sum;
      sum += v[j];
    }
  }
  return sum;
}

// Sum u over the token blocks: where its counts are (one per block, `stride` apart) and where its
// sums before each block go.
struct Series {
  const i64* cnt;
  i64* base;
  i64 stride;
};
EM_FN Series series(const Scratch& x, i64 u, i64 S, i64 TB, i64 E) {
  Series r;
  if (u < 2 * S) {
    const i64 s = u >> 1;
    r.cnt = ((u & 1) ? x.set_rcnt : x.set_cnt) + s * TB;
    r.base = ((u & 1) ? x.set_rbase : x.set_base) + s * TB;
    r.stride = 1;
  } else {
    const i64 he = u - 2 * S, h = quot32(he, E), e = he - h * E;
    r.cnt = x.ecnt + h * TB * E + e;
    r.base = x.ebase + h * TB * E + e;
    r.stride = E;
  }
  return r;
}

// Scan block kOffsetBlocks + j: sums kSeries j to kSeries (j + 1) - 1, kLanes threads a sum.  Each
// lane sums its run of ceil(TB / kLanes) blocks, then adds the runs of the lanes before it to walk
// its own (two memory latencies a sum).
EM_FN void sums_block(const Args& a, i64 j, ScanShared& ss) {
  const Prog p = prog_of(a);
  const Scratch x = scratch_of(a);
  const i64 TB = p[H_token_blocks], E = p[H_experts], S = p[H_num_sets];
  const i64 NS = num_series(p), L = (TB + kLanes - 1) / kLanes;
  const i64 u0 = j * kSeries;
  EM_THREADS(t)
    const i64 u = u0 + t / kLanes, b0 = (t % kLanes) * L;
    i64 sum = 0;
    if (u < NS && b0 < TB) {
      const Series r = series(x, u, S, TB, E);
      sum = run_sum(r.cnt + b0 * r.stride, TB - b0 < L ? TB - b0 : L, r.stride);
    }
    ss.lane_sum[t] = sum;
  EM_SYNC
  EM_THREADS(t)
    const i64 u = u0 + t / kLanes;
    const int lane = t % kLanes;
    const i64 b0 = lane * L;
    if (u < NS && b0 < TB) {
      const i64* runs = ss.lane_sum + (t - lane);
      i64 before = 0;
      for (int i = 0; i < kLanes; ++i) before += i < lane ? runs[i] : 0;
      const Series r = series(x, u, S, TB, E);
      prefix_run(r.cnt + b0 * r.stride, r.base + b0 * r.stride, TB - b0 < L ? TB - b0 : L, r.stride, before);
    }
  EM_SYNC
}

// Offsets block 0: each rank's output rows, expert-major -- home_before[h][e] from home h's rows of
// e to the rows of the lower home ranks, e_first[e] the rows of its rank's lower local experts --
// and this rank's received rows per expert.  kBlock / R threads a rank, each a run of its local
// experts: the runs' sums, their prefix within the rank (a scan over the block's runs, log2(kBlock)
// short steps of one loop), then each run walked from it.  One block runs it once per dispatch, so
// its instructions come cold from L2: every loop is short or rolled (four steps over segments of
// 16 experts, each a rolled loop one expert after the other, took 4.4 us of the scan's long pole:
// 1 x H200, 2 ranks time-sliced, 2026-11-28).
static_assert(kMaxRanks <= kBlock, "expert_offsets gives every rank a thread at least");
EM_FN void expert_offsets(const Args& a, ScanShared& ss) {
  const Prog p = prog_of(a);
  const Scratch x = scratch_of(a);
  const int R = static_cast<int>(p[H_num_ranks]), E = static_cast<int>(p[H_experts]), EPR = static_cast<int>(p[H_epr]);
  const int me = static_cast<int>(p[H_rank]);
  const Div16 by_rank = div16(static_cast<unsigned>(kBlock / R));  // threads per rank
  const int per = (EPR + kBlock / R - 1) / (kBlock / R);          // local experts per thread
  EM_THREADS(t)
    for (int e = t; e < E; e += kBlock) ss.e_total[e] = prefix_run(x.home_before + e, x.home_before + e, R, E);
  EM_SYNC
  EM_THREADS(t)
    const int d = static_cast<int>(quot16(by_rank, static_cast<unsigned>(t)));
    const int l0 = (t - d * (kBlock / R)) * per;
    i64 sum = 0;
    EM_ROLLED
    for (int l = l0; d < R && l < l0 + per && l < EPR; ++l) sum += ss.e_total[expert_of(p, d, l)];
    ss.lane_sum[t] = sum;
  EM_SYNC
  // inclusive prefix over the block's runs (Hillis-Steele, the two arrays in turn): each run's
  // prefix within its rank is that less the prefix up to the rank's first run
  i64* from = ss.lane_sum;
  i64* to = ss.lane_tmp;
  EM_ROLLED
  for (int step = 1; step < kBlock; step *= 2) {
    EM_THREADS(t)
      to[t] = from[t] + (t >= step ? from[t - step] : 0);
    EM_SYNC
    i64* was = from;
    from = to;
    to = was;
  }
  EM_THREADS(t)
    const int d = static_cast<int>(quot16(by_rank, static_cast<unsigned>(t))), first = d * (kBlock / R);
    const int l0 = (t - first) * per;
    if (d < R && l0 < EPR) {
      // the runs before this one of its rank: the prefix up to the run before less the prefix up
      // to the rank's first run's
      i64 n = (t > 0 ? from[t - 1] : 0) - (first > 0 ? from[first - 1] : 0);
      const int end = l0 + per < EPR ? l0 + per : EPR;
      EM_ROLLED
      for (int l = l0; l < end; ++l) {
        const int e = expert_of(p, d, l);
        const i64 v = ss.e_total[e];
        x.e_first[e] = n;
        if (d == me) {
          a.recv_offset[l] = static_cast<int>(n);
          a.recv_count[l] = static_cast<int>(v);
        }
        n += v;
      }
      if (d == me && end == EPR) a.recv_offset[EPR] = static_cast<int>(n);
    }
  EM_SYNC
}

// Offsets block 1: where each SEG set's slots start in its buffer (its group's sets before it),
// the combine's zero list's bytes, the blobs' token counts.
EM_FN void set_offsets(const Args& a) {
  const Prog p = prog_of(a);
  const Scratch x = scratch_of(a);
  EM_THREADS(t)
    for (i64 g = t; g < p[H_num_groups]; g += kBlock) {
      const i64* gr = rec(p, H_off_groups, g, G_COUNT);
      prefix_gather(p + p[H_off_group_sets] + gr[G_first], x.set_total, x.set_off, gr[G_count]);
    }
    for (i64 i = t; i < p[H_num_zero]; i += kBlock) {
      const i64* z = rec(p, H_off_zero, i, Z_COUNT);
      i64 rows = 0;
      if (z[Z_result]) {
        rows = p[H_max_tokens];
      } else {
        const i64* sets = p + p[H_off_group_sets] + z[Z_group_first];
        rows = run_gather(sets, x.set_total, z[Z_group_count]);
      }
      const uint64_t v = static_cast<uint64_t>(rows) * 4u * static_cast<uint64_t>(p[H_hidden]);
      memcpy(a.blob[1] + z[Z_desc_off] + kZeroBytes, &v, 8);
    }
    if (t == 0) {
      const uint32_t tok = static_cast<uint32_t>(a.tokens[p[H_rank]]);
      if (p[H_blob_bytes_d]) memcpy(a.blob[0] + kHeaderTokens, &tok, 4);
      if (p[H_blob_bytes_c]) memcpy(a.blob[1] + kHeaderTokens, &tok, 4);
    }
  EM_SYNC
}

// Offsets block 2: each copy's parts' first token and row in it (from their sets' totals), its
// tokens, rows and chunks; then the descriptors' counts (CopyDesc rows, RoleDesc items, DrainDesc)
// and each copy's first and end chunk starts.  The second step reads each copy's rows and chunks
// from shared memory where they fit (ScanShared::e_total, free here), not back from global memory.
EM_FN void copy_offsets(const Args& a, ScanShared& ss) {
  const Prog p = prog_of(a);
  const Scratch x = scratch_of(a);
  const i64 NC = p[H_num_copies];
  const bool staged = 2 * NC <= kMaxExperts;
  // where the second step reads each copy's rows and chunks: staged, ScanShared::e_total (the rows,
  // then the chunks); else the scratch the first step writes them to anyway
  const i64* rows_of = staged ? ss.e_total : x.copy_rows;
  const i64* chunks_of = staged ? ss.e_total + NC : x.copy_chunks;
  EM_THREADS(t)
    for (i64 c = t; c < NC; c += kBlock) {
      const i64* cr = copy_rec(p, c);
      const i64 first = cr[C_first_part], np = cr[C_num_parts];
      const ChunkSpec cs = chunk_spec(p, c);  // read before the stores below (which might alias it)
      i64 tok = 0, rows = 0;
      for (i64 q0 = 0; q0 < np; q0 += kRun) {  // the parts' sets, then their totals, kRun at a time
        i64 s[kRun], v[kRun], r[kRun];
        bool out[kRun];
        for (int j = 0; j < kRun; ++j) {
          const i64* pr = part_rec(p, first + q0 + j);
          s[j] = q0 + j < np ? pr[P_tok_set] : -1;
          out[j] = q0 + j < np && (pr[P_kind] == PART_D_OUT || pr[P_kind] == PART_C_OUT);
        }
        for (int j = 0; j < kRun; ++j) {
          v[j] = s[j] >= 0 ? x.set_total[s[j]] : 0;
          r[j] = s[j] >= 0 ? (out[j] ? x.set_rtotal[s[j]] : v[j]) : 0;
        }
        for (int j = 0; j < kRun && q0 + j < np; ++j) {
          x.part_tok_base[first + q0 + j] = tok;
          x.part_row_base[first + q0 + j] = rows;
          tok += v[j];
          rows += r[j];
        }
      }
      const i64 chunks = num_chunks(chunking(cs, tok));
      x.copy_tok[c] = tok;
      x.copy_rows[c] = rows;
      x.copy_chunks[c] = chunks;
      if (staged) {
        ss.e_total[c] = rows;
        ss.e_total[NC + c] = chunks;
      }
    }
  EM_SYNC
  // the copies' descriptors, the roles' item counts and the drains' values side by side, each on
  // threads of its own and each kind from a warp of its own (one index space over all three, each
  // kind's part of it rounded up to whole warps): each is a chain of dependent loads, which in turn
  // on one thread took ~3 us of the scan's long pole (2 x H100, 2026-11-28), and a warp that holds
  // two kinds runs their chains one after the other (~2 us of it, 1 x H200, 2026-11-28)
  EM_THREADS(t)
    const i64 NT = p[H_num_tcopies], NR = p[H_num_roles], ND = p[H_num_drain];
    const i64 at_roles = (NT + 31) / 32 * 32, at_drains = at_roles + (NR + 31) / 32 * 32;
    for (i64 q0 = t; q0 < at_drains + ND; q0 += kBlock) {
      // the tcopies at 0, the roles at at_roles, the drains at at_drains; q: this one's index in
      // the space without the gaps (NT + NR + ND: a gap, nothing to do)
      const i64 q = q0 < at_roles ? (q0 < NT ? q0 : NT + NR + ND)
                  : q0 < at_drains ? (q0 - at_roles < NR ? NT + q0 - at_roles : NT + NR + ND)
                                   : NT + NR + q0 - at_drains;
      if (q >= NT + NR + ND) continue;
      if (q < NT) {
        const i64* tc = tcopy_rec(p, q);
        uint8_t* blob = a.blob[tc[T_program]];
        const i64 c = tc[T_copy];
        const i64 rows = rows_of[c], chunks = chunks_of[c];
        const uint32_t nrows = static_cast<uint32_t>(rows);
        memcpy(blob + tc[T_desc_off] + kCopyNRows, &nrows, 4);
        i64* starts = x.per_tcopy + tc[T_scratch_starts];
        starts[0] = 0;
        starts[chunks] = rows;
      } else if (q < NT + NR) {
        const i64* ro = rec(p, H_off_roles, q - NT, R_COUNT);
        i64 items = 0;
        for (i64 j0 = 0; j0 < ro[R_num_tcopies]; j0 += kRun) {  // the copies' indices, then their chunks
          i64 c[kRun];
          for (int j = 0; j < kRun; ++j) c[j] = j0 + j < ro[R_num_tcopies] ? tcopy_rec(p, ro[R_first_tcopy] + j0 + j)[T_copy] : -1;
          for (int j = 0; j < kRun; ++j) items += c[j] >= 0 ? chunks_of[c[j]] : 0;
        }
        const uint32_t v = static_cast<uint32_t>(items);
        memcpy(a.blob[ro[R_program]] + ro[R_desc_off] + kRoleItemCount, &v, 4);
      } else {
        const i64* dr = rec(p, H_off_drain, q - NT - NR, D_COUNT);
        const uint64_t v = static_cast<uint64_t>(chunks_of[dr[D_copy]]);
        memcpy(a.blob[dr[D_program]] + dr[D_desc_off] + kDrainValue, &v, 8);
      }
    }
  EM_SYNC
}

// Scan block vb: the offsets blocks first (the longest chains), then the sums.  The blocks need
// count's counts and totals only, not each other's.
EM_FN void scan_block(const Args& a, i64 vb, ScanShared& ss) {
  if (vb >= kOffsetBlocks) {
    sums_block(a, vb - kOffsetBlocks, ss);
    return;
  }
  if (vb == 0) expert_offsets(a, ss);
  else if (vb == 1) set_offsets(a);
  else copy_offsets(a, ss);
}

// ---------------------------------------------------------------------------------- rows
// The rows phase reads what count left (each token's record, the sets' block masks), not the
// routing: no shared memory, one barrier (done(): what the items read is written), and a thread's
// loads go out together -- the part's records, then in one round the item's counts and offsets, the
// masks of the part's sets and its token's record, then the expert rows' bases.

// Where home h's rows of each expert start in the output (its rows of lower home ranks and blocks
// included): the three scratch arrays that add up to it, at (h, block) once per block.
struct ExpertBase {
  const i64 *first, *home, *block;
  EM_METHOD i64 at(int e) const { return first[e] + home[e] + block[e]; }
};
EM_FN ExpertBase expert_base(const Scratch& x, Prog p, int h, int block) {
  const i64 E = p[H_experts], TB = p[H_token_blocks];
  ExpertBase b;
  b.first = x.e_first;
  b.home = x.home_before + h * E;
  b.block = x.ebase + (h * TB + block) * E;
  return b;
}

// The token of a part's set within its copy: the part's first token plus the token's rank in the set.
EM_FN i64 part_token(const Scratch& x, Prog p, i64 part, int block, int t) {
  const i64 s = part_rec(p, part)[P_tok_set];
  const Mask m = get_mask(x.set_mask + (s * p[H_token_blocks] + block) * 2);
  return x.part_tok_base[part] + x.set_base[s * p[H_token_blocks] + block] + before(m.w, t);
}

// A rows work item as far as the program says (what every token of it shares, before the
// routing): read by rows_item, which meta_fused runs for its first item while the peers' routing
// comes, so the rows phase starts at the loads that need the scan's results.
struct RowsItem {
  i64 part, tcopy, copy, tok_set, src_set, dst_set, srcbuf, out_rank;
  i64 src_rows, dst_rows, weights;     // byte offsets into the program's blob (weights: -1, none)
  i64 waits, starts, nprod;            // the copy's waits and chunk starts in the scratch's per_tcopy
  i64 prod, prod_part, prod_slot;      // the producer copy, its part of this one's source (-1: no producer waits)
  i64 contrib_begin, contrib_count;
  int block, h, kind, program, tok_bit;
  ChunkSpec ck, pck;                   // the copy's and the producer's
};

EM_FN void rows_item(Prog p, i64 wi, RowsItem& r) {
  const i64* w = rec(p, H_off_work, wi, W_COUNT);
  const i64 part = w[W_part];
  const i64* pr = part_rec(p, part);
  const i64* tc = tcopy_rec(p, pr[P_tcopy]);
  const int kind = static_cast<int>(pr[P_kind]);
  r.part = part;
  r.tcopy = pr[P_tcopy];
  r.block = static_cast<int>(w[W_block]);
  r.h = static_cast<int>(pr[P_origin]);
  r.copy = pr[P_copy];
  r.kind = kind;
  r.tok_set = pr[P_tok_set];
  r.tok_bit = static_cast<int>(set_rec(p, r.tok_set)[S_bit]);
  // the slots a row reads or writes: staging, both; into `output`, the source's (dispatch) or the
  // destination's (combine); a dispatch's waits, the source's
  r.src_set = kind == PART_C_OUT ? -1 : pr[P_src_set];
  r.dst_set = kind == PART_D_OUT ? -1 : pr[P_dst_set];
  r.srcbuf = pr[P_srcbuf];
  r.out_rank = pr[P_out_rank];
  r.program = static_cast<int>(tc[T_program]);
  r.src_rows = tc[T_src_rows];
  r.dst_rows = tc[T_dst_rows];
  r.weights = tc[T_weighted] ? tc[T_weights] : -1;
  r.waits = tc[T_scratch_waits];
  r.starts = tc[T_scratch_starts];
  r.nprod = tc[T_prod_count];
  r.contrib_begin = pr[P_contrib_begin];
  r.contrib_count = pr[P_contrib_count];
  r.ck = chunk_spec(p, r.copy);
  r.prod = pr[P_producer];
  r.prod_slot = pr[P_prod_slot];
  const bool prod_waits = (kind == PART_D_STAGE || kind == PART_D_OUT) && r.prod >= 0 && r.prod_slot >= 0;
  r.prod_part = prod_waits ? copy_rec(p, r.prod)[C_first_part] + pr[P_prod_part] : -1;
  r.pck = prod_waits ? chunk_spec(p, r.prod) : r.ck;
}

// Work item r (a part of this rank's copies x a token block) of part kind KIND (r.kind): its rows,
// in two parts.  First what count left, once records() returned (every thread calls it: meta_fused
// waits there for every count block's masks and token records): in one round the masks of the
// part's sets at this block, the token's record and, a combine's expert rows, its slots' weights;
// then from them the token's place in its sets, its rows before it in the block and its slots'
// order on the part's rank.  Then, once scanned() returned (every thread: meta_fused's grid barrier
// after the scan, which the block arrived at before records()), what the scan wrote, in one round:
// the item's counts and offsets and the expert rows' bases.  meta_fused runs the first part while
// the scan runs: the scan's results and its last barrier were the rows phase's first round, and its
// code, fetched cold, half of its time (ncu: 59 % of rows_run's stall samples waited for
// instructions, 2 x H200, 2026-11-28).  Each thread then writes what the items phase reads (its
// chunk's first row, the chunks' waits), calls done() -- every thread, once: meta_fused counts the
// item done there (rows_done), so its copy's items wait for those few words, not for the rows --
// then stores its rows, which only the dispatch reads.  A chunk's wait for a producer is a maximum
// over its tokens, the producer's token growing with the copy's: only the chunk's last token of
// the block raises it (one atomic a chunk, not a token).  One instance per kind (rows_run below
// picks it): a block runs its kind's code alone, not the other kinds' beside it.
template <int KIND, class Records, class Scanned, class Done>
EM_FN void rows_run_kind(const Args& a, const RowsItem& r, Records records, Scanned scanned, Done done) {
  const Prog p = prog_of(a);
  const i64 part = r.part;
  const int block = r.block, h = r.h;
  constexpr int kind = KIND;
  const Scratch x = scratch_of(a);
  const i64 copy = r.copy;
  const int K = static_cast<int>(p[H_topk]), TB = static_cast<int>(p[H_token_blocks]);
  const i64 max_tokens = p[H_max_tokens];
  const Experts xp = experts_of(p);
  const ExpertBase eb = expert_base(x, p, h, block);
  const i64 tok_set = r.tok_set;
  const int tok_bit = r.tok_bit;
  uint8_t* blob = a.blob[r.program];
  int64_t* src_rows = reinterpret_cast<int64_t*>(blob + r.src_rows);
  int64_t* dst_rows = reinterpret_cast<int64_t*>(blob + r.dst_rows);
  float* weights = r.weights >= 0 ? reinterpret_cast<float*>(blob + r.weights) : nullptr;
  const i64 srcbuf = r.srcbuf;
  i64* waits = x.per_tcopy + r.waits;
  i64* starts = x.per_tcopy + r.starts;
  const i64 nprod = r.nprod;
  constexpr bool stage = kind == PART_D_STAGE || kind == PART_C_STAGE;
  const i64 tb = tok_set * TB + block;  // the part's set at this token block
  // an OUT part: its set's row masks (tokens with at least m + 1 rows on the part's rank)
  const i64* rows_mask = x.row_mask + tb * K * 2;
  const bool prod_waits = r.prod_part >= 0;
  const i64 src_set = kind == PART_C_OUT ? -1 : r.src_set, dst_set = kind == PART_D_OUT ? -1 : r.dst_set;
  const i64 sb = src_set * TB + block, db = dst_set * TB + block;
  const i64* recs = tok_at(x, p, h, block, 0);  // the block's token records
  const i64 rec_words = tok_words(p);
  const unsigned long long* slots = a.routing + (static_cast<i64>(h) * max_tokens + block * kBlock) * K;
  const bool weighted = kind == PART_C_OUT && weights != nullptr;
  EM_THREADS(t)
    records();
    // Part one, from count's masks and records, every load issued before any is used (the warp
    // issues in order, and a use waits for its load: a load after a use would wait a round more)
    const i64 src_m0 = src_set >= 0 ? x.set_mask[sb * 2] : 0, src_m1 = src_set >= 0 ? x.set_mask[sb * 2 + 1] : 0;
    const i64 dst_m0 = dst_set >= 0 ? x.set_mask[db * 2] : 0, dst_m1 = dst_set >= 0 ? x.set_mask[db * 2 + 1] : 0;
    const i64 tok_m0 = x.set_mask[tb * 2], tok_m1 = x.set_mask[tb * 2 + 1];
    i64 row_m[kMaxTopk][2];
    EM_UNROLL
    for (int m = 0; m < kMaxTopk; ++m) {
      row_m[m][0] = !stage && m < K ? rows_mask[m * 2] : 0;
      row_m[m][1] = !stage && m < K ? rows_mask[m * 2 + 1] : 0;
    }
    const i64* tr = recs + t * rec_words;
    const unsigned long long set_word = static_cast<unsigned long long>(tr[tok_bit >> 6]);
    unsigned long long words[kSlotWords];
    load_token(tr, K, words);
    unsigned long long slot_w[kMaxTopk];  // a combine's expert rows: the routing's slot words (their weights)
    EM_UNROLL
    for (int j = 0; j < kMaxTopk; ++j)
      slot_w[j] = weighted && j < K && block * kBlock + t < max_tokens ? slots[t * K + j] : 0ull;
    // then what they give: the token's place among the part's set's tokens of the block and its
    // slots' there, its rows before it, whether it is in the part's set
    const Mask tm = mask_of(tok_m0, tok_m1);
    const Mask src_m = mask_of(src_m0, src_m1), dst_m = mask_of(dst_m0, dst_m1);
    const int tok_in = before(tm.w, t);  // the part's tokens of the block before it
    const bool block_last = tok_in + 1 == count(tm.w);
    const int src_in = before(src_m.w, t), dst_in = before(dst_m.w, t);
    int rb = 0;
    EM_UNROLL
    for (int m = 0; m < kMaxTopk; ++m) rb += before(mask_of(row_m[m][0], row_m[m][1]).w, t);
    Token k;
    unpack_token(tr, K, words, k);
    const bool mine = ((set_word >> (tok_bit & 63)) & 1ull) != 0;
    // an OUT part's expert rows (a staging part has none): the token's slots on rank d, each one's
    // place among them by local expert, which on one rank is the experts' own order under either
    // placement (blocked: rank * epr + local; strided: local * R + rank), so the experts compare as
    // they are (a token's experts differ; a slot elsewhere, or none, is kOff: never before one on d)
    constexpr int kOff = 0x7fffffff;
    int key[kMaxTopk], at[kMaxTopk];
    const int d = static_cast<int>(r.out_rank);
    EM_UNROLL
    for (int j = 0; j < kMaxTopk; ++j) {
      const int e = k.expert[j];
      key[j] = !stage && mine && e >= 0 && xp.rank(e) == d ? e : kOff;
    }
    EM_UNROLL
    for (int j = 0; j < kMaxTopk; ++j) {
      at[j] = 0;
      EM_UNROLL
      for (int i = 0; i < kMaxTopk; ++i) at[j] += i != j && key[i] < key[j] ? 1 : 0;
    }
    bool on[kMaxTopk];
    EM_UNROLL
    for (int j = 0; j < kMaxTopk; ++j) on[j] = key[j] != kOff;
    scanned();
    // Part two, from the scan: the item's counts and offsets, the expert rows' bases, in one round
    const i64 copy_tok = x.copy_tok[copy], tok0 = x.part_tok_base[part], tok_before = x.set_base[tb];
    const i64 row0 = x.part_row_base[part], row_before = stage ? 0 : x.set_rbase[tb];
    const i64 src_off = src_set >= 0 ? x.set_off[src_set] : 0, src_before = src_set >= 0 ? x.set_base[sb] : 0;
    const i64 dst_off = dst_set >= 0 ? x.set_off[dst_set] : 0, dst_before = dst_set >= 0 ? x.set_base[db] : 0;
    const i64 ptok0 = prod_waits ? x.part_tok_base[r.prod_part] : 0, pcopy_tok = prod_waits ? x.copy_tok[r.prod] : 0;
    i64 out[kMaxTopk];
    EM_UNROLL
    for (int j = 0; j < kMaxTopk; ++j) out[j] = on[j] ? eb.at(k.expert[j]) + k.place[j] : 0;
    // then what they give: the copy's chunking (and the producer's), the token within the copy, its
    // slots in the part's source and destination sets, its first row in the copy (staging: its
    // place among the part's tokens; expert rows: after the rows of the set's tokens before it)
    const Chunking ck = chunking(r.ck, copy_tok);
    const Chunking pck = prod_waits ? chunking(r.pck, pcopy_tok) : ck;
    const i64 tok_at = tok0 + tok_before;  // the part's first token of this block
    const i64 tok = tok_at + tok_in;       // the token within the copy
    const i64 src_at = src_off + src_before;
    const i64 src_slot = src_at + src_in, dst_slot = dst_off + dst_before + dst_in;
    const i64 ptok_at = ptok0 + src_before;  // the producer's token of this block's first slot of the source set
    const i64 row = stage ? row0 + tok_in + tok_before : row0 + row_before + rb;
    // what the items read first (each chunk's first row, its waits), then done(), then the rows
    if (mine) {
      const i64 chunk = chunk_of(ck, tok);
      if (chunk_start(ck, chunk) == tok) starts[chunk] = row;
      // waits: per producer, its chunk holding this token
      if (prod_waits) {
        // the largest over the chunk's tokens, the producer's token growing with this one's: its last
        // token's of the block (the chunk's last, or the part's last here) alone raises it
        if (tok + 1 == chunk_start(ck, chunk + 1) || block_last) {
          const i64 ptok = ptok_at + (src_slot - src_at);
          const i64 v = chunk_of(pck, ptok) + 1;
          EM_MAX(reinterpret_cast<unsigned long long*>(waits + chunk * nprod + r.prod_slot),
                 static_cast<unsigned long long>(v));
        }
      } else if (kind == PART_C_STAGE) {
        const i64* ks = p + p[H_off_contrib] + r.contrib_begin * K_COUNT;
        for (i64 i = 0; i < r.contrib_count; ++i, ks += K_COUNT) {
          const i64 q = ks[K_part];
          const int qb = static_cast<int>(set_rec(p, part_rec(p, q)[P_tok_set])[S_bit]);
          if (!tok_has(k, qb)) continue;
          const i64 qtok = part_token(x, p, q, block, t);
          const i64 v = chunk_of(chunking(p, ks[K_copy], x.copy_tok[ks[K_copy]]), qtok) + 1;
          EM_MAX(reinterpret_cast<unsigned long long*>(waits + chunk * nprod + ks[K_slot]),
                 static_cast<unsigned long long>(v));
        }
      }
    }
    done();  // every thread
    if (mine) {
      if (stage) {
        src_rows[row] = (srcbuf << kRowBufShift) | src_slot;
        dst_rows[row] = dst_slot;
      } else {
        const i64 slot = kind == PART_D_OUT ? src_slot : dst_slot;
        EM_UNROLL
        for (int j = 0; j < kMaxTopk; ++j) {
          if (!on[j]) continue;
          if (kind == PART_D_OUT) {
            src_rows[row + at[j]] = (srcbuf << kRowBufShift) | slot;
            dst_rows[row + at[j]] = out[j];
          } else {
            src_rows[row + at[j]] = (srcbuf << kRowBufShift) | out[j];
            dst_rows[row + at[j]] = slot;
            if (weights) weights[row + at[j]] = slot_weight(slot_w[j]);
          }
        }
      }
    }
  EM_DONE  // no barrier: nothing follows
}

template <class Records, class Scanned, class Done>
EM_FN void rows_run(const Args& a, const RowsItem& r, Records records, Scanned scanned, Done done) {
  switch (r.kind) {
    case PART_D_STAGE: rows_run_kind<PART_D_STAGE>(a, r, records, scanned, done); break;
    case PART_D_OUT: rows_run_kind<PART_D_OUT>(a, r, records, scanned, done); break;
    case PART_C_STAGE: rows_run_kind<PART_C_STAGE>(a, r, records, scanned, done); break;
    default: rows_run_kind<PART_C_OUT>(a, r, records, scanned, done); break;
  }
}

// The table copy whose rows work item wi writes.
EM_FN i64 work_tcopy(Prog p, i64 wi) { return part_rec(p, rec(p, H_off_work, wi, W_COUNT)[W_part])[P_tcopy]; }

EM_FN void rows_block(const Args& a, i64 wi) {
  RowsItem r;
  rows_item(prog_of(a), wi, r);
  rows_run(a, r, NoWait{}, NoWait{}, NoWait{});
}

// Block `hb` (home rank x token block): this rank's received rows, each one's weight and expert;
// block 0 advances the exchange's epoch (every count block read it: the rows phase runs after them
// all; the next exchange's routing copy reads it after this launch), off the scan's chains.
EM_FN void recv_block(const Args& a, int hb) {
  const Prog p = prog_of(a);
  const int TB = static_cast<int>(p[H_token_blocks]);
  const int h = hb / TB, block = hb % TB;
  const Scratch x = scratch_of(a);
  const int K = static_cast<int>(p[H_topk]), me = static_cast<int>(p[H_rank]);
  const Experts xp = experts_of(p);
  const ExpertBase eb = expert_base(x, p, h, block);
  const i64 max_tokens = p[H_max_tokens];
  const unsigned long long epoch = hb == 0 ? *a.epoch : 0;  // loaded before the stores, which might alias it
  EM_THREADS(t)
    Token k;
    get_token(x, p, h, block, t, k);
    i64 row[kMaxTopk];  // loaded before any store (see rows_block)
    float wt[kMaxTopk];
    EM_UNROLL
    for (int j = 0; j < kMaxTopk; ++j) {
      const int e = k.expert[j];
      const bool mine = e >= 0 && xp.rank(e) == me;
      row[j] = mine ? eb.at(e) + k.place[j] : -1;
      wt[j] = mine ? slot_weight(a.routing[(static_cast<i64>(h) * max_tokens + block * kBlock + t) * K + j]) : 0.f;
    }
    EM_UNROLL
    for (int j = 0; j < kMaxTopk; ++j) {
      if (row[j] < 0) continue;
      a.recv_w[row[j]] = wt[j];
      a.recv_idx[row[j]] = k.expert[j];
    }
    if (hb == 0 && t == 0) *a.epoch = epoch + 1;
  EM_DONE  // no barrier: nothing follows
}

// Rows block vb: num_work (part x token block, parts of this rank's copies only), then num_ranks x
// token_blocks (the received rows).
EM_FN void rows_phase_block(const Args& a, i64 vb) {
  const i64 work = a.head[H_num_work];
  if (vb < work) rows_block(a, vb);
  else recv_block(a, static_cast<int>(vb - work));
}

// The place of item (copy i of the role, chunk c) in the role's item order: by progress
// (2c + 1) / (2 n_i), ties by copy (tables.item_order).  With `channel`, its place among the
// items of the role's copies between the same two ranks only: the chunk's sequence number on its
// GPU proxy channel (runtime/engines/gpu_proxy/channels.py item_sequences).
EM_FN i64 item_position(const Scratch& x, Prog p, const i64* ro, i64 i, i64 c, bool channel = false) {
  const i64* ti = tcopy_rec(p, ro[R_first_tcopy] + i);
  const i64 ni = x.copy_chunks[ti[T_copy]];
  i64 pos = c;
  for (i64 j = 0; j < ro[R_num_tcopies]; ++j) {
    if (j == i) continue;
    const i64* tj = tcopy_rec(p, ro[R_first_tcopy] + j);
    if (channel && (tj[T_src_rank] != ti[T_src_rank] || tj[T_dst_rank] != ti[T_dst_rank])) continue;
    const i64 nj = x.copy_chunks[tj[T_copy]];
    if (nj == 0) continue;
    const i64 X = (2 * c + 1) * nj;  // chunk c' of j comes first iff (2c' + 1) ni < X (or <= X for j < i)
    i64 lim = j < i ? quot(X, ni) : quot(X + ni - 1, ni) - 1;  // the largest odd value (2c' + 1) allowed
    i64 n = lim >= 1 ? (lim - 1) / 2 + 1 : 0;
    pos += n < nj ? n : nj;
  }
  return pos;
}

// Items block ti: copy ti of this rank's tables, once `ready()` returned (every thread calls it,
// once: meta_fused waits there for the copy's rows, rows_wait).  What needs the program and the
// scan's chunk counts alone is read before: the copy's records and, for a thread's first chunk, its
// place in the role's item order (item_position, the block's longest chain of loads) and on its
// proxy channel, and its first producers' ranks.  After the wait a thread loads its chunk's first
// rows and waits from the rows phase, then stores; its further chunks (a copy of more than kBlock)
// read everything after it.  The items step 2.2-2.6 -> 1.4-1.5 us, the kernels' own time -0.7 us
// (2 x H200, 2026-11-28): a block's own rows item ends 2-3 us before its copy's slowest.
constexpr int kItemsEarlyProducers = 4;  // the producers whose ranks a thread reads before the wait
template <class Ready>
EM_FN void items_block(const Args& a, i64 ti, Ready ready) {
  const Prog p = prog_of(a);
  const Scratch x = scratch_of(a);
  const i64* tc = tcopy_rec(p, ti);
  const i64* ro = rec(p, H_off_roles, tc[T_role_rec], R_COUNT);
  const int program = static_cast<int>(tc[T_program]);
  uint8_t* blob = a.blob[program];
  const i64 items_at = p[program ? H_items_off_c : H_items_off_d], waits_at = p[program ? H_waits_off_c : H_waits_off_d];
  const i64 n = x.copy_chunks[tc[T_copy]];
  const i64 nprod = tc[T_prod_count];
  const i64* waits = x.per_tcopy + tc[T_scratch_waits];
  const i64* starts = x.per_tcopy + tc[T_scratch_starts];
  const i64* prods = p + p[H_off_prods] + tc[T_prod_begin];
  const i64 i = ti - ro[R_first_tcopy];
  const bool waited = tc[T_side] != SIDE_UNPACK;  // an unpack item waits for no producer
  uint32_t* seq = tc[T_side] != SIDE_SM ? a.seq[program] : nullptr;
  EM_THREADS(t)
    uint32_t pdst[kItemsEarlyProducers];
    EM_UNROLL
    for (int k = 0; k < kItemsEarlyProducers; ++k)
      pdst[k] = waited && k < nprod ? static_cast<uint32_t>(copy_rec(p, prods[k])[C_dst]) : 0;
    for (i64 c = t;; c += kBlock) {
      const bool has = c < n;
      const i64 pos = has ? item_position(x, p, ro, i, c) : 0;
      const i64 chan = has && seq ? item_position(x, p, ro, i, c, true) : 0;
      if (c == t) ready();  // once, every thread, after its first chunk's places
      if (!has) break;
      const i64 w0 = ro[R_wait_begin] + pos * ro[R_wait_stride];
      uint32_t nw = 0;
      const auto wait_on = [&](i64 k, uint32_t dst) {  // producer k (flag order), its rank dst
        const uint64_t v = static_cast<uint64_t>(waits[c * nprod + k]);
        if (v == 0) return;
        const uint32_t wd[4] = {dst, static_cast<uint32_t>(prods[k]), static_cast<uint32_t>(v),
                                static_cast<uint32_t>(v >> 32)};  // WaitDesc
        memcpy(blob + waits_at + (w0 + nw) * kWaitBytes, wd, kWaitBytes);
        ++nw;
      };
      if (waited) {
        EM_UNROLL
        for (int k = 0; k < kItemsEarlyProducers; ++k)
          if (k < nprod) wait_on(k, pdst[k]);
        for (i64 k = kItemsEarlyProducers; k < nprod; ++k)
          wait_on(k, static_cast<uint32_t>(copy_rec(p, prods[k])[C_dst]));
      }
      const uint32_t item[6] = {static_cast<uint32_t>(tc[T_desc_index]), static_cast<uint32_t>(c),
                                static_cast<uint32_t>(starts[c]), static_cast<uint32_t>(starts[c + 1]),
                                static_cast<uint32_t>(w0), nw};  // ItemDesc
      memcpy(blob + items_at + (ro[R_item_begin] + pos) * kItemBytes, item, kItemBytes);
      if (seq) seq[ro[R_item_begin] + pos] = static_cast<uint32_t>(chan);
    }
  EM_SYNC
}
EM_FN void items_block(const Args& a, i64 ti) { items_block(a, ti, NoWait{}); }

// Block vb of `phase` (phase_blocks(phase) of them; within a phase, in any order and on any
// blocks): the phases in order, each after every block of the one before.  Count's blocks run
// count_prepare first unless `prepared` (the block's shared memory already holds vb's home's sets).
EM_FN void phase_block(const Args& a, int phase, i64 vb, PhaseShared& sm, bool prepared = false) {
  switch (phase) {
    case PHASE_COUNT:
      if (!prepared) count_prepare(a, static_cast<int>(quot32(vb, a.head[H_token_blocks])), sm.count);
      count_block(a, vb, sm.count);
      break;
    case PHASE_SCAN: scan_block(a, vb, sm.scan); break;
    case PHASE_ROWS: rows_phase_block(a, vb); break;
    default: items_block(a, vb); break;
  }
}

// ---------------------------------------------------------------------------------- kernels
// Each phase as a launch of its own, a block per phase block, in stream order: the targets without
// a cooperative launch (SUPA), and the CUDA target's fallback.
#ifdef EPCC_META_HOST
#define EM_PHASE_KERNEL(name, phase) \
  EM_KERNEL name(Args a, int em_block) { \
    EM_SHARED PhaseShared sm; \
    phase_block(a, phase, EM_BLOCK, sm); \
  }
#else
#define EM_PHASE_KERNEL(name, phase) \
  EM_KERNEL name(EM_ARGS a) { \
    EM_SHARED PhaseShared sm; \
    phase_block(a, phase, EM_BLOCK, sm); \
  }
#endif
EM_PHASE_KERNEL(meta_count, PHASE_COUNT)
EM_PHASE_KERNEL(meta_scan, PHASE_SCAN)
EM_PHASE_KERNEL(meta_rows, PHASE_ROWS)
EM_PHASE_KERNEL(meta_items, PHASE_ITEMS)
#undef EM_PHASE_KERNEL

}  // namespace meta
}  // namespace epcc
