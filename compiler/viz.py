"""`epcc viz`: the schedule DAG as a graphviz picture.

Steps are nodes, grouped into clusters by the tier of the machine they run across (on one rank,
between the ranks of a card, a VNode, a node, ...: the smallest level or group that contains
every pair of ranks the step moves data between).  Solid edges are data dependencies (labelled
with the buffer), dashed edges explicit `after` orderings, dotted lines `parallel with` hints.
Node colours give the link kind (p2p / d2d / rdma / local); labels give the expected volume.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import graphviz

from .analysis.flow import FlowAnalysis
from .diagnostics import CompileError, Diagnostic
from .palette import KIND_COLOR, KIND_FILL
from .sema import model
from .textsafe import dot_text

FORMATS = ("svg", "png", "dot", "pdf")


def tier(sched: model.Schedule, st: model.Step) -> str:
    """Smallest level/group holding every (src, dst) pair of the step, as a cluster label."""
    space = sched.topology.space
    if st.verb == "exchange":
        return "metadata"
    pairs = [(a, b) for r in range(space.num_ranks) for a, b in st.flows(r)]
    if all(a == b for a, b in pairs):
        return f"on each {space.rank_level.name}"
    # Scopes from innermost to outermost: levels and groups ordered by depth.
    scopes: list[tuple[float, str]] = [(lv.depth, lv.name) for lv in space.levels]
    scopes += [(g.depth - 0.5, g.name) for g in space.groups.values()]
    for _, name in sorted(scopes, reverse=True):
        if all(space.scope_key(a, name) == space.scope_key(b, name) for a, b in pairs):
            return f"within a {name}"
    return f"across {space.levels[0].name}s"


def _mb(x: float) -> str:
    return f"{x / 1e6:.1f} MB" if x >= 1e5 else f"{x / 1e3:.1f} KB"


def build_graph(sched: model.Schedule) -> graphviz.Digraph:
    flows = FlowAnalysis(sched)
    g = graphviz.Digraph(name=dot_text(sched.name), graph_attr={
        "rankdir": "LR", "fontname": "Helvetica", "fontsize": "11", "compound": "true",
        "label": _title(sched), "labelloc": "t", "newrank": "true",
    }, node_attr={"fontname": "Helvetica", "fontsize": "10", "shape": "box", "style": "rounded,filled"},
        edge_attr={"fontname": "Helvetica", "fontsize": "9"})
    prog = sched.dispatch
    g.node("input", "input\n(own tokens)", shape="cylinder", fillcolor="#ffffff")
    g.node("output", "output\n(expert-major)", shape="cylinder", fillcolor="#ffffff")
    clusters: dict[str, list[model.Step]] = {}
    for st in prog.steps:
        clusters.setdefault(tier(sched, st), []).append(st)
    for i, (label, steps) in enumerate(clusters.items()):
        # Local steps bracket the pipeline (first reorder, last permute): no box around them.
        local = label.startswith("on each")
        with g.subgraph(name=f"{'group' if local else 'cluster'}_{i}") as c:
            c.attr(label=dot_text(label), style="dashed", color="#999999", fontcolor="#555555")
            for st in steps:
                c.node(dot_text(st.name), _node_label(sched, st, flows), fillcolor=KIND_FILL[_kind(st)],
                       color=KIND_COLOR[_kind(st)], penwidth="1.5", tooltip=f"{dot_text(sched.path)}:{st.span.line}")
    writers: dict[str, list[str]] = {}
    for st in prog.steps:
        for src in st.sources:
            b = src.buffer.name
            if b == "input":
                g.edge("input", dot_text(st.name), color="#555555")
        for d in st.data_deps:
            dep = prog.step(d)
            if dep.verb == "exchange":  # the layout must be known before data moves
                g.edge(dot_text(d), dot_text(st.name), style="dashed", color="#888888", label=dot_text(dep.exchange_what))
                continue
            bufs = sorted({s.buffer.name for s in st.sources} & {dep.dest.buffer.name})
            g.edge(dot_text(d), dot_text(st.name), label=dot_text(", ".join(bufs)), color="#555555")
        for d in st.after:
            if d not in st.data_deps:
                g.edge(dot_text(d), dot_text(st.name), style="dashed", color="#aa5500", label="after")
        for p in st.parallel:
            if st.name < p or st.name not in prog.step(p).parallel:
                g.edge(dot_text(st.name), dot_text(p), style="dotted", dir="none", color="#888888", constraint="false",
                       label="parallel")
        if st.dest is not None:
            writers.setdefault(st.dest.buffer.name, []).append(st.name)
    for w in writers.get("output", []):
        g.edge(dot_text(w), "output", color="#555555")
    _legend(g)
    return g


def _kind(st: model.Step) -> str | None:
    return st.link.kind if st.link else None


def _title(sched: model.Schedule) -> str:
    t = sched.topology
    wl = sched.workload
    head = dot_text(sched.title or sched.name)
    return (f"{head}\n{t.num_ranks} ranks, {wl.tokens} tokens/rank x {wl.hidden} {wl.dtype}, "
            f"top-{wl.topk} of {wl.experts}; volumes: expected bytes per rank, uniform routing")


def _node_label(sched: model.Schedule, st: model.Step, flows: FlowAnalysis) -> str:
    lines = [dot_text(st.name if not st.title else f"{st.name}: {st.title}"), dot_text(st.describe())]
    v = flows.volumes[st.name]
    if st.verb == "exchange":
        lines.append(f"metadata {_mb(v.max_bytes)}")
    else:
        link = st.link
        via = f"{link.kind} '{dot_text(link.name)}'" if link else "no link (free)"
        fan = max((len(pf) for pf in v.per_flow), default=1)
        per = max((c for pf in v.per_flow for (_, _, c) in pf), default=0.0) * sched.workload.bytes_per_token
        vol = _mb(v.max_bytes)
        if fan > 1:
            vol += f" ({fan} x {_mb(per)})"
        lines.append(f"{via}: {vol}")
    opts = []
    if st.chunk_tokens:
        opts.append(f"chunk {st.chunk_tokens} tok")
    if st.chunk_bytes:
        opts.append(f"chunk {st.chunk_bytes} B")
    if st.depth:
        opts.append(f"depth {st.depth}")
    if st.order:
        opts.append(st.order)
    if opts:
        lines.append(", ".join(opts))
    lines.append(f"line {st.span.line}")
    return "\n".join(lines)


def _legend(g: graphviz.Digraph) -> None:
    with g.subgraph(name="cluster_legend") as c:
        c.attr(label="link kind", style="solid", color="#cccccc")
        prev = None
        for kind in ("p2p", "d2d", "rdma", "local"):
            n = f"legend_{kind}"
            c.node(n, kind, fillcolor=KIND_FILL[kind], color=KIND_COLOR[kind], fontsize="9", width="0.6", height="0.3")
            if prev:
                c.edge(prev, n, style="invis")
            prev = n


def render(sched: model.Schedule, out: str) -> Path:
    """Write the DAG to `out` (.svg, .png, .pdf or .dot).  Raises CompileError on user errors."""
    return _write(build_graph(sched), out)


def _write(g: graphviz.Digraph, out: str) -> Path:
    path = Path(out)
    fmt = path.suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise CompileError([Diagnostic("error", f"{out}: unknown picture format '.{fmt}'; use one of "
                                                f"{', '.join('.' + f for f in FORMATS)}", None)])
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "dot":
        path.write_text(g.source, encoding="utf-8")
        return path
    if shutil.which("dot") is None:
        raise CompileError([Diagnostic("error", "graphviz's 'dot' program is not installed; install Debian's "
                                                "'graphviz' (scripts/setup.sh does) or write a .dot file", None)])
    data = g.pipe(format=fmt)
    path.write_bytes(data)
    return path


# --------------------------------------------------------------------------- scheduled view


def overlap_groups(steps) -> list[list]:
    """Steps whose simulated [start, end] intervals overlap, transitively: the phases that run at once."""
    order = sorted(steps, key=lambda s: (s.start_s, s.end_s))
    groups: list[list] = []
    end = None
    for s in order:
        if groups and s.start_s < end:
            groups[-1].append(s)
            end = max(end, s.end_s)
        else:
            groups.append([s])
            end = s.end_s
    return groups


def _direct_program_label(program: str, pres, sm_model: dict) -> str:
    """A program's line under the direct kernels' model (sim/direct.py describe(), as `sm_model`):
    its one kernel's SMs per rank, shared by all its steps, and its launches, metadata passes and
    drain as describe() words them."""
    n = sm_model["sms"].get(program)
    if n is None:
        sms = "no SMs of its own"
    elif "copy" in sm_model.get("rates_gbps", {}):
        sms = f"{n} SMs per rank, shared by all its steps"
    else:
        sms = f"{n} SMs per rank (no SM pool: the topology gives no `sm` copy rate)"
    text = f"direct kernel: {sms}" + (f", {sm_model['per_program'][program]}" if n is not None else "")
    if pres.launch_s > 0:
        text += f" ({pres.launch_s * 1e3:.3f} ms of launch and metadata before its first step)"
    return text


def build_scheduled_graph(built, res) -> graphviz.Digraph:
    """The plan as the compiler scheduled it: per program, overlap groups (steps that run at the
    same time in the simulation), each step with its chunking, SM role and simulated interval;
    pipelined dependencies dashed ("chunk by chunk"), the critical path in red.

    The simulation's SM model decides what is drawn: under the table-driven kernels' model every
    step shows its plan chunking and kernel-formation's SM role; under the direct kernels' model
    (res.sm_model["model"] == "direct", sim/direct.py) the steps of a program share one kernel's
    pool of SMs and are not chunked, so the graph and program labels give that model (describe()'s
    text) and the steps show neither roles nor chunks."""
    plan = built.plan
    direct = res.sm_model.get("model") == "direct"
    label = (f"{dot_text(plan.schedule)}: scheduled plan, {dot_text(plan.routing)}; total {res.total_s * 1e3:.3f} ms "
             f"(serial {res.serial_s * 1e3:.3f} ms); red: critical path")
    if direct:
        label += f"\nSM model: {dot_text(res.sm_model['text'])}"
    g = graphviz.Digraph(name=dot_text(f"{plan.schedule}_scheduled"), graph_attr={
        "rankdir": "LR", "fontname": "Helvetica", "fontsize": "11", "compound": "true", "newrank": "true",
        "label": label, "labelloc": "t",
    }, node_attr={"fontname": "Helvetica", "fontsize": "10", "shape": "box", "style": "rounded,filled"},
        edge_attr={"fontname": "Helvetica", "fontsize": "9"})
    roles = {(k.program, r.step): (k.name, r) for k in plan.kernels for r in k.roles}
    for program, pres in res.programs.items():
        psteps = {s.name: s for s in plan.program_steps(program)}
        crit = set(pres.critical_path)
        crit_edges = set(zip(pres.critical_path, pres.critical_path[1:]))
        with g.subgraph(name=f"cluster_{program}") as pc:
            plabel = f"{program}: {pres.makespan_s * 1e3:.3f} ms"
            if direct:
                plabel += "\n" + dot_text(_direct_program_label(program, pres, res.sm_model))
            pc.attr(label=plabel, style="solid", color="#666666")
            for gi, members in enumerate(overlap_groups(pres.steps)):
                t0 = min(s.start_s for s in members) * 1e3
                t1 = max(s.end_s for s in members) * 1e3
                with pc.subgraph(name=f"cluster_{program}_g{gi}") as c:
                    c.attr(label=f"overlap group {gi + 1}: {t0:.3f}-{t1:.3f} ms", style="dashed", color="#999999",
                           fontcolor="#555555")
                    for st in members:
                        ps = psteps[st.name]
                        kind = ps.link_kind
                        lines = [dot_text(st.name + (f" ({ps.reverse_of})" if ps.reverse_of and ps.reverse_of != st.name
                                                     else "")),
                                 f"{dot_text(kind or 'no link')} '{dot_text(ps.link)}'" if ps.link else "metadata",
                                 f"{_mb(st.max_rank_bytes)} / rank"]
                        if direct:
                            if ps.verb != "exchange":
                                lines.append(f"in the {program} kernel, not chunked")
                        elif ps.verb != "exchange":
                            lines.append(f"{ps.num_chunks} chunks x {_mb(ps.chunk_bytes or 0)}, depth {ps.depth}")
                        kr = None if direct else roles.get((program, st.name))
                        if kr:
                            kname, r = kr
                            sm = f", SMs {r.sm_begin}-{r.sm_end - 1}" if r.sm_end > r.sm_begin else ""
                            lines.append(dot_text(f"{kname}: {r.role}") + sm)
                        lines.append(f"{st.start_s * 1e3:.3f}-{st.end_s * 1e3:.3f} ms")
                        on_path = st.name in crit
                        c.node(dot_text(f"{program}.{st.name}"), "\n".join(lines), fillcolor=KIND_FILL[kind],
                               color="#d62728" if on_path else KIND_COLOR[kind], penwidth="3" if on_path else "1.2")
            for st in pres.steps:
                for d in st.deps:
                    if d not in psteps:
                        continue
                    on_path = (d, st.name) in crit_edges
                    pipelined = d in st.pipelined_deps
                    g.edge(dot_text(f"{program}.{d}"), dot_text(f"{program}.{st.name}"), style="dashed" if pipelined else "solid",
                           color="#d62728" if on_path else "#555555", penwidth="2.5" if on_path else "1",
                           label="chunk by chunk" if pipelined else "")
    _legend(g)
    return g


def render_scheduled(built, res, out: str) -> Path:
    return _write(build_scheduled_graph(built, res), out)
