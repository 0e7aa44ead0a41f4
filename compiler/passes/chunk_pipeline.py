"""chunk-pipeline: split transfers into chunks and decide which steps may follow others chunk by chunk.

Chunk size.  From the file (`chunk 256 tokens` / `chunk 1 MiB`) when given; otherwise the cost
model picks the smallest whole number of tokens whose transfer time is at least
`LATENCY_FACTOR` times the link's per-chunk latency (so latency costs at most 1/LATENCY_FACTOR
of the bandwidth), never less than `MIN_CHUNK_BYTES`, and never smaller than the chunks of the
producers it follows (a consumer works at its producers' granularity).

Depth.  From the file, else `DEFAULT_DEPTH` (double buffering plus one).  Bounded by staging
buffers: a buffer declared with a capacity must hold `depth` chunks from each rank that writes
into it at once; the depth shrinks to fit, and a buffer that cannot hold one chunk from each
writer is an error located at its declaration.

Pipelining.  A step follows a data dependency chunk by chunk (it may start on chunk i as soon as
its producer has delivered chunk i) when both move tokens one by one: every data dependency
except metadata exchanges (their layout must be complete) and explicit `after` orderings.

IR: an `epcc.chunk_loop` marker before every chunked step, and `epcc.chunk` on the step op.
"""

from __future__ import annotations

import math

from mlir import ir

from ..diagnostics import Note
from ..ir import ops, query
from ..plan import Plan, PlanStep
from ..sema import model
from . import Pass, PassContext, register

LATENCY_FACTOR = 16
MIN_CHUNK_BYTES = 64 * 1024
DEFAULT_DEPTH = 3


def writers_per_rank(sched: model.Schedule, program: str, buffer: str) -> int:
    """How many distinct ranks write `buffer` on one rank (the worst rank)."""
    prog = sched.dispatch if program == "dispatch" else sched.combine
    if prog is None:
        return 1
    n = sched.topology.num_ranks
    writers: list[set[int]] = [set() for _ in range(n)]
    for st in prog.steps:
        if st.dest is None or st.dest.buffer.name != buffer:
            continue
        for r in range(n):
            for src, dst in st.flows(r):
                writers[dst].add(src)
    return max((len(w) for w in writers), default=1) or 1


def choose_chunk(st: model.Step | None, ps: PlanStep, bpt: int, link: model.LinkInfo | None) -> tuple[float, int | None]:
    """(chunk bytes, chunk tokens or None)."""
    if st is not None and st.chunk_tokens:
        return float(st.chunk_tokens * bpt), st.chunk_tokens
    if st is not None and st.chunk_bytes:
        return float(st.chunk_bytes), None
    if link is None:
        return float(max(MIN_CHUNK_BYTES, bpt)), max(1, math.ceil(MIN_CHUNK_BYTES / bpt))
    want = max(MIN_CHUNK_BYTES, link.latency * link.effective_bandwidth * LATENCY_FACTOR)
    tokens = max(1, math.ceil(want / bpt))
    return float(tokens * bpt), tokens


@register
class ChunkPipeline(Pass):
    name = "chunk-pipeline"
    description = "chunk sizes, pipeline depth bounded by staging buffers, chunk-by-chunk dependencies"

    def run(self, module, ctx: PassContext) -> None:
        sched = ctx.schedule
        plan: Plan = ctx.get("plan")
        wl = sched.workload
        links = sched.topology.links
        for ps in plan.steps:
            by_name = {s.name: s for s in plan.program_steps(ps.program)}
            prog = sched.dispatch if ps.program == "dispatch" else sched.combine
            st = _step(prog, ps.name) if prog is not None and ps.reverse_of is None else None
            src_step = _step(sched.dispatch, ps.reverse_of) if ps.reverse_of else None
            bpt = wl.bytes_per_token if ps.program == "dispatch" else wl.combine_bytes_per_token
            link = links.get(ps.link) if ps.link else None
            if ps.verb == "exchange":
                ps.num_chunks, ps.depth, ps.chunk_bytes = 1, 1, None
                continue
            chunk_bytes, chunk_tokens = choose_chunk(st or src_step, ps, bpt, link)
            explicit_chunk = bool((st or src_step) and ((st or src_step).chunk_tokens or (st or src_step).chunk_bytes))
            if not explicit_chunk:
                # Follow producers at their granularity: a consumer chunk never smaller than theirs.
                for d in ps.deps:
                    p = by_name.get(d)
                    if p is not None and p.verb != "exchange" and p.chunk_bytes and p.chunk_bytes > chunk_bytes:
                        chunk_bytes = p.chunk_bytes
                        chunk_tokens = max(1, int(round(chunk_bytes / bpt)))
                        chunk_bytes = float(chunk_tokens * bpt)
            biggest = max((f.bytes for f in ps.flows), default=0.0)
            ps.chunk_bytes = chunk_bytes
            ps.num_chunks = max(1, math.ceil(biggest / chunk_bytes)) if biggest > 0 else 1
            depth = (st.depth if st is not None and st.depth else None) or \
                    (src_step.depth if src_step is not None and src_step.depth else None) or DEFAULT_DEPTH
            dest = st.dest.buffer if st is not None and st.dest is not None else None
            if dest is not None and dest.role == "staging" and (dest.capacity_tokens or dest.capacity_bytes):
                cap = dest.capacity_bytes or dest.capacity_tokens * bpt
                writers = writers_per_rank(sched, ps.program, dest.name)
                fit = int(cap // (chunk_bytes * writers))
                if fit < 1:
                    ctx.diags.error(dest.span,
                                    f"buffer '{dest.name}' ({_cap_text(dest)}) cannot hold one chunk from each of "
                                    f"the {writers} rank(s) that write it: that needs {writers} x "
                                    f"{_chunk_text(chunk_bytes, chunk_tokens)} = {_mb(writers * chunk_bytes)}",
                                    Note(f"step '{ps.name}' writes it in chunks of {_chunk_text(chunk_bytes, chunk_tokens)}",
                                         st.span))
                    continue
                depth = min(depth, fit)
            ps.depth = max(1, min(depth, ps.num_chunks))
            exchanges = {s.name for s in plan.program_steps(ps.program) if s.verb == "exchange"}
            explicit = set(st.after) if st is not None else set()
            ps.pipelined_deps = tuple(d for d in ps.deps if d not in exchanges and d not in explicit)
        ctx.diags.raise_if_errors()
        self._annotate(module, ctx, plan)

    def _annotate(self, module, ctx: PassContext, plan: Plan) -> None:
        for kind in ("dispatch", "combine"):
            prog = query.program_module(module, kind)
            if prog is None:
                continue
            steps = query.step_ops(prog)
            for ps in plan.program_steps(kind):
                op = steps.get(ps.name)
                if op is None or ps.verb == "exchange":
                    continue
                bpt = plan.bytes_per_token if kind == "dispatch" else ctx.schedule.workload.combine_bytes_per_token
                tokens = int(ps.chunk_bytes // bpt) if ps.chunk_bytes else 0
                query.annotate(op, "chunk", {
                    "chunk_bytes": int(ps.chunk_bytes or 0), "num_chunks": ps.num_chunks, "depth": ps.depth,
                    "pipelined_after": ir.ArrayAttr.get([ir.StringAttr.get(d) for d in ps.pipelined_deps]),
                })
                loc = query.named_loc(op, f"{ps.name}.chunks")
                with ir.InsertionPoint(op), loc:
                    ops.chunk_loop(step=ps.name, chunks=ps.num_chunks, chunk_tokens=tokens, depth=ps.depth, loc=loc)


def _step(prog: model.Program | None, name: str | None) -> model.Step | None:
    if prog is None or name is None:
        return None
    try:
        return prog.step(name)
    except KeyError:
        return None


def _mb(b: float) -> str:
    return f"{b / 1e6:.2f} MB"


def _chunk_text(chunk_bytes: float, tokens: int | None) -> str:
    return f"{tokens} tokens ({_mb(chunk_bytes)})" if tokens else _mb(chunk_bytes)


def _cap_text(b: model.BufferInfo) -> str:
    return f"capacity {b.capacity_tokens} tokens" if b.capacity_tokens else f"capacity {b.capacity_bytes} B"
