"""Resolving `dispatch { ... }` and `combine { ... }` programs into checked steps.

Every rank runs every step (SPMD).  In a step, `me` is the executing rank; a buffer written as
`rel.buf` is `buf` on each rank that `rel` relates to the executing rank (the *far* rank), and
`rel` inside a selection means that far rank.
"""

from __future__ import annotations

from typing import Callable

from ..diagnostics import DiagnosticBag, Note, Span, did_you_mean
from ..frontend import ast
from . import model
from .units import number_text, parse_size

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
DEDUP = ("rank", "none")
_DEFAULTABLE = ("chunk", "depth", "sms", "ramp", "dedup")
MAX_DEPTH = 1 << 16
MAX_SMS = 4096
MAX_RAMP = 8  # halvings: a chunk of 256 tokens ramps from 1


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
        defaults = self._defaults()
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
        self._dataflow(steps, by_name)
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

    def _defaults(self) -> dict[str, ast.StepOpt]:
        out: dict[str, ast.StepOpt] = {}
        for d in self.p.defaults:
            for o in d.opts:
                if o.key not in _DEFAULTABLE:
                    self.err(o.span, f"'{o.key}' cannot be a default; it belongs to one step",
                             f"defaults may set {', '.join(_DEFAULTABLE)}")
                    continue
                if o.key in out:
                    self.err(o.span, f"default '{o.key}' is given twice", Note("first given here", out[o.key].span))
                    continue
                out[o.key] = o
        return out

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
        self._options(st, s, defaults, resolve_link=ok)
        if not ok or any(d.severity == "error" for d in self.diags.items[n_err:]):
            return None
        return st

    def _exchange(self, st: model.Step, a: ast.Action) -> bool:
        if a.what.text not in EXCHANGE_WHAT:
            self.err(a.what.span, f"cannot exchange '{a.what.text}'", *_maybe(did_you_mean(a.what.text, EXCHANGE_WHAT)),
                     f"exchangeable metadata: {', '.join(EXCHANGE_WHAT)}")
            return False
        st.exchange_what = a.what.text
        st.exchange_peers = self._rankset(a.peers, far=None)
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
            notes = list(_maybe(did_you_mean(b.buf.text, cands)))
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
            self.err(n.span, f"unknown relation '{n.text}'", *_maybe(did_you_mean(n.text, rels)))
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
        rs = self._rankset(sel.ranks, far)
        if rs is None:
            return None
        return model.Selection(sel.mode, rs, sel.span)

    # ------------------------------------------------------------------ rank sets
    def _rankset(self, rs: ast.RankSet, far: model.RelationInfo | None) -> model.RankSetExpr | None:
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
                         *_maybe(did_you_mean(member, scopes + list(rels))))
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
        self.err(t.base.span, f"unknown rank set '{base}'", *_maybe(did_you_mean(base, cands)),
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

    # ------------------------------------------------------------------ options
    def _options(self, st: model.Step, s: ast.Step, defaults: dict[str, ast.StepOpt], resolve_link: bool) -> None:
        given: dict[str, ast.StepOpt] = {}
        for o in s.opts:
            if o.key in given:
                self.err(o.span, f"'{o.key}' is given twice for step '{st.name}'", Note("first given here", given[o.key].span))
                continue
            given[o.key] = o
        opts = dict(defaults)
        opts.update(given)
        for key, o in opts.items():
            st.opt_spans[key] = o.span
            if key == "chunk":
                res = parse_size(o.value, "a chunk", self.diags)
                if res is not None:
                    st.chunk_tokens, st.chunk_bytes = res
            elif key == "depth":
                if o.value < 1:
                    self.err(o.span, f"pipeline depth must be at least 1, not {o.value}")
                elif o.value > MAX_DEPTH:
                    self.err(o.span, f"pipeline depth {number_text(o.value)} is out of range (at most {MAX_DEPTH})")
                st.depth = o.value
            elif key == "sms":
                if o.value < 1:
                    self.err(o.span, f"a step needs at least 1 SM, not {o.value}")
                elif o.value > MAX_SMS:
                    self.err(o.span, f"{number_text(o.value)} SMs is out of range (at most {MAX_SMS})")
                st.sms = o.value
            elif key == "ramp":
                if o.value > MAX_RAMP:
                    self.err(o.span, f"ramp {number_text(o.value)} is out of range (at most {MAX_RAMP} halvings; "
                             f"0 keeps every chunk whole)")
                st.ramp = o.value
            elif key == "dedup":
                if o.value.text not in DEDUP:
                    self.err(o.value.span, f"unknown dedup mode '{o.value.text}'", *_maybe(did_you_mean(o.value.text, DEDUP)),
                             "dedup rank: one copy per token and receiving rank; dedup none: one copy per expert")
                st.dedup = o.value.text
            elif key == "order":
                st.order = o.value
            elif key == "after":
                st.after = tuple(n.text for n in o.value)
            elif key == "parallel":
                st.parallel = tuple(n.text for n in o.value)
        if resolve_link:
            self._link(st, given.get("over"))

    def _link(self, st: model.Step, over: ast.StepOpt | None) -> None:
        links = self.topo.links
        local = st.verb in ("copy", "permute", "reduce")
        if over is not None:
            name = over.value
            if name.text in self.topo.broken_links:
                return  # the link's declaration is wrong: already reported there
            if name.text not in links:
                self.err(name.span, f"unknown link '{name.text}'", *_maybe(did_you_mean(name.text, links)))
                return
            link = links[name.text]
            if local and link.kind != "local":
                self.err(name.span, f"'{st.verb}' stays on the rank, but '{link.name}' is a {link.kind} link",
                         "use a local link (e.g. 'link hbm local { bandwidth 3 TB/s }') or drop 'over'")
                return
            if not local and link.kind == "local":
                self.err(name.span, f"step '{st.name}' moves data between ranks, but '{link.name}' is a local link")
                return
            if st.verb == "exchange":
                self._check_exchange_link(st, link, name.span)
            elif not local:
                self._check_link_pairs(st, link, name.span)
            st.link = link
            return
        if local:
            cands = self.topo.local_links()
            if len(cands) == 1:
                st.link = cands[0]
            elif len(cands) > 1:
                self.err(st.span, f"step '{st.name}' could use any of the local links "
                                  f"{', '.join(l.name for l in cands)}; name one with 'over'")
            return
        if st.verb == "exchange":
            return  # metadata is routed by the compiler over whatever links reach the peers
        cands = [l for l in links.values() if l.kind != "local" and all(
            l.connects(a, b) for r in range(self.space.num_ranks) for a, b in st.flows(r))]
        if len(cands) == 1:
            st.link = cands[0]
            return
        if not cands:
            # Name the first pair no link joins.
            for r in range(self.space.num_ranks):
                for a, b in st.flows(r):
                    if not any(l.connects(a, b) for l in links.values()):
                        self.err(st.span, f"no link connects {self.space.describe(a)} to {self.space.describe(b)}, "
                                          f"which step '{st.name}' moves data between ({_rel_role(st)})",
                                 *( [f"links: {', '.join(links)}"] if links else ["the topology declares no links"]))
                        return
            self.err(st.span, f"no single link connects every pair that step '{st.name}' moves data between",
                     "split the step by link, or name one with 'over'")
            return
        self.err(st.span, f"step '{st.name}' could use any of the links {', '.join(l.name for l in cands)}; "
                          f"name one with 'over'")

    def _check_link_pairs(self, st: model.Step, link: model.LinkInfo, span: Span) -> None:
        for r in range(self.space.num_ranks):
            for a, b in st.flows(r):
                if not link.connects(a, b):
                    others = [l.name for l in self.topo.links.values() if l.connects(a, b) and l.kind != "local"]
                    notes = [f"link '{link.name}' connects '{link.relation_text}'"]
                    if others:
                        notes.append(f"{'link' if len(others) == 1 else 'links'} {', '.join(others)} "
                                     f"{'connects' if len(others) == 1 else 'connect'} that pair")
                    self.err(span, f"link '{link.name}' does not connect {self.space.describe(a)} to "
                                   f"{self.space.describe(b)} ({_rel_role(st)})", *notes)
                    return

    def _check_exchange_link(self, st: model.Step, link: model.LinkInfo, span: Span) -> None:
        for r in range(self.space.num_ranks):
            for p in sorted(st.exchange_peers.evaluate(r, None) - {r}) if st.exchange_peers else ():
                if not link.connects(r, p):
                    self.err(span, f"link '{link.name}' does not connect {self.space.describe(r)} to "
                                   f"{self.space.describe(p)}, a rank it exchanges {st.exchange_what} with",
                             "drop 'over' to let the compiler route metadata")
                    return

    # ------------------------------------------------------------------ dataflow
    def _dataflow(self, steps: list[model.Step], by_name: dict[str, ast.Step]) -> None:
        names = {s.name: s for s in steps}
        writers: dict[str, list[model.Step]] = {}
        exchanges: list[model.Step] = []
        for s in steps:
            # Data steps need the counts/layout that earlier metadata exchanges produce.
            deps: list[str] = [] if s.verb == "exchange" else [x.name for x in exchanges]
            if s.verb == "exchange":
                data_before = [t for t in steps if t.index < s.index and t.verb != "exchange"]
                if data_before:
                    self.diags.warning(s.span, f"metadata exchange '{s.name}' comes after data step "
                                               f"'{data_before[0].name}', which cannot use its {s.exchange_what}",
                                       "exchange metadata first; later data steps wait for it")
                exchanges.append(s)
            for src in s.sources:
                buf = src.buffer
                if buf.role == "staging":
                    ws = writers.get(buf.name, [])
                    if not ws:
                        later = [t for t in steps if t.index > s.index and t.dest is not None and t.dest.buffer.name == buf.name]
                        notes = [Note(f"'{buf.name}' is first written by step '{later[0].name}', which comes later",
                                      later[0].span)] if later else [f"no step writes '{buf.name}'"]
                        self.err(src.span, f"buffer '{buf.name}' is read by step '{s.name}' before any step writes it", *notes)
                        continue
                    deps.extend(w.name for w in ws)
            s.data_deps = tuple(dict.fromkeys(deps))
            if s.dest is not None:
                writers.setdefault(s.dest.buffer.name, []).append(s)
        # Explicit dependencies and hints.
        for s in steps:
            for key in ("after", "parallel"):
                for n in getattr(s, key):
                    if n not in names:
                        self.err(s.opt_spans[key], f"unknown step '{n}'", *_maybe(did_you_mean(n, names)))
        if self.diags.has_errors:
            return
        self._cycles(steps, names)
        if self.diags.has_errors:
            return
        anc = _ancestors(steps)
        for s in steps:
            for n in s.parallel:
                if n == s.name:
                    self.err(s.opt_spans["parallel"], f"step '{s.name}' is said to run in parallel with itself")
                elif n in anc[s.name] or s.name in anc[n]:
                    first, second = (n, s.name) if n in anc[s.name] else (s.name, n)
                    self.err(s.opt_spans["parallel"],
                             f"steps '{s.name}' and '{n}' cannot run in parallel: '{second}' depends on '{first}'",
                             _why(names[second], first))
        # Buffers nobody reads / writes.
        read = {src.buffer.name for s in steps for src in s.sources}
        written = {s.dest.buffer.name for s in steps if s.dest is not None}
        for name, b in self.buffers.items():
            if b.role != "staging":
                continue
            if name not in read and name not in written:
                self.diags.warning(b.span, f"buffer '{name}' is never used")
            elif name not in read:
                self.diags.warning(b.span, f"data written to buffer '{name}' is never read")

    def _cycles(self, steps: list[model.Step], names: dict[str, model.Step]) -> None:
        state: dict[str, int] = {}
        stack: list[str] = []

        def visit(n: str) -> bool:
            state[n] = 1
            stack.append(n)
            for d in names[n].deps:
                if state.get(d) == 1:
                    cyc = stack[stack.index(d):] + [d]
                    # Report at the explicit `after` that closes the cycle.
                    culprit = next((names[x] for x in cyc if names[x].after and any(
                        y in names[x].after for y in cyc)), names[n])
                    span = culprit.opt_spans.get("after", culprit.span)
                    self.err(span, "dependency cycle: " + " -> ".join(reversed(cyc)),
                             "a step waits for the steps it names in 'after' and for the steps whose buffers it reads")
                    return True
                if state.get(d) is None and visit(d):
                    return True
            stack.pop()
            state[n] = 2
            return False

        for s in steps:
            if state.get(s.name) is None and visit(s.name):
                return

    def _check_sink(self, steps: list[model.Step]) -> None:
        sink = next(n for n, r in BUILTINS[self.kind].items() if r == "sink")
        if not any(s.dest is not None and s.dest.buffer.name == sink for s in steps):
            self.err(self.p.head_span, f"the {self.kind} program never writes '{sink}' "
                                       f"({BUILTIN_DOC[(self.kind, sink)]})",
                     "without it no token is delivered")


def _ancestors(steps: list[model.Step]) -> dict[str, set[str]]:
    names = {s.name: s for s in steps}
    memo: dict[str, set[str]] = {}

    def anc(n: str) -> set[str]:
        if n not in memo:
            memo[n] = set()
            acc: set[str] = set()
            for d in names[n].deps:
                acc.add(d)
                acc |= anc(d)
            memo[n] = acc
        return memo[n]

    return {s.name: anc(s.name) for s in steps}


def _why(step: model.Step, dep: str) -> str:
    if dep in step.after:
        return f"'{step.name}' says 'after {dep}'"
    if dep in step.data_deps:
        return f"'{step.name}' reads what '{dep}' writes"
    return f"'{step.name}' waits for '{dep}' through other steps"


def _rel_role(st: model.Step) -> str:
    if st.verb == "send":
        return f"'{st.name}' sends to its '{st.relation.name}'"
    return f"'{st.name}' pulls from its '{st.relation.name}'"


def _set_text(space: model.RankSpace, s: frozenset[int]) -> str:
    if not s:
        return "no rank"
    items = sorted(s)
    if len(items) == 1:
        return f"rank {items[0]}"
    shown = ", ".join(map(str, items[:6])) + (", ..." if len(items) > 6 else "")
    return f"ranks {{{shown}}}"


def _maybe(x):
    return (x,) if x else ()
