"""Duplicate-mode launches: one launch covering both dies of a card, where the plan allows it.

A BR166 card has two dies joined by D2D; its runtime can launch one kernel on both dies at once
("duplicate mode": seed 000, "目前 BR166 上的 kernel 都是 duplicate mode，两个 DIE 处理相同 shape 的
tensor"), the same kernel and launch configuration on each die, each die telling itself apart by
its die index.  A plan whose ranks are dies may use it for a card where the dies' programs are
mirror images: swapping the two dies of every card (die 0 <-> die 1) maps the plan onto itself,
every flow of every step onto a flow of the same step with the same link and the same selection,
swapped.  Then the two dies run the same roles on the same SM ranges against mirrored peers, and
one launch with each die's own arguments (its rank's tables, counts and peer addresses) does
what two would.  What each die moves may still differ with the routing: the kernels read their
counts at run time, as they do without duplicate mode.

Decided from the plan and how its ranks sit on cards (`twin`: each rank's other die, from the
rank space); kernel-formation records it in `Plan.launch` (plan.json, `--emit`).  Advisory for
now: the SUPA code generator does not use it yet (every die is launched as its own rank).
"""

from __future__ import annotations

from .model import Flow, LaunchPlan, Plan


def _key(f: Flow, twin: list[int]) -> tuple:
    sel = None if f.select is None else tuple(sorted(twin[r] for r in f.select))
    return (twin[f.rank], twin[f.src], twin[f.dst], sel)


def duplicate_launch(plan: Plan, twin: list[int] | None, not_dies: str) -> LaunchPlan:
    """The duplicate-mode pairs of `plan` (module docstring).  `twin[r]` is rank r's other die on
    its card, or `twin` is None when the ranks are not dies of two-die cards, `not_dies` saying
    why; the reason is kept either way."""
    if twin is None:
        return LaunchPlan([], not_dies)
    names = plan.rank_names or [f"rank {r}" for r in range(plan.num_ranks)]
    for s in plan.steps:
        have = {(f.rank, f.src, f.dst, None if f.select is None else tuple(sorted(f.select))) for f in s.flows}
        for f in s.flows:
            if _key(f, twin) not in have:
                return LaunchPlan([], f"not symmetric across the dies: {s.program} step '{s.name}' (line {s.line}) "
                                      f"moves data of {names[f.rank]} from {f.src} to {f.dst}, and the other die "
                                      f"{names[twin[f.rank]]} has no mirror of it (from {twin[f.src]} to "
                                      f"{twin[f.dst]})")
    pairs = sorted({tuple(sorted((r, twin[r]))) for r in range(plan.num_ranks)})
    return LaunchPlan([list(p) for p in pairs],
                      f"every step's flows map onto themselves when the two dies of each card swap roles: one "
                      f"launch per card ({len(pairs)}) covers both dies, each with its own rank's arguments")


__all__ = ["duplicate_launch"]
