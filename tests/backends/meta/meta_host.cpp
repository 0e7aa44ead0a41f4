// The metadata kernels compiled for the host (EPCC_META_HOST): each block's phases run one thread
// after the other, blocks one after the other, in the order the GPU launches them.  Built and
// called by tests/backends/test_meta_kernels.py (ctypes).
#define EPCC_META_HOST 1
#include <climits>
#include <cstring>

#include "epcc/table/meta.cuh"

using namespace epcc::meta;

extern "C" long long epcc_meta_scratch_words(const long long* prog) { return scratch_words(prog); }

// meta_scan's blocks (meta_program.py grids()["scan"] must say the same).
extern "C" long long epcc_meta_scan_blocks(const long long* prog) { return scan_blocks(prog); }

// The blocks the next runs give meta_scan (0: scan_blocks'), to check any grid writes the same.
static int g_scan_grid = 0;
extern "C" void epcc_meta_set_scan_grid(int blocks) { g_scan_grid = blocks; }

// sizeof(Shared) at this build's capacity (meta_program.py shared_bytes computes the same).
extern "C" long long epcc_meta_shared_bytes(void) { return static_cast<long long>(sizeof(Shared)); }

extern "C" int epcc_meta_run(const long long* prog, long long* scratch, const int* tokens, const int* topk,
                             const float* weights, unsigned char* blob_d, unsigned char* blob_c, int* bad,
                             float* recv_w, long long* recv_idx, int* recv_count, int* recv_offset,
                             unsigned* seq_d, unsigned* seq_c) {
  if (!fits(prog)) return 1;
  Args a;
  // what the routing copy's kernel leaves: the regions before kZeroed zero, the rest what an earlier
  // dispatch wrote (here a pattern no table holds: what meta_count does not write shows)
  const long long words = scratch_words(prog, a.lay);
  std::memset(scratch, 0, sizeof(long long) * a.lay[kZeroed]);
  std::memset(scratch + a.lay[kZeroed], 0x5a, sizeof(long long) * (words - a.lay[kZeroed]));
  *bad = INT_MAX;
  a.prog = prog;
  a.scratch = scratch;
  a.tokens = tokens;
  a.topk = topk;
  a.weights = weights;
  a.blob[0] = blob_d;
  a.blob[1] = blob_c;
  a.bad = bad;
  a.recv_w = recv_w;
  a.recv_idx = reinterpret_cast<int64_t*>(recv_idx);
  a.recv_count = recv_count;
  a.recv_offset = recv_offset;
  a.seq[0] = seq_d;
  a.seq[1] = seq_c;
  const int blocks = static_cast<int>(prog[H_num_ranks] * prog[H_token_blocks]);
  for (int b = 0; b < blocks; ++b) meta_count(a, b);
  const int scan = g_scan_grid > 0 ? g_scan_grid : static_cast<int>(scan_blocks(prog));  // the last one finishes
  for (int b = 0; b < scan; ++b) meta_scan(a, b, scan);
  for (int b = 0; b < prog[H_num_work] + blocks; ++b) meta_rows(a, b);  // then the received rows
  for (int b = 0; b < prog[H_num_tcopies]; ++b) meta_items(a, b);
  return 0;
}
