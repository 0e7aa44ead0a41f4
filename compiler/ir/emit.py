"""Lowering a checked :class:`~epcc.sema.model.Schedule` into the epcc dialect.

The emitted module mirrors the model one to one (the dialect's header comment shows its shape):
the topology with evaluated relations and link pairs, the workload, and each program as a
dataflow graph in which every step is one op whose ``!epcc.event`` result the steps depending on
it consume.  Nothing is optimised or decided here; passes do that on the IR.

Every op carries the location of the source it came from, so passes and backends can point
diagnostics and generated code back at the .sched file.  Locations are file ranges
(``loc("x.sched":41:3 to 42:60)``, end column exclusive like epcc spans); ops that define a value
wrap theirs in a name (``loc("push"(...))``), which :func:`print_module` uses to name the SSA
value (``%push``), so the printed IR reads like the schedule.

Sema has already rejected every user error, so an emitted module that fails verification is a
bug in epcc: :func:`emit_module` raises :class:`InternalError` with the printed IR.
"""

from __future__ import annotations

from mlir import ir

from ..dialect import load
from ..diagnostics import Span
from ..textsafe import mlir_text
from ..sema import model
from . import ops, query


class InternalError(Exception):
    """epcc built IR its own dialect rejects: a compiler bug, not a problem with the schedule."""


def emit_module(schedule: model.Schedule, ctx: ir.Context) -> ir.Module:
    """Build and verify the epcc module of a checked schedule in `ctx` (the dialect is loaded)."""
    load(ctx)
    with ctx:
        module = _Emitter(schedule).run()
        verify(module, what=f"the IR emitted for schedule '{schedule.name}'")
    return module


def verify(module: ir.Module, *, what: str = "the module") -> None:
    """Verify `module`; a failure is an :class:`InternalError` carrying the diagnostics and IR."""
    try:
        module.operation.verify()
    except ir.MLIRError as e:
        notes = "\n".join(f"  {d.location}: {d.message}" for d in e.error_diagnostics) or f"  {e}"
        # Generic form: the one form that prints invalid IR faithfully.
        text = module.operation.get_asm(enable_debug_info=True, print_generic_op_form=True,
                                        use_local_scope=True)
        raise InternalError(f"internal compiler error: {what} does not verify:\n{notes}\n"
                            f"--- IR ---\n{text}") from e


def print_module(module: ir.Module) -> str:
    """The module's text with locations; deterministic, and parseable by ir.Module.parse/mlir-opt.

    Locations are printed inline (local scope) rather than as `#loc` aliases at the end, so each
    op's line says where it came from; SSA values are named after their name locations.  The text
    ends with a newline, like any text file it is written to.
    """
    text = module.operation.get_asm(enable_debug_info=True, use_local_scope=True,
                                    use_name_loc_as_prefix=True)
    return text if text.endswith("\n") else text + "\n"


def span_loc(span: Span, name: str | None = None) -> ir.Location:
    """A source location for `span`, wrapped in a name location when `name` is given."""
    loc = ir.Location.file(mlir_text(span.path), span.line, span.col, span.end_line, span.end_col)
    return ir.Location.name(name, loc) if name is not None else loc


class _Emitter:
    def __init__(self, schedule: model.Schedule):
        self.s = schedule

    def run(self) -> ir.Module:
        s = self.s
        # The schedule as a whole has no span of its own: point at the file.
        module = ops.schedule_module(s.name, s.title, s.path, s.topology.num_ranks,
                                     loc=ir.Location.file(mlir_text(s.path), 1, 1))
        with ir.InsertionPoint(module.body):
            self._topology(s.topology)
            self._workload(s.workload)
            self._program(s.dispatch)
            if s.combine is not None:
                self._program(s.combine)
            else:
                # `combine reverse of dispatch`: a pass derives it; the container marks the job.
                ops.program_module("combine", derived_from="dispatch", loc=span_loc(s.combine_reverse_span))
        return module

    # ------------------------------------------------------------------ topology
    def _topology(self, t: model.Topology) -> None:
        top = ops.topology_module(t.name, loc=span_loc(t.span))
        query.annotate(top.operation, "vendor", t.vendor)  # whose machine (`vendor biren arch br166`)
        query.annotate(top.operation, "arch", t.arch)
        if t.sm_rates:  # bytes/s per SM by kind of work (the simulator's SM term)
            query.annotate(top.operation, "sm_rates_Bps", {k: float(v) for k, v in t.sm_rates.items()})
        if t.sm_launch:  # seconds per kernel launch (the simulator's launches of the direct kernels)
            query.annotate(top.operation, "sm_launch_s", float(t.sm_launch))
        if t.sm_meta:  # seconds per metadata pass (the simulator's metadata of the direct kernels)
            query.annotate(top.operation, "sm_meta_s", float(t.sm_meta))
        atomics = {l.name: float(l.atomics) for l in t.links.values() if l.atomics}
        if atomics:  # fp32 atomic adds into a peer per GPU pair, by link (the simulator's atomics term)
            query.annotate(top.operation, "atomics_Bps", atomics)
        post = {l.name: float(l.post) for l in t.links.values() if l.post}
        if post:  # the RDMA proxy's host time per chunk, by link (the simulator's window term)
            query.annotate(top.operation, "post_s", post)
        with ir.InsertionPoint(top.body):
            for lv in t.space.levels:
                ops.level(lv.name, lv.count, lv.depth, loc=span_loc(lv.span))
            # Groups, relations and links in source order (the model's dicts are in resolution order).
            for g in sorted(t.space.groups.values(), key=lambda g: g.span):
                ops.group(g.name, g.level, g.size, loc=span_loc(g.span))
            for r in sorted(t.relations.values(), key=lambda r: r.span):
                ops.relation(r.name, r.text, r.targets, loc=span_loc(r.span))
            links = ops.links_module(loc=span_loc(t.span))
            with ir.InsertionPoint(links.body):
                for lk in sorted(t.links.values(), key=lambda lk: lk.span):
                    op = ops.link(lk.name, lk.kind, bandwidth_Bps=lk.bandwidth, latency_s=lk.latency,
                                  engine=lk.engine, lanes=lk.lanes, efficiency=lk.efficiency,
                                  connects=lk.relation_text, pairs=lk.pairs, shared_per=lk.shared_per,
                                  loc=span_loc(lk.span))
                    if lk.engine_rates:  # the engines engine-selection chooses between, with their rates
                        query.annotate(op, "engines_Bps", {e: float(r) for e, r in lk.engine_rates.items()})

    def _workload(self, w: model.Workload) -> None:
        ops.workload(tokens=w.tokens, hidden=w.hidden, dtype=w.dtype, topk=w.topk, experts=w.experts,
                     placement=w.placement, node_limit=w.node_limit, node_limit_scope=w.node_limit_scope,
                     weights_travel=w.weights_travel, bytes_per_token=w.bytes_per_token,
                     combine_bytes_per_token=w.combine_bytes_per_token, loc=span_loc(w.span))

    # ------------------------------------------------------------------ programs
    def _program(self, p: model.Program) -> None:
        head = _head_span(p)
        mod = ops.program_module(p.kind, loc=span_loc(p.span))
        with ir.InsertionPoint(mod.body):
            bufs: dict[str, ir.Value] = {}
            for b in p.buffers.values():
                # Built-in buffers are declared by the program itself: point at its head.
                bufs[b.name] = ops.buffer(b.name, b.role, capacity_tokens=b.capacity_tokens,
                                          capacity_bytes=b.capacity_bytes, loc=span_loc(b.span or head, b.name))
            events: dict[str, ir.Value] = {}
            for st in p.steps:
                deps = [events[d] for d in st.deps]
                events[st.name] = self._step(st, bufs, deps)

    def _step(self, st: model.Step, bufs: dict[str, ir.Value], deps: list[ir.Value]) -> ir.Value:
        loc = span_loc(st.span, st.name)
        info = ops.StepInfo(st.name, st.title, chunk_tokens=st.chunk_tokens, chunk_bytes=st.chunk_bytes,
                            depth=st.depth, sms=st.sms, order=st.order, after=st.after, parallel=st.parallel)
        link = st.link.name if st.link is not None else None
        if st.verb == "exchange":
            return ops.exchange(deps, info, what=st.exchange_what, peers=st.exchange_peers.text, link=link, loc=loc)
        srcs = [bufs[a.buffer.name] for a in st.sources]
        dst = bufs[st.dest.buffer.name]
        # With no local link declared, local steps run on the default engine for local moves.
        engine = st.link.engine if st.link is not None else model.DEFAULT_ENGINE["local"]
        if st.verb == "permute":
            return ops.permute(srcs, dst, deps, info, link=link, engine=engine, loc=loc)
        if st.verb == "reduce":
            (src,) = srcs
            return ops.reduce(src, dst, deps, info, link=link, engine=engine, loc=loc)
        sel = self._selection(st)
        if st.verb == "copy":
            return ops.copy(srcs, dst, sel, deps, info, link=link, engine=engine, dedup=st.dedup, loc=loc)
        if st.verb in ("send", "pull"):
            if st.link is None or st.relation is None:
                raise InternalError(f"internal compiler error: step '{st.name}' ({st.span}) reached IR emission "
                                    f"without a resolved link and relation")
            return ops.transfer(srcs, dst, sel, deps, info, direction=st.direction, relation=st.relation.name,
                                src_relations=[a.relation.name if a.relation else None for a in st.sources],
                                link=st.link.name, link_kind=st.link.kind, engine=st.link.engine,
                                dedup=st.dedup, loc=loc)
        raise InternalError(f"internal compiler error: step '{st.name}' has unknown verb '{st.verb}'")

    def _selection(self, st: model.Step) -> ir.Value:
        sel = st.selection
        if sel is None:
            raise InternalError(f"internal compiler error: step '{st.name}' ({st.span}) has no token selection")
        return ops.select(sel.mode, sel.ranks.text if sel.ranks is not None else None,
                          loc=span_loc(sel.span, f"{st.name}.sel"))


def _head_span(p: model.Program) -> Span:
    """The program's keyword (`dispatch` / `combine`), where its built-in buffers come from."""
    s = p.span
    return Span(s.path, s.line, s.col, s.line, s.col + len(p.kind))
