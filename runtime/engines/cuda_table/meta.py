"""The metadata of a table-driven plan on the GPU (epcc_table_meta.cu): per dispatch, every
rank's routing exchanged (over peer memory inside one box, "ipc"; by the process group's all-gather
across boxes, "collective": exchange.py) and this rank's table blobs of both programs written by
the metadata kernels (epcc/table/meta.cuh), stream-ordered, no host round trip (CUDA-graph
capturable): on the CUDA target one cooperative launch per dispatch (meta_fused: the routing's copy
as slot words into every rank's area, the count blocks' polls of their tokens' words, the kernels'
four phases, a grid barrier after count and after scan, each items block's wait for its own copy's
rows before it; collective: the routing copy, the all-gathers, then meta_fused), else a launch per
step.  The blobs are placed (placement.py) and stay where they are: the launcher is told once where
they lie (Context.use_tables).

`DeviceMeta` holds what one rank needs: the encoded metadata program (meta_program.py), the
blobs' templates and the blobs (and, for the GPU proxy path, each RDMA item's sequence number on
its channel, which the kernels write beside them), the scratch, this rank's gather area (ipc: peer memory every
rank maps, allocated by the caller with the launcher library's malloc; collective: its own, a
tensor, all-gathered by the Buffer's Exchange: exchange.py), the exchange's epoch, meta_fused's
grid barrier counter, an error word the kernels write before they give up, and what a dispatch
returns of the received rows (their weights, experts, the rows per local expert).

meta_fused's timeline (`DeviceMeta.timeline`, off by default): each block's %globaltimer stamps at
the stages of one launch (STAGES), read back as an array (`read_timeline`) that `timeline_summary`
turns into when each stage was passed and how long each step took (bench/meta_time.py --timeline).
"""

from __future__ import annotations

import ctypes
import statistics

import numpy as np
import torch

from epcc.plan.segments import SegmentProgram
from ..base import EngineError
from epcc.backends.cuda.meta_program import HEADER, MetaProgram, encode
from epcc.backends.cuda.meta_program import VERSION as PROGRAM_VERSION
from epcc.backends.cuda.placement import Placement, placement, template

from .exchange import Exchange, area_regions
from .tables import PROGRAMS

MAX_RANKS = 64
ZERO_BLOCKS = 264  # zero_partials' grid at most (epcc_table_meta_zero), and alone on the device
META_ABI = 12  # epcc_table_meta.cu kMetaAbi: the layout of _Meta and _Args below
LAYOUT_WORDS = 21  # meta.cuh kLayout: the scratch's regions
HEADER_WORDS = len(HEADER)  # meta.cuh H_COUNT: the program's header, a copy of which the kernels' arguments hold
# what meta_fused's grid barrier timeouts name (error word {2, n}): after count, scan (meta.cuh Phase),
# and the first half-barrier, after the routing copy (the scratch the count blocks add into cleared)
PHASES = ("count", "scan", "the routing copy")
# meta_fused's timeline (epcc_table_meta.cu MetaStamp, kMetaTimelineWords): what each block's
# thread 0 stamps, in order.  sent: its share of the scratch cleared and of the templates copied, its
# arrival counted, its share of the routing stored into every rank's area; prepared: its first count
# block's sets (and first rows item's records) read; peers: that count block's tokens' slot words
# landed (thread 0's token; a block without count work: prepared's stamp); a phase's name: its work
# done; "barrier n": past the grid barrier after the n-th phase; "rows seen": its first items block's
# wait for the rows of that block's copy over, after the block read what needs no rows (no grid
# barrier after rows; a block without items: its rows done).  Without the exchange (collective)
# sent is entry's stamp.
STAGES = ("entry", "sent", "prepared", "peers", "count", "barrier 1", "scan", "barrier 2", "rows", "rows seen",
          "items")
TIMELINE_WORDS = len(STAGES)
# what the step up to each stage is called in timeline_summary: start is the spread of the blocks'
# entries, wait the wait for every block's arrival and then for the block's tokens' routing
STEPS = ("start", "send", "prepare", "wait", "count", "barrier 1", "scan", "barrier 2", "rows", "rows wait",
         "items")
# the phase whose blocks with work a stage's statistics are over (timeline_summary's busy; None: every block)
_STAGE_PHASE = (None, None, "count", None, "count", None, "scan", None, "rows", None, "items")


class _Exchange(ctypes.Structure):
    _fields_ = [("areas", ctypes.c_uint64 * MAX_RANKS), ("own", ctypes.c_uint64), ("routing", ctypes.c_uint64),
                ("weights", ctypes.c_uint64), ("epoch", ctypes.c_uint64), ("error", ctypes.c_uint64),
                ("timeout_ns", ctypes.c_uint64), ("rank", ctypes.c_int), ("num_ranks", ctypes.c_int),
                ("max_tokens", ctypes.c_int), ("k", ctypes.c_int), ("tokens", ctypes.c_int),
                ("topk_int32", ctypes.c_int), ("collective", ctypes.c_int)]


class _Args(ctypes.Structure):  # epcc::meta::Args
    _fields_ = [("prog", ctypes.c_uint64), ("scratch", ctypes.c_uint64),
                ("tokens", ctypes.c_uint64), ("routing", ctypes.c_uint64), ("epoch", ctypes.c_uint64),
                ("error", ctypes.c_uint64), ("timeout_ns", ctypes.c_uint64), ("blob", ctypes.c_uint64 * 2),
                ("bad", ctypes.c_uint64), ("recv_w", ctypes.c_uint64), ("recv_idx", ctypes.c_uint64),
                ("recv_count", ctypes.c_uint64), ("recv_offset", ctypes.c_uint64), ("seq", ctypes.c_uint64 * 2),
                ("lay", ctypes.c_int64 * LAYOUT_WORDS), ("head", ctypes.c_int64 * HEADER_WORDS)]


class _Meta(ctypes.Structure):  # EpccTableMeta
    _fields_ = [("exchange", _Exchange), ("args", _Args), ("templ", ctypes.c_uint64 * 2),
                ("templ_bytes", ctypes.c_uint64 * 2), ("sync", ctypes.c_uint64), ("grid_count", ctypes.c_int),
                ("grid_rows", ctypes.c_int), ("grid_items", ctypes.c_int), ("grid_copy", ctypes.c_int),
                ("grid_scan", ctypes.c_int), ("grid_fused", ctypes.c_int), ("timeline", ctypes.c_uint64)]


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
    lib.epcc_table_meta_timeline_words.argtypes, lib.epcc_table_meta_timeline_words.restype = [], ctypes.c_int
    if lib.epcc_table_meta_timeline_words() != TIMELINE_WORDS:
        raise EngineError(f"the bundle's metadata kernels stamp {lib.epcc_table_meta_timeline_words()} words per "
                          f"block, this runtime reads {TIMELINE_WORDS}: recompile the bundle with this epcc")
    for entry in (lib.epcc_table_meta, lib.epcc_table_meta_gather, lib.epcc_table_meta_tables):
        entry.argtypes, entry.restype = [ctypes.POINTER(_Meta), ctypes.c_uint64], ctypes.c_int
    lib.epcc_table_meta_zero.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int]
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


def area_layout(lib, num_ranks: int, max_tokens: int, topk: int) -> tuple[int, int, int]:
    """(bytes, token counts' offset, slot words' offset) of a gather area."""
    out = (ctypes.c_uint64 * 3)()
    lib.epcc_table_meta_area(num_ranks, max_tokens, topk, out)
    return int(out[0]), int(out[1]), int(out[2])


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
        if words == -2:
            raise EngineError(f"the bundle's metadata kernels read another version of the metadata program than "
                              f"this epcc writes (version {PROGRAM_VERSION}): recompile the bundle with this epcc")
        if words < 0:  # a bundle compiled before -2 existed says -1 for another version too
            raise EngineError(f"the bundle's metadata kernels do not hold rank {rank}'s program (built for "
                              f"{manifest['metadata'].get('capacity')}, it needs {self.mp.capacity()}, or compiled "
                              f"by another epcc, whose metadata program differs): recompile the bundle with this epcc")
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
        # meta_fused's timeline, [fused_grid][TIMELINE_WORDS], made by the first timeline(True) and kept (a
        # launch still in flight may write it); stamped into while self.stamping
        self.stamps: torch.Tensor | None = None
        self.stamping = False
        # meta_fused's grid: as many blocks as its largest phase has, at most what the device holds
        # at once (0: the launches of the steps instead, where the target has no cooperative launch)
        dev = torch.device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device() if dev.type == "cuda" else 0
        most = int(lib.epcc_table_meta_max_grid(index))
        if most < 0:
            raise EngineError(f"metadata kernels: {lib.epcc_table_meta_error().decode(errors='replace')}")
        self.fused_grid = min(most, max(self.mp.phase_blocks().values()))
        self.grid = self.fused_grid  # what the launches get (set_grid)
        # the exchange's error words: pinned host memory the kernel writes, or device memory where
        # kernels may not write host memory (SUPA on BR1xx), read back after the stream
        self.error = (torch.zeros(2, dtype=torch.int32, device=device) if error_on_device
                      else torch.zeros(2, dtype=torch.int32, pin_memory=True))
        self.area_bytes, self.off_tokens, self.off_routing = area_layout(lib, R, wl.tokens, wl.topk)
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
            # what the peers' kernels read of this rank: its slot words (its token count only it reads)
            self.regions = area_regions(self.area, R, wl.tokens, wl.topk, self.off_tokens, self.off_routing)[1:]
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
        a.prog = self.prog.data_ptr()
        a.scratch = self.scratch.data_ptr()
        a.tokens = self.own_area + self.off_tokens
        a.routing = self.own_area + self.off_routing
        a.epoch, a.error, a.timeout_ns = x.epoch, x.error, x.timeout_ns
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
        a.head[:] = self.mp.array[:HEADER_WORDS].tolist()
        g = self.mp.grids()
        m.grid_count, m.grid_rows, m.grid_items, m.grid_scan = g["count"], g["rows"], g["items"], g["scan"]
        m.grid_copy = max(1, min(264, -(-self.R * self.T * self.K // 256)))
        m.sync, m.grid_fused = self.sync.data_ptr(), self.grid
        m.timeline = self.stamps.data_ptr() if self.stamping else 0
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

    def timeline(self, on: bool = True) -> None:
        """meta_fused's timeline from the next dispatch on (on), or no longer (the kernels then pay one
        branch per stage): each block's %globaltimer stamps of the last launch, `read_timeline`."""
        if on and self.fused_grid == 0:
            raise EngineError("the timeline is meta_fused's: this device or target has no cooperative launch, the "
                              "metadata's steps run as launches of their own")
        if on and self.stamps is None:
            self.stamps = torch.zeros(self.fused_grid * TIMELINE_WORDS, dtype=torch.int64, device=self.device)
        self.stamping = on
        if self.areas:
            self.args.timeline = self.stamps.data_ptr() if on else 0

    def read_timeline(self) -> np.ndarray:
        """The last dispatch's stamps, [grid][TIMELINE_WORDS] ns (int64), once its stream is done
        (the caller synchronizes it): timeline_summary's input, with busy_blocks()."""
        if self.stamps is None:
            raise EngineError("read_timeline: call timeline(True) before the stamped dispatch")
        if self.grid == 0:
            raise EngineError("read_timeline: meta_fused's grid is 0 (set_grid): the steps ran as launches of their "
                              "own, which stamp nothing")
        return self.stamps.view(self.fused_grid, TIMELINE_WORDS)[:self.grid].cpu().numpy()

    def busy_blocks(self) -> dict[str, tuple[int, int]]:
        """Per phase, meta_fused's blocks with work in it at the current grid, (first, n)
        (MetaProgram.busy_blocks)."""
        return self.mp.busy_blocks(self.grid or self.fused_grid)

    def zero_partials(self, own_buffers_dev: int, stream: int, blocks: int = ZERO_BLOCKS) -> None:
        """The combine's partial buffers of this rank, cleared (before the combine kernel: beside the
        dispatch kernel, CudaTableEngine._zero_beside, or on the combine's stream), by
        `blocks` blocks (1 to ZERO_BLOCKS)."""
        if self.lib.epcc_table_meta_zero(self.blobs["combine"].data_ptr(), own_buffers_dev, stream, blocks) != 0:
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
        if code == 3:
            return (f"the metadata kernels' items of table copy {rank} timed out on rank {self.rank} waiting for "
                    f"that copy's rows")
        if code == 4:
            return (f"the metadata kernels' rows timed out on rank {self.rank} waiting for count's token records "
                    f"(a count block did not finish)")
        return None


def timeline_summary(stamps, busy: dict[str, tuple[int, int]] | None = None) -> dict:
    """One meta_fused launch's timeline (`stamps`: DeviceMeta.read_timeline's [blocks][TIMELINE_WORDS]
    ns) in microseconds from the earliest block's entry:

    * "stages": per stage (STAGES), over blocks, its blocks and min / median / max.  Every block
      stamps every stage, work or none; with `busy` (DeviceMeta.busy_blocks: per phase, the blocks
      with work in it, (first, n): blocks first .. first + n - 1 modulo the grid) a phase's "done" stage and
      count's "prepared" are over those blocks only (the others stamp right after the stage before:
      no work), their statistics None where none had any;
    * "steps": (name, us) per step (STEPS): how much later the last block of the grid passed the
      stage than the last passed the one before (start: the last entry after the first), every
      block counted -- the launch's critical path, which adds up to "total_us", the last stamp
      after the first entry;
    * "own_us": the total less the wait step -- the launch's own time, without the peers' lateness
      (the ranks enter the launch apart: the wait is theirs, not the kernel's) and, over CUDA IPC,
      without the routing's flight (the count blocks wait for their tokens' slot words there).

    ValueError where the stamps are not one launch's (a block's stamps out of order, or none)."""
    t = np.asarray(stamps, dtype=np.int64)
    if t.ndim != 2 or t.shape[1] != TIMELINE_WORDS or t.shape[0] == 0:
        raise ValueError(f"meta_fused timeline: shape {t.shape}, not [blocks][{TIMELINE_WORDS}]")
    if (t <= 0).any():
        raise ValueError(f"meta_fused timeline: block {int(np.argwhere(t <= 0)[0][0])} has no stamp (a launch "
                         f"without the timeline, or of fewer blocks)")
    back = np.argwhere(np.diff(t, axis=1) < 0)
    if back.size:
        b, i = (int(v) for v in back[0])
        raise ValueError(f"meta_fused timeline: block {b} stamped {STAGES[i + 1]} before {STAGES[i]}")
    G = t.shape[0]
    us = (t - t[:, 0].min()) / 1e3
    stages = []
    for i, name in enumerate(STAGES):
        phase = _STAGE_PHASE[i]
        first, n = (0, G) if busy is None or phase is None else busy[phase]
        n = max(0, min(G, int(n)))
        col = us[(first + np.arange(n)) % G, i]
        stats = (float(col.min()), float(np.median(col)), float(col.max())) if n else (None, None, None)
        stages.append({"stage": name, "blocks": n, **dict(zip(("min_us", "median_us", "max_us"), stats))})
    last = us.max(axis=0)
    steps = [(STEPS[0], float(last[0]))] + [(STEPS[i], float(last[i] - last[i - 1])) for i in range(1, len(STEPS))]
    wait = dict(steps)["wait"]
    return {"blocks": G, "stages": stages, "steps": steps, "total_us": float(last[-1]),
            "own_us": float(last[-1]) - wait}


def timeline_medians(rounds: list[dict]) -> dict:
    """Several launches' timeline_summary as one: per stage the median over the launches of its
    median and of its max over blocks ("median_us", "max_us"), per step and of the total the
    median (so the steps' medians need not add up to the total's), and of the own time."""
    if not rounds:
        raise ValueError("timeline_medians: no launches")

    def med(vals: list) -> float | None:
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    stages = [{"stage": s["stage"], "blocks": s["blocks"],
               "median_us": med([r["stages"][i]["median_us"] for r in rounds]),
               "max_us": med([r["stages"][i]["max_us"] for r in rounds])} for i, s in enumerate(rounds[0]["stages"])]
    steps = [(name, med([r["steps"][i][1] for r in rounds])) for i, (name, _) in enumerate(rounds[0]["steps"])]
    return {"blocks": rounds[0]["blocks"], "stages": stages, "steps": steps,
            "total_us": med([r["total_us"] for r in rounds]), "own_us": med([r["own_us"] for r in rounds]),
            "launches": len(rounds)}


def routing_error(bad: int, topk_idx, experts: int) -> str | None:
    """The message of a bad routing row the metadata kernels marked (bad: the first bad token)."""
    if bad >= topk_idx.shape[0]:
        return None
    return (f"dispatch: topk_idx row {bad} names an expert outside [-1, {experts - 1}] or the same expert twice: "
            f"{topk_idx[bad].tolist()} (those entries were not dispatched)")


__all__ = ["DeviceMeta", "area_layout", "bind", "program_of", "routing_error", "timeline_medians",
           "timeline_summary"]
