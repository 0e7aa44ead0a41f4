"""The metadata kernels of the table-driven CUDA target, emulated in NumPy: every rank's tables
from the plan's segment program (epcc.plan.segments) and the gathered routing, with nothing but
per-token predicates and prefix sums -- the arithmetic the kernels do (runtime/engines/cuda_table/
meta.py launches them; backends/cuda/include/epcc/table/meta.cuh is their code).  It shares none
of runtime/layout's code: tests check the two agree record for record on every shipped plan,
and the GPU's blobs against these, byte for byte.

Per token of a home rank h, D is the set of ranks holding one of its experts.  Then:

* a token is in segment s iff it is one of h's tokens and D hits every mask of s; its slot there
  is s's offset in the buffer (the tokens of the segments before s) plus its rank among s's tokens;
* a dispatch copy's rows are its parts' tokens in order: into a staging buffer the tokens of the
  part's new segment, into `output` the tokens of the source segment with an expert on the copy's
  destination, one row per such expert in local-expert order, at
  base(local expert) + (tokens of that expert on lower home ranks) + (earlier tokens of h with it);
* a derived combine copy takes its dispatch copies' rows backwards over the parts that read the
  step's reverse source: all expert rows (weighted), or the rows whose token went on from their
  slot (live: some later part took it on, as a live token or as expert rows);
* chunks cut a copy's tokens (plan.chunk_sizes); a chunk waits, per producer, for the producer's
  chunk that holds the last of its tokens the chunk reads (dispatch: the copy that wrote the source
  slot; combine: every copy that adds into it, from an earlier step).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from epcc.plan.model import chunk_sizes
from epcc.plan.segments import SegmentProgram

from epcc.backends.cuda.placement import Placement

from ..engines.cuda_table.placed import CopyRows, assemble
from ..engines.cuda_table.tables import Tables
from ..routing import expert_rank


@dataclass
class Routing:
    """The gathered routing: every rank's tokens and top-k (rows past a rank's count ignored)."""

    topk: np.ndarray  # int64 [R, T, k], -1: an empty slot
    weights: np.ndarray  # float32 [R, T, k]
    tokens: np.ndarray  # int64 [R]


def _chunk_bounds(ntok: int, tpc, head: int, tail: int) -> np.ndarray:
    """Token offsets of a copy's chunks: [0, ..., ntok] (one chunk without a size, none without tokens)."""
    return np.cumsum([0] + chunk_sizes(ntok, tpc, head, tail)).astype(np.int64)


def _rank_in(mask: np.ndarray) -> np.ndarray:
    """Per position, how many set positions come before it (the rank of a member among members)."""
    return np.cumsum(mask) - mask


class _Tokens:
    """Per-token facts of one routing (what the first kernel computes into shared memory)."""

    def __init__(self, plan, prog: SegmentProgram, rt: Routing):
        wl = plan.workload
        R, T, K = rt.topk.shape
        self.R, self.T = R, T
        rank_of, local_of = expert_rank(wl.experts, R, wl.placement)
        live_token = np.arange(T)[None, :] < rt.tokens[:, None]
        self.valid = (rt.topk >= 0) & live_token[:, :, None]  # [R, T, K]
        e = np.maximum(rt.topk, 0)
        self.expert, self.dest, self.local = e, np.where(self.valid, rank_of[e], -1), local_of[e]
        self.hits = np.zeros((R, T, R), dtype=bool)
        hh, tt, jj = np.nonzero(self.valid)
        self.hits[hh, tt, self.dest[hh, tt, jj]] = True
        self.live_token = live_token
        self.weights = rt.weights
        self.origin_of = {s.id: s.origin for s in prog.segments}
        # segments: membership, counts, offsets in their buffer
        self.member: dict[int, np.ndarray] = {}
        for s in prog.segments:
            m = live_token[s.origin].copy()
            for mask in s.masks:
                m &= self.hit(s.origin, mask)
            self.member[s.id] = m
        self.offset: dict[int, int] = {}
        for key, sids in prog.buffers.items():
            off = 0
            for sid in sids:
                self.offset[sid] = off
                off += int(self.member[sid].sum())
        self.ordinal = {sid: _rank_in(m) for sid, m in self.member.items()}
        # output rows: expert-major (local expert, home rank, token); the row of every (h, t, j)
        E, epr = wl.experts, wl.experts // R
        cnt = np.zeros((R, E), dtype=np.int64)  # tokens of home h with expert e
        self.row_of = np.full((R, T, K), -1, dtype=np.int64)
        before = np.zeros((R, T, K), dtype=np.int64)  # earlier tokens of h with the same expert
        for h in range(R):
            onehot = np.zeros((T, E), dtype=np.int64)
            tt, jj = np.nonzero(self.valid[h])
            onehot[tt, e[h][tt, jj]] = 1
            before[h][tt, jj] = (np.cumsum(onehot, axis=0) - onehot)[tt, e[h][tt, jj]]
            cnt[h] = onehot.sum(0)
        self.recv_counts = np.zeros((R, epr), dtype=np.int64)
        for d in range(R):
            experts = np.flatnonzero(rank_of == d)
            experts = experts[np.argsort(local_of[experts])]
            per_home = cnt[:, experts]  # [home, local expert]
            tot = per_home.sum(0)
            self.recv_counts[d] = tot
            base = np.cumsum(tot) - tot
            home_before = np.cumsum(per_home, axis=0) - per_home
            for h in range(R):
                tt, jj = np.nonzero(self.valid[h] & (self.dest[h] == d))
                le = local_of[e[h][tt, jj]]
                self.row_of[h][tt, jj] = base[le] + home_before[h, le] + before[h][tt, jj]

    def hit(self, h: int, mask: int) -> np.ndarray:
        """[T]: the tokens of home h whose destination ranks hit `mask` (-1: every rank)."""
        if mask == -1:
            return self.hits[h].any(axis=1)
        ranks = [r for r in range(self.R) if mask >> r & 1]
        return self.hits[h][:, ranks].any(axis=1)


def _dispatch_rows(prog: SegmentProgram, tk: _Tokens):
    """Every dispatch copy's rows, the token of each row within the copy, and each part's first
    token (a producer's row of a token it wrote into segment s: part_first[s] + rank in s)."""
    out: dict[int, CopyRows] = {}
    tok_of_row: dict[int, np.ndarray] = {}
    first_of_seg: dict[int, int] = {}  # segment -> its first token within the copy that wrote it
    for c in prog.dispatch:
        src_ids, src_slots, dst_slots, toks = [], [], [], []
        ntok = 0
        for p in c.parts:
            s = prog.segments[p.src]
            h = s.origin
            if p.dst >= 0:
                t = np.flatnonzero(tk.member[p.dst])
                first_of_seg[p.dst] = ntok
                src_slots.append(tk.offset[p.src] + tk.ordinal[p.src][t])
                dst_slots.append(tk.offset[p.dst] + tk.ordinal[p.dst][t])
                toks.append(ntok + np.arange(t.size))
                src_ids.append(np.full(t.size, p.src_buffer))
                ntok += t.size
                continue
            t = np.flatnonzero(tk.member[p.src] & tk.hits[h][:, c.dst])
            on = tk.valid[h][t] & (tk.dest[h][t] == c.dst)  # [n, K]: the token's expert rows here
            order = np.argsort(np.where(on, tk.local[h][t], 1 << 30), axis=1, kind="stable")
            i, k = np.nonzero(np.take_along_axis(on, order, axis=1))
            j = order[i, k]
            src_slots.append(tk.offset[p.src] + tk.ordinal[p.src][t[i]])
            dst_slots.append(tk.row_of[h][t[i], j])
            toks.append(ntok + i)
            src_ids.append(np.full(i.size, p.src_buffer))
            ntok += t.size
        cat = (lambda a: np.concatenate(a).astype(np.int64) if a else np.zeros(0, np.int64))
        tok = cat(toks)
        bounds = _chunk_bounds(ntok, c.tpc, c.ramp_head, c.ramp_tail)
        starts = np.searchsorted(tok, bounds, side="left")
        starts[-1] = tok.size
        out[c.id] = CopyRows(c.src, c.dst, c.step_index, c.flow_index, c.dst_buffer, cat(src_ids), cat(src_slots),
                             cat(dst_slots), None, starts.astype(np.int64) if ntok else np.zeros(1, np.int64), [])
        tok_of_row[c.id] = tok
    # waits: a row reading segment s (written by copy P) needs P's chunk holding the token
    for c in prog.dispatch:
        r = out[c.id]
        nch = len(r.chunk_starts) - 1
        waits = [dict() for _ in range(nch)]
        row = 0
        for p in c.parts:
            s = prog.segments[p.src]
            n = _part_rows(p, c, tk)
            if s.writer >= 0 and n:
                t_in_s = tk.ordinal[p.src][_part_tokens_rows(p, c, tk)]
                prod = out[s.writer]
                pchunk = np.searchsorted(prod.chunk_starts, first_of_seg[p.src] + t_in_s, side="right") - 1
                cchunk = np.searchsorted(r.chunk_starts, row + np.arange(n), side="right") - 1
                for ch, v in zip(cchunk.tolist(), pchunk.tolist()):
                    if waits[ch].get(s.writer, 0) < v + 1:
                        waits[ch][s.writer] = v + 1
            row += n
        r.waits = [sorted(w.items()) for w in waits]
    return out, tok_of_row, first_of_seg


def _part_tokens_rows(p, c, tk: _Tokens) -> np.ndarray:
    """Per row of part p of dispatch copy c, its token (index within the home rank)."""
    if p.dst >= 0:
        return np.flatnonzero(tk.member[p.dst])
    h = tk.origin_of[p.src]
    t = np.flatnonzero(tk.member[p.src] & tk.hits[h][:, c.dst])
    return np.repeat(t, (tk.valid[h][t] & (tk.dest[h][t] == c.dst)).sum(axis=1))


def _part_rows(p, c, tk: _Tokens) -> int:
    return int(_part_tokens_rows(p, c, tk).size)


def device_tables(manifest: dict, plan, prog: SegmentProgram, placements: dict[str, Placement],
                  rt: Routing) -> dict[str, Tables]:
    """What the metadata kernels write for one rank: its placed blob of each program."""
    tk = _Tokens(plan, prog, rt)
    drows, dtok, first_of_seg = _dispatch_rows(prog, tk)
    crows = _combine_rows(plan, prog, tk, drows, dtok)
    rows = {**drows, **crows}
    chunks = {cid: len(r.chunk_starts) - 1 for cid, r in rows.items()}
    flag_rank = {c.id: c.dst for c in (*prog.dispatch, *prog.combine)}
    out = {}
    wl = plan.workload
    row_bytes = 2 * wl.hidden if wl.dtype == "bf16" else wl.hidden + wl.hidden // 128 * 4
    for program, pl in placements.items():
        zero_rows = {}
        for _, name in pl.zero:
            zero_rows[name] = _combine_buffer_rows(prog, tk, name, pl.rank)
        out[program] = assemble(manifest, pl, rows, flag_rank, chunks, zero_rows, int(rt.tokens[pl.rank]),
                                wl.hidden, row_bytes, plan.num_ranks)
    return out


def _combine_buffer_rows(prog: SegmentProgram, tk: _Tokens, name: str, rank: int) -> int:
    """Rows of a derived combine buffer on `rank`: those of the dispatch buffer it mirrors."""
    if name == "result":
        return tk.T
    mirror = prog.partial_of.get(name, name)
    return sum(int(tk.member[s].sum()) for s in prog.buffers.get((mirror, rank), []))


def _combine_rows(plan, prog: SegmentProgram, tk: _Tokens, drows: dict, dtok: dict) -> dict[int, CopyRows]:
    # live: a token in segment s went on from there (some later part took it on)
    live: dict[int, np.ndarray] = {}
    readers: dict[int, list] = defaultdict(list)
    for c in prog.dispatch:
        for p in c.parts:
            readers[p.src].append((c, p))
    for s in reversed(prog.segments):
        m = np.zeros(tk.T, dtype=bool)
        for c, p in readers.get(s.id, []):
            if p.dst >= 0:
                m |= tk.member[p.dst] & live[p.dst]
            else:
                m |= tk.member[s.id] & tk.hits[s.origin][:, c.dst]
        live[s.id] = m
    out: dict[int, CopyRows] = {}
    tok_of: dict[int, np.ndarray] = {}
    by_id = {c.id: c for c in prog.dispatch}
    for cc in prog.combine:
        ss, ds, ws, toks = [], [], [], []
        ntok = 0
        for did in cc.pool:
            d, dr = by_id[did], drows[did]
            row = 0
            for p in d.parts:
                n = _part_rows(p, d, tk)
                if p.src_buffer == cc.src_buffer:
                    sl = slice(row, row + n)
                    if d.into_output:
                        h = prog.segments[p.src].origin
                        keep = np.ones(n, dtype=bool)
                        t_rows = _part_tokens_rows(p, d, tk)
                    else:
                        h = prog.segments[p.src].origin
                        t_rows = np.flatnonzero(tk.member[p.dst])
                        keep = live[p.dst][t_rows]
                    ss.append(dr.dst_slots[sl][keep])
                    ds.append(dr.src_slots[sl][keep])
                    tok = dtok[did][sl][keep]
                    toks.append(tok + ntok)
                    ntok += int(tok.max()) + 1 if tok.size else 0
                    if cc.weighted:
                        on_rows = _expert_slots(p, d, tk, h)
                        ws.append(tk.weights[h][t_rows, on_rows][keep])
                row += n
        cat = (lambda a: np.concatenate(a) if a else np.zeros(0, np.int64))
        tok = cat(toks).astype(np.int64)
        if tok.size:  # dense token ordinals (the rows of a token are consecutive)
            new = np.ones(tok.size, dtype=bool)
            new[1:] = tok[1:] != tok[:-1]
            tok = np.cumsum(new) - 1
        n_tok = int(tok[-1]) + 1 if tok.size else 0
        bounds = _chunk_bounds(n_tok, cc.tpc, cc.ramp_head, cc.ramp_tail)
        starts = np.searchsorted(tok, bounds, side="left")
        starts[-1] = tok.size
        out[cc.id] = CopyRows(cc.src, cc.dst, cc.step_index, cc.flow_index, cc.dst_buffer,
                              np.zeros(tok.size, np.int64), cat(ss).astype(np.int64), cat(ds).astype(np.int64),
                              cat(ws).astype(np.float32) if cc.weighted else None,
                              starts.astype(np.int64) if n_tok else np.zeros(1, np.int64), [])
        tok_of[cc.id] = tok
    # waits: a row reading slot q of its source buffer waits, per earlier copy adding into q, for
    # that copy's chunk holding q's contribution
    contrib: dict[tuple[str, int], list] = defaultdict(list)  # (buffer, rank) -> (slots, copy, chunks, step)
    for cc in prog.combine:
        r = out[cc.id]
        ch = np.searchsorted(r.chunk_starts, np.arange(len(r.dst_slots)), side="right") - 1
        contrib[(cc.dst_buffer, cc.dst)].append((r.dst_slots, cc.id, ch, cc.step_index))
    for cc in prog.combine:
        r = out[cc.id]
        nch = len(r.chunk_starts) - 1
        waits = [dict() for _ in range(nch)]
        crow = np.searchsorted(r.chunk_starts, np.arange(len(r.src_slots)), side="right") - 1
        for slots, pid, pch, step in contrib.get((cc.src_buffer_name, cc.src), []):
            if step >= cc.step_index or not len(slots):
                continue
            last = np.full(int(slots.max()) + 1, -1, dtype=np.int64)
            np.maximum.at(last, slots, pch)
            q = r.src_slots
            inside = q < last.size
            v = np.where(inside, last[np.minimum(q, last.size - 1)], -1)
            for c_, val in zip(crow[v >= 0].tolist(), v[v >= 0].tolist()):
                if waits[c_].get(pid, 0) < val + 1:
                    waits[c_][pid] = val + 1
        r.waits = [sorted(w.items()) for w in waits]
    return out


def _expert_slots(p, c, tk: _Tokens, h: int) -> np.ndarray:
    """Per row of an into-output part, the top-k slot j of its expert."""
    t = np.flatnonzero(tk.member[p.src] & tk.hits[h][:, c.dst])
    on = tk.valid[h][t] & (tk.dest[h][t] == c.dst)
    order = np.argsort(np.where(on, tk.local[h][t], 1 << 30), axis=1, kind="stable")
    i, k = np.nonzero(np.take_along_axis(on, order, axis=1))
    return order[i, k]
