"""Token streams through a dispatch program, and the expected data volume of every step.

A *stream* is a population of token copies sitting in one buffer of one rank: the tokens of home
rank `h` whose destination set hits every rank set in `conds` (each selection `tokens for S` on
the way adds S).  Following the steps in order moves streams between buffers exactly as the
program says, so for each step and executing rank we know which streams it moves, and

    E[#tokens of h that hit S_1, ..., S_m] = T * P(hit all)
    P(hit all) = sum over J ⊆ {1..m} of (-1)^|J| * C(E - |X_J|, k) / C(E, k)

where X_J is the set of experts on the ranks of the union of the S_j, j in J (inclusion-exclusion
over "misses" of uniform top-k routing without replacement).  Writes into the expert-major
`output` place one row per (token, local expert): E[rows] = |X_r| * k/E * P(hit the other conds
| one local expert chosen), computed the same way with k-1 of E-1.

Node-limited routing changes these probabilities; it is not modelled here yet (see
docs/language.md), and the estimates say so.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations
from math import comb

from ..sema import model


@dataclass(frozen=True)
class Stream:
    home: int
    conds: tuple[frozenset[int], ...]  # canonical: sorted, no superset of another member


@dataclass
class StepVolume:
    """What one step moves when each rank runs it."""

    step: model.Step
    copies: list[float]  # per executing rank: expected token copies (or rows, for permute)
    bytes: list[float]  # per executing rank
    per_flow: list[list[tuple[int, int, float]]]  # per executing rank: (src, dst, copies)

    @property
    def max_bytes(self) -> float:
        return max(self.bytes, default=0.0)

    @property
    def mean_bytes(self) -> float:
        return sum(self.bytes) / len(self.bytes) if self.bytes else 0.0


class FlowAnalysis:
    """Streams and expected volumes of a schedule's dispatch program under uniform routing."""

    def __init__(self, sched: model.Schedule):
        self.sched = sched
        self.topo = sched.topology
        self.wl = sched.workload
        self.n = self.topo.num_ranks
        prog = sched.dispatch
        self.contents: dict[str, list[list[Stream]]] = {b: [[] for _ in range(self.n)] for b in prog.buffers}
        for h in range(self.n):
            self.contents["input"][h].append(Stream(h, ()))
        self.volumes: dict[str, StepVolume] = {}
        for st in prog.steps:
            self.volumes[st.name] = self._run(st)

    # ------------------------------------------------------------------ probabilities
    def p_hit_all(self, conds: tuple[frozenset[int], ...], k: int | None = None, e: int | None = None) -> float:
        k = self.wl.topk if k is None else k
        e = self.wl.experts if e is None else e
        return _p_hit_all(_canon(conds), self.wl.experts_per_rank, k, e)

    def expected_tokens(self, conds: tuple[frozenset[int], ...]) -> float:
        return self.wl.tokens * self.p_hit_all(conds)

    def expected_rows(self, conds: tuple[frozenset[int], ...], r: int) -> float:
        """Expected (token, expert-on-r) rows among a stream's tokens (dedup none / permute)."""
        wl = self.wl
        others = tuple(c for c in conds if r not in c)
        p = wl.topk / wl.experts * wl.experts_per_rank
        if others:
            p *= _p_hit_all(_canon(others), wl.experts_per_rank, wl.topk - 1, wl.experts - 1)
        return wl.tokens * p

    # ------------------------------------------------------------------ propagation
    def _run(self, st: model.Step) -> StepVolume:
        n = self.n
        copies = [0.0] * n
        per_flow: list[list[tuple[int, int, float]]] = [[] for _ in range(n)]
        if st.verb == "exchange":
            # Metadata to each peer: per-expert counts (int32 each), or the top-k expert indices
            # of every token (int32 each) for a routing map / layout.
            if st.exchange_what == "counts":
                meta = self.wl.experts * 4
            else:
                meta = self.wl.tokens * self.wl.topk * 4
            byts = []
            for r in range(n):
                peers = st.exchange_peers.evaluate(r, None) - {r}
                per_flow[r] = [(r, p, 0.0) for p in sorted(peers)]
                copies[r] = 0.0
                byts.append(float(meta * len(peers)))
            return StepVolume(st, copies, byts, per_flow)
        moved: list[tuple[str, int, Stream]] = []
        for r in range(n):
            for src_rank, dst_rank in st.flows(r):
                far = dst_rank if st.verb == "send" else (src_rank if st.verb == "pull" else None)
                sel = st.selection
                if st.verb == "permute" or (sel is not None and sel.mode == "all" and st.dest.buffer.role == "sink"):
                    extra: tuple[frozenset[int], ...] = (frozenset((dst_rank,)),)
                elif sel is None or sel.mode == "all":
                    extra = ()
                else:
                    extra = (sel.ranks.evaluate(r, far),)
                flow = 0.0
                for src in st.sources:
                    for s in self.contents[src.buffer.name][src_rank]:
                        conds = _canon(s.conds + extra)
                        if st.verb == "permute" or st.dedup == "none":
                            # One row per (token, expert of the receiver).
                            c = self.expected_rows(conds, dst_rank) if self.p_hit_all(conds) > 0 else 0.0
                        else:
                            c = self.expected_tokens(conds)
                        if c <= 0.0:
                            continue
                        flow += c
                        moved.append((st.dest.buffer.name, dst_rank, Stream(s.home, conds)))
                copies[r] += flow
                per_flow[r].append((src_rank, dst_rank, flow))
        for buf, rank, s in moved:
            self.contents[buf][rank].append(s)
        bpt = self.wl.bytes_per_token
        return StepVolume(st, copies, [c * bpt for c in copies], per_flow)


def _canon(conds: tuple[frozenset[int], ...]) -> tuple[frozenset[int], ...]:
    """Drop conditions implied by others (hitting S implies hitting any superset of S)."""
    uniq = sorted(set(conds), key=lambda c: (len(c), sorted(c)))
    keep: list[frozenset[int]] = []
    for c in uniq:
        if not any(k <= c for k in keep):
            keep.append(c)
    return tuple(sorted(keep, key=lambda c: (len(c), sorted(c))))


@lru_cache(maxsize=65536)
def _p_hit_all(conds: tuple[frozenset[int], ...], epr: int, k: int, e: int) -> float:
    if any(not c for c in conds):
        return 0.0
    if k <= 0:
        return 1.0 if not conds else 0.0
    total = comb(e, k)
    acc = 0.0
    m = len(conds)
    for size in range(m + 1):
        sign = -1.0 if size % 2 else 1.0
        for js in combinations(conds, size):
            union = frozenset().union(*js) if js else frozenset()
            acc += sign * comb(e - epr * len(union), k) / total
    return max(0.0, min(1.0, acc))
