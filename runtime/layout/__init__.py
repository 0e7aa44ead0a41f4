"""The token-level layout of a plan (docs/runtime.md): what every rank's buffers hold and which
rows every (program, step, flow) copies, chunked, with the producer counters each chunk waits for.

`compute_layout(plan, topk_idx, weights)` is a pure function of the plan and every rank's top-k
indices (exchanged by the metadata step), so every rank computes the same layout.  It is the
token-level instance of the compiler's stream analysis (compiler/analysis/flow.py follows token
*populations* through the same steps; combine_flow.py does the same for the derived combine).
types.py holds what a layout is; builder.py its state; dispatch.py, combine.py and waits.py
compute it in that order.

Dispatch, steps in program order (exchanges move no rows):

* an entry is a token copy (home rank, token); `input` on h holds (h, 0..T-1);
* a flow (rank, src, dst, select) of a step reads the entries that EARLIER steps wrote into the
  step's source buffers on `src` (each buffer in `src_buffers` order, entries in slot order)
  whose destination ranks hit `select` (None: all of them);
* into a staging buffer it appends one entry per token on `dst`, appends ordered by (step,
  flow, source buffer, entry); into `output` it places one row per (token, expert of dst), and
  output's rows are finally expert-major: local expert, home rank, token.

Derived combine (`reverse_of` X, `reverse_source` A, `weighted`): for each flow (r, b, a) of the
combine step, the dispatch copy of X's flow (r, a, b) is run backwards for its rows that came
out of A: the partial of the row's destination slot (on b; for a weighted step the expert output
row, times the routing weight) is accumulated (fp32) into the partial of its source slot on a.
Partial buffers mirror the dispatch buffers slot for slot (`Layout.partial_of`), `result`
mirrors `input`.  Rows whose dispatch copy delivered nothing downstream carry an empty (zero)
partial and are left out, as the compiler's volume model does ("a copy that delivered nothing
returns nothing").

Written-out combine steps (no `reverse_of`; derive-combine records their `src_buffers`,
`dst_buffer` and evaluated selections in the plan): a partial buffer holds one slot per (home, token), created by the first contribution to
arrive (in step, flow, row order) and accumulated into afterwards; `select` is a set of HOME
ranks; `reduce output into B` applies the routing weights; `result` on h mirrors `input`.

Chunks.  Rows per chunk: `max(1, chunk_bytes // bytes_per_token)` tokens of the step
(`plan.bytes_per_token` in dispatch, the bf16 partial `2 * hidden` in combine).  A chunk never
splits a token: a write into output keeps a token's expert rows (a weighted combine copy the
rows reduced into one partial) in one chunk, so "rows" of the chunk size count tokens on the
wire.  Every copy has one counter (FlagInfo, on its dst rank), bumped once per chunk.

Waits.  `Copy.waits[c]` lists, for chunk c, (producer flag, value): dispatch: for every
producer copy that wrote a slot the chunk reads, 1 + the producer's chunk holding the last such
slot (producer chunks < value wrote everything the chunk reads); combine: for every producer
copy that accumulates into a slot the chunk reads, 1 + its last chunk that contributes to any
of them, so that each partial the chunk reads is final (every contribution in).  Counters are
monotone, chunk by chunk in order, so the value is minimal.  Copies that read `input` or the
expert outputs wait for nothing.

Cost: O(rows moved) NumPy work (selection masks `hits[:, S].any(1)` cached per rank set, sorts
for the expert-major order and for grouping waits) plus O(copies + chunks) Python, never a
Python loop over tokens or rows.  ubbv2_ep32 (32 ranks, 14 steps) at 2048 tokens per rank:
2.7 M row copies in 3300 copies, about 1.3 s on one core; at 64 tokens, 0.15 s.
"""

from __future__ import annotations

import numpy as np

from ...limits import MAX_LAYOUT_ROWS
from ...plan.invariants import layout_rows
from ..routing import check_topk, check_weights
from .builder import Builder, LayoutError
from .combine import lay_out_combine
from .dispatch import lay_out_dispatch
from .types import Copy, FlagInfo, Layout

__all__ = ["Copy", "FlagInfo", "Layout", "LayoutError", "compute_layout"]


def compute_layout(plan, topk_idx: np.ndarray, weights: np.ndarray | None = None,
                   tokens: np.ndarray | list[int] | None = None) -> Layout:
    """The layout of `plan` for the routing `topk_idx` [R, T, k] (expert indices, -1 = empty slot)
    and the routing weights [R, T, k] (None: weight 1 for every row).  `tokens` [R]: how many
    tokens each rank dispatches, the first tokens[h] rows of topk_idx[h] (ranks with fewer than T
    pad the rest; None: T each).  Bad inputs raise ValueError naming the argument; a plan that
    cannot be laid out raises LayoutError."""
    wl = plan.workload
    if wl is None:
        raise LayoutError("plan: carries no workload (compiled by an older epcc? recompile it)")
    topk = check_topk(topk_idx, wl.experts, plan.num_ranks, wl.topk)
    w = check_weights(weights, topk.shape) if weights is not None else None
    rows = layout_rows(plan, topk.shape[1])  # before anything is allocated per copy
    if rows > MAX_LAYOUT_ROWS:
        raise LayoutError(f"plan: its layout could hold up to {rows} rows at {topk.shape[1]} tokens per rank, "
                          f"more than this runtime lays out ({MAX_LAYOUT_ROWS}); use fewer tokens")
    counts = None
    if tokens is not None:
        counts = np.asarray(tokens)
        if counts.shape != (plan.num_ranks,) or not np.issubdtype(counts.dtype, np.integer) \
                or (counts.size and (counts.min() < 0 or counts.max() > topk.shape[1])):
            raise ValueError(f"tokens: expected {plan.num_ranks} token counts in 0..{topk.shape[1]} (one per rank), "
                             f"got {np.asarray(tokens).tolist()!r}"[:300])
        counts = counts.astype(np.int64)
    bld = Builder(plan, topk, w, counts)
    lay_out_dispatch(bld)
    lay_out_combine(bld)
    return bld.layout()
