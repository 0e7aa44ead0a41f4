"""What each chunk of a copy waits for: the producer counters and the values they must reach.

Dispatch: for every producer copy that wrote a slot the chunk reads, 1 + the producer's chunk
holding the last such slot.  Combine: for every producer copy that accumulates into a slot the
chunk reads, 1 + its last chunk contributing to any of them, so each partial read is final.
Counters rise chunk by chunk in order, so these values are minimal.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .builder import Builder, chunk_of_rows


def dispatch_waits(bld: Builder) -> None:
    # Per staging (buffer, rank): the copy and chunk that wrote each slot.
    prod: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
    for key, cids in bld.writers.items():
        size = bld.store.size[key]
        p = np.full(size, -1, dtype=np.int64)
        ch = np.full(size, -1, dtype=np.int64)
        for cid in cids:
            c = bld.copies[cid]
            p[c.dst_slots] = cid
            ch[c.dst_slots] = chunk_of_rows(c.chunk_starts)
        prod[key] = (p, ch)
    steps = bld.plan.program_steps("dispatch")
    for cid in range(bld.n_dispatch):
        c = bld.copies[cid]
        names = steps[c.step_index].src_buffers
        pid = np.full(c.src_slots.size, -1, dtype=np.int64)
        pch = np.full(c.src_slots.size, -1, dtype=np.int64)
        for bi, b in enumerate(names):
            pr = prod.get((b, c.src))
            if pr is None:
                continue
            m = bld.src_ids[cid] == bi
            s = c.src_slots[m]
            pid[m] = pr[0][s]
            pch[m] = pr[1][s]
        c.waits = group_waits(chunk_of_rows(c.chunk_starts), pid, pch, c.chunk_starts.size - 1)


def combine_waits(bld: Builder) -> None:
    """Each chunk waits until every contribution to the partials it reads is in."""
    steps = bld.plan.program_steps("combine")
    # contributions per (buffer, rank): (slot, copy, chunk, step index)
    contrib: dict[tuple[str, int], list[tuple[np.ndarray, int, np.ndarray, int]]] = defaultdict(list)
    for cid in range(bld.n_dispatch, len(bld.copies)):
        c = bld.copies[cid]
        contrib[(c.dst_buffer, c.dst)].append((c.dst_slots, cid, chunk_of_rows(c.chunk_starts), c.step_index))
    index: dict[tuple[str, int], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
    for key, parts in contrib.items():
        slot = np.concatenate([p[0] for p in parts])
        pid = np.concatenate([np.full(p[0].size, p[1], dtype=np.int64) for p in parts])
        pch = np.concatenate([p[2] for p in parts])
        pst = np.concatenate([np.full(p[0].size, p[3], dtype=np.int64) for p in parts])
        o = np.argsort(slot, kind="stable")
        index[key] = (slot[o], pid[o], pch[o], pst[o])
    for cid in range(bld.n_dispatch, len(bld.copies)):
        c = bld.copies[cid]
        nch = c.chunk_starts.size - 1
        crow = chunk_of_rows(c.chunk_starts)
        names = list(steps[c.step_index].src_buffers)
        rows_c, rows_p, rows_ch = [], [], []
        for bi, b in enumerate(names):
            ix = index.get((b, c.src))
            if ix is None:
                continue
            slot, pid, pch, pst = ix
            m = bld.src_ids[cid] == bi
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
            c.waits = group_waits(np.concatenate(rows_c), np.concatenate(rows_p), np.concatenate(rows_ch), nch)
        else:
            c.waits = [[] for _ in range(nch)]


def group_waits(crow: np.ndarray, pid: np.ndarray, pch: np.ndarray, nch: int) -> list[list[tuple[int, int]]]:
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
