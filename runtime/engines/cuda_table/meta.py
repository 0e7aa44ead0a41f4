"""The metadata of a table-driven plan on the GPU (epcc_table_meta.cu): per dispatch, every
rank's routing exchanged (over peer memory inside one box, "ipc"; by the process group's all-gather
across boxes, "collective": exchange.py) and this rank's table blobs of both programs written by
the metadata kernels (epcc/table/meta.cuh), stream-ordered, no host round trip (CUDA-graph
capturable): on the CUDA target one cooperative launch per dispatch (meta_fused: the routing's copy,
the peers' flags and the kernels' four phases, a grid barrier between two; collective: the routing
copy, the all-gathers, then meta_fused), else a launch per step.  The blobs are placed (placement.py) and stay where they are: the launcher is told
once where they lie (Context.use_tables).

`DeviceMeta` holds what one rank needs: the encoded metadata program (meta_program.py), the
blobs' templates and the blobs (and, for the GPU proxy path, each RDMA item's sequence number on
its channel, which the kernels write beside them), the scratch, this rank's gather area (ipc: peer memory every
rank maps, allocated by the caller with the launcher library's malloc; collective: its own, a
tensor, all-gathered by the Buffer's Exchange: exchange.py), the exchange's epoch, meta_fused's
grid barrier counter, an error word the kernels write before they give up, and what a dispatch
returns of the received rows (their weights, experts, the rows per local expert).
"""

from __future__ import annotations

import ctypes

import torch

from epcc.plan.segments import SegmentProgram
from ..base import EngineError
from epcc.backends.cuda.meta_program import MetaProgram, encode
from epcc.backends.cuda.placement import Placement, placement, template

from .exchange import Exchange, area_regions
from .tables import PROGRAMS

MAX_RANKS = 64
META_ABI = 6  # epcc_table_meta.cu kMetaAbi: the layout of _Meta and _Args below
LAYOUT_WORDS = 21  # meta.cuh kLayout: the scratch's regions
PHASES = ("count", "scan", "rows")  # meta.cuh Phase: what meta_fused's barrier timeouts name


class _Exchange(ctypes.Structure):
    _fields_ = [("areas", ctypes.c_uint64 * MAX_RANKS), ("own", ctypes.c_uint64), ("routing", ctypes.c_uint64),
                ("weights", ctypes.c_uint64), ("epoch", ctypes.c_uint64), ("error", ctypes.c_uint64),
                ("timeout_ns", ctypes.c_uint64), ("rank", ctypes.c_int), ("num_ranks", ctypes.c_int),
                ("max_tokens", ctypes.c_int), ("k", ctypes.c_int), ("tokens", ctypes.c_int),
                ("topk_int32", ctypes.c_int), ("collective", ctypes.c_int)]


class _Args(ctypes.Structure):  # epcc::meta::Args
    _fields_ = [("prog", ctypes.c_uint64), ("prog_words", ctypes.c_int64), ("scratch", ctypes.c_uint64),
                ("tokens", ctypes.c_uint64),
                ("topk", ctypes.c_uint64), ("weights", ctypes.c_uint64), ("blob", ctypes.c_uint64 * 2),
                ("bad", ctypes.c_uint64), ("recv_w", ctypes.c_uint64), ("recv_idx", ctypes.c_uint64),
                ("recv_count", ctypes.c_uint64), ("recv_offset", ctypes.c_uint64), ("seq", ctypes.c_uint64 * 2),
                ("lay", ctypes.c_int64 * LAYOUT_WORDS)]


class _Meta(ctypes.Structure):  # EpccTableMeta
    _fields_ = [("exchange", _Exchange), ("args", _Args), ("templ", ctypes.c_uint64 * 2),
                ("templ_bytes", ctypes.c_uint64 * 2), ("sync", ctypes.c_uint64), ("grid_count", ctypes.c_int),
                ("grid_rows", ctypes.c_int), ("grid_items", ctypes.c_int), ("grid_copy", ctypes.c_int),
                ("grid_scan", ctypes.c_int), ("grid_fused", ctypes.c_int)]


def bind(lib: ctypes.CDLL) -> None:
    """Declare the metadata entry points of a bundle library (EngineError: a library built from
    another version's metadata sources, whose arguments this runtime would lay out wrongly)."""
    abi = getattr(lib, "epcc_table_meta_abi", None)
    if abi is None:
        raise EngineError(f"the bundle's library has metadata kernels of an older epcc (no epcc_table_meta_abi; "
                          f"this runtime needs ABI {META_ABI}): recompile the bundle with this epcc")
    abi.argtypes, abi.restype = [], ctypes.c_int
    if abi() != META_ABI:
        raise EngineError(f"the bundle's metadata kernels have ABI {abi()}, this runtime needs {META_ABI}: "
                          f"recompile the bundle with this epcc")
    for entry in (lib.epcc_table_meta, lib.epcc_table_meta_gather, lib.epcc_table_meta_tables):
        entry.argtypes, entry.restype = [ctypes.POINTER(_Meta), ctypes.c_uint64], ctypes.c_int
    lib.epcc_table_meta_zero.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64]
    lib.epcc_table_meta_zero.restype = ctypes.c_int
    lib.epcc_table_meta_copy_rows.argtypes = [ctypes.c_uint64] * 5
    lib.epcc_table_meta_copy_rows.restype = ctypes.c_int
    lib.epcc_table_meta_area.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]
    lib.epcc_table_meta_area.restype = None
    lib.epcc_table_meta_scratch_words.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.epcc_table_meta_scratch_words.restype = ctypes.c_int64
    lib.epcc_table_meta_error.argtypes = []
    lib.epcc_table_meta_error.restype = ctypes.c_char_p
    lib.epcc_table_meta_load.argtypes = []
    lib.epcc_table_meta_load.restype = ctypes.c_int
    lib.epcc_table_meta_max_grid.argtypes = [ctypes.c_int]
    lib.epcc_table_meta_max_grid.restype = ctypes.c_int


def area_layout(lib, num_ranks: int, max_tokens: int, topk: int) -> tuple[int, int, int, int]:
    """(bytes, tokens offset, top-k offset, weights offset) of a gather area."""
    out = (ctypes.c_uint64 * 4)()
    lib.epcc_table_meta_area(num_ranks, max_tokens, topk, out)
    return int(out[0]), int(out[1]), int(out[2]), int(out[3])


def program_of(manifest: dict, plan, prog: SegmentProgram, rank: int) -> tuple[MetaProgram, dict[str, Placement]]:
    """This rank's placements and metadata program (MetaProgramError where the kernels do not cover
    the plan)."""
    tokens = plan.workload.tokens
    programs = [p for p in PROGRAMS if any(k["program"] == p and k["kind"] == "main" for k in manifest["kernels"])]
    pls = {p: placement(manifest, prog, p, rank, tokens) for p in programs}
    return encode(manifest, plan.workload.placement, prog, pls, rank, tokens), pls


class DeviceMeta:
    """One rank's metadata on the GPU (see the module docstring).  Device memory comes from torch
    (on the current device) except, with the exchange over CUDA IPC, the gather area, which the
    caller allocates and maps on peers (set_areas); with the collective exchange (`exchange`: the
    Buffer's, exchange.py) the area is this rank's own tensor, made here, and its first exchange
    (of the zeroed area) is enqueued here: the caller waits for it (watched: Exchange.watch)."""

    def __init__(self, lib, manifest: dict, plan, prog: SegmentProgram, rank: int, device, timeout_s: float,
                 error_on_device: bool = False, exchange: Exchange | None = None):
        self.lib, self.rank, self.device = lib, rank, device
        bind(lib)
        if lib.epcc_table_meta_load() != 0:  # not behind a running kernel
            raise EngineError(f"metadata kernels: {lib.epcc_table_meta_error().decode(errors='replace')}")
        self.mp, self.placements = program_of(manifest, plan, prog, rank)
        wl = plan.workload
        R, self.T, self.K = plan.num_ranks, wl.tokens, wl.topk
        self.R = R
        self.prog = torch.from_numpy(self.mp.array).to(device)
        self.layout = (ctypes.c_int64 * LAYOUT_WORDS)()
        words = int(lib.epcc_table_meta_scratch_words(self.mp.array.ctypes.data, self.layout))
        if words < 0:
            raise EngineError(f"the bundle's metadata kernels do not hold rank {rank}'s program (built for "
                              f"{manifest['metadata'].get('capacity')}, it needs {self.mp.capacity()}): recompile "
                              f"the bundle with this epcc")
        self.scratch = torch.zeros(max(words, 1), dtype=torch.int64, device=device)
        self.templates = {p: torch.from_numpy(template(manifest, pl, R)).to(device) for p, pl in self.placements.items()}
        self.blobs = {p: t.clone() for p, t in self.templates.items()}
        # the GPU proxy path's: each RDMA item's sequence number on its channel (KernelArgs.rdma_seq)
        self.seq = {p: torch.zeros(max(pl.num_items, 1), dtype=torch.int32, device=device)
                    for p, pl in self.placements.items() if any(r.side != "sm" for r in pl.roles)}
        self.headers = {p: self.templates[p][:128].cpu().numpy().tobytes() for p in self.templates}
        epr = wl.experts // R
        cap = R * wl.tokens * min(wl.topk, epr)
        self.recv_w = torch.zeros(max(cap, 1), dtype=torch.float32, device=device)
        self.recv_idx = torch.zeros(max(cap, 1), dtype=torch.int64, device=device)
        self.recv_count = torch.zeros(epr, dtype=torch.int32, device=device)
        self.recv_offset = torch.zeros(epr + 1, dtype=torch.int32, device=device)
        self.bad = torch.zeros(1, dtype=torch.int32, device=device)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)
        self.sync = torch.zeros(1, dtype=torch.int64, device=device)  # meta_fused's barrier counter
        # meta_fused's grid: as many blocks as its largest phase has, at most what the device holds
        # at once (0: the launches of the steps instead, where the target has no cooperative launch)
        dev = torch.device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device() if dev.type == "cuda" else 0
        most = int(lib.epcc_table_meta_max_grid(index))
        if most < 0:
            raise EngineError(f"metadata kernels: {lib.epcc_table_meta_error().decode(errors='replace')}")
        g = self.mp.grids()
        self.fused_grid = min(most, max(g["count"], g["scan"], g["rows"] + g["count"], g["items"]))
        self.grid = self.fused_grid  # what the launches get (set_grid)
        # the exchange's error words: pinned host memory the kernel writes, or device memory where
        # kernels may not write host memory (SUPA on BR1xx), read back after the stream
        self.error = (torch.zeros(2, dtype=torch.int32, device=device) if error_on_device
                      else torch.zeros(2, dtype=torch.int32, pin_memory=True))
        self.area_bytes, self.off_tokens, self.off_topk, self.off_weights = area_layout(lib, R, wl.tokens, wl.topk)
        self.timeout_ns = int(timeout_s * 1e9)
        self.areas: list[int] = []
        self.own_area = 0
        self.collective = manifest["metadata"].get("exchange") == "collective"
        self.exchange = exchange
        if self.collective:  # no peer maps it: the group's all-gather fills the others' slots
            if exchange is None:
                raise EngineError("the bundle's metadata exchange is the process group's collective: DeviceMeta "
                                  "needs the Buffer's Exchange")
            self.area = torch.zeros(self.area_bytes, dtype=torch.uint8, device=device)
            self.regions = area_regions(self.area, R, wl.tokens, wl.topk, self.off_tokens, self.off_topk,
                                        self.off_weights)
            # one exchange of the zeroed area now (every rank makes its Buffer at the same time): the
            # group's communicator is set up here, not by a first dispatch inside a CUDA-graph capture
            exchange.all_gather(self.regions)
            self.set_areas([self.area.data_ptr() if r == rank else 0 for r in range(R)], rank)

    def set_areas(self, areas: list[int], rank: int) -> None:
        """Every rank's gather area as mapped here (this rank's own at `rank`); the launch
        arguments are made here, once (a call only sets its routing)."""
        if len(areas) > MAX_RANKS:
            raise EngineError(f"{len(areas)} ranks: the metadata exchange handles at most {MAX_RANKS}")
        self.areas, self.own_area = list(areas), areas[rank]
        self.args = self._args()

    def run(self, tokens: int, topk_idx, topk_weights, stream) -> None:
        """The exchange and the metadata kernels of one dispatch, on `stream` (a torch.cuda.Stream),
        no host sync: over CUDA IPC in one entry; collective: this rank's slot, the Exchange's
        all-gathers on `stream`, then the metadata kernels."""
        m = self.args
        x = m.exchange
        x.routing = topk_idx.data_ptr() if tokens else 0
        x.weights = topk_weights.data_ptr() if (topk_weights is not None and tokens) else 0
        x.tokens = tokens
        x.topk_int32 = int(topk_idx.dtype == torch.int32)
        s = stream.cuda_stream
        if not self.collective:
            self._check(self.lib.epcc_table_meta(ctypes.byref(m), s))
            return
        self._check(self.lib.epcc_table_meta_gather(ctypes.byref(m), s))
        with torch.cuda.stream(stream):
            self.exchange.all_gather(self.regions)
        self._check(self.lib.epcc_table_meta_tables(ctypes.byref(m), s))

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise EngineError(f"metadata kernels: {self.lib.epcc_table_meta_error().decode(errors='replace')}")

    def copy_rows(self, dst: int, src: int, row_bytes: int, stream: int) -> None:
        """As many rows as this rank received in the last dispatch (a count only the GPU knows)."""
        count = self.recv_offset.data_ptr() + 4 * (self.recv_offset.numel() - 1)
        if self.lib.epcc_table_meta_copy_rows(dst, src, count, row_bytes, stream) != 0:
            raise EngineError(f"copying the rows: {self.lib.epcc_table_meta_error().decode(errors='replace')}")

    def _args(self) -> _Meta:
        m = _Meta()
        x = m.exchange
        for r, a in enumerate(self.areas):
            x.areas[r] = a
        x.own = self.own_area
        x.epoch = self.epoch.data_ptr()
        x.error = self.error.data_ptr()
        x.timeout_ns = self.timeout_ns
        x.rank, x.num_ranks, x.max_tokens, x.k = self.rank, self.R, self.T, self.K
        x.collective = int(self.collective)
        a = m.args
        a.prog, a.prog_words = self.prog.data_ptr(), len(self.mp.array)
        a.scratch = self.scratch.data_ptr()
        a.tokens = self.own_area + self.off_tokens
        a.topk = self.own_area + self.off_topk
        a.weights = self.own_area + self.off_weights
        for i, p in enumerate(PROGRAMS):
            if p in self.blobs:
                a.blob[i] = self.blobs[p].data_ptr()
                m.templ[i] = self.templates[p].data_ptr()
                m.templ_bytes[i] = self.placements[p].offsets["rows"]
        a.bad = self.bad.data_ptr()
        a.recv_w, a.recv_idx = self.recv_w.data_ptr(), self.recv_idx.data_ptr()
        a.recv_count, a.recv_offset = self.recv_count.data_ptr(), self.recv_offset.data_ptr()
        for i, p in enumerate(PROGRAMS):
            a.seq[i] = self.seq[p].data_ptr() if p in self.seq else 0
        a.lay[:] = list(self.layout)
        g = self.mp.grids()
        m.grid_count, m.grid_rows, m.grid_items, m.grid_scan = g["count"], g["rows"], g["items"], g["scan"]
        m.grid_copy = max(1, min(264, -(-self.R * self.T * self.K // 256)))
        m.sync, m.grid_fused = self.sync.data_ptr(), self.grid
        return m

    def set_grid(self, blocks: int) -> None:
        """meta_fused's grid from the next dispatch on: 0 (the launches of the steps instead) up to
        the grid it was given (what its largest phase has, at most what the device holds at once).
        Its barrier counter is cleared on the current stream (between dispatches): it counts on the
        grid staying one size."""
        if not 0 <= blocks <= self.fused_grid:
            raise EngineError(f"meta_fused's grid must be 0 to {self.fused_grid} blocks, not {blocks}")
        self.sync.zero_()
        self.grid = blocks
        if self.areas:
            self.args.grid_fused = blocks

    def zero_partials(self, own_buffers_dev: int, stream: int) -> None:
        """The combine's partial buffers of this rank, cleared (before the combine kernel)."""
        if self.lib.epcc_table_meta_zero(self.blobs["combine"].data_ptr(), own_buffers_dev, stream) != 0:
            raise EngineError(f"zeroing the partials: {self.lib.epcc_table_meta_error().decode(errors='replace')}")

    def failure(self) -> str | None:
        """What the exchange's kernels wrote before they gave up (None: nothing)."""
        try:
            code, rank = (int(v) for v in self.error.tolist())
        except RuntimeError:  # device memory after a kernel trapped: the runtime may refuse the copy
            return None
        if code == 1:
            return (f"the metadata exchange timed out: rank {self.rank} received no routing from rank {rank} "
                    f"(it did not dispatch, or it failed)")
        if code == 2:
            after = PHASES[rank] if 0 <= rank < len(PHASES) else f"phase {rank}"
            return f"the metadata kernels' grid barrier after {after} timed out on rank {self.rank}"
        return None


def routing_error(bad: int, topk_idx, experts: int) -> str | None:
    """The message of a bad routing row the metadata kernels marked (bad: the first bad token)."""
    if bad >= topk_idx.shape[0]:
        return None
    return (f"dispatch: topk_idx row {bad} names an expert outside [-1, {experts - 1}] or the same expert twice: "
            f"{topk_idx[bad].tolist()} (those entries were not dispatched)")


__all__ = ["DeviceMeta", "area_layout", "bind", "program_of", "routing_error"]
