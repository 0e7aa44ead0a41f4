"""`epcc simulate`'s predictions beside the measured times: the bundle's simulate.json (written by
tests/gpu/bundles.py, where the compiler is), or, for a plan re-chunked at run time
(--rdma-chunks), the simulator run here (it reads only the plan: no MLIR on the GPU machine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from epcc.plan import Plan
from epcc.plan.rdma import rdma_bytes_per_token, with_overrides
from epcc.plan.cuda_manifest import converts_in_kernel
from epcc.sim.calls import reads_caller_rows
from epcc.sim.meta import from_manifest
from epcc.sim.report import to_dict
from epcc.sim.simulate import SimOptions, simulate


def rechunk(plan: Plan, chunking: tuple[int | None, int | None]) -> Plan:
    """The plan with its RDMA steps re-chunked: `chunking` = (tokens per chunk, depth), None keeps
    the plan's (plan/rdma.py with_overrides; the environment is not read again)."""
    return with_overrides(plan, chunk_tokens=chunking[0], depth=chunking[1], env={})


def rdma_chunking_of(plan: Plan) -> dict:
    """{program.step: {chunk_tokens, depth, chunks}} of the plan's RDMA steps."""
    out = {}
    for s in plan.steps:
        if s.link_kind == "rdma" and s.chunk_bytes:
            bpt = rdma_bytes_per_token(plan, s.program)
            out[f"{s.program}.{s.name}"] = {"chunk_tokens": round(s.chunk_bytes / bpt), "depth": s.depth,
                                            "chunks": s.num_chunks}
    return out


def predict(plan: Plan, T: int, manifest: dict | None = None) -> dict | None:
    """`epcc simulate --rdma proxy` of a re-chunked plan, run here: the simulator reads only the
    plan (no MLIR), so the GPU machine can run it; with the metadata kernels where the bundle's
    CUDA manifest has them, and the Buffer call's copies where it is a table-driven bundle (tables
    from the GPU or the host; the expert outputs not copied where the manifest's combine_input lets
    the combine read them in place, as `epcc simulate`).  None where it cannot (said on stderr)."""
    try:
        meta = from_manifest((manifest or {}).get("metadata"))
        table = bool(manifest) and "direct" not in manifest
        opts = SimOptions(rdma_proxy=True, metadata=meta, calls=table, caller_rows=reads_caller_rows(manifest),
                          convert_in_kernel=converts_in_kernel(manifest))
        return prediction(to_dict(simulate(plan, opts), tokens=T))
    except Exception as e:  # noqa: BLE001
        sys.stderr.write(f"ep_bench: cannot simulate the re-chunked plan: {type(e).__name__}: {e}\n")
        return None


def load_prediction(bundle: str | Path) -> dict | None:
    """`epcc simulate --json` of the bundle's schedule, where tests/gpu/bundles.py stored it
    (simulate.json: the simulator needs the compiler, which the GPU machine does not have)."""
    path = Path(bundle) / "simulate.json"
    if not path.is_file():
        return None
    return prediction(json.loads(path.read_text(encoding="utf-8")))


def prediction(d: dict) -> dict:
    """What the report keeps of `epcc simulate --json`: per program the total (with overlap), the
    serial sum, the bottleneck link class, each step's start and end, what precedes the kernel
    (launch_ms: launches, metadata, the call's copies), the table-driven kernels' metadata on the GPU
    before the first step and the Buffer call's copies beside the kernels (us per part; empty where
    none, or in a simulate.json from before the term); the tokens and the direct kernels' SMs it assumed."""
    steps = {p: {s["name"]: [s["start_ms"], s["end_ms"]] for s in d.get("steps", []) if s.get("program") == p}
             for p in ("dispatch", "combine")}
    sms = ((d.get("model") or {}).get("sm") or {}).get("sms")  # the direct kernels' SMs it assumed
    return {"tokens": d.get("tokens"), "sms": sms if isinstance(sms, dict) else None,
            **{p: {"total_ms": d["programs"][p]["total_ms"], "serial_ms": d["programs"][p]["serial_ms"],
                   "bottleneck": d["programs"][p]["bottleneck"]["link_class"], "steps": steps[p],
                   "launch_ms": d["programs"][p].get("launch_ms", 0.0),
                   "metadata_us": d["programs"][p].get("metadata_us") or {},
                   "calls_us": d["programs"][p].get("calls_us") or {}}
               for p in ("dispatch", "combine")}}
