"""A plan.json from outside, checked before a Plan is built from it.

`epcc run plan.json` and every loader of a bundle take a plan that may have been edited,
truncated or written by hand.  :func:`check_plan_json` checks its format and version first
(plan/schema.py), then the parsed JSON against the Plan's own dataclasses (epcc.plan): every
field the dataclass requires is there, no field is unknown, every value has the type its
annotation gives (a whole number where an int is declared, never a bool or a string for a
number), and numbers lie in the ranges the compiler itself produces -- so that a bad value is
named here, as a user error, instead of surfacing later as a TypeError, an OverflowError or an
allocation of terabytes.  It also checks what refers to what: ranks, selections, dependencies and
roles name ranks and steps that exist; and last the structural invariants the compiler proved
(plan/invariants.py).  The first problem raises PlanJsonError naming the field
(`steps[2].flows[5].select[0]`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

from ..limits import MAX_DEPTH, MAX_RAMP, MAX_RANKS, MAX_SIZE, MAX_SMS
from ..limits import WORKLOAD_LIMITS as LIMITS
from .invariants import check_invariants
from ..vendors import VENDORS
from .model import ENGINES, Plan
from .schema import MAX_FLOAT, MAX_INT, PLAN_FORMAT, FormatVersionError, SchemaError, Str, check_format, fail

PROGRAMS = ("dispatch", "combine")
VERBS = ("send", "pull", "copy", "permute", "reduce", "exchange")
DTYPES = ("bf16", "fp8")
PLACEMENTS = ("blocked", "strided")
LAYOUTS = ("expert", "token")
FP8_SCALE_GROUP = 128
ENVELOPE = ("format", "version")  # plan/schema.py's fields, not the Plan's


class PlanJsonError(SchemaError):
    """The plan's JSON does not describe a plan epcc could have written; the message names the field."""


@functools.cache
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _check(v: Any, tp: Any, path: str) -> None:
    """`v` has the type `tp` (a dataclass field's annotation), recursively."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return
        (inner,) = [a for a in args if a is not type(None)]
        _check(v, inner, path)
    elif tp is Any:
        return
    elif tp is bool:
        if not isinstance(v, bool):
            raise fail(path, "true or false", v)
    elif tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise fail(path, "a whole number", v)
        if not -MAX_INT <= v <= MAX_INT:
            raise fail(path, "a whole number of magnitude at most 2^53", v)
    elif tp is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise fail(path, "a number", v)
        if not abs(v) <= MAX_FLOAT:  # NaN included
            raise fail(path, f"a number of magnitude at most {MAX_FLOAT:g}", v)
    elif tp is str:
        Str().check(v, path)
    elif origin in (list, tuple):
        if not isinstance(v, list):
            raise fail(path, "a list", v)
        for i, x in enumerate(v):
            _check(x, args[0], f"{path}[{i}]")
    elif origin is dict:
        if not isinstance(v, dict):
            raise fail(path, "an object", v)
        for k, x in v.items():
            _check(x, args[1], f"{path}.{k}")
    elif dataclasses.is_dataclass(tp):
        _check_object(v, tp, path)
    else:  # pragma: no cover - a Plan field of a type this checker does not know
        raise TypeError(f"plan.check: no rule for {tp!r} ({path})")


def _check_object(v: Any, cls, path: str) -> None:
    """`v` is an object of the dataclass `cls`; a field it leaves out gets the field's default (in
    place), so that what reads it next finds every field."""
    if not isinstance(v, dict):
        raise fail(path, "an object", v)
    hints = _hints(cls)
    fields = _fields(cls)
    for k in v:
        if k not in fields:
            raise SchemaError(f"{path}.{k}: not a field of {cls.__name__}" if path else
                              f"{k}: not a field of {cls.__name__}")
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name not in v:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SchemaError(f"{sub}: missing")
            v[name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
            continue
        _check(v[name], hints[name], sub)


def _range(path: str, v: float | int | None, lo: float, hi: float, what: str = "") -> None:
    if v is not None and not lo <= v <= hi:
        raise SchemaError(f"{path}: {v!r} is out of range ({what or 'expected'} {lo:g}..{hi:g})")


def check_plan_json(d: Any) -> dict:
    """The plan's fields (`d` without its format and version; the fields it leaves out filled in
    with their defaults) unless `d` (a parsed plan.json) is
    not a plan this epcc could have written: its format and version (FormatVersionError for
    another version), the types of every field, the ranges of its numbers, that ranks,
    selections, dependencies and roles refer to what exists, and the structural invariants
    (plan/invariants.py); PlanJsonError naming the field otherwise."""
    try:
        check_format(d, PLAN_FORMAT)
        d = {k: v for k, v in d.items() if k not in ENVELOPE}
        _check_sizes(d)
        _check_fields(d)
        check_invariants(d)
    except FormatVersionError:
        raise
    except SchemaError as e:
        raise PlanJsonError(str(e)) from None
    return d


def _check_sizes(d: dict) -> None:
    """The flows of a step, counted before any of them is looked at: a plan of more flows than
    (rank, source, destination) triples is refused at the cost of its length alone."""
    R, steps = d.get("num_ranks"), d.get("steps")
    if isinstance(R, bool) or not isinstance(R, int) or not 1 <= R <= MAX_RANKS or not isinstance(steps, list):
        return  # the field checks say what is wrong
    for i, s in enumerate(steps):
        flows = s.get("flows") if isinstance(s, dict) else None
        if isinstance(flows, list) and len(flows) > R * R:
            raise SchemaError(f"steps[{i}].flows: {len(flows)} flows, more than the {R * R} (rank, source, "
                              f"destination) triples of {R} ranks")


def _check_fields(d: dict) -> None:
    _check_object(d, Plan, "")
    R = d["num_ranks"]
    _range("num_ranks", R, 1, MAX_RANKS)
    _range("bytes_per_token", d["bytes_per_token"], 0, MAX_SIZE)
    wl = d.get("workload")
    if wl is not None:
        _range("workload.tokens", wl["tokens"], 1, LIMITS["tokens"])
        _range("workload.hidden", wl["hidden"], 1, LIMITS["hidden"])
        _range("workload.experts", wl["experts"], 1, LIMITS["experts"])
        _range("workload.topk", wl["topk"], 1, min(LIMITS["topk"], wl["experts"]))
        if wl["experts"] % R:
            raise SchemaError(f"workload.experts: {wl['experts']} experts do not divide among {R} ranks")
        if wl["dtype"] not in DTYPES:
            raise SchemaError(f"workload.dtype: {wl['dtype']!r} is not one of {', '.join(DTYPES)}")
        if wl["dtype"] == "fp8" and wl["hidden"] % FP8_SCALE_GROUP:
            raise SchemaError(f"workload.hidden: {wl['hidden']} is not divisible by {FP8_SCALE_GROUP} (fp8)")
        if wl["placement"] not in PLACEMENTS:
            raise SchemaError(f"workload.placement: {wl['placement']!r} is not one of {', '.join(PLACEMENTS)}")
        if wl["layout"] not in LAYOUTS:
            raise SchemaError(f"workload.layout: {wl['layout']!r} is not one of {', '.join(LAYOUTS)}")
    vendor = VENDORS.get(d["vendor"])
    if vendor is None:
        raise SchemaError(f"vendor: {d['vendor']!r} is not one of {', '.join(VENDORS)}")
    if vendor.arch(d["arch"]) is None:
        raise SchemaError(f"arch: {d['arch']!r} is not a {vendor.name} architecture "
                          f"({', '.join(a.name for a in vendor.archs)})")
    launch = d.get("launch")
    if launch is not None:
        dies: set[int] = set()
        for i, pair in enumerate(launch["duplicate"]):
            if len(pair) != 2:
                raise SchemaError(f"launch.duplicate[{i}]: {len(pair)} ranks (expected the 2 dies of a card)")
            for j, r in enumerate(pair):
                _range(f"launch.duplicate[{i}][{j}]", r, 0, R - 1, "a rank")
                if r in dies:
                    raise SchemaError(f"launch.duplicate[{i}][{j}]: rank {r} appears twice")
                dies.add(r)
    names = d.get("rank_names", [])
    if names and len(names) != R:
        raise SchemaError(f"rank_names: {len(names)} names for {R} ranks")
    for k, bps in d.get("resources", {}).items():
        _range(f"resources.{k}", bps, 0, MAX_FLOAT)
    seen: set[tuple[str, str]] = set()
    for i, s in enumerate(d["steps"]):
        _check_step(s, f"steps[{i}]", R)
        key = (s["program"], s["name"])
        if key in seen:
            raise SchemaError(f"steps[{i}]: a second {s['program']} step named {s['name']!r}")
        seen.add(key)
    for i, s in enumerate(d["steps"]):
        for field in ("deps", "pipelined_deps"):
            for j, dep in enumerate(s.get(field, [])):
                if (s["program"], dep) not in seen:
                    raise SchemaError(f"steps[{i}].{field}[{j}]: no {s['program']} step named {dep!r}")
    for i, b in enumerate(d["buffers"]):
        _range(f"buffers[{i}].bytes_per_rank", b["bytes_per_rank"], 0, MAX_INT)
    for i, k in enumerate(d.get("kernels", [])):
        _range(f"kernels[{i}].sms", k["sms"], 0, MAX_SMS)
        for j, r in enumerate(k["roles"]):
            at = f"kernels[{i}].roles[{j}]"
            if (k["program"], r["step"]) not in seen:
                raise SchemaError(f"{at}.step: no {k['program']} step named {r['step']!r}")
            _range(f"{at}.sm_begin", r["sm_begin"], 0, MAX_SMS)
            _range(f"{at}.sm_end", r["sm_end"], r["sm_begin"], MAX_SMS, "expected sm_begin..")
            for f in ("warps", "pack_sms", "unpack_sms"):
                _range(f"{at}.{f}", r[f] if f in r else None, 0, MAX_SMS)


def _check_step(s: dict, at: str, R: int) -> None:
    if s["program"] not in PROGRAMS:
        raise SchemaError(f"{at}.program: {s['program']!r} is not one of {', '.join(PROGRAMS)}")
    if s["verb"] not in VERBS:
        raise SchemaError(f"{at}.verb: {s['verb']!r} is not one of {', '.join(VERBS)}")
    _range(f"{at}.chunk_bytes", s.get("chunk_bytes"), 1, MAX_SIZE)
    _range(f"{at}.num_chunks", s.get("num_chunks"), 1, MAX_INT)
    _range(f"{at}.depth", s.get("depth"), 1, MAX_DEPTH)
    _range(f"{at}.sms", s.get("sms"), 1, MAX_SMS)
    _range(f"{at}.ramp_head", s.get("ramp_head"), 0, MAX_RAMP)
    _range(f"{at}.ramp_tail", s.get("ramp_tail"), 0, MAX_RAMP)
    _range(f"{at}.line", s.get("line"), 0, MAX_INT)
    _range(f"{at}.completion_lag", s.get("completion_lag"), 0, 1)
    if s.get("engine") is not None and s["engine"] not in ENGINES:
        raise SchemaError(f"{at}.engine: {s['engine']!r} is not one of {', '.join(ENGINES)}")
    flows = s["flows"]
    if len(flows) > R * R:
        raise SchemaError(f"{at}.flows: {len(flows)} flows, more than the {R * R} (rank, source, destination) "
                            f"triples of {R} ranks")
    triples = set()
    for j, f in enumerate(flows):
        fat = f"{at}.flows[{j}]"
        for k in ("rank", "src", "dst"):
            _range(f"{fat}.{k}", f[k], 0, R - 1, "a rank")
        t = (f["rank"], f["src"], f["dst"])
        if t in triples:
            raise SchemaError(f"{fat}: a second flow of rank {t[0]} from {t[1]} to {t[2]}")
        triples.add(t)
        _range(f"{fat}.bytes", f["bytes"], 0, MAX_FLOAT)
        for k in ("latency_s", "tail_s", "lead_s"):
            _range(f"{fat}.{k}", f.get(k), 0, MAX_FLOAT)
        sel = f.get("select")
        for n, r in enumerate(sel or ()):
            _range(f"{fat}.select[{n}]", r, 0, R - 1, "a rank")
        w = f.get("weights", [])
        if w and len(w) != len(f["resources"]):
            raise SchemaError(f"{fat}.weights: {len(w)} weights for {len(f['resources'])} resources")


__all__ = ["PlanJsonError", "check_plan_json"]
