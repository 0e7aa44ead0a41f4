"""chunk-pipeline: split transfers into chunks and decide which steps may follow others chunk by chunk.

Chunk size.  From the file (`chunk 256 tokens` / `chunk 1 MiB`) when given; otherwise the cost
model picks the smallest whole number of tokens whose transfer time is at least
`LATENCY_FACTOR` times the link's per-chunk latency (so latency costs at most 1/LATENCY_FACTOR
of the bandwidth), never less than `MIN_CHUNK_BYTES`, and never smaller than the chunks of the
producers it follows (a consumer works at its producers' granularity).

An RDMA step (a link of kind rdma) whose file gives no chunk or no depth gets them from the
window model the simulator uses for the GPU proxy path (costmodel/rates.py, window_rate): of
`RDMA_CHUNK_TOKENS` x `RDMA_DEPTHS` with at most `RDMA_WINDOW_BYTES` in flight per channel, the
pair with the shortest time for the step's biggest flow alone, bytes / min(link, window) plus
the first chunk's staging and the last one's apply and latency: for each chunk size the
shallowest depth that reaches its best time, and of the chunk sizes within `RDMA_TIE` of the
fastest the one with the fewest chunks (the least proxy work).  The window counts each chunk's
staging and apply on one SM (the topology's `sm` rates), both latencies, and the link's `post`
(the proxy's host time per chunk, which also caps a channel at chunk / post), counted at
1 / `RDMA_HEADROOM` of what it models: chunks too small to amortise the post, or a window too
shallow for the round trip, lose.  Without `sm` rates the latency rule below holds.

Depth.  From the file, else `DEFAULT_DEPTH` (double buffering plus one).  Bounded by staging
buffers: a buffer declared with a capacity must hold `depth` chunks from each rank that writes
into it at once; the depth shrinks to fit, and a buffer that cannot hold one chunk from each
writer is an error located at its declaration.

Pipelining.  A step follows a data dependency chunk by chunk (it may start on chunk i as soon as
its producer has delivered chunk i) when both move tokens one by one: every data dependency
except metadata exchanges (their layout must be complete) and explicit `after` orderings.

Ramps.  A chunk is one SM's work, so a pipeline fills and drains a whole chunk at a time: the
consumer of an SM role waits for the first wave of whole chunks (64 tokens of a combine's
gather into partials: ~0.16 ms on one SM of H200, before the RDMA behind it moves a byte), and
the role that follows a producer gets the producer's last chunk on one SM while its other SMs
idle.  So an SM role's ends are cut finer (PlanStep.ramp_head / ramp_tail, plan.chunk_sizes):
one that others follow chunk by chunk starts with its first chunk's tokens in chunks of
1 / 2^k of a chunk, the next as many in chunks of 2 / 2^k, ..., and one that follows a producer
ends mirrored; k = the step's `ramp` (default `RAMP_HEAD_DEFAULT` / `RAMP_TAIL_DEFAULT`, and then no chunk below
`RAMP_MIN_BYTES`).  The middle keeps whole chunks.  RDMA steps keep uniform chunks (their credit
window is sized in chunks), as do copy-engine (DMA) steps, where a chunk is not one SM's work,
and steps without a chunk size.

IR: an `epcc.chunk_loop` marker before every chunked step, and `epcc.chunk` on the step op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlir import ir

from ..diagnostics import Note
from ..ir import ops, query
from ..plan import Plan, PlanStep, chunk_sizes
from ..sema import model
from ..costmodel.rates import THREAD_ENGINES, proxy_rates, sm_rates, window_rate, work_of
from . import Pass, PassContext, register

LATENCY_FACTOR = 16
MIN_CHUNK_BYTES = 64 * 1024
DEFAULT_DEPTH = 3
RDMA_CHUNK_TOKENS = (16, 32, 64, 128, 256, 512)
RDMA_DEPTHS = (2, 4, 8, 16)
RDMA_WINDOW_BYTES = 16 * 1024 * 1024  # in flight per channel: its landing slots (and the sender's slots)
RDMA_TIE = 0.01  # chunk sizes this close to the fastest count as fast: the fewest chunks wins
RDMA_SAME = 0.001  # depths this close to a chunk size's fastest count as equal: the shallowest wins
# The window a choice may count on: 1 / RDMA_HEADROOM of the modelled one.  On the GPU machine's
# emulated transport round trips ran up to ~2x the model (64-token chunks at 400 GB/s: ~120 us
# per 8 chunks against 64 modelled), and a window that only just covers the link loses it.
RDMA_HEADROOM = 1.5
# Default halvings of a followed step's head and of a following step's tail (a step's `ramp N`
# sets both).  3: 1/8, 1/4, 1/2 of a chunk, a role of 8 SMs spreads one chunk over its first or
# last wave.  Heads are whole by default: measured on 2 x H200 (2026-11-23, docs/rdma.md) the
# combine's RDMA started 77 us sooner behind a ramped gather but ended no sooner (the gather,
# 8 SMs at ~46 GB/s of partials, holds it) and the gather's extra chunks cost it ~1 %.
RAMP_HEAD_DEFAULT = 0
RAMP_TAIL_DEFAULT = 3
RAMP_MIN_BYTES = 64 * 1024  # the default ramp stops above this (an explicit `ramp N` goes down to one token)


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


def flow_bound_bytes(st: model.Step, program: str, wl: model.Workload, bpt: int) -> float | None:
    """The most bytes one rank can move to one other in dispatch step `st` when it reads only the
    ranks' own tokens (`input`): each token once (`dedup rank`) or once per expert (`dedup none`).
    None where a source is a staging buffer, or in combine: no bound as simple."""
    if program != "dispatch" or not st.sources or any(s.buffer.name != "input" for s in st.sources):
        return None
    return float(wl.tokens * bpt * (wl.topk if st.dedup == "none" else 1))


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


def rdma_step_time(flow_bytes: float, chunk: float, depth: int, link: model.LinkInfo, stage_bps: float,
                   apply_bps: float) -> float:
    """Seconds one channel of an RDMA step takes alone on the GPU proxy path (module docstring)."""
    bw = link.effective_bandwidth
    rate = min(bw, window_rate(chunk, depth, bw, link.latency, stage_bps, apply_bps, link.post) / RDMA_HEADROOM)
    return flow_bytes / rate + chunk / stage_bps + chunk / apply_bps + link.latency


@dataclass(frozen=True)
class RdmaChoice:
    chunk_bytes: float
    depth: int
    tokens: int | None  # None: the file's chunk, in bytes
    seconds: float  # the step's biggest flow alone, as the model estimates it

    def describe(self, link: model.LinkInfo) -> str:
        return (f"cost model: {self.seconds * 1e3:.3f} ms alone over '{link.name}' "
                f"({link.effective_bandwidth / 1e9:g} GB/s, post {link.post * 1e6:g} us)")


def choose_rdma_chunking(ps: PlanStep, bpt: int, link: model.LinkInfo, rates: dict[str, float],
                         chunk_fixed: float | None = None, depth_fixed: int | None = None,
                         min_chunk: float = 0.0) -> RdmaChoice | None:
    """The chunk and depth of an RDMA step from the window model (module docstring), the file's
    own chunk or depth kept, no chunk below `min_chunk` (its producers' chunks); None without the
    `sm` rates it needs."""
    if "copy" not in rates or work_of(ps, rates) not in rates:
        return None
    stage_bps, apply_bps = proxy_rates(rates, ps)
    biggest = max((f.bytes for f in ps.flows), default=0.0)
    if biggest <= 0:
        return None
    if chunk_fixed:
        chunks: list[tuple[float, int | None]] = [(chunk_fixed, None)]
    else:
        floor = max(MIN_CHUNK_BYTES, min_chunk)
        chunks = [(float(t * bpt), t) for t in RDMA_CHUNK_TOKENS if t * bpt >= floor]
        if not chunks:
            t = max(RDMA_CHUNK_TOKENS[-1], math.ceil(floor / bpt))
            chunks = [(float(t * bpt), t)]
    scored: list[tuple[float, int, float, int, int | None]] = []  # per chunk size: its shallowest fastest depth
    for chunk, tokens in chunks:
        n = ps.chunk_count(chunk)
        depths = [(rdma_step_time(biggest, chunk, d, link, stage_bps, apply_bps), d)
                  for d in sorted({min(d, n) for d in ((depth_fixed,) if depth_fixed else RDMA_DEPTHS)})
                  if depth_fixed or d == 1 or d * chunk <= RDMA_WINDOW_BYTES]
        if depths:
            best = min(t for t, _ in depths)
            t, d = min((x for x in depths if x[0] <= best * (1 + RDMA_SAME)), key=lambda x: x[1])
            scored.append((t, n, chunk, d, tokens))
    if not scored:
        return None
    fastest = min(x[0] for x in scored)
    t, _, chunk, d, tokens = min((x for x in scored if x[0] <= fastest * (1 + RDMA_TIE)), key=lambda x: (x[1], x[0]))
    return RdmaChoice(chunk, d, tokens, t)


@register
class ChunkPipeline(Pass):
    name = "chunk-pipeline"
    description = "chunk sizes, pipeline depth bounded by staging buffers, chunk-by-chunk dependencies"

    def run(self, module, ctx: PassContext) -> None:
        sched = ctx.schedule
        plan: Plan = ctx.get("plan")
        self.chosen: dict[tuple[str, str], str] = {}  # RDMA steps chunked by the cost model: why
        wl = sched.workload
        links = sched.topology.links
        rates = sm_rates(plan)  # the topology's `sm` line, as the simulator reads it
        too_small: set = set()  # chunk options already reported (a dispatch step's and its reverse's)
        resolved: dict[int, tuple] = {}  # id(plan step) -> (its file step, bytes per token, link): for the ramps
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
            given = st or src_step
            if given is not None and given.chunk_bytes and given.chunk_bytes < bpt:
                span = given.opt_spans.get("chunk") or given.span
                if (span.path, span.line, span.col) not in too_small:
                    too_small.add((span.path, span.line, span.col))
                    ctx.diags.error(span, f"a chunk of {given.chunk_bytes} B holds no whole token: one token of "
                                          f"{ps.program} is {bpt} B; give at least that, or the chunk in tokens")
                continue
            chunk_bytes, chunk_tokens = choose_chunk(given, ps, bpt, link)
            explicit_chunk = bool(given and (given.chunk_tokens or given.chunk_bytes))
            given_depth = given.depth if given is not None and given.depth else None
            # the largest chunk of the (non-exchange) steps it depends on
            producers = max((by_name[d].chunk_bytes or 0.0 for d in ps.deps
                             if d in by_name and by_name[d].verb != "exchange"), default=0.0)
            auto = None
            if ps.link_kind == "rdma" and link is not None and not (explicit_chunk and given_depth):
                auto = choose_rdma_chunking(ps, bpt, link, rates, chunk_bytes if explicit_chunk else None, given_depth,
                                            min_chunk=producers)
            if auto is not None:
                chunk_bytes, chunk_tokens = auto.chunk_bytes, (auto.tokens if not explicit_chunk else chunk_tokens)
                self.chosen[(ps.program, ps.name)] = auto.describe(link)
            if not explicit_chunk and producers > chunk_bytes:
                # Follow producers at their granularity: a consumer chunk never smaller than theirs.
                chunk_tokens = max(1, int(round(producers / bpt)))
                chunk_bytes = float(chunk_tokens * bpt)
            ps.chunk_bytes = chunk_bytes
            ps.num_chunks = ps.chunk_count(chunk_bytes)
            depth = given_depth or (auto.depth if auto is not None else DEFAULT_DEPTH)
            dest = st.dest.buffer if st is not None and st.dest is not None else None
            if dest is not None and dest.role == "staging" and (dest.capacity_tokens or dest.capacity_bytes):
                cap = dest.capacity_bytes or dest.capacity_tokens * bpt
                writers = writers_per_rank(sched, ps.program, dest.name)
                # a writer never has more in flight than its whole flow, where that is less than a chunk
                whole = flow_bound_bytes(st, ps.program, wl, bpt)
                per_writer = min(chunk_bytes, whole or chunk_bytes)
                fit = int(cap // (per_writer * writers))
                if fit < 1:
                    need = (_chunk_text(chunk_bytes, chunk_tokens) if per_writer == chunk_bytes else
                            f"{int(per_writer // bpt)} tokens ({_mb(per_writer)}: all one rank sends, less than a chunk)")
                    ctx.diags.error(dest.span,
                                    f"buffer '{dest.name}' ({_cap_text(dest)}) cannot hold one chunk from each of "
                                    f"the {writers} rank(s) that write it: that needs {writers} x {need} = "
                                    f"{_mb(writers * per_writer)}",
                                    Note(f"step '{ps.name}' writes it in chunks of {_chunk_text(chunk_bytes, chunk_tokens)}",
                                         st.span))
                    continue
                depth = min(depth, fit)
            ps.depth = max(1, min(depth, ps.num_chunks))
            exchanges = {s.name for s in plan.program_steps(ps.program) if s.verb == "exchange"}
            explicit = set(st.after) if st is not None else set()
            ps.pipelined_deps = tuple(d for d in ps.deps if d not in exchanges and d not in explicit)
            resolved[id(ps)] = (given, bpt, link)
        ctx.diags.raise_if_errors()
        for ps in plan.steps:
            if id(ps) in resolved:  # the pipelining of every step is known now: who follows whom
                self._ramp(plan, ps, *resolved[id(ps)])
        self._annotate(module, ctx, plan)

    @staticmethod
    def _ramp(plan: Plan, ps: PlanStep, given: model.Step | None, bpt: int, link: model.LinkInfo | None) -> None:
        """ramp_head / ramp_tail of a chunked SM role (module docstring), and its chunk count;
        `given` is the file's step (a reverse step's: the dispatch step it returns)."""
        engine = ps.effective_engine(link)
        if ps.link_kind == "rdma" or engine not in THREAD_ENGINES or not ps.chunk_bytes:
            return
        tokens = int(ps.chunk_bytes // bpt)
        explicit = given is not None and given.ramp is not None

        def halvings(want: int) -> int:
            k = 0
            while k < want:
                size = tokens >> (k + 1)
                if size < 1 or (not explicit and size * bpt < RAMP_MIN_BYTES):
                    break
                k += 1
            return k

        followed = any(ps.name in s.pipelined_deps for s in plan.program_steps(ps.program))
        ps.ramp_head = halvings(given.ramp if explicit else RAMP_HEAD_DEFAULT) if followed else 0
        ps.ramp_tail = halvings(given.ramp if explicit else RAMP_TAIL_DEFAULT) if ps.pipelined_deps else 0
        if ps.ramp_head or ps.ramp_tail:
            biggest = max((f.bytes for f in ps.flows), default=0.0)
            ps.num_chunks = max(1, len(chunk_sizes(round(biggest / ps.chunk_bytes * tokens), tokens,
                                                   ps.ramp_head, ps.ramp_tail)))

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
                attrs = {
                    "chunk_bytes": int(ps.chunk_bytes or 0), "num_chunks": ps.num_chunks, "depth": ps.depth,
                    "pipelined_after": ir.ArrayAttr.get([ir.StringAttr.get(d) for d in ps.pipelined_deps]),
                }
                if ps.ramp_head or ps.ramp_tail:
                    attrs["ramp"] = [ps.ramp_head, ps.ramp_tail]
                if (kind, ps.name) in self.chosen:
                    attrs["chosen_by"] = self.chosen[(kind, ps.name)]
                query.annotate(op, "chunk", attrs)
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
