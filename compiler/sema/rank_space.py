"""The rank space of a topology: its `levels` (which make the ranks) and its `groups`.

Ranks are the instances of the innermost level, numbered row-major over the levels
(:class:`~epcc.sema.model.RankSpace`); a group splits the instances of one level into
consecutive runs of equal size.  Everything else in a topology is evaluated over this space,
so a topology whose levels or groups are wrong is not evaluated further.
"""

from __future__ import annotations

from math import prod

from ..diagnostics import DiagnosticBag, Note
from ..frontend import ast
from ..limits import MAX_RANKS
from . import model
from .hints import report_duplicate, suggestion



def build_rank_space(t: ast.Topology, diags: DiagnosticBag) -> model.RankSpace | None:
    """The levels and groups of `t`, or None once diagnostics say why they are unusable."""
    if not t.levels:
        diags.error(t.name.span, f"topology '{t.name.text}' declares no levels",
                    "add e.g. 'levels node 2, gpu 8'")
        return None
    levels: list[model.LevelInfo] = []
    seen: dict[str, ast.Level] = {}
    ok = True
    for lv in t.levels:
        if lv.name.text in seen:
            report_duplicate(diags, "level", lv.name, seen[lv.name.text].name)
            ok = False
            continue
        seen[lv.name.text] = lv
        if lv.count < 1:
            diags.error(lv.count_span, f"level '{lv.name.text}' has count {lv.count}; it must be at least 1")
            ok = False
        levels.append(model.LevelInfo(lv.name.text, lv.count, len(levels), lv.span))
    if not ok:
        return None
    total = prod(lv.count for lv in levels)
    if total > MAX_RANKS:
        diags.error(t.levels_span, f"the levels give {total} ranks; epcc supports at most {MAX_RANKS}")
        return None
    for extra in t.extra_ranks:
        diags.error(extra.span, "the rank level is given twice", Note("first given here", t.rank.span))
    if t.rank is None:
        diags.error(t.name.span, f"topology '{t.name.text}' does not say which level is an EP rank",
                    f"add 'rank {levels[-1].name}'")
    elif t.rank.text not in seen:
        diags.error(t.rank.span, f"unknown level '{t.rank.text}'", *suggestion(t.rank.text, seen))
    elif t.rank.text != levels[-1].name:
        diags.error(t.rank.span,
                    f"the rank level must be the innermost level ('{levels[-1].name}'), not '{t.rank.text}'",
                    "drop the levels below the EP rank, or make the innermost level the rank")
    groups: dict[str, model.GroupInfo] = {}
    for g in t.groups:
        if g.name.text in groups:
            report_duplicate(diags, "group", g.name, next(x.name for x in t.groups if x.name.text == g.name.text))
            continue
        if g.name.text in seen:
            diags.error(g.name.span, f"group '{g.name.text}' has the name of a level")
            continue
        if g.level.text not in seen:
            diags.error(g.level.span, f"unknown level '{g.level.text}'", *suggestion(g.level.text, seen))
            continue
        lv = next(l for l in levels if l.name == g.level.text)
        if g.size < 1:
            diags.error(g.size_span, f"group size must be at least 1, not {g.size}")
            continue
        if lv.count % g.size:
            diags.error(g.size_span, f"{lv.count} {lv.name}s per parent cannot be split into groups of {g.size}")
            continue
        groups[g.name.text] = model.GroupInfo(g.name.text, lv.name, lv.depth, g.size, g.span)
    if diags.has_errors:
        return None
    return model.RankSpace(levels, groups)
