"""cuda/manifest.json, checked before a runtime reads it: every field a reader of the CUDA bundle
uses (runtime/engines/cuda_direct, cuda_table, gpu_proxy, runtime/testing/emulate.py, epcc tune,
bench/ep_bench.py), with its type and range, and what refers to what (a role's buffers, the
lowering and its direct entry).  Written by backends/cuda/codegen.py; format and version in
plan/schema.py.  Paths in it name files inside the bundle's cuda/ directory only.

supa/manifest.json (the SUPA target: the same generator) has the same fields but its "build" (the
brcc steps of both runtime generations and the shim's nvcc command) and "machine" (what the
kernels were generated for): SUPA_SCHEMA, check_supa_manifest.
"""

from __future__ import annotations

from ..limits import MAX_RANKS, MAX_SIZE, MAX_SMS, WORKLOAD_LIMITS
from .schema import (Bool, Int, List, Map, Name, Nullable, Num, Obj, OneOf, RelPath, SchemaError, Str)

PROGRAMS = ("dispatch", "combine")
# Each program's input buffer, which a launch may read from the caller's memory instead (the manifest's
# `dispatch_input` / `combine_input`): the dispatch's tokens, the combine's expert rows as the caller
# hands them to the call.
CALLER_INPUTS = {"dispatch": "input", "combine": "output"}
MAX_THREADS = 1024  # per block
MAX_SHARED = 1 << 20  # bytes of shared memory per block
MAX_WARPS = 64
MAX_UNROLL = 256
MAX_LIST = 4096  # kernels, roles, buffers, steps, files, arguments of one manifest
SMALL = Int(0, MAX_SIZE)

_COMMAND = List(Str(), 1, MAX_LIST)

ROLE = Obj({
    "index": Int(0, MAX_LIST), "step": Str(), "title": Nullable(Str()), "line": Int(0, 1 << 31), "role": Str(),
    "engine": Str(), "lowered": Str(), "blocks": List(Int(0, MAX_SMS), 2, 2), "sms": Int(0, MAX_SMS),
    "plan_sms": Nullable(List(Int(0, MAX_SMS), 2, 2)), "warps": Int(0, MAX_WARPS), "op": Str(),
    "access_bytes": Int(1, MAX_THREADS), "unroll": Int(1, MAX_UNROLL), "src_buffers": List(Str(), 0, MAX_LIST),
    "dst_buffer": Nullable(Str()), "paced_bytes_per_s": Nullable(Num(0)), "function": Str(),
})

KERNEL = Obj({
    "name": Str(), "kind": Str(choices=("main", "finish", "count")), "program": Str(choices=PROGRAMS), "file": Name,
    "launch": Str(choices=("cooperative", "plain")), "launch_fn": Str(),
    "grid": OneOf((Int(1, MAX_SMS), Str()), "a number of blocks, or a rule"), "block": Int(1, MAX_THREADS),
    "shared_bytes": Int(0, MAX_SHARED), "roles": List(ROLE, 0, MAX_LIST),
})

BUFFER = Obj({"name": Str(), "rows": Str(choices=("wire", "bf16", "f32"))})

DIRECT = Obj({
    "abi": Int(0, 1 << 31), "source": Name, "library": Name, "command": _COMMAND,
    "constants": Obj({
        "num_ranks": Int(1, MAX_RANKS), "experts_per_rank": Int(1, WORKLOAD_LIMITS["experts"]),
        "topk": Int(1, WORKLOAD_LIMITS["topk"]), "hidden": Int(1, WORKLOAD_LIMITS["hidden"]),
        "max_tokens": Int(1, WORKLOAD_LIMITS["tokens"]), "capacity": Int(1, MAX_SIZE), "x_bytes": Int(1, MAX_SIZE),
        "scale_bytes": SMALL, "timeline_blocks": Int(0, MAX_SMS), "timeline_words": Int(0, MAX_LIST),
        "align_max": Int(1, MAX_SIZE), "region_bytes": Int(1, MAX_SIZE),
        "placement": Str(choices=("blocked", "strided")), "dtype": Str(choices=("bf16", "fp8")),
        "offsets_named": Map(SMALL, hi=MAX_LIST),
    }),
    "waits": List(Str(), 0, MAX_LIST),
    "config": Map(Int(0, MAX_SMS), hi=64),
    "steps": List(Obj({"program": Str(choices=PROGRAMS), "name": Str()}), 0, MAX_LIST),
})

_FIELDS = {
    "table_version": Int(0, 1 << 31), "epcc_version": Str(), "schedule": Str(), "source": Str(),
    "num_ranks": Int(1, MAX_RANKS), "target": Str(),
    "workload": Obj({
        "hidden": Int(1, WORKLOAD_LIMITS["hidden"]), "dtype": Str(choices=("bf16", "fp8")),
        "tokens": Int(1, WORKLOAD_LIMITS["tokens"]), "topk": Int(1, WORKLOAD_LIMITS["topk"]),
        "experts": Int(1, WORKLOAD_LIMITS["experts"]), "row_bytes": Int(1, MAX_SIZE),
    }),
    "options": Obj({
        "rdma": Str(choices=("emulate", "external", "proxy")), "dma_blocks": Int(0, MAX_SMS),
        "proxy_blocks": Int(0, MAX_SMS), "pace_rdma": Bool(), "copy_unroll": Int(1, MAX_UNROLL),
        "accum_unroll": Int(1, MAX_UNROLL),
    }),
    "build": Obj({"library": Name, "sources": List(Name, 1, MAX_LIST), "headers": List(RelPath, 0, MAX_LIST),
                  "command": _COMMAND}),
    "buffers": Obj({p: List(BUFFER, 0, MAX_LIST) for p in PROGRAMS}),
    "kernels": List(KERNEL, 0, MAX_LIST),
    "not_lowered": List(Obj({"program": Str(choices=PROGRAMS), "step": Str(), "kind": Str()}), 0, MAX_LIST),
    "lowering": Str(choices=("direct", "tables")),
    "direct": DIRECT,
    "direct_not_used": Nullable(Str()),
    "rdma": List(RelPath, 0, MAX_LIST),
    # whether each program's kernel may read this rank's input rows (the dispatch's tokens, the
    # combine's expert rows) where the caller has them (absent in bundles of an older epcc: the
    # runtime copies them into `buffer`)
    **{f"{p}_input": Obj({"buffer": Str(), "caller_rows": Bool(), "why": Str()}) for p in PROGRAMS},
    # where the combine's fp32 home partials become the caller's bf16 tokens: in the combine kernel
    # (the warp adding a row's last contribution converts it; a `count` kernel counts each row's
    # contributions before the launch) or by a `finish` kernel after it (absent in bundles of an
    # older epcc: the finish kernel)
    "combine_output": Obj({"convert": Str(choices=("in-kernel", "finish-kernel")), "why": Str()}),
}
_OPTIONAL = frozenset({"direct", "direct_not_used", "combine_output", *(f"{p}_input" for p in PROGRAMS)})
SCHEMA = Obj(_FIELDS, optional=_OPTIONAL)

_STEPS = List(_COMMAND, 1, MAX_LIST)
SUPA_SCHEMA = Obj({
    **_FIELDS,
    "build": Obj({
        "library": Name, "sources": List(Name, 1, MAX_LIST), "headers": List(RelPath, 0, MAX_LIST), "arch": Str(),
        "brcc": Obj({"su": Obj({"about": Str(), "steps": _STEPS}), "supa": Obj({"about": Str(), "steps": _STEPS})}),
        "shim": Obj({"library": Name, "api": Str(choices=("su", "supa")), "command": _COMMAND}),
    }),
    "machine": Obj({"warp_size": Int(1, MAX_THREADS), "max_block_threads": Int(1, MAX_THREADS),
                    "blocks_per_cu": Int(1, MAX_THREADS), "kernel_writes_host_memory": Bool()}),
}, optional=_OPTIONAL)


def check_supa_manifest(d: dict) -> None:
    """check_cuda_manifest for a supa/manifest.json (SUPA_SCHEMA; no direct lowering)."""
    SUPA_SCHEMA.check(d, "")
    if d["lowering"] != "tables":
        raise SchemaError(f"lowering: {d['lowering']!r}; the SUPA target has the table-driven kernels only")
    _check_references(d)


def check_cuda_manifest(d: dict) -> None:
    """SchemaError naming the field unless `d` (a parsed cuda/manifest.json, its format version
    checked) has every field a runtime reads, of its type and in its range, consistently."""
    SCHEMA.check(d, "")
    _check_references(d)


def _check_references(d: dict) -> None:
    if ("direct" in d) != (d["lowering"] == "direct"):
        raise SchemaError(f"lowering: {d['lowering']!r}, {'with' if 'direct' in d else 'without'} a direct entry")
    if "direct" in d and d["direct"]["constants"]["num_ranks"] != d["num_ranks"]:
        raise SchemaError(f"direct.constants.num_ranks: {d['direct']['constants']['num_ranks']}, the manifest's "
                          f"num_ranks {d['num_ranks']}")
    names = {p: {b["name"] for b in d["buffers"][p]} for p in PROGRAMS}
    for p in PROGRAMS:
        seen = set()
        for j, b in enumerate(d["buffers"][p]):
            if b["name"] in seen:
                raise SchemaError(f"buffers.{p}[{j}].name: {b['name']!r} listed twice")
            seen.add(b["name"])
    for p in PROGRAMS:
        ci = d.get(f"{p}_input")
        if ci is not None and ci["caller_rows"] and ci["buffer"] not in names[p]:
            raise SchemaError(f"{p}_input.buffer: no {p} buffer named {ci['buffer']!r}")
    mains = set()
    for i, k in enumerate(d["kernels"]):
        at = f"kernels[{i}]"
        if k["kind"] == "main":
            if k["program"] in mains:
                raise SchemaError(f"{at}: a second main kernel of {k['program']}")
            mains.add(k["program"])
            if not isinstance(k["grid"], int):
                raise SchemaError(f"{at}.grid: a main kernel's grid is a number of blocks, got {k['grid']!r}")
        for j, r in enumerate(k["roles"]):
            b0, b1 = r["blocks"]
            if not b0 <= b1 <= (k["grid"] if isinstance(k["grid"], int) else MAX_SMS):
                raise SchemaError(f"{at}.roles[{j}].blocks: {r['blocks']} is not a range of the kernel's {k['grid']} "
                                  f"blocks")
            for b in [*r["src_buffers"], *([r["dst_buffer"]] if r["dst_buffer"] is not None else [])]:
                if b not in names[k["program"]]:
                    raise SchemaError(f"{at}.roles[{j}]: no {k['program']} buffer named {b!r}")


__all__ = ["check_cuda_manifest", "check_supa_manifest"]


def converts_in_kernel(manifest: dict | None) -> bool:
    """Whether a bundle's combine kernel converts its fp32 home partials into the caller's bf16
    tokens itself (its `combine_output`: in-kernel) rather than a finish kernel after it; False for
    a bundle of an older epcc, which has no such field.  Read by `epcc simulate`'s calls."""
    co = (manifest or {}).get("combine_output") or {}
    return co.get("convert") == "in-kernel"


def reads_caller_rows(manifest: dict | None, program: str) -> bool:
    """Whether a bundle's `program` kernel may read this rank's input rows where the caller has them
    (its `<program>_input`: caller_rows, of the program's input buffer, CALLER_INPUTS) instead of
    from a copy in that buffer; False for a bundle of an older epcc, which has no such field (the
    Buffer copies them).  The one reading of the field: `epcc simulate`'s calls and the table
    engine both ask it."""
    ci = (manifest or {}).get(f"{program}_input") or {}
    return bool(ci.get("caller_rows")) and ci.get("buffer") == CALLER_INPUTS[program]
