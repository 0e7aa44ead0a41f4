"""Placed table blobs (backends/cuda/placement.py) built on the host: from a layout computed by
runtime/layout (`build_placed`: what the metadata kernels must write, byte for byte), or from
any source of every copy's rows (`assemble`: runtime/testing/device_tables.py's NumPy version of
the kernels)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from epcc.backends.cuda.abi import (NO_FLAG, PROGRAMS, ROW_BUF_SHIFT, TABLE_MAGIC, TABLE_VERSION, dtype,
                                    step_crc)
from epcc.backends.cuda.placement import Placement, record_writer
from epcc.plan.model import item_order

from .tables import TableError, Tables, combine_rows


@dataclass
class CopyRows:
    """What a table needs of one copy: its rows, their chunks and each chunk's waits."""

    src: int
    dst: int
    step_index: int
    flow_index: int
    dst_buffer: str
    src_buffer_ids: np.ndarray  # per row: index into the role's src_buffers
    src_slots: np.ndarray
    dst_slots: np.ndarray
    weights: np.ndarray | None
    chunk_starts: np.ndarray
    waits: list  # per chunk: [(flag id, value)], ascending flag ids


def rows_from_layout(layout) -> dict[int, CopyRows]:
    """Every copy of a host layout (runtime/layout), by flag id."""
    return {c.flag_id: CopyRows(c.src, c.dst, c.step_index, c.flow_index, c.dst_buffer, c.src_buffer_ids,
                                c.src_slots, c.dst_slots, c.weights, c.chunk_starts, c.waits) for c in layout.copies}


def build_placed(manifest: dict, layout, pl: Placement) -> Tables:
    """The blob `pl` places, from a layout computed on the host: what the metadata kernels must
    write, byte for byte."""
    flag_rank = {f.flag_id: f.rank for f in layout.flags}
    chunks = {f.flag_id: f.chunks for f in layout.flags}
    zero_rows = {name: combine_rows(layout, name, pl.rank) for _, name in pl.zero}
    return assemble(manifest, pl, rows_from_layout(layout), flag_rank, chunks, zero_rows, layout.rank_tokens(pl.rank),
                    int(layout.hidden), int(layout.row_bytes), layout.num_ranks)


def assemble(manifest: dict, pl: Placement, rows: dict[int, CopyRows], flag_rank: dict[int, int],
             chunks: dict[int, int], zero_rows: dict[str, int], tokens: int, hidden: int, row_bytes: int,
             num_ranks: int) -> Tables:
    """The placed blob of `pl` from every copy's rows, the rank of every counter, every counter's
    final value, the rows of each fp32 combine buffer, and this rank's token count."""
    program, rank = pl.program, pl.rank
    buffers = {b["name"]: i for i, b in enumerate(manifest["buffers"][program])}
    blob = np.zeros(pl.total_bytes, dtype=np.uint8)

    put = record_writer(blob)

    def put_array(offset: int, arr: np.ndarray) -> None:
        raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        blob[offset: offset + raw.size] = raw

    kernel = next(k for k in manifest["kernels"] if k["program"] == program and k["kind"] == "main")
    for pr, role in zip(pl.roles, kernel["roles"]):
        nchunks = []
        for pc in pr.copies:
            c = rows[pc.copy]
            n = len(c.src_slots)
            if n > pc.rows_cap or len(c.chunk_starts) - 1 > pc.chunks_cap:
                raise TableError(f"{program} copy {pc.copy} (flow {c.flow_index}): {n} rows in "
                                 f"{len(c.chunk_starts) - 1} chunks exceed the placement's {pc.rows_cap} rows in "
                                 f"{pc.chunks_cap} chunks (more tokens than the bundle's?)")
            lut = np.asarray([buffers[b] for b in (role.get("src_buffers") or [])], dtype=np.int64)
            ids = lut[np.asarray(c.src_buffer_ids, dtype=np.int64)] if n else np.zeros(0, np.int64)
            put_array(pc.src_rows, ((ids << ROW_BUF_SHIFT) | np.asarray(c.src_slots, dtype=np.int64)).astype("<i8"))
            put_array(pc.dst_rows, np.asarray(c.dst_slots, dtype="<i8"))
            if pc.weighted:
                put_array(pc.weights, np.asarray(c.weights if c.weights is not None else np.zeros(n), dtype="<f4"))
            no_flag = pr.side == "rdma-pack"
            put(pl.offsets["copies"] + pc.index * dtype("CopyDesc").itemsize, "CopyDesc",
                (pc.src_rows, pc.dst_rows, pc.weights if pc.weighted else 0, n, c.src, c.dst,
                 buffers[c.dst_buffer], NO_FLAG if no_flag else pc.copy, 0 if no_flag else flag_rank[pc.copy],
                 c.step_index, c.flow_index))
            nchunks.append(len(c.chunk_starts) - 1)
        order = item_order(nchunks)
        for pos, (ci, ch) in enumerate(order):
            pc = pr.copies[ci]
            c = rows[pc.copy]
            ws = [] if pr.side == "rdma-unpack" else c.waits[ch]
            w0 = pr.wait_begin + pos * pr.wait_stride
            for k, (fid, value) in enumerate(ws):
                put(pl.offsets["waits"] + (w0 + k) * dtype("WaitDesc").itemsize, "WaitDesc",
                    (flag_rank[fid], fid, int(value)))
            put(pl.offsets["items"] + (pr.item_begin + pos) * dtype("ItemDesc").itemsize, "ItemDesc",
                (pc.index, ch, int(c.chunk_starts[ch]), int(c.chunk_starts[ch + 1]), w0, len(ws)))
        put(pl.offsets["roles"] + pl.roles.index(pr) * dtype("RoleDesc").itemsize, "RoleDesc",
            (pr.item_begin, len(order), step_crc(pr.step), len(pr.copies)))
    for i, fid in enumerate(pl.drain):
        put(pl.offsets["drain"] + i * dtype("DrainDesc").itemsize, "DrainDesc", (fid, 0, chunks[fid]))
    for i, (b, name) in enumerate(pl.zero):
        put(pl.offsets["zero"] + i * dtype("ZeroDesc").itemsize, "ZeroDesc", (b, 0, zero_rows[name] * 4 * hidden))
    hdr = dict(magic=TABLE_MAGIC, version=TABLE_VERSION, program=PROGRAMS.index(program), rank=rank,
               num_ranks=num_ranks, num_roles=len(pl.roles), num_copies=len(pl.copies), num_items=pl.num_items,
               num_waits=pl.num_waits, num_drain=len(pl.drain), num_flags=pl.num_flags, num_zero=len(pl.zero),
               hidden=hidden, row_bytes=row_bytes, num_buffers=pl.num_buffers, tokens=tokens,
               total_bytes=pl.total_bytes)
    hdr.update({f"off_{n}": o for n, o in pl.offsets.items()})
    dt = dtype("TableHeader")
    put(0, "TableHeader", tuple(hdr[f] for f in dt.names))
    return Tables(program, rank, blob, pl.num_flags, [(n, zero_rows[n] * 4 * hidden) for _, n in pl.zero])




def placed_differences(want: np.ndarray, got: np.ndarray, pl: Placement) -> np.ndarray:
    """The bytes where a placed blob the GPU wrote (`got`) differs from the host's (`want`), over
    what the kernels read: everything before the row arrays, and each copy's first n_rows rows
    (want's CopyDesc) -- the room past them keeps what an earlier dispatch left there, since the
    metadata kernels restore only the blob's static fields before they write its rows."""
    if want.shape != got.shape:
        raise ValueError(f"blobs of {want.size} and {got.size} bytes")
    read = np.zeros(want.size, dtype=bool)
    read[:pl.offsets["rows"]] = True
    cd = dtype("CopyDesc")
    for pc in pl.copies:
        at = pl.offsets["copies"] + pc.index * cd.itemsize
        n = int(want[at: at + cd.itemsize].view(cd)[0]["n_rows"])
        read[pc.src_rows: pc.src_rows + 8 * n] = True
        read[pc.dst_rows: pc.dst_rows + 8 * n] = True
        if pc.weights:
            read[pc.weights: pc.weights + 4 * n] = True
    return np.flatnonzero(read & (want != got))
