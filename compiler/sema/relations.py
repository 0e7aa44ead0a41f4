"""Relations of a topology: rank pairings written as rules, pair lists, tables and other relations.

Relation rules (docs/language.md, "Relations"): a rule list constrains the far rank level by
level; levels the list does not mention keep the near rank's index.

    same L / same G     equal index at level L / same instance of group G
    other L / other G   a different index at L / a different instance of G
    any L               any index at L
    L -> expr           the index given by expr, evaluated on the near rank's indices

Alternatives joined by `or` unite their pairs; `pairs (a, b), ... on L` swaps the paired
instances of L; `table T.col` takes each instance's partner from a column of a `table`.  Every
relation (and every link's `connects`, which is written the same way) is evaluated here to one
target set per rank.
"""

from __future__ import annotations

from itertools import product
from math import prod
from typing import Callable, Sequence

from ..diagnostics import DiagnosticBag, Note
from ..frontend import ast
from . import model
from .hints import report_duplicate, suggestion

MAX_RELATION_WORK = 2_000_000  # candidate far ranks examined per relation, over all ranks (EP1024 all-to-all)


class RelationResolver:
    """The tables and relations of one topology, evaluated over its rank space.

    `relations` holds the relations that resolved; `broken` names those whose declaration is
    wrong (already reported: later uses of them stay silent)."""

    def __init__(self, space: model.RankSpace, diags: DiagnosticBag):
        self.space = space
        self.diags = diags
        self.tables: dict[str, ast.Table] = {}
        self.table_maps: dict[tuple[str, str], list[int]] = {}
        self.rel_ast: dict[str, ast.Relation] = {}
        self.relations: dict[str, model.RelationInfo] = {}
        self.broken: set[str] = set()
        self._resolving: list[str] = []

    # ------------------------------------------------------------------ tables
    def collect_tables(self, tables: Sequence[ast.Table]) -> None:
        """Check the `table` declarations; keep each good column as a map of instance to partner."""
        space = self.space
        for tb in tables:
            if tb.name.text in self.tables:
                report_duplicate(self.diags, "table", tb.name, self.tables[tb.name.text].name)
                continue
            self.tables[tb.name.text] = tb
            if tb.level.text not in space.level_index:
                self.diags.error(tb.level.span, f"unknown level '{tb.level.text}'",
                                 *suggestion(tb.level.text, space.level_index))
                continue
            n = space.instances(tb.level.text)
            cols = [c.text for c in tb.columns]
            for i, c in enumerate(tb.columns):
                if c.text in cols[:i]:
                    self.diags.error(c.span, f"duplicate column '{c.text}' in table '{tb.name.text}'")
            rows: dict[int, ast.TableRow] = {}
            for row in tb.rows:
                if not (0 <= row.key < n):
                    self.diags.error(row.key_span,
                                     f"row {row.key} is out of range: table '{tb.name.text}' is over {n} "
                                     f"{tb.level.text}s (0..{n - 1})")
                    continue
                if row.key in rows:
                    self.diags.error(row.key_span, f"duplicate row {row.key} in table '{tb.name.text}'",
                                     Note("first given here", rows[row.key].key_span))
                    continue
                rows[row.key] = row
                if len(row.values) != len(cols):
                    self.diags.error(row.span, f"row {row.key} has {len(row.values)} entries; "
                                               f"table '{tb.name.text}' has {len(cols)} columns")
                    continue
                for (v, vs), col in zip(row.values, cols):
                    if not (0 <= v < n):
                        self.diags.error(vs, f"entry {v} in column '{col}' is out of range 0..{n - 1}")
                    elif v == row.key:
                        self.diags.error(vs, f"row {row.key} pairs {tb.level.text} {v} with itself in column '{col}'")
            missing = [i for i in range(n) if i not in rows]
            if missing and not self.diags.has_errors:
                shown = ", ".join(map(str, missing[:6])) + (", ..." if len(missing) > 6 else "")
                self.diags.error(tb.span, f"table '{tb.name.text}' has no row for {tb.level.text} {shown}",
                                 f"a table over '{tb.level.text}' needs one row for each of its {n} instances")
            if self.diags.has_errors:
                continue
            for ci, col in enumerate(cols):
                self.table_maps[(tb.name.text, col)] = [rows[i].values[ci][0] for i in range(n)]

    # ------------------------------------------------------------------ relations
    def declare(self, relations: Sequence[ast.Relation]) -> None:
        """Register the relation declarations by name (a relation may use one declared after it)."""
        space = self.space
        for r in relations:
            if r.name.text in self.rel_ast:
                report_duplicate(self.diags, "relation", r.name, self.rel_ast[r.name.text].name)
                continue
            if r.name.text in space.level_index or r.name.text in space.groups:
                self.diags.error(r.name.span, f"relation '{r.name.text}' has the name of a level or group")
                continue
            self.rel_ast[r.name.text] = r

    def resolve_all(self) -> None:
        for name in self.rel_ast:
            self.relation(name)

    def relation(self, name: str) -> model.RelationInfo | None:
        """The relation `name`, resolving the relations it is written in terms of first; None when
        its declaration is wrong (reported once, here)."""
        if name in self.relations:
            return self.relations[name]
        if name in self.broken:
            return None  # already reported
        r = self.rel_ast[name]
        if name in self._resolving:
            cycle = " -> ".join(self._resolving[self._resolving.index(name):] + [name])
            self.diags.error(r.name.span, f"relation '{name}' is defined in terms of itself ({cycle})")
            self.broken.add(name)
            return None
        self._resolving.append(name)
        try:
            targets = self.evaluate(r.expr, what=f"relation '{name}'")
        finally:
            self._resolving.pop()
        if targets is None:
            self.broken.add(name)
            return None
        if not any(targets):
            self.diags.error(r.expr.span, f"relation '{name}' pairs nothing: no rank has a partner under these rules")
            self.broken.add(name)
            return None
        info = model.RelationInfo(name, tuple(tuple(sorted(t)) for t in targets), relation_text(r.expr), r.span)
        self.relations[name] = info
        return info

    def evaluate(self, e: ast.RelExpr, what: str) -> list[set[int]] | None:
        """Per rank, the ranks `e` relates it to; None once diagnostics say why not.  `what` names
        the expression's owner in messages (relation 'peer', link 'nvl')."""
        n = self.space.num_ranks
        out: list[set[int]] = [set() for _ in range(n)]
        ok = True
        for alt in e.alts:
            res = self._eval_alt(alt, what)
            if res is None:
                ok = False
                continue
            for r in range(n):
                out[r] |= res[r]
        return out if ok else None

    def _eval_alt(self, alt, what: str) -> list[set[int]] | None:
        space = self.space
        n = space.num_ranks
        if isinstance(alt, ast.RelName):
            nm = alt.name.text
            if nm in self.broken and nm not in self._resolving:
                return None  # broken: reported at its declaration
            if nm not in self.rel_ast:
                self.diags.error(alt.name.span, f"unknown relation '{nm}'",
                                 *suggestion(nm, list(self.rel_ast) + space.scope_names()))
                return None
            rel = self.relation(nm)
            return None if rel is None else [set(t) for t in rel.targets]
        if isinstance(alt, ast.TableRef):
            tb = alt.table.text
            if tb not in self.tables:
                self.diags.error(alt.table.span, f"unknown table '{tb}'", *suggestion(tb, self.tables))
                return None
            cols = [c.text for c in self.tables[tb].columns]
            if alt.column.text not in cols:
                self.diags.error(alt.column.span, f"table '{tb}' has no column '{alt.column.text}'",
                                 *suggestion(alt.column.text, cols))
                return None
            m = self.table_maps.get((tb, alt.column.text))
            if m is None:
                return None  # the table itself is broken; already reported
            level = self.tables[tb].level.text
            d = space.level_index[level]
            out = []
            for r in range(n):
                c = space.coords(r)
                g = m[space.global_index(r, level)]
                # Decompose the far instance's global index into coordinates down to `level`.
                far = list(c)
                for i in range(d, -1, -1):
                    far[i] = g % space.counts[i]
                    g //= space.counts[i]
                out.append({space.rank(far)})
            return out
        if isinstance(alt, ast.PairList):
            lvl = alt.level.text
            if lvl not in space.level_index:
                self.diags.error(alt.level.span, f"unknown level '{lvl}'", *suggestion(lvl, space.level_index))
                return None
            d = space.level_index[lvl]
            cnt = space.counts[d]
            partner: dict[int, int] = {}
            bad = False
            for a, b, sp in alt.pairs:
                for v in (a, b):
                    if not (0 <= v < cnt):
                        self.diags.error(sp, f"{lvl} {v} is out of range 0..{cnt - 1}")
                        bad = True
                if bad:
                    continue
                if a == b:
                    self.diags.error(sp, f"pair ({a}, {b}) pairs {lvl} {a} with itself")
                    bad = True
                    continue
                for v in (a, b):
                    if v in partner:
                        self.diags.error(sp, f"{lvl} {v} appears in two pairs")
                        bad = True
                partner[a], partner[b] = b, a
            if bad:
                return None
            out = []
            for r in range(n):
                c = list(space.coords(r))
                if c[d] in partner:
                    c[d] = partner[c[d]]
                    out.append({space.rank(c)})
                else:
                    out.append(set())
            return out
        return self._eval_rules(alt, what)

    def _eval_rules(self, rl: ast.RuleList, what: str) -> list[set[int]] | None:
        space = self.space
        names = space.scope_names()
        # Per level: list of predicates/choosers.  None = default (same index).
        per_level: dict[int, list] = {}
        ok = True
        for rule in rl.rules:
            lvl = rule.level.text
            if lvl not in space.level_index and lvl not in space.groups:
                self.diags.error(rule.level.span, f"unknown level or group '{lvl}'",
                                 *suggestion(lvl, names))
                ok = False
                continue
            if isinstance(rule, ast.MapRule) and lvl in space.groups:
                self.diags.error(rule.level.span, f"'{lvl}' is a group; index maps apply to levels",
                                 f"map the level '{space.groups[lvl].level}' instead")
                ok = False
                continue
            if isinstance(rule, ast.AnyRule) and lvl in space.groups:
                self.diags.error(rule.level.span, f"'{lvl}' is a group; write 'any {space.groups[lvl].level}'")
                ok = False
                continue
            d = space.level_index[lvl] if lvl in space.level_index else space.groups[lvl].depth
            per_level.setdefault(d, []).append(rule)
            if isinstance(rule, ast.MapRule) and not self._check_expr_names(rule.expr):
                ok = False
        if not ok:
            return None
        n = space.num_ranks
        counts = space.counts
        work = 0
        out: list[set[int]] = []
        for r in range(n):
            c = space.coords(r)
            choices: list[list[int]] = []
            for d, cnt in enumerate(counts):
                rules = per_level.get(d)
                if not rules:
                    choices.append([c[d]])
                    continue
                cand = list(range(cnt))
                for rule in rules:
                    cand = self._apply_rule(rule, c, d, cand, r)
                    if cand is None:
                        return None
                choices.append(cand)
            size = prod(len(x) for x in choices)
            work += size
            if work > MAX_RELATION_WORK:
                self.diags.error(rl.span, f"{what} relates too many rank pairs to evaluate "
                                          f"(more than {MAX_RELATION_WORK} candidates)")
                return None
            out.append({space.rank(f) for f in product(*choices)})
        return out

    def _apply_rule(self, rule, c: tuple[int, ...], d: int, cand: list[int], r: int) -> list[int] | None:
        space = self.space
        lvl = rule.level.text
        if isinstance(rule, ast.AnyRule):
            return cand
        if lvl in space.groups:
            size = space.groups[lvl].size
            mine = c[d] // size
            if isinstance(rule, ast.SameRule):
                return [v for v in cand if v // size == mine]
            return [v for v in cand if v // size != mine]
        if isinstance(rule, ast.SameRule):
            return [v for v in cand if v == c[d]]
        if isinstance(rule, ast.OtherRule):
            return [v for v in cand if v != c[d]]
        # MapRule
        env = {lv.name: c[i] for i, lv in enumerate(space.levels)}
        for g in space.groups.values():
            env[g.name] = c[g.depth] // g.size
        try:
            v = _eval_expr(rule.expr, env)
        except ZeroDivisionError:
            self.diags.error(rule.expr.span, f"division by zero in '{lvl} -> ...' for {space.describe(r)}")
            return None
        cnt = space.counts[d]
        if not (0 <= v < cnt):
            self.diags.error(rule.expr.span,
                             f"'{lvl} -> {_expr_text(rule.expr)}' maps {space.describe(r)} to {lvl} {v}, "
                             f"outside 0..{cnt - 1}",
                             f"wrap it, e.g. '{lvl} -> ({_expr_text(rule.expr)}) % {cnt}'")
            return None
        return [x for x in cand if x == v]

    def _check_expr_names(self, e) -> bool:
        space = self.space
        if isinstance(e, ast.Var):
            if e.name not in space.level_index and e.name not in space.groups:
                self.diags.error(e.span, f"unknown name '{e.name}' in index map",
                                 *suggestion(e.name, space.scope_names()),
                                 "index maps may use level and group names")
                return False
            return True
        if isinstance(e, ast.BinOp):
            return self._check_expr_names(e.lhs) & self._check_expr_names(e.rhs)
        return True


# --------------------------------------------------------------------------- index-map expressions


_OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a // b,
    "%": lambda a, b: a % b,
    "^": lambda a, b: a ^ b,
    "&": lambda a, b: a & b,
    "|": lambda a, b: a | b,
}


def _eval_expr(e, env: dict[str, int]) -> int:
    if isinstance(e, ast.Lit):
        return e.value
    if isinstance(e, ast.Var):
        return env[e.name]
    return _OPS[e.op](_eval_expr(e.lhs, env), _eval_expr(e.rhs, env))


def _expr_text(e) -> str:
    if isinstance(e, ast.Lit):
        return str(e.value)
    if isinstance(e, ast.Var):
        return e.name
    lhs, rhs = _expr_text(e.lhs), _expr_text(e.rhs)
    if isinstance(e.lhs, ast.BinOp):
        lhs = f"({lhs})"
    if isinstance(e.rhs, ast.BinOp):
        rhs = f"({rhs})"
    return f"{lhs} {e.op} {rhs}"


def relation_text(e: ast.RelExpr) -> str:
    """A relation expression written back as text (`same node, other gpu or table T.c`)."""
    parts = []
    for a in e.alts:
        if isinstance(a, ast.RelName):
            parts.append(a.name.text)
        elif isinstance(a, ast.TableRef):
            parts.append(f"table {a.table.text}.{a.column.text}")
        elif isinstance(a, ast.PairList):
            parts.append("pairs " + ", ".join(f"({x}, {y})" for x, y, _ in a.pairs) + f" on {a.level.text}")
        else:
            rs = []
            for r in a.rules:
                if isinstance(r, ast.SameRule):
                    rs.append(f"same {r.level.text}")
                elif isinstance(r, ast.OtherRule):
                    rs.append(f"other {r.level.text}")
                elif isinstance(r, ast.AnyRule):
                    rs.append(f"any {r.level.text}")
                else:
                    rs.append(f"{r.level.text} -> {_expr_text(r.expr)}")
            parts.append(", ".join(rs))
    return " or ".join(parts)
