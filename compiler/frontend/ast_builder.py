"""Lark parse trees to the frozen AST of :mod:`epcc.frontend.ast`.

One method per grammar rule family (topology, workload, programs); every AST node carries the
source span of the tree it came from.  The one error raised here is for expressions nested too
deep for the later stages, which walk them recursively.
"""

from __future__ import annotations

from lark import Token, Tree

from ..diagnostics import CompileError, Diagnostic, Span, source_lines
from . import ast

MAX_EXPR_DEPTH = 200  # operators nested in one expression (relations, selections)


class AstBuilder:
    """Builds the AST of one file (`path` goes into every span)."""

    def __init__(self, path: str):
        self.path = path

    # -- spans
    def span(self, node: Tree | Token) -> Span:
        if isinstance(node, Token):
            return Span(self.path, node.line, node.column, node.end_line, node.end_column)
        m = node.meta
        if getattr(m, "empty", True):
            return Span.point(self.path, 1, 1)
        return Span(self.path, m.line, m.column, m.end_line, m.end_column)

    def name(self, tok: Token) -> ast.Name:
        return ast.Name(str(tok), self.span(tok))

    # -- file
    def file(self, tree: Tree, text: str) -> ast.File:
        sched, topos, wls, progs, revs = [], [], [], [], []
        for item in tree.children:
            kind = item.data
            if kind == "schedule_decl":
                toks = item.children
                title = _unquote(toks[1]) if len(toks) > 1 else None
                sched.append(ast.ScheduleDecl(self.name(toks[0]), title, self.span(item)))
            elif kind == "topology":
                topos.append(self.topology(item))
            elif kind == "workload":
                wls.append(self.workload(item))
            elif kind in ("dispatch_program", "combine_program"):
                progs.append(self.program(item, kind.split("_")[0]))
            elif kind == "combine_reverse":
                revs.append(ast.CombineReverse(self.name(item.children[0]), self.span(item)))
        lines = source_lines(text) or [""]
        last = max((i for i, ln in enumerate(lines) if ln.strip()), default=0)
        whole = Span(self.path, 1, 1, last + 1, len(lines[last].rstrip()) + 1)
        return ast.File(self.path, tuple(sched), tuple(topos), tuple(wls), tuple(progs), tuple(revs), whole)

    # -- topology
    def topology(self, tree: Tree) -> ast.Topology:
        name = self.name(tree.children[0])
        levels: list[ast.Level] = []
        levels_span = None
        rank = None
        extra_ranks: list[ast.Name] = []
        groups, rels, tables, links, sm_rates, vendors = [], [], [], [], [], []
        for it in tree.children[1:]:
            d = it.data
            if d == "levels_decl":
                if levels_span is None:
                    levels_span = self.span(it)
                for spec in it.children:
                    n, c = spec.children
                    levels.append(ast.Level(self.name(n), int(c), self.span(c), self.span(spec)))
            elif d == "rank_decl":
                if rank is None:
                    rank = self.name(it.children[0])
                else:
                    extra_ranks.append(self.name(it.children[0]))
            elif d == "group_decl":
                n, size, lvl = it.children
                groups.append(ast.Group(self.name(n), int(size), self.span(size), self.name(lvl), self.span(it)))
            elif d == "relation_decl":
                n, expr = it.children
                rels.append(ast.Relation(self.name(n), self.rel_expr(expr), self.span(it)))
            elif d == "table_decl":
                tables.append(self.table(it))
            elif d == "link_decl":
                links.append(self.link(it))
            elif d == "sm_decl":
                sm_rates.extend(ast.SmRate(self.name(r.children[0]), self.quantity(r.children[1]), self.span(r))
                                for r in it.children)
            elif d == "vendor_decl":
                arch = self.name(it.children[1]) if len(it.children) > 1 else None
                vendors.append(ast.Vendor(self.name(it.children[0]), arch, self.span(it)))
        return ast.Topology(name, tuple(levels), levels_span, rank, tuple(groups), tuple(rels), tuple(tables),
                            tuple(links), self.span(tree), tuple(extra_ranks), tuple(sm_rates), tuple(vendors))

    def rel_expr(self, tree: Tree) -> ast.RelExpr:
        return ast.RelExpr(tuple(self.rel_alt(a) for a in tree.children), self.span(tree))

    def rel_alt(self, t: Tree):
        d = t.data
        if d == "rel_name":
            return ast.RelName(self.name(t.children[0]), self.span(t))
        if d == "table_ref":
            return ast.TableRef(self.name(t.children[0]), self.name(t.children[1]), self.span(t))
        if d == "pair_list":
            *pairs, lvl = t.children
            out = tuple((int(p.children[0]), int(p.children[1]), self.span(p)) for p in pairs)
            return ast.PairList(out, self.name(lvl), self.span(t))
        if d == "rule_list":
            return ast.RuleList(tuple(self.rule(r) for r in t.children), self.span(t))
        # A single rule is inlined by `?rule`.
        return ast.RuleList((self.rule(t),), self.span(t))

    def rule(self, t: Tree):
        d = t.data
        if d == "same_rule":
            return ast.SameRule(self.name(t.children[0]), self.span(t))
        if d == "other_rule":
            return ast.OtherRule(self.name(t.children[0]), self.span(t))
        if d == "any_rule":
            return ast.AnyRule(self.name(t.children[0]), self.span(t))
        if d == "map_rule":
            return ast.MapRule(self.name(t.children[0]), self.expr(t.children[1]), self.span(t))
        raise AssertionError(f"unknown rule {d}")

    _BINOPS = {
        "bin_or": "|", "bin_xor": "^", "bin_and": "&", "bin_add": "+",
        "bin_sub": "-", "bin_mul": "*", "bin_div": "/", "bin_mod": "%",
    }

    def expr(self, t: Tree | Token, depth: int = 0):
        if isinstance(t, Token):  # pragma: no cover - atoms are always wrapped
            return ast.Lit(int(t), self.span(t))
        if t.data == "lit":
            return ast.Lit(int(t.children[0]), self.span(t))
        if t.data == "var":
            return ast.Var(str(t.children[0]), self.span(t))
        if depth >= MAX_EXPR_DEPTH:  # every later stage walks expressions recursively
            raise CompileError([Diagnostic("error", f"expression too long: more than {MAX_EXPR_DEPTH} operators "
                                                    f"nested; write it in fewer terms", self.span(t))])
        op = self._BINOPS[t.data]
        return ast.BinOp(op, self.expr(t.children[0], depth + 1), self.expr(t.children[1], depth + 1), self.span(t))

    def table(self, t: Tree) -> ast.Table:
        name, level, cols, *rows = t.children
        columns = tuple(self.name(c) for c in cols.children)
        out = []
        for r in rows:
            key, *vals = r.children
            out.append(ast.TableRow(int(key), self.span(key), tuple((int(v), self.span(v)) for v in vals), self.span(r)))
        return ast.Table(self.name(name), self.name(level), columns, tuple(out), self.span(t))

    def link(self, t: Tree) -> ast.Link:
        name, kind, *props = t.children
        out = []
        for p in props:
            d = p.data
            key = d[: -len("_prop")]
            c = p.children
            if d == "connects_prop":
                val = self.rel_expr(c[0])
            elif d in ("bandwidth_prop", "latency_prop", "atomics_prop", "post_prop"):
                val = self.quantity(c[0])
            elif d == "engine_prop":
                val = self.name(c[0])
            elif d == "lanes_prop":
                val = int(c[0])
            elif d == "shared_prop":
                val = self.name(c[0])
            elif d == "engines_prop":
                val = tuple(ast.EngineRate(self.name(r.children[0]), self.quantity(r.children[1]), self.span(r))
                            for r in c)
            elif d == "efficiency_prop":
                val = self.number_quantity(c[0], "%" if len(c) > 1 else None)
            else:  # pragma: no cover
                raise AssertionError(d)
            out.append(ast.LinkProp(key, val, self.span(p)))
        return ast.Link(self.name(name), self.name(kind), tuple(out), self.span(t))

    def quantity(self, t: Tree) -> ast.Quantity:
        num = t.children[0]
        unit = None
        unit_span = None
        if len(t.children) > 1:
            u = t.children[1]
            unit = "/".join(str(x) for x in u.children)
            unit_span = self.span(u)
        return ast.Quantity(_number(num), num.type == "INT", unit, self.span(t), unit_span)

    def number_quantity(self, num: Token, unit: str | None) -> ast.Quantity:
        return ast.Quantity(_number(num), num.type == "INT", unit, self.span(num), None)

    # -- workload
    def workload(self, t: Tree) -> ast.Workload:
        items = []
        for it in t.children:
            key = it.data[: -len("_item")]
            vals = tuple(int(c) if c.type == "INT" else self.name(c) for c in it.children)
            items.append(ast.WorkloadItem(key, vals, self.span(it)))
        return ast.Workload(tuple(items), self.span(t))

    # -- programs
    def program(self, t: Tree, kind: str) -> ast.Program:
        bufs, defaults, steps = [], [], []
        for it in t.children:
            d = it.data
            if d == "buffer_decl":
                cap = self.quantity(it.children[1]) if len(it.children) > 1 else None
                bufs.append(ast.Buffer(self.name(it.children[0]), cap, self.span(it)))
            elif d == "defaults_decl":
                defaults.append(ast.Defaults(tuple(self.step_opt(o) for o in it.children), self.span(it)))
            elif d == "step":
                steps.append(self.step(it))
        sp = self.span(t)
        head = Span(sp.path, sp.line, sp.col, sp.line, sp.col + len(kind))
        return ast.Program(kind, tuple(bufs), tuple(defaults), tuple(steps), sp, head)

    def step(self, t: Tree) -> ast.Step:
        c = list(t.children)
        name = self.name(c.pop(0))
        title = None
        if isinstance(c[0], Token) and c[0].type == "STRING":
            title = _unquote(c.pop(0))
        action = self.action(c.pop(0))
        opts = tuple(self.step_opt(o) for o in c)
        return ast.Step(name, title, action, opts, self.span(t))

    def action(self, t: Tree) -> ast.Action:
        d = t.data
        verb = d[: -len("_action")]
        c = t.children
        sp = self.span(t)
        if verb in ("send", "pull", "copy"):
            sel, srcs, dst = c
            return ast.Action(verb, self.selection(sel), self.bufrefs(srcs), self.bufref(dst), None, None, sp)
        if verb == "permute":
            srcs, dst = c
            return ast.Action(verb, None, self.bufrefs(srcs), self.bufref(dst), None, None, sp)
        if verb == "reduce":
            src, dst = c
            return ast.Action(verb, None, (self.bufref(src),), self.bufref(dst), None, None, sp)
        if verb == "exchange":
            what, peers = c
            return ast.Action(verb, None, (), None, self.name(what), self.rankset(peers), sp)
        raise AssertionError(verb)  # pragma: no cover

    def selection(self, t: Tree) -> ast.Selection:
        mode = t.data[len("sel_"):]
        ranks = self.rankset(t.children[0]) if mode in ("for", "of") else None
        return ast.Selection(mode, ranks, self.span(t))

    def rankset(self, t: Tree) -> ast.RankSet:
        terms: list[tuple[str, ast.RankTerm]] = []
        op = "+"
        for c in t.children:
            if c.data == "rs_op":
                op = str(c.children[0])
                continue
            base = self.name(c.children[0])
            member = self.name(c.children[1]) if len(c.children) > 1 else None
            terms.append((op, ast.RankTerm(base, member, self.span(c))))
        return ast.RankSet(tuple(terms), self.span(t))

    def bufrefs(self, t: Tree) -> tuple[ast.BufRef, ...]:
        return tuple(self.bufref(b) for b in t.children)

    def bufref(self, t: Tree) -> ast.BufRef:
        if len(t.children) == 1:
            return ast.BufRef(None, self.name(t.children[0]), self.span(t))
        return ast.BufRef(self.name(t.children[0]), self.name(t.children[1]), self.span(t))

    def step_opt(self, t: Tree) -> ast.StepOpt:
        d = t.data
        sp = self.span(t)
        c = t.children
        if d == "over_opt":
            return ast.StepOpt("over", self.name(c[0]), sp)
        if d == "chunk_opt":
            return ast.StepOpt("chunk", self.quantity(c[0]), sp)
        if d == "depth_opt":
            return ast.StepOpt("depth", int(c[0]), sp)
        if d == "after_opt":
            return ast.StepOpt("after", tuple(self.name(x) for x in c), sp)
        if d == "parallel_opt":
            return ast.StepOpt("parallel", tuple(self.name(x) for x in c), sp)
        if d in ("order_first", "order_last"):
            return ast.StepOpt("order", d[len("order_"):], sp)
        if d == "sms_opt":
            return ast.StepOpt("sms", int(c[0]), sp)
        if d == "ramp_opt":
            return ast.StepOpt("ramp", int(c[0]), sp)
        if d == "dedup_opt":
            return ast.StepOpt("dedup", self.name(c[0]), sp)
        if d == "engine_opt":
            return ast.StepOpt("engine", self.name(c[0]), sp)
        raise AssertionError(d)  # pragma: no cover


def _number(tok: Token) -> int | float:
    """Integers stay exact (Python ints); decimals are floats."""
    return int(tok) if tok.type == "INT" else float(tok)


def _unquote(tok: Token) -> str:
    return str(tok)[1:-1]
