"""The compilation pipeline: an ordered list of stages, each of which can be printed.

`epcc compile FILE --emit STAGE` stops after STAGE and prints its result.  Stages run in order:

    ast    the parsed file (frontend)
    model  the checked schedule: ranks, relations, links, steps with their dependencies (sema)
    mlir   the `epcc` dialect IR, verified by MLIR against dialect/epcc.irdl.mlir

Later passes register themselves after `mlir` (compiler/passes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .diagnostics import SourceMap
from .frontend import ast as ast_mod
from .frontend.parser import parse_file
from .sema import model
from .sema.check import analyze


@dataclass
class Compilation:
    """Everything one run of the pipeline produced, stage by stage."""

    path: str
    sources: SourceMap = field(default_factory=SourceMap)
    ast: ast_mod.File | None = None
    schedule: model.Schedule | None = None
    warnings: list = field(default_factory=list)
    context: Any = None  # mlir.ir.Context
    module: Any = None  # mlir.ir.Module


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[Compilation], None]
    show: Callable[[Compilation], str]
    help: str


def _parse(c: Compilation) -> None:
    c.ast = parse_file(c.path, c.sources)


def _sema(c: Compilation) -> None:
    c.schedule, c.warnings = analyze(c.ast)


def _mlir(c: Compilation) -> None:
    from .ir.emit import emit_module
    from epcc.dialect import new_context

    c.context = new_context()
    c.module = emit_module(c.schedule, c.context)


def _show_mlir(c: Compilation) -> str:
    from .ir.emit import print_module

    return print_module(c.module)


STAGES: list[Stage] = [
    Stage("ast", _parse, lambda c: ast_mod.dump(c.ast), "the parsed file"),
    Stage("model", _sema, lambda c: describe_schedule(c.schedule), "the checked schedule"),
    Stage("mlir", _mlir, _show_mlir, "epcc dialect IR (verified)"),
]


def stage_names() -> list[str]:
    return [s.name for s in STAGES]


def run(path: str, until: str = STAGES[-1].name, sources: SourceMap | None = None) -> Compilation:
    c = Compilation(path, sources or SourceMap())
    for st in STAGES:
        st.run(c)
        if st.name == until:
            break
    return c


def show(c: Compilation, stage: str) -> str:
    return next(s for s in STAGES if s.name == stage).show(c)


def describe_schedule(s: model.Schedule) -> str:
    """A readable dump of the checked model (`--emit model`)."""
    t = s.topology
    sp = t.space
    wl = s.workload
    out = [f"schedule {s.name}" + (f"  # {s.title}" if s.title else "")]
    out.append(f"topology {t.name}: " + " x ".join(f"{lv.count} {lv.name}" for lv in sp.levels)
               + f" = {t.num_ranks} ranks")
    for g in sp.groups.values():
        out.append(f"  group {g.name} = {g.size} {g.level}")
    for r in t.relations.values():
        ex = ", ".join(str(x) for x in r.of(0))
        out.append(f"  relation {r.name} = {r.text}    # rank 0 -> {{{ex}}}, fan-out {r.fanout}")
    for l in t.links.values():
        bw = f"{l.bandwidth / 1e9:g} GB/s" + (f" x {l.lanes}" if l.lanes > 1 else "")
        eff = f" at {l.efficiency * 100:g} %" if l.efficiency < 1 else ""
        sh = f", shared per {l.shared_per}" if l.shared_per else ""
        conn = f" connects {l.relation_text} ({len(l.pairs) // 2} pairs)" if l.kind != "local" else ""
        out.append(f"  link {l.name} {l.kind}: {bw}{eff}, {l.latency * 1e6:g} us, engine {l.engine}{sh}{conn}")
    out.append(f"workload: {wl.tokens} tokens/rank, hidden {wl.hidden} {wl.dtype}, top-{wl.topk} of {wl.experts} "
               f"({wl.placement}, {wl.experts_per_rank}/rank), {wl.bytes_per_token} B/token on the wire"
               + (f", node_limit {wl.node_limit} over {wl.node_limit_scope}" if wl.node_limit else "")
               + (", weights travel" if wl.weights_travel else ""))
    for p in s.programs:
        out.append(f"{p.kind}:")
        for b in p.buffers.values():
            cap = f" capacity {b.capacity_tokens} tokens" if b.capacity_tokens else (
                f" capacity {b.capacity_bytes} B" if b.capacity_bytes else "")
            out.append(f"  buffer {b.name} ({b.role}){cap}")
        for st in p.steps:
            link = f" over {st.link.name}" if st.link else ""
            deps = f" after {', '.join(st.deps)}" if st.deps else ""
            out.append(f"  step {st.name}: {st.describe()}{link}{deps}    # line {st.span.line}")
    if s.combine is None:
        out.append("combine: reverse of dispatch (derived by the compiler)")
    return "\n".join(out)
