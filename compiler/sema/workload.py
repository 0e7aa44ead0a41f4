"""Resolving a `workload { ... }` block."""

from __future__ import annotations

from ..diagnostics import DiagnosticBag, Note, did_you_mean
from ..frontend import ast
from ..limits import WORKLOAD_LIMITS
from . import model
from .units import number_text

_REQUIRED = ("tokens", "hidden", "dtype", "topk", "experts")


def resolve_workload(w: ast.Workload, topo: model.Topology | None, diags: DiagnosticBag) -> model.Workload | None:
    items: dict[str, ast.WorkloadItem] = {}
    for it in w.items:
        if it.key in items:
            diags.error(it.span, f"'{it.key}' is given twice in the workload", Note("first given here", items[it.key].span))
            continue
        items[it.key] = it
    missing = [k for k in _REQUIRED if k not in items]
    for k in missing:
        diags.error(w.span, f"the workload does not give '{k}'", _EXAMPLES[k])
    if missing:
        return None
    ok = True
    for key, limit in LIMITS.items():
        it = items.get(key)
        if it is not None and isinstance(it.values[0], int) and it.values[0] > limit:
            diags.error(it.span, f"{key} {number_text(it.values[0])} is out of range (at most {limit})")
            ok = False
    if not ok:
        return None
    tokens = items["tokens"].values[0]
    if len(items["tokens"].values) > 1:
        per = items["tokens"].values[1]
        if per.text != "rank":
            diags.error(per.span, f"tokens are counted per rank, not per '{per.text}'", "write 'tokens 4096 per rank'")
            ok = False
    if tokens < 1:
        diags.error(items["tokens"].span, "tokens per rank must be at least 1")
        ok = False
    hidden = items["hidden"].values[0]
    if hidden < 1:
        diags.error(items["hidden"].span, "hidden size must be at least 1")
        ok = False
    dt = items["dtype"].values[0]
    if dt.text not in model.DTYPES:
        diags.error(dt.span, f"unsupported dtype '{dt.text}'", *_maybe(did_you_mean(dt.text, model.DTYPES)),
                    "dispatch supports bf16 and fp8 (e4m3 with one fp32 scale per 128 channels)")
        ok = False
    elif dt.text == "fp8" and hidden % model.FP8_SCALE_GROUP:
        diags.error(items["hidden"].span,
                    f"fp8 dispatch needs a hidden size divisible by {model.FP8_SCALE_GROUP} (one scale per "
                    f"{model.FP8_SCALE_GROUP} channels), not {hidden}")
        ok = False
    topk = items["topk"].values[0]
    experts = items["experts"].values[0]
    ex_item = items["experts"]
    placement = "blocked"
    if len(ex_item.values) > 1:
        pl = ex_item.values[1]
        if pl.text not in model.PLACEMENTS:
            diags.error(pl.span, f"unknown expert placement '{pl.text}'",
                        *_maybe(did_you_mean(pl.text, model.PLACEMENTS)),
                        "placements: blocked (experts r*E/R .. (r+1)*E/R-1 on rank r), strided (expert e on rank e % R)")
            ok = False
        placement = pl.text
    if experts < 1:
        diags.error(ex_item.span, "the number of experts must be at least 1")
        ok = False
    if topk < 1:
        diags.error(items["topk"].span, "topk must be at least 1")
        ok = False
    elif experts >= 1 and topk > experts:
        diags.error(items["topk"].span, f"topk {topk} is more than the {experts} experts")
        ok = False
    num_ranks = topo.num_ranks if topo else None
    if num_ranks and experts >= 1 and experts % num_ranks:
        diags.error(ex_item.span, f"{experts} experts cannot be divided evenly among {num_ranks} ranks",
                    f"use a multiple of {num_ranks}")
        ok = False
    node_limit = scope = None
    if "node_limit" in items:
        it = items["node_limit"]
        node_limit = it.values[0]
        if topo is not None:
            space = topo.space
            scope = space.levels[0].name
            if len(it.values) > 1:
                sc = it.values[1]
                if sc.text not in space.level_index and sc.text not in space.groups:
                    diags.error(sc.span, f"unknown level or group '{sc.text}'",
                                *_maybe(did_you_mean(sc.text, space.scope_names())))
                    ok = False
                scope = sc.text
            if node_limit < 1:
                diags.error(it.span, "node_limit must be at least 1")
                ok = False
            elif ok and num_ranks and experts % num_ranks == 0:
                per_scope = experts // space.scope_instances(scope)
                if node_limit >= space.scope_instances(scope):
                    diags.warning(it.span, f"node_limit {node_limit} never binds: there are only "
                                           f"{space.scope_instances(scope)} {scope} instances")
                if node_limit * per_scope < topk:
                    diags.error(it.span,
                                f"node_limit {node_limit} over '{scope}' leaves {node_limit * per_scope} experts "
                                f"reachable, fewer than topk {topk}")
                    ok = False
    weights = False
    if "weights" in items:
        wv = items["weights"].values[0]
        if wv.text not in ("travel", "stay"):
            diags.error(wv.span, f"'weights {wv.text}': say 'weights travel' (routing weights ride with the "
                                 f"tokens) or 'weights stay'", *_maybe(did_you_mean(wv.text, ("travel", "stay"))))
            ok = False
        weights = wv.text == "travel"
    layout = "expert"
    if "layout" in items:
        lv = items["layout"].values[0]
        if lv.text not in model.LAYOUTS:
            diags.error(lv.span, f"unknown output layout '{lv.text}'", *_maybe(did_you_mean(lv.text, model.LAYOUTS)),
                        "layouts: expert (one row per token and local expert, the default), token (one row per "
                        "token and destination rank, as DeepEP's intranode dispatch)")
            ok = False
        layout = lv.text
    if not ok or topo is None:
        return None
    return model.Workload(tokens, hidden, dt.text, topk, experts, placement, node_limit, scope, weights,
                          topo.num_ranks, w.span, layout)


LIMITS = WORKLOAD_LIMITS

_EXAMPLES = {
    "tokens": "add e.g. 'tokens 4096 per rank'",
    "hidden": "add e.g. 'hidden 7168'",
    "dtype": "add 'dtype bf16' or 'dtype fp8'",
    "topk": "add e.g. 'topk 8'",
    "experts": "add e.g. 'experts 256 blocked'",
}


def _maybe(x):
    return (x,) if x else ()

