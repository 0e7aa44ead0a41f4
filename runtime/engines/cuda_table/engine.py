"""The `cuda` engine of `epcc.runtime.Buffer` for every plan that is not one-hop: the bundle's
table-driven kernels (and, for a bundle compiled with `--rdma proxy`, the GPU proxy path) on
NVIDIA GPUs, behind the Engine protocol (runtime/engines/base.py).

One process per GPU (torchrun), `torch.cuda.set_device(local_rank)` before the Buffer is made.
At construction every rank builds (rank 0 first, then the others from the build cache) and
loads the launcher library, creates its context and flag area, and allocates every buffer of
both programs once, at the most rows any routing of at most the bundle's `tokens` per rank can
put there (runtime/layout/capacity.py), so buffers are mapped on the peers (CUDA IPC) once.

Which peers (ipc_domain.py): every rank names its CUDA IPC domain (its host, or
EPCC_CUDA_IPC_DOMAIN) in a round of the agreement before anything is built.  All in one domain:
every peer's flag area and buffers are mapped, as always.  Across domains: only the ranks this
rank's kernels reach over peer memory, or that reach it (plan/peers.py; the GPU proxy path's RDMA
steps excluded); the others are null in the kernels' pointer tables and the entry barrier meets
the mapped ranks only.  Refused when the Buffer is made, on every rank, with the ranks, the step
and the fix: a step over peer memory between domains (an RDMA step emulated by peer copies:
compile with `--rdma proxy`), the metadata exchange over CUDA IPC (`--metadata-exchange
collective`), the proxy's `emulated` transport (it maps every rank: use `nvshmem`).  `opened`
holds the mappings made, `ipc_peers` the ranks mapped, `domains` every rank's domain.

Where do a dispatch's tables come from (the bundle's manifest, "metadata"):

* "device" (the plans the metadata kernels cover: backends/cuda/codegen.py device_metadata): the
  GPU exchanges every rank's routing (over peer memory inside one box; by the group's all-gather,
  exchange.py, across boxes or where the bundle was compiled `--metadata-exchange collective`)
  and writes this rank's tables of both programs itself (meta.py), stream-ordered: no host sync,
  no allocation, CUDA-graph capturable.  Across CUDA IPC domains the exchange must be the
  group's (above): its all-gather, on every rank's dispatch stream, is also what orders the
  launches of ranks that share no memory (and so no entry barrier).
  With the GPU proxy path, its channels, rings and FIFOs are set up once, here, for every
  routing (gpu_proxy/channels.py from_placement), the metadata kernels number each RDMA chunk on
  its channel, and the proxy threads run for the Buffer's life, following what the kernels push.
  Both modes work: normal (`sync=True`: the per-expert counts read back, bad routing raised) and
  low latency (`sync=False`: the whole receive buffer, counts and offsets as device tensors, a
  bad routing row ignored and reported by `check_routing`).
  On the GPU proxy path the proxy threads issue CUDA calls (the emulated transport's copies,
  NVSHMEM's puts) while the kernels wait for them, so the host must not block in a CUDA call
  while a launch of the path is in flight: a read into pageable memory (`.cpu()`, `.item()`)
  holds the context and the proxy thread waits on it, and a kernel's first (lazily loaded) launch
  stalls the proxy's copies; either deadlocks until the kernels' timeout (2 x H100, 2026-11-27:
  the proxy thread asleep on a futex behind a `.cpu()`, its copies issued but never run behind a
  first launch).  So the normal mode waits for its dispatch and its combine watched (an event
  polled, watch.py) before returning, and a caller of the low-latency mode (a CUDA graph's
  replay too) waits with `Buffer.synchronize()`, the same watched wait, before a host read or
  another blocking CUDA call.
* "host" (plans beyond the metadata kernels, the GPU proxy path compiled with `--proxy-tables
  host`, bundles of an older epcc): the routings and token counts of
  every rank are exchanged over the group, every rank computes the same layout (runtime/layout)
  and uploads its tables
  (stream-ordered: the launches before still read the previous ones).  Normal mode only.

Ranks may dispatch different numbers of tokens (0 included), up to the bundle's `tokens`.  A
cached-handle dispatch (`handle=`) reuses the routing.  Outputs of the normal mode are copies
(valid after the next call): recv_x [rows, hidden] in the documented expert-major order (local
expert, home rank, token), the global expert and the routing weight of each row, the rows per
local expert; with `expert_alignment` N every expert's rows start at a multiple of N (zero rows
between; combine ignores them).

Dispatch reads the tokens `x` and combine the expert rows `y` where the caller has them (their
address a launch argument, which a CUDA graph captures: a replay reads the captured tensor, kept
unchanged until the kernel ends) where the bundle allows it (manifest `dispatch_input`,
`combine_input`: no copy reads another rank's tokens, expert rows) and the rows start 16-byte
aligned; else, or with a library of an older epcc, it copies them into the program's input buffer
first (the dispatch's copy of x: 0.03-0.04 ms of 4096 x 7168 bf16 tokens on H100; 2 x H100,
2026-11-27, h200x2_2vnode at 50 GB/s, 4096 tokens: ~0.5 ms of a 2.03 ms combine was the copy of y,
the partials' clearing and the bf16 conversion outside the kernel).  With tables from the GPU the
combine's partials are cleared beside the dispatch kernel (_zero_beside), not in the combine call,
and where the combine kernel writes the bf16 tokens itself (manifest `combine_output`: each row
converted by the warp adding its last contribution) each row's contributions are counted there
too (the launcher's combine_prepare); no conversion runs after the kernel.  2 x H100, 2026-11-27,
h200x2_2vnode_50, one device call: the combine 1.352 -> 1.284 ms.

Failures (agree.py): every host-side exchange is a round of the Buffer's agreement; an argument a
rank refuses, a kernel or proxy that gave up, or a rank that stopped answering raises the same
GroupError on every rank.  On the GPU proxy path the host's wait for a launch is watched
(gpu_proxy/watch.py): a proxy thread that stops or stalls is posted to the group at once, and a
peer's failure ends this rank's wait at once, instead of every rank's kernels timing out together.
With the collective exchange the wait (the normal mode's, `synchronize`, `close`) is watched too:
the exchange runs in a process group of its own, made with the Buffer, and one that a peer did not
come to within the timeout (it skipped a dispatch, stalled or died) has its group aborted (in
the background: the abort waits for the rest of the stream) and is posted at once, naming the
rank that does not answer (exchange.py), instead of waiting in NCCL for torch's group timeout.
A low-latency caller waits with `synchronize()` before a host read.
A construction that fails releases on this rank what it had acquired, the proxy threads stopped
first, then the launcher's mappings, buffers and context, last acquired first; a Buffer never
closed is released so at interpreter exit, before torch's teardown (lifetime.py).
"""

from __future__ import annotations

from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

from ....plan.bundle import Bundle, cuda_manifest
from ....plan.cuda_manifest import converts_in_kernel
from ....plan.cuda_manifest import reads_caller_rows as manifest_reads_caller_rows
from ....plan.rdma import rdma_steps
from ....plan.segments import segment_program
from ...layout import Layout, compute_layout
from ...layout.capacity import capacity_rows
from ..agree import Agreement
from ..base import EngineError, GroupError, KernelTimeout
from ..gpu_proxy.build import build_gpu
from ..gpu_proxy.channels import TRANSPORTS, from_placement, from_tables
from ..gpu_proxy.engine import GpuRdma
from ..gpu_proxy.watch import STALL_FRACTION, ProxyWatch, Watch, Watches, WatchFailed, wait_watched
from ..ipc_domain import ipc_peers, local_domain
from ..lifetime import Held, exit_hook, released_on_failure, track, untrack
from ..tensors import FP8_GROUP, WEIGHTS_DIFFER, check_tensor, check_token_count, device_view
from .exchange import Exchange, backstop_s
from .launcher import CudaError, Library, build_library, role_timeline
from .meta import ZERO_BLOCKS, DeviceMeta, routing_error
from .tables import PROGRAMS, build_tables

ALIGN_MAX = 1024  # largest expert_alignment (rows)
BUILD_S = 600.0  # how much longer than the timeout the others wait for rank 0's nvcc
ROW_ALIGN = 16  # bytes: a caller's rows the kernels read in place start at a multiple (their 16-byte loads)
# zero_partials' blocks beside the dispatch kernel: few enough to leave that kernel the SMs it needs
# (an h200x2_2vnode dispatch holds 20-28 of an H100's 132); its 0.23 GB of partials then take
# ~0.1-0.2 ms, under a dispatch of 1.2 ms at 50 GB/s
ZERO_BESIDE_BLOCKS = 32
ZERO_BESIDE_MIN_BLOCKS = 8  # fewer left beside the dispatch kernel: the combine clears them itself


class TableHandle:
    """What combine (and a cached dispatch) needs from a dispatch: its routing and shapes."""

    def __init__(self, index: int, layout: Layout | None, tokens: int, rows: int, topk_idx, topk_weights,
                 aligned_rows: torch.Tensor | None, sync: bool = True):
        self.dispatch_index = index
        self.sync = sync  # from a normal-mode dispatch (False: low latency, sync=False)
        self.layout = layout  # host metadata only
        self.tokens = tokens
        self.rows = rows  # rows recv_x had (with the alignment padding; the capacity with sync=False)
        self.topk_idx = topk_idx
        self.topk_weights = topk_weights
        self.aligned_rows = aligned_rows  # with expert_alignment: recv_x row of each output row


class CudaTableEngine:
    #: what a target's engine changes (runtime/engines/supa_shim): the backend's name in messages,
    #: where its kernels lie, how they are built, the launcher's C prefix, where kernels may write
    BACKEND = "cuda"
    ABI_PREFIX = "epcc_cuda"
    ERROR_ON_DEVICE = False  # the metadata exchange's error words: host-mapped (kernels may write host memory)

    def _manifest(self, bundle: Bundle) -> dict:
        return cuda_manifest(bundle.path)

    def _sources(self, bundle: Bundle):
        return bundle.cuda_dir

    def _build_library(self, src_dir, manifest: dict):
        return build_library(src_dir)

    def __init__(self, group, bundle: Bundle, *, timeout_s: float, config: dict | None = None,
                 agree: Agreement | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError(f"Buffer(backend='{self.BACKEND}'): no CUDA device is available")
        self.group = group
        self.rank = dist.get_rank(group)
        self.R = dist.get_world_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.agree = agree or Agreement.for_group(group, timeout_s)
        self.ctx = None
        self.rdma: list[GpuRdma] = []
        self._done = None  # the event the proxy path's watched wait polls
        self.own: dict[str, list[int]] = {}
        self.own_bytes: dict[str, list[int]] = {}  # per program, the size of each of `own`'s buffers
        self.opened: list[int] = []  # every CUDA IPC mapping this rank opened (closed by close())
        self.ipc_peers: frozenset[int] = frozenset()  # the ranks whose memory it maps (ipc_domain.py)
        # what the launcher allocated and mapped, released last acquired first (lifetime.py); the
        # proxy engines (self.rdma) are stopped before any of it
        self.held = Held()
        exit_hook()
        with released_on_failure(self.release_locally), self.agree.call("making the Buffer", numbered=False):
            self._make(bundle, timeout_s, config)
        track(self)

    def _make(self, bundle: Bundle, timeout_s: float, config: dict | None) -> None:
        self.plan = plan = bundle.plan
        self.manifest = manifest = self._manifest(bundle)
        wl = plan.workload
        self.hidden, self.topk, self.dtype, self.max_tokens = wl.hidden, wl.topk, wl.dtype, wl.tokens
        self.row_bytes = 2 * wl.hidden if wl.dtype == "bf16" else wl.hidden + wl.hidden // FP8_GROUP * 4
        self.programs = [p for p in PROGRAMS
                         if any(k["program"] == p and k["kind"] == "main" for k in manifest["kernels"])]
        self.proxy = manifest.get("options", {}).get("rdma") == "proxy"
        self.on_device = manifest.get("metadata", {}).get("lowering") == "device"
        config = dict(config or {})
        self.transport = config.pop("rdma_transport", "emulated")
        if config:
            raise ValueError(f"Buffer: config {sorted(config)} does not apply to the table-driven kernels (their SMs "
                             f"and chunks are the plan's; 'rdma_transport' picks the proxy path's transport)")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"Buffer: config rdma_transport must be one of {', '.join(TRANSPORTS)}, "
                             f"not {self.transport!r}")
        # which peers to map over CUDA IPC (ipc_domain.py), decided before anything is built
        self.domains = self.agree.gather("the ranks' CUDA IPC domains", local_domain(self.rank))
        self.ipc_peers = ipc_peers(plan, manifest, self.transport, self.domains, self.rank)
        self.timeout_s = timeout_s
        self.dispatches = 0
        self.layout: Layout | None = None  # host metadata: the layout whose tables are uploaded
        cuda_dir = self._sources(bundle)

        def build():
            lib = self._build_library(cuda_dir, manifest)
            proxy = build_gpu(cuda_dir / "rdma", self.transport) if self.proxy else None
            return lib, proxy

        build_wait = timeout_s + BUILD_S  # rank 0 builds first; the others find it in the cache
        paths = build() if self.rank == 0 else None
        self.agree.barrier("rank 0's build of the kernels", timeout_s=build_wait)
        if self.rank != 0:
            paths = build()
        self.agree.barrier("the kernels' build", timeout_s=build_wait)
        lib_path, self.proxy_lib = paths
        dev = self.device.index
        n_flags = sum(len(s.flows) for s in plan.steps if s.verb != "exchange")
        cap = capacity_rows(plan, self.max_tokens)
        self.lib = Library(str(lib_path), self.ABI_PREFIX)
        self.ctx = self.lib.create(dev, self.rank, 1 + 2 * max(n_flags, 1), timeout_s)
        self.held.push("the launcher's context", self.ctx.close)
        handles = {"flags": self.lib.ipc_handle(self.ctx.flag_area)}
        for p in self.programs:
            self.own_bytes[p] = [max(n, 1) for n in self._sizes(p, cap)]
            self.own[p] = [self._malloc(dev, n, f"a {p} buffer") for n in self.own_bytes[p]]
            handles[p] = [self.lib.ipc_handle(q) for q in self.own[p]]
        self.meta = None
        # the combine's partials were cleared, outside a CUDA graph's capture, since the last combine (_zero_beside)
        self.partials_clean = False
        self.zero_stream = None  # with device tables: the stream _zero_beside clears them on
        self.exchange = None  # the collective exchange: the engine's own, from here on (release_locally)
        if self.on_device:
            if manifest["metadata"].get("exchange") == "collective":  # its own group: a collective of every rank
                self.agree.barrier("the metadata exchange's process group")
                self.exchange = Exchange(self.group, timeout_s, bundle.path.name, self.device)
            self.meta = DeviceMeta(self.lib.lib, manifest, plan, segment_program(plan), self.rank, self.device,
                                   timeout_s, error_on_device=self.ERROR_ON_DEVICE, exchange=self.exchange)
            # the combine's partials are cleared beside each dispatch kernel, on a stream of their own
            # (_zero_beside), on the SMs that kernel leaves
            grid = max((k["grid"] for k in manifest["kernels"] if k["program"] == "dispatch" and k["kind"] == "main"
                        and isinstance(k["grid"], int)), default=0)
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self.zero_blocks = min(ZERO_BESIDE_BLOCKS, ZERO_BLOCKS, sms - grid)
            if self.zero_blocks >= ZERO_BESIDE_MIN_BLOCKS and "combine" in self.programs:  # else the combine does
                self.zero_stream = torch.cuda.Stream(self.device)
            if not self.meta.collective:  # the peers write their routing into it over CUDA IPC
                self.area = self._malloc(dev, self.meta.area_bytes, "the metadata's gather area")
                handles["area"] = self.lib.ipc_handle(self.area)
        everyone = self.agree.gather("the buffers' handles", handles)

        def peer(h: bytes, r: int, own: int) -> int:
            if r == self.rank:
                return own
            if r not in self.ipc_peers:  # another domain, and no copy of this rank's kernels reaches it
                return 0
            p = self.lib.ipc_open(dev, h)
            self.held.push(f"rank {r}'s memory mapped over CUDA IPC", self.lib.ipc_close, p)
            self.opened.append(p)
            return p

        stream = self._stream()
        self.ctx.set_flag_areas([peer(e["flags"], r, self.ctx.flag_area) for r, e in enumerate(everyone)])
        self.ptrs = {}
        for p in self.programs:
            self.ptrs[p] = [[peer(everyone[r][p][b], r, self.own[p][b]) for r in range(self.R)]
                            for b in range(len(self.own[p]))]
            self.ctx.set_buffers(p, self.ptrs[p], stream)
        names = {p: [b["name"] for b in manifest["buffers"][p]] for p in self.programs}
        self.input_ptr = self.own["dispatch"][names["dispatch"].index("input")]
        self.output_ptr = self.own["dispatch"][names["dispatch"].index("output")]
        self.y_ptr = self.own["combine"][names["combine"].index("output")] if "combine" in self.programs else 0
        self.caller_rows = reads_caller_rows(manifest, self.lib.has_caller_rows, self.programs)
        # the combine kernel writes the bf16 tokens itself (manifest combine_output): no finish kernel
        self.convert_in_kernel = converts_in_kernel(manifest) and self.lib.has_combine_prepare
        if self.meta is not None:
            if not self.meta.collective:
                self.meta.set_areas([peer(e["area"], r, self.area) for r, e in enumerate(everyone)], self.rank)
            for p in self.programs:
                self.ctx.use_tables(p, self.meta.blobs[p].data_ptr(), self.meta.headers[p], self.meta.blobs[p].numel())
            self.own_combine = torch.tensor(self.own.get("combine", [0]), dtype=torch.int64, device=self.device)
            cap_rows = self.meta.recv_w.numel()
            self.recv_view = device_view(self.output_ptr, cap_rows * self.row_bytes, torch.uint8,
                                         (cap_rows, self.row_bytes), self.device)
            if self.proxy:  # every channel any routing uses, set up once; the kernels number the chunks
                for p in self.meta.seq:
                    self._start_rdma(p, from_placement(manifest, self.meta.placements[p]), self.meta.seq[p].data_ptr())
        # the inputs' buffers as tensors, once (a call copies into a slice of them)
        self.input_view = device_view(self.input_ptr, self.max_tokens * self.row_bytes, torch.uint8,
                                      (self.max_tokens, self.row_bytes), self.device)
        self._finish(stream)  # watched where the collective exchange made its first all-gather
        self.agree.barrier("the buffers' mapping")  # every flag area and buffer exists (zeroed) before any launch

    # ------------------------------------------------------------------ helpers
    def _malloc(self, device: int, nbytes: int, what: str) -> int:
        p = self.lib.malloc(device, nbytes)
        self.held.push(what, self.lib.free, p)
        return p

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _sizes(self, program: str, cap: dict) -> list[int]:
        """Bytes of each buffer of `program` on this rank (manifest order) at its capacity."""
        out = []
        for b in self.manifest["buffers"][program]:
            rows = cap.get((program, b["name"], self.rank), 0)
            if program == "dispatch":
                out.append(rows * self.row_bytes)
            elif b["name"] == "output":
                out.append(rows * 2 * self.hidden)
            else:
                out.append(rows * 4 * self.hidden)
        return out

    def _report(self, e: Exception) -> Exception:
        """The report of a kernel, exchange or proxy that gave up, as one error."""
        detail = str(e)
        if isinstance(e, CudaError) and self.ctx is not None:
            _, msg = self.ctx.read_error()
            detail = msg or detail
        if self.meta is not None and self.meta.failure():
            detail = self.meta.failure() + "; " + detail
        for eng in self.rdma:
            if eng.failure():
                detail += "; " + eng.failure()
        return KernelTimeout(detail) if isinstance(e, KernelTimeout) or "timed out" in detail else EngineError(detail)

    def _routing_error(self, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None) -> str | None:
        """What is wrong with this rank's routing (the first bad row), or None (host metadata)."""
        E = self.plan.workload.experts
        if topk_idx.shape[0] == 0:
            return None
        idx = topk_idx.to(torch.int64)
        s, _ = torch.sort(idx, dim=1)
        bad = ((idx < -1) | (idx >= E)).any(1) | ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any(1)
        if topk_weights is not None:
            bad |= ~torch.isfinite(topk_weights).all(1)
        rows = torch.nonzero(bad).flatten()
        if rows.numel() == 0:
            return None
        t = int(rows[0])
        return (f"dispatch: topk_idx row {t} names an expert outside [-1, {E - 1}] or the same expert twice, or "
                f"its weights are not finite: {topk_idx[t].tolist()}")

    def _gather(self, T: int, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None):
        """Host metadata: every rank's token count, top-k indices and weights (padded to the
        bundle's tokens), in one round of the agreement."""
        K, Tm = self.topk, self.max_tokens
        idx = np.full((Tm, K), -1, dtype=np.int64)
        w = np.ones((Tm, K), dtype=np.float32)
        if T:
            idx[:T] = topk_idx.cpu().numpy()
            if topk_weights is not None:
                w[:T] = topk_weights.cpu().numpy()
        allr = self.agree.gather("the routings", (T, idx, w))
        tokens = np.array([a[0] for a in allr], dtype=np.int64)
        return np.stack([a[1] for a in allr]), np.stack([a[2] for a in allr]), tokens

    def _upload(self, layout: Layout) -> None:
        """Host metadata: this rank's tables of both programs for `layout` (and the proxy path's channels)."""
        stream = self._stream()
        tables = {p: build_tables(self.manifest, layout, p, self.rank) for p in self.programs}
        for p in self.programs:
            self.ctx.upload_tables(p, tables[p], stream)
        if self.proxy:  # the proxy path's channels follow the layout's chunks: set up anew
            torch.cuda.current_stream(self.device).synchronize()  # every launch with the old channels is done
            self._close_rdma()
            for p in self.programs:
                if not any(s.program == p for s in rdma_steps(self.plan)):
                    continue
                self._start_rdma(p, from_tables(self.manifest, tables[p].blob, p))
        self.layout = layout

    def _start_rdma(self, program: str, source, seq_dev: int = 0) -> None:
        """The GPU proxy path of `program` (gpu_proxy/engine.py), its thread started."""
        eng = GpuRdma(proxy_lib=str(self.proxy_lib), cuda_lib=self.lib, ctx=self.ctx, plan=self.plan,
                      manifest=self.manifest, source=source, program=program, rank=self.rank,
                      device=self.device.index, exchange=self._exchange, timeout_s=self.timeout_s,
                      transport=self.transport, seq_dev=seq_dev)
        self.rdma.append(eng)  # before its thread starts: whatever happens next, close() stops it
        eng.start()

    def _exchange(self, obj):
        return self.agree.gather(f"the proxy path's setup ({type(obj).__name__})", obj)

    def _close_rdma(self) -> None:
        """Stop and release every proxy engine (collective: with the NVSHMEM memory every rank frees
        together, in the same order); EngineError naming those that could not be (a thread that did
        not stop keeps what it may touch), after the others were."""
        failures = close_proxies(self.rdma, collective=True)
        self.rdma = []
        if failures:
            raise EngineError(f"rank {self.rank}: " + "; ".join(failures))

    def _abort_waits(self) -> None:
        """This rank's proxies stop and its collective exchange's group is aborted (a stuck
        all-gather returns; on a thread of its own, which the report does not wait for): nothing of
        this rank waits for a peer any more."""
        for eng in self.rdma:
            eng.abort_proxy()
        if self.exchange is not None:
            self.exchange.abort()

    def _watches(self) -> list[Watch]:
        """What the host looks at while it waits for a launch: the proxy path's proxies, the
        collective exchange's marks (exchange.py)."""
        watches: list[Watch] = []
        if self.rdma:
            watches.append(ProxyWatch(self.rdma, self.timeout_s * STALL_FRACTION))
        if self.exchange is not None:
            watches.append(self.exchange.watch())
        return watches

    def _finish(self, stream: int) -> None:
        """Wait for this rank's launches on `stream`; on the proxy path and with the collective
        exchange watched (watch.py): a failed or stalled proxy, an exchange a peer did not come to
        within the timeout and its peers' alarm end the wait at once."""
        watches = self._watches()
        if not watches:
            self.ctx.synchronize(stream)
            return
        if self._done is None:
            self._done = torch.cuda.Event()
        self._done.record(torch.cuda.current_stream(self.device))

        def done() -> bool:
            try:
                return self._done.query()
            except RuntimeError:  # a kernel trapped: the launcher's report (its error record) instead
                self.ctx.synchronize(stream)
                raise

        wait_watched(done, Watches(watches), self.agree, on_fail=self._abort_waits)

    def _fail_launch(self, e: Exception) -> NoReturn:
        """A launch failed on this rank, or a peer's did (a GroupError, already the group's): this
        rank's proxies stop and its exchange's group is aborted, and every rank raises the same
        GroupError."""
        if isinstance(e, GroupError):
            self._abort_waits()
            raise e
        report = e if isinstance(e, WatchFailed) else self._report(e)
        self._abort_waits()
        self.agree.fail(report)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x, topk_idx=None, topk_weights=None, *, sync: bool = True, expert_alignment: int = 1,
                 handle: TableHandle | None = None):
        with self.agree.call("dispatch"):
            try:
                rows, T, topk_idx, topk_weights = self._dispatch_args(x, topk_idx, topk_weights, sync,
                                                                      expert_alignment, handle)
                if not self.on_device and handle is None:
                    err = self._routing_error(topk_idx, topk_weights)
                    if err:
                        raise ValueError(err)
            except Exception as e:  # noqa: BLE001 - refused before anything moved: every rank raises it
                if sync or not self.on_device:  # the peers meet it in their verdict round: the Buffer stays usable
                    self.agree.fail(e)
                self.agree.fail(e, wait_s=0, fatal=True)  # low latency: the peers are in their kernels already
            if self.on_device:
                if sync:
                    self.agree.barrier("the dispatch's arguments")  # every rank's verdict before any launch
                return self._dispatch_device(rows, T, topk_idx, topk_weights, sync, expert_alignment)
            return self._dispatch_host(rows, T, topk_idx, topk_weights, expert_alignment, handle)

    def _dispatch_args(self, x, topk_idx, topk_weights, sync: bool, expert_alignment: int, handle):
        """The argument checks, before anything touches the GPU."""
        if not sync and not self.on_device:
            raise ValueError(f"dispatch: sync=False (the low-latency, CUDA-graph capturable mode) needs the layout "
                             f"computed on the GPU; this bundle's tables come from the host "
                             f"({self.manifest.get('metadata', {}).get('why', 'compiled by an older epcc')}): use "
                             f"sync=True")
        if isinstance(expert_alignment, bool) or not isinstance(expert_alignment, int) \
                or not 1 <= expert_alignment <= ALIGN_MAX:
            raise ValueError(f"dispatch: expert_alignment must be an integer in [1, {ALIGN_MAX}], "
                             f"got {expert_alignment!r}")
        if not sync and expert_alignment != 1:
            raise ValueError("dispatch: expert_alignment needs sync=True with the table-driven kernels (the padded "
                             "rows are laid out from the counts)")
        if handle is not None:
            if not isinstance(handle, TableHandle):
                raise TypeError("dispatch: handle must be a handle an earlier dispatch of this Buffer returned")
            if topk_idx is not None:
                raise ValueError("dispatch: give topk_idx or handle, not both")
            topk_idx, topk_weights = handle.topk_idx, handle.topk_weights
        if topk_idx is None:
            raise TypeError("dispatch: topk_idx is required (or a handle from an earlier dispatch)")
        rows, T = self._rows(x)
        check_token_count(T, self.max_tokens)
        check_tensor("dispatch", "topk_idx", topk_idx, (T, self.topk), (torch.int64, torch.int32), self.device)
        if topk_weights is not None:
            check_tensor("dispatch", "topk_weights", topk_weights, (T, self.topk), (torch.float32,), self.device)
        return rows, T, topk_idx, topk_weights

    def _dispatch_host(self, rows, T: int, topk_idx, topk_weights, expert_alignment: int, handle):
        if handle is not None and handle.layout is not None:
            layout = handle.layout
            self.agree.barrier("the dispatch's arguments")  # every rank's verdict before any launch
        else:
            idx_all, w_all, tokens = self._gather(T, topk_idx, topk_weights)
            layout = compute_layout(self.plan, idx_all, w_all, tokens)  # the same on every rank
        try:
            if layout is not self.layout:
                self._upload(layout)
            stream = self._stream()
            self.ctx.launch_dispatch(stream, self._dispatch_input(rows, T))
            n = layout.buffer_rows("output", self.rank)
            got = device_view(self.output_ptr, n * self.row_bytes, torch.uint8, (n, self.row_bytes),
                              self.device).clone()
            self._finish(stream)
        except (CudaError, KernelTimeout, RuntimeError) as e:  # a GroupError too: a peer failed first
            self._fail_launch(e)
        self.dispatches += 1
        counts = [int(c) for c in layout.recv_counts[self.rank]]
        entries = layout.entries[("output", self.rank)]
        idx = torch.from_numpy(np.ascontiguousarray(entries[:, 2], dtype=np.int64)).to(self.device)
        w = torch.from_numpy(np.ascontiguousarray(layout.output_weights[self.rank], dtype=np.float32)).to(self.device)
        return self._outputs(got, idx, w, counts, T, layout, topk_idx, topk_weights, expert_alignment)

    def _dispatch_device(self, rows, T: int, topk_idx, topk_weights, sync: bool, expert_alignment: int):
        stream = self._stream()
        if sync:  # a rank held up since the arguments' round hears a peer's failure, not its dead kernels
            self.agree.heed()
        try:
            cur = torch.cuda.current_stream(self.device)
            self.meta.run(T, topk_idx, topk_weights, cur)
            # this dispatch's tables written: the combine's zero list among them
            tables = cur.record_event() if self.zero_stream is not None else None
            self.ctx.launch_dispatch(stream, self._dispatch_input(rows, T))
            if tables is not None:
                self._zero_beside(tables, cur)
        except (CudaError, KernelTimeout, EngineError) as e:  # the exchange's own timeout too (ExchangeTimeout)
            self._fail_launch(e)
        self.dispatches += 1
        m = self.meta
        if not sync:
            rx = self._unpack(self.recv_view)
            h = TableHandle(self.dispatches, None, T, self.recv_view.shape[0], topk_idx, topk_weights, None,
                            sync=False)
            return rx, None, m.recv_w, (m.recv_count, m.recv_offset), h, None
        try:
            self._finish(stream)  # on the proxy path watched: a stalled proxy or a peer's alarm ends it
            counts = m.recv_count.cpu().tolist()  # the one host sync of the normal mode
            bad = int(m.bad.cpu()[0])
        except (CudaError, KernelTimeout, RuntimeError) as e:  # a kernel trapped, or a peer failed first
            self._fail_launch(e)
        err = routing_error(bad, topk_idx, self.plan.workload.experts)
        # every rank's kernels finished (the bad entries ignored): a refusal leaves the Buffer usable
        self.agree.verdicts("the dispatch's read-back", ValueError(err) if err else None)
        n = int(sum(counts))
        got = self.recv_view[:n].clone()
        return self._outputs(got, m.recv_idx[:n].clone(), m.recv_w[:n].clone(), counts, T, None, topk_idx,
                             topk_weights, expert_alignment)

    def _outputs(self, got, idx, w, counts, T, layout, topk_idx, topk_weights, expert_alignment: int):
        aligned = None
        if expert_alignment > 1:
            got, idx, w, aligned = _align_rows(got, idx, w, counts, expert_alignment)
        recv_x = self._unpack(got)
        h = TableHandle(self.dispatches, layout, T, got.shape[0], topk_idx, topk_weights, aligned)
        return recv_x, idx, w, counts, h, None

    def _rows(self, x) -> tuple[torch.Tensor, int]:
        """x as wire rows (uint8 [T, row_bytes], on the device) and its token count."""
        H = self.hidden
        if self.dtype == "fp8":
            if not (isinstance(x, tuple) and len(x) == 2):
                raise TypeError("dispatch: this bundle dispatches fp8: pass x as (x_fp8, scales)")
            x8, sc = x
            check_tensor("dispatch", "x_fp8", x8, (None, H), (torch.float8_e4m3fn,), self.device)
            T = x8.shape[0]
            check_tensor("dispatch", "scales", sc, (T, H // FP8_GROUP), (torch.float32,), self.device)
            if T == 0:
                return torch.zeros((0, self.row_bytes), dtype=torch.uint8, device=self.device), 0
            return torch.cat([x8.view(torch.uint8), sc.view(torch.uint8)], dim=1), T
        if isinstance(x, tuple):
            raise TypeError("dispatch: this bundle dispatches bf16: pass x as one [tokens, hidden] bfloat16 tensor")
        check_tensor("dispatch", "x", x, (None, H), (torch.bfloat16,), self.device)
        T = x.shape[0]
        if T == 0:
            return torch.zeros((0, self.row_bytes), dtype=torch.uint8, device=self.device), 0
        return x.view(torch.uint8), T

    def _unpack(self, rows: torch.Tensor):
        H = self.hidden
        if self.dtype == "fp8":
            return rows[:, :H].view(torch.float8_e4m3fn), rows[:, H:].view(torch.float32)
        return rows.view(torch.bfloat16) if rows.shape[0] else torch.zeros((0, H), dtype=torch.bfloat16,
                                                                             device=self.device)

    def check_routing(self, topk_idx=None) -> None:
        """Raise if the last dispatch met a bad top-k row (for sync=False callers); syncs (watched,
        where a launch is: `synchronize`)."""
        if self.meta is None:
            return
        if self.rdma or self.exchange is not None:  # what _watches watches: not a blocking read behind a
            # stalled proxy or an exchange a peer never came to
            self.synchronize()
        bad = int(self.meta.bad.cpu()[0])
        if bad < self.max_tokens:
            row = topk_idx[bad].tolist() if topk_idx is not None else "?"
            raise ValueError(f"dispatch: topk_idx row {bad} names an expert outside "
                             f"[-1, {self.plan.workload.experts - 1}] or the same expert twice: {row}")

    # ------------------------------------------------------------------ combine
    def combine(self, y: torch.Tensor, handle: TableHandle, topk_weights: torch.Tensor | None = None) -> torch.Tensor:
        with self.agree.call("combine"):
            try:
                y, out = self._combine_args(y, handle, topk_weights)
            except Exception as e:  # noqa: BLE001 - refused before the launch: the peers' kernels wait for this rank
                self.agree.fail(e, wait_s=0, fatal=True)
            try:
                stream = self._stream()
                rows = self._combine_input(y, handle, stream)
                out_ptr = out.data_ptr() if handle.tokens else 0
                if self.meta is not None:
                    if not self.partials_clean or capturing():
                        # no dispatch cleared them since the last combine, or a graph's replays need their own
                        # (the launch counts the rows' contributions itself: nothing prepared since the last)
                        self.meta.zero_partials(self.own_combine.data_ptr(), stream)
                    self.partials_clean = False
                    self.ctx.launch_combine_tokens(out_ptr, handle.tokens, stream, rows)
                    if self.rdma and handle.sync and not torch.cuda.is_current_stream_capturing():
                        self._finish(stream)  # normal mode on the proxy path: see the module docstring
                else:
                    if rows:  # host tables: this rank's tokens are the tables' (layout.rank_tokens)
                        self.ctx.launch_combine_tokens(out_ptr, handle.tokens, stream, rows)
                    else:
                        self.ctx.launch_combine(out_ptr, stream)
                    self._finish(stream)
            except (CudaError, KernelTimeout, EngineError, RuntimeError) as e:  # a GroupError too: a peer's
                self._fail_launch(e)
            return out

    def _zero_beside(self, tables: torch.cuda.Event, cur: torch.cuda.Stream) -> None:
        """The combine's partial buffers cleared beside the dispatch kernel just launched: on the
        engine's zero stream once `tables` (the metadata of this dispatch: the combine's zero list)
        are written, with zero_blocks blocks, then joined back into `cur`, so that whatever the caller
        runs next there (a CUDA graph's capture too) comes after it; there too each row's
        contributions are counted for a combine that writes the bf16 tokens in its kernel
        (combine_prepare).  The next combine then clears nothing itself (partials_clean) -- where
        neither it nor this dispatch is captured into a CUDA graph: a captured combine records its
        own clearing (and the launcher its own count, as in any combine nothing was prepared for),
        since its replays need not follow a dispatch that cleared.  No peer touches this rank's partials by then: `tables` comes after
        this dispatch's metadata exchange, which every peer joins only after its previous combine
        kernel ended (stream order on its side), and this rank's previous combine is before it on
        `cur`; the peers' next writes come after the next combine's entry barrier, after the join.
        Measured 2 x H100, 2026-11-27 (h200x2_2vnode_50): the combine's own clearing took ~0.09 ms."""
        z = self.zero_stream
        z.wait_event(tables)
        self.meta.zero_partials(self.own_combine.data_ptr(), z.cuda_stream, self.zero_blocks)
        self.ctx.combine_prepare(z.cuda_stream)  # each row's contributions, where the kernel converts rows itself
        cur.wait_stream(z)
        self.partials_clean = not capturing()

    def _dispatch_input(self, rows: torch.Tensor, T: int) -> int:
        """Where the dispatch kernel reads this rank's tokens: `rows` itself (x, or x_fp8 and its
        scales side by side: its address, returned: a launch argument, which a CUDA graph captures)
        where the bundle allows it (`caller_rows`: manifest dispatch_input) and they can be read in
        place (caller_rows_usable) and do not lie in this rank's dispatch buffers (a low-latency
        recv_x passed back: the kernels write there); else 0, after they are copied into the
        dispatch's input buffer."""
        if T and self.caller_rows["dispatch"] and caller_rows_usable(rows) and not self._in_own(rows, "dispatch"):
            return rows.data_ptr()
        if T:
            self.input_view[:T].copy_(rows)
        return 0

    def _in_own(self, t: torch.Tensor, program: str) -> bool:
        """Whether `t`'s bytes overlap one of this rank's buffers of `program`, which its kernels write."""
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        return any(lo < p + n and p < hi for p, n in zip(self.own.get(program, ()), self.own_bytes.get(program, ())))

    def _combine_input(self, y: torch.Tensor, handle: TableHandle, stream: int) -> int:
        """Where the combine kernel reads this rank's expert rows: `y` itself (its address, returned:
        a launch argument, which a CUDA graph captures, so a replay reads the captured tensor) where
        the bundle allows it (`caller_rows`: manifest combine_input) and y is a contiguous bf16
        [rows, hidden] tensor on this device, 16-byte aligned; else 0, after y is copied into the combine's input
        buffer (low latency: only the rows received)."""
        n = y.shape[0]
        if (self.caller_rows["combine"] and n and y.dtype == torch.bfloat16 and y.device == self.device
                and y.dim() == 2 and y.shape[1] == self.hidden and caller_rows_usable(y)
                and not self._in_own(y, "combine")):
            return y.data_ptr()
        if self.meta is not None and handle.layout is None and n == self.recv_view.shape[0]:
            # low latency: y is the whole receive buffer; only the rows received count
            self.meta.copy_rows(self.y_ptr, y.data_ptr(), 2 * self.hidden, stream)
        elif n:
            device_view(self.y_ptr, n * 2 * self.hidden, torch.bfloat16, (n, self.hidden), self.device).copy_(y)
        return 0

    def _combine_args(self, y, handle, topk_weights):
        if not isinstance(handle, TableHandle):
            raise TypeError(f"combine: handle must be the handle dispatch returned, not {type(handle).__name__}")
        given = handle.topk_weights
        if topk_weights is not None and not (
                isinstance(topk_weights, torch.Tensor) and given is not None and topk_weights.shape == given.shape
                and torch.equal(topk_weights.to(given.device, given.dtype), given)):
            if not (given is None and isinstance(topk_weights, torch.Tensor) and bool((topk_weights == 1).all())):
                raise ValueError(WEIGHTS_DIFFER)
        if handle.dispatch_index != self.dispatches:
            raise ValueError(f"combine: handle is from dispatch #{handle.dispatch_index}, but this Buffer has run "
                             f"dispatch #{self.dispatches} since; dispatch again (or with handle=) first")
        if "combine" not in self.programs:
            raise ValueError("combine: the bundle has no combine program")
        check_tensor("combine", "x", y, (handle.rows, self.hidden), (torch.bfloat16,), self.device)
        if handle.aligned_rows is not None:
            y = y.index_select(0, handle.aligned_rows)
        out = torch.empty((handle.tokens, self.hidden), dtype=torch.bfloat16, device=self.device)
        return y, out

    # ------------------------------------------------------------------ what the bench reads
    def enable_timeline(self) -> None:
        """Stamp every block of every later launch (Context.enable_timeline); `read_timeline`."""
        for p in self.programs:
            self.ctx.enable_timeline(p)

    def read_timeline(self) -> dict:
        """Per program, when each role ran in the last launch (launcher.role_timeline)."""
        self.synchronize()
        return {p: role_timeline(self.manifest, p, self.ctx.read_timeline(p)) for p in self.programs}

    def rdma_stats(self) -> dict:
        """Per program with RDMA steps, the proxy path's transport counters (GpuRdma.stats)."""
        return {eng.program: eng.stats() for eng in self.rdma}

    def rdma_summary(self) -> list[str]:
        return [eng.summary for eng in self.rdma]

    def synchronize(self) -> None:
        """Wait for this rank's kernels; a failure reaches every rank as one GroupError."""
        self.agree.check()
        try:
            self._finish(self._stream())
            torch.cuda.current_stream(self.device).synchronize()
        except (CudaError, KernelTimeout, RuntimeError) as e:  # a GroupError too: a peer failed first
            self._fail_launch(e)

    def close(self) -> None:
        """Collective: every rank's kernels finish before any buffer is unmapped and freed.  A
        failed Buffer (or one whose peer fails during the close) meets no peer: its proxies are
        stopped and its exchange aborted on this rank, and its memory stays until the process ends,
        as at exit and as the direct engine's does: a peer's kernel or proxy may still write into it."""
        if self.ctx is None:
            return
        untrack(self)
        exchange = self.exchange
        with released_on_failure(lambda: self.release_locally(keep_memory=True)):  # a peer failed meanwhile
            if self.agree.state == "ready":
                with self.agree.call("close", numbered=False):
                    if exchange is not None:  # a low-latency exchange no peer came to is reported, not waited for
                        self._finish(self._stream())
                    torch.cuda.synchronize(self.device)
                    self.agree.barrier("the kernels' end, on every rank")
                    self._close_rdma()
                    self.agree.barrier("the proxies' end")  # no peer's proxy writes into this rank any more
                    if exchange is not None:
                        exchange.close()  # every rank's last exchange is done
        failures = self.release_locally(keep_memory=self.agree.state != "ready")
        if failures:
            raise EngineError(f"closing the Buffer on rank {self.rank}: " + "; ".join(failures))

    def release_locally(self, keep_memory: bool = False) -> list[str]:
        """Release everything on this rank alone, without meeting the peers (a failed construction,
        a failed Buffer's close, the interpreter's exit): the proxy threads stopped first (one that
        does not stop keeps what it may touch), then what they and the launcher allocated and
        mapped, last acquired first; with `keep_memory` the threads are only stopped (and the
        exchange aborted).  Returns what could not be released."""
        failures = stop_proxies(self.rdma) if keep_memory else close_proxies(self.rdma, collective=False)
        # the exchange's group (None where the construction failed before it; made before the metadata,
        # so one that failed after it has the group and no DeviceMeta): aborted on this rank alone (after
        # close(): nothing left), its abort thread (begun here or at the failure) joined, memory kept or
        # not, so no thread of it is inside NCCL when the buffers go or the interpreter ends
        exchange = getattr(self, "exchange", None)
        if exchange is not None:
            exchange.abort()
            exchange.join(backstop_s(self.timeout_s))
        if not keep_memory:
            failures += self.held.release()
            self.opened, self.own, self.ctx = [], {}, None
        self.rdma = []
        return failures

    def release_at_exit(self) -> None:
        """The interpreter exits with this Buffer open (lifetime.py): its proxies stop; its memory is
        released only where the Buffer is still usable (a failed Buffer's peers may still write into
        it: the process's end reclaims it)."""
        failures = self.release_locally(keep_memory=self.agree.state != "ready")
        if failures:
            raise EngineError("; ".join(failures))


def close_proxies(engines: list[GpuRdma], collective: bool) -> list[str]:
    """Close every proxy engine, in order, even after one that fails; what failed, one line each."""
    return _each(engines, lambda eng: eng.close(collective=collective))


def stop_proxies(engines: list[GpuRdma]) -> list[str]:
    """Stop (abort) every proxy engine's thread, their memory kept; what failed, one line each."""
    return _each(engines, lambda eng: eng.stop_thread(abort=True))


def _each(engines: list[GpuRdma], act) -> list[str]:
    failures = []
    for eng in engines:
        try:
            act(eng)
        except Exception as e:  # noqa: BLE001 - the other proxies must still stop
            failures.append(f"{eng.program}'s proxy: {e}")
    return failures


def reads_caller_rows(manifest: dict, library_can: dict[str, bool], programs) -> dict[str, bool]:
    """Per program, whether a call hands the kernel the caller's rows (the dispatch's tokens, the
    combine's expert rows) instead of copying them into the program's input buffer: the bundle has
    the program, its manifest says its kernels may (dispatch_input, combine_input, decided by the
    compiler: backends/cuda/codegen.py caller_input; absent in a bundle of an older epcc) and its
    library has the entry point."""
    return {p: p in programs and library_can.get(p, False) and manifest_reads_caller_rows(manifest, p)
            for p in PROGRAMS}


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def caller_rows_usable(t: torch.Tensor) -> bool:
    """Whether a kernel may read `t`'s rows in place: contiguous, its address a multiple of
    ROW_ALIGN (the kernels' 16-byte vector loads)."""
    return t.is_contiguous() and t.data_ptr() % ROW_ALIGN == 0


def _align_rows(rows: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, counts: list[int], align: int):
    """The rows with every expert's first row at a multiple of `align` (zero rows between): the
    padded rows, experts (-1 on padding), weights (0 on padding), and each output row's padded row."""
    starts, pos = [], 0
    for n in counts:
        starts.append(pos)
        pos += -(-n // align) * align
    where = torch.cat([torch.arange(s, s + n, dtype=torch.int64) for s, n in zip(starts, counts)]) if counts else \
        torch.zeros(0, dtype=torch.int64)
    where = where.to(rows.device)
    out = torch.zeros((pos, rows.shape[1]), dtype=rows.dtype, device=rows.device)
    out[where] = rows
    pidx = torch.full((pos,), -1, dtype=idx.dtype, device=idx.device)
    pidx[where] = idx
    pw = torch.zeros((pos,), dtype=w.dtype, device=w.device)
    pw[where] = w
    return out, pidx, pw, where
