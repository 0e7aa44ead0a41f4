"""Token streams through a dispatch program: provenance, deliveries and expected volumes.

A *stream* is a population of token copies sitting in one buffer of one rank: the tokens of home
rank `home` whose destination set hits every rank set in `conds` (each selection `tokens for S`
on the way adds S), together with the chain of steps (`path`) that brought them there.  Following
the steps in program order moves streams between buffers exactly as the program says:

* a step reads what earlier steps wrote into its source buffers (later writes land elsewhere);
* a write into `output` (a permute, or a send/pull/copy into it) *delivers* the stream to the
  receiving rank, for the tokens routed there: `deliveries[d]` lists every stream delivered to d.

Routes are independent of the routing distribution; volumes are not: `volumes` gives, per step
and executing rank, the expected token copies (rows, for permutes) under a
:class:`~epcc.analysis.routing.Routing`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sema import model
from .routing import Routing, UniformRouting, canon


@dataclass(frozen=True)
class Stream:
    home: int
    conds: tuple[frozenset[int], ...]  # canonical (routing.canon)
    path: tuple[tuple[str, int, int], ...]  # (step, src rank, dst rank) hops


@dataclass
class StepVolume:
    """What one step moves when each rank runs it."""

    step: model.Step
    copies: list[float]  # per executing rank: expected token copies (rows, for permutes)
    bytes: list[float]  # per executing rank
    per_flow: list[list[tuple[int, int, float]]]  # per executing rank: (src, dst, copies)

    @property
    def max_bytes(self) -> float:
        return max(self.bytes, default=0.0)

    @property
    def mean_bytes(self) -> float:
        return sum(self.bytes) / len(self.bytes) if self.bytes else 0.0


class FlowAnalysis:
    """Streams, deliveries and expected volumes of a schedule's dispatch program."""

    def __init__(self, sched: model.Schedule, routing: Routing | None = None):
        self.sched = sched
        self.topo = sched.topology
        self.wl = sched.workload
        self.n = self.topo.num_ranks
        self.routing = routing or UniformRouting(self.wl, self.topo.space)
        prog = sched.dispatch
        self.contents: dict[str, list[list[Stream]]] = {b: [[] for _ in range(self.n)] for b in prog.buffers}
        for h in range(self.n):
            self.contents["input"][h].append(Stream(h, (), ()))
        # deliveries[d] = the streams delivered into rank d's output (their last hop is the
        # delivering step); sema makes every write into output select the receiver, so their
        # conds always include {d}.
        self.deliveries: list[list[Stream]] = [[] for _ in range(self.n)]
        # moved[step][r] = streams step moved when rank r ran it (as they arrived).
        self.moved: dict[str, list[list[Stream]]] = {}
        self.volumes: dict[str, StepVolume] = {}
        for st in prog.steps:
            self.volumes[st.name] = self._run(st)

    # ------------------------------------------------------------------ queries
    def expected_tokens(self, conds: tuple[frozenset[int], ...]) -> float:
        return self.wl.tokens * self.routing.p_hit_all(conds)

    def expected_rows(self, conds: tuple[frozenset[int], ...], r: int) -> float:
        return self.wl.tokens * self.routing.rows(conds, r)

    # ------------------------------------------------------------------ propagation
    def _run(self, st: model.Step) -> StepVolume:
        n = self.n
        copies = [0.0] * n
        per_flow: list[list[tuple[int, int, float]]] = [[] for _ in range(n)]
        moved_by: list[list[Stream]] = [[] for _ in range(n)]
        self.moved[st.name] = moved_by
        if st.verb == "exchange":
            # Metadata to each peer: per-expert counts (int32 each), or the top-k expert indices
            # of every token (int32 each) for a routing map / layout.
            meta = self.wl.experts * 4 if st.exchange_what == "counts" else self.wl.tokens * self.wl.topk * 4
            byts = []
            for r in range(n):
                peers = st.exchange_peers.evaluate(r, None) - {r}
                per_flow[r] = [(r, p, 0.0) for p in sorted(peers)]
                byts.append(float(meta * len(peers)))
            return StepVolume(st, copies, byts, per_flow)
        into_sink = st.dest.buffer.role == "sink"
        landed: list[tuple[str, int, Stream]] = []
        for r in range(n):
            for src_rank, dst_rank in st.flows(r):
                far = dst_rank if st.verb == "send" else (src_rank if st.verb == "pull" else None)
                sel = st.selection
                extra: tuple[frozenset[int], ...]
                if st.verb == "permute":
                    extra = (frozenset((dst_rank,)),)
                elif sel is None or sel.mode == "all":
                    extra = ()
                else:
                    extra = (sel.ranks.evaluate(r, far),)
                flow = 0.0
                for src in st.sources:
                    for s in self.contents[src.buffer.name][src_rank]:
                        conds = canon(s.conds + extra)
                        if any(not c for c in conds):
                            continue  # no token can satisfy an empty set
                        new = Stream(s.home, conds, s.path + ((st.name, src_rank, dst_rank),))
                        if st.verb == "permute" or st.dedup == "none":
                            flow += self.expected_rows(conds, dst_rank)  # one row per local expert
                        else:
                            flow += self.expected_tokens(conds)
                        moved_by[r].append(new)
                        landed.append((st.dest.buffer.name, dst_rank, new))
                copies[r] += flow
                per_flow[r].append((src_rank, dst_rank, flow))
        for buf, rank, s in landed:
            if into_sink:
                self.deliveries[rank].append(s)
            else:
                self.contents[buf][rank].append(s)
        bpt = self.wl.bytes_per_token
        return StepVolume(st, copies, [c * bpt for c in copies], per_flow)

    def route_text(self, s: Stream) -> str:
        """`rank 0 -fwd1-> 10 -fwd3-> 11 (final)`: remote hops as arrows, local steps in brackets."""
        out = f"rank {s.home}"
        for step, a, b in s.path:
            out += f" -{step}-> {b}" if a != b else f" ({step})"
        return out
