"""The dependency graph of a program's steps.

A data step waits for the metadata exchanges before it and for every step that writes a staging
buffer it reads (sema checks this per buffer; verify-delivery checks it per rank); `after` adds
explicit dependencies, and `parallel` is a hint that must not contradict them.  The graph must
be acyclic.
"""

from __future__ import annotations

from typing import Callable

from ..diagnostics import DiagnosticBag, Note
from . import model
from .hints import suggestion


def check_step_graph(steps: list[model.Step], buffers: dict[str, model.BufferInfo], diags: DiagnosticBag,
                     err: Callable[..., None]) -> None:
    """Set every step's data dependencies and check the graph they make with `after` and
    `parallel`: names that exist, no cycle, no `parallel` between dependent steps; warn about
    staging buffers nobody reads."""
    names = {s.name: s for s in steps}
    writers: dict[str, list[model.Step]] = {}
    exchanges: list[model.Step] = []
    for s in steps:
        # Data steps need the counts/layout that earlier metadata exchanges produce.
        deps: list[str] = [] if s.verb == "exchange" else [x.name for x in exchanges]
        if s.verb == "exchange":
            data_before = [t for t in steps if t.index < s.index and t.verb != "exchange"]
            if data_before:
                diags.warning(s.span, f"metadata exchange '{s.name}' comes after data step "
                                      f"'{data_before[0].name}', which cannot use its {s.exchange_what}",
                              "exchange metadata first; later data steps wait for it")
            exchanges.append(s)
        for src in s.sources:
            buf = src.buffer
            if buf.role == "staging":
                ws = writers.get(buf.name, [])
                if not ws:
                    later = [t for t in steps if t.index > s.index and t.dest is not None and t.dest.buffer.name == buf.name]
                    notes = [Note(f"'{buf.name}' is first written by step '{later[0].name}', which comes later",
                                  later[0].span)] if later else [f"no step writes '{buf.name}'"]
                    err(src.span, f"buffer '{buf.name}' is read by step '{s.name}' before any step writes it", *notes)
                    continue
                deps.extend(w.name for w in ws)
        s.data_deps = tuple(dict.fromkeys(deps))
        if s.dest is not None:
            writers.setdefault(s.dest.buffer.name, []).append(s)
    # Explicit dependencies and hints.
    for s in steps:
        for key in ("after", "parallel"):
            for n in getattr(s, key):
                if n not in names:
                    err(s.opt_spans[key], f"unknown step '{n}'", *suggestion(n, names))
    if diags.has_errors:
        return
    _cycles(steps, names, err)
    if diags.has_errors:
        return
    anc = _ancestors(steps)
    for s in steps:
        for n in s.parallel:
            if n == s.name:
                err(s.opt_spans["parallel"], f"step '{s.name}' is said to run in parallel with itself")
            elif n in anc[s.name] or s.name in anc[n]:
                first, second = (n, s.name) if n in anc[s.name] else (s.name, n)
                err(s.opt_spans["parallel"],
                    f"steps '{s.name}' and '{n}' cannot run in parallel: '{second}' depends on '{first}'",
                    _why(names[second], first))
    # Buffers nobody reads / writes.
    read = {src.buffer.name for s in steps for src in s.sources}
    written = {s.dest.buffer.name for s in steps if s.dest is not None}
    for name, b in buffers.items():
        if b.role != "staging":
            continue
        if name not in read and name not in written:
            diags.warning(b.span, f"buffer '{name}' is never used")
        elif name not in read:
            diags.warning(b.span, f"data written to buffer '{name}' is never read")


def _cycles(steps: list[model.Step], names: dict[str, model.Step], err: Callable[..., None]) -> None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> bool:
        state[n] = 1
        stack.append(n)
        for d in names[n].deps:
            if state.get(d) == 1:
                cyc = stack[stack.index(d):] + [d]
                # Report at the explicit `after` that closes the cycle.
                culprit = next((names[x] for x in cyc if names[x].after and any(
                    y in names[x].after for y in cyc)), names[n])
                span = culprit.opt_spans.get("after", culprit.span)
                err(span, "dependency cycle: " + " -> ".join(reversed(cyc)),
                    "a step waits for the steps it names in 'after' and for the steps whose buffers it reads")
                return True
            if state.get(d) is None and visit(d):
                return True
        stack.pop()
        state[n] = 2
        return False

    for s in steps:
        if state.get(s.name) is None and visit(s.name):
            return


def _ancestors(steps: list[model.Step]) -> dict[str, set[str]]:
    names = {s.name: s for s in steps}
    memo: dict[str, set[str]] = {}

    def anc(n: str) -> set[str]:
        if n not in memo:
            memo[n] = set()
            acc: set[str] = set()
            for d in names[n].deps:
                acc.add(d)
                acc |= anc(d)
            memo[n] = acc
        return memo[n]

    return {s.name: anc(s.name) for s in steps}


def _why(step: model.Step, dep: str) -> str:
    if dep in step.after:
        return f"'{step.name}' says 'after {dep}'"
    if dep in step.data_deps:
        return f"'{step.name}' reads what '{dep}' writes"
    return f"'{step.name}' waits for '{dep}' through other steps"
