"""What rank 0 prints and writes: per-method summaries (the maximum over ranks per iteration, the
median over iterations, GB/s by byte convention), the table, the lines against `epcc simulate`
and the role timelines, the JSON."""

from __future__ import annotations

import statistics

import numpy as np

from epcc.runtime.engines.transport import cost_phrase

#: the row of epcc compared with `epcc simulate` (which predicts the kernels alone): the cached-handle
#: dispatch where a bundle has one (table-driven: the fresh row includes the host layout), else epcc
SIM_ROWS = ("epcc_cached", "epcc")


def method_record(per_rank: list[dict], tr: dict, rb: int, topk: int, method: str) -> dict:
    """One method's entry of the report from every rank's result: its summary and checks, or the
    error (the most telling rank's) or why it was skipped."""
    rec: dict = {"per_rank": per_rank}
    first = per_rank[0]
    if "sms" in first:
        rec["sms"] = first["sms"]
    hosts = [x.get("host_ms", {}).get("layout_tables") for x in per_rank]
    if all(h is not None for h in hosts):
        rec["host_ms_max"] = max(hosts)
    errs = [(r, x["error"]) for r, x in enumerate(per_rank) if x.get("error")]
    if errs:
        rec["error"] = first_error(errs)  # the first rank's own message; "a peer failed" ones only if nothing better
    elif any("skipped" in x for x in per_rank):
        rec["skipped"] = first.get("skipped", "skipped")
    else:
        rec["summary"] = summarize(per_rank, tr, wire_for(method, tr, rb, topk, first.get("wire_bytes")))
        rec["check"] = [x.get("check") for x in per_rank]
    return rec


def summarize(per_rank: list[dict], traffic_b: dict, wire: dict | None) -> dict:
    """Per-iteration max over ranks -> median, min; GB/s from the mean bytes per rank."""
    out = {}
    for op in ("dispatch", "combine"):
        series = [r[f"{op}_ms"] for r in per_rank]
        n = min(len(s) for s in series)
        it = [max(s[i] for s in series) for i in range(n)]
        med, mn = statistics.median(it), min(it)
        tb = traffic_b[op]
        mean = lambda v: float(np.mean(v))  # noqa: E731
        o = {"median_ms": med, "min_ms": mn, "iter_max_over_ranks_ms": it,
             "per_rank_median_ms": [statistics.median(s) for s in series],
             "gbps_remote_dedup": mean(tb["remote_dedup"]) / med / 1e6,
             "gbps_remote_rows": mean(tb["remote_rows"]) / med / 1e6,
             "gbps_deepep": mean(tb["deepep"]) / med / 1e6}
        if wire is not None:
            o["wire_bytes_per_rank"] = wire[op]
            o["gbps_remote_wire"] = mean(wire[op]) / med / 1e6
        out[op] = o
    return out


def wire_for(method: str, tr: dict, rb: int, topk: int, measured: dict | None) -> dict | None:
    """The remote bytes per rank a method moves (docs/benchmarking.md, "wire"): epcc's as its
    result counted them (`measured`); a DeepEP row (name@SMs) counts its variant's."""
    base = method.split("@")[0]
    if base in ("epcc", "epcc_cached", "epcc_graph"):
        return measured
    dedup = {"dispatch": tr["dispatch"]["remote_dedup"], "combine": tr["combine"]["remote_dedup"]}
    if base == "torch_megatron":  # payload + 2k x 4 B of top-k ids and weights per token; rows back
        return {"dispatch": _with_meta(dedup["dispatch"], rb, 2 * topk * 4), "combine": tr["combine"]["remote_rows"]}
    if base in ("deepep", "deepep_permute"):  # payload + k x (8 + 4) B of top-k ids and weights per token
        return {"dispatch": _with_meta(dedup["dispatch"], rb, topk * 12), "combine": dedup["combine"]}
    return dedup  # nccl_a2a, deepep_cached: the payload only


def _with_meta(payload: list, rb: int, meta: int) -> list:
    return [b + b // rb * meta for b in payload]


def format_table(report: dict) -> str:
    hdr = ["bundle", "method", "dispatch ms med (min)", "disp GB/s dedup|wire|DeepEP", "combine ms med (min)",
           "comb GB/s dedup|wire|DeepEP", "SMs d/c", "layout+tables host ms"]
    rows, notes = [], []  # notes: (bundle, method, message) printed across the columns
    for b in report["bundles"]:
        if "error" in b:
            notes.append((len(rows), b["name"], "-", f"bundle: {b['error']}"))
            continue
        for m, r in b["methods"].items():
            if "summary" not in r:
                msg = f"{m.split('_')[0]}: failed: {r['error']}" if "error" in r else r.get("skipped", "no result")
                if _host(r):
                    msg += f" (layout+tables host {_host(r)} ms)"
                notes.append((len(rows), b["name"], m, msg))
                continue
            d, c = r["summary"]["dispatch"], r["summary"]["combine"]
            rows.append([b["name"], m, f"{d['median_ms']:.3f} ({d['min_ms']:.3f})", _gb(d),
                         f"{c['median_ms']:.3f} ({c['min_ms']:.3f})", _gb(c), _sms(r), _host(r) or "-"])
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(hdr)]
    widths[0] = max([widths[0]] + [len(n[1]) for n in notes])
    widths[1] = max([widths[1]] + [len(n[2]) for n in notes])

    def line(cells):
        return "  ".join(c.ljust(wd) for c, wd in zip(cells, widths)).rstrip()

    out = [line(hdr), line(["-" * wd for wd in widths])]
    lines = [line(r) for r in rows]
    for pos, bname, m, msg in reversed(notes):  # keep report order
        lines.insert(pos, "  ".join([bname.ljust(widths[0]), m.ljust(widths[1]), msg]))
    return "\n".join(out + lines)


def format_predictions(report: dict) -> list[str]:
    """Measured epcc medians against `epcc simulate` (with overlap, and its serial sum), per bundle
    (the row of SIM_ROWS the bundle has, named where it is not plain epcc); none where ranks shared
    GPUs (time-sliced kernels: not the plan's times) or in a dry run."""
    if report.get("shared_gpus") and any(b.get("simulate") for b in report["bundles"]):
        return [f"against epcc simulate: not compared ({report['shared_gpus']}: the times are not the plan's)"]
    if (report.get("args") or {}).get("dry_run") and any(b.get("simulate") for b in report["bundles"]):
        return ["against epcc simulate: not compared (a dry run: wall-clock times on the CPU)"]
    out = []
    for b in report["bundles"]:
        methods = b.get("methods", {})
        row = next((m for m in SIM_ROWS if "summary" in methods.get(m, {})), None)
        sim = b.get("simulate")
        if not sim or row is None:
            continue
        r, label = methods[row], b["name"] + ("" if row == "epcc" else f" ({row})")
        if sim.get("tokens") not in (None, b.get("workload", {}).get("tokens")):
            out.append(f"{label}: simulate.json is for {sim['tokens']} tokens, the run for "
                       f"{b['workload']['tokens']}: not compared")
            continue
        run_sms, sim_sms = r.get("sms"), sim.get("sms")
        if isinstance(run_sms, dict) and sim_sms and any(run_sms.get(p) != n for p, n in sim_sms.items()):
            # a tuned configuration: the prediction was made for the plan's SMs
            out.append(f"{label}: simulate.json is for {_sms({'sms': sim_sms})} SMs, the run used "
                       f"{_sms(r)}: not compared (`epcc simulate --sms N` predicts other SM counts)")
            out += format_timeline(b, r, None)
            continue
        cells = []
        for p in ("dispatch", "combine"):
            m, s = r["summary"][p]["median_ms"], sim[p]
            meta = s.get("metadata_us") or {}
            with_meta = f"metadata kernels {sum(meta.values()):.0f} us included, " if meta else ""
            cells.append(f"{p} measured {m:.3f} ms, simulate {s['total_ms']:.3f} ms ({(m / s['total_ms'] - 1) * 100:+.0f} %; "
                         f"{with_meta}serial sum {s['serial_ms']:.3f}, bottleneck {s['bottleneck']})")
        out.append(f"{label}: " + "; ".join(cells))
        out += format_timeline(b, r, sim)
    if out:
        out.insert(0, "against epcc simulate (the bundle's simulate.json; a re-chunked plan (name@TxD) simulated here):")
    return out


def format_timeline(b: dict, r: dict, sim: dict | None) -> list[str]:
    """Rank 0's role timeline, the median of the untimed stamped rounds (ms after the entry
    barrier: first block moving rows .. last block done), beside the simulator's step start .. end
    (less the metadata kernels it puts before the dispatch kernel, whose barrier the timeline
    starts at)."""
    tl = (r.get("per_rank") or [{}])[0].get("timeline")
    if not tl:
        return []
    out = []
    for p in ("dispatch", "combine"):
        steps = (sim or {}).get(p, {}).get("steps", {})
        before = sum(((sim or {}).get(p, {}).get("metadata_us") or {}).values()) / 1e3
        cells = []
        for role in tl[p]["roles"]:
            got = (f"{role['start_ms']:.3f}-{role['end_ms']:.3f}" if role["start_ms"] is not None else "no rows")
            if role.get("median_end_ms") is not None:
                got += f" (median warp end {role['median_end_ms']:.3f})"
            s = steps.get(role["step"])
            cells.append(f"{role['step']} {got}" + (f" (sim {s[0] - before:.3f}-{s[1] - before:.3f})" if s else ""))
        out.append(f"  {p} rank 0 timeline, ms: " + ", ".join(cells) + f"; kernel end {tl[p]['end_ms']:.3f}")
    return out


def _num(v: float) -> str:
    return f"{v:.0f}" if v >= 99.5 else f"{v:.1f}" if v >= 9.95 else f"{v:.2f}"


def _gb(o: dict) -> str:
    wire = _num(o["gbps_remote_wire"]) if "gbps_remote_wire" in o else "-"
    return f"{_num(o['gbps_remote_dedup'])} | {wire} | {_num(o['gbps_deepep'])}"


def _sms(r: dict) -> str:
    s = r.get("sms")
    if isinstance(s, dict):
        return f"{s.get('dispatch', '-')}/{s.get('combine', '-')}"
    return str(s or "-")


def _host(r: dict) -> str:
    h = r.get("host_ms_max")
    return f"{h:.1f}" if h is not None else ""


def jsonable(o):
    """`o` as JSON takes it: NumPy scalars as Python numbers, non-finite floats as null."""
    if isinstance(o, dict):
        return {str(k): jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [jsonable(v) for v in o]
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, float) and not np.isfinite(o):
        return None
    return o


def proxy_cost(st: dict) -> str:
    """This rank's proxy thread since the last fresh layout (a dispatch with a new routing sets the
    proxy path up anew; the bench reads it after the cached-handle rounds: warm-up, timed and
    stamped): writes posted, host time per post call, and chunks found waiting per FIFO pass (above
    1: the kernels pushed chunks faster than the thread posted them, so the proxy set the pace)."""
    cost = cost_phrase(st)
    return f"{st.get('writes_posted', 0)} writes" + (f", {cost}" if cost else "")


def first_error(errs: list[tuple[int, str]]) -> str:
    """The most telling of the ranks' messages: a rank's own failure before 'a peer failed'; a
    check failure already names its rank."""
    r, msg = ([e for e in errs if not e[1].startswith("a peer failed")] or errs)[0]
    return msg if msg.startswith("WRONG") else f"rank {r}: {msg}"


def status(per_rank: list[dict]) -> str:
    """One method's progress line: ok with its medians, failed with the most telling error, or
    why it was skipped."""
    errs = [(r, x["error"]) for r, x in enumerate(per_rank) if x.get("error")]
    if errs:
        return f"failed: {first_error(errs)}"
    if any("skipped" in x for x in per_rank):
        return per_rank[0].get("skipped", "skipped")
    d = statistics.median(max(v) for v in zip(*[x["dispatch_ms"] for x in per_rank]))
    c = statistics.median(max(v) for v in zip(*[x["combine_ms"] for x in per_rank]))
    return f"ok: dispatch {d:.3f} ms, combine {c:.3f} ms (median)"
