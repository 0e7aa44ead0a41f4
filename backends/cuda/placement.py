"""Table blobs at fixed places: every section, every copy's rows and every role's items and waits
at an offset that depends on the plan and the bundle's token capacity only, never on a routing.

The kernels read a blob through its offsets (tables.py describes the blob), so a blob may leave
room between its records.  Placed this way, a blob can be written by the GPU itself (the
metadata kernels of runtime/engines/cuda_table/meta.py write each record where this placement
puts it, in parallel, without first counting what comes before it), and the host can build the
very same bytes from a layout (`build_placed`) to check them.  What differs from tables.py's
packed blobs: a role's items start at a fixed index (RoleDesc.item_begin) and leave room for the
most chunks its copies can have; an item's waits start at a fixed index and leave room for every
producer its copy can have (ItemDesc.wait_count of them are used, in flag order); every copy's row
arrays have room for its most rows; the drain lists every counter on the rank (a copy with no
chunk drains at 0) and the zero list every fp32 combine buffer (cleared to its rows, maybe none);
the header counts the room (num_items, num_waits), and unused room is zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from epcc.backends.cuda.abi import (ALIGN, NO_FLAG, PROGRAMS, TABLE_MAGIC, TABLE_VERSION, dtype,
                                    step_crc)
from epcc.plan.model import chunk_sizes, ramp_sizes
from epcc.plan.segments import SegmentProgram



class PlacementError(ValueError):
    """A blob cannot be placed (the plan's tables do not fit what the kernels were compiled for)."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def max_chunks(tokens: int, tpc: int | None, head: int, tail: int) -> int:
    """The most chunks a copy of at most `tokens` tokens is cut into (plan.chunk_sizes): the count
    grows with the tokens, except that a copy just long enough for its ramps can have fewer chunks
    than one a token shorter (which has none), so both are considered."""
    if tokens <= 0:
        return 0
    if not tpc:
        return 1
    ramps = sum(ramp_sizes(tpc, head)) + sum(ramp_sizes(tpc, tail))
    below = min(tokens, ramps + tpc - 1)  # the longest copy without ramps
    return max(len(chunk_sizes(tokens, tpc, head, tail)), -(-below // tpc))


@dataclass
class PlacedCopy:
    """One copy of a rank's table for one program, and where its records go."""

    copy: int  # its id in the segment program (= its flag id)
    kind: str  # dispatch | combine
    side: str  # sm (the rank executes it), rdma-pack (it sends), rdma-unpack (it lands here)
    role: int
    index: int  # its CopyDesc index
    weighted: bool
    rows_cap: int
    tokens_cap: int
    chunks_cap: int
    producers: list[int]  # flag ids of the copies its chunks may wait for, ascending (none on unpack)
    chunk_rows_cap: int = 0  # the most rows one of its chunks can hold (a GPU proxy path's slot)
    src_rows: int = 0  # absolute offsets of its row arrays
    dst_rows: int = 0
    weights: int = 0


@dataclass
class PlacedRole:
    step: str
    side: str
    item_begin: int
    item_cap: int
    wait_begin: int  # first WaitDesc index of the role's first item
    wait_stride: int  # WaitDesc slots per item: the most producers of its copies
    copies: list[PlacedCopy] = field(default_factory=list)


@dataclass
class Placement:
    program: str
    rank: int
    roles: list[PlacedRole]
    copies: list[PlacedCopy]
    drain: list[int]  # flag ids of the counters on this rank, in flag order
    zero: list[tuple[int, str]]  # (buffer id, name) of the fp32 combine buffers, manifest order
    num_items: int
    num_waits: int
    num_flags: int
    num_buffers: int
    offsets: dict[str, int]  # section -> offset
    total_bytes: int
    copy_meta: dict = field(default_factory=dict)  # copy id -> the segment program's copy


def placement(manifest: dict, prog: SegmentProgram, program: str, rank: int, tokens: int) -> Placement:
    """Where everything of `program`'s table of `rank` goes, for at most `tokens` tokens per rank."""
    if program not in PROGRAMS:
        raise PlacementError(f"program must be one of {PROGRAMS}, not {program!r}")
    kernel = next((k for k in manifest["kernels"] if k["program"] == program and k["kind"] == "main"), None)
    if kernel is None:
        raise PlacementError(f"the manifest has no {program} kernel")
    wl = manifest["workload"]
    per_token = min(int(wl["topk"]), int(wl["experts"]) // prog.num_ranks)
    dcap = {c.id: _dispatch_caps(c, tokens, per_token) for c in prog.dispatch}
    if program == "dispatch":
        copies = prog.dispatch
        producers = {c.id: sorted({prog.segments[p.src].writer for p in c.parts
                                   if prog.segments[p.src].writer >= 0}) for c in copies}
        caps = dcap
        per_tok = {c.id: per_token if c.into_output else 1 for c in copies}
    else:
        copies = prog.combine
        writers: dict[tuple, list] = {}  # (buffer, rank) -> the combine copies writing there
        for c2 in copies:
            writers.setdefault((c2.dst_buffer, c2.dst), []).append(c2)
        producers = {c.id: sorted({c2.id for c2 in writers.get((c.src_buffer_name, c.src), ())
                                   if c2.step_index < c.step_index}) for c in copies}
        caps, per_tok = {}, {}
        for c in copies:  # rows and tokens of its dispatch copies' parts that read the reverse source
            rows = toks = 0
            per_tok[c.id] = 1
            for d in c.pool:
                dc = prog.dispatch[d]
                n = sum(1 for p in dc.parts if p.src_buffer == c.src_buffer)
                rows += n * tokens * (per_token if dc.into_output else 1)
                toks += n * tokens
                if n and dc.into_output:
                    per_tok[c.id] = per_token
            caps[c.id] = (rows, toks)
    by_step: dict[str, list] = {}
    for c in copies:
        by_step.setdefault(c.step, []).append(c)
    roles: list[PlacedRole] = []
    placed: list[PlacedCopy] = []
    items = waits = 0
    for ri, role in enumerate(kernel["roles"]):
        side = role.get("lowered")
        side = side if side in ("rdma-pack", "rdma-unpack") else "sm"
        mine = [c for c in by_step.get(role["step"], [])
                if (c.src if side == "rdma-pack" else c.dst if side == "rdma-unpack" else c.rank) == rank]
        mine.sort(key=lambda c: (c.flow_index, c.src, c.dst))
        pr = PlacedRole(role["step"], side, items, 0, waits, 0)
        for c in mine:
            rows_cap, toks_cap = caps[c.id]
            prods = [] if side == "rdma-unpack" else producers[c.id]
            chunk_toks = min(c.tpc, toks_cap) if c.tpc else toks_cap  # ramps and the remainder are smaller
            pc = PlacedCopy(c.id, program, side, ri, len(placed), role["op"] == "accum_weighted", rows_cap, toks_cap,
                            max_chunks(toks_cap, c.tpc, c.ramp_head, c.ramp_tail), prods,
                            min(rows_cap, chunk_toks * per_tok[c.id]))
            pr.copies.append(pc)
            placed.append(pc)
        pr.item_cap = sum(c.chunks_cap for c in pr.copies)
        pr.wait_stride = max((len(c.producers) for c in pr.copies), default=0)
        items += pr.item_cap
        waits += pr.item_cap * pr.wait_stride
        roles.append(pr)
    drain = [c.id for c in copies if c.dst == rank]
    drain.sort()
    zero = [(i, b["name"]) for i, b in enumerate(manifest["buffers"][program])
            if program == "combine" and b["rows"] == "f32"]
    offsets = {}
    off = _align(dtype("TableHeader").itemsize)
    for name, n in (("roles", len(roles)), ("copies", len(placed)), ("items", items), ("waits", waits),
                    ("drain", len(drain)), ("zero", len(zero))):
        offsets[name] = off
        off = _align(off + n * dtype({"roles": "RoleDesc", "copies": "CopyDesc", "items": "ItemDesc",
                                      "waits": "WaitDesc", "drain": "DrainDesc", "zero": "ZeroDesc"}[name]).itemsize)
    offsets["rows"] = off
    for pc in placed:
        pc.src_rows, off = off, _align(off + 8 * pc.rows_cap)
        pc.dst_rows, off = off, _align(off + 8 * pc.rows_cap)
        if pc.weighted:
            pc.weights, off = off, _align(off + 4 * pc.rows_cap)
    return Placement(program, rank, roles, placed, drain, zero, items, waits,
                     len(prog.dispatch) + len(prog.combine), len(manifest["buffers"][program]), offsets, off,
                     {c.id: c for c in copies})


def _dispatch_caps(c, tokens: int, per_token: int) -> tuple[int, int]:
    toks = len(c.parts) * tokens
    return (toks * per_token if c.into_output else toks), toks


def record_writer(blob: np.ndarray):
    """put(offset, record name, fields): one abi.py record written into the byte array `blob`."""
    def put(offset: int, name: str, rec: tuple) -> None:
        dt = dtype(name)
        arr = np.zeros(1, dtype=dt)
        arr[0] = rec
        blob[offset: offset + dt.itemsize] = np.frombuffer(arr.tobytes(), dtype=np.uint8)
    return put


def template(manifest: dict, pl: Placement, num_ranks: int) -> np.ndarray:
    """The placed blob with its static fields only (what no routing changes): the bytes the
    metadata kernels start from.  Zero where the kernels write: RoleDesc.item_count, CopyDesc.n_rows,
    DrainDesc.value, ZeroDesc.bytes, the header's tokens, every item, wait and row."""
    program = pl.program
    buffers = {b["name"]: i for i, b in enumerate(manifest["buffers"][program])}
    wl = manifest["workload"]
    blob = np.zeros(pl.total_bytes, dtype=np.uint8)

    put = record_writer(blob)

    for ri, pr in enumerate(pl.roles):
        for pc in pr.copies:
            c = pl.copy_meta[pc.copy]
            no_flag = pr.side == "rdma-pack"
            put(pl.offsets["copies"] + pc.index * dtype("CopyDesc").itemsize, "CopyDesc",
                (pc.src_rows, pc.dst_rows, pc.weights if pc.weighted else 0, 0, c.src, c.dst, buffers[c.dst_buffer],
                 NO_FLAG if no_flag else pc.copy, 0 if no_flag else c.dst, c.step_index, c.flow_index))
        put(pl.offsets["roles"] + ri * dtype("RoleDesc").itemsize, "RoleDesc",
            (pr.item_begin, 0, step_crc(pr.step), len(pr.copies)))
    for i, fid in enumerate(pl.drain):
        put(pl.offsets["drain"] + i * dtype("DrainDesc").itemsize, "DrainDesc", (fid, 0, 0))
    for i, (b, _) in enumerate(pl.zero):
        put(pl.offsets["zero"] + i * dtype("ZeroDesc").itemsize, "ZeroDesc", (b, 0, 0))
    hdr = dict(magic=TABLE_MAGIC, version=TABLE_VERSION, program=PROGRAMS.index(program), rank=pl.rank,
               num_ranks=num_ranks, num_roles=len(pl.roles), num_copies=len(pl.copies), num_items=pl.num_items,
               num_waits=pl.num_waits, num_drain=len(pl.drain), num_flags=pl.num_flags, num_zero=len(pl.zero),
               hidden=int(wl["hidden"]), row_bytes=int(wl["row_bytes"]), num_buffers=pl.num_buffers, tokens=0,
               total_bytes=pl.total_bytes)
    hdr.update({f"off_{n}": o for n, o in pl.offsets.items()})
    dt = dtype("TableHeader")
    put(0, "TableHeader", tuple(hdr[f] for f in dt.names))
    return blob
