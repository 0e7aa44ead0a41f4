"""The semantic checker's entry point: AST file -> :class:`~epcc.sema.model.Schedule`.

All semantic errors of a file are collected before the CompileError is raised.
"""

from __future__ import annotations

from ..diagnostics import CompileError, DiagnosticBag, Note, SourceMap, Span
from ..frontend import ast
from ..frontend.parser import parse_file
from ..limits import MAX_SCHEDULE_NAME
from . import model
from .program import resolve_program
from .topology import resolve_topology
from .workload import resolve_workload


def analyze(f: ast.File) -> tuple[model.Schedule, list]:
    """Resolve a parsed file.  Returns the schedule and its warnings; raises CompileError."""
    diags = DiagnosticBag()
    diags.items.extend(f.warnings)
    _single(f.schedule, "schedule name", diags)
    _single(f.topologies, "topology", diags)
    _single(f.workloads, "workload", diags)
    programs: dict[str, ast.Program] = {}
    for p in f.programs:
        if p.kind in programs:
            diags.error(p.head_span, f"duplicate {p.kind} program", Note("first defined here", programs[p.kind].head_span))
        else:
            programs[p.kind] = p
    reverse = None
    for rv in f.reverses:
        if rv.of.text != "dispatch":
            diags.error(rv.of.span, f"combine can only be the reverse of 'dispatch', not '{rv.of.text}'")
        if "combine" in programs:
            diags.error(rv.span, "combine is both written out and declared as the reverse of dispatch",
                        Note("written out here", programs["combine"].head_span))
        if reverse is not None:
            diags.error(rv.span, "combine is declared as the reverse of dispatch twice", Note("first here", reverse.span))
        reverse = reverse or rv
    end = f.span
    if not f.topologies:
        diags.error(_end(end), "no topology: describe the machine with 'topology NAME { levels ...; rank ...; link ... }'")
    if not f.workloads:
        diags.error(_end(end), "no workload: give 'workload { tokens ...; hidden ...; dtype ...; topk ...; experts ... }'")
    if "dispatch" not in programs:
        diags.error(_end(end), "no dispatch program: add 'dispatch { step ... }'")
    if "combine" not in programs and reverse is None:
        diags.error(_end(end), "no combine program: write 'combine { step ... }' or declare 'combine reverse of dispatch'")
    topo = resolve_topology(f.topologies[0], diags) if f.topologies else None
    wl = resolve_workload(f.workloads[0], topo, diags) if f.workloads else None
    progs: dict[str, model.Program] = {}
    if topo is not None:
        for kind, p in programs.items():
            rp = resolve_program(p, topo, wl, diags)
            if rp is not None:
                progs[kind] = rp
    named = f.schedule[0].name if f.schedule else f.topologies[0].name if f.topologies else None
    if named is not None and len(named.text) > MAX_SCHEDULE_NAME:
        notes = () if f.schedule else (Note("without a 'schedule NAME' line, the topology's name is the schedule's"),)
        diags.error(named.span, f"a schedule name of {len(named.text)} characters: at most {MAX_SCHEDULE_NAME} "
                    f"(it names the bundle's files, NAME.mlir and the generated sources)", *notes)
    diags.raise_if_errors()
    name = f.schedule[0].name.text if f.schedule else topo.name
    title = f.schedule[0].title if f.schedule else None
    sched = model.Schedule(name, title, f.path, topo, wl, progs["dispatch"], progs.get("combine"),
                           reverse.span if reverse else None)
    return sched, diags.warnings()


def check_file(path: str, sources: SourceMap | None = None) -> tuple[model.Schedule, list]:
    return analyze(parse_file(path, sources))


def _single(items, what: str, diags: DiagnosticBag) -> None:
    for extra in items[1:]:
        span = getattr(extra, "span")
        first = items[0]
        diags.error(_head(span), f"duplicate {what}", Note("first defined here", _head(first.span)))


def _head(span):
    return Span(span.path, span.line, span.col, span.line, span.col + 1)


def _end(span):
    return Span(span.path, span.end_line, max(span.end_col - 1, 1), span.end_line, max(span.end_col, 2))


__all__ = ["analyze", "check_file", "CompileError"]
