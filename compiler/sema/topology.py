"""Resolving a `topology { ... }` block into a :class:`~epcc.sema.model.Topology`.

In the order a topology is checked: its levels and groups make the rank space
(:mod:`epcc.sema.rank_space`); its tables and relations are evaluated over that space
(:mod:`epcc.sema.relations`); its links are checked and their `connects` evaluated the same way
(:mod:`epcc.sema.links`); its `sm` lines (the per-SM rates and fixed times the simulator uses)
and its `vendor` line (whose machine it is, :mod:`epcc.vendors`) are read here.
"""

from __future__ import annotations

from ..diagnostics import DiagnosticBag, Note
from ..frontend import ast
from . import model
from .hints import quantity_text, suggestion
from .links import resolve_links
from .rank_space import build_rank_space
from .relations import RelationResolver
from .units import parse_quantity
from ..vendors import DEFAULT_ARCH, DEFAULT_VENDOR, VENDORS


def resolve_topology(t: ast.Topology, diags: DiagnosticBag) -> model.Topology | None:
    """The checked topology, or None when its levels or groups are too broken to evaluate the rest."""
    space = build_rank_space(t, diags)
    if space is None:
        return None
    rels = RelationResolver(space, diags)
    rels.collect_tables(t.tables)
    rels.declare(t.relations)
    rels.resolve_all()
    links, broken_links = resolve_links(t.links, rels, diags)
    rates, times = _sm_rates(t, diags)
    vendor, arch = _vendor(t, diags)
    return model.Topology(t.name.text, space, dict(rels.relations), links, t.span,
                          frozenset(rels.broken), frozenset(broken_links), rates,
                          times.get(model.SM_LAUNCH, 0.0), times.get(model.SM_META, 0.0), vendor, arch)


def _vendor(t: ast.Topology, diags: DiagnosticBag) -> tuple[str, str]:
    """The `vendor` line: (vendor, architecture); nvidia hopper without one.  An unknown vendor or
    architecture is reported and the default stands in (the rest of the file is still checked)."""
    if not t.vendors:
        return DEFAULT_VENDOR, DEFAULT_ARCH
    first = t.vendors[0]
    for extra in t.vendors[1:]:
        diags.error(extra.span, f"topology '{t.name.text}' names its vendor twice", Note("first named here", first.span))
    name = first.name.text
    vendor = VENDORS.get(name)
    if vendor is None:
        diags.error(first.name.span, f"unknown vendor '{name}'", *suggestion(name, VENDORS),
                    f"vendors are {', '.join(VENDORS)}")
        return DEFAULT_VENDOR, DEFAULT_ARCH
    if first.arch is None:
        return name, vendor.archs[0].name
    arch = first.arch.text
    if vendor.arch(arch) is None:
        names = [a.name for a in vendor.archs]
        diags.error(first.arch.span, f"unknown {name} architecture '{arch}'", *suggestion(arch, names),
                    f"{name} architectures: {', '.join(names)}")
        return name, vendor.archs[0].name
    return name, arch


def _sm_rates(t: ast.Topology, diags: DiagnosticBag) -> tuple[dict[str, float], dict[str, float]]:
    """The `sm` lines: (bytes/s per SM by kind of work, seconds by kind of time given)."""
    rates: dict[str, float] = {}
    times: dict[str, float] = {}
    first: dict[str, ast.SmRate] = {}
    keys = model.SM_WORK + tuple(model.SM_TIMES)
    for r in t.sm_rates:
        work = r.work.text
        if work not in keys:
            diags.error(r.work.span, f"unknown kind of SM work '{work}'",
                        *suggestion(work, keys),
                        f"kinds of SM work are {', '.join(model.SM_WORK)}; `{model.SM_LAUNCH}` gives "
                        f"the time of a kernel launch, `{model.SM_META}` that of a metadata pass")
            continue
        if work in first:
            what = f"the {model.SM_TIMES[work]} time" if work in model.SM_TIMES else f"the SM rate of '{work}'"
            diags.error(r.span, f"{what} is given twice", Note("first given here", first[work].span))
            continue
        first[work] = r
        if work in model.SM_TIMES:
            secs = parse_quantity(r.rate, "time", diags)
            if secs is not None and secs <= 0:
                diags.error(r.rate.span, f"a {model.SM_TIMES[work]} time must be positive, not {quantity_text(r.rate)}")
            elif secs is not None:
                times[work] = secs
            continue
        bw = parse_quantity(r.rate, "bandwidth", diags)
        if bw is not None and bw <= 0:
            diags.error(r.rate.span, f"an SM rate must be positive, not {quantity_text(r.rate)}")
            continue
        if bw is not None:
            rates[work] = bw
    return rates, times
