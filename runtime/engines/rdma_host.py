"""Run a plan's RDMA steps through the emitted proxy loop and a real transport (CPU path).

One `RdmaEngine` per process (rank) and program.  The host decides everything here, from the
layout: the channels (one per (step, src, dst)), each chunk's sequence number on its channel
(the producer's chunk-major order over the role's copies), the send slots and landing rings
(depth x the channel's largest chunk), the credit words; it registers them with the transport,
all-gathers addresses and keys through `exchange` (a bounded round of the ranks' agreement,
agree.py, in cpu_procs.py), and runs the loop's threads: one producer per sending role, one proxy, one receiver (each a ctypes
call into the emitted library, which releases the GIL).

Data path of an RDMA copy: the sender packs the chunk's source rows into a send slot, the proxy
writes the slot into the receiver's landing slot with an immediate (channel, sequence number),
the receiver applies the landed rows to their destination rows (copy or accumulate), bumps the
copy's flag, and writes its consumed count back into the sender's credit word.  Nothing of an
RDMA copy moves through shared memory.

The library: the plan's emitted loop (backends/rdma/emit.py) with a transport compiled by cc
(libfabric, ibverbs), through the build cache (build_proxy); a transport alone, for probing
(build_transport).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from epcc.backends.rdma.abi import ENGINE, RECV_CHAN, SEND_CHAN, SEND_COPY, SEND_ROLE
from epcc.backends.rdma.emit import proxy_file_name, proxy_source
from epcc.backends.rdma.sources import NATIVE_DIR
from epcc.plan import Plan
from epcc.plan.rdma import WIRE_SHIFT, rdma_steps

from ..build_cache import CFLAGS, BuildError, c_compiler, cached, compiler_version, key, run, sources
from ..layout import Copy, Layout
from .transport import (ERRLEN, STATUS_OK, STATUS_TIMEOUT, TP_LOCAL, TP_REMOTE_WRITE, Transport, c_string,
                        u64_table)

SEQ_BITS = 20  # bits of the 32-bit immediate for a chunk's sequence number on its channel (the rest: the channel)

#: transport -> (sources, macro, link flags), compiled by cc
TRANSPORTS = {
    "libfabric": (("transport_libfabric.c",), "EPCC_TP_HAVE_LIBFABRIC", ("-lfabric",)),
    "ibverbs": (("transport_ibverbs.c",), "EPCC_TP_HAVE_IBVERBS", ("-libverbs",)),
}


def transport_sources(transport: str) -> tuple[list[Path], str, list[str]]:
    if transport not in TRANSPORTS:
        raise BuildError(f"transport '{transport}' is not one of {', '.join(sorted(TRANSPORTS))} (compiled by cc; "
                         f"'emulated' and 'nvshmem' are CUDA sources, built with nvcc)")
    srcs, macro, libs = TRANSPORTS[transport]
    return [NATIVE_DIR / s for s in srcs], macro, list(libs)


def compile_command(srcs: list[Path], out: Path, transport: str) -> list[str]:
    """cc's command for a library of `srcs` (emitted loops) with the transport and the proxy runtime."""
    tsrcs, macro, libs = transport_sources(transport)
    return [c_compiler(), *CFLAGS, f"-D{macro}", f"-I{NATIVE_DIR}", "-shared", "-o", str(out), *map(str, srcs),
            str(NATIVE_DIR / "epcc_transport.c"), str(NATIVE_DIR / "epcc_proxy_prim.c"), *map(str, tsrcs), *libs]


def _cc_key(transport: str, *extra: str | bytes) -> str:
    cc = c_compiler()
    return key(*extra, *sources(NATIVE_DIR, (".c", ".h")), transport, " ".join(CFLAGS), compiler_version(cc))


def build_proxy(plan: Plan, transport: str = "libfabric") -> Path:
    """The shared library of `plan`'s proxy loop linked with `transport`, emitted here from the
    plan (backends/rdma/emit.py) and compiled through the build cache."""
    text = proxy_source(plan)
    if not text:
        raise BuildError(f"schedule '{plan.schedule}' has no RDMA step: there is no proxy loop to build")
    transport_sources(transport)

    def build(out: Path, work: Path) -> None:
        src = work / proxy_file_name(plan)
        src.write_text(text, encoding="utf-8")
        run(compile_command([src], out, transport), "compiling the proxy library")

    return cached("rdma", _cc_key(transport, text), f"libepcc_proxy_{transport}.so", build)


def build_transport(transport: str) -> Path:
    """A library of the transport alone (epcc_transport.h's functions), for probing."""
    transport_sources(transport)
    return cached("rdma", _cc_key(transport, "transport only"), f"libepcc_transport_{transport}.so",
                  lambda out, work: run(compile_command([], out, transport), "compiling the transport library"))


@dataclass
class _Chan:
    key: tuple[int, int, int]  # (step index, src, dst)
    step: int
    src: int
    dst: int
    depth: int
    chunks: list[tuple[Copy, int]]  # in sequence order
    slot_bytes: int = 0


def _src_row_bytes(layout: Layout, program: str, op: str) -> int:
    """Bytes of one source row: the dispatch wire row, a bf16 expert output, an fp32 partial."""
    if program == "dispatch":
        return layout.row_bytes
    return 2 * layout.hidden if op == "acc_bf16" else 4 * layout.hidden


def _wire_row_bytes(layout: Layout, program: str, op: str) -> int:
    """Bytes of one row on the wire (send and landing slots): partials travel as bf16."""
    return _src_row_bytes(layout, program, op) >> WIRE_SHIFT[op]


def channels(plan, layout: Layout, program: str):
    """(steps of this program by name, role copies by (step, src) in layout order, channels by key,
    chunk sequence numbers by (id(copy), chunk)): the same on every rank."""
    steps = {s.step: s for s in rdma_steps(plan) if s.program == program}
    roles: dict[tuple[str, int], list[Copy]] = {}
    for c in layout.program_copies(program):
        # a copy with no rows (no token of this routing takes that pair) has no chunk: no channel
        # carries it, and a role or channel for it would wait for chunks that never come
        if c.step in steps and len(c.chunk_starts) > 1:
            roles.setdefault((c.step, c.src), []).append(c)
    chans: dict[tuple[int, int, int], _Chan] = {}
    seq: dict[tuple[int, int], int] = {}
    for (step, _src), copies in roles.items():
        s = steps[step]
        wrb = _wire_row_bytes(layout, program, s.op)
        nch = [len(c.chunk_starts) - 1 for c in copies]
        for r in range(max(nch)):
            for c, n in zip(copies, nch):
                if r >= n:
                    continue
                key = (s.index, c.src, c.dst)
                ch = chans.get(key)
                if ch is None:
                    ch = chans[key] = _Chan(key, s.index, c.src, c.dst, s.depth, [])
                seq[(id(c), r)] = len(ch.chunks)
                ch.chunks.append((c, r))
                ch.slot_bytes = max(ch.slot_bytes, int(c.chunk_starts[r + 1] - c.chunk_starts[r]) * wrb, 1)
    if len(chans) >= (1 << (32 - SEQ_BITS)) or any(len(ch.chunks) >= (1 << SEQ_BITS) for ch in chans.values()):
        raise ValueError(f"{program}: {len(chans)} RDMA channels or a channel of >= 2^{SEQ_BITS} chunks: more than the "
                         f"32-bit immediate carries")
    return steps, roles, dict(sorted(chans.items())), seq


class RdmaEngine:
    """The proxy loop of one rank for one program, over `transport`."""

    def __init__(self, lib: ctypes.CDLL, transport: Transport, plan, layout: Layout, program: str, mem, rank: int,
                 exchange, *, timeout_s: float, abort: np.ndarray, flag_address, rank_desc: str):
        self.lib, self.tp, self.rank, self.program = lib, transport, rank, program
        self.timeout_ns = int(timeout_s * 1e9)
        self.keep: list = []
        self.steps, roles, chans, seq = channels(plan, layout, program)
        self.step_names = set(self.steps)
        step_by_index = {s.index: s for s in self.steps.values()}
        flag_names = {f.flag_id: f.name() for f in layout.flags}

        def arr(a, dtype):
            a = np.ascontiguousarray(np.asarray(a, dtype=dtype))
            if a.size == 0:
                a = np.zeros(1, dtype=dtype)
            self.keep.append(a)
            return a

        def cstr(text: str) -> int:
            return c_string(self.keep, text)

        def table(t, rows: list[dict]) -> np.ndarray:
            return u64_table(self.keep, t, rows)

        chan_name = {k: f"{program}.{step_by_index[k[0]].step}[{k[1]}->{k[2]}]"
                     for k in chans}
        recv = [ch for ch in chans.values() if ch.dst == rank]
        send = [ch for ch in chans.values() if ch.src == rank]
        # Receive side: landing rings and what each landed chunk does.
        recv_rows, self.landing = [], []
        credit_src = arr(np.zeros(len(recv)), np.uint64)
        csrc_mr, _, _ = transport.reg(credit_src, TP_LOCAL)
        published_recv = {}
        for i, ch in enumerate(recv):
            s = step_by_index[ch.step]
            landing = arr(np.zeros(ch.depth * ch.slot_bytes), np.uint8)
            mr, raddr, rkey = transport.reg(landing, TP_REMOTE_WRITE)
            published_recv[ch.key] = (raddr, rkey, ch.slot_bytes, ch.depth, i)
            starts, dst_rows, weights, flags = [0], [], [], []
            for c, r in ch.chunks:
                lo, hi = int(c.chunk_starts[r]), int(c.chunk_starts[r + 1])
                dst = mem.buffer(program, c.dst_buffer, c.dst)
                slots = np.asarray(c.dst_slots[lo:hi], dtype=np.uint64)
                dst_rows.append(np.uint64(dst.ctypes.data) + slots * np.uint64(dst.strides[0]))
                if s.op == "acc_bf16":
                    weights.append(np.asarray(c.weights[lo:hi], dtype=np.float32))
                flags.append(flag_address(int(c.flag_id), f"{program} step '{c.step}'"))
                starts.append(starts[-1] + hi - lo)
            w = arr(np.concatenate(weights), np.float32) if weights else None
            recv_rows.append(dict(
                peer=ch.src, step=ch.step, n_chunks=len(ch.chunks), landing=landing.ctypes.data,
                slot_bytes=ch.slot_bytes, depth=ch.depth,
                row_len=layout.row_bytes if program == "dispatch" else layout.hidden,
                src_row_bytes=_wire_row_bytes(layout, program, s.op), chunk_rows=arr(starts, np.int64).ctypes.data,
                dst_rows=arr(np.concatenate(dst_rows) if dst_rows else [], np.uint64).ctypes.data,
                weights=0 if w is None else w.ctypes.data, chunk_flags=arr(flags, np.uint64).ctypes.data,
                credit_raddr=0, credit_rkey=0, credit_src=credit_src.ctypes.data + 8 * i, credit_mr=csrc_mr,
                name=cstr(chan_name[ch.key] + ".landed")))
        # Send side: credit words the receivers write.
        credits = arr(np.zeros(len(send)), np.uint64)
        _, credit_raddr, credit_rkey = transport.reg(credits, TP_REMOTE_WRITE)
        published_send = {ch.key: (credit_raddr + 8 * i, credit_rkey) for i, ch in enumerate(send)}
        # Exchange addresses and keys (torch.distributed all-gather), then connect.
        mine = {"addr": transport.address(), "recv": published_recv, "send": published_send}
        everyone = exchange(mine)
        transport.connect([e["addr"] for e in everyone])
        for i, ch in enumerate(recv):
            raddr, rkey = everyone[ch.src]["send"][ch.key]
            recv_rows[i]["credit_raddr"], recv_rows[i]["credit_rkey"] = raddr, rkey
        send_index = {ch.key: i for i, ch in enumerate(send)}
        send_rows = []
        for i, ch in enumerate(send):
            raddr, rkey, slot_bytes, depth, imm_chan = everyone[ch.dst]["recv"][ch.key]
            send_rows.append(dict(peer=ch.dst, remote_addr=raddr, remote_key=rkey, slot_bytes=slot_bytes, depth=depth,
                                  n_chunks=len(ch.chunks), imm_chan=imm_chan, credit=credits.ctypes.data + 8 * i,
                                  credit_name=cstr(chan_name[ch.key] + ".credit")))
        # Sending roles: the producer's copies, FIFO depth and send slots.
        role_rows = []
        self.n_sent_chunks = 0
        for (step, src), copies in roles.items():
            if src != rank:
                continue
            s = self.steps[step]
            srb = _src_row_bytes(layout, program, s.op)
            crow = []
            for c in copies:
                n = len(c.chunk_starts) - 1
                src_rows = np.zeros(max(len(c.src_slots), 1), dtype=np.uint64)
                names = np.asarray(c.src_buffers, dtype=object)
                for name in dict.fromkeys(c.src_buffers):
                    b = mem.buffer(program, name, c.src)
                    m = names == name
                    src_rows[: len(c.src_slots)][m] = np.uint64(b.ctypes.data) + \
                        np.asarray(c.src_slots, dtype=np.uint64)[m] * np.uint64(b.strides[0])
                waits = c.waits if c.waits else [[] for _ in range(n)]
                ws = np.cumsum([0] + [len(w) for w in waits])
                wf = [flag_address(int(f), f"{program} step '{c.step}'") for w in waits for f, _ in w]
                wv = [int(v) for w in waits for _, v in w]
                wn = [cstr(flag_names.get(int(f), f"flag {int(f)}")) for w in waits for f, _ in w]
                crow.append(dict(n_chunks=n, chunk_starts=arr(c.chunk_starts, np.int64).ctypes.data,
                                 src_rows=arr(src_rows, np.uint64).ctypes.data,
                                 wait_starts=arr(ws, np.int64).ctypes.data, wait_flags=arr(wf, np.uint64).ctypes.data,
                                 wait_values=arr(wv, np.int64).ctypes.data, wait_names=arr(wn, np.uint64).ctypes.data,
                                 chan=send_index[(s.index, c.src, c.dst)],
                                 chunk_seq=arr([seq[(id(c), r)] for r in range(n)], np.int64).ctypes.data))
                self.n_sent_chunks += n
            slot = max(chans[(s.index, c.src, c.dst)].slot_bytes for c in copies)
            send_buf = arr(np.zeros(s.depth * slot), np.uint8)
            mr, _, _ = transport.reg(send_buf, TP_LOCAL)
            role_rows.append(dict(step=s.index, n_copies=len(copies), copies=table(SEND_COPY, crow).ctypes.data,
                                  max_chunks=max(len(c.chunk_starts) - 1 for c in copies), depth=s.depth,
                                  slot_bytes=slot, src_row_bytes=srb, send_buf=send_buf.ctypes.data, mr=mr))
        self.n_roles = len(role_rows)
        self.n_recv_chunks = sum(len(ch.chunks) for ch in recv)
        self.err = ctypes.create_string_buffer(ERRLEN)
        self.stop = np.zeros(1, dtype=np.uint64)
        self.abort = abort
        self.engine = table(ENGINE, [dict(
            tp=transport.ptr.value, rank_desc=cstr(rank_desc), timeout_ns=self.timeout_ns, abort=abort.ctypes.data,
            stop=self.stop.ctypes.data, n_roles=len(role_rows), roles=table(SEND_ROLE, role_rows).ctypes.data,
            n_send_chans=len(send_rows), send_chans=table(SEND_CHAN, send_rows).ctypes.data,
            n_recv_chans=len(recv_rows), recv_chans=table(RECV_CHAN, recv_rows).ctypes.data,
            err=ctypes.addressof(self.err), errlen=ERRLEN, status=0, state=0)])
        if lib.epcc_rdma_engine_init(self.engine.ctypes.data) != 0:
            raise MemoryError("epcc rdma: the proxy engine's state could not be allocated")
        self.status: dict[str, int] = {}
        self._threads: dict[str, threading.Thread] = {}

    # -- threads --------------------------------------------------------------------------------
    def _run(self, name: str, fn, *args) -> None:
        self.status[name] = int(fn(self.engine.ctypes.data, *args))

    def start(self) -> None:
        specs = [("proxy", self.lib.epcc_rdma_proxy), ("receiver", self.lib.epcc_rdma_receive)]
        specs += [(f"producer{i}", self.lib.epcc_rdma_produce, i) for i in range(self.n_roles)]
        for name, fn, *a in specs:
            t = threading.Thread(target=self._run, args=(name, fn, *a), name=f"epcc-rdma-{name}", daemon=True)
            self._threads[name] = t
            t.start()

    def join_local(self) -> None:
        """Wait for this rank's producers (all chunks posted and flushed) and receiver (all chunks
        applied); the proxy keeps polling, for peers, until stop()."""
        for name, t in self._threads.items():
            if name != "proxy":
                t.join()

    def stop_proxy(self) -> None:
        self.stop[0] = 1
        t = self._threads.get("proxy")
        if t is not None:
            t.join()

    def failure(self) -> str | None:
        bad = {n: s for n, s in self.status.items() if s != STATUS_OK}
        if not bad:
            return None
        return self.err.value.decode(errors="replace") or f"epcc rdma: {', '.join(bad)} failed (status {bad})"

    def timed_out(self) -> bool:
        return any(s == STATUS_TIMEOUT for s in self.status.values())

    def counts(self) -> tuple[int, int]:
        p = self.engine.ctypes.data
        return int(self.lib.epcc_rdma_engine_posted(p)), int(self.lib.epcc_rdma_engine_applied(p))

    def backlog(self) -> tuple[int, int]:
        """(chunk entries the proxy took, FIFO passes that found any): their ratio above 1 means
        the producers pushed chunks faster than the proxy posted them."""
        p = self.engine.ctypes.data
        return int(self.lib.epcc_rdma_engine_drained(p)), int(self.lib.epcc_rdma_engine_passes(p))

    def close(self) -> None:
        if self.engine is not None:
            self.lib.epcc_rdma_engine_fini(self.engine.ctypes.data)
            self.engine = None
