"""The device descriptor tables of the table-driven CUDA kernels: their binary layout.

One blob per (program, rank, layout): a TableHeader, then RoleDesc, CopyDesc, ItemDesc, WaitDesc,
DrainDesc and ZeroDesc arrays and the row arrays, little-endian, every section on a 16-byte
boundary, offsets in bytes from the blob's start (relocatable: no pointer fix-ups).  The code
generator writes the C declarations of STRUCTS into the device header (codegen.py, with a
`static_assert` per offset); the runtime builds blobs of the same dtypes from a layout
(runtime/engines/cuda_table/tables.py describes the blob's contents), so the two sides cannot drift.
"""

from __future__ import annotations

import zlib

import numpy as np

TABLE_MAGIC = 0x54435045  # "EPCT", little-endian
TABLE_VERSION = 1
ROW_BUF_SHIFT = 40  # source handle: (buffer id << 40) | slot
ALIGN = 16
NO_FLAG = 0xFFFFFFFF
PROGRAMS = ("dispatch", "combine")


# name -> [(field, numpy type code, comment)]; all fields naturally aligned, no implicit padding.
STRUCTS: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "TableHeader": ("at offset 0 of every table blob", [
        ("magic", "u4", "EPCC_TABLE_MAGIC"),
        ("version", "u4", "EPCC_TABLE_VERSION"),
        ("program", "u4", "0 dispatch, 1 combine"),
        ("rank", "u4", "the rank that executes these tables"),
        ("num_ranks", "u4", ""),
        ("num_roles", "u4", "roles of the program's kernel"),
        ("num_copies", "u4", ""),
        ("num_items", "u4", ""),
        ("num_waits", "u4", ""),
        ("num_drain", "u4", ""),
        ("num_flags", "u4", "counters of the layout (this rank clears words 1..num_flags)"),
        ("num_zero", "u4", ""),
        ("hidden", "u4", "channels per token"),
        ("row_bytes", "u4", "dispatch wire row (bf16: 2*hidden; fp8: hidden + hidden/128*4)"),
        ("num_buffers", "u4", "buffers of the program (manifest order)"),
        ("tokens", "u4", "tokens per rank (rows of `result`)"),
        ("off_roles", "u8", "RoleDesc[num_roles]"),
        ("off_copies", "u8", "CopyDesc[num_copies]"),
        ("off_items", "u8", "ItemDesc[num_items]"),
        ("off_waits", "u8", "WaitDesc[num_waits]"),
        ("off_drain", "u8", "DrainDesc[num_drain]"),
        ("off_zero", "u8", "ZeroDesc[num_zero]"),
        ("off_rows", "u8", "row arrays of the copies"),
        ("total_bytes", "u8", "size of the blob"),
    ]),
    "RoleDesc": ("one role (step) of the kernel", [
        ("item_begin", "u4", "its items: items[item_begin, item_begin + item_count)"),
        ("item_count", "u4", ""),
        ("step_crc", "u4", "crc32 of the step name (checked against the compiled kernel)"),
        ("num_copies", "u4", "copies of this role on this rank"),
    ]),
    "CopyDesc": ("one Copy of the layout: rows of one flow of one step", [
        ("src_rows", "u8", "int64[n_rows]: (source buffer id << 40) | slot"),
        ("dst_rows", "u8", "int64[n_rows]: slot in the destination buffer"),
        ("weights", "u8", "float32[n_rows] routing weights; 0: not weighted"),
        ("n_rows", "u4", ""),
        ("src_rank", "u4", "rank whose buffers the rows are read from"),
        ("dst_rank", "u4", "rank whose buffer the rows are written into"),
        ("dst_buf", "u4", "destination buffer id"),
        ("flag_id", "u4", "counter bumped by one after each chunk"),
        ("flag_rank", "u4", "rank holding that counter"),
        ("step_index", "u4", "position of the step in its program"),
        ("flow_index", "u4", "position of the flow in PlanStep.flows"),
    ]),
    "ItemDesc": ("one chunk of one copy: the unit a block processes", [
        ("copy", "u4", "index into CopyDesc[]"),
        ("chunk", "u4", "chunk index within the copy"),
        ("row_begin", "u4", "rows [row_begin, row_end) of the copy"),
        ("row_end", "u4", ""),
        ("wait_begin", "u4", "waits[wait_begin, wait_begin + wait_count) first"),
        ("wait_count", "u4", ""),
    ]),
    "WaitDesc": ("a producer counter a chunk needs: flag (flag_rank, flag_id) >= value", [
        ("flag_rank", "u4", ""),
        ("flag_id", "u4", ""),
        ("value", "u8", ""),
    ]),
    "DrainDesc": ("a counter on this rank and the value it reaches when the program is done", [
        ("flag_id", "u4", ""),
        ("reserved", "u4", ""),
        ("value", "u8", ""),
    ]),
    "ZeroDesc": ("combine: a partial buffer of this rank to clear before the launch", [
        ("buf", "u4", "buffer id"),
        ("reserved", "u4", ""),
        ("bytes", "u8", "bytes from the start of the buffer"),
    ]),
}

CTYPES = {"u4": "uint32_t", "u8": "uint64_t", "i4": "int32_t", "i8": "int64_t", "f4": "float"}


def dtype(name: str) -> np.dtype:
    """The NumPy structured dtype of one descriptor (little-endian, C layout)."""
    return np.dtype([(f, "<" + t) for f, t, _ in STRUCTS[name][1]], align=True)


def struct_layout(name: str) -> list[tuple[str, str, int, str]]:
    """[(field, C type, byte offset, comment)] of a descriptor, for the C declarations."""
    dt = dtype(name)
    return [(f, CTYPES[t], dt.fields[f][1], c) for f, t, c in STRUCTS[name][1]]


def step_crc(step: str) -> int:
    return zlib.crc32(step.encode("utf-8")) & 0xFFFFFFFF
