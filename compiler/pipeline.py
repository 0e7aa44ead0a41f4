"""The compilation pipeline: an ordered list of stages, each of which can be printed.

`epcc compile FILE --emit STAGE` stops after STAGE and prints its result.  Stages run in order:

    ast    the parsed file (frontend)
    model  the checked schedule: ranks, relations, links, steps with their dependencies (sema)
    mlir   the `epcc` dialect IR, verified by MLIR against dialect/epcc.irdl.mlir

    <pass>  after `mlir`, one stage per pass of compiler/passes (PIPELINE order): the IR after it
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from epcc.dialect import new_context

from .diagnostics import CompileError, Diagnostic, SourceMap
from .textsafe import terminal
from .frontend import ast as ast_mod
from .frontend.parser import parse_file
from .ir.emit import emit_module, print_module, verify
from .passes import PIPELINE, PassContext, PassOptions
from .passes.manager import run_pipeline
from .sema import model
from .sema.check import analyze


@dataclass
class Compilation:
    """Everything one run of the pipeline produced, stage by stage."""

    path: str
    sources: SourceMap = field(default_factory=SourceMap)
    options: "PassOptions" = None  # type: ignore[assignment]
    print_after: Callable[[str, str], None] | None = None  # (pass name, IR text), for --print-ir-after-all
    passes: "PassContext | None" = None
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
    c.warnings = list(c.ast.warnings)  # sema reports them again with its own


def _sema(c: Compilation) -> None:
    c.schedule, c.warnings = analyze(c.ast)
    if c.options is not None and c.options.tokens is not None:
        wl = dataclasses.replace(c.schedule.workload, tokens=c.options.tokens)
        c.schedule = dataclasses.replace(c.schedule, workload=wl)
    hidden = getattr(c.options, "hidden", None) if c.options is not None else None
    if hidden is not None:
        wl = c.schedule.workload
        if wl.dtype == "fp8" and hidden % model.FP8_SCALE_GROUP:
            raise CompileError([Diagnostic(
                "error", f"--hidden {hidden}: {c.schedule.name} dispatches fp8, which needs a hidden size divisible "
                         f"by {model.FP8_SCALE_GROUP} (one scale per {model.FP8_SCALE_GROUP} channels)", None)])
        c.schedule = dataclasses.replace(c.schedule, workload=dataclasses.replace(wl, hidden=hidden))
    dtype = getattr(c.options, "dtype", None) if c.options is not None else None
    if dtype is not None:
        wl = c.schedule.workload
        if dtype == "fp8" and wl.hidden % model.FP8_SCALE_GROUP:
            raise CompileError([Diagnostic(
                "error", f"--dtype fp8: {c.schedule.name} has hidden {wl.hidden}, which fp8 dispatch needs divisible "
                         f"by {model.FP8_SCALE_GROUP} (one scale per {model.FP8_SCALE_GROUP} channels)", None)])
        c.schedule = dataclasses.replace(c.schedule, workload=dataclasses.replace(wl, dtype=dtype))
    layout = getattr(c.options, "layout", None) if c.options is not None else None
    if layout is not None:
        c.schedule = dataclasses.replace(c.schedule, workload=dataclasses.replace(c.schedule.workload, layout=layout))


def _mlir(c: Compilation) -> None:
    c.context = new_context()
    c.module = emit_module(c.schedule, c.context)


def _show_mlir(c: Compilation) -> str:
    return print_module(c.module)


def _pass_stage(name: str) -> Callable[[Compilation], None]:
    def run_passes(c: Compilation) -> None:
        if c.passes is None:
            c.passes = PassContext(c.schedule, c.options or PassOptions())
        done = c.passes.results.setdefault("_done", [])

        def after(pass_name: str, module) -> None:
            verify(module, what=f"the IR after pass '{pass_name}'")
            done.append(pass_name)
            if c.print_after is not None:
                c.print_after(pass_name, print_module(module))

        run_pipeline(c.module, c.passes, until=name, after_each=after, start=len(done))

    return run_passes


STAGES: list[Stage] = [
    Stage("ast", _parse, lambda c: ast_mod.dump(c.ast), "the parsed file"),
    Stage("model", _sema, lambda c: describe_schedule(c.schedule), "the checked schedule"),
    Stage("mlir", _mlir, _show_mlir, "epcc dialect IR (verified)"),
] + [Stage(p, _pass_stage(p), _show_mlir, f"the IR after pass {p}") for p in PIPELINE]


def stage_names() -> list[str]:
    return [s.name for s in STAGES]


def run(path: str, until: str = STAGES[-1].name, sources: SourceMap | None = None,
        options: PassOptions | None = None,
        print_after: Callable[[str, str], None] | None = None) -> Compilation:
    c = Compilation(path, sources or SourceMap(), options or PassOptions(), print_after)
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
    out = [f"schedule {s.name}" + (f"  # {terminal(s.title)}" if s.title else "")]
    out.append(f"topology {t.name}: " + " x ".join(f"{lv.count} {lv.name}" for lv in sp.levels)
               + f" = {t.num_ranks} ranks")
    out.append(f"  vendor {t.vendor} arch {t.arch}")
    for g in sp.groups.values():
        out.append(f"  group {g.name} = {g.size} {g.level}")
    for r in t.relations.values():
        ex = ", ".join(str(x) for x in r.of(0))
        out.append(f"  relation {r.name} = {r.text}    # rank 0 -> {{{ex}}}, fan-out {r.fanout}")
    for l in t.links.values():
        bw = f"{l.bandwidth / 1e9:g} GB/s" + (f" x {l.lanes}" if l.lanes > 1 else "")
        eff = f" at {l.efficiency * 100:g} %" if l.efficiency < 1 else ""
        sh = f", shared per {l.shared_per}" if l.shared_per else ""
        sh += f", fp32 atomics {l.atomics / 1e9:g} GB/s per pair" if l.atomics else ""
        sh += (", engines " + ", ".join(f"{e} {r / 1e9:g} GB/s" for e, r in l.engine_rates.items())
               if l.engine_rates else "")
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
            link = (f" over {st.link.name}" if st.link else "") + (f" engine {st.engine}" if st.engine else "")
            deps = f" after {', '.join(st.deps)}" if st.deps else ""
            out.append(f"  step {st.name}: {st.describe()}{link}{deps}    # line {st.span.line}")
    if s.combine is None:
        out.append("combine: reverse of dispatch (derived by the compiler)")
    return "\n".join(out)
