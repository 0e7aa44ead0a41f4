"""verify-delivery: prove that every (token, destination rank) pair is delivered exactly once.

**What is proved.**  For the dispatch program: for every home rank h, every destination rank d
and every destination set D a token can have (d ∈ D), the number of the token's copies written
into d's `output` is exactly 1.  For a written-out combine program: every home's `result` gets
every rank's expert outputs exactly once, weighted exactly once (see
:mod:`epcc.analysis.written_combine`).  A derived combine is checked by `derive-combine` with the
same engine.  And at rank level, in either program: every step that reads a staging buffer on a
rank reads a buffer that an earlier step fills *on that rank* (sema checks this per buffer only).

**How (dispatch).**  Route analysis (:mod:`epcc.analysis.flow`) gives, for each destination d,
the streams delivered into d's output; a stream of home h carries `conds`, rank sets S that the
token's destination set D must hit for the stream to exist (each `tokens for S` on its way adds
S; a write into output adds {d}: the permute's implicit selection, or the `tokens for <receiver>`
sema requires of a send/pull/copy into output).  A token with destination set D is delivered to d
once per stream of (h, d) whose conds D all hits.  Whether that is exactly once for every
realizable D is decided exactly, pattern by pattern, by the engine of
:mod:`epcc.analysis.exactly_once`; where it is not, the engine gives a concrete D, and this
module turns it into the error: the routes that fire more than once, or, for a pair never
delivered, the routes that exist but do not fire and where the token's copies got stuck.

**Node-limited routing** (`node_limit`) only removes destination sets (a token's experts span at
most L nodes); verifying over all realizable D without it is stronger, and is what we do.

Results: `ctx.results["verification"]` (a summary dict), and `epcc.verified` on the dispatch
(and written-out combine) program module: "exactly-once: H homes x D destinations, N destination
patterns checked".
"""

from __future__ import annotations

import time
from collections import defaultdict

from ..analysis.exactly_once import ExactlyOnce, Failure, TooComplex
from ..analysis.findings import Problem, head_span, route_text
from ..analysis.flow import FlowAnalysis, Stream
from ..analysis.written_combine import WrittenCombine
from ..diagnostics import DiagnosticBag, Note, Span
from ..ir import query
from ..sema import model
from . import Pass, PassContext, register

#: A dropped pair lists at most this many of its routes that exist but do not fire.
#: (Pairs that fail the same way, same kind and location, are reported once, with a count.)
MAX_NOTES_ROUTES = 4


# --------------------------------------------------------------------------- text helpers


def ranks_text(ranks) -> str:
    """{0-3, 8, 10-11}: a rank set, runs compressed."""
    rs = sorted(ranks)
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if j == i else (f"{rs[i]}, {rs[j]}" if j == i + 1 else f"{rs[i]}-{rs[j]}"))
        i = j + 1
    return "{" + ", ".join(parts) + "}"


def dest_text(ranks) -> str:
    return "{" + ", ".join(str(r) for r in sorted(ranks)) + "}"


def times_text(k: int) -> str:
    return {2: "twice", 3: "three times"}.get(k, f"{k} times")


def join_and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def report(bag: DiagnosticBag, findings: list[Problem], what: str) -> None:
    """One error per group (kind, location), naming its first instance and counting the rest."""
    first: dict[tuple, Problem] = {}
    counts: dict[tuple, int] = defaultdict(int)
    for f in findings:
        first.setdefault(f.group, f)
        counts[f.group] += 1
    for g, f in first.items():
        notes = list(f.notes)
        more = counts[g] - 1
        if more:
            notes.append(Note(f"{more} more {what} fails the same way" if more == 1 else
                              f"{more} more {what}s fail the same way"))
        bag.error(f.span, f.message, *notes)


# --------------------------------------------------------------------------- rank-level staging


def check_staging(prog: model.Program, space: model.RankSpace, bag: DiagnosticBag) -> int:
    """Every staging read on a rank must follow a write of that buffer on that rank."""
    filled: dict[str, set[int]] = defaultdict(set)
    writers: dict[str, list[tuple[model.Step, set[int]]]] = defaultdict(list)
    n_err = 0
    n = space.num_ranks
    for st in prog.steps:
        if st.verb == "exchange":
            continue
        reported: set[str] = set()
        for r in range(n):
            flows = st.flows(r)
            for src in st.sources:
                if src.buffer.role != "staging" or src.text() in reported:
                    continue
                read_at = sorted({a for a, _ in flows})  # the source rank of every flow
                for q in read_at:
                    if q in filled[src.buffer.name]:
                        continue
                    where = "" if q == r else f" of {space.describe(q)}"
                    notes = [Note(f"step '{w.name}' fills '{src.buffer.name}' only on ranks {ranks_text(rs)}", w.span)
                             for w, rs in writers[src.buffer.name]]
                    bag.error(src.span, f"step '{st.name}' on {space.describe(r)} reads '{src.text()}'{where}, "
                                        f"which no earlier step fills on that rank", *notes)
                    reported.add(src.text())
                    n_err += 1
                    break
        if st.dest is not None and st.dest.buffer.role == "staging":
            wrote = {b for r in range(n) for _, b in st.flows(r)}
            filled[st.dest.buffer.name] |= wrote
            writers[st.dest.buffer.name].append((st, wrote))
    return n_err


# --------------------------------------------------------------------------- dispatch


class DispatchVerifier:
    def __init__(self, flow: FlowAnalysis, engine: ExactlyOnce, bag: DiagnosticBag):
        self.flow = flow
        self.sched = flow.sched
        self.space = flow.topo.space
        self.prog = flow.sched.dispatch
        self.engine = engine
        self.bag = bag
        self.findings: list[Problem] = []
        self.skipped = 0

    def run(self) -> None:
        n = self.flow.n
        pairs: list[dict[int, list[Stream]]] = [defaultdict(list) for _ in range(n)]  # [h][d]
        for d in range(n):
            for s in self.flow.deliveries[d]:
                pairs[s.home][d].append(s)
        for h in range(n):
            by_d = pairs[h]
            for d in range(n):
                streams = by_d.get(d, [])
                try:
                    fail = self.engine.check(d, [s.conds for s in streams])
                except TooComplex as e:
                    self.skipped += 1
                    self.bag.warning(head_span(self.prog), f"delivery of tokens of {self.space.describe(h)} to rank {d} "
                                                           f"not verified: {e.args[0]} distinct condition sets")
                    continue
                if fail is not None:
                    self.findings.append(self._finding(h, d, streams, fail))
        report(self.bag, self.findings, "(token home, destination) pair")

    # ------------------------------------------------------------------ messages
    def _finding(self, h: int, d: int, streams: list[Stream], fail: Failure) -> Problem:
        who = f"a token of {self.space.describe(h)} routed to ranks {dest_text(fail.dest_set)}"
        if fail.fired:
            fired = [streams[i] for i in fail.fired]
            routes = [route_text(h, s.path) for s in fired]
            step = self.prog.step(fired[-1].path[-1][0])
            notes = []
            other = {s.path[-1][0] for s in fired[:-1]} - {step.name}
            for name in sorted(other, key=lambda x: self.prog.step(x).index):
                notes.append(Note(f"step '{name}' delivers another copy", self.prog.step(name).span))
            return Problem(("dup", step.span), step.span,
                            f"{who} is delivered to rank {d} {times_text(len(fired))}: {join_and(routes)}", notes)
        notes: list[Note] = []
        span = None
        for i, miss in fail.missed[:MAX_NOTES_ROUTES]:
            s = streams[i]
            step, sel_span = self._selector(s, miss)
            notes.append(Note(f"route {route_text(h, s.path)} does not fire: "
                              f"{'step ' + repr(step) + ' selects' if step else 'it needs'} tokens routed to "
                              f"ranks {ranks_text(miss)}, and this token is not", sel_span))
            if span is None and sel_span is not None:
                span = sel_span
        if not streams:
            ends = self._dead_ends(h, set(fail.dest_set))
            for s, buf in ends:
                st = self.prog.step(s.path[-1][0])
                q = s.path[-1][2]
                readers = [t.name for t in self.prog.steps[st.index + 1:] if any(x.buffer.name == buf for x in t.sources)]
                goal = "place it into 'output'" if q == d else f"move it toward rank {d}"
                why = (f"no later step reads '{buf}'" if not readers else
                       f"{'the step that reads' if len(readers) == 1 else 'the steps that read'} '{buf}' later "
                       f"({', '.join(readers)}) {'does' if len(readers) == 1 else 'do'} not {goal}")
                notes.append(Note(f"it gets as far as '{buf}' on {self.space.describe(q)} "
                                  f"({route_text(h, s.path)}); {why}", st.span))
                if span is None:
                    span = st.span
            if not ends:
                notes.append(Note(f"no step moves it out of 'input' of rank {h}"))
            notes.insert(0, Note(f"no route of the dispatch program ends in 'output' of rank {d} for tokens of rank {h}"))
        span = span or head_span(self.prog)
        return Problem(("drop", span), span, f"{who} never reaches rank {d}", notes)

    def _selector(self, s: Stream, miss: frozenset[int]) -> tuple[str | None, Span | None]:
        """The step on the stream's path whose selection is `miss`, and that selection's span."""
        for step_name, a, b in s.path:
            st = self.prog.step(step_name)
            if st.verb == "permute":
                if miss == frozenset((b,)):
                    return st.name, st.span
                continue
            if st.selection is None or st.selection.ranks is None:
                continue
            r = b if st.verb == "pull" else a
            far = b if st.verb == "send" else (a if st.verb == "pull" else None)
            if st.selection.ranks.evaluate(r, far) == miss:
                return st.name, st.selection.span
        return None, None

    def _dead_ends(self, h: int, dest: set[int]) -> list[tuple[Stream, str]]:
        """The token's copies that exist under `dest` and got furthest (at most 2)."""
        found: list[tuple[Stream, str]] = []
        for buf, per_rank in self.flow.contents.items():
            if buf == "input":
                continue
            for q in range(self.flow.n):
                for s in per_rank[q]:
                    if s.home == h and all(c & dest for c in s.conds):
                        found.append((s, buf))
        # Leaves only: a copy another found copy descends from adds nothing.
        prefixes = {s.path[:k] for s, _ in found for k in range(len(s.path))}
        found = [x for x in found if x[0].path not in prefixes]
        found.sort(key=lambda x: (-len(x[0].path), [self.prog.step(p[0]).index for p in x[0].path], x[0].path))
        return found[:2]


# --------------------------------------------------------------------------- the pass


def verify_written_combine(cf: WrittenCombine, bag: DiagnosticBag) -> None:
    """Report the problems the written-out combine's stream analysis found."""
    report(bag, cf.problems, "(token home, contributing rank) pair")


@register
class VerifyDelivery(Pass):
    name = "verify-delivery"
    description = "prove every (token, destination rank) pair is delivered exactly once, for every routing"

    def run(self, module, ctx: PassContext) -> None:
        with module.context:
            self._run(module, ctx)

    def _run(self, module, ctx: PassContext) -> None:
        t0 = time.perf_counter()
        sched = ctx.schedule
        flow: FlowAnalysis = ctx.get("flow")
        space = sched.topology.space
        wl = sched.workload
        bag = ctx.diags
        n = space.num_ranks
        engine = ExactlyOnce(n, wl.topk, wl.experts_per_rank)
        ctx.results["exactly_once"] = engine
        summary: dict[str, object] = {"homes": n, "destinations": n}
        if check_staging(sched.dispatch, space, bag) == 0:
            v = DispatchVerifier(flow, engine, bag)
            v.run()
            summary.update(dispatch_ok=not v.findings and not v.skipped, dispatch_failures=len(v.findings),
                           pairs=engine.pairs, patterns=engine.patterns, skipped=v.skipped)
            if not v.findings and not v.skipped:
                query.annotate(query.program_module(module, "dispatch"), "verified",
                               f"exactly-once: {n} homes x {n} destinations, {engine.patterns} destination "
                               f"patterns checked")
        else:
            summary.update(dispatch_ok=False)
        if sched.combine is not None:
            if check_staging(sched.combine, space, bag) == 0:
                cf = WrittenCombine(sched, flow.routing)
                ctx.results["combine_flow"] = cf
                verify_written_combine(cf, bag)
                summary.update(combine="written", combine_ok=not cf.problems, combine_failures=len(cf.problems))
                if not cf.problems:
                    query.annotate(query.program_module(module, "combine"), "verified",
                                   f"exactly-once: {n} homes x {n} contributing ranks, every contribution weighted once")
            else:
                summary.update(combine="written", combine_ok=False)
        summary["seconds"] = time.perf_counter() - t0
        ctx.results["verification"] = summary
