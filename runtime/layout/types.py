"""The token-level layout of a plan: what every backend executes (docs/runtime.md).

Computed by runtime/layout from a Plan and every rank's top-k indices; consumed by the engines
(runtime/engines), the NumPy executors (runtime/testing) and the runtime API.  Plain NumPy
arrays: no MLIR, no torch.

Slots are row indices into a buffer of one rank.  Staging buffers hold token copies, one row of
`row_bytes` each; `output` holds one row per (token, local expert), expert-major (token-major
with the workload's `layout token`: one row per (token, destination rank)); combine's
partial buffers mirror the dispatch buffers slot for slot (fp32 partial sums of `hidden`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Copy:
    """Rows one flow of one step moves: `dst_slots[i]` on (dst, dst_buffer) <- `src_slots[i]` on
    (src, src_buffer[i]).  Dispatch copies are plain row copies; combine copies accumulate
    (`+=`, fp32), the weighted ones multiplying by `weights[i]` first."""

    program: str  # dispatch | combine
    step: str
    step_index: int  # position of the step in its program
    flow_index: int  # position of the flow in PlanStep.flows
    rank: int  # executing rank (whose thread runs it)
    src: int
    dst: int
    src_buffers: list[str]  # per row: which of the step's source buffers it reads
    src_slots: np.ndarray  # int64 [n]
    dst_buffer: str
    dst_slots: np.ndarray  # int64 [n]
    weights: np.ndarray | None = None  # float32 [n], weighted combine copies only
    # Chunking: rows [chunk_starts[c], chunk_starts[c+1]) form chunk c of this copy.
    chunk_starts: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    # Producer chunks each chunk needs first: waits[c] = [(flag_id, value), ...] (the counter
    # `flag_id` on rank `dst`... see Layout.flags) that must have reached `value`.
    waits: list[list[tuple[int, int]]] = field(default_factory=list)
    flag_id: int = -1  # the counter this copy bumps by 1 after each of its chunks
    # Added by runtime/layout: src_buffers as indices into PlanStep.src_buffers (int64 [n]),
    # for backends that want the per-row source buffer without comparing strings.
    src_buffer_ids: np.ndarray | None = None


@dataclass
class FlagInfo:
    """One completion counter: bumped once per chunk by one Copy; lives in the memory of rank
    `rank` (the rank whose buffer the copy writes)."""

    flag_id: int
    rank: int
    program: str
    step: str
    flow_index: int
    chunks: int  # the value it reaches when its copy is done

    def name(self) -> str:
        return f"{self.program}.{self.step}[flow {self.flow_index}].ready"


@dataclass
class Layout:
    num_ranks: int
    tokens: int
    topk: int
    experts: int
    hidden: int
    row_bytes: int  # dispatch wire row: the payload (bf16: 2*hidden; fp8: hidden + hidden/128*4)
    # entries[(buffer, rank)]: int64 [n, 2] (home, token) for staging buffers and input;
    # for output: int64 [n, 3] (home, token, global expert), expert-major.
    entries: dict[tuple[str, int], np.ndarray]
    copies: list[Copy]  # dispatch copies then combine copies, each program in step order
    flags: list[FlagInfo]
    # Per rank: rows of output per local expert (the expert-major segment lengths).
    recv_counts: np.ndarray  # int64 [R, E/R]
    rank_names: list[str]
    # Added by runtime/layout (optional, defaults empty):
    # combine_entries[(buffer, rank)]: int64 [n, 2] (home, token) of every slot of combine's
    # buffers (`result` mirrors input; a derived combine's partial buffers mirror the dispatch
    # buffers slot for slot, a written combine's hold one slot per (home, token) they receive).
    # Combine's `output` is dispatch's (entries[("output", r)]).  Size combine buffers by these.
    combine_entries: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)
    # Derived combine: combine buffer -> the dispatch buffer it mirrors ("result" -> "input").
    partial_of: dict[str, str] = field(default_factory=dict)
    # Per rank: the routing weight of each row of `output` (float32 [n], expert-major order;
    # 1.0 when compute_layout got no weights): DeepEP's recv_topk_weights, row by row.
    output_weights: list[np.ndarray] = field(default_factory=list)
    # Tokens each rank dispatched (int64 [R], each at most `tokens`, which is the padded width of
    # the routing): `input` on h holds (h, 0..tokens_per_rank[h]-1).  None: every rank `tokens`.
    tokens_per_rank: np.ndarray | None = None
    # Token-major output (workload `layout token`): `output` holds one row per (token, destination
    # rank) in (home rank, token) order, entries[("output", r)] are int64 [n, 2] (home, token),
    # output_weights are 1.0 (combine sums a token's rows unweighted, as DeepEP's does), and
    # recv_topk_idx[r] / recv_topk_weights[r] ([n, k]) give each row's top-k: the local expert id
    # where the expert is on r, else -1, and its weight, else 0.
    token_major: bool = False
    recv_topk_idx: list[np.ndarray] = field(default_factory=list)
    recv_topk_weights: list[np.ndarray] = field(default_factory=list)

    def rank_tokens(self, rank: int) -> int:
        """Tokens rank `rank` dispatched (rows of its `input`, and of its combined result)."""
        return int(self.tokens if self.tokens_per_rank is None else self.tokens_per_rank[rank])

    @staticmethod
    def canonical(program: str, name: str) -> str:
        """In combine, `input` and `result` are one buffer: the partials of `input` are the result."""
        return "result" if program == "combine" and name == "input" else name

    def spec(self, program: str, name: str, rank: int) -> tuple[np.dtype, tuple[int, int]]:
        """dtype and shape of buffer `name` of `program` on `rank`: dispatch buffers are uint8
        rows of `row_bytes`; combine's `output` holds the bf16 expert outputs (uint16); every other
        combine buffer holds fp32 partial sums of `hidden`."""
        name = self.canonical(program, name)
        if program == "dispatch":
            return np.dtype(np.uint8), (self.buffer_rows(name, rank), self.row_bytes)
        if name == "output":
            return np.dtype(np.uint16), (self.buffer_rows("output", rank), self.hidden)
        if name == "result":
            return np.dtype(np.float32), (self.tokens, self.hidden)
        if self.combine_entries:
            return np.dtype(np.float32), (self.combine_rows(name, rank), self.hidden)
        # A layout without them: a partial buffer mirrors its dispatch buffer slot for slot.
        return np.dtype(np.float32), (self.buffer_rows(self.partial_of.get(name, name), rank), self.hidden)

    def combine_rows(self, buffer: str, rank: int) -> int:
        """Rows of a combine buffer on `rank` (`output`: the expert-output rows)."""
        if buffer == "output":
            return self.buffer_rows("output", rank)
        e = self.combine_entries.get((buffer, rank))
        return 0 if e is None else int(e.shape[0])

    def buffer_rows(self, buffer: str, rank: int) -> int:
        e = self.entries.get((buffer, rank))
        return 0 if e is None else int(e.shape[0])

    def program_copies(self, program: str) -> list[Copy]:
        return [c for c in self.copies if c.program == program]
