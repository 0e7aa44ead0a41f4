"""The transport library (backends/rdma/native/epcc_transport.h) and the proxy loop's entry
points as this process sees them through ctypes, for both proxy paths: the CPU path (rdma_host.py)
and the GPU path (gpu_proxy).  Also: the descriptor-table rows both fill (backends/rdma/abi.py).
"""

from __future__ import annotations

import ctypes

import numpy as np

TP_LOCAL, TP_REMOTE_WRITE = 1, 2
ERRLEN = 1024
STATUS_OK, STATUS_TIMEOUT, STATUS_ABORTED, STATUS_FAILED = 0, 1, 2, 3


class TransportError(RuntimeError):
    """The transport could not be opened or failed (the message is the transport's)."""


class TpStats(ctypes.Structure):
    _fields_ = [("writes_posted", ctypes.c_uint64), ("bytes_posted", ctypes.c_uint64),
                ("imm_received", ctypes.c_uint64), ("local_completions", ctypes.c_uint64), ("eagain", ctypes.c_uint64),
                ("post_ns", ctypes.c_uint64), ("link_idle_ns", ctypes.c_uint64), ("link_gaps", ctypes.c_uint64),
                ("signal_lag_ns", ctypes.c_uint64), ("signals", ctypes.c_uint64)]


def load(lib_path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(lib_path))
    vp, u64, i32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int
    lib.epcc_tp_open.argtypes = [ctypes.c_char_p, ctypes.c_char_p, i32, i32, ctypes.POINTER(vp), ctypes.c_char_p,
                                 ctypes.c_size_t]
    lib.epcc_tp_error.argtypes, lib.epcc_tp_error.restype = [vp], ctypes.c_char_p
    lib.epcc_tp_describe.argtypes, lib.epcc_tp_describe.restype = [vp], ctypes.c_char_p
    lib.epcc_tp_reg.argtypes = [vp, vp, ctypes.c_size_t, ctypes.c_uint, ctypes.POINTER(vp)]
    lib.epcc_tp_mr_remote.argtypes = [vp, ctypes.POINTER(u64), ctypes.POINTER(u64)]
    lib.epcc_tp_mr_remote.restype = None
    lib.epcc_tp_dereg.argtypes = [vp, vp]
    lib.epcc_tp_address.argtypes = [vp, vp, ctypes.POINTER(ctypes.c_size_t)]
    lib.epcc_tp_connect.argtypes = [vp, vp, ctypes.c_size_t]
    lib.epcc_tp_flush.argtypes = [vp, u64]
    lib.epcc_tp_close.argtypes, lib.epcc_tp_close.restype = [vp], None
    lib.epcc_tp_stats_get.argtypes, lib.epcc_tp_stats_get.restype = [vp, ctypes.POINTER(TpStats)], None
    lib.epcc_tp_post_write_signal.argtypes = [vp, i32, ctypes.c_uint, vp, ctypes.c_size_t, vp, u64, u64, u64, u64, u64,
                                              u64, u64]
    lib.epcc_tp_links.argtypes, lib.epcc_tp_links.restype = [vp], i32
    if not hasattr(lib, "epcc_rdma_proxy"):
        return lib  # a transport alone (build_transport)
    for name in ("epcc_rdma_engine_init", "epcc_rdma_proxy", "epcc_rdma_receive"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [vp], i32
    lib.epcc_rdma_produce.argtypes, lib.epcc_rdma_produce.restype = [vp, u64], i32
    lib.epcc_rdma_engine_fini.argtypes, lib.epcc_rdma_engine_fini.restype = [vp], None
    for name in ("epcc_rdma_engine_posted", "epcc_rdma_engine_applied", "epcc_rdma_engine_drained",
                 "epcc_rdma_engine_passes"):
        if hasattr(lib, name):  # the backlog counters: not in proxy loops emitted before them
            getattr(lib, name).argtypes, getattr(lib, name).restype = [vp], u64
    return lib


def cost_phrase(stats: dict) -> str:
    """What a proxy thread cost, from its counters (one engine's, or summed over ranks): mean host
    time per post call, and chunks found waiting per FIFO pass (above 1: the producers pushed
    chunks faster than the thread posted them, so the proxy set the pace); on a paced transport
    (emulated) the wire time its links sat idle inside a stream, nothing posted (the senders were
    held: credits, FIFO slots, packing, or the proxy itself), and how late the polling issued the
    landing signals; '' without posts."""
    writes, parts = stats.get("writes_posted") or 0, []
    if writes and stats.get("post_ns") is not None:
        parts.append(f"{stats['post_ns'] / writes / 1e3:.2f} us mean host time per post call")
    if stats.get("passes"):
        parts.append(f"{stats['drained'] / stats['passes']:.1f} chunks waiting per FIFO pass")
    if stats.get("link_gaps"):
        parts.append(f"link idle {stats['link_idle_ns'] / 1e3:.0f} us inside streams in {stats['link_gaps']} gaps "
                     f"({stats['link_idle_ns'] / stats['link_gaps'] / 1e3:.1f} us each)")
    if stats.get("signals"):
        parts.append(f"signals issued {stats['signal_lag_ns'] / stats['signals'] / 1e3:.2f} us after their paced "
                     f"landing on average")
    return ", ".join(parts)


def c_string(keep: list, text: str) -> int:
    """Address of a NUL-terminated copy of `text`, kept alive in `keep` (names in the messages)."""
    b = ctypes.create_string_buffer(text.encode())
    keep.append(b)
    return ctypes.addressof(b)


def u64_table(keep: list, t, rows: list[dict]) -> np.ndarray:
    """Rows of descriptor table `t` (backends/rdma/abi.py; every field 8 bytes) as the C side reads them;
    fields a row leaves out are 0 (e.g. the GPU path's on the CPU path)."""
    a = np.zeros((max(len(rows), 1), len(t.fields)), dtype=np.uint64)
    for i, row in enumerate(rows):
        for j, f in enumerate(t.names()):
            a[i, j] = np.uint64(int(row.get(f, 0)) & 0xFFFFFFFFFFFFFFFF)
    keep.append(a)
    return a


class Transport:
    """An open transport (epcc_transport.h) of this process."""

    def __init__(self, lib: ctypes.CDLL, kind: str, spec: str, rank: int, nranks: int):
        self.lib = lib
        self.ptr = ctypes.c_void_p()
        err = ctypes.create_string_buffer(ERRLEN)
        rc = lib.epcc_tp_open(kind.encode(), spec.encode(), rank, nranks, ctypes.byref(self.ptr), err, ERRLEN)
        if rc != 0:
            raise TransportError(err.value.decode(errors="replace") or f"epcc_tp_open failed ({rc})")
        self.mrs: list[ctypes.c_void_p] = []

    @property
    def description(self) -> str:
        return self.lib.epcc_tp_describe(self.ptr).decode()

    @property
    def links(self) -> int:
        """How many links (send queues paced on their own) the transport has; posts name one below."""
        return int(self.lib.epcc_tp_links(self.ptr))

    def error(self) -> str:
        return self.lib.epcc_tp_error(self.ptr).decode(errors="replace")

    def reg(self, arr: np.ndarray, access: int) -> tuple[int, int, int]:
        """Register `arr`; returns (mr handle, remote address of byte 0, key)."""
        return self.reg_ptr(arr.ctypes.data, arr.nbytes, access)

    def reg_ptr(self, ptr: int, nbytes: int, access: int) -> tuple[int, int, int]:
        """Register `nbytes` at `ptr` (host, or device memory for the CUDA transports)."""
        mr = ctypes.c_void_p()
        if self.lib.epcc_tp_reg(self.ptr, ptr, max(nbytes, 1), access, ctypes.byref(mr)) != 0:
            raise TransportError(self.error())
        self.mrs.append(mr)
        a, k = ctypes.c_uint64(), ctypes.c_uint64()
        self.lib.epcc_tp_mr_remote(mr, ctypes.byref(a), ctypes.byref(k))
        return int(mr.value), int(a.value), int(k.value)

    def address(self) -> bytes:
        buf = ctypes.create_string_buffer(4096)
        n = ctypes.c_size_t(4096)
        if self.lib.epcc_tp_address(self.ptr, buf, ctypes.byref(n)) != 0:
            raise TransportError(self.error())
        return buf.raw[: n.value]

    def connect(self, blobs: list[bytes]) -> None:
        width = max(len(b) for b in blobs)
        packed = b"".join(b.ljust(width, b"\0") for b in blobs)
        buf = ctypes.create_string_buffer(packed, len(packed))
        if self.lib.epcc_tp_connect(self.ptr, buf, width) != 0:
            raise TransportError(self.error())

    def flush(self, timeout_s: float) -> None:
        if self.lib.epcc_tp_flush(self.ptr, int(timeout_s * 1e9)) != 0:
            raise TransportError(self.error())

    def stats(self) -> dict:
        s = TpStats()
        self.lib.epcc_tp_stats_get(self.ptr, ctypes.byref(s))
        return {f: int(getattr(s, f)) for f, _ in TpStats._fields_}

    def close(self) -> None:
        if self.ptr:
            for mr in self.mrs:
                self.lib.epcc_tp_dereg(self.ptr, mr)
            self.mrs.clear()
            self.lib.epcc_tp_close(self.ptr)
            self.ptr = ctypes.c_void_p()
