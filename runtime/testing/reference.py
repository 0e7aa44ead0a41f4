"""A NumPy executor of a Layout: the independent check that a layout implements the semantics.

Not the cpu engine (runtime/engines/cpu runs the plan's roles, lowered to LLVM IR by backends/cpu,
as threads): this one applies the copies one after another over per-rank NumPy buffers,
dispatch as row copies, combine as fp32 accumulations.  `epcc run --backend reference` uses it
as a debugging backend (the Runner protocol of runtime/engines/base.py, as the cpu engine):

    run_dispatch(plan, layout, x_rows: list of uint8 [T, row_bytes]) -> list of uint8 [n_d, row_bytes]
    run_combine(plan, layout, y: list of uint16 (bf16) [n_d, hidden]) -> list of float32 [T, hidden]

`run_chunked` executes chunk by chunk in a random order that only respects `Copy.waits` and
checks that every slot a chunk reads is ready (dispatch: written; combine: every contribution
in): the test that the waits are sufficient.
"""

from __future__ import annotations

import numpy as np

from ..bf16 import bf16_to_f32
from ..layout import Copy, Layout

__all__ = ["run_dispatch", "run_combine", "run_chunked", "WaitError"]


class WaitError(AssertionError):
    """A chunk read a slot its waits did not make ready, or the waits deadlock."""


def _src_ids(plan, c: Copy) -> tuple[list[str], np.ndarray]:
    names = list(plan.program_steps(c.program)[c.step_index].src_buffers)
    if c.src_buffer_ids is not None:
        return names, c.src_buffer_ids
    lut = {b: i for i, b in enumerate(names)}
    return names, np.asarray([lut[b] for b in c.src_buffers], dtype=np.int64)


def _rows_to_array(x_rows, layout: Layout) -> list[np.ndarray]:
    out = []
    for r in range(layout.num_ranks):
        a = np.asarray(x_rows[r])
        if a.dtype != np.uint8 or a.shape != (layout.tokens, layout.row_bytes):
            raise ValueError(f"x_rows: rank {r}: expected uint8 [{layout.tokens}, {layout.row_bytes}], "
                             f"got {a.dtype} {list(a.shape)}")
        out.append(a)
    return out


def _dispatch_buffers(layout: Layout, x: list[np.ndarray]) -> dict[tuple[str, int], np.ndarray]:
    bufs: dict[tuple[str, int], np.ndarray] = {}
    for (b, r), e in layout.entries.items():
        bufs[(b, r)] = x[r] if b == "input" else np.zeros((e.shape[0], layout.row_bytes), dtype=np.uint8)
    return bufs


def run_dispatch(plan, layout: Layout, x_rows) -> list[np.ndarray]:
    x = _rows_to_array(x_rows, layout)
    bufs = _dispatch_buffers(layout, x)
    for c in layout.program_copies("dispatch"):
        names, ids = _src_ids(plan, c)
        dst = bufs[(c.dst_buffer, c.dst)]
        for bi, b in enumerate(names):
            m = ids == bi
            if m.any():
                dst[c.dst_slots[m]] = bufs[(b, c.src)][c.src_slots[m]]
    return [bufs[("output", r)] for r in range(layout.num_ranks)]


def _accumulate(dst: np.ndarray, slots: np.ndarray, vals: np.ndarray) -> None:
    """dst[slots] += vals, fp32, rows with the same slot summed in row order."""
    if slots.size == 0:
        return
    order = np.argsort(slots, kind="stable")
    s = slots[order]
    first = np.ones(s.size, dtype=bool)
    first[1:] = s[1:] != s[:-1]
    if first.all():
        dst[slots] += vals
        return
    starts = np.flatnonzero(first)
    dst[s[starts]] += np.add.reduceat(vals[order], starts, axis=0)


def _combine_inputs(layout: Layout, y) -> list[np.ndarray]:
    out = []
    for r in range(layout.num_ranks):
        a = np.asarray(y[r])
        n = layout.buffer_rows("output", r)
        if a.shape != (n, layout.hidden):
            raise ValueError(f"y: rank {r}: expected [{n}, {layout.hidden}] expert outputs, got {list(a.shape)}")
        out.append(bf16_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32))
    return out


def _combine_buffers(layout: Layout, y: list[np.ndarray]) -> dict[tuple[str, int], np.ndarray]:
    bufs: dict[tuple[str, int], np.ndarray] = {}
    for (b, r), e in layout.combine_entries.items():
        bufs[(b, r)] = np.zeros((e.shape[0], layout.hidden), dtype=np.float32)
    for r in range(layout.num_ranks):
        bufs[("output", r)] = y[r]
        bufs.setdefault(("result", r), np.zeros((layout.tokens, layout.hidden), dtype=np.float32))
    return bufs


def _combine_rows(plan, c: Copy, bufs, m: np.ndarray, b: str) -> np.ndarray:
    v = bufs[(b, c.src)][c.src_slots[m]]
    if c.weights is not None:
        v = c.weights[m][:, None] * v
    return v


def run_combine(plan, layout: Layout, y) -> list[np.ndarray]:
    bufs = _combine_buffers(layout, _combine_inputs(layout, y))
    for c in layout.program_copies("combine"):
        names, ids = _src_ids(plan, c)
        dst = bufs[(c.dst_buffer, c.dst)]
        for bi, b in enumerate(names):
            m = ids == bi
            if m.any():
                _accumulate(dst, c.dst_slots[m], _combine_rows(plan, c, bufs, m, b))
    return [bufs[("result", r)] for r in range(layout.num_ranks)]


# --------------------------------------------------------------------------- chunk by chunk


def _rows_by_source(plan, c: Copy, lo: int, hi: int):
    """(source buffer, row mask) for the rows [lo, hi) of copy `c`, one source buffer at a time."""
    names, ids = _src_ids(plan, c)
    for bi, b in enumerate(names):
        m = np.zeros(c.src_slots.size, dtype=bool)
        m[lo:hi] = ids[lo:hi] == bi
        if m.any():
            yield b, m


def run_chunked(plan, layout: Layout, x_rows, y, seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Dispatch then combine, chunk by chunk in a random order that respects only the waits
    (each copy's chunks in order; a chunk runs once all its (flag, value) pairs are reached).
    Raises WaitError if a chunk reads a slot that is not ready or no chunk can run."""
    rng = np.random.default_rng(seed)
    x = _rows_to_array(x_rows, layout)
    flags = np.zeros(len(layout.flags), dtype=np.int64)
    # dispatch
    bufs = _dispatch_buffers(layout, x)
    ready = {key: np.full(a.shape[0], key[0] == "input", dtype=bool) for key, a in bufs.items()}

    def do_dispatch(c: Copy, lo: int, hi: int) -> None:
        dst = bufs[(c.dst_buffer, c.dst)]
        for b, m in _rows_by_source(plan, c, lo, hi):
            s = c.src_slots[m]
            if not ready[(b, c.src)][s].all():
                bad = int(s[~ready[(b, c.src)][s]][0])
                raise WaitError(f"dispatch {c.step}[flow {c.flow_index}] reads slot {bad} of '{b}' on rank {c.src} "
                                f"before it is written")
            dst[c.dst_slots[m]] = bufs[(b, c.src)][s]
            ready[(c.dst_buffer, c.dst)][c.dst_slots[m]] = True

    _run_program(layout, layout.program_copies("dispatch"), flags, do_dispatch, rng)
    outputs = [bufs[("output", r)] for r in range(layout.num_ranks)]
    # combine: a partial is ready once every contribution to it is in
    cbufs = _combine_buffers(layout, _combine_inputs(layout, y))
    pending = {key: np.zeros(a.shape[0], dtype=np.int64) for key, a in cbufs.items()}
    ccopies = layout.program_copies("combine")
    for c in ccopies:
        np.add.at(pending[(c.dst_buffer, c.dst)], c.dst_slots, 1)

    def do_combine(c: Copy, lo: int, hi: int) -> None:
        dst = cbufs[(c.dst_buffer, c.dst)]
        for b, m in _rows_by_source(plan, c, lo, hi):
            s = c.src_slots[m]
            left = pending[(b, c.src)][s]
            if (left > 0).any():
                bad = int(s[left > 0][0])
                raise WaitError(f"combine {c.step}[flow {c.flow_index}] reads the partial in slot {bad} of '{b}' on "
                                f"rank {c.src} while {int(left[left > 0][0])} contribution(s) are still missing")
            _accumulate(dst, c.dst_slots[m], _combine_rows(plan, c, cbufs, m, b))
            np.add.at(pending[(c.dst_buffer, c.dst)], c.dst_slots[m], -1)

    _run_program(layout, ccopies, flags, do_combine, rng)
    return outputs, [cbufs[("result", r)] for r in range(layout.num_ranks)]


def _run_program(layout: Layout, copies: list[Copy], flags: np.ndarray, do, rng) -> None:
    nxt = {id(c): 0 for c in copies}
    todo = [c for c in copies if c.chunk_starts.size > 1]
    while todo:
        runnable = []
        for c in todo:
            ch = nxt[id(c)]
            if all(flags[f] >= v for f, v in c.waits[ch]):
                runnable.append(c)
        if not runnable:
            c = todo[0]
            raise WaitError(f"deadlock: {c.program} {c.step}[flow {c.flow_index}] chunk {nxt[id(c)]} waits for "
                            f"{c.waits[nxt[id(c)]]}, flags {[int(flags[f]) for f, _ in c.waits[nxt[id(c)]]]}")
        # Half the time the latest runnable copy (consumers as early as their waits allow: what
        # exposes a missing wait), otherwise any.
        c = runnable[-1] if rng.random() < 0.5 else runnable[int(rng.integers(len(runnable)))]
        ch = nxt[id(c)]
        do(c, int(c.chunk_starts[ch]), int(c.chunk_starts[ch + 1]))
        flags[c.flag_id] += 1
        nxt[id(c)] = ch + 1
        if ch + 1 == c.chunk_starts.size - 1:
            todo.remove(c)
