"""Resolving `dispatch { ... }` and `combine { ... }` programs into checked steps.

Every rank runs every step (SPMD).  In a step, `me` is the executing rank; a buffer written as
`rel.buf` is `buf` on each rank that `rel` relates to the executing rank (the *far* rank), and
`rel` inside a selection means that far rank.

This module resolves a program's buffers and each step's action (its verb, buffers, relation
and selection).  The rest of a program is resolved beside it: rank sets in
:mod:`epcc.sema.ranksets`, step options, defaults and links in :mod:`epcc.sema.step_options`,
and the dependency graph of the steps in :mod:`epcc.sema.step_graph`.
"""

from __future__ import annotations

from ..diagnostics import DiagnosticBag, Note, Span
from ..frontend import ast
from . import model
from .hints import suggestion
from .ranksets import RankSetResolver
from .step_graph import check_step_graph
from .step_options import StepOptions, program_defaults
from .units import parse_size

BUILTINS = {
    "dispatch": {"input": "source", "output": "sink"},
    "combine": {"output": "source", "result": "sink"},
}
BUILTIN_DOC = {
    ("dispatch", "input"): "the rank's own tokens",
    ("dispatch", "output"): "the expert-major receive buffer",
    ("combine", "output"): "the expert outputs, where dispatch left them",
    ("combine", "result"): "the combined tokens, at their home rank",
}
VERBS_BY_KIND = {
    "dispatch": ("send", "pull", "copy", "permute", "exchange"),
    "combine": ("send", "pull", "copy", "reduce", "exchange"),
}
EXCHANGE_WHAT = ("counts", "routing", "layout")


def resolve_program(p: ast.Program, topo: model.Topology, wl: model.Workload | None,
                    diags: DiagnosticBag) -> model.Program | None:
    return _ProgramResolver(p, topo, wl, diags).run()


class _ProgramResolver:
    def __init__(self, p: ast.Program, topo: model.Topology, wl, diags: DiagnosticBag):
        self.p = p
        self.kind = p.kind
        self.topo = topo
        self.space = topo.space
        self.diags = diags
        self._said: set = set()  # (path, line, col, message) of the errors reported (err)
        self.buffers: dict[str, model.BufferInfo] = {}
        self.buffer_ast: dict[str, ast.Buffer] = {}
        self.broken_buffers: set[str] = set()
        self.ranksets = RankSetResolver(topo, self.err)
        self.options = StepOptions(topo, diags, self.err)

    def err(self, span: Span, msg: str, *notes) -> None:
        # once per place and message: a bad `defaults` option is checked for every step inheriting it
        key = (span.path, span.line, span.col, msg) if span is not None else None
        if key is not None and key in self._said:
            return
        self._said.add(key)
        self.diags.error(span, msg, *notes)

    def run(self) -> model.Program | None:
        n_err = len(self.diags.items)
        for name, role in BUILTINS[self.kind].items():
            self.buffers[name] = model.BufferInfo(name, role, None, None, None)
        for b in self.p.buffers:
            self._buffer(b)
        defaults = program_defaults(self.p, self.err)
        steps: list[model.Step] = []
        by_name: dict[str, ast.Step] = {}
        dropped = False
        for i, s in enumerate(self.p.steps):
            if s.name.text in by_name:
                self.err(s.name.span, f"duplicate step '{s.name.text}'", Note("first defined here", by_name[s.name.text].name.span))
                continue
            by_name[s.name.text] = s
            st = self._step(s, len(steps), defaults)
            if st is not None:
                steps.append(st)
            elif self.diags.has_errors:
                dropped = True
        if any(d.severity == "error" for d in self.diags.items[n_err:]):
            return None
        if dropped:  # a step that an earlier error (its relation, its link) made unresolvable: the
            return None  # dataflow checks would only report its absence as errors of their own
        if not self.p.steps:
            self.err(self.p.head_span, f"the {self.kind} program has no steps")
            return None
        check_step_graph(steps, self.buffers, self.diags, self.err)
        self._check_sink(steps)
        if any(d.severity == "error" for d in self.diags.items[n_err:]):
            return None
        return model.Program(self.kind, dict(self.buffers), tuple(steps), False, self.p.span)

    # ------------------------------------------------------------------ declarations
    def _buffer(self, b: ast.Buffer) -> None:
        name = b.name.text
        if name in BUILTINS[self.kind]:
            self.err(b.name.span, f"'{name}' is a built-in buffer of {self.kind} ({BUILTIN_DOC[(self.kind, name)]})",
                     "choose another name for a staging buffer")
            return
        if name in self.buffer_ast:
            self.err(b.name.span, f"duplicate buffer '{name}'", Note("first defined here", self.buffer_ast[name].name.span))
            return
        toks = byts = None
        if b.capacity is not None:
            res = parse_size(b.capacity, "a buffer capacity", self.diags)
            if res is None:
                self.broken_buffers.add(name)
                return
            toks, byts = res
        self.buffer_ast[name] = b
        self.buffers[name] = model.BufferInfo(name, "staging", toks, byts, b.span)

    # ------------------------------------------------------------------ steps
    def _step(self, s: ast.Step, index: int, defaults: dict[str, ast.StepOpt]) -> model.Step | None:
        a = s.action
        verb = a.verb
        n_err = len(self.diags.items)
        if verb not in VERBS_BY_KIND[self.kind]:
            other = "combine" if self.kind == "dispatch" else "dispatch"
            hint = {"reduce": "in dispatch, move tokens with send/pull/copy and place them with permute",
                    "permute": "in combine, sum expert outputs with reduce"}[verb]
            self.err(a.span, f"'{verb}' belongs in {other}, not in {self.kind}", hint)
            return None
        st = model.Step(s.name.text, s.title, verb, s.span, index)
        ok = self._exchange(st, a) if verb == "exchange" else self._transfer(st, a)
        # Links are checked against the step's rank pairs: only once the step itself resolved.
        self.options.apply(st, s, defaults, resolve_link=ok)
        if not ok or any(d.severity == "error" for d in self.diags.items[n_err:]):
            return None
        return st

    def _exchange(self, st: model.Step, a: ast.Action) -> bool:
        if a.what.text not in EXCHANGE_WHAT:
            self.err(a.what.span, f"cannot exchange '{a.what.text}'", *suggestion(a.what.text, EXCHANGE_WHAT),
                     f"exchangeable metadata: {', '.join(EXCHANGE_WHAT)}")
            return False
        st.exchange_what = a.what.text
        st.exchange_peers = self.ranksets.rankset(a.peers, far=None)
        if st.exchange_peers is None:
            return False
        if not any(st.exchange_peers.evaluate(r, None) - {r} for r in range(self.space.num_ranks)):
            self.err(a.peers.span, f"'{st.exchange_peers.text}' names no rank but the executing one; "
                                   f"there is nothing to exchange")
            return False
        return True

    def _transfer(self, st: model.Step, a: ast.Action) -> bool:
        verb = st.verb
        srcs = [self._bufaccess(b) for b in a.sources]
        dst = self._bufaccess(a.dest)
        if any(x is None for x in srcs) or dst is None:
            return False
        seen_src: dict[str, model.BufAccess] = {}
        for x in srcs:
            if x.text() in seen_src:
                self.err(x.span, f"step '{st.name}' reads '{x.text()}' twice; its tokens would be moved twice",
                         Note("first listed here", seen_src[x.text()].span))
                return False
            seen_src[x.text()] = x
        if verb == "permute" and dst.buffer.role != "sink":
            self.err(dst.span, f"permute writes expert-major rows into 'output', not into '{dst.text()}'",
                     "to move tokens into a staging buffer, use 'copy' (local) or 'send'/'pull'")
            return False
        st.sources, st.dest = tuple(srcs), dst
        # Which side is remote.
        remote_src = [x for x in srcs if x.relation is not None]
        if verb == "send":
            if remote_src:
                self.err(remote_src[0].span, "a send reads the executing rank's own buffer",
                         f"to read '{remote_src[0].text()}', use 'pull ... from {remote_src[0].text()} into ...'")
                return False
            if dst.relation is None:
                self.err(dst.span, f"a send writes another rank's buffer: write '<relation>.{dst.buffer.name}'",
                         "for a local move use 'copy'")
                return False
            st.relation = dst.relation
            if not self._far_ok(dst):
                return False
        elif verb == "pull":
            if dst.relation is not None:
                self.err(dst.span, "a pull writes the executing rank's own buffer",
                         f"to write '{dst.text()}', use 'send ... to {dst.text()}'")
                return False
            local_src = [x for x in srcs if x.relation is None]
            if local_src:
                self.err(local_src[0].span,
                         f"a pull reads another rank's buffer: write '<relation>.{local_src[0].buffer.name}'",
                         "for a local move use 'copy'")
                return False
            rels = {x.relation.name for x in srcs}
            if len(rels) > 1:
                self.err(a.span, f"a pull reads from one relation at a time, not from {', '.join(sorted(rels))}",
                         "split it into one pull per relation")
                return False
            st.relation = remote_src[0].relation
            if not self._far_ok(remote_src[0]):
                return False
        else:
            for x in srcs + [dst]:
                if x.relation is not None:
                    self.err(x.span, f"'{verb}' works on the executing rank's own buffers",
                             "move data between ranks with send or pull")
                    return False
        # Roles of built-in buffers.
        for x in srcs:
            if x.buffer.role == "sink":
                self.err(x.span, f"'{x.buffer.name}' is where {self.kind} delivers ({BUILTIN_DOC[(self.kind, x.buffer.name)]}); "
                                 f"it cannot be read in {self.kind}", "stage data through a buffer of your own")
                return False
        if dst.buffer.role == "source":
            self.err(dst.span, f"'{dst.buffer.name}' is read-only in {self.kind} ({BUILTIN_DOC[(self.kind, dst.buffer.name)]})")
            return False
        far = st.relation
        if a.selection is not None:
            st.selection = self._selection(a.selection, far)
            if st.selection is None:
                return False
        if dst.buffer.role == "sink":
            n_err = len(self.diags.items)
            self._check_sink_selection(st, a)
            return len(self.diags.items) == n_err
        return True

    def _far_ok(self, acc: model.BufAccess) -> bool:
        r = acc.relation.self_pair()
        if r is None:
            return True
        self.err(acc.span, f"relation '{acc.relation.name}' relates {self.space.describe(r)} to itself; a step "
                           f"cannot move data from a rank to itself over a link",
                 "exclude the rank itself (e.g. 'other <level>') or use 'copy' for a local move")
        return False

    def _check_sink_selection(self, st: model.Step, a: ast.Action) -> None:
        """Writes into output/result must carry exactly the receiver's tokens."""
        sel = st.selection
        if sel is None:  # permute / reduce: implicitly the receiver's own tokens
            return
        want_mode = "for" if self.kind == "dispatch" else "of"
        sink = st.dest.buffer.name
        noun = "routed to" if self.kind == "dispatch" else "homed at"
        recv_word = st.relation.name if st.verb == "send" else "me"
        fix = f"select 'tokens {want_mode} {recv_word}'"
        if sel.mode != want_mode:
            self.err(sel.span, f"step '{st.name}' writes '{sel.text()}' into {st.dest.text()}; only tokens {noun} "
                               f"the receiving rank belong there", fix)
            return
        for r in range(self.space.num_ranks):
            for src, dst in st.flows(r):
                far = dst if st.verb == "send" else (src if st.verb == "pull" else None)
                got = sel.ranks.evaluate(r, far)
                if got != {dst}:
                    self.err(sel.span, f"step '{st.name}' writes tokens {noun} {_set_text(self.space, got)} into "
                                       f"'{sink}' of {self.space.describe(dst)}; only tokens {noun} that rank belong there",
                             fix)
                    return

    def _bufaccess(self, b: ast.BufRef) -> model.BufAccess | None:
        rel = None
        if b.rel is not None:
            rel = self._relation_name(b.rel)
            if rel is None:
                return None
        if b.buf.text in self.broken_buffers:
            return None  # declared, but its declaration is wrong: already reported there
        if b.buf.text not in self.buffers:
            cands = list(self.buffers)
            notes = list(suggestion(b.buf.text, cands))
            if not notes:
                notes.append(f"declare it: 'buffer {b.buf.text}'")
            self.err(b.buf.span, f"unknown buffer '{b.buf.text}'", *notes)
            return None
        return model.BufAccess(self.buffers[b.buf.text], rel, b.span)

    def _relation_name(self, n: ast.Name) -> model.RelationInfo | None:
        rels = self.topo.relations
        if n.text in self.topo.broken_relations:
            return None  # declared, but its declaration is wrong: already reported there
        if n.text not in rels:
            self.err(n.span, f"unknown relation '{n.text}'", *suggestion(n.text, rels))
            return None
        return rels[n.text]

    def _selection(self, sel: ast.Selection, far: model.RelationInfo | None) -> model.Selection | None:
        if sel.mode in ("all", "any"):
            return model.Selection("all", None, sel.span)
        if self.kind == "dispatch" and sel.mode == "of":
            self.err(sel.span, "dispatch selects tokens by destination: write 'tokens for ...'",
                     "'tokens of S' (by home rank) is for combine")
            return None
        if self.kind == "combine" and sel.mode == "for":
            self.err(sel.span, "combine selects partial sums by their home rank: write 'tokens of ...'",
                     "'tokens for S' (by destination) is for dispatch")
            return None
        rs = self.ranksets.rankset(sel.ranks, far)
        if rs is None:
            return None
        return model.Selection(sel.mode, rs, sel.span)

    def _check_sink(self, steps: list[model.Step]) -> None:
        """The program must write its sink (`output` / `result`) somewhere."""
        sink = next(n for n, r in BUILTINS[self.kind].items() if r == "sink")
        if not any(s.dest is not None and s.dest.buffer.name == sink for s in steps):
            self.err(self.p.head_span, f"the {self.kind} program never writes '{sink}' "
                                       f"({BUILTIN_DOC[(self.kind, sink)]})",
                     "without it no token is delivered")


def _set_text(space: model.RankSpace, s: frozenset[int]) -> str:
    if not s:
        return "no rank"
    items = sorted(s)
    if len(items) == 1:
        return f"rank {items[0]}"
    shown = ", ".join(map(str, items[:6])) + (", ..." if len(items) > 6 else "")
    return f"ranks {{{shown}}}"
