"""Dispatch's layout: which rows each copy moves, in step order, and where they land.

An entry is a token copy (home rank, token); `input` on h holds (h, 0..T-1).  A flow of a step
reads the entries EARLIER steps wrote into the step's source buffers on its `src` rank whose
destination ranks hit its `select`, appends one entry per token into a staging buffer, or places
one row per (token, expert of dst) into `output`, whose rows end expert-major (local expert,
home rank, token); with the workload's `layout token`, one row per token with an expert on dst,
in (home rank, token) order.  The waits are waits.py's.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .builder import EMPTY, Builder, LayoutError, chunk_bounds, ordinals, Store, tokens_per_chunk
from .types import Copy
from .waits import dispatch_waits


def lay_out_dispatch(bld: Builder) -> None:
    plan, T, R = bld.plan, bld.T, bld.R
    store = Store()
    for h in range(R):
        store.append(("input", h), np.arange(h * T, h * T + int(bld.tokens[h]), dtype=np.int64))
    # output rows, per receiving rank: (copy id, gid, expert, slot j), in copy row order
    out_parts: list[list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in range(R)]
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
        tpc = tokens_per_chunk(st.chunk_bytes, bpt)
        pending: dict[tuple[str, int], list[np.ndarray]] = defaultdict(list)
        pending_n: dict[tuple[str, int], int] = defaultdict(int)
        for fi, f in enumerate(st.flows):
            bld.check_flow("dispatch", st, f)
            slots, ids, gids = [], [], []
            for bi, b in enumerate(st.src_buffers):
                if b == "output":
                    raise LayoutError(f"plan: dispatch step '{st.name}' reads 'output'")
                g = store.gids((b, f.src))
                idx = np.arange(g.size, dtype=np.int64) if f.select is None else \
                    np.flatnonzero(bld.hit_mask(f.select)[g])
                slots.append(idx)
                ids.append(np.full(idx.size, bi, dtype=np.int64))
                gids.append(g[idx])
            slots_a = np.concatenate(slots) if slots else EMPTY
            ids_a = np.concatenate(ids) if ids else EMPTY
            gid_a = np.concatenate(gids) if gids else EMPTY
            c = Copy("dispatch", st.name, si, fi, f.rank, f.src, f.dst, [], EMPTY, st.dst_buffer, EMPTY)
            if into_output and bld.token_major:  # one row per token with an expert on dst
                i = np.flatnonzero((bld.dest[gid_a] == f.dst).any(axis=1))
                tok = np.arange(i.size, dtype=np.int64)
                c.src_slots = slots_a[i]
                rid = ids_a[i]
                cid = bld.add_copy(c, tok, rid)
                out_parts[f.dst].append((cid, gid_a[i], EMPTY, EMPTY))
            elif into_output:
                i, j = np.nonzero(bld.dest[gid_a] == f.dst)
                e = bld.flat[gid_a[i], j]
                o = np.lexsort((bld.local_of[e], i))
                i, j, e = i[o], j[o], e[o]
                tok = ordinals(i)
                c.src_slots = slots_a[i]
                rid = ids_a[i]
                cid = bld.add_copy(c, tok, rid)
                out_parts[f.dst].append((cid, gid_a[i], e, j))
            else:
                key = (st.dst_buffer, f.dst)
                start = store.size[key] + pending_n[key]
                c.src_slots = slots_a
                c.dst_slots = start + np.arange(slots_a.size, dtype=np.int64)
                rid = ids_a
                tok = np.arange(slots_a.size, dtype=np.int64)
                cid = bld.add_copy(c, tok, rid)
                pending[key].append(gid_a)
                pending_n[key] += int(gid_a.size)
                bld.writers[key].append(cid)
            names = list(st.src_buffers)
            c.src_buffers = [names[x] for x in rid.tolist()] if len(names) > 1 else names * int(rid.size)
            c.chunk_starts = chunk_bounds(tok, tpc, st)
        for key, parts in pending.items():
            for g in parts:
                store.append(key, g)
    # output: expert-major order, and the copies' destination rows in it
    w = bld.weights
    for d in range(R):
        parts = out_parts[d]
        if parts:
            gid = np.concatenate([p[1] for p in parts])
            e = np.concatenate([p[2] for p in parts])
            j = np.concatenate([p[3] for p in parts])
        else:
            gid = e = j = EMPTY
        h, t = gid // T, gid % T
        if bld.token_major:
            _token_major_output(bld, d, parts, gid, h, t)
            continue
        loc = bld.local_of[e]
        order = np.lexsort((t, h, loc))
        _place(bld, parts, order)
        bld.entries[("output", d)] = np.stack([h, t, e], axis=1)[order].reshape(-1, 3)
        bld.recv_counts[d] = np.bincount(loc, minlength=bld.epr)
        ow = w[h, t, j] if w is not None else np.ones(gid.size, dtype=np.float32)
        bld.out_weight.append(np.asarray(ow, dtype=np.float32)[order])
    bld.store = store
    for st in steps:  # every staging buffer on every rank, even if nothing reaches it
        for b in (*st.src_buffers, st.dst_buffer):
            if b not in (None, "output", "input"):
                for r in range(R):
                    store.size[(b, r)] += 0
    for (b, r), _ in list(store.size.items()):
        g = store.gids((b, r))
        bld.entries[(b, r)] = np.stack([g // T, g % T], axis=1)
    for h in range(R):
        n = int(bld.tokens[h])  # a rank with no tokens has no segment in the store
        bld.entries.setdefault(("input", h), np.stack([np.full(n, h), np.arange(n)], axis=1).astype(np.int64))
    bld.n_dispatch = len(bld.copies)
    dispatch_waits(bld)


def _place(bld: Builder, parts, order: np.ndarray) -> None:
    """The output copies' destination rows: the rows of `parts` (in copy order) sorted by `order`."""
    pos = np.empty(order.size, dtype=np.int64)
    pos[order] = np.arange(order.size, dtype=np.int64)
    off = 0
    for cid, g, _, _ in parts:
        bld.copies[cid].dst_slots = pos[off:off + g.size]
        off += g.size


def _token_major_output(bld: Builder, d: int, parts, gid: np.ndarray, h: np.ndarray, t: np.ndarray) -> None:
    """Rank d's token-major `output`: its rows (one per token) ordered by (home rank, token), the
    copies' destination rows in it, each row's top-k as DeepEP returns it, and rows per local
    expert (num_recv_tokens_per_expert)."""
    order = np.lexsort((t, h))
    _place(bld, parts, order)
    g = gid[order]
    twice = np.flatnonzero(g[1:] == g[:-1])
    if twice.size:
        raise LayoutError(f"plan: token {int(g[twice[0]] % bld.T)} of rank {int(g[twice[0]] // bld.T)} reaches "
                          f"the token-major output of rank {d} twice")
    bld.entries[("output", d)] = np.stack([g // bld.T, g % bld.T], axis=1).reshape(-1, 2)
    on = bld.dest[g] == d  # [n, k]
    e = bld.flat[g]
    bld.recv_topk_idx.append(np.where(on, bld.local_of[np.maximum(e, 0)], -1).astype(np.int64).reshape(-1, bld.k))
    w = bld.weights.reshape(bld.N, bld.k)[g] if bld.weights is not None else np.ones(e.shape, np.float32)
    bld.recv_topk_weights.append(np.where(on, w, 0).astype(np.float32).reshape(-1, bld.k))
    bld.recv_counts[d] = np.bincount(bld.local_of[e[on]], minlength=bld.epr)
    bld.out_weight.append(np.ones(g.size, dtype=np.float32))  # combine sums a token's rows unweighted
