"""Rank sets in steps: `me`, `all`, relations, levels and groups, `x.member`, joined by + and -.

A rank set is evaluated per executing rank `r` and, inside a transfer, per far rank `f` (the
rank the step's relation pairs `r` with): there the step's own relation means that far rank,
and another relation means all the ranks it relates `r` to.  Resolving one gives a
:class:`~epcc.sema.model.RankSetExpr`, a function of (r, f) with the source text it came from.
"""

from __future__ import annotations

from typing import Callable

from ..frontend import ast
from . import model
from .hints import suggestion


class RankSetResolver:
    """Rank sets over one topology; errors go to `err` (the program resolver's reporter)."""

    def __init__(self, topo: model.Topology, err: Callable[..., None]):
        self.topo = topo
        self.space = topo.space
        self.err = err

    def rankset(self, rs: ast.RankSet, far: model.RelationInfo | None) -> model.RankSetExpr | None:
        """`rs` as a function of (executing rank, far rank); None once an error says why not.
        `far` is the relation of the step it appears in (None outside a transfer)."""
        fns: list[tuple[str, Callable[[int, int | None], frozenset[int]]]] = []
        texts = []
        for op, term in rs.terms:
            fn = self._rank_term(term, far)
            if fn is None:
                return None
            fns.append((op, fn))
            t = term.base.text + (f".{term.member.text}" if term.member else "")
            texts.append(t if not texts else f"{op} {t}")

        def evaluate(r: int, f: int | None, _fns=tuple(fns)) -> frozenset[int]:
            acc: frozenset[int] = frozenset()
            for op, fn in _fns:
                acc = acc | fn(r, f) if op == "+" else acc - fn(r, f)
            return acc

        return model.RankSetExpr(" ".join(texts), evaluate, rs.span)

    def _rank_term(self, t: ast.RankTerm, far: model.RelationInfo | None):
        space = self.space
        base = t.base.text
        scopes = space.scope_names()
        rels = self.topo.relations
        member = None
        if t.member is not None:
            member = t.member.text
            if member not in scopes and member not in rels and member not in self.topo.broken_relations:
                self.err(t.member.span, f"unknown level, group or relation '{member}'",
                         *suggestion(member, scopes + list(rels)))
                return None
        broken = self.topo.broken_relations
        if base in broken or (member is not None and member in broken):
            return None  # a broken relation: already reported at its declaration
        pick = self._member_fn(member)
        if base == "me":
            return lambda r, f: pick(r)
        if base == "all":
            if member is not None:
                self.err(t.span, "'all' is every rank; it has no members to pick", f"write '{member}' for my {member}")
                return None
            everyone = frozenset(range(space.num_ranks))
            return lambda r, f: everyone
        if base in rels:
            rel = rels[base]
            if far is not None and rel.name == far.name:
                return lambda r, f: pick(f)
            # Another relation: all of the executing rank's related ranks.
            return lambda r, f: frozenset().union(*(pick(g) for g in rel.of(r)))
        if base in scopes:
            if member is not None:
                self.err(t.span, f"'{base}' is a level or group; '{base}.{member}' means nothing",
                         f"write '{base}' for my {base}, or '<relation>.{member}'")
                return None
            return lambda r, f: space.members(r, base)
        cands = ["me", "all"] + list(rels) + scopes
        self.err(t.base.span, f"unknown rank set '{base}'", *suggestion(base, cands),
                 "rank sets are 'me', 'all', relations, levels and groups (e.g. 'mate.vnode')")
        return None

    def _member_fn(self, member: str | None) -> Callable[[int], frozenset[int]]:
        """`x.member`: x itself, the ranks of x's level/group instance, or x's related ranks."""
        space = self.space
        if member is None:
            return lambda q: frozenset((q,))
        if member in self.topo.relations:
            rel = self.topo.relations[member]
            return lambda q: frozenset(rel.of(q))
        return lambda q: space.members(q, member)
