"""The most rows each buffer of a plan can hold, for every routing of at most T tokens per rank.

A runtime that allocates its buffers once (and maps them on the peers once) sizes them by this
instead of by one routing's layout.  The bound is exact for staging buffers: an entry of a
staging buffer is a token on one *path* through the plan (the chain of flows that carried it
there from its home's `input`), a flow passes a token whose destination ranks hit its
selection, and every selection is passed by a token that has rows on every rank, so each path
can carry all T tokens of its home at once.  Enumerating the paths in program order (steps,
flows, source buffers, then the source buffer's own paths: the order compute_layout appends
entries in) gives each staging buffer's paths; its capacity is T per path.  `output` holds one
row per (token, expert of the rank): at most R x T x min(topk, experts per rank).  Combine's
derived partial buffers mirror the dispatch buffers they reverse; written-out ones hold one slot
per (home, token) reaching them, at most R x T.
"""

from __future__ import annotations

from collections import defaultdict


def staging_paths(plan) -> dict[tuple[str, int], int]:
    """Paths into each dispatch staging buffer and `input`, by (buffer, rank) (`output` is left
    out: its rows are per expert, not per path)."""
    R = plan.num_ranks
    paths: dict[tuple[str, int], int] = defaultdict(int)
    for h in range(R):
        paths[("input", h)] = 1
    for st in plan.program_steps("dispatch"):
        if st.verb == "exchange" or st.dst_buffer in (None, "output"):
            continue
        new: dict[tuple[str, int], int] = defaultdict(int)
        for f in st.flows:
            for b in st.src_buffers:
                new[(st.dst_buffer, f.dst)] += paths.get((b, f.src), 0)
        for key, n in new.items():  # a step reads what earlier steps wrote
            paths[key] += n
    return dict(paths)


def capacity_rows(plan, tokens: int) -> dict[tuple[str, str, int], int]:
    """(program, buffer, rank) -> the most rows that buffer holds on that rank when no rank
    dispatches more than `tokens` tokens (every buffer any step of the plan names)."""
    R, wl = plan.num_ranks, plan.workload
    out_rows = R * tokens * min(wl.topk, wl.experts // R)
    paths = staging_paths(plan)
    cap: dict[tuple[str, str, int], int] = {}
    dispatch_buffers = {"input", "output"}
    for st in plan.program_steps("dispatch"):
        dispatch_buffers.update(b for b in (*st.src_buffers, st.dst_buffer) if b)
    for b in dispatch_buffers:
        for r in range(R):
            cap[("dispatch", b, r)] = out_rows if b == "output" else tokens * paths.get((b, r), 0)
    mirror: dict[str, str] = {"output": "output", "result": "input"}
    written = set()
    dsteps = {s.name: s for s in plan.program_steps("dispatch")}
    for cs in plan.program_steps("combine"):
        if cs.verb == "exchange":
            continue
        x = dsteps.get(cs.reverse_of) if cs.reverse_of else None
        if x is not None:
            if cs.dst_buffer and cs.reverse_source:
                mirror.setdefault(cs.dst_buffer, cs.reverse_source)
            if cs.src_buffers and x.dst_buffer:
                mirror.setdefault(cs.src_buffers[0], x.dst_buffer)
        else:
            written.update(b for b in (*cs.src_buffers, cs.dst_buffer) if b and b not in mirror)
    for b in set(mirror) | written:
        for r in range(R):
            if b == "result":
                rows = tokens
            elif b in mirror:
                rows = cap.get(("dispatch", mirror[b], r), 0)
            else:
                rows = R * tokens
            cap[("combine", b, r)] = rows
    return cap
