"""The device descriptor tables of the CUDA backend: one binary blob per (program, rank, layout).

The host builds a blob from a `Layout` (runtime/layout) with :func:`build_tables` and
uploads it once per layout (`epcc_cuda_upload_tables`); the persistent kernel reads it in place.
Everything is little-endian; every section starts on a 16-byte boundary; offsets are bytes from
the start of the blob (row arrays too: offset 0 means "absent"), so the blob is relocatable
(no pointer fix-ups).

    TableHeader   128 B    counts, sizes, section offsets (below)
    RoleDesc[]    16 B     per kernel role, in the kernel's role order: its work items
    CopyDesc[]    56 B     per Copy this rank executes: row arrays, ranks, buffers, its counter
    ItemDesc[]    24 B     per (copy, chunk) work item, grouped by role, in processing order
    WaitDesc[]    16 B     producer counters a chunk waits for: (rank, flag id) >= value
    DrainDesc[]   16 B     counters living on this rank, with the value they reach (kernel end)
    ZeroDesc[]    16 B     combine: this rank's partial buffers to clear before the launch
    rows                   int64 source handles, int64 destination slots, float32 weights

A source handle is `(buffer id << 40) | slot`: a copy may read several source buffers of one
rank (a permute of `sendbuf, from_peer, ...`), one per row.  Buffer ids are the positions in the
launch manifest's `buffers[program]` list; the kernel finds buffer b of rank r at
`buffer_ptrs[b * num_ranks + r]` (peer memory mapped through CUDA IPC).

Counters: every rank has one flag area of `2 * flag_capacity` uint64 words (dispatch region,
then combine region).  Word 0 of a region is the program's entry-barrier counter (monotonic,
never cleared); then two banks of `(flag_capacity - 1) // 2` counters, used by alternate
launches: in bank b, word 1 + b * bank + f is the counter of flag f (`Layout.flags[f]`), cleared
by its owner at the start of the launch that uses it.  Wait values are therefore the plain chunk
counts of the layout.  A copy without a counter (flag_id -1) has flag_id NO_FLAG here.

The structs are backends/cuda/abi.py's (the code generator writes their C declarations from the
same definitions, with a `static_assert` per offset), so the two sides cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from epcc.backends.cuda.abi import (ALIGN, NO_FLAG, PROGRAMS, ROW_BUF_SHIFT, TABLE_MAGIC, TABLE_VERSION, dtype,
                                    step_crc)
from epcc.plan.model import item_order

from ...bf16 import BF16_ROUNDOFF

BF16_WIRE = BF16_ROUNDOFF  # partials that cross an RDMA link are rounded to bf16


def partial_rounding(manifest: dict) -> float:
    """What runtime/testing/oracle.py's compare_combine must admit for this bundle's combine: the bf16
    rounding of the partials that cross an RDMA-class link (role op `accum_bf16_wire`), else 0."""
    ops = {r["op"] for k in manifest.get("kernels", []) for r in k.get("roles", [])}
    return BF16_WIRE if "accum_bf16_wire" in ops else 0.0


class TableError(ValueError):
    """The layout does not fit the compiled kernels (another plan, a missing buffer, ...)."""


@dataclass
class Tables:
    """A built blob and what the host needs beside it."""

    program: str
    rank: int
    blob: np.ndarray  # uint8
    num_flags: int
    zero: list[tuple[str, int]]  # (buffer, bytes) the host clears before a combine launch

    @property
    def nbytes(self) -> int:
        return int(self.blob.nbytes)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _source_ids(c, role: dict, n: int, buf_id) -> np.ndarray:
    """Per row, the id of the buffer it is read from."""
    ids = getattr(c, "src_buffer_ids", None)
    names = role.get("src_buffers") or []
    if ids is not None and names and len(ids) == n:
        lut = np.asarray([buf_id(b, "source") for b in names], dtype=np.int64)
        ids = np.asarray(ids, dtype=np.int64)
        if n and (ids.min() < 0 or ids.max() >= len(lut)):
            raise TableError(f"step '{c.step}' flow {c.flow_index}: source buffer index out of range")
        return lut[ids]
    if len(c.src_buffers) != n:
        raise TableError(f"step '{c.step}' flow {c.flow_index}: {len(c.src_buffers)} source buffers for {n} rows")
    uniq = {b: buf_id(b, "source") for b in set(c.src_buffers)}
    return np.fromiter((uniq[b] for b in c.src_buffers), dtype=np.int64, count=n)


def combine_rows(layout, name: str, rank: int) -> int:
    """Rows of a combine buffer on `rank` (`result` mirrors `input`: the rank's tokens)."""
    if name == "result":
        return int(layout.tokens)
    rows = getattr(layout, "combine_rows", None)
    if rows is not None:
        return int(rows(name, rank))
    return int(layout.buffer_rows(getattr(layout, "partial_of", {}).get(name, name), rank))


def buffer_sizes(manifest: dict, layout, program: str, rank: int) -> list[int]:
    """Bytes of every buffer of `program` on `rank` (manifest order, = buffer ids): what the host
    allocates (and maps on the peers) before uploading the tables.  Dispatch rows are wire rows
    (`layout.row_bytes`); combine `output` holds bf16 expert outputs, every other combine buffer
    fp32 partials of `hidden` channels (`result`: one row per token)."""
    out = []
    for b in manifest["buffers"][program]:
        name = b["name"]
        if program == "dispatch":
            rows = layout.tokens if name == "input" else layout.buffer_rows(name, rank)
            out.append(int(rows) * int(layout.row_bytes))
        elif name == "output":
            out.append(layout.buffer_rows("output", rank) * 2 * int(layout.hidden))
        else:
            out.append(combine_rows(layout, name, rank) * 4 * int(layout.hidden))
    return out


def build_tables(manifest: dict, layout, program: str, rank: int) -> Tables:
    """The blob rank `rank` uploads for `program`, from the global `layout`.

    `manifest` is the CUDA launch manifest (cuda/manifest.json, or `CudaBundle.manifest`): its
    kernel for `program` gives the roles (step names, in kernel order) and which of them run on
    the GPU; its `buffers[program]` the buffer ids."""
    if program not in PROGRAMS:
        raise TableError(f"program must be one of {PROGRAMS}, not {program!r}")
    kernel = next((k for k in manifest["kernels"] if k["program"] == program and k["kind"] == "main"), None)
    if kernel is None:
        raise TableError(f"the manifest has no {program} kernel")
    if layout.num_ranks != manifest["num_ranks"]:
        raise TableError(f"the layout has {layout.num_ranks} ranks, the kernels were compiled for "
                         f"{manifest['num_ranks']}")
    if not 0 <= rank < layout.num_ranks:
        raise TableError(f"rank {rank} is not in [0, {layout.num_ranks})")
    buffers = {b["name"]: i for i, b in enumerate(manifest["buffers"][program])}
    flags = {f.flag_id: f for f in layout.flags}
    if sorted(flags) != list(range(len(layout.flags))):
        raise TableError("Layout.flags must be numbered 0..n-1 by flag_id")

    def buf_id(name: str, what: str) -> int:
        if name not in buffers:
            raise TableError(f"{program} {what} buffer '{name}' is not one the kernels were compiled for "
                             f"({', '.join(buffers)})")
        return buffers[name]

    by_step: dict[str, list] = {}
    # GPU proxy path: the copies this rank sends (its pack roles: the rows are here, whichever
    # rank the layout lets execute the copy; combine pulls) and receives (its unpack roles)
    sending: dict[str, list] = {}
    landing: dict[str, list] = {}
    for c in layout.copies:
        if c.program == program and c.rank == rank:
            by_step.setdefault(c.step, []).append(c)
        if c.program == program and c.src == rank:
            sending.setdefault(c.step, []).append(c)
        if c.program == program and c.dst == rank:
            landing.setdefault(c.step, []).append(c)
    gpu_steps = {r["step"] for r in kernel["roles"]}
    host_steps = {s["step"] for s in manifest.get("not_lowered", []) if s["program"] == program}
    for step in by_step:
        if step not in gpu_steps and step not in host_steps:
            raise TableError(f"the layout has {program} copies of step '{step}', which the kernels do not know")

    roles, copies, items, waits, rows = [], [], [], [], []
    row_off = 0  # bytes into the rows section

    def add_rows(arr: np.ndarray) -> int:
        nonlocal row_off
        off = row_off
        rows.append(arr.tobytes())
        pad = _align(arr.nbytes) - arr.nbytes
        if pad:
            rows.append(b"\0" * pad)
        row_off += arr.nbytes + pad
        return off

    for role in kernel["roles"]:
        # GPU proxy path: the sender's pack role has the copies it executes but bumps no counter
        # (the receiver's unpack role does, once the chunk landed); the unpack role has the copies
        # whose rows land here and waits for each chunk's landing signal, not the producers.
        side = role.get("lowered")
        group = {"rdma-pack": sending, "rdma-unpack": landing}.get(side, by_step)
        role_copies = sorted(group.get(role["step"], []),
                             key=lambda c: (c.flow_index, c.src, c.dst))
        first_copy = len(copies)
        nchunks = []
        for c in role_copies:
            n = int(len(c.src_slots))
            if len(c.dst_slots) != n:
                raise TableError(f"{program} step '{c.step}' flow {c.flow_index}: src/dst row counts differ")
            starts = np.asarray(c.chunk_starts, dtype=np.int64)
            if len(starts) < 1 or starts[0] != 0 or starts[-1] != n or np.any(np.diff(starts) < 0):
                raise TableError(f"{program} step '{c.step}' flow {c.flow_index}: chunk_starts {starts.tolist()} "
                                 f"do not cover its {n} rows")
            if len(c.waits) != len(starts) - 1:
                raise TableError(f"{program} step '{c.step}' flow {c.flow_index}: {len(c.waits)} wait lists "
                                 f"for {len(starts) - 1} chunks")
            if c.flag_id != -1 and c.flag_id not in flags:
                raise TableError(f"{program} step '{c.step}' flow {c.flow_index}: unknown flag {c.flag_id}")
            src_ids = _source_ids(c, role, n, buf_id)
            handles = (src_ids << ROW_BUF_SHIFT) | np.asarray(c.src_slots, dtype=np.int64)
            src_off = add_rows(handles.astype("<i8"))
            dst_off = add_rows(np.asarray(c.dst_slots, dtype="<i8"))
            w_off = -1
            if role["op"] == "accum_weighted":
                if c.weights is None:
                    raise TableError(f"combine step '{c.step}' is weighted but flow {c.flow_index} has no weights")
                w_off = add_rows(np.asarray(c.weights, dtype="<f4"))
            no_flag = c.flag_id == -1 or side == "rdma-pack"
            copies.append(dict(src_rows=src_off, dst_rows=dst_off, weights=w_off, n_rows=n, src_rank=c.src,
                               dst_rank=c.dst, dst_buf=buf_id(c.dst_buffer, "destination"),
                               flag_id=NO_FLAG if no_flag else c.flag_id,
                               flag_rank=0 if no_flag else flags[c.flag_id].rank, step_index=c.step_index,
                               flow_index=c.flow_index, _starts=starts,
                               _waits=[[] for _ in range(len(starts) - 1)] if side == "rdma-unpack" else c.waits,
                               _weighted=w_off >= 0))
            if w_off < 0:
                copies[-1]["weights"] = 0
            nchunks.append(len(starts) - 1)
        item_begin = len(items)
        for ci, ch in item_order(nchunks):
            cd = copies[first_copy + ci]
            w0 = len(waits)
            for fid, value in cd["_waits"][ch]:
                if fid not in flags:
                    raise TableError(f"{program} step '{role['step']}': chunk {ch} waits for unknown flag {fid}")
                waits.append((flags[fid].rank, fid, int(value)))
            items.append((first_copy + ci, ch, int(cd["_starts"][ch]), int(cd["_starts"][ch + 1]), w0,
                          len(waits) - w0))
        roles.append((item_begin, len(items) - item_begin, step_crc(role["step"]), len(role_copies)))

    drain = [(f.flag_id, 0, f.chunks) for f in layout.flags
             if f.program == program and f.rank == rank and f.chunks > 0]
    hidden = int(layout.hidden)
    zero: list[tuple[str, int]] = []
    if program == "combine":
        for b in manifest["buffers"]["combine"]:
            if b["rows"] != "f32":
                continue
            nrows = combine_rows(layout, b["name"], rank)
            if nrows:
                zero.append((b["name"], int(nrows) * 4 * hidden))

    def role_weighted(cd: dict) -> bool:
        return cd["_weighted"]

    def table(name: str, recs: list) -> bytes:
        dt = dtype(name)
        arr = np.zeros(len(recs), dtype=dt)
        for i, r in enumerate(recs):
            if isinstance(r, dict):
                arr[i] = tuple(r[f] for f in dt.names)
            else:
                arr[i] = r
        return arr.tobytes()

    # Row offsets become absolute (bytes from the blob's start): 0 then always means "none".
    rows_at = _align(dtype("TableHeader").itemsize)
    for name, n in (("RoleDesc", len(roles)), ("CopyDesc", len(copies)), ("ItemDesc", len(items)),
                    ("WaitDesc", len(waits)), ("DrainDesc", len(drain)), ("ZeroDesc", len(zero))):
        rows_at = _align(rows_at + n * dtype(name).itemsize)
    for cd in copies:
        cd["src_rows"] += rows_at
        cd["dst_rows"] += rows_at
        if role_weighted(cd):
            cd["weights"] += rows_at
    sections = [
        ("roles", table("RoleDesc", roles)),
        ("copies", table("CopyDesc", copies)),
        ("items", table("ItemDesc", items)),
        ("waits", table("WaitDesc", waits)),
        ("drain", table("DrainDesc", drain)),
        ("zero", table("ZeroDesc", [(buffers[n], 0, b) for n, b in zero])),
        ("rows", b"".join(rows)),
    ]
    hdr_dt = dtype("TableHeader")
    off = _align(hdr_dt.itemsize)
    offsets = {}
    for name, data in sections:
        offsets[name] = off
        off = _align(off + len(data))
    total = off
    assert offsets["rows"] == rows_at, (offsets, rows_at)
    hdr = np.zeros(1, dtype=hdr_dt)
    fields = dict(magic=TABLE_MAGIC, version=TABLE_VERSION, program=PROGRAMS.index(program), rank=rank,
                  num_ranks=layout.num_ranks, num_roles=len(roles), num_copies=len(copies), num_items=len(items),
                  num_waits=len(waits), num_drain=len(drain), num_flags=len(layout.flags), num_zero=len(zero),
                  hidden=hidden, row_bytes=int(layout.row_bytes), num_buffers=len(buffers),
                  tokens=layout.rank_tokens(rank) if hasattr(layout, "rank_tokens") else int(layout.tokens),
                  total_bytes=total)
    fields.update({f"off_{n}": o for n, o in offsets.items()})
    hdr[0] = tuple(fields[f] for f in hdr_dt.names)
    blob = np.zeros(total, dtype=np.uint8)
    blob[: hdr_dt.itemsize] = np.frombuffer(hdr.tobytes(), dtype=np.uint8)
    for name, data in sections:
        blob[offsets[name]: offsets[name] + len(data)] = np.frombuffer(data, dtype=np.uint8)
    return Tables(program, rank, blob, len(layout.flags), zero)


def parse_tables(blob: np.ndarray) -> dict:
    """Decode a blob into NumPy record arrays (tests, debugging): the inverse of build_tables."""
    b = np.ascontiguousarray(blob, dtype=np.uint8)
    hdr = np.frombuffer(b[: dtype("TableHeader").itemsize].tobytes(), dtype=dtype("TableHeader"))[0]
    if int(hdr["magic"]) != TABLE_MAGIC or int(hdr["version"]) != TABLE_VERSION:
        raise TableError(f"not an epcc table blob of version {TABLE_VERSION}")

    def sec(name: str, count: str, off: str) -> np.ndarray:
        dt = dtype(name)
        o, n = int(hdr[off]), int(hdr[count])
        return np.frombuffer(b[o: o + n * dt.itemsize].tobytes(), dtype=dt)

    return {
        "header": hdr,
        "roles": sec("RoleDesc", "num_roles", "off_roles"),
        "copies": sec("CopyDesc", "num_copies", "off_copies"),
        "items": sec("ItemDesc", "num_items", "off_items"),
        "waits": sec("WaitDesc", "num_waits", "off_waits"),
        "drain": sec("DrainDesc", "num_drain", "off_drain"),
        "zero": sec("ZeroDesc", "num_zero", "off_zero"),
        "blob": b,
    }


def copy_rows(parsed: dict, copy_index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """(source buffer ids, source slots, destination slots, weights) of one decoded copy."""
    c = parsed["copies"][copy_index]
    blob = parsed["blob"]
    n = int(c["n_rows"])

    def arr(off, dt, size):
        o = int(off)
        return np.frombuffer(blob[o: o + n * size].tobytes(), dtype=dt)

    h = arr(c["src_rows"], "<i8", 8)
    w = arr(c["weights"], "<f4", 4) if int(c["weights"]) else None
    return h >> ROW_BUF_SHIFT, h & ((1 << ROW_BUF_SHIFT) - 1), arr(c["dst_rows"], "<i8", 8), w
