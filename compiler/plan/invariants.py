"""What the compiler proved about a plan, re-checked cheaply when a plan.json is loaded.

plan/check.py has checked the types and ranges of every field; these are the structural
invariants that make a layout (runtime/layout) of the plan deliver every token once, and that
bound what laying it out costs, in one pass over the steps and flows (no allocation per token):

* a step's flows run where its verb runs them (a send on its source rank, a pull on its
  destination rank, a copy, permute or reduce on one rank; an exchange moves no buffer);
* a selection lists ranks in increasing order, each once; an empty one (the compiler writes it
  where a selection evaluates to no rank) moves nothing, so its flow carries no bytes; a permute,
  and every dispatch write into `output`, selects the receiver;
* a step reads each source buffer once, never the buffer it writes; a dispatch step only buffers
  the plan declares; no two buffers share a name;
* a derived combine step mirrors its dispatch step: its buffers, its weighting, and its flows,
  one for one the reverses of the dispatch step's;
* dependencies form no cycle;
* token streams (the tokens of one home rank, flowing through the dispatch steps: plan/model.py
  and analysis/flow.py): the most that reach a staging buffer on any rank is the number its
  declared worst case (`worst_case_bytes` = streams x tokens x bytes per token) was computed
  from; at most one per home rank reaches each rank's `output`, and from every home rank h to
  every rank d a chain of flows whose selections all include d does (a token's selections are
  hit by its destination set, so such a chain carries every token of h routed to d): together,
  delivery exactly once;
* the rows a layout of the plan can hold (`layout_rows`, an upper bound from the streams) stay
  within MAX_LAYOUT_ROWS at the plan's tokens per rank.

The first problem raises SchemaError naming the field.  `layout_rows` also takes a Plan, for the
layout's own check at the tokens of a run.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from ..limits import MAX_LAYOUT_ROWS, MAX_REACH_WORK
from .schema import SchemaError

ROOT_BUFFERS = {"dispatch": ("input", "output"), "combine": ("output", "result")}
ONE_RANK_VERBS = ("copy", "permute", "reduce")


def _get(o: Any, k: str) -> Any:
    """A field of a plan's JSON object or of a Plan's dataclass."""
    return o[k] if isinstance(o, dict) else getattr(o, k)


def check_invariants(d: dict) -> None:
    """SchemaError naming the field unless the plan `d` (parsed plan.json, types checked) keeps
    every invariant above."""
    declared = _buffers(d)
    dispatch = {s["name"]: s for s in d["steps"] if s["program"] == "dispatch"}
    for i, s in enumerate(d["steps"]):
        at = f"steps[{i}]"
        _step_buffers(s, at, declared)
        for j, f in enumerate(s["flows"]):
            _flow(s, f, f"{at}.flows[{j}]")
        if s["program"] == "combine":
            _mirror(s, at, dispatch)
        elif s["reverse_of"] is not None or s["reverse_source"] is not None:
            raise SchemaError(f"{at}.reverse_of: a dispatch step reverses none")
    _acyclic(d["steps"])
    streams = _streams(d)
    wl = d.get("workload")
    if wl is not None:
        _stream_bounds(d, streams, wl["tokens"])
        rows = layout_rows(d, wl["tokens"])
        if rows > MAX_LAYOUT_ROWS:
            raise SchemaError(f"steps: a layout of the plan could hold up to {rows} rows at its {wl['tokens']} "
                              f"tokens per rank, more than this runtime lays out ({MAX_LAYOUT_ROWS})")
    _reach_every_receiver(d)


def _buffers(d: dict) -> dict[str, set[str]]:
    names: dict[str, set[str]] = defaultdict(set)
    for i, b in enumerate(d["buffers"]):
        if b["program"] not in ROOT_BUFFERS:
            raise SchemaError(f"buffers[{i}].program: {b['program']!r} is not one of dispatch, combine")
        if b["name"] in names[b["program"]]:
            raise SchemaError(f"buffers[{i}]: a second {b['program']} buffer named {b['name']!r}")
        names[b["program"]].add(b["name"])
    return names


def _step_buffers(s: dict, at: str, declared: dict[str, set[str]]) -> None:
    prog, src, dst = s["program"], s["src_buffers"], s["dst_buffer"]
    if s["verb"] == "exchange":
        if src or dst is not None:
            raise SchemaError(f"{at}: an exchange moves metadata, not buffers (src_buffers {src}, dst_buffer {dst!r})")
        return
    if not src or dst is None:
        raise SchemaError(f"{at}: a {s['verb']} step names its source and destination buffers")
    # combine's partial buffers mirror dispatch's under their own names, or are its own (a written-out combine)
    known = declared["dispatch"] | set(ROOT_BUFFERS[prog]) if prog == "dispatch" else None
    for j, b in enumerate(src):
        if known is not None and b not in known:
            raise SchemaError(f"{at}.src_buffers[{j}]: no buffer named {b!r}")
        if b in src[:j]:
            raise SchemaError(f"{at}.src_buffers[{j}]: {b!r} listed twice (its tokens would move twice)")
    if known is not None and dst not in known:
        raise SchemaError(f"{at}.dst_buffer: no buffer named {dst!r}")
    if dst in src or (prog == "dispatch" and dst == "input") or (prog == "dispatch" and "output" in src):
        raise SchemaError(f"{at}.dst_buffer: a {prog} step writes {dst!r} and reads {', '.join(map(repr, src))}")


def _flow(s: dict, f: dict, at: str) -> None:
    verb, r, a, b, sel = s["verb"], f["rank"], f["src"], f["dst"], f["select"]
    where = {"send": r == a != b, "exchange": r == a != b, "pull": r == b != a}.get(verb, r == a == b)
    if not where:
        runs = {"send": "on its source rank, to another", "exchange": "on its source rank, to another",
                "pull": "on its destination rank, from another"}.get(verb, "on one rank, from it into it")
        raise SchemaError(f"{at}: a {verb} runs {runs}; this flow runs on rank {r} from {a} to {b}")
    if sel is None:
        if verb == "permute" or (s["program"] == "dispatch" and s["dst_buffer"] == "output"):
            raise SchemaError(f"{at}.select: a write into output selects its receiver ([{b}]), got null")
        return
    if verb == "exchange":
        raise SchemaError(f"{at}.select: an exchange selects no token")
    if not sel:
        if f["bytes"]:
            raise SchemaError(f"{at}.select: an empty selection moves no token, but the flow carries "
                              f"{f['bytes']:g} bytes")
        return
    if any(x >= y for x, y in zip(sel, sel[1:])):
        raise SchemaError(f"{at}.select: expected ranks in increasing order, each once, got {sel[:8]}")
    if (verb == "permute" or (s["program"] == "dispatch" and s["dst_buffer"] == "output")) and list(sel) != [b]:
        raise SchemaError(f"{at}.select: a write into output selects its receiver ([{b}]), got {sel[:8]}")


def _mirror(s: dict, at: str, dispatch: dict[str, dict]) -> None:
    rev, source = s["reverse_of"], s["reverse_source"]
    if rev is None:
        if source is not None:
            raise SchemaError(f"{at}.reverse_source: set on a step that reverses none")
        return
    x = dispatch.get(rev)
    if x is None or x["verb"] == "exchange":
        raise SchemaError(f"{at}.reverse_of: no dispatch step named {rev!r} that moves tokens")
    if source not in x["src_buffers"]:
        raise SchemaError(f"{at}.reverse_source: {source!r} is not a source buffer of dispatch step {rev!r}")
    if s["src_buffers"] != [x["dst_buffer"]] or (s["dst_buffer"] == "result") != (source == "input"):
        writes = "'result'" if source == "input" else f"the partials of {source!r}"
        raise SchemaError(f"{at}: the reverse of {rev!r} reads [{x['dst_buffer']!r}] and writes {writes}, not "
                          f"{s['src_buffers']} and {s['dst_buffer']!r}")
    if s["weighted"] != (x["dst_buffer"] == "output"):
        raise SchemaError(f"{at}.weighted: the reverse of a write into {x['dst_buffer']!r} is "
                          f"{'' if x['dst_buffer'] == 'output' else 'not '}weighted")
    if len(s["flows"]) != len(x["flows"]):  # with the flows unique (plan/check.py): one for one
        raise SchemaError(f"{at}.flows: {len(s['flows'])} flows reverse dispatch step {rev!r}, which has "
                          f"{len(x['flows'])}")
    flows = {(f["rank"], f["src"], f["dst"]) for f in x["flows"]}
    for j, f in enumerate(s["flows"]):
        if (f["rank"], f["dst"], f["src"]) not in flows:
            raise SchemaError(f"{at}.flows[{j}]: dispatch step {rev!r} has no flow of rank {f['rank']} from "
                              f"{f['dst']} to {f['src']} for it to reverse")


def _acyclic(steps: list[dict]) -> None:
    for i, s in enumerate(steps):
        for j, p in enumerate(s["pipelined_deps"]):
            if p not in s["deps"]:
                raise SchemaError(f"steps[{i}].pipelined_deps[{j}]: {p!r} is not among the step's deps")
    for prog in ROOT_BUFFERS:
        deps = {s["name"]: s["deps"] for s in steps if s["program"] == prog}
        state: dict[str, int] = {}  # 1: on the path from `start`, 2: done
        for start in deps:
            if start in state:
                continue
            state[start] = 1
            stack = [(start, iter(deps[start]))]
            while stack:
                name, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    state[name] = 2
                    stack.pop()
                elif state.get(nxt) == 1:
                    raise SchemaError(f"steps: the {prog} steps' deps form a cycle through {nxt!r}")
                elif state.get(nxt) is None:
                    state[nxt] = 1
                    stack.append((nxt, iter(deps[nxt])))


def _flow_streams(s: Any, f: Any, streams: dict) -> int:
    """Token streams a dispatch flow moves: those in its source buffers on its source rank (the
    compiler drops a stream whose selection is empty, analysis/flow.py)."""
    sel = _get(f, "select")
    if sel is not None and not sel:
        return 0
    src = _get(f, "src")
    return sum(streams.get((b, src), 0) for b in _get(s, "src_buffers"))


def _streams(d: Any) -> dict:
    """(buffer, rank) -> the token streams the dispatch steps bring there, and per flow ('flow',
    step, rank, src, dst) the streams it moves; `input` holds one per rank."""
    streams: dict = {("input", r): 1 for r in range(_get(d, "num_ranks"))}
    for s in _get(d, "steps"):
        if _get(s, "program") != "dispatch" or _get(s, "verb") == "exchange":
            continue
        landed: dict = defaultdict(int)
        for f in _get(s, "flows"):
            n = _flow_streams(s, f, streams)
            streams[("flow", _get(s, "name"), _get(f, "rank"), _get(f, "src"), _get(f, "dst"))] = n
            landed[(_get(s, "dst_buffer"), _get(f, "dst"))] += n
        for k, n in landed.items():
            streams[k] = streams.get(k, 0) + n
    return streams


def _stream_bounds(d: dict, streams: dict, tokens: int) -> None:
    R, per_stream = d["num_ranks"], tokens * d["bytes_per_token"]
    for i, b in enumerate(d["buffers"]):
        if b["program"] != "dispatch" or b["name"] in ROOT_BUFFERS["dispatch"]:
            continue
        most = max(range(R), key=lambda r: streams.get((b["name"], r), 0))
        got, worst = streams.get((b["name"], most), 0), b["worst_case_bytes"]
        if worst is None or per_stream <= 0 or worst % per_stream or worst // per_stream != got:
            raise SchemaError(f"buffers[{i}].worst_case_bytes: {b['name']!r} is declared for "
                              f"{'no' if worst is None else f'{worst} bytes,'} but the steps writing it bring {got} "
                              f"token streams of {tokens} tokens x {d['bytes_per_token']} bytes to rank {most}")
    delivered: dict[int, int] = defaultdict(int)
    for i, s in enumerate(d["steps"]):
        if s["program"] != "dispatch" or s["dst_buffer"] != "output":
            continue
        for j, f in enumerate(s["flows"]):
            delivered[f["dst"]] += streams[("flow", s["name"], f["rank"], f["src"], f["dst"])]
            if delivered[f["dst"]] > R:
                raise SchemaError(f"steps[{i}].flows[{j}]: the writes into output deliver {delivered[f['dst']]} "
                                  f"token streams to rank {f['dst']}, more than one per home rank ({R}): a token "
                                  f"would reach its expert twice")


def _reach_every_receiver(d: dict) -> None:
    """SchemaError unless, for every home rank h and receiver r, the dispatch steps carry a token
    of h whose only destination is r into r's `output`.  Per (buffer, rank) the home ranks whose
    tokens reach it, each with the receivers (bits) those tokens may be routed to; the steps in
    program order as the layout runs them.  The work is one entry per (flow, home rank in its
    source), at most MAX_REACH_WORK."""
    R = d["num_ranks"]
    masks: dict = {}

    def selected(sel) -> int:
        if sel is None:
            return (1 << R) - 1
        key = tuple(sel)
        if key not in masks:
            masks[key] = sum(1 << r for r in set(sel) if 0 <= r < R)
        return masks[key]

    reach: dict = {("input", r): {r: (1 << R) - 1} for r in range(R)}
    work = 0
    for s in d["steps"]:
        if s["program"] != "dispatch" or s["verb"] == "exchange":
            continue
        landed: dict = defaultdict(dict)
        for f in s["flows"]:
            sel = selected(f["select"])
            into = landed[(s["dst_buffer"], f["dst"])]
            for b in s["src_buffers"]:
                homes = reach.get((b, f["src"]), {})
                work += len(homes)
                for h, m in homes.items():
                    if m & sel:
                        into[h] = into.get(h, 0) | (m & sel)
            if work > MAX_REACH_WORK:
                raise SchemaError(f"steps: checking delivery would take more than {MAX_REACH_WORK} steps "
                                  f"(flows x home ranks in their sources): the plan is too large to load")
        for k, homes in landed.items():
            old = reach.setdefault(k, {})
            for h, m in homes.items():
                old[h] = old.get(h, 0) | m
    for r in range(R):
        got = reach.get(("output", r), {})
        for h in range(R):
            if not got.get(h, 0) >> r & 1:
                raise SchemaError(f"steps: no chain of dispatch flows carries rank {h}'s tokens routed to rank "
                                  f"{r} into its output (every selection along it must include {r}): they "
                                  f"would be lost")


def layout_rows(plan: Any, tokens: int) -> int:
    """An upper bound of the rows a layout of `plan` (a Plan, or its checked JSON) holds at
    `tokens` tokens per rank: every dispatch copy moves at most its streams x tokens tokens (x the
    experts per rank a token has, into output), a derived combine copy as many as the dispatch
    copy it reverses, a written-out one at most one row per (token, expert) of every rank."""
    wl = _get(plan, "workload")
    R = _get(plan, "num_ranks")
    k = min(_get(wl, "topk"), _get(wl, "experts") // R) if wl is not None else 1
    streams = _streams(plan)
    rows: dict = {}
    total = 0
    for s in _get(plan, "steps"):
        name, verb = _get(s, "name"), _get(s, "verb")
        if verb == "exchange":
            continue
        for f in _get(s, "flows"):
            key = (_get(f, "rank"), _get(f, "src"), _get(f, "dst"))
            if _get(s, "program") == "dispatch":
                n = streams[("flow", name, *key)] * (k if _get(s, "dst_buffer") == "output" else 1)
                rows[(name, *key)] = n
            elif _get(s, "reverse_of") is not None:
                n = rows.get((_get(s, "reverse_of"), key[0], key[2], key[1]), 0)
            else:
                n = R * k
            total += n
    return total * tokens


__all__ = ["check_invariants", "layout_rows"]
