"""instantiate: the SPMD program becomes per-rank-class IR.

Every rank runs the same steps, but not every rank plays the same part (in the Port-10 plan
only die 0 owns a cable; in a table-wired board a rank's neighbours may differ).  Ranks that the
topology cannot tell apart form a *rank class*; code, tables and time estimates are made once per
class, not once per rank, so EP256 costs no more to compile than its number of classes.

Classes are found by colour refinement over the topology's labelled graphs (every relation and
every link, both directions): start with one colour, split ranks whose neighbours' colours
differ, repeat to a fixpoint.  Ranks in one orbit of the topology's symmetries always share a
colour, so per-class results computed on a representative hold for every member.

IR: the top module gets `epcc.rank_classes` (the ranks of each class); every step op gets
`epcc.per_class`, one entry per class: its representative, the far ranks it talks to there, and
its fan-out.
"""

from __future__ import annotations

from mlir import ir

from ..ir import query
from ..sema import model
from . import Pass, PassContext, register


def rank_classes(sched: model.Schedule) -> list[list[int]]:
    topo = sched.topology
    n = topo.num_ranks
    graphs: list[list[tuple[int, ...]]] = []
    for name in sorted(topo.relations):
        rel = topo.relations[name]
        fwd = [tuple(rel.of(r)) for r in range(n)]
        rev: list[list[int]] = [[] for _ in range(n)]
        for r in range(n):
            for f in rel.of(r):
                rev[f].append(r)
        graphs += [fwd, [tuple(x) for x in rev]]
    for name in sorted(topo.links):
        lk = topo.links[name]
        if lk.kind == "local":
            continue
        adj: list[list[int]] = [[] for _ in range(n)]
        for a, b in lk.pairs:
            adj[a].append(b)
        graphs.append([tuple(x) for x in adj])
    color = [0] * n
    while True:
        sigs = [(color[r],) + tuple(tuple(sorted(color[f] for f in g[r])) for g in graphs) for r in range(n)]
        index = {s: i for i, s in enumerate(sorted(set(sigs)))}
        new = [index[s] for s in sigs]
        if len(set(new)) == len(set(color)):
            break
        color = new
    classes: dict[int, list[int]] = {}
    for r in range(n):
        classes.setdefault(color[r], []).append(r)
    return sorted(classes.values(), key=lambda c: c[0])


@register
class Instantiate(Pass):
    name = "instantiate"
    description = "split ranks into classes the topology cannot tell apart; per-class step facts"

    def run(self, module, ctx: PassContext) -> None:
        sched = ctx.schedule
        classes = rank_classes(sched)
        ctx.results["rank_classes"] = classes
        query.annotate(module, "rank_classes", [list(c) for c in classes])
        prog = query.program_module(module, "dispatch")
        steps = query.step_ops(prog)
        for st in sched.dispatch.steps:
            per = []
            for ci, members in enumerate(classes):
                rep = members[0]
                far = sorted({b if a == rep else a for a, b in st.flows(rep)} - {rep}) if st.verb != "exchange" \
                    else sorted(st.exchange_peers.evaluate(rep, None) - {rep})
                per.append({"class": ci, "representative": rep, "far": ir.DenseI64ArrayAttr.get(far),
                            "fanout": len(far)})
            query.annotate(steps[st.name], "per_class", per)
