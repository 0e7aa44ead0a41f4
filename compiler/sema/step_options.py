"""Step options: `defaults { ... }`, each step's own options, and the link a step runs over.

A step takes every option of its program's `defaults` blocks that it does not give itself (only
the options in DEFAULTABLE may be defaults).  Its link is the one it names with `over`, checked
against every rank pair it moves data between; without `over`, the one link that joins all of
those pairs (for a local step, the one local link).  A metadata exchange without `over` is
routed by the compiler.
"""

from __future__ import annotations

from typing import Callable

from ..diagnostics import DiagnosticBag, Note, Span
from ..frontend import ast
from ..limits import MAX_DEPTH, MAX_RAMP, MAX_SMS
from . import model
from .hints import suggestion
from .units import number_text, parse_size

DEDUP = ("rank", "none")
DEFAULTABLE = ("chunk", "depth", "sms", "ramp", "dedup")


def program_defaults(p: ast.Program, err: Callable[..., None]) -> dict[str, ast.StepOpt]:
    """The options of the program's `defaults` blocks, by key (each key once)."""
    out: dict[str, ast.StepOpt] = {}
    for d in p.defaults:
        for o in d.opts:
            if o.key not in DEFAULTABLE:
                err(o.span, f"'{o.key}' cannot be a default; it belongs to one step",
                    f"defaults may set {', '.join(DEFAULTABLE)}")
                continue
            if o.key in out:
                err(o.span, f"default '{o.key}' is given twice", Note("first given here", out[o.key].span))
                continue
            out[o.key] = o
    return out


class StepOptions:
    """Applies options to the steps of one program; errors go to `err` (the program resolver's
    reporter, which says each once), quantities are parsed into `diags`."""

    def __init__(self, topo: model.Topology, diags: DiagnosticBag, err: Callable[..., None]):
        self.topo = topo
        self.space = topo.space
        self.diags = diags
        self.err = err

    def apply(self, st: model.Step, s: ast.Step, defaults: dict[str, ast.StepOpt], resolve_link: bool) -> None:
        """Set `st`'s options from `s` and the program's defaults; choose its link when
        `resolve_link` (only once the step itself resolved: links are checked against its pairs)."""
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
                    self.err(o.value.span, f"unknown dedup mode '{o.value.text}'", *suggestion(o.value.text, DEDUP),
                             "dedup rank: one copy per token and receiving rank; dedup none: one copy per expert")
                st.dedup = o.value.text
            elif key == "engine":
                if o.value.text not in model.COPY_ENGINES:
                    self.err(o.value.span, f"unknown copy engine '{o.value.text}'",
                             *suggestion(o.value.text, model.COPY_ENGINES),
                             f"copy engines are {', '.join(model.COPY_ENGINES)}")
                else:
                    st.engine = o.value.text
            elif key == "order":
                st.order = o.value
            elif key == "after":
                st.after = tuple(n.text for n in o.value)
            elif key == "parallel":
                st.parallel = tuple(n.text for n in o.value)
        if resolve_link:
            self._link(st, given.get("over"))
            if st.engine is not None:
                self._check_engine(st, given["engine"])

    def _check_engine(self, st: model.Step, opt: ast.StepOpt) -> None:
        """A step's `engine` is one its link offers (its `engines`, or its one `engine`)."""
        if st.verb == "exchange":
            self.err(opt.span, f"step '{st.name}' exchanges metadata, which the compiler routes; 'engine' chooses "
                               f"how a step copies rows", "drop 'engine'")
            st.engine = None
            return
        link = st.link
        if link is None:
            default = model.DEFAULT_ENGINE["local"]
            if st.verb in ("copy", "permute", "reduce") and not self.topo.local_links() and st.engine != default:
                self.err(opt.value.span, f"step '{st.name}' has no local link to run on engine '{st.engine}': "
                                         f"without one, local steps run on '{default}'",
                         f"declare one, e.g. 'link hbm local {{ bandwidth 600 GB/s  engines {default} 600 GB/s, "
                         f"{st.engine} 300 GB/s }}'")
                st.engine = None
            return  # otherwise no link resolved: already reported
        if link.kind == "rdma":
            self.err(opt.span, f"step '{st.name}' runs over the rdma link '{link.name}', which its NIC drives",
                     "drop 'engine' (the step's chunks are posted by the proxy)")
            st.engine = None
            return
        offered = tuple(link.engine_rates) or (link.engine,)
        if st.engine not in offered:
            notes = [f"link '{link.name}' offers {', '.join(offered)}"]
            if not link.engine_rates:
                notes.append(f"give the link the engines it can run on, e.g. 'engines {link.engine} 20 GB/s, "
                             f"{st.engine} 15 GB/s'")
            self.err(opt.value.span, f"link '{link.name}' cannot run step '{st.name}' on engine '{st.engine}'",
                     *notes)
            st.engine = None

    def _link(self, st: model.Step, over: ast.StepOpt | None) -> None:
        links = self.topo.links
        local = st.verb in ("copy", "permute", "reduce")
        if over is not None:
            name = over.value
            if name.text in self.topo.broken_links:
                return  # the link's declaration is wrong: already reported there
            if name.text not in links:
                self.err(name.span, f"unknown link '{name.text}'", *suggestion(name.text, links))
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


def _rel_role(st: model.Step) -> str:
    if st.verb == "send":
        return f"'{st.name}' sends to its '{st.relation.name}'"
    return f"'{st.name}' pulls from its '{st.relation.name}'"
