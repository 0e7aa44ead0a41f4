"""buffer-allocation: the size of every buffer on every rank, and why.

DeepEP's users size buffers blind (`num_nvl_bytes`, worst case, opaque).  Here every size comes
with its formula, printed by `epcc compile --emit buffer-allocation` and kept in the plan:

* a staging buffer whose readers follow its writers chunk by chunk is a ring:
  sum over the ranks that write it of depth x chunk (the writer's), unless that is no smaller
  than the worst case below (chunks bigger than all the writers send): then the worst case;
* otherwise it must hold everything that can land in it: every token stream that lands there
  carries at most `tokens` tokens of one home, so the worst case is
  streams x tokens x bytes/token; the expected fill (under the routing) is shown beside it;
* `output` (expert-major) gets the expected rows and the worst case
  (sum over homes of tokens x min(topk, experts per rank) rows); it is sized at run time from
  the exchanged counts, as DeepEP's normal mode does;
* combine reuses the dispatch buffers' slots (its partial sums, BF16, are no larger).

A buffer declared with a capacity smaller than what its readers need is an error at its
declaration.
"""

from __future__ import annotations

from collections import defaultdict

from ..diagnostics import Note
from ..ir import query
from ..plan import BufferPlan, Plan
from . import Pass, PassContext, register


def _mb(b: float) -> str:
    return f"{b / 1e6:.1f} MB" if b >= 1e6 else f"{b / 1e3:.1f} KB"


@register
class BufferAllocation(Pass):
    name = "buffer-allocation"
    description = "staging and receive buffer sizes per rank, with the formula for each"

    def run(self, module, ctx: PassContext) -> None:
        sched = ctx.schedule
        plan: Plan = ctx.get("plan")
        flow = ctx.get("flow")
        wl = sched.workload
        bpt = wl.bytes_per_token
        n = sched.topology.num_ranks
        prog = sched.dispatch
        steps = {s.name: s for s in plan.program_steps("dispatch")}
        out: list[BufferPlan] = []
        for name, buf in prog.buffers.items():
            writers = [s for s in prog.steps if s.dest is not None and s.dest.buffer.name == name]
            readers = [s for s in prog.steps if any(src.buffer.name == name for src in s.sources)]
            if buf.role == "source":
                out.append(BufferPlan("dispatch", name, wl.tokens * bpt,
                                      f"the caller's tokens: {wl.tokens} tokens x {bpt} B = {_mb(wl.tokens * bpt)}"))
                continue
            # Incoming streams and expected bytes per receiving rank.
            streams = [0] * n
            expected = [0.0] * n
            ring = [0.0] * n
            sources: list[set[tuple[str, int]]] = [set() for _ in range(n)]
            for w in writers:
                ps = steps[w.name]
                for r in range(n):
                    for s in flow.moved[w.name][r]:
                        streams[s.path[-1][2]] += 1
                for f in ps.flows:
                    expected[f.dst] += f.bytes
                    if (w.name, f.src) not in sources[f.dst]:
                        sources[f.dst].add((w.name, f.src))
                        ring[f.dst] += ps.depth * (ps.chunk_bytes or 0.0)
            if buf.role == "sink":
                rows_exp = max(expected) / bpt if expected else 0.0
                worst_rows = n * wl.tokens * min(wl.topk, wl.experts_per_rank)
                formula = (f"expert-major rows: expected {rows_exp:.0f} rows x {bpt} B = {_mb(max(expected))} per rank "
                           f"under {plan.routing}; worst case {n} ranks x {wl.tokens} tokens x "
                           f"min(topk {wl.topk}, {wl.experts_per_rank} experts/rank) = {worst_rows} rows = "
                           f"{_mb(worst_rows * bpt)}; sized at run time from the exchanged counts")
                out.append(BufferPlan("dispatch", name, int(max(expected)), formula, int(worst_rows * bpt)))
                continue
            r_max = max(range(n), key=lambda r: (streams[r], expected[r]))
            worst = streams[r_max] * wl.tokens * bpt
            pipelined = all(all(w.name in steps[rd.name].pipelined_deps for w in writers) for rd in readers)
            if pipelined and readers and max(ring) < worst:
                size = max(ring)
                rr = max(range(n), key=lambda r: ring[r])
                parts = defaultdict(int)
                for (wname, _src) in sources[rr]:
                    parts[wname] += 1
                terms = " + ".join(
                    f"{cnt} x depth {steps[w].depth} x {_mb(steps[w].chunk_bytes or 0)} chunks ({w})"
                    for w, cnt in sorted(parts.items()))
                formula = (f"ring, readers follow writers chunk by chunk: {terms} = {_mb(size)}; "
                           f"without pipelining it would need up to {streams[r_max]} streams x {wl.tokens} tokens x "
                           f"{bpt} B = {_mb(worst)} (expected fill {_mb(max(expected))})")
            else:
                size = worst
                formula = (f"whole: {streams[r_max]} token streams x {wl.tokens} tokens x {bpt} B = {_mb(worst)} "
                           f"(expected fill {_mb(max(expected))} under {plan.routing})")
            cap = buf.capacity_bytes or (buf.capacity_tokens * bpt if buf.capacity_tokens else None)
            if cap is not None:
                if cap < size:
                    ctx.diags.error(buf.span, f"buffer '{name}' holds {_mb(cap)} but needs {_mb(size)}",
                                    Note(formula, None),
                                    *([Note(f"its readers do not follow its writers chunk by chunk; "
                                            f"e.g. step '{readers[0].name}'", readers[0].span)] if not pipelined and readers else []))
                    continue
                formula += f"; declared capacity {_mb(cap)}"
                size = cap
            out.append(BufferPlan("dispatch", name, int(size), formula, int(worst)))
        ctx.diags.raise_if_errors()
        plan.buffers = out
        prog_op = query.program_module(module, "dispatch")
        for op in query.body(prog_op).operations:
            o = op.operation
            if o.name == "epcc.buffer":
                nm = o.attributes["sym_name"]
                bp = next(b for b in out if b.name == str(nm).strip('"'))
                query.annotate(o, "alloc", {"bytes_per_rank": bp.bytes_per_rank, "formula": bp.formula,
                                            "worst_case_bytes": bp.worst_case_bytes or 0})
        if sched.combine is None:
            plan.notes.append("combine reuses the dispatch buffers' slots for its BF16 partial sums")
