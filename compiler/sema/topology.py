"""Resolving a `topology { ... }` block: levels, groups, relations, tables and links.

Relation rules (docs/language.md, "Relations"): a rule list constrains the far rank level by
level; levels the list does not mention keep the near rank's index.

    same L / same G     equal index at level L / same instance of group G
    other L / other G   a different index at L / a different instance of G
    any L               any index at L
    L -> expr           the index given by expr, evaluated on the near rank's indices
"""

from __future__ import annotations

from itertools import product
from math import prod
from typing import Callable

from ..diagnostics import DiagnosticBag, Note, Span, did_you_mean
from ..frontend import ast
from . import model
from .units import number_text, parse_quantity

MAX_RANKS = 4096
MAX_LANES = 1024
MAX_RELATION_WORK = 2_000_000  # candidate far ranks examined per relation, over all ranks (EP1024 all-to-all)


class _Abort(Exception):
    """The topology is too broken to evaluate further; diagnostics already say why."""


def resolve_topology(t: ast.Topology, diags: DiagnosticBag) -> model.Topology | None:
    try:
        return _TopologyResolver(t, diags).run()
    except _Abort:
        return None


class _TopologyResolver:
    def __init__(self, t: ast.Topology, diags: DiagnosticBag):
        self.t = t
        self.diags = diags
        self.space: model.RankSpace | None = None
        self.tables: dict[str, ast.Table] = {}
        self.table_maps: dict[tuple[str, str], list[int]] = {}
        self.rel_ast: dict[str, ast.Relation] = {}
        self.relations: dict[str, model.RelationInfo] = {}
        self.broken: set[str] = set()  # relations
        self.broken_links: set[str] = set()
        self._resolving: list[str] = []

    # ------------------------------------------------------------------ levels & groups
    def run(self) -> model.Topology:
        space = self._rank_space()
        self.space = space
        self._collect_tables()
        for r in self.t.relations:
            if r.name.text in self.rel_ast:
                self._duplicate("relation", r.name, self.rel_ast[r.name.text].name)
                continue
            if r.name.text in space.level_index or r.name.text in space.groups:
                self.diags.error(r.name.span, f"relation '{r.name.text}' has the name of a level or group")
                continue
            self.rel_ast[r.name.text] = r
        for name in self.rel_ast:
            self._relation(name)
        links = self._links()
        rates, times = self._sm_rates()
        return model.Topology(self.t.name.text, space, dict(self.relations), links, self.t.span,
                              frozenset(self.broken), frozenset(self.broken_links), rates,
                              times.get(model.SM_LAUNCH, 0.0), times.get(model.SM_META, 0.0))

    def _sm_rates(self) -> tuple[dict[str, float], dict[str, float]]:
        """The `sm` lines: (bytes/s per SM by kind of work, seconds by kind of time given)."""
        rates: dict[str, float] = {}
        times: dict[str, float] = {}
        first: dict[str, ast.SmRate] = {}
        keys = model.SM_WORK + tuple(model.SM_TIMES)
        for r in self.t.sm_rates:
            work = r.work.text
            if work not in keys:
                self.diags.error(r.work.span, f"unknown kind of SM work '{work}'",
                                 *_maybe(did_you_mean(work, keys)),
                                 f"kinds of SM work are {', '.join(model.SM_WORK)}; `{model.SM_LAUNCH}` gives "
                                 f"the time of a kernel launch, `{model.SM_META}` that of a metadata pass")
                continue
            if work in first:
                what = f"the {model.SM_TIMES[work]} time" if work in model.SM_TIMES else f"the SM rate of '{work}'"
                self.diags.error(r.span, f"{what} is given twice", ast_note("first given here", first[work].span))
                continue
            first[work] = r
            if work in model.SM_TIMES:
                t = parse_quantity(r.rate, "time", self.diags)
                if t is not None and t <= 0:
                    self.diags.error(r.rate.span, f"a {model.SM_TIMES[work]} time must be positive, not {_num(r.rate)}")
                elif t is not None:
                    times[work] = t
                continue
            bw = parse_quantity(r.rate, "bandwidth", self.diags)
            if bw is not None and bw <= 0:
                self.diags.error(r.rate.span, f"an SM rate must be positive, not {_num(r.rate)}")
                continue
            if bw is not None:
                rates[work] = bw
        return rates, times

    def _duplicate(self, what: str, name: ast.Name, first: ast.Name) -> None:
        self.diags.error(name.span, f"duplicate {what} '{name.text}'", ast_note("first defined here", first.span))

    def _rank_space(self) -> model.RankSpace:
        t = self.t
        if not t.levels:
            self.diags.error(t.name.span, f"topology '{t.name.text}' declares no levels",
                             "add e.g. 'levels node 2, gpu 8'")
            raise _Abort
        levels: list[model.LevelInfo] = []
        seen: dict[str, ast.Level] = {}
        ok = True
        for lv in t.levels:
            if lv.name.text in seen:
                self._duplicate("level", lv.name, seen[lv.name.text].name)
                ok = False
                continue
            seen[lv.name.text] = lv
            if lv.count < 1:
                self.diags.error(lv.count_span, f"level '{lv.name.text}' has count {lv.count}; it must be at least 1")
                ok = False
            levels.append(model.LevelInfo(lv.name.text, lv.count, len(levels), lv.span))
        if not ok:
            raise _Abort
        total = prod(lv.count for lv in levels)
        if total > MAX_RANKS:
            self.diags.error(t.levels_span, f"the levels give {total} ranks; epcc supports at most {MAX_RANKS}")
            raise _Abort
        for extra in t.extra_ranks:
            self.diags.error(extra.span, "the rank level is given twice", ast_note("first given here", t.rank.span))
        if t.rank is None:
            self.diags.error(t.name.span, f"topology '{t.name.text}' does not say which level is an EP rank",
                             f"add 'rank {levels[-1].name}'")
        elif t.rank.text not in seen:
            self.diags.error(t.rank.span, f"unknown level '{t.rank.text}'",
                             *_maybe(did_you_mean(t.rank.text, seen)))
        elif t.rank.text != levels[-1].name:
            self.diags.error(t.rank.span,
                             f"the rank level must be the innermost level ('{levels[-1].name}'), not '{t.rank.text}'",
                             "drop the levels below the EP rank, or make the innermost level the rank")
        groups: dict[str, model.GroupInfo] = {}
        for g in t.groups:
            if g.name.text in groups:
                self._duplicate("group", g.name, next(x.name for x in t.groups if x.name.text == g.name.text))
                continue
            if g.name.text in seen:
                self.diags.error(g.name.span, f"group '{g.name.text}' has the name of a level")
                continue
            if g.level.text not in seen:
                self.diags.error(g.level.span, f"unknown level '{g.level.text}'",
                                 *_maybe(did_you_mean(g.level.text, seen)))
                continue
            lv = next(l for l in levels if l.name == g.level.text)
            if g.size < 1:
                self.diags.error(g.size_span, f"group size must be at least 1, not {g.size}")
                continue
            if lv.count % g.size:
                self.diags.error(g.size_span,
                                 f"{lv.count} {lv.name}s per parent cannot be split into groups of {g.size}")
                continue
            groups[g.name.text] = model.GroupInfo(g.name.text, lv.name, lv.depth, g.size, g.span)
        if self.diags.has_errors:
            raise _Abort
        return model.RankSpace(levels, groups)

    # ------------------------------------------------------------------ tables
    def _collect_tables(self) -> None:
        space = self.space
        for tb in self.t.tables:
            if tb.name.text in self.tables:
                self._duplicate("table", tb.name, self.tables[tb.name.text].name)
                continue
            self.tables[tb.name.text] = tb
            if tb.level.text not in space.level_index:
                self.diags.error(tb.level.span, f"unknown level '{tb.level.text}'",
                                 *_maybe(did_you_mean(tb.level.text, space.level_index)))
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
                                     ast_note("first given here", rows[row.key].key_span))
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
    def _relation(self, name: str) -> model.RelationInfo | None:
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
            targets = self._eval_rel_expr(r.expr, what=f"relation '{name}'")
        finally:
            self._resolving.pop()
        if targets is None:
            self.broken.add(name)
            return None
        if not any(targets):
            self.diags.error(r.expr.span, f"relation '{name}' pairs nothing: no rank has a partner under these rules")
            self.broken.add(name)
            return None
        info = model.RelationInfo(name, tuple(tuple(sorted(t)) for t in targets), _rel_text(r.expr), r.span)
        self.relations[name] = info
        return info

    def _check_pairs(self, targets: list[set[int]], span: Span, what: str) -> bool:
        space = self.space
        if not any(targets):
            self.diags.error(span, f"{what} pairs nothing: no rank has a partner under these rules")
            return False
        for r, ts in enumerate(targets):
            if r in ts:
                self.diags.error(span, f"{what} pairs {space.describe(r)} with itself",
                                 "unmentioned levels keep the same index; add 'other <level>' to exclude the rank itself")
                return False
        return True

    def _eval_rel_expr(self, e: ast.RelExpr, what: str) -> list[set[int]] | None:
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
                                 *_maybe(did_you_mean(nm, list(self.rel_ast) + space.scope_names())))
                return None
            rel = self._relation(nm)
            return None if rel is None else [set(t) for t in rel.targets]
        if isinstance(alt, ast.TableRef):
            tb = alt.table.text
            if tb not in self.tables:
                self.diags.error(alt.table.span, f"unknown table '{tb}'", *_maybe(did_you_mean(tb, self.tables)))
                return None
            cols = [c.text for c in self.tables[tb].columns]
            if alt.column.text not in cols:
                self.diags.error(alt.column.span, f"table '{tb}' has no column '{alt.column.text}'",
                                 *_maybe(did_you_mean(alt.column.text, cols)))
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
                self.diags.error(alt.level.span, f"unknown level '{lvl}'", *_maybe(did_you_mean(lvl, space.level_index)))
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
                                 *_maybe(did_you_mean(lvl, names)))
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
                                 *_maybe(did_you_mean(e.name, space.scope_names())),
                                 "index maps may use level and group names")
                return False
            return True
        if isinstance(e, ast.BinOp):
            return self._check_expr_names(e.lhs) & self._check_expr_names(e.rhs)
        return True

    # ------------------------------------------------------------------ links
    def _links(self) -> dict[str, model.LinkInfo]:
        links: dict[str, model.LinkInfo] = {}
        seen: dict[str, ast.Link] = {}
        for lk in self.t.links:
            if lk.name.text in seen:
                self._duplicate("link", lk.name, seen[lk.name.text].name)
                continue
            seen[lk.name.text] = lk
            info = self._link(lk)
            if info is not None:
                links[lk.name.text] = info
            else:
                self.broken_links.add(lk.name.text)
        return links

    def _link(self, lk: ast.Link) -> model.LinkInfo | None:
        kind = lk.kind.text
        ok = True
        if kind not in model.LINK_KINDS:
            self.diags.error(lk.kind.span, f"unknown link kind '{kind}'",
                             *_maybe(did_you_mean(kind, model.LINK_KINDS)),
                             f"link kinds are {', '.join(model.LINK_KINDS)}")
            ok = False
        props: dict[str, ast.LinkProp] = {}
        for p in lk.props:
            if p.key in props:
                self.diags.error(p.span, f"'{p.key}' is given twice for link '{lk.name.text}'",
                                 ast_note("first given here", props[p.key].span))
                ok = False
                continue
            props[p.key] = p
        bw = None
        if "bandwidth" not in props:
            self.diags.error(lk.name.span, f"link '{lk.name.text}' has no bandwidth", "add e.g. 'bandwidth 20 GB/s'")
            ok = False
        else:
            bw = parse_quantity(props["bandwidth"].value, "bandwidth", self.diags)
            if bw is not None and bw <= 0:
                self.diags.error(props["bandwidth"].value.span, f"bandwidth must be positive, not {_num(props['bandwidth'].value)}")
                bw = None
            ok &= bw is not None
        lat = 0.0
        if "latency" in props:
            lat = parse_quantity(props["latency"].value, "latency", self.diags)
            if lat is not None and lat < 0:
                self.diags.error(props["latency"].value.span, "latency cannot be negative")
                lat = None
            ok &= lat is not None
        engine = model.DEFAULT_ENGINE.get(kind, "sm")
        if "engine" in props:
            en = props["engine"].value
            if en.text not in model.ENGINES:
                self.diags.error(en.span, f"unknown engine '{en.text}'", *_maybe(did_you_mean(en.text, model.ENGINES)),
                                 f"engines are {', '.join(model.ENGINES)}")
                ok = False
            engine = en.text
        lanes = 1
        if "lanes" in props:
            lanes = props["lanes"].value
            if lanes < 1:
                self.diags.error(props["lanes"].span, f"a link needs at least 1 lane, not {lanes}")
                ok = False
            elif lanes > MAX_LANES:
                self.diags.error(props["lanes"].span, f"{number_text(lanes)} lanes is out of range (at most {MAX_LANES})")
                ok = False
        eff = 1.0
        if "efficiency" in props:
            q = props["efficiency"].value
            if q.unit != "%":
                self.diags.error(q.span, "efficiency needs a '%' sign, e.g. 'efficiency 80 %'")
                ok = False
            elif not (0 < q.value <= 100):
                self.diags.error(q.span, f"efficiency must be in (0, 100] %, not {_num(q)} %")
                ok = False
            else:
                eff = q.value / 100.0
        shared = None
        if "shared" in props:
            sc = props["shared"].value
            if sc.text not in self.space.level_index and sc.text not in self.space.groups:
                self.diags.error(sc.span, f"unknown level or group '{sc.text}'",
                                 *_maybe(did_you_mean(sc.text, self.space.scope_names())))
                ok = False
            shared = sc.text
        atomics = None
        if "atomics" in props:
            q = props["atomics"].value
            atomics = parse_quantity(q, "bandwidth", self.diags)
            if kind == "local":
                self.diags.error(props["atomics"].span, "'atomics' is the rate of adds into another GPU's memory; "
                                 "a local link has none", "drop 'atomics' (the `sm` line's 'add' rate bounds local adds)")
                atomics = None
            elif atomics is not None and atomics <= 0:
                self.diags.error(q.span, f"atomics must be positive, not {_num(q)}")
                atomics = None
            ok &= atomics is not None
        post = 0.0
        if "post" in props:
            q = props["post"].value
            post = parse_quantity(q, "time", self.diags)
            if kind != "rdma":
                self.diags.error(props["post"].span, f"'post' is the RDMA proxy's host time per chunk; a {kind} link "
                                 f"is written by SMs, not posted", "drop 'post', or make the link 'rdma'")
                post = None
            ok &= post is not None  # a negative one does not parse (tests/sema/cases/post_negative)
        pairs: frozenset[tuple[int, int]] = frozenset()
        rel_text = ""
        if kind == "local":
            if "connects" in props:
                self.diags.error(props["connects"].span, "a local link connects a rank with itself; drop 'connects'")
                ok = False
        elif kind in model.LINK_KINDS:
            if "connects" not in props:
                self.diags.error(lk.name.span, f"link '{lk.name.text}' does not say what it connects",
                                 "add e.g. 'connects other card'")
                ok = False
            else:
                expr = props["connects"].value
                targets = self._eval_rel_expr(expr, what=f"link '{lk.name.text}'")
                if targets is None or not self._check_pairs(targets, expr.span, f"link '{lk.name.text}'"):
                    ok = False
                else:
                    ps = {(r, f) for r, ts in enumerate(targets) for f in ts}
                    pairs = frozenset(ps | {(b, a) for a, b in ps})  # physical links are full duplex
                    rel_text = _rel_text(expr)
        if not ok:
            return None
        return model.LinkInfo(lk.name.text, kind, bw, lat, engine, lanes, eff, pairs, rel_text, lk.span, shared, atomics,
                              post)


# --------------------------------------------------------------------------- helpers


def ast_note(msg: str, span: Span) -> Note:
    return Note(msg, span)


def _maybe(x):
    return (x,) if x else ()


def _num(q: ast.Quantity) -> str:
    return number_text(q.value)


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


def _rel_text(e: ast.RelExpr) -> str:
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
