"""Partial sums through a combine program: who contributes what to every token's result.

Combine runs dispatch backwards: at every rank d, `output` holds the expert outputs of the tokens
dispatch delivered there, and every home rank h must end with, in `result`, the weighted sum of
its tokens' expert outputs over every rank, each rank counted once and each (token, expert)
weight applied once.  A rank contributes only for the tokens routed to it, so "every rank" is
the complete set whatever the routing.

Two analyses:

* :class:`~epcc.analysis.written_combine.WrittenCombine` follows a written-out
  `combine { ... }` program, piece by piece (see its module); it is importable from here too, so
  that the passes take both analyses from one place.

* :class:`AdjointCombine`, in this module, follows a combine derived from dispatch (`combine
  reverse of dispatch`, built by the derive-combine pass as a list of :class:`CombineOp`).  Each
  op returns, for the copies one dispatch step moved out of one of its source buffers, the
  partial sums those copies gathered downstream (the dispatch handle identifies them, as in
  DeepEP's combine), so partials are keyed by copy (home, dispatch path).  Running the ops in
  order checks that each copy's partial is complete when it is returned (every downstream copy
  that delivered something has been returned into it), counts the weight applications per
  delivery, and collects at each home the contributions (destination rank, delivery conditions)
  that the exactly-once engine of verify-delivery then checks for every destination set.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from itertools import combinations
from typing import Iterable

from ..diagnostics import Note, Span
from ..sema import model
from .findings import CombineVolume, Hop, Problem, route_text
from .flow import FlowAnalysis
from .routing import Routing, canon
from .written_combine import WrittenCombine  # noqa: F401  (re-exported: the passes import both analyses from here)


@dataclass
class CombineOp:
    """One step of a derived combine: the reverse of dispatch step `reverse_of` for the copies
    it moved out of its source buffer `source`."""

    name: str
    reverse_of: str
    source: str  # the dispatch buffer the copies came from (their partials return into it)
    verb: str  # send | pull | copy | reduce
    src_buffer: str  # combine buffer read ("output" for a weighted reduce)
    dst_buffer: str  # combine buffer accumulated into
    weighted: bool  # applies the routing weights (the reverse of a write into output)
    deps: tuple[str, ...]
    step: model.Step  # the dispatch step

    @property
    def span(self) -> Span:
        return self.step.span


def partial_names(disp: model.Program) -> dict[str, str]:
    """Dispatch buffer -> the combine buffer holding its copies' partial sums."""
    out = {"input": "result", "output": "output"}
    taken = {"result", "output"}
    for b in disp.buffers.values():
        if b.role != "staging":
            continue
        name = b.name
        while name in taken:
            name += "_partial"
        out[b.name] = name
        taken.add(name)
    return out


REVERSE_VERB = {"send": "pull", "pull": "send", "copy": "copy", "permute": "reduce"}


def derive_ops(sched: model.Schedule) -> list[CombineOp]:
    """The adjoint of dispatch: its data steps in reverse order, one op per (step, source buffer).

    An op waits for the ops that reverse the dispatch steps depending on its step (those read
    what it wrote, or were ordered after it): their partial sums must be in before it returns
    its own.  Metadata exchanges have no reverse (combine reuses dispatch's layout)."""
    disp = sched.dispatch
    pname = partial_names(disp)
    consumers: dict[str, list[model.Step]] = defaultdict(list)
    for y in disp.steps:
        if y.verb == "exchange":
            continue
        for x in y.deps:
            consumers[x].append(y)
    ops_of: dict[str, list[tuple[str, str]]] = {}  # dispatch step -> [(op name, source buffer)]
    out: list[CombineOp] = []
    for x in reversed(disp.steps):
        if x.verb == "exchange":
            continue
        into_output = x.dest.buffer.role == "sink"
        verb = "reduce" if into_output and x.verb in ("copy", "permute") else REVERSE_VERB[x.verb]
        # A consumer that reads what x wrote: wait for its ops returning into x's destination;
        # one ordered after x by `after`: wait for all of its ops.
        deps = tuple(dict.fromkeys(
            o for y in consumers[x.name] for o, src in ops_of[y.name]
            if x.name in y.after or src == x.dest.buffer.name))
        names = []
        for a in x.sources:
            name = x.name if len(x.sources) == 1 else f"{x.name}.{a.buffer.name}"
            out.append(CombineOp(name, x.name, a.buffer.name, verb,
                                 "output" if into_output else pname[x.dest.buffer.name], pname[a.buffer.name],
                                 into_output, deps, x))
            names.append((name, a.buffer.name))
        ops_of[x.name] = names
    return out


@dataclass(frozen=True)
class Contribution:
    dest: int  # the rank whose expert outputs these are
    conds: tuple[frozenset[int], ...]  # the delivery's conditions
    path: tuple[Hop, ...]  # the dispatch path of the delivery (combine runs it backwards)


def p_union(routing: Routing, base: tuple[frozenset[int], ...], contribs: Iterable[Contribution]) -> tuple[float, bool]:
    """P(the token's copy returns something) = P(∪ over its downstream deliveries s of
    "D hits all of s.conds"), and whether the value is exact.

    Every delivery s downstream of the copy has conds implying the copy's `base` and containing
    {s.dest}.  When the rest of s.conds is implied by `base` or contains s.dest ("simple", the
    case of every shipped plan), s's event is  base ∧ hit({s.dest}),  and the union over simple
    deliveries is  base ∧ hit(U), U = their destinations: one p_hit_all.  Other deliveries add
    their own conjunctions, combined by inclusion-exclusion (up to 10 events; beyond, the union
    bound, flagged inexact)."""
    simple: set[int] = set()
    others: list[tuple[frozenset[int], ...]] = []
    for c in contribs:
        if all(c.dest in s or any(b <= s for b in base) for s in c.conds):
            simple.add(c.dest)
        else:
            others.append(c.conds)
    events: list[tuple[frozenset[int], ...]] = []
    if simple:
        events.append(canon(tuple(base) + (frozenset(simple),)))
    events.extend(dict.fromkeys(canon(o) for o in others))
    if not events:
        return 0.0, True
    if len(events) > 10:
        return min(routing.p_hit_all(base), sum(routing.p_hit_all(e) for e in events)), False
    acc = 0.0
    for k in range(1, len(events) + 1):
        sign = 1.0 if k % 2 else -1.0
        for js in combinations(events, k):
            acc += sign * routing.p_hit_all(canon(tuple(c for e in js for c in e)))
    return max(0.0, min(1.0, acc)), True


class AdjointCombine:
    """Runs the ops of a derived combine over per-copy partial sums (see the module docstring)."""

    kind = "derived"

    def __init__(self, flow: FlowAnalysis, ops: list[CombineOp]):
        self.flow = flow
        self.ops = ops
        self.sched = flow.sched
        disp = self.sched.dispatch
        n = self.n = flow.n
        wl = self.sched.workload
        self.problems: list[Problem] = []
        self.inexact = 0
        dest_of = {s.name: s.dest.buffer.name for s in disp.steps if s.dest is not None}

        def buffer_of(path: tuple[Hop, ...]) -> str:
            return dest_of[path[-1][0]] if path else "input"

        # Live copies: those with a delivery downstream (or deliveries themselves).
        live: set[tuple[int, tuple[Hop, ...]]] = set()
        self.delivery_keys: list[tuple[int, tuple[Hop, ...]]] = []
        for d in range(n):
            for s in flow.deliveries[d]:
                self.delivery_keys.append((s.home, s.path))
                for k in range(len(s.path) + 1):
                    live.add((s.home, s.path[:k]))
        children: dict[tuple[int, tuple[Hop, ...]], list[tuple[Hop, ...]]] = defaultdict(list)
        order = {s.name: s.index for s in disp.steps}
        for h, p in sorted(live, key=lambda k: (k[0], [(order[x[0]], x[1], x[2]) for x in k[1]])):
            if p:
                children[(h, p[:-1])].append(p)
        partial: dict[tuple[int, tuple[Hop, ...]], list[Contribution]] = defaultdict(list)
        returned: set[tuple[int, tuple[Hop, ...]]] = set()
        returned_by: dict[tuple[int, tuple[Hop, ...]], str] = {}
        self.weights_applied: dict[tuple[int, tuple[Hop, ...]], int] = defaultdict(int)
        self.volumes: dict[str, CombineVolume] = {}
        bpt = wl.combine_bytes_per_token
        for op in ops:
            x = op.step
            copies = [0.0] * n
            per_flow: list[list[tuple[int, int, float]]] = [[] for _ in range(n)]
            for r in range(n):
                acc: dict[tuple[int, int], float] = {}
                for a, b in x.flows(r):
                    acc[(b, a)] = 0.0
                for c in flow.moved[x.name][r]:
                    if buffer_of(c.path[:-1]) != op.source:
                        continue
                    _, a, b = c.path[-1]
                    key = (c.home, c.path)
                    if op.weighted:
                        contribs = [Contribution(b, c.conds, c.path)]
                        self.weights_applied[key] += 1
                        vol = (flow.expected_rows(c.conds, b) if x.verb == "permute" or x.dedup == "none"
                               else flow.expected_tokens(c.conds))
                    else:
                        if key not in live:
                            continue  # a copy that delivered nothing returns nothing
                        late = [p for p in children[key] if (c.home, p) not in returned]
                        if late:
                            self._late(op, c.home, c.path, late[0])
                        contribs = partial.get(key, [])
                        p, exact = p_union(flow.routing, c.conds, contribs)
                        self.inexact += not exact
                        vol = wl.tokens * p
                    if key in returned:
                        self.problems.append(Problem(
                            ("twice", x.span), x.span,
                            f"combine steps '{returned_by[key]}' and '{op.name}' both return the partial sums of "
                            f"the copy {route_text(c.home, c.path)}"))
                    returned.add(key)
                    returned_by[key] = op.name
                    partial[(c.home, c.path[:-1])].extend(contribs)
                    acc[(b, a)] = acc.get((b, a), 0.0) + vol
                per_flow[r] = [(s, t, v) for (s, t), v in acc.items()]
                copies[r] = sum(acc.values())
            self.volumes[op.name] = CombineVolume(op.name, copies, [c * bpt for c in copies], per_flow)
        # What reaches `result` (the reverse of `input`) at each home.
        self.result: list[list[Contribution]] = [partial.get((h, ()), []) for h in range(n)]

    def _late(self, op: CombineOp, h: int, path, child) -> None:
        disp = self.sched.dispatch
        y = disp.step(child[-1][0])
        self.problems.append(Problem(
            ("late", op.span), op.span,
            f"combine step '{op.name}' returns the partial sums of the copy {route_text(h, path)} before the "
            f"reverse of dispatch step '{y.name}' has added what that copy delivered through it "
            f"({route_text(h, child)})",
            [Note(f"dispatch step '{y.name}' moves the copy on", y.span)]))
