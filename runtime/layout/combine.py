"""Combine's layout: the partials each copy accumulates, derived from dispatch or written out.

A derived combine runs dispatch's copies backwards (partial buffers mirror the dispatch buffers
slot for slot); a written-out combine creates one partial slot per (home, token) at its first
contribution.  __init__.py gives the rules; the waits are waits.py's.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .builder import EMPTY, Builder, LayoutError, chunk_bounds, ordinals, Store, tokens_per_chunk
from .types import Copy
from .waits import combine_waits


def lay_out_combine(bld: Builder) -> None:
    steps = bld.plan.program_steps("combine")
    data = [s for s in steps if s.verb != "exchange"]
    if not data:
        _combine_buffers_derived(bld)
        return
    derived = [s.reverse_of is not None for s in data]
    if all(derived):
        _derived(bld, steps)
    elif not any(derived):
        _written(bld, steps)
    else:
        raise LayoutError("plan: the combine program mixes derived steps (reverse_of) and written-out ones")


def _combine_buffers_derived(bld: Builder) -> None:
    for (b, r), e in bld.entries.items():
        if b == "input":
            bld.combine_entries[("result", r)] = e
    bld.partial_of.setdefault("result", "input")


def _derived(bld: Builder, steps) -> None:
    plan, R = bld.plan, bld.R
    dsteps = {s.name: s for s in plan.program_steps("dispatch")}
    # Live slots: those whose copy delivered something downstream (their partial is non-empty).
    live: dict[tuple[str, int], np.ndarray] = {}

    def live_of(b: str, r: int) -> np.ndarray:
        a = live.get((b, r))
        if a is None:
            n = bld.entries[(b, r)].shape[0] if (b, r) in bld.entries else 0
            a = live[(b, r)] = np.full(n, b == "output", dtype=bool)
        return a

    for cid in range(bld.n_dispatch - 1, -1, -1):
        c = bld.copies[cid]
        ld = live_of(c.dst_buffer, c.dst)[c.dst_slots]
        names = dsteps[c.step].src_buffers
        for bi, b in enumerate(names):
            m = (bld.src_ids[cid] == bi) & ld
            if m.any():
                live_of(b, c.src)[c.src_slots[m]] = True
    by_step: dict[str, list[int]] = defaultdict(list)
    for cid in range(bld.n_dispatch):
        by_step[bld.copies[cid].step].append(cid)
    hidden = bld.wl.hidden
    cbpt = 2 * hidden
    bld.partial_of["result"] = "input"
    bld.partial_of["output"] = "output"
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
            if bld.partial_of.setdefault(cb, db) != db:
                raise LayoutError(f"plan: combine buffer '{cb}' mirrors both '{bld.partial_of[cb]}' and '{db}'")
        pool: dict[tuple[int, int, int], list[int]] = defaultdict(list)
        for cid in by_step[x.name]:
            d = bld.copies[cid]
            pool[(d.rank, d.src, d.dst)].append(cid)
        tpc = tokens_per_chunk(cs.chunk_bytes, cbpt)
        for fi, f in enumerate(cs.flows):
            bld.check_flow("combine", cs, f)
            # The dispatch flow (rank, a, b) this one reverses; none (a hand-edited plan):
            # dispatch moved nothing there, so there is nothing to return.
            dids = pool.pop((f.rank, f.dst, f.src), [])
            src_slots, dst_slots, toks, wts = [], [], [], []
            base = 0
            for did in dids:
                d = bld.copies[did]
                m = bld.src_ids[did] == ai
                if not cs.weighted:
                    m &= live_of(x.dst_buffer, d.dst)[d.dst_slots]
                src_slots.append(d.dst_slots[m])
                dst_slots.append(d.src_slots[m])
                tk = bld.tok[did][m]
                toks.append(tk + base)
                base += int(tk[-1]) + 1 if tk.size else 0
                if cs.weighted:
                    wts.append(bld.out_weight[d.dst][d.dst_slots[m]])
            ss = np.concatenate(src_slots) if src_slots else EMPTY
            tok = ordinals(np.concatenate(toks)) if toks else EMPTY
            c = Copy("combine", cs.name, ci, fi, f.rank, f.src, f.dst, [src_buf] * int(ss.size), ss,
                     cs.dst_buffer, np.concatenate(dst_slots) if dst_slots else EMPTY,
                     weights=(np.concatenate(wts).astype(np.float32) if wts else np.zeros(0, np.float32))
                     if cs.weighted else None)
            c.chunk_starts = chunk_bounds(tok, tpc, cs)
            bld.add_copy(c, tok, np.zeros(ss.size, dtype=np.int64))
    for cb, db in bld.partial_of.items():
        if cb == "output":
            continue
        for r in range(R):
            e = bld.entries.get((db, r))
            if e is not None:
                bld.combine_entries[(cb, r)] = e
    combine_waits(bld)


def _written(bld: Builder, steps) -> None:
    R, T, N = bld.R, bld.T, bld.N
    cbpt = 2 * bld.wl.hidden
    # Partial buffers: one slot per (home, token), created by its first contribution.
    slot_of: dict[tuple[str, int], np.ndarray] = {}
    store = Store()

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
        tpc = tokens_per_chunk(cs.chunk_bytes, cbpt)
        committed = {key: store.size[key] for key in list(store.size)}
        for fi, f in enumerate(cs.flows):
            bld.check_flow("combine", cs, f)
            homes = None if f.select is None else bld.home_mask(f.select)
            gids, ss, ids, ws = [], [], [], []
            weighted = False
            for bi, b in enumerate(cs.src_buffers):
                if b == "output":
                    if cs.verb != "reduce":
                        raise LayoutError(f"plan: combine step '{cs.name}' moves unweighted expert rows out of "
                                          f"'output'; the layout supports written combines that reduce "
                                          f"(weight) the expert outputs first")
                    ent = bld.entries[("output", f.src)]
                    g = ent[:, 0] * T + ent[:, 1]
                    idx = np.arange(g.size, dtype=np.int64) if homes is None else np.flatnonzero(homes[ent[:, 0]])
                    ws.append(bld.out_weight[f.src][idx])
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
            g = np.concatenate(gids) if gids else EMPTY
            src_slots = np.concatenate(ss) if ss else EMPTY
            rid = np.concatenate(ids) if ids else EMPTY
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
            tok = ordinals(dst_slots)
            names = list(cs.src_buffers)
            c = Copy("combine", cs.name, ci, fi, f.rank, f.src, f.dst, [names[x] for x in rid.tolist()],
                     src_slots, dst_buf, dst_slots, weights=wv)
            c.chunk_starts = chunk_bounds(tok, tpc, cs)
            bld.add_copy(c, tok, rid)
    for (b, r), _ in list(store.size.items()):
        g = store.gids((b, r))
        bld.combine_entries[(b, r)] = np.stack([g // T, g % T], axis=1)
    for cs in steps:  # every partial buffer on every rank, even if nothing reaches it
        for b in (*cs.src_buffers, cs.dst_buffer):
            if b not in (None, "output", "result"):
                for r in range(R):
                    bld.combine_entries.setdefault((b, r), np.zeros((0, 2), dtype=np.int64))
    for h in range(R):
        bld.combine_entries[("result", h)] = bld.entries[("input", h)]
    combine_waits(bld)
