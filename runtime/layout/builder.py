"""The layout's shared state and helpers: the routing as masks, the copies with their token
ordinals, chunking by tokens, the buffers' entries (runtime/layout/__init__.py says what a layout is)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ...plan import chunk_sizes
from ..routing import expert_rank
from .types import Copy, FlagInfo, Layout


class LayoutError(ValueError):
    """The plan cannot be laid out (a malformed or inconsistent plan)."""


EMPTY = np.zeros(0, dtype=np.int64)


def tokens_per_chunk(chunk_bytes: float | None, bytes_per_token: int) -> int | None:
    if not chunk_bytes or bytes_per_token <= 0:
        return None
    return max(1, int(chunk_bytes // bytes_per_token))


def ordinals(key: np.ndarray) -> np.ndarray:
    """0, 0, 1, 1, 1, 2, ...: a new ordinal wherever `key` changes (rows grouped by key)."""
    if key.size == 0:
        return EMPTY
    ch = np.empty(key.size, dtype=bool)
    ch[0] = True
    np.not_equal(key[1:], key[:-1], out=ch[1:])
    return np.cumsum(ch) - 1


def chunk_bounds(tok: np.ndarray, tpc: int | None, st=None) -> np.ndarray:
    """Row offsets of the chunks of a copy whose rows belong to tokens `tok` (non-decreasing
    ordinals 0..m-1): chunk c holds the rows of tokens c*tpc .. (c+1)*tpc-1, or, where the
    step `st` ramps its ends (PlanStep.ramp_head / ramp_tail), the tokens plan.chunk_sizes gives."""
    n = tok.size
    if n == 0:
        return np.zeros(1, dtype=np.int64)
    if tpc is None:
        return np.array([0, n], dtype=np.int64)
    head, tail = (st.ramp_head, st.ramp_tail) if st is not None else (0, 0)
    if head or tail:
        bounds = np.cumsum([0] + chunk_sizes(int(tok[-1]) + 1, tpc, head, tail))
        starts = np.searchsorted(tok, bounds[:-1], side="left")
        return np.append(starts, n).astype(np.int64)
    cid = tok // tpc
    nch = int(cid[-1]) + 1
    starts = np.searchsorted(cid, np.arange(nch), side="left")
    return np.append(starts, n).astype(np.int64)


def chunk_of_rows(starts: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(starts.size - 1, dtype=np.int64), np.diff(starts))


class Store:
    """Entries of the buffers of one program, one list of segments per (buffer, rank)."""

    def __init__(self):
        self.segs: dict[tuple[str, int], list[np.ndarray]] = defaultdict(list)
        self.size: dict[tuple[str, int], int] = defaultdict(int)
        self._cat: dict[tuple[str, int], np.ndarray] = {}

    def gids(self, key: tuple[str, int]) -> np.ndarray:
        g = self._cat.get(key)
        if g is None:
            segs = self.segs.get(key)
            g = np.concatenate(segs) if segs else EMPTY
            self._cat[key] = g
        return g

    def append(self, key: tuple[str, int], gids: np.ndarray) -> None:
        if gids.size:
            self.segs[key].append(gids)
            self.size[key] += int(gids.size)
            self._cat.pop(key, None)


class Builder:
    """The state of one layout computation: the routing, the copies so far, the buffers' entries."""

    def __init__(self, plan, topk: np.ndarray, weights: np.ndarray | None, tokens: np.ndarray | None = None):
        wl = plan.workload
        self.plan = plan
        self.wl = wl
        self.R = R = plan.num_ranks
        self.topk = topk
        self.T = T = topk.shape[1]
        self.k = k = topk.shape[2]
        self.N = R * T
        # tokens of each rank: the first tokens[h] rows of topk[h] (the rest pad a shorter rank)
        self.tokens = np.full(R, T, dtype=np.int64) if tokens is None else tokens
        self.weights = weights
        self.rank_of, self.local_of = expert_rank(wl.experts, R, wl.placement)
        self.epr = wl.experts // R
        self.flat = topk.reshape(self.N, k)
        valid = self.flat >= 0
        self.dest = np.where(valid, self.rank_of[np.maximum(self.flat, 0)], -1)
        self.hits = np.zeros((self.N, R), dtype=bool)
        rr, jj = np.nonzero(valid)
        self.hits[rr, self.dest[rr, jj]] = True
        self._sel: dict[tuple[int, ...], np.ndarray] = {}
        self.copies: list[Copy] = []
        self.tok: list[np.ndarray] = []  # per copy: token ordinal of each row
        self.src_ids: list[np.ndarray] = []  # per copy: index into the step's src_buffers
        self.entries: dict[tuple[str, int], np.ndarray] = {}
        self.combine_entries: dict[tuple[str, int], np.ndarray] = {}
        self.partial_of: dict[str, str] = {}
        self.out_weight: list[np.ndarray] = []  # per rank: routing weight of each output row
        # set by dispatch.py: which copies write each staging (buffer, rank), the staging buffers'
        # entries, rows per local expert, how many of the copies are dispatch's
        self.writers: dict[tuple[str, int], list[int]] = defaultdict(list)
        self.store = Store()
        self.recv_counts = np.zeros((R, self.epr), dtype=np.int64)
        self.n_dispatch = 0
        self.token_major = getattr(wl, "layout", "expert") == "token"
        # token-major output only: per rank, each row's top-k as DeepEP returns it (local expert
        # ids on the rank, -1 elsewhere; the weights of those slots, 0 elsewhere)
        self.recv_topk_idx: list[np.ndarray] = []
        self.recv_topk_weights: list[np.ndarray] = []

    # ------------------------------------------------------------------ selections
    def hit_mask(self, sel: tuple[int, ...]) -> np.ndarray:
        """[N] bool: the token's destination ranks hit `sel`."""
        key = tuple(sorted(set(sel)))
        m = self._sel.get(key)
        if m is None:
            bad = [r for r in key if not 0 <= r < self.R]
            if bad:
                raise LayoutError(f"plan: a selection names rank {bad[0]}, outside 0..{self.R - 1}")
            m = self.hits[:, list(key)].any(axis=1) if key else np.zeros(self.N, dtype=bool)
            self._sel[key] = m
        return m

    def home_mask(self, sel: tuple[int, ...]) -> np.ndarray:
        """[R] bool: the home ranks in `sel` (combine selections select by home)."""
        m = np.zeros(self.R, dtype=bool)
        idx = [r for r in sel if 0 <= r < self.R]
        m[idx] = True
        return m

    def check_flow(self, program: str, step, f) -> None:
        for what, r in (("rank", f.rank), ("src", f.src), ("dst", f.dst)):
            if not 0 <= r < self.R:
                raise LayoutError(f"plan: {program} step '{step.name}' has a flow whose {what} rank {r} is "
                                  f"outside 0..{self.R - 1}")

    def add_copy(self, c: Copy, tok: np.ndarray, src_ids: np.ndarray) -> int:
        c.flag_id = len(self.copies)
        c.src_buffer_ids = src_ids
        self.copies.append(c)
        self.tok.append(tok)
        self.src_ids.append(src_ids)
        return c.flag_id

    # ------------------------------------------------------------------ result
    def layout(self) -> Layout:
        flags = [FlagInfo(c.flag_id, c.dst, c.program, c.step, c.flow_index, int(c.chunk_starts.size - 1))
                 for c in self.copies]
        wl = self.wl
        row_bytes = 2 * wl.hidden if wl.dtype == "bf16" else wl.hidden + (wl.hidden // 128) * 4
        names = list(self.plan.rank_names) or [f"rank {r}" for r in range(self.R)]
        return Layout(num_ranks=self.R, tokens=self.T, topk=self.k, experts=wl.experts, hidden=wl.hidden,
                      row_bytes=row_bytes, entries=self.entries, copies=self.copies, flags=flags,
                      recv_counts=self.recv_counts, rank_names=names, combine_entries=self.combine_entries,
                      partial_of=self.partial_of, output_weights=self.out_weight,
                      tokens_per_rank=self.tokens.copy(), token_major=self.token_major,
                      recv_topk_idx=self.recv_topk_idx, recv_topk_weights=self.recv_topk_weights)
