"""Partial sums through a written-out `combine { ... }` program (:class:`WrittenCombine`).

A *piece* is one rank's contribution to the tokens of one home; a buffer on a rank holds, per
home, the pieces summed there so far.  `output` at d starts with d's piece for every home,
unweighted (expert rows).  Transfers select by home (`tokens of S`, `all tokens`) and ACCUMULATE
into their destination: pieces of the same home meeting in one buffer are summed; meeting a
contributor already there is a double count.  `reduce SRC into DST` applies the routing weights
to unweighted pieces (pieces already weighted are just summed) and, into `result`, takes the
executing rank's own tokens (the implicit selection sema describes).  At the end every home's
`result` must hold every rank's piece, weighted.  Expected volumes: an unweighted piece of rank
d is one row per (token, expert of d), T * rows({d}); a weighted partial with contributors C is
one partial per token that hits C, T * P(hit C).
"""

from __future__ import annotations

from collections import defaultdict

from ..diagnostics import Note
from ..sema import model
from .findings import CombineVolume, Hop, Problem, head_span, route_text
from .routing import Routing


def _exchange_volume(st: model.Step, wl: model.Workload, n: int) -> CombineVolume:
    meta = wl.experts * 4 if st.exchange_what == "counts" else wl.tokens * wl.topk * 4
    per_flow, byts = [], []
    for r in range(n):
        peers = sorted(st.exchange_peers.evaluate(r, None) - {r})
        per_flow.append([(r, p, 0.0) for p in peers])
        byts.append(float(meta * len(peers)))
    return CombineVolume(st.name, [0.0] * n, byts, per_flow)


class WrittenCombine:
    """Pieces through a written-out combine program (see the module docstring)."""

    kind = "written"

    def __init__(self, sched: model.Schedule, routing: Routing):
        self.sched = sched
        self.prog = sched.combine
        self.space = sched.topology.space
        self.wl = sched.workload
        self.routing = routing
        self.n = n = self.space.num_ranks
        # contents[(buffer, rank)][home][contributor] = (path, weighted)
        self.contents: dict[tuple[str, int], dict[int, dict[int, tuple[tuple[Hop, ...], bool]]]] = defaultdict(dict)
        for d in range(n):
            self.contents[("output", d)] = {h: {d: ((), False)} for h in range(n)}
        self.problems: list[Problem] = []
        self.volumes: dict[str, CombineVolume] = {}
        self._rows = [self.wl.tokens * routing.rows((frozenset((d,)),), d) for d in range(n)]
        for st in self.prog.steps:
            self.volumes[st.name] = self._run(st)
        self._check_results()

    def _expected(self, pieces: dict[int, tuple[tuple[Hop, ...], bool]]) -> float:
        raw = [c for c, (_, w) in pieces.items() if not w]
        done = frozenset(c for c, (_, w) in pieces.items() if w)
        v = sum(self._rows[c] for c in raw)
        if done:
            v += self.wl.tokens * self.routing.p_hit_all((done,))
        return v

    def _run(self, st: model.Step) -> CombineVolume:
        n = self.n
        if st.verb == "exchange":
            return _exchange_volume(st, self.wl, n)
        copies = [0.0] * n
        per_flow: list[list[tuple[int, int, float]]] = [[] for _ in range(n)]
        writes: list[tuple[int, int, dict]] = []  # (rank, home, pieces)
        dest = st.dest.buffer.name
        into_result = st.dest.buffer.role == "sink"
        for r in range(n):
            if st.verb == "reduce":
                part = self.contents.get((st.sources[0].buffer.name, r), {})
                homes = [r] if into_result else sorted(part)
                flow = 0.0
                for h in homes:
                    pieces = part.get(h)
                    if not pieces:
                        continue
                    flow += self._expected(pieces)
                    writes.append((r, h, {c: (p + ((st.name, r, r),), True) for c, (p, _) in pieces.items()}))
                copies[r] += flow
                per_flow[r].append((r, r, flow))
                continue
            for a, b in st.flows(r):
                far = b if st.verb == "send" else (a if st.verb == "pull" else None)
                sel = st.selection
                homes = None if sel is None or sel.mode == "all" else sel.ranks.evaluate(r, far)
                flow = 0.0
                for src in st.sources:
                    part = self.contents.get((src.buffer.name, a), {})
                    for h in sorted(part):
                        if homes is not None and h not in homes:
                            continue
                        pieces = part[h]
                        flow += self._expected(pieces)
                        writes.append((b, h, {c: (p + ((st.name, a, b),), w) for c, (p, w) in pieces.items()}))
                copies[r] += flow
                per_flow[r].append((a, b, flow))
        for rank, h, pieces in writes:
            held = self.contents[(dest, rank)].setdefault(h, {})
            for c, (p, w) in pieces.items():
                if c in held:
                    self._double(st, dest, rank, h, c, held[c][0], p)
                    continue
                held[c] = (p, w)
        bpt = self.wl.combine_bytes_per_token
        return CombineVolume(st.name, copies, [c * bpt for c in copies], per_flow)

    # ------------------------------------------------------------------ problems
    def _double(self, st: model.Step, buf: str, rank: int, h: int, c: int, p1, p2) -> None:
        sp = self.space
        self.problems.append(Problem(
            ("double", st.span), st.span,
            f"a token of {sp.describe(h)} would count rank {c}'s expert outputs twice in '{buf}' of rank {rank}: "
            f"{route_text(c, p1)} and {route_text(c, p2)}"))

    def _check_results(self) -> None:
        sp = self.space
        for h in range(self.n):
            got = self.contents.get(("result", h), {}).get(h, {})
            for c in range(self.n):
                if c not in got:
                    self._drop(h, c)
                elif not got[c][1]:
                    p = got[c][0]
                    st = self.prog.step(p[-1][0])
                    self.problems.append(Problem(
                        ("unweighted", st.span), st.span,
                        f"rank {c}'s expert outputs for a token of {sp.describe(h)} reach 'result' without a "
                        f"weighted reduce: {route_text(c, p)}",
                        [Note("reduce them ('reduce BUF into BUF') on the way: only a reduce applies the routing weights")]))

    def _drop(self, h: int, c: int) -> None:
        sp = self.space
        found = []
        for (buf, q), part in self.contents.items():
            if buf == "result" or c not in part.get(h, {}):
                continue
            p = part[h][c][0]
            if p:
                found.append((len(p), [self.prog.step(x[0]).index for x in p], buf, q, p))
        prefixes = {x[4][:k] for x in found for k in range(len(x[4]))}
        found = [x for x in found if x[4] not in prefixes]  # leaves only
        found.sort(key=lambda x: (-x[0], x[1], x[3]))
        notes = []
        span = None
        for _, _, buf, q, p in found[:2]:
            st = self.prog.step(p[-1][0])
            readers = [t.name for t in self.prog.steps[st.index + 1:] if any(x.buffer.name == buf for x in t.sources)]
            why = (f"no later step reads '{buf}'" if not readers else
                   f"{'the step that reads' if len(readers) == 1 else 'the steps that read'} '{buf}' later "
                   f"({', '.join(readers)}) {'does' if len(readers) == 1 else 'do'} not move them toward "
                   f"'result' of rank {h}")
            notes.append(Note(f"they get as far as '{buf}' on {sp.describe(q)} ({route_text(c, p)}); {why}", st.span))
            span = span or st.span
        if not found:
            notes.append(Note(f"no step takes them out of 'output' of rank {c}"))
        span = span or head_span(self.prog)
        self.problems.append(Problem(("drop", span), span,
                                     f"a token of {sp.describe(h)} never receives rank {c}'s expert outputs in 'result'",
                                     notes))
