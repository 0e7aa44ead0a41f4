"""The token-level layout of a plan (docs/runtime.md): what every rank's buffers hold and which
rows every (program, step, flow) copies, chunked, with the producer counters each chunk waits for.

`compute_layout(plan, topk_idx, weights)` is a pure function of the plan and every rank's top-k
indices (exchanged by the metadata step), so every rank computes the same layout.  It is the
token-level instance of the compiler's stream analysis (compiler/analysis/flow.py follows token
*populations* through the same steps; combine_flow.py does the same for the derived combine).

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

from collections import defaultdict

import numpy as np

from ..plan import chunk_sizes
from .layout_types import Copy, FlagInfo, Layout
from .oracle import check_topk, check_weights, expert_rank

__all__ = ["compute_layout", "LayoutError"]


class LayoutError(ValueError):
    """The plan cannot be laid out (a malformed or inconsistent plan)."""


_EMPTY = np.zeros(0, dtype=np.int64)


def _tokens_per_chunk(chunk_bytes: float | None, bytes_per_token: int) -> int | None:
    if not chunk_bytes or bytes_per_token <= 0:
        return None
    return max(1, int(chunk_bytes // bytes_per_token))


def _ordinals(key: np.ndarray) -> np.ndarray:
    """0, 0, 1, 1, 1, 2, ...: a new ordinal wherever `key` changes (rows grouped by key)."""
    if key.size == 0:
        return _EMPTY
    ch = np.empty(key.size, dtype=bool)
    ch[0] = True
    np.not_equal(key[1:], key[:-1], out=ch[1:])
    return np.cumsum(ch) - 1


def _chunk_starts(tok: np.ndarray, tpc: int | None, st=None) -> np.ndarray:
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


def _chunk_of_rows(starts: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(starts.size - 1, dtype=np.int64), np.diff(starts))


class _Store:
    """Entries of the buffers of one program, one list of segments per (buffer, rank)."""

    def __init__(self):
        self.segs: dict[tuple[str, int], list[np.ndarray]] = defaultdict(list)
        self.size: dict[tuple[str, int], int] = defaultdict(int)
        self._cat: dict[tuple[str, int], np.ndarray] = {}

    def gids(self, key: tuple[str, int]) -> np.ndarray:
        g = self._cat.get(key)
        if g is None:
            segs = self.segs.get(key)
            g = np.concatenate(segs) if segs else _EMPTY
            self._cat[key] = g
        return g

    def append(self, key: tuple[str, int], gids: np.ndarray) -> None:
        if gids.size:
            self.segs[key].append(gids)
            self.size[key] += int(gids.size)
            self._cat.pop(key, None)


class _Builder:
    def __init__(self, plan, topk: np.ndarray, weights: np.ndarray | None):
        wl = plan.workload
        self.plan = plan
        self.wl = wl
        self.R = R = plan.num_ranks
        self.topk = topk
        self.T = T = topk.shape[1]
        self.k = k = topk.shape[2]
        self.N = R * T
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

    def _check_flow(self, program: str, step, f) -> None:
        for what, r in (("rank", f.rank), ("src", f.src), ("dst", f.dst)):
            if not 0 <= r < self.R:
                raise LayoutError(f"plan: {program} step '{step.name}' has a flow whose {what} rank {r} is "
                                  f"outside 0..{self.R - 1}")

    def _add_copy(self, c: Copy, tok: np.ndarray, src_ids: np.ndarray) -> int:
        c.flag_id = len(self.copies)
        c.src_buffer_ids = src_ids
        self.copies.append(c)
        self.tok.append(tok)
        self.src_ids.append(src_ids)
        return c.flag_id

    # ------------------------------------------------------------------ dispatch
    def dispatch(self) -> None:
        plan, T, R = self.plan, self.T, self.R
        store = _Store()
        for h in range(R):
            store.append(("input", h), np.arange(h * T, (h + 1) * T, dtype=np.int64))
        # output rows, per receiving rank: (copy id, gid, expert, slot j), in copy row order
        out_parts: list[list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in range(R)]
        self.writers: dict[tuple[str, int], list[int]] = defaultdict(list)
        steps = plan.program_steps("dispatch")
        bpt = plan.bytes_per_token
        for si, st in enumerate(steps):
            if st.verb == "exchange":
                continue
            if not st.src_buffers or st.dst_buffer is None:
                raise LayoutError(f"plan: dispatch step '{st.name}' names no source or destination buffer "
                                  f"(a plan from an older epcc? recompile it)")
            if st.dst_buffer == "input" or st.dst_buffer in st.src_buffers:
                raise LayoutError(f"plan: dispatch step '{st.name}' writes '{st.dst_buffer}', which it reads "
                                  f"or which is read-only")
            into_output = st.dst_buffer == "output"
            tpc = _tokens_per_chunk(st.chunk_bytes, bpt)
            pending: dict[tuple[str, int], list[np.ndarray]] = defaultdict(list)
            pending_n: dict[tuple[str, int], int] = defaultdict(int)
            for fi, f in enumerate(st.flows):
                self._check_flow("dispatch", st, f)
                slots, ids, gids = [], [], []
                for bi, b in enumerate(st.src_buffers):
                    if b == "output":
                        raise LayoutError(f"plan: dispatch step '{st.name}' reads 'output'")
                    g = store.gids((b, f.src))
                    idx = np.arange(g.size, dtype=np.int64) if f.select is None else \
                        np.flatnonzero(self.hit_mask(f.select)[g])
                    slots.append(idx)
                    ids.append(np.full(idx.size, bi, dtype=np.int64))
                    gids.append(g[idx])
                slots_a = np.concatenate(slots) if slots else _EMPTY
                ids_a = np.concatenate(ids) if ids else _EMPTY
                gid_a = np.concatenate(gids) if gids else _EMPTY
                c = Copy("dispatch", st.name, si, fi, f.rank, f.src, f.dst, [], _EMPTY, st.dst_buffer, _EMPTY)
                if into_output:
                    i, j = np.nonzero(self.dest[gid_a] == f.dst)
                    e = self.flat[gid_a[i], j]
                    o = np.lexsort((self.local_of[e], i))
                    i, j, e = i[o], j[o], e[o]
                    tok = _ordinals(i)
                    c.src_slots = slots_a[i]
                    rid = ids_a[i]
                    cid = self._add_copy(c, tok, rid)
                    out_parts[f.dst].append((cid, gid_a[i], e, j))
                else:
                    key = (st.dst_buffer, f.dst)
                    start = store.size[key] + pending_n[key]
                    c.src_slots = slots_a
                    c.dst_slots = start + np.arange(slots_a.size, dtype=np.int64)
                    rid = ids_a
                    tok = np.arange(slots_a.size, dtype=np.int64)
                    cid = self._add_copy(c, tok, rid)
                    pending[key].append(gid_a)
                    pending_n[key] += int(gid_a.size)
                    self.writers[key].append(cid)
                names = list(st.src_buffers)
                c.src_buffers = [names[x] for x in rid.tolist()] if len(names) > 1 else names * int(rid.size)
                c.chunk_starts = _chunk_starts(tok, tpc, st)
            for key, parts in pending.items():
                for g in parts:
                    store.append(key, g)
        # output: expert-major order, and the copies' destination rows in it
        self.recv_counts = np.zeros((R, self.epr), dtype=np.int64)
        w = self.weights
        for d in range(R):
            parts = out_parts[d]
            if parts:
                gid = np.concatenate([p[1] for p in parts])
                e = np.concatenate([p[2] for p in parts])
                j = np.concatenate([p[3] for p in parts])
            else:
                gid = e = j = _EMPTY
            h, t = gid // T, gid % T
            loc = self.local_of[e]
            order = np.lexsort((t, h, loc))
            pos = np.empty(order.size, dtype=np.int64)
            pos[order] = np.arange(order.size, dtype=np.int64)
            off = 0
            for cid, g, _, _ in parts:
                self.copies[cid].dst_slots = pos[off:off + g.size]
                off += g.size
            self.entries[("output", d)] = np.stack([h, t, e], axis=1)[order].reshape(-1, 3)
            self.recv_counts[d] = np.bincount(loc, minlength=self.epr)
            ow = w[h, t, j] if w is not None else np.ones(gid.size, dtype=np.float32)
            self.out_weight.append(np.asarray(ow, dtype=np.float32)[order])
        self.store = store
        for st in steps:  # every staging buffer on every rank, even if nothing reaches it
            for b in (*st.src_buffers, st.dst_buffer):
                if b not in (None, "output", "input"):
                    for r in range(R):
                        store.size[(b, r)] += 0
        for (b, r), _ in list(store.size.items()):
            g = store.gids((b, r))
            self.entries[(b, r)] = np.stack([g // T, g % T], axis=1)
        for h in range(R):
            self.entries.setdefault(("input", h), np.stack([np.full(T, h), np.arange(T)], axis=1).astype(np.int64))
        self.n_dispatch = len(self.copies)
        self._dispatch_waits()

    def _dispatch_waits(self) -> None:
        # Per staging (buffer, rank): the copy and chunk that wrote each slot.
        prod: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        for key, cids in self.writers.items():
            size = self.store.size[key]
            p = np.full(size, -1, dtype=np.int64)
            ch = np.full(size, -1, dtype=np.int64)
            for cid in cids:
                c = self.copies[cid]
                p[c.dst_slots] = cid
                ch[c.dst_slots] = _chunk_of_rows(c.chunk_starts)
            prod[key] = (p, ch)
        steps = self.plan.program_steps("dispatch")
        for cid in range(self.n_dispatch):
            c = self.copies[cid]
            names = steps[c.step_index].src_buffers
            pid = np.full(c.src_slots.size, -1, dtype=np.int64)
            pch = np.full(c.src_slots.size, -1, dtype=np.int64)
            for bi, b in enumerate(names):
                pr = prod.get((b, c.src))
                if pr is None:
                    continue
                m = self.src_ids[cid] == bi
                s = c.src_slots[m]
                pid[m] = pr[0][s]
                pch[m] = pr[1][s]
            c.waits = _group_waits(_chunk_of_rows(c.chunk_starts), pid, pch, c.chunk_starts.size - 1)

    # ------------------------------------------------------------------ combine
    def combine(self) -> None:
        steps = self.plan.program_steps("combine")
        data = [s for s in steps if s.verb != "exchange"]
        if not data:
            self._combine_buffers_derived()
            return
        derived = [s.reverse_of is not None for s in data]
        if all(derived):
            self._derived(steps)
        elif not any(derived):
            self._written(steps)
        else:
            raise LayoutError("plan: the combine program mixes derived steps (reverse_of) and written-out ones")

    def _combine_buffers_derived(self) -> None:
        for (b, r), e in self.entries.items():
            if b == "input":
                self.combine_entries[("result", r)] = e
        self.partial_of.setdefault("result", "input")

    def _derived(self, steps) -> None:
        plan, R = self.plan, self.R
        dsteps = {s.name: s for s in plan.program_steps("dispatch")}
        # Live slots: those whose copy delivered something downstream (their partial is non-empty).
        live: dict[tuple[str, int], np.ndarray] = {}

        def live_of(b: str, r: int) -> np.ndarray:
            a = live.get((b, r))
            if a is None:
                n = self.entries[(b, r)].shape[0] if (b, r) in self.entries else 0
                a = live[(b, r)] = np.full(n, b == "output", dtype=bool)
            return a

        for cid in range(self.n_dispatch - 1, -1, -1):
            c = self.copies[cid]
            ld = live_of(c.dst_buffer, c.dst)[c.dst_slots]
            names = dsteps[c.step].src_buffers
            for bi, b in enumerate(names):
                m = (self.src_ids[cid] == bi) & ld
                if m.any():
                    live_of(b, c.src)[c.src_slots[m]] = True
        by_step: dict[str, list[int]] = defaultdict(list)
        for cid in range(self.n_dispatch):
            by_step[self.copies[cid].step].append(cid)
        hidden = self.wl.hidden
        cbpt = 2 * hidden
        self.partial_of["result"] = "input"
        self.partial_of["output"] = "output"
        for ci, cs in enumerate(steps):
            if cs.verb == "exchange":
                continue
            x = dsteps.get(cs.reverse_of)
            if x is None:
                raise LayoutError(f"plan: combine step '{cs.name}' reverses dispatch step '{cs.reverse_of}', "
                                  f"which the plan does not have")
            a = cs.reverse_source
            if a not in x.src_buffers:
                raise LayoutError(f"plan: combine step '{cs.name}' returns partials into '{a}', which dispatch step "
                                  f"'{x.name}' does not read")
            if cs.dst_buffer is None or len(cs.src_buffers) != 1:
                raise LayoutError(f"plan: combine step '{cs.name}' should read one buffer and write one")
            ai = x.src_buffers.index(a)
            src_buf = cs.src_buffers[0]
            if cs.weighted != (x.dst_buffer == "output"):
                raise LayoutError(f"plan: combine step '{cs.name}' is {'' if cs.weighted else 'not '}weighted but "
                                  f"dispatch step '{x.name}' writes '{x.dst_buffer}'")
            for cb, db in ((cs.dst_buffer, a), (src_buf, x.dst_buffer)):
                if self.partial_of.setdefault(cb, db) != db:
                    raise LayoutError(f"plan: combine buffer '{cb}' mirrors both '{self.partial_of[cb]}' and '{db}'")
            pool: dict[tuple[int, int, int], list[int]] = defaultdict(list)
            for cid in by_step[x.name]:
                d = self.copies[cid]
                pool[(d.rank, d.src, d.dst)].append(cid)
            tpc = _tokens_per_chunk(cs.chunk_bytes, cbpt)
            for fi, f in enumerate(cs.flows):
                self._check_flow("combine", cs, f)
                # The dispatch flow (rank, a, b) this one reverses; none (a hand-edited plan):
                # dispatch moved nothing there, so there is nothing to return.
                dids = pool.pop((f.rank, f.dst, f.src), [])
                src_slots, dst_slots, toks, wts = [], [], [], []
                base = 0
                for did in dids:
                    d = self.copies[did]
                    m = self.src_ids[did] == ai
                    if not cs.weighted:
                        m &= live_of(x.dst_buffer, d.dst)[d.dst_slots]
                    src_slots.append(d.dst_slots[m])
                    dst_slots.append(d.src_slots[m])
                    tk = self.tok[did][m]
                    toks.append(tk + base)
                    base += int(tk[-1]) + 1 if tk.size else 0
                    if cs.weighted:
                        wts.append(self.out_weight[d.dst][d.dst_slots[m]])
                ss = np.concatenate(src_slots) if src_slots else _EMPTY
                tok = _ordinals(np.concatenate(toks)) if toks else _EMPTY
                c = Copy("combine", cs.name, ci, fi, f.rank, f.src, f.dst, [src_buf] * int(ss.size), ss,
                         cs.dst_buffer, np.concatenate(dst_slots) if dst_slots else _EMPTY,
                         weights=(np.concatenate(wts).astype(np.float32) if wts else np.zeros(0, np.float32))
                         if cs.weighted else None)
                c.chunk_starts = _chunk_starts(tok, tpc, cs)
                self._add_copy(c, tok, np.zeros(ss.size, dtype=np.int64))
        for cb, db in self.partial_of.items():
            if cb == "output":
                continue
            for r in range(R):
                e = self.entries.get((db, r))
                if e is not None:
                    self.combine_entries[(cb, r)] = e
        self._combine_waits()

    def _written(self, steps) -> None:
        R, T, N = self.R, self.T, self.N
        cbpt = 2 * self.wl.hidden
        # Partial buffers: one slot per (home, token), created by its first contribution.
        slot_of: dict[tuple[str, int], np.ndarray] = {}
        store = _Store()

        def slots_in(b: str, r: int) -> np.ndarray:
            a = slot_of.get((b, r))
            if a is None:
                a = slot_of[(b, r)] = np.full(N, -1, dtype=np.int64)
            return a

        for ci, cs in enumerate(steps):
            if cs.verb == "exchange":
                continue
            if not cs.src_buffers or cs.dst_buffer is None:
                raise LayoutError(f"plan: written combine step '{cs.name}' carries no buffers "
                                  f"(the plan comes from an older epcc? recompile the schedule)")
            dst_buf = cs.dst_buffer
            if dst_buf == "output":
                raise LayoutError(f"plan: combine step '{cs.name}' writes 'output' (the expert outputs are read-only)")
            tpc = _tokens_per_chunk(cs.chunk_bytes, cbpt)
            committed = {key: store.size[key] for key in list(store.size)}
            for fi, f in enumerate(cs.flows):
                self._check_flow("combine", cs, f)
                homes = None if f.select is None else self.home_mask(f.select)
                gids, ss, ids, ws = [], [], [], []
                weighted = False
                for bi, b in enumerate(cs.src_buffers):
                    if b == "output":
                        if cs.verb != "reduce":
                            raise LayoutError(f"plan: combine step '{cs.name}' moves unweighted expert rows out of "
                                              f"'output'; the layout supports written combines that reduce "
                                              f"(weight) the expert outputs first")
                        ent = self.entries[("output", f.src)]
                        g = ent[:, 0] * T + ent[:, 1]
                        idx = np.arange(g.size, dtype=np.int64) if homes is None else np.flatnonzero(homes[ent[:, 0]])
                        ws.append(self.out_weight[f.src][idx])
                        weighted = True
                    elif b == "result":
                        raise LayoutError(f"plan: combine step '{cs.name}' reads 'result'")
                    else:
                        g = store.gids((b, f.src))[: committed.get((b, f.src), 0)]
                        idx = np.arange(g.size, dtype=np.int64) if homes is None else \
                            np.flatnonzero(homes[g // T])
                        ws.append(np.ones(idx.size, np.float32))  # partials are weighted already
                    gids.append(g[idx])
                    ss.append(idx)
                    ids.append(np.full(idx.size, bi, dtype=np.int64))
                g = np.concatenate(gids) if gids else _EMPTY
                src_slots = np.concatenate(ss) if ss else _EMPTY
                rid = np.concatenate(ids) if ids else _EMPTY
                wv = np.concatenate(ws).astype(np.float32) if weighted else None
                if dst_buf == "result":
                    bad = np.flatnonzero(g // T != f.dst)
                    if bad.size:
                        h = int(g[bad[0]] // T)
                        raise LayoutError(f"plan: combine step '{cs.name}' flow {fi} adds a partial of a token of rank "
                                          f"{h} into 'result' of rank {f.dst}")
                    dst_slots = g % T
                else:
                    sl = slots_in(dst_buf, f.dst)
                    new = g[sl[g] < 0]
                    if new.size:
                        _, first = np.unique(new, return_index=True)
                        new = new[np.sort(first)]
                        key = (dst_buf, f.dst)
                        sl[new] = store.size[key] + np.arange(new.size, dtype=np.int64)
                        store.append(key, new)
                    dst_slots = sl[g]
                # one chunk = tpc partials: rows grouped by destination slot
                o = np.argsort(dst_slots, kind="stable") if weighted else np.arange(dst_slots.size)
                src_slots, dst_slots, rid = src_slots[o], dst_slots[o], rid[o]
                if wv is not None:
                    wv = wv[o]
                tok = _ordinals(dst_slots)
                names = list(cs.src_buffers)
                c = Copy("combine", cs.name, ci, fi, f.rank, f.src, f.dst, [names[x] for x in rid.tolist()],
                         src_slots, dst_buf, dst_slots, weights=wv)
                c.chunk_starts = _chunk_starts(tok, tpc, cs)
                self._add_copy(c, tok, rid)
        for (b, r), _ in list(store.size.items()):
            g = store.gids((b, r))
            self.combine_entries[(b, r)] = np.stack([g // T, g % T], axis=1)
        for cs in steps:  # every partial buffer on every rank, even if nothing reaches it
            for b in (*cs.src_buffers, cs.dst_buffer):
                if b not in (None, "output", "result"):
                    for r in range(R):
                        self.combine_entries.setdefault((b, r), np.zeros((0, 2), dtype=np.int64))
        for h in range(R):
            self.combine_entries[("result", h)] = self.entries[("input", h)]
        self._combine_waits()

    def _combine_waits(self) -> None:
        """Each chunk waits until every contribution to the partials it reads is in."""
        steps = self.plan.program_steps("combine")
        # contributions per (buffer, rank): (slot, copy, chunk, step index)
        contrib: dict[tuple[str, int], list[tuple[np.ndarray, int, np.ndarray, int]]] = defaultdict(list)
        for cid in range(self.n_dispatch, len(self.copies)):
            c = self.copies[cid]
            contrib[(c.dst_buffer, c.dst)].append((c.dst_slots, cid, _chunk_of_rows(c.chunk_starts), c.step_index))
        index: dict[tuple[str, int], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        for key, parts in contrib.items():
            slot = np.concatenate([p[0] for p in parts])
            pid = np.concatenate([np.full(p[0].size, p[1], dtype=np.int64) for p in parts])
            pch = np.concatenate([p[2] for p in parts])
            pst = np.concatenate([np.full(p[0].size, p[3], dtype=np.int64) for p in parts])
            o = np.argsort(slot, kind="stable")
            index[key] = (slot[o], pid[o], pch[o], pst[o])
        for cid in range(self.n_dispatch, len(self.copies)):
            c = self.copies[cid]
            nch = c.chunk_starts.size - 1
            crow = _chunk_of_rows(c.chunk_starts)
            names = list(steps[c.step_index].src_buffers)
            rows_c, rows_p, rows_ch = [], [], []
            for bi, b in enumerate(names):
                ix = index.get((b, c.src))
                if ix is None:
                    continue
                slot, pid, pch, pst = ix
                m = self.src_ids[cid] == bi
                s = c.src_slots[m]
                lo = np.searchsorted(slot, s, side="left")
                hi = np.searchsorted(slot, s, side="right")
                cnt = hi - lo
                tot = int(cnt.sum())
                if tot == 0:
                    continue
                rep = np.repeat(np.arange(s.size), cnt)
                rec = lo[rep] + (np.arange(tot) - np.repeat(np.cumsum(cnt) - cnt, cnt))
                keep = pst[rec] < c.step_index  # a step reads what earlier steps wrote
                rows_c.append(crow[m][rep][keep])
                rows_p.append(pid[rec][keep])
                rows_ch.append(pch[rec][keep])
            if rows_c:
                c.waits = _group_waits(np.concatenate(rows_c), np.concatenate(rows_p), np.concatenate(rows_ch), nch)
            else:
                c.waits = [[] for _ in range(nch)]

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
                      partial_of=self.partial_of, output_weights=self.out_weight)


def _group_waits(crow: np.ndarray, pid: np.ndarray, pch: np.ndarray, nch: int) -> list[list[tuple[int, int]]]:
    """waits[c] = [(producer, 1 + its last chunk any row of chunk c needs)], producers ascending.
    Rows with pid < 0 (read from a buffer nobody writes in this program) need nothing."""
    waits: list[list[tuple[int, int]]] = [[] for _ in range(nch)]
    m = pid >= 0
    if not m.any():
        return waits
    crow, pid, pch = crow[m], pid[m], pch[m]
    o = np.lexsort((pch, pid, crow))
    crow, pid, pch = crow[o], pid[o], pch[o]
    last = np.ones(crow.size, dtype=bool)
    last[:-1] = (crow[1:] != crow[:-1]) | (pid[1:] != pid[:-1])
    for c, p, v in zip(crow[last].tolist(), pid[last].tolist(), (pch[last] + 1).tolist()):
        waits[c].append((p, v))
    return waits


def compute_layout(plan, topk_idx: np.ndarray, weights: np.ndarray | None = None) -> Layout:
    """The layout of `plan` for the routing `topk_idx` [R, T, k] (expert indices, -1 = empty slot)
    and the routing weights [R, T, k] (None: weight 1 for every row).  Bad inputs raise
    ValueError naming the argument; a plan that cannot be laid out raises LayoutError."""
    wl = plan.workload
    if wl is None:
        raise LayoutError("plan: carries no workload (compiled by an older epcc? recompile it)")
    topk = check_topk(topk_idx, wl.experts, plan.num_ranks, wl.topk)
    w = check_weights(weights, topk.shape) if weights is not None else None
    b = _Builder(plan, topk, w)
    b.dispatch()
    b.combine()
    return b.layout()
