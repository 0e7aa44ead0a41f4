"""The `link` declarations of a topology: kind, rates, engine, and the rank pairs each connects.

A link's `connects` is a relation expression (:mod:`epcc.sema.relations` evaluates it); the
pairs it gives are made symmetric, as physical links are full duplex.  A `local` link connects a
rank with itself and takes no `connects`.
"""

from __future__ import annotations

from typing import Sequence

from ..diagnostics import DiagnosticBag, Note, Span
from ..frontend import ast
from . import model
from .hints import quantity_text, report_duplicate, suggestion
from .relations import RelationResolver, relation_text
from .units import number_text, parse_quantity

MAX_LANES = 1024


def resolve_links(decls: Sequence[ast.Link], rels: RelationResolver,
                  diags: DiagnosticBag) -> tuple[dict[str, model.LinkInfo], set[str]]:
    """The links that resolved, by name, and the names of those whose declaration is wrong."""
    broken: set[str] = set()
    links: dict[str, model.LinkInfo] = {}
    seen: dict[str, ast.Link] = {}
    for lk in decls:
        if lk.name.text in seen:
            report_duplicate(diags, "link", lk.name, seen[lk.name.text].name)
            continue
        seen[lk.name.text] = lk
        info = _link(lk, rels, diags)
        if info is not None:
            links[lk.name.text] = info
        else:
            broken.add(lk.name.text)
    return links, broken


def _link(lk: ast.Link, rels: RelationResolver, diags: DiagnosticBag) -> model.LinkInfo | None:
    """One link declaration, checked whole; None when any of it is wrong (all of that reported)."""
    space = rels.space
    kind = lk.kind.text
    ok = True
    if kind not in model.LINK_KINDS:
        diags.error(lk.kind.span, f"unknown link kind '{kind}'",
                    *suggestion(kind, model.LINK_KINDS),
                    f"link kinds are {', '.join(model.LINK_KINDS)}")
        ok = False
    props: dict[str, ast.LinkProp] = {}
    for p in lk.props:
        if p.key in props:
            diags.error(p.span, f"'{p.key}' is given twice for link '{lk.name.text}'",
                        Note("first given here", props[p.key].span))
            ok = False
            continue
        props[p.key] = p
    bw = None
    if "bandwidth" not in props:
        diags.error(lk.name.span, f"link '{lk.name.text}' has no bandwidth", "add e.g. 'bandwidth 20 GB/s'")
        ok = False
    else:
        bw = parse_quantity(props["bandwidth"].value, "bandwidth", diags)
        if bw is not None and bw <= 0:
            diags.error(props["bandwidth"].value.span,
                        f"bandwidth must be positive, not {quantity_text(props['bandwidth'].value)}")
            bw = None
        ok &= bw is not None
    lat = 0.0
    if "latency" in props:
        lat = parse_quantity(props["latency"].value, "latency", diags)
        if lat is not None and lat < 0:
            diags.error(props["latency"].value.span, "latency cannot be negative")
            lat = None
        ok &= lat is not None
    engine = model.DEFAULT_ENGINE.get(kind, "sm")
    if "engine" in props:
        en = props["engine"].value
        if en.text not in model.ENGINES:
            diags.error(en.span, f"unknown engine '{en.text}'", *suggestion(en.text, model.ENGINES),
                        f"engines are {', '.join(model.ENGINES)}")
            ok = False
        engine = en.text
    engine_rates = _engine_rates(props.get("engines"), kind, diags)
    ok &= engine_rates is not None
    if engine_rates:
        if "engine" not in props:
            engine = next(iter(engine_rates))
        elif engine in model.ENGINES and engine not in engine_rates:
            diags.error(props["engine"].value.span, f"engine '{engine}' is not one of the link's engines "
                        f"({', '.join(engine_rates)})", "name one of them, or drop 'engine' (the first of "
                        "'engines' is the link's engine where the cost model has no preference)")
            ok = False
    lanes = 1
    if "lanes" in props:
        lanes = props["lanes"].value
        if lanes < 1:
            diags.error(props["lanes"].span, f"a link needs at least 1 lane, not {lanes}")
            ok = False
        elif lanes > MAX_LANES:
            diags.error(props["lanes"].span, f"{number_text(lanes)} lanes is out of range (at most {MAX_LANES})")
            ok = False
    eff = 1.0
    if "efficiency" in props:
        q = props["efficiency"].value
        if q.unit != "%":
            diags.error(q.span, "efficiency needs a '%' sign, e.g. 'efficiency 80 %'")
            ok = False
        elif not (0 < q.value <= 100):
            diags.error(q.span, f"efficiency must be in (0, 100] %, not {quantity_text(q)} %")
            ok = False
        else:
            eff = q.value / 100.0
    shared = None
    if "shared" in props:
        sc = props["shared"].value
        if sc.text not in space.level_index and sc.text not in space.groups:
            diags.error(sc.span, f"unknown level or group '{sc.text}'",
                        *suggestion(sc.text, space.scope_names()))
            ok = False
        shared = sc.text
    atomics = None
    if "atomics" in props:
        q = props["atomics"].value
        atomics = parse_quantity(q, "bandwidth", diags)
        if kind == "local":
            diags.error(props["atomics"].span, "'atomics' is the rate of adds into another GPU's memory; "
                        "a local link has none", "drop 'atomics' (the `sm` line's 'add' rate bounds local adds)")
            atomics = None
        elif atomics is not None and atomics <= 0:
            diags.error(q.span, f"atomics must be positive, not {quantity_text(q)}")
            atomics = None
        ok &= atomics is not None
    post = 0.0
    if "post" in props:
        q = props["post"].value
        post = parse_quantity(q, "time", diags)
        if kind != "rdma":
            diags.error(props["post"].span, f"'post' is the RDMA proxy's host time per chunk; a {kind} link "
                        f"is written by SMs, not posted", "drop 'post', or make the link 'rdma'")
            post = None
        ok &= post is not None  # a negative one does not parse (tests/sema/cases/post_negative)
    pairs: frozenset[tuple[int, int]] = frozenset()
    rel_text = ""
    if kind == "local":
        if "connects" in props:
            diags.error(props["connects"].span, "a local link connects a rank with itself; drop 'connects'")
            ok = False
    elif kind in model.LINK_KINDS:
        if "connects" not in props:
            diags.error(lk.name.span, f"link '{lk.name.text}' does not say what it connects",
                        "add e.g. 'connects other card'")
            ok = False
        else:
            expr = props["connects"].value
            targets = rels.evaluate(expr, what=f"link '{lk.name.text}'")
            if targets is None or not _check_pairs(targets, expr.span, f"link '{lk.name.text}'", space, diags):
                ok = False
            else:
                ps = {(r, f) for r, ts in enumerate(targets) for f in ts}
                pairs = frozenset(ps | {(b, a) for a, b in ps})  # physical links are full duplex
                rel_text = relation_text(expr)
    if not ok:
        return None
    return model.LinkInfo(lk.name.text, kind, bw, lat, engine, lanes, eff, pairs, rel_text, lk.span, shared, atomics,
                          post, engine_rates or {})


def _engine_rates(prop: ast.LinkProp | None, kind: str, diags: DiagnosticBag) -> dict[str, float] | None:
    """A link's `engines spc 27.9 GB/s, dma 15 GB/s`: rate by engine, in the order written ({}
    without the property); None when any of it is wrong (reported)."""
    if prop is None:
        return {}
    if kind == "rdma":
        diags.error(prop.span, "an rdma link is driven by its NIC; 'engines' chooses between copy engines of a "
                    "p2p, d2d or local link", "drop 'engines' (the step's chunks are posted by the proxy)")
        return None
    out: dict[str, float] = {}
    first: dict[str, ast.EngineRate] = {}
    ok = True
    for er in prop.value:
        name = er.engine.text
        if name not in model.COPY_ENGINES:
            diags.error(er.engine.span, f"unknown copy engine '{name}'", *suggestion(name, model.COPY_ENGINES),
                        f"copy engines are {', '.join(model.COPY_ENGINES)}")
            ok = False
            continue
        if name in first:
            diags.error(er.span, f"engine '{name}' is given twice", Note("first given here", first[name].span))
            ok = False
            continue
        first[name] = er
        rate = parse_quantity(er.rate, "bandwidth", diags)
        if rate is not None and rate <= 0:
            diags.error(er.rate.span, f"an engine's rate must be positive, not {quantity_text(er.rate)}")
            rate = None
        if rate is None:
            ok = False
            continue
        out[name] = rate
    return out if ok else None


def _check_pairs(targets: list[set[int]], span: Span, what: str, space: model.RankSpace,
                 diags: DiagnosticBag) -> bool:
    """A link joins ranks with other ranks: some pair, and no rank with itself."""
    if not any(targets):
        diags.error(span, f"{what} pairs nothing: no rank has a partner under these rules")
        return False
    for r, ts in enumerate(targets):
        if r in ts:
            diags.error(span, f"{what} pairs {space.describe(r)} with itself",
                        "unmentioned levels keep the same index; add 'other <level>' to exclude the rank itself")
            return False
    return True
