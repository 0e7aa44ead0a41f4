"""A NumPy emulator of the table-driven CUDA kernels, driven by the same table blobs the GPU reads.

It walks the blobs exactly as the device code does (backends/cuda/templates/device.cu.j2, `run_role`): every
block of every role of every rank is a coroutine taking its role's items round-robin
(`item = block, block + blocks, ...`; a SUPA DMA-engine role, the launcher's copy lane, is one
block taking them in order); before an item it needs every wait satisfied, then it
applies the row operation to the item's rows and, once the copy's earlier chunks are
published, bumps the copy's counter by one.  Blocks are
interleaved one item at a time; a full sweep without progress is a deadlock.  At the end every
drain entry must hold.  What it checks: the tables (encoding, item order, waits, the split of
items over blocks) implement the layout; it cannot check the CUDA code itself (timing, memory
ordering, vector widths), which needs a GPU.  Steps the kernels leave to a host proxy
(rdma="external") run as proxy stand-ins: the layout's copy, chunk by chunk, with its waits.
"""

from __future__ import annotations

import numpy as np

from epcc.backends.cuda.abi import NO_FLAG, PROGRAMS, ROW_BUF_SHIFT

from ..bf16 import bf16_to_f32, f32_to_bf16
from ..engines.cuda_table.tables import build_tables, combine_rows, copy_rows, parse_tables


class EmulationError(AssertionError):
    """The tables deadlock, or leave a counter short of its drain value."""


def make_buffers(manifest: dict, layout, program: str, inputs: list[np.ndarray]) -> dict[tuple[str, int], np.ndarray]:
    """Every rank's buffers of `program`, as the host would allocate them: dispatch uint8
    [rows, row_bytes] (`input` filled from inputs[r]), combine `output` bf16 bits (uint16) from
    inputs[r], every other combine buffer fp32 zeros."""
    bufs = {}
    R, hidden = layout.num_ranks, layout.hidden
    for b in manifest["buffers"][program]:
        name = b["name"]
        for r in range(R):
            if program == "dispatch":
                rows = layout.tokens if name == "input" else layout.buffer_rows(name, r)
                a = np.zeros((rows, layout.row_bytes), dtype=np.uint8)
                if name == "input":
                    a[:] = inputs[r]
            elif name == "output":
                a = np.array(inputs[r], dtype=np.uint16).reshape(-1, hidden)
            else:
                a = np.zeros((combine_rows(layout, name, r), hidden), dtype=np.float32)
            bufs[(name, r)] = a
    return bufs


def emulate(manifest: dict, layout, program: str, inputs: list[np.ndarray],
            blobs: list[np.ndarray] | None = None) -> dict[tuple[str, int], np.ndarray]:
    """Run `program` of every rank over its tables; returns every (buffer, rank) array.

    inputs[r]: dispatch, the rows of `input` (uint8 [T, row_bytes]); combine, the expert
    outputs (bf16 bits, uint16 [rows of output, hidden])."""
    R = layout.num_ranks
    kernel = next(k for k in manifest["kernels"] if k["program"] == program and k["kind"] == "main")
    names = [b["name"] for b in manifest["buffers"][program]]
    bufs = make_buffers(manifest, layout, program, inputs)
    if blobs is None:
        blobs = [build_tables(manifest, layout, program, r).blob for r in range(R)]
    parsed = [parse_tables(b) for b in blobs]
    counters = np.zeros((R, max(len(layout.flags), 1)), dtype=np.int64)
    ops = [r["op"] for r in kernel["roles"]]
    sides = [r.get("lowered") for r in kernel["roles"]]
    packed: set[tuple[int, int, int, int, int]] = set()  # GPU proxy path: chunks pushed to the proxy

    def block_run(rank: int, role: int, block: int, blocks: int):
        t = parsed[rank]
        rd = t["roles"][role]
        cache = {}
        for k in range(block, int(rd["item_count"]), blocks):
            it = t["items"][int(rd["item_begin"]) + k]
            w0, nw = int(it["wait_begin"]), int(it["wait_count"])
            waits = t["waits"][w0: w0 + nw]
            while any(counters[int(w["flag_rank"]), int(w["flag_id"])] < int(w["value"]) for w in waits):
                yield False
            ci = int(it["copy"])
            if ci not in cache:
                cache[ci] = copy_rows(t, ci)
            sbuf, sslot, dslot, wts = cache[ci]
            c = t["copies"][ci]
            key = (int(c["src_rank"]), int(c["dst_rank"]), int(c["step_index"]), int(c["flow_index"]), int(it["chunk"]))
            if sides[role] == "rdma-pack":  # the proxy carries it; the receiver's unpack role applies it
                packed.add(key)
                yield True
                continue
            while sides[role] == "rdma-unpack" and key not in packed:  # its landing signal
                yield False
            lo, hi = int(it["row_begin"]), int(it["row_end"])
            dst = bufs[(names[int(c["dst_buf"])], int(c["dst_rank"]))]
            for b in np.unique(sbuf[lo:hi]):
                m = np.nonzero(sbuf[lo:hi] == b)[0] + lo
                src = bufs[(names[int(b)], int(c["src_rank"]))]
                if ops[role] == "copy":
                    dst[dslot[m]] = src[sslot[m]]
                elif ops[role] == "accum_bf16_wire":  # the partial crosses the NIC as bf16
                    np.add.at(dst, dslot[m], bf16_to_f32(f32_to_bf16(src[sslot[m]])))
                elif ops[role] == "accum_weighted":
                    np.add.at(dst, dslot[m], wts[m][:, None] * bf16_to_f32(src[sslot[m]]))
                else:
                    np.add.at(dst, dslot[m], src[sslot[m]])
            if int(c["flag_id"]) != NO_FLAG:
                fr, fid = int(c["flag_rank"]), int(c["flag_id"])
                while counters[fr, fid] < int(it["chunk"]):  # publish in chunk order
                    yield False
                counters[fr, fid] += 1
            yield True

    def proxy_run(c):
        """A stand-in for the host proxy that posts a step the kernels leave out (rdma="external"):
        the layout's copy, chunk by chunk in order, with the layout's waits."""
        flag_rank = {f.flag_id: f.rank for f in layout.flags}
        src_names = list(c.src_buffers)
        for ch in range(len(c.chunk_starts) - 1):
            while any(counters[flag_rank[f], f] < v for f, v in c.waits[ch]):
                yield False
            lo, hi = int(c.chunk_starts[ch]), int(c.chunk_starts[ch + 1])
            dst = bufs[(c.dst_buffer, c.dst)]
            for i in range(lo, hi):
                src = bufs[(src_names[i], c.src)]
                s, d = int(c.src_slots[i]), int(c.dst_slots[i])
                if program == "dispatch":
                    dst[d] = src[s]
                elif c.weights is not None:
                    dst[d] += c.weights[i] * bf16_to_f32(src[s])
                else:
                    dst[d] += src[s]
            if c.flag_id != -1:
                counters[flag_rank[c.flag_id], c.flag_id] += 1
            yield True

    live = []
    external = {n["step"] for n in manifest.get("not_lowered", []) if n["program"] == program and n["kind"] == "rdma"}
    for c in layout.copies:
        if c.program == program and c.step in external:
            live.append(((c.rank, c.step + " (proxy)", c.flow_index), proxy_run(c)))
    for rank in range(R):
        for i, role in enumerate(kernel["roles"]):
            # a DMA-engine role (SUPA) has no block: the launcher's lane takes its items in order, as one block
            n = 1 if role.get("lowered") == "dma-engine" else role["blocks"][1] - role["blocks"][0]
            for blk in range(n):
                live.append(((rank, role["step"], blk), block_run(rank, i, blk, n)))
    while live:
        progress, keep = False, []
        for key, g in live:
            try:
                progress |= next(g)
                keep.append((key, g))
            except StopIteration:
                progress = True
        live = keep
        if live and not progress:
            stuck = ", ".join(f"rank {r} step '{s}' block {b}" for (r, s, b), _ in live[:6])
            raise EmulationError(f"{program}: the tables deadlock ({len(live)} blocks waiting: {stuck})")
    for rank, t in enumerate(parsed):
        for d in t["drain"]:
            got = counters[rank, int(d["flag_id"])]
            if got != int(d["value"]):
                raise EmulationError(f"{program}: rank {rank} flag {int(d['flag_id'])} ends at {got}, "
                                     f"drain waits for {int(d['value'])}")
    return bufs


__all__ = ["EmulationError", "emulate", "make_buffers", "PROGRAMS", "ROW_BUF_SHIFT"]
