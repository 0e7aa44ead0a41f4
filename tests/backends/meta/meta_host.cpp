// The metadata kernels compiled for the host (EPCC_META_HOST): each block's steps run one thread
// after the other, blocks one after the other, phase after phase as the GPU runs them.  Built and
// called by tests/backends/test_meta_kernels.py (ctypes).
#define EPCC_META_HOST 1
#include <climits>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "epcc/table/meta.cuh"

using namespace epcc::meta;

extern "C" long long epcc_meta_scratch_words(const long long* prog) { return scratch_words(prog_of(prog)); }

// The blocks of a phase (meta_program.py grids() must say the same).
extern "C" long long epcc_meta_phase_blocks(const long long* prog, int phase) { return phase_blocks(prog_of(prog), phase); }
// The first of `phase`'s blocks that block b of a grid of G runs (meta_fused's order).
extern "C" long long epcc_meta_phase_first(const long long* prog, int phase, long long b, long long G) {
  return phase_first(prog_of(prog), phase, b, G);
}

// The grid the next runs emulate: 0, each phase a launch of its own (the four kernels, a block per
// phase block, in order); G > 0, the cooperative kernel of G blocks (block b runs the phase blocks
// b, b + G, ... of each phase, the first count block's sets read ahead), blocks in turn.
static int g_grid = 0;
extern "C" void epcc_meta_set_grid(int blocks) { g_grid = blocks; }

// The kernels' divisions without a divide against the divide: Div16 for every divisor 1..dmax and
// every n < 2^16, then for every larger divisor below 2^16 the n at each multiple and just below it
// and n = 2^16 - 1; quot and quot32 on values around 2^32.  0: every one exact; else the first
// failing divisor.
extern "C" long long epcc_meta_check_division(unsigned dmax) {
  for (unsigned d = 1; d < 65536u; ++d) {
    const Div16 v = div16(d);
    if (d <= dmax) {
      for (unsigned n = 0; n < 65536u; ++n)
        if (quot16(v, n) != n / d || rem16(v, n) != n % d) return d;
    } else {
      for (unsigned q = 1; q * d < 65536u; ++q)
        for (unsigned n : {q * d - 1, q * d})
          if (quot16(v, n) != n / d || rem16(v, n) != n % d) return d;
      if (quot16(v, 65535u) != 65535u / d) return d;
    }
  }
  const long long big[] = {0, 1, 7, 4095, 65536, 0xffffffffll, 0x100000000ll, 0x100000001ll, 0x7fffffffffffll};
  for (long long a : big)
    for (long long b : {1ll, 3ll, 128ll, 4097ll, 0xfffffffell})
      if (quot(a, b) != a / b || (a < 0x100000000ll && (quot32(a, b) != a / b || rem32(a, b) != a % b))) return b;
  return 0;
}

// The slot words as the exchange writes them (slot_word) and as count reads them back.
extern "C" unsigned long long epcc_meta_slot_word(long long e, float w, int present, unsigned tag) {
  return slot_word(e, w, present != 0, tag);
}
extern "C" int epcc_meta_slot_expert(unsigned long long v) { return slot_expert(v); }
extern "C" unsigned epcc_meta_tag_of(unsigned long long epoch) { return tag_of(epoch); }

// The next run writes rank `rank`'s slot words with the tag of the exchange before (-1: none), as a
// gather area holds them where that rank's routing never came: the run then returns 3 and
// epcc_meta_error_rank names the rank the kernels found missing.
static int g_stale = -1, g_error_rank = -1;
extern "C" void epcc_meta_set_stale(int rank) { g_stale = rank; }
extern "C" int epcc_meta_error_rank(void) { return g_error_rank; }

// sizeof(Shared) at this build's capacity (meta_program.py shared_bytes computes the same).
extern "C" long long epcc_meta_shared_bytes(void) { return static_cast<long long>(sizeof(Shared)); }

// expert_offsets alone, on R ranks' rows of E experts (`rows` [R][E], placement blocked or strided,
// rank `rank`'s received rows): home_before [R][E] (each home's rows of the expert from the lower
// home ranks), e_first [E], recv_count [E / R], recv_offset [E / R + 1].  1: R or E out of range.
extern "C" int epcc_meta_expert_offsets(int R, int E, int strided, int rank, const long long* rows,
                                        long long* home_before, long long* e_first, int* recv_count,
                                        int* recv_offset) {
  if (R < 1 || R > kMaxRanks || E < R || E > kMaxExperts || E % R != 0 || rank < 0 || rank >= R) return 1;
  std::vector<long long> prog(H_COUNT, 0);
  prog[H_num_ranks] = R;
  prog[H_experts] = E;
  prog[H_epr] = E / R;
  prog[H_strided] = strided;
  prog[H_rank] = rank;
  Args a{};
  a.prog = prog.data();
  std::memcpy(a.head, prog.data(), sizeof a.head);
  // the scratch: home_before at 0 (count's totals, R x E), e_first after it (scratch_of's regions 3 and
  // 12; the others unused)
  std::vector<long long> scratch(static_cast<size_t>(R + 1) * E, 0x5a5a5a5a);
  std::memcpy(scratch.data(), rows, sizeof(long long) * R * E);
  a.scratch = scratch.data();
  a.lay[3] = 0;
  a.lay[12] = static_cast<long long>(R) * E;
  a.recv_count = recv_count;
  a.recv_offset = recv_offset;
  static ScanShared ss;
  expert_offsets(a, ss);
  std::memcpy(home_before, scratch.data(), sizeof(long long) * R * E);
  std::memcpy(e_first, scratch.data() + static_cast<size_t>(R) * E, sizeof(long long) * E);
  return 0;
}


// A run's end: 3 where the kernels found a rank's routing missing (the exchange's error word {1, rank}),
// 4 where the epoch did not advance by exactly one, else 0.
static int finish(const int (&error)[2], unsigned long long epoch) {
  if (error[0]) {
    g_error_rank = error[1];
    return 3;
  }
  return epoch == 2 ? 0 : 4;
}

extern "C" int epcc_meta_run(const long long* prog, long long* scratch, const int* tokens, const int* topk,
                             const float* weights, unsigned char* blob_d, unsigned char* blob_c, int* bad,
                             float* recv_w, long long* recv_idx, int* recv_count, int* recv_offset,
                             unsigned* seq_d, unsigned* seq_c) {
  const Prog p = prog_of(prog);
  if (!fits(p)) return 1;
  Args a;
  // what the routing copy leaves: the regions before kZeroed zero, the rest what an earlier
  // dispatch wrote (here a pattern no table holds: what the phases do not write shows)
  const long long words = scratch_words(p, a.lay);
  std::memset(scratch, 0, sizeof(long long) * a.lay[kZeroed]);
  std::memset(scratch + a.lay[kZeroed], 0x5a, sizeof(long long) * (words - a.lay[kZeroed]));
  *bad = INT_MAX;
  a.prog = prog;
  std::memcpy(a.head, prog, sizeof a.head);
  a.scratch = scratch;
  // every rank's routing as the exchange leaves it in a gather area: slot words of this exchange's
  // tag (the second: the area's words of the first, and a rank's set stale, show), tokens past a
  // rank's count absent
  const long long R = p[H_num_ranks], T = p[H_max_tokens], K = p[H_topk];
  unsigned long long epoch = 1;
  std::vector<unsigned long long> slots(static_cast<size_t>(R * T * K));
  for (long long r = 0; r < R; ++r)
    for (long long i = 0; i < T * K; ++i) {
      const long long at = r * T * K + i;
      slots[at] = slot_word(topk[at], weights[at], i / K < tokens[r], tag_of(r == g_stale ? epoch : epoch + 1));
    }
  g_stale = -1;
  int error[2] = {0, 0};
  g_error_rank = -1;
  a.tokens = tokens;
  a.routing = slots.data();
  a.epoch = &epoch;
  a.error = error;
  a.timeout_ns = 0;
  a.blob[0] = blob_d;
  a.blob[1] = blob_c;
  a.bad = bad;
  a.recv_w = recv_w;
  a.recv_idx = reinterpret_cast<int64_t*>(recv_idx);
  a.recv_count = recv_count;
  a.recv_offset = recv_offset;
  a.seq[0] = seq_d;
  a.seq[1] = seq_c;
  if (g_grid <= 0) {
    for (int b = 0; b < phase_blocks(p, PHASE_COUNT); ++b) meta_count(a, b);
    for (int b = 0; b < phase_blocks(p, PHASE_SCAN); ++b) meta_scan(a, b);
    for (int b = 0; b < phase_blocks(p, PHASE_ROWS); ++b) meta_rows(a, b);
    for (int b = 0; b < phase_blocks(p, PHASE_ITEMS); ++b) meta_items(a, b);
    return finish(error, epoch);
  }
  // meta_fused's order (its block b reads its first count block's sets and its first rows item
  // while it waits for the exchange: here right before that block, the blocks running one after
  // the other).  Its items
  // block of table copy ti waits for that copy's rows work items (rows_done per work_tcopy, up to
  // the program's T_work_items): here the rows phase ran whole before, and each copy's count of them
  // must be what the wait waits for (2: it is not; the GPU would hang there, or go on too early).
  static PhaseShared sm;
  const long long G = g_grid, TB = p[H_token_blocks];
  for (int phase = 0; phase < PHASES; ++phase) {
    if (phase == PHASE_ITEMS) {
      for (long long ti = 0; ti < p[H_num_tcopies]; ++ti) {
        long long done = 0;
        for (long long wi = 0; wi < p[H_num_work]; ++wi) done += work_tcopy(p, wi) == ti;
        if (done != tcopy_rec(p, ti)[T_work_items]) return 2;
      }
    }
    for (long long b = 0; b < G; ++b)
      for (long long vb = phase_first(p, phase, b, G); vb < phase_blocks(p, phase); vb += G) {
        const bool first = phase == PHASE_COUNT && vb == b;
        if (first) count_prepare(a, static_cast<int>(vb / TB), sm.count);
        if (phase == PHASE_ROWS && vb == b && vb < p[H_num_work]) {
          // the block's first rows item as meta_fused runs it: its records read early
          static RowsItem ri;
          rows_item(p, vb, ri);
          rows_run(a, ri, NoWait{}, NoWait{}, NoWait{});
          continue;
        }
        phase_block(a, phase, vb, sm, first);
      }
  }
  return finish(error, epoch);
}
