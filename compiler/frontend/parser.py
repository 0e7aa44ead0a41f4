"""Reading and parsing .sched files.

The only boundary between lark and the rest of epcc: lark's exceptions become
:class:`~epcc.diagnostics.CompileError` with the expected tokens said in words, and lark trees
become the frozen AST of :mod:`epcc.frontend.ast`.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from ..diagnostics import CompileError, Diagnostic, Note, SourceMap, Span, did_you_mean
from . import ast

MAX_EXPR_DEPTH = 200  # operators nested in one expression (relations, selections)

# How a terminal is named in "expected ..." lists.
TOKEN_WORDS = {
    "NAME": "a name",
    "INT": "an integer",
    "DECIMAL": "a decimal number",
    "STRING": "a quoted string",
    "ALL_TOKENS": "'all tokens'",
    "$END": "end of file",
}


@functools.lru_cache(maxsize=1)
def _parser() -> Lark:
    text = resources.files(__package__).joinpath("grammar.lark").read_text(encoding="utf-8")
    return Lark(text, parser="lalr", propagate_positions=True, maybe_placeholders=False)


def read_source(path: str) -> str:
    """The text of a .sched file, or a CompileError naming the file."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise CompileError([Diagnostic("error", f"{path}: no such file", None)]) from None
    except IsADirectoryError:
        raise CompileError([Diagnostic("error", f"{path}: is a directory, not a .sched file", None)]) from None
    except OSError as e:
        raise CompileError([Diagnostic("error", f"{path}: cannot read: {e.strerror}", None)]) from None
    if data[:2] in (b"\xff\xfe", b"\xfe\xff") and b"\x00" in data[2:64]:
        raise CompileError([Diagnostic("error", f"{path}: the file is UTF-16 encoded; save it as UTF-8", None)])
    if b"\x00" in data:
        at = data.index(b"\x00")
        line = data[:at].count(b"\n") + 1
        col = at - (data.rfind(b"\n", 0, at) + 1) + 1
        raise CompileError([Diagnostic("error", "NUL byte: a binary file? expected .sched text", Span.point(path, line, col))])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise CompileError(
            [Diagnostic("error", f"file is not valid UTF-8 (byte 0x{data[e.start]:02x})", Span.point(path, line, col))]
        ) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    return text


def parse_file(path: str, sources: SourceMap | None = None) -> ast.File:
    text = read_source(path)
    if sources is not None:
        sources.add(path, text)
    return parse_text(text, path)


def parse_text(text: str, path: str = "<input>") -> ast.File:
    if not text.strip() or all(_is_comment_or_blank(line) for line in text.splitlines()):
        raise CompileError(
            [
                Diagnostic(
                    "error",
                    "empty schedule: expected a 'topology', a 'workload' and 'dispatch'/'combine' programs",
                    Span.point(path, 1, 1),
                )
            ]
        )
    try:
        tree = _parser().parse(text)
    except UnexpectedInput as e:
        raise CompileError([_syntax_error(e, text, path)]) from None
    return _Builder(path).file(tree, text)


def _is_comment_or_blank(line: str) -> bool:
    s = line.strip()
    return not s or s.startswith("#")


# --------------------------------------------------------------------------- syntax errors


def _word(term: str) -> str:
    if term in TOKEN_WORDS:
        return TOKEN_WORDS[term]
    try:
        t = _parser().get_terminal(term)
    except KeyError:
        return term.lower()
    if t.pattern.type == "str":
        return f"'{t.pattern.value}'"
    return term.lower()


def _expected_words(expected: set[str]) -> list[str]:
    words = {_word(t) for t in expected}
    if {"an integer", "a decimal number"} <= words:
        words -= {"an integer", "a decimal number"}
        words.add("a number")
    words = sorted(words)
    # Keywords first, then classes ('a name', ...), end of file last.
    return sorted(words, key=lambda w: (w == "end of file", not w.startswith("'"), w))


def _keywords(expected: set[str]) -> list[str]:
    out = []
    for t in expected:
        w = _word(t)
        if w.startswith("'") and w[1:-1].replace("_", "").isalpha():
            out.append(w[1:-1])
    return out


def _syntax_error(e: UnexpectedInput, text: str, path: str) -> Diagnostic:
    notes: list[Note] = []
    if isinstance(e, UnexpectedToken) and e.token.type == "$END":
        expected = _expected_words(set(e.expected))
        line, col = _end_position(text)
        msg = f"unexpected end of file; expected {_one_of(expected)}"
        return Diagnostic("error", msg, Span.point(path, line, col))
    if isinstance(e, UnexpectedEOF):
        line, col = _end_position(text)
        return Diagnostic("error", f"unexpected end of file; expected {_one_of(_expected_words(set(e.expected)))}",
                          Span.point(path, line, col))
    if isinstance(e, UnexpectedToken) and str(e.token) == "." and e.token.start_pos is not None:
        dec = _decimal_at(text, e.token.start_pos, e.token.line, e.token.column, path)
        if dec is not None:
            return dec
    if isinstance(e, UnexpectedToken):
        tok = e.token
        expected_terms = set(e.accepts or e.expected) if getattr(e, "accepts", None) else set(e.expected)
        expected = _expected_words(expected_terms)
        shown = _show_token(tok)
        span = Span(path, tok.line, tok.column, tok.end_line or tok.line, tok.end_column or tok.column + 1)
        if tok.type == "NAME" or _word(tok.type).startswith("'"):
            hint = did_you_mean(str(tok), _keywords(expected_terms))
            if hint:
                notes.append(Note(hint))
        return Diagnostic("error", f"unexpected {shown}; expected {_one_of(expected)}", span, tuple(notes))
    if isinstance(e, UnexpectedCharacters):
        ch = text[e.pos_in_stream] if e.pos_in_stream < len(text) else ""
        span = Span.point(path, e.line, e.column)
        # What the parser (not just the lexer state) accepts here.
        allowed = set(e.allowed or ())
        ip = getattr(e, "interactive_parser", None)
        if ip is not None:
            try:
                allowed = {t for t in ip.accepts() if t != "$END"} or allowed
            except Exception:  # the lexer's list is still a fine answer
                pass
        expected = _expected_words(allowed)
        dec = _decimal_at(text, e.pos_in_stream, e.line, e.column, path)
        if dec is not None:
            return dec
        if ch == '"':
            return Diagnostic("error", "unterminated string: a quoted string must end on the same line", span)
        what = f"character {ch!r}" if ch.isprintable() else f"character U+{ord(ch):04X}"
        msg = f"unexpected {what}"
        if expected:
            msg += f"; expected {_one_of(expected)}"
        return Diagnostic("error", msg, span)
    return Diagnostic("error", f"syntax error: {e}", Span.point(path, getattr(e, "line", 1), getattr(e, "column", 1)))


def _decimal_at(text: str, pos: int, line: int, col: int, path: str) -> Diagnostic | None:
    """`topk 2.5`: a decimal point inside a number where the grammar wants a whole number."""
    if not (0 < pos < len(text) - 1 and text[pos] == "." and text[pos - 1].isdigit() and text[pos + 1].isdigit()):
        return None
    start, end = pos, pos + 1
    while start > 0 and text[start - 1].isdigit():
        start -= 1
    while end < len(text) and text[end].isdigit():
        end += 1
    c0 = col - (pos - start)
    return Diagnostic("error", f"'{text[start:end]}' is not a whole number; a whole number is expected here",
                      Span(path, line, c0, line, c0 + end - start))


def _show_token(tok: Token) -> str:
    if tok.type == "NAME":
        return f"name '{tok}'"
    if tok.type in ("INT", "DECIMAL"):
        return f"number {tok}"
    if tok.type == "STRING":
        return f"string {tok}"
    return f"'{tok}'"


def _one_of(words: list[str]) -> str:
    if not words:
        return "nothing more"
    if len(words) == 1:
        return words[0]
    if len(words) <= 14:
        return "one of " + ", ".join(words[:-1]) + " or " + words[-1]
    return "one of " + ", ".join(words[:14]) + ", ..."


def _end_position(text: str) -> tuple[int, int]:
    lines = text.splitlines() or [""]
    # Point just after the last non-blank line.
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].strip():
            return i + 1, len(lines[i].rstrip()) + 1
    return 1, 1


# --------------------------------------------------------------------------- tree -> AST


class _Builder:
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
        lines = text.splitlines() or [""]
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
        groups, rels, tables, links, sm_rates = [], [], [], [], []
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
        return ast.Topology(name, tuple(levels), levels_span, rank, tuple(groups), tuple(rels), tuple(tables),
                            tuple(links), self.span(tree), tuple(extra_ranks), tuple(sm_rates))

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
        raise AssertionError(d)  # pragma: no cover


def _number(tok: Token) -> int | float:
    """Integers stay exact (Python ints); decimals are floats."""
    return int(tok) if tok.type == "INT" else float(tok)


def _unquote(tok: Token) -> str:
    return str(tok)[1:-1]
