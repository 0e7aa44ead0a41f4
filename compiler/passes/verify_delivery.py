"""verify-delivery: prove that every (token, destination rank) pair is delivered exactly once.

**What is proved.**  For the dispatch program: for every home rank h, every destination rank d
and every destination set D a token can have (d ∈ D), the number of the token's copies written
into d's `output` is exactly 1.  For a written-out combine program: every home's `result` gets
every rank's expert outputs exactly once, weighted exactly once (see
:mod:`epcc.analysis.combine_flow`).  A derived combine is checked by `derive-combine` with the
same engine.  And at rank level, in either program: every step that reads a staging buffer on a
rank reads a buffer that an earlier step fills *on that rank* (sema checks this per buffer only).

**How (dispatch).**  Route analysis (:mod:`epcc.analysis.flow`) gives, for each destination d,
the streams delivered into d's output; a stream of home h carries `conds`, rank sets S that the
token's destination set D must hit for the stream to exist (each `tokens for S` on its way adds
S; a write into output adds {d}: the permute's implicit selection, or the `tokens for <receiver>`
sema requires of a send/pull/copy into output).  A token with destination set D is delivered to d
once per stream of (h, d) whose conds D all hits.  So the count depends on D only through the
truth values "D hits S_i" of the few distinct sets S_1..S_m in those conds (sets containing d are
always hit and are dropped first).  We enumerate the truth assignments A ⊆ {1..m} and, for each,
decide exactly whether some *realizable* D has that pattern:

* D must contain d, must avoid every S_i with i ∉ A, and must hit every S_i with i ∈ A;
* a token picks `topk` distinct experts, and with E/R experts on every rank (sema requires an
  even split) its destination set D is realizable iff ceil(topk / (E/R)) <= |D| <= min(topk, R):
  at most topk ranks, and enough of them to hold topk experts (with one expert per rank, as at
  EP256 with 256 experts, every D has exactly topk ranks; "any 1 <= |D| <= topk" would admit
  destination sets no token can have).

Let the *atoms* be the regions of the Venn diagram of S_1..S_m (ranks with the same membership
mask).  Ranks in an avoided set are forbidden; the allowed ranks are those whose mask ⊆ A, and d
(mask 0) is one of them.  Hitting every S_i, i ∈ A, takes one rank from each of a family of
atoms whose masks unite to exactly A: g[A] = the fewest atoms whose masks unite to A, a DP over
bitmasks (g[U | a] <= g[U] + 1 for every atom a).  Extra ranks from allowed atoms change no truth
value, so the pattern A is realizable iff g[A] is finite and

    max(1 + g[A], ceil(topk / (E/R))) <= min(topk, R, #allowed ranks(A)).

For every realizable A the number of streams whose condition masks ⊆ A must be 1; the first A
(fewest hits first) where it is not gives a concrete D (d, the smallest rank of each covering
atom, padded with the smallest allowed ranks) for the error message.

Cost per (h, d) pair: O(2^m * (#atoms + m)) with m the number of distinct sets not containing d;
results are cached per (d, conds signature).  Every shipped schedule, and a DeepEP-style EP256
plan, has m = 0 for every pair (each delivered stream's conds reduce to {d}): one pattern, O(1).

**Node-limited routing** (`node_limit`) only removes destination sets (a token's experts span at
most L nodes); verifying over all realizable D without it is stronger, and is what we do.

Results: `ctx.results["verification"]` (a summary dict), and `epcc.verified` on the dispatch
(and written-out combine) program module: "exactly-once: H homes x D destinations, N destination
patterns checked".
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from ..analysis.findings import Problem, head_span, route_text
from ..analysis.flow import FlowAnalysis, Stream
from ..analysis.written_combine import WrittenCombine
from ..diagnostics import DiagnosticBag, Note, Span
from ..ir import query
from ..sema import model
from . import Pass, PassContext, register

#: Beyond this many distinct condition sets for one (home, destination) pair the exact
#: enumeration (2^m patterns) is skipped with a warning.  No real plan comes close.
MAX_SETS = 14

#: A dropped pair lists at most this many of its routes that exist but do not fire.
#: (Pairs that fail the same way, same kind and location, are reported once, with a count.)
MAX_NOTES_ROUTES = 4


# --------------------------------------------------------------------------- the engine


@dataclass(frozen=True)
class Failure:
    """A concrete destination set D under which a (home, d) pair is not delivered exactly once."""

    dest_set: tuple[int, ...]  # D, ascending
    fired: tuple[int, ...]  # indices of the routes that deliver under D
    missed: tuple[tuple[int, frozenset[int]], ...]  # (route index, a set D misses) for the others


class TooComplex(Exception):
    pass


class ExactlyOnce:
    """Decides "exactly one route fires for every realizable destination set D ∋ d"."""

    def __init__(self, num_ranks: int, topk: int, experts_per_rank: int):
        self.n = num_ranks
        self.kmax = min(topk, num_ranks)
        self.kmin = max(1, -(-topk // max(experts_per_rank, 1)))
        self.patterns = 0  # destination patterns (classes of D) checked, cache hits included
        self.pairs = 0
        self._cache: dict[tuple, tuple[Failure | None, int]] = {}

    def check(self, d: int, routes: Sequence[tuple[frozenset[int], ...]]) -> Failure | None:
        """`routes[i]` is the conds of route i; returns None if exactly one fires for every D."""
        self.pairs += 1
        rc = tuple(tuple(c for c in conds if d not in c) for conds in routes)
        if all(not c for c in rc):  # every route fires for every D ∋ d: one pattern
            self.patterns += 1
            if len(rc) == 1:
                return None
            return Failure(self._pad([d], lambda r: True), tuple(range(len(rc))), ())
        key = (d, rc)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._solve(d, rc)
            self._cache[key] = hit
        self.patterns += hit[1]
        return hit[0]

    # ------------------------------------------------------------------ exact enumeration
    def _solve(self, d: int, rc: tuple[tuple[frozenset[int], ...], ...]) -> tuple[Failure | None, int]:
        sets: list[frozenset[int]] = []
        index: dict[frozenset[int], int] = {}
        for conds in rc:
            for c in conds:
                if c not in index:
                    index[c] = len(sets)
                    sets.append(c)
        m = len(sets)
        if m > MAX_SETS:
            raise TooComplex(m)
        route_mask = [sum(1 << index[c] for c in conds) for conds in rc]
        # Venn atoms: membership mask -> ranks (ranks in no set form mask 0, d among them).
        rank_mask: dict[int, int] = defaultdict(int)
        for i, s in enumerate(sets):
            for r in s:
                rank_mask[r] |= 1 << i
        atoms: dict[int, list[int]] = defaultdict(list)
        for r, mk in rank_mask.items():
            atoms[mk].append(r)
        for v in atoms.values():
            v.sort()
        count0 = self.n - len(rank_mask)
        full = 1 << m
        # allowed[A] = #ranks whose mask ⊆ A (subset-sum / zeta transform).
        allowed = [0] * full
        allowed[0] = count0
        for mk, rs in atoms.items():
            allowed[mk] += len(rs)
        for i in range(m):
            bit = 1 << i
            for a in range(full):
                if a & bit:
                    allowed[a] += allowed[a ^ bit]
        # g[U] = fewest atoms whose masks unite to exactly U; parent for reconstruction.
        inf = 1 << 30
        g = [inf] * full
        parent: list[tuple[int, int] | None] = [None] * full
        g[0] = 0
        masks = sorted(atoms)
        for u in range(full):
            if g[u] == inf:
                continue
            for a in masks:
                v = u | a
                if v != u and g[u] + 1 < g[v]:
                    g[v] = g[u] + 1
                    parent[v] = (u, a)
        checked = 0
        for a in sorted(range(full), key=lambda x: (bin(x).count("1"), x)):
            if g[a] == inf:
                continue
            lo = max(1 + g[a], self.kmin)
            hi = min(self.kmax, allowed[a])
            if lo > hi:
                continue
            checked += 1
            fired = tuple(i for i, mk in enumerate(route_mask) if mk & ~a == 0)
            if len(fired) == 1:
                continue
            # A concrete D: d, the smallest rank of each covering atom, then padding.
            chosen = [d]
            u = a
            while u:
                pu, atom = parent[u]
                chosen.append(atoms[atom][0])
                u = pu
            dest = self._pad(chosen, lambda r, a=a: rank_mask.get(r, 0) & ~a == 0, lo)
            missed = []
            for i, conds in enumerate(rc):
                if i not in fired:
                    miss = next(c for c in conds if not (a >> index[c]) & 1)
                    missed.append((i, miss))
            return Failure(dest, fired, tuple(missed)), checked
        return None, checked

    def _pad(self, chosen: list[int], ok, size: int | None = None) -> tuple[int, ...]:
        """`chosen` plus the smallest allowed ranks until D reaches the smallest realizable size."""
        want = max(size or 0, self.kmin)
        out = set(chosen)
        r = 0
        while len(out) < want and r < self.n:
            if r not in out and ok(r):
                out.add(r)
            r += 1
        return tuple(sorted(out))


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
