"""The simulator's results as a readable table (`epcc simulate`) and as one JSON object (`--json`)."""

from __future__ import annotations

from .simulate import Bottleneck, SimResult


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def _bottleneck_dict(b: Bottleneck | None) -> dict | None:
    if b is None:
        return None
    return {"link_class": b.link_class, "kind": b.kind, "resource": b.resource,
            "busy_ms": b.work_s * 1e3, "utilisation": b.utilisation}


def to_dict(res: SimResult, passes_run: list[str] | None = None, tokens: int | None = None) -> dict:
    steps = []
    for s in res.steps:
        steps.append({
            "name": s.name, "program": s.program, "verb": s.verb, "link": s.link, "link_kind": s.link_kind,
            "engine": s.engine,
            "ready_ms": s.ready_s * 1e3, "start_ms": s.start_s * 1e3, "end_ms": s.end_s * 1e3,
            "bytes": s.bytes, "max_rank_bytes": s.max_rank_bytes,
            "achieved_gbps": s.achieved_bps / 1e9 if s.achieved_bps else None,
            "num_chunks": s.num_chunks, "chunk_ms": [t * 1e3 for t in s.chunk_times_s],
            "alone_ms": s.alone_s * 1e3, "critical": s.critical,
            "deps": list(s.deps), "pipelined_deps": list(s.pipelined_deps),
        })
    programs = {}
    for name, p in res.programs.items():
        programs[name] = {
            "total_ms": p.makespan_s * 1e3, "serial_ms": p.serial_s * 1e3,
            "bottleneck": _bottleneck_dict(p.bottleneck), "critical_path": p.critical_path,
            "link_busy_ms": {c.name: c.work_s * 1e3 for c in p.link_classes.values()},
            "link_active_ms": {c.name: c.active_s * 1e3 for c in p.link_classes.values()},
            "launch_ms": p.launch_s * 1e3,
            "metadata_us": {k: v * 1e6 for k, v in p.metadata.items()},  # its parts, in launch_ms
            "calls_us": {k: v * 1e6 for k, v in p.calls.items()},  # the Buffer call's copies, in launch_ms
            "events": p.events,
        }
    active: dict[str, float] = {}
    for p in res.programs.values():
        for c in p.link_classes.values():
            active[c.name] = active.get(c.name, 0.0) + c.active_s * 1e3
    return {
        "schedule": res.schedule,
        "routing": res.routing,
        "num_ranks": res.num_ranks,
        "tokens": tokens,
        "passes_run": passes_run or [],
        "total_ms": res.total_s * 1e3,
        "serial_ms": res.serial_s * 1e3,
        "bottleneck": _bottleneck_dict(res.bottleneck),
        "link_busy_ms": {k: v * 1e3 for k, v in res.link_busy_s().items()},
        "link_active_ms": active,
        "programs": programs,
        "steps": steps,
        "model": {
            "busy": "bytes / capacity of the busiest instance of each link class",
            "active": "wall time the busiest-active instance carried any traffic",
            "pipelining": res.options.pipelining, "latency": res.options.latency,
            "priorities": res.options.priorities, "order_hints": res.options.order_hints,
            "rdma": "proxy" if res.options.rdma_proxy else "emulate",
            "sm": res.sm_model,
        },
    }


def table(res: SimResult, passes_run: list[str] | None = None) -> str:
    out = [f"schedule {res.schedule}: {res.num_ranks} ranks, routing {res.routing}"]
    if passes_run is not None:
        out.append("plan after passes: " + ", ".join(passes_run))
    if res.sm_model:
        out.append(f"SM model: {res.sm_model['text']}")
    w = max([15] + [len(s.name) for s in res.steps])
    lw = max([7] + [len(s.link or "-") for s in res.steps])
    hdr = (f"{'step':<{w + 1}} {'link':<{lw}} {'kind':<6} {'engine':<6} {'start':>8} {'end':>8} {'MB/rank':>9} {'GB/s':>8} "
           f"{'chunks':>6} {'alone':>8}")
    for name, p in res.programs.items():
        out.append("")
        out.append(f"{name} (times in ms; GB/s = the busiest rank's bytes over the step's start..end; "
                   f"* = critical path)")
        out.append(hdr)
        out.append("-" * len(hdr))
        for s in p.steps:
            gbps = f"{s.achieved_bps / 1e9:.1f}" if s.achieved_bps else "-"
            mark = "*" if s.critical else " "
            out.append(f"{mark}{s.name:<{w}} {s.link or '-':<{lw}} {s.link_kind or '-':<6} {s.engine or '-':<6} {_ms(s.start_s):>8} "
                       f"{_ms(s.end_s):>8} {s.max_rank_bytes / 1e6:>9.2f} {gbps:>8} {s.num_chunks:>6} {_ms(s.alone_s):>8}")
        out.append("link busy (busiest instance; busy = bytes / capacity, active = wall time with traffic):")
        cw = max([10] + [len(c.name) for c in p.link_classes.values()])
        for c in sorted(p.link_classes.values(), key=lambda c: -c.work_s):
            out.append(f"  {c.name:<{cw}} {c.kind or '-':<6} busy {_ms(c.work_s):>8} ms  active {_ms(c.active_s):>8} ms"
                       f"  ({c.busiest}, {c.instances} instance{'s' if c.instances != 1 else ''})")
        if p.bottleneck:
            out.append(f"bottleneck: {p.bottleneck.describe()}")
        out.append(f"critical path: {' -> '.join(p.critical_path)}")
        if p.metadata:
            parts = ", ".join(f"{k} {v * 1e6:.1f}" for k, v in p.metadata.items())
            out.append(f"{name} metadata kernels on the GPU: {sum(p.metadata.values()) * 1e6:.1f} us before the "
                       f"first step ({parts} us)")
        if p.calls:
            notes = []
            if name in res.options.caller_rows:  # no copy into the input buffer: read in place
                notes.append("x and its scales packed into one tensor the kernel reads in place" if "input" in p.calls
                             else {"dispatch": "the tokens", "combine": "the expert outputs"}[name]
                             + " read where the caller has them, not copied")
            if name == "combine" and res.options.zero_beside:
                notes.append("the partials cleared beside the dispatch kernel")
            if name == "combine" and res.options.convert_in_kernel:
                notes.append("the bf16 tokens written by the combine kernel")
            if any(k != "gaps" for k in p.calls):
                parts = ", ".join(f"{k} {v * 1e6:.1f}" for k, v in p.calls.items())
                said = f"{sum(p.calls.values()) * 1e6:.1f} us ({'; '.join([parts + ' us', *notes])})"
            else:
                said = f"none ({'; '.join(notes)})"
            out.append(f"{name} Buffer call's copies beside the kernels: {said}")
        launches = f" (kernel launch and metadata {_ms(p.launch_s)} ms before the first step included)" if p.launch_s else ""
        out.append(f"{name}: total {_ms(p.makespan_s)} ms with overlap, serial sum {_ms(p.serial_s)} ms{launches}")
    if len(res.programs) > 1:
        out.append("")
        out.append(f"together: total {_ms(res.total_s)} ms with overlap, serial sum {_ms(res.serial_s)} ms "
                   f"(programs back to back)")
        if res.bottleneck:
            out.append(f"bottleneck (together): {res.bottleneck.describe()}")
    return "\n".join(out)
