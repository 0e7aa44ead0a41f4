"""sync-insertion: the flags that order steps across ranks, and bounded waits on them.

For every dependency of a step on a producer:

* a producer that *pushes* into other ranks' buffers bumps the flag `<producer>.ready` on each
  receiving rank once per chunk (`epcc.signal` through the producer's relation; a combine step
  that reverses a dispatch send pushes through the inverse relation, written `~rel`);
* a producer that pulls or works locally bumps its own `<producer>.done` once per chunk;
* a metadata exchange bumps `<producer>.meta` on each peer once;
* a producer with more chunks than its pipeline depth writes a ring: it waits for
  `chunks - depth` credits on `<producer>.credit` before reusing slots.

The consumer waits (`epcc.wait`, before it) until the flag reaches the number of bumps all its
writers send that rank.  Every wait is bounded (`timeout_ns`: 100x the step's estimated time,
at least 1 s) and names its step and flag, so a stuck schedule says where it is stuck.

Pairing is then *validated* independently of how the ops were built: for every rank and flag,
the bumps that arrive, recomputed from each signal op's relation (decoded from the IR's relation
tables) and chunk count, must equal the value the waits on that rank expect, which comes from
the plan's flows.
"""

from __future__ import annotations

from collections import defaultdict

from mlir import ir

from ..diagnostics import Note
from ..ir import ops, query
from ..plan import Plan, PlanStep
from ..sema import model
from . import Pass, PassContext, register
from .overlap_schedule import step_times

MIN_TIMEOUT_NS = 1_000_000_000
MAX_TIMEOUT_NS = 1 << 62  # ~146 years: an i64 attribute, whatever a (very slow) link makes of the estimate
TIMEOUT_FACTOR = 100


def relation_tables(module) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Relation name -> targets per rank, decoded from the IR (plus `~name`, the inverse)."""
    out: dict[str, tuple[tuple[int, ...], ...]] = {}
    for op in query.walk(module):
        if op.name == ops.RELATION:
            t = ops.relation_targets(op)
            name = ir.StringAttr(op.attributes["sym_name"]).value
            inv: list[list[int]] = [[] for _ in t]
            for r, fs in enumerate(t):
                for f in fs:
                    inv[f].append(r)
            out[name] = t
            out["~" + name] = tuple(tuple(sorted(x)) for x in inv)
    return out


class _Producer:
    """How one producer step tells its consumers that data is there."""

    def __init__(self, p: PlanStep, sched: model.Schedule):
        n = sched.topology.num_ranks
        self.step = p
        self.expected = [0] * n  # bumps each rank receives
        self.relation: str | None = None
        if p.verb == "exchange":
            self.flag = f"{p.name}.meta"
            self.bumps = 1
            for f in p.flows:
                self.expected[f.dst] += 1
            return
        self.bumps = p.num_chunks
        if any(f.rank == f.src and f.dst != f.src for f in p.flows):
            self.flag = f"{p.name}.ready"
            for f in p.flows:
                self.expected[f.dst] += p.num_chunks
            self.relation = self._push_relation(p, sched)
        else:
            self.flag = f"{p.name}.done"
            for r in {f.rank for f in p.flows}:
                self.expected[r] = p.num_chunks

    @staticmethod
    def _push_relation(p: PlanStep, sched: model.Schedule) -> str:
        if p.reverse_of is None:
            return sched.dispatch.step(p.name).relation.name if p.program == "dispatch" else \
                sched.combine.step(p.name).relation.name
        ds = sched.dispatch.step(p.reverse_of)
        # The reverse of a send (r -> f) pushes back from f to r: the inverse relation.
        return ("~" + ds.relation.name) if ds.verb == "send" else ds.relation.name


@register
class SyncInsertion(Pass):
    name = "sync-insertion"
    description = "per-chunk ready flags, ring credits and bounded waits; signal/wait pairing check"

    def run(self, module, ctx: PassContext) -> None:
        sched = ctx.schedule
        plan: Plan = ctx.get("plan")
        n = sched.topology.num_ranks
        tables = relation_tables(module)
        report = {}
        for program in ("dispatch", "combine"):
            psteps = {s.name: s for s in plan.program_steps(program)}
            prog_op = query.program_module(module, program)
            if not psteps or prog_op is None:
                continue
            times = step_times(ctx, program)
            step_ops = query.step_ops(prog_op)
            producers: dict[str, _Producer] = {}
            waits: list[tuple[_Producer, PlanStep]] = []
            for c in psteps.values():
                timeout = min(MAX_TIMEOUT_NS, max(MIN_TIMEOUT_NS, int(TIMEOUT_FACTOR * times.get(c.name, 0.0) * 1e9)))
                for d in c.deps:
                    pr = producers.setdefault(d, _Producer(psteps[d], sched))
                    op = step_ops[c.name]
                    loc = query.named_loc(op, f"{c.name}.wait")
                    with ir.InsertionPoint(op), loc:
                        w = ops.wait([], step=c.name, flag=pr.flag, value=max(pr.expected), timeout_ns=timeout,
                                     loc=loc)
                    if len(set(pr.expected)) > 1:
                        query.annotate(w.owner, "per_rank_value", list(pr.expected))
                    waits.append((pr, c))
            for name, pr in producers.items():
                p = pr.step
                op = step_ops[name]
                if p.verb != "exchange" and p.num_chunks > p.depth:
                    loc = query.named_loc(op, f"{name}.credit")
                    with ir.InsertionPoint(op), loc:
                        cw = ops.wait([], step=name, flag=f"{name}.credit", value=p.num_chunks - p.depth,
                                      timeout_ns=max(MIN_TIMEOUT_NS, int(TIMEOUT_FACTOR * times.get(name, 0.0) * 1e9)),
                                      loc=loc)
                    query.annotate(cw.owner, "ring", {"slots": p.depth, "chunks": p.num_chunks})
                loc = query.named_loc(op, f"{name}.signal")
                with ir.InsertionPoint.after(op), loc:
                    sig = ops.signal([op.result], step=name, flag=pr.flag, value=1, relation=pr.relation,
                                     loc=loc)
                query.annotate(sig.owner, "times", pr.bumps)
            self._validate(ctx, sched, program, producers, waits, tables)
            report[program] = {"waits": len(waits), "signals": len(producers)}
        ctx.diags.raise_if_errors()
        ctx.results["sync"] = report

    def _validate(self, ctx, sched, program, producers, waits, tables) -> None:
        n = sched.topology.num_ranks
        arrived: dict[tuple[str, int], int] = defaultdict(int)
        for pr in producers.values():
            p = pr.step
            runs_on = sorted({f.rank for f in p.flows})
            for r in runs_on:
                if p.verb == "exchange":
                    ex = sched.dispatch.step(p.name) if program == "dispatch" else sched.combine.step(p.name)
                    for q in sorted(ex.exchange_peers.evaluate(r, None) - {r}):
                        arrived[(pr.flag, q)] += 1
                elif pr.relation is not None:
                    for f in tables[pr.relation][r]:
                        arrived[(pr.flag, f)] += pr.bumps
                else:
                    arrived[(pr.flag, r)] += pr.bumps
        prog = sched.dispatch if program == "dispatch" else sched.combine
        for pr, c in waits:
            for r in range(n):
                if arrived[(pr.flag, r)] != pr.expected[r]:
                    span = None
                    if prog is not None and c.name in {s.name for s in prog.steps}:
                        span = prog.step(c.name).span
                    elif c.reverse_of:
                        span = sched.dispatch.step(c.reverse_of).span
                    ctx.diags.error(span, f"signal/wait mismatch on {sched.topology.space.describe(r)}: step "
                                          f"'{c.name}' waits for flag '{pr.flag}' to reach {pr.expected[r]}, "
                                          f"but {arrived[(pr.flag, r)]} signals arrive there",
                                    Note(f"'{pr.step.name}' signals through "
                                         f"{pr.relation or 'its own rank'}; its flows reach other ranks"))
                    return
