"""The `cuda` backend of `epcc.runtime.Buffer`: the bundle's direct kernels on NVIDIA GPUs (the
Engine protocol, runtime/engines/base.py).

One process per GPU (torchrun), `torch.cuda.set_device(local_rank)` before the Buffer is made.
At construction every rank allocates one peer region (the size the manifest gives: meta areas,
tails, records, the expert-major receive buffer, the combine staging), exchanges CUDA IPC
handles (a round of the Buffer's agreement, below) and maps its peers' regions: the direct
kernels run inside one CUDA IPC domain (one host), and ranks that span several
(runtime/engines/ipc_domain.py) are refused before anything is built, with the rule and the fix.  The library is
built with nvcc on first use and cached by content hash (library.py, runtime/build_cache.py);
rank 0 builds first while the others wait (up to BUILD_S beyond the timeout), then everyone loads
the cached file.

Calls are stream-ordered on the current torch stream and every rank must make the same calls in
the same order (they are collectives).  Three ways to call dispatch:

* `dispatch(..., sync=True)` (normal): after the kernels, the per-expert counts are read back
  (one host sync, as DeepEP's normal mode), routing errors are raised, and recv_x is returned
  trimmed to the rows received.
* `dispatch(..., sync=False)` (low latency, CUDA-graph capturable): no host sync and no
  allocation; recv_x is the whole receive buffer [capacity, hidden] and the counts/offsets are
  device tensors.  Bad routing cannot be raised without a sync: such entries are ignored by the
  kernels and reported by the next `check_routing()`.
* `dispatch(x, handle=h)` (cached): the routing of an earlier dispatch.  When h's routing is the
  one whose metadata the GPU holds (no dispatch with other routing since, the same tokens and
  alignment) the dispatch launches no metadata kernel (Args.cached); otherwise the metadata is
  computed again from h's routing.

Token-major bundles (the workload's `layout token`: DeepEP's intranode output, epcc/direct/token.cuh)
return one row per (source rank, token) in that order, recv_topk_idx / recv_topk_weights [rows,
topk] (local expert ids, -1 and weight 0 where the expert is on another rank), the tokens per local
expert rounded up to `expert_alignment` (DeepEP's num_recv_tokens_per_expert_list; with sync=False
the device tensors (counts, first row of each source rank then the total)); combine sums each
token's rows at its home rank, unweighted.

recv_x (and the fp8 scales, and recv weights) are views into the peer region: valid until the
next dispatch on this Buffer, like DeepEP's low-latency buffers.  Copy them to keep them.

Failures (agree.py; every rank raises the same GroupError, naming the rank that failed and why):

* every host-side exchange (the build, the IPC handles, close) is a bounded round of the Buffer's
  agreement, never a torch collective (an NCCL one cannot be interrupted);
* a call's arguments are checked before its launch; a rank that refuses them launches nothing and
  raises at once, posting its reason where its peers will look;
* normal mode (`sync=True`) ends in a round after the read-back: a top-k row the kernels found bad
  on one rank reaches every rank there (nothing hung; the Buffer stays usable), and a rank whose
  kernel gave up (the report read from the host-mapped error record) posts it there too;
* a kernel's bounded wait for a peer that refused, stalled or died gives up after the timeout and
  traps (the CUDA context is lost: a new process); the rank then hears, within a short grace, why
  the peer did not come.  The low-latency mode takes no round: its failures surface at the next
  `synchronize()` or normal-mode call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ....plan.bundle import Bundle, cuda_manifest
from ....plan.direct import DirectConfig, DirectError
from ..agree import Agreement
from ..base import GroupError, KernelTimeout
from ..ipc_domain import local_domain, one_domain
from ..lifetime import Held, exit_hook, released_on_failure, track, untrack
from ..tensors import WEIGHTS_DIFFER, check_tensor, check_token_count, device_view
from .library import DirectLibrary, DirectRuntimeError, build, timeline_summary

#: How much longer than the timeout the other ranks wait for rank 0 to build the kernels (nvcc;
#: once per machine and bundle, then the build cache has them).
BUILD_S = 600.0


@dataclass
class CudaHandle:
    """What combine needs from the dispatch it reverses (the routing stays on the GPU)."""

    dispatch_index: int
    tokens: int
    rows: int  # rows recv_x had (trimmed total, or the capacity with sync=False)
    topk_idx: torch.Tensor | None = None  # the routing, for a cached-handle dispatch
    topk_weights: torch.Tensor | None = None
    meta_index: int = 0  # the dispatch whose metadata (on the GPU) this routing's is
    alignment: int = 1


class CudaDirectEngine:
    def __init__(self, group, bundle: Bundle, *, timeout_s: float, config: dict | None = None,
                 agree: Agreement | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("Buffer(backend='cuda'): no CUDA device is available")
        self.group = group
        self.rank = dist.get_rank(group)
        self.R = dist.get_world_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.agree = agree or Agreement.for_group(group, timeout_s)
        self.bases: list[int] = []
        self.held = Held()  # the region, the peers' mapped, the error record: released last first (lifetime.py)
        exit_hook()
        with released_on_failure(self.release_locally), self.agree.call("making the Buffer", numbered=False):
            self._make(bundle, timeout_s, config)
        track(self)

    def _make(self, bundle: Bundle, timeout_s: float, config: dict | None) -> None:
        cuda_dir = bundle.cuda_dir
        plan = bundle.plan
        self.manifest = cuda_manifest(bundle.path)
        if "direct" not in self.manifest:
            raise DirectError(f"{bundle.path}: the cuda backend of Buffer runs one-hop plans; this one is not "
                              f"({self.manifest.get('direct_not_used', '?')})")
        entry = self.manifest["direct"]
        cfg = dict(entry["config"])
        tuned = cuda_dir / "tuned.json"
        if tuned.is_file():
            cfg.update(json.loads(tuned.read_text(encoding="utf-8")).get("config", {}))
        cfg.update(config or {})
        self.config = DirectConfig.from_dict(cfg)
        c = entry["constants"]
        self.config.check()
        self.c = c
        self.plan = plan
        # every rank maps every peer's region: one CUDA IPC domain, refused before the build otherwise
        one_domain(self.agree.gather("the ranks' CUDA IPC domains", local_domain(self.rank)),
                   f"{bundle.path}: the direct kernels (a one-hop plan)")
        # build: rank 0 first (the others find it in the cache); a rank that fails posts why in
        # the round the others wait in (agree.py), so every rank raises it, none hangs
        build_wait = timeout_s + BUILD_S
        lib_path = build(cuda_dir, self.manifest) if self.rank == 0 else None
        self.agree.barrier("rank 0's build of the kernels", timeout_s=build_wait)
        if self.rank != 0:
            lib_path = build(cuda_dir, self.manifest)
        self.agree.barrier("the kernels' build", timeout_s=build_wait)
        self.lib = DirectLibrary(lib_path, self.manifest)
        self.lib.init(self.config.warps)
        self.lib.prepare()
        self.region = self.lib.malloc(self.lib.region_bytes)
        self.held.push("the peer region", self.lib.free, self.region)
        handles = self.agree.gather("the peer regions' handles", self.lib.ipc_handle(self.region))
        bases = []
        for r, h in enumerate(handles):
            if r == self.rank:
                bases.append(self.region)
                continue
            bases.append(self.lib.ipc_open(h))
            self.held.push(f"rank {r}'s region mapped over CUDA IPC", self.lib.ipc_close, bases[-1])
        self.bases = bases
        self.err_host, self.err_dev = self.lib.error_record()
        self.held.push("the error record", self.lib.free_host, self.err_host)
        self.timeout_ns = int(timeout_s * 1e9)
        offs = dict(entry["constants"].get("offsets_named", {}))
        self.off = offs
        self.state_off = self.lib.state_offsets
        self.dispatches = 0
        # views of the peer region, made once (a call must not pay for them: low-latency mode)
        cap, H, epr = c["capacity"], c["hidden"], c["experts_per_rank"]
        if c["dtype"] == "fp8":
            self.recv_x = (self.region_view("OFF_RECV_X", cap * c["x_bytes"], torch.float8_e4m3fn, (cap, H)),
                           self.region_view("OFF_RECV_S", cap * c["scale_bytes"], torch.float32, (cap, H // 128)))
        else:
            self.recv_x = self.region_view("OFF_RECV_X", cap * c["x_bytes"], torch.bfloat16, (cap, H))
        # token-major (DeepEP's layout): one row per (source rank, token), each row's top-k ids and weights
        self.token_major = c.get("layout") == "token"
        if self.token_major:
            K = c["topk"]
            self.recv_w = self.region_view("OFF_RECV_W", cap * K * 4, torch.float32, (cap, K))
            self.recv_idx = self.region_view("OFF_RECV_IDX", cap * K * 8, torch.int64, (cap, K))
            self.src_offset = self.state_view("src_offset", self.R + 1)
        else:
            self.recv_w = self.region_view("OFF_RECV_W", cap * 4, torch.float32, (cap,))
        self.meta_index = 0  # the dispatch whose metadata the GPU holds (a cached handle of it skips the metadata)
        self.captured = False  # a dispatch was captured in a CUDA graph: metadata is never skipped again
        self.recv_count = self.state_view("recv_count", epr)
        self.recv_offset = self.state_view("recv_offset", epr + 1)
        self.bad_token = self.state_view("bad_token", 1)
        self._args = self.args()
        self.agree.barrier("the peer regions' mapping")

    # ------------------------------------------------------------------ helpers
    def region_view(self, name: str, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
        return device_view(self.region + self.off[name], nbytes, dtype, tuple(shape), self.device)

    def state_view(self, field: str, count: int) -> torch.Tensor:
        return device_view(self.region + self.off["OFF_STATE"] + self.state_off[field], 4 * count, torch.int32,
                     (count,), self.device)

    def args(self, **kw):
        """The kernels' argument block: built once, per-call fields (and the configuration, which
        `epcc tune` changes between calls) written into it before each launch."""
        a = getattr(self, "_args", None)
        if a is None:
            a = self.lib.Args()
            for r, b in enumerate(self.bases):
                a.base[r] = b
            a.me = self.rank
            a.timeout_ns = self.timeout_ns
            a.err = self.err_dev
        cfg = self.config
        a.C, a.NSB, a.NR, a.W = cfg.channels(kw.get("T")), cfg.send_blocks, cfg.recv_blocks, cfg.warps
        a.NS, a.ND = cfg.combine_send_blocks, cfg.combine_reduce_blocks
        a.align = 1
        a.cached = 0
        for k, v in kw.items():
            setattr(a, k, v)
        return a

    def enable_timeline(self, on: bool = True) -> None:
        """Stamp every block's start and every warp's end (%globaltimer) from the next call on;
        `read_timeline` turns the stamps into per-role times.  Off again with on=False."""
        c = self.c
        if on:
            self._timeline = torch.zeros(2 * c["timeline_blocks"] * c["timeline_words"], dtype=torch.int64,
                                         device=self.device)
            self._args.timeline = self._timeline.data_ptr()
        else:
            self._timeline = None
            self._args.timeline = 0

    def read_timeline(self) -> dict:
        """Per kernel and role: ms to its first block's start, its median and last warp end."""
        if getattr(self, "_timeline", None) is None:
            raise RuntimeError("read_timeline: call enable_timeline() before the stamped dispatch and combine")
        torch.cuda.synchronize(self.device)
        raw = self._timeline.cpu().tolist()
        return timeline_summary(raw, self.config, self.c["timeline_blocks"], self.c["timeline_words"])

    def raise_if_failed(self) -> None:
        msg = self.lib.read_error(self.err_host, self.plan.rank_names or None)
        if msg:
            raise KernelTimeout(msg)

    def close(self) -> None:
        """Collective: every rank's kernels finish (peers may still write into this rank's region
        until theirs do) before any region is unmapped and freed.  A failed Buffer keeps its
        region until the process ends: a peer's kernel may still write into it."""
        untrack(self)
        if not self.bases or self.agree.state != "ready":
            return
        with self.agree.call("close", numbered=False):
            self.synchronize()
            self.agree.barrier("the kernels' end, on every rank")
        failures = self.release_locally()
        if failures:
            raise DirectRuntimeError(f"closing the Buffer on rank {self.rank}: " + "; ".join(failures))

    def release_locally(self) -> list[str]:
        """Release the region, the peers' mapped and the error record on this rank alone, last
        acquired first (a failed construction, the interpreter's exit); what could not be."""
        self.bases = []
        return self.held.release()

    def release_at_exit(self) -> None:
        """The interpreter exits with this Buffer open (lifetime.py): released here where it is still
        usable; a failed Buffer's region stays until the process ends (a peer's kernel may still
        write into it)."""
        if self.agree.state == "ready":
            failures = self.release_locally()
            if failures:
                raise DirectRuntimeError("; ".join(failures))

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x, topk_idx=None, topk_weights=None, *, sync: bool = True, expert_alignment: int = 1,
                 handle: CudaHandle | None = None):
        with self.agree.call("dispatch"):
            try:
                a, topk_idx, topk_weights, T, fp8 = self._dispatch_args(x, topk_idx, topk_weights, expert_alignment,
                                                                        handle)
            except Exception as e:  # noqa: BLE001 - refused before the launch
                if sync:  # the peers meet it in their verdict round below: nobody launches, the Buffer stays usable
                    self.agree.fail(e)
                self.agree.fail(e, wait_s=0, fatal=True)  # low latency: the peers are in their kernels already
            if sync:
                self.agree.barrier("the dispatch's arguments")  # every rank's verdict before any launch
            return self._dispatch(a, topk_idx, topk_weights, T, fp8, sync)

    def _dispatch_args(self, x, topk_idx, topk_weights, expert_alignment: int, handle):
        """The argument checks, before anything touches the GPU; the launch arguments."""
        c = self.c
        if handle is not None:  # cached: the handle's routing (its metadata reused when it is the last computed)
            if not isinstance(handle, CudaHandle) or handle.topk_idx is None:
                raise TypeError("dispatch: handle must be a handle an earlier dispatch of this Buffer returned")
            if topk_idx is not None:
                raise ValueError("dispatch: give topk_idx or handle, not both")
            topk_idx, topk_weights = handle.topk_idx, handle.topk_weights
        if topk_idx is None:
            raise TypeError("dispatch: topk_idx is required (or a handle from an earlier dispatch)")
        H, K, fp8 = c["hidden"], c["topk"], c["dtype"] == "fp8"
        if fp8:
            if not (isinstance(x, tuple) and len(x) == 2):
                raise TypeError("dispatch: this bundle dispatches fp8: pass x as (x_fp8, scales)")
            x8, sc = x
            check_tensor("dispatch", "x_fp8", x8, (None, H), (torch.float8_e4m3fn,), self.device)
            T = x8.shape[0]
            check_tensor("dispatch", "scales", sc, (T, H // 128), (torch.float32,), self.device)
            xp, sp = x8.data_ptr(), sc.data_ptr()
        else:
            if isinstance(x, tuple):
                raise TypeError("dispatch: this bundle dispatches bf16: pass x as one [tokens, hidden] bfloat16 tensor")
            check_tensor("dispatch", "x", x, (None, H), (torch.bfloat16,), self.device)
            T, xp, sp = x.shape[0], x.data_ptr(), 0
        check_token_count(T, c["max_tokens"])
        check_tensor("dispatch", "topk_idx", topk_idx, (T, K), (torch.int64, torch.int32), self.device)
        if topk_weights is not None:
            check_tensor("dispatch", "topk_weights", topk_weights, (T, K), (torch.float32,), self.device)
        if isinstance(expert_alignment, bool) or not isinstance(expert_alignment, int) \
                or not 1 <= expert_alignment <= c["align_max"]:
            raise ValueError(f"dispatch: expert_alignment must be an integer in [1, {c['align_max']}], "
                             f"got {expert_alignment!r}")
        # a handle of the last metadata's dispatch, same tokens and alignment: its metadata is on the
        # GPU still (every rank holds the same handles: the calls are collective), none is computed
        # CUDA graphs: a replayed fresh dispatch changes the metadata on the GPU behind this count, and
        # a captured cached one would reuse whatever metadata its replay meets: none is skipped in or
        # after a capture
        if torch.cuda.is_current_stream_capturing():
            self.captured = True
        cached = handle is not None and handle.meta_index == self.meta_index and handle.tokens == T \
            and handle.alignment == expert_alignment and not self.captured
        a = self.args(T=T, x=xp, scales=sp, topk_idx=topk_idx.data_ptr(),
                      idx_int32=int(topk_idx.dtype == torch.int32),
                      topk_w=topk_weights.data_ptr() if topk_weights is not None else 0,
                      has_weights=int(topk_weights is not None), align=expert_alignment, cached=int(cached))
        return a, topk_idx, topk_weights, T, fp8

    def _dispatch(self, a, topk_idx, topk_weights, T: int, fp8: bool, sync: bool):
        c = self.c
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if sync:  # a rank held up since the arguments' round hears a peer's failure, not its dead kernels
            self.agree.heed()
        self.lib.dispatch(a, stream)
        self.dispatches += 1
        if not a.cached:
            self.meta_index = self.dispatches
        cap, epr = c["capacity"], c["experts_per_rank"]
        rx, rw, counts, offsets = self.recv_x, self.recv_w, self.recv_count, self.recv_offset

        def handle(rows: int) -> CudaHandle:
            return CudaHandle(self.dispatches, T, rows, topk_idx, topk_weights, self.meta_index, int(a.align))

        if not sync:
            if self.token_major:  # every row's top-k too: the kernels write them
                return rx, self.recv_idx, rw, (counts, self.src_offset), handle(cap), None
            return rx, None, rw, (counts, offsets), handle(cap), None
        try:
            host_counts = counts.cpu().tolist()
            host_offsets = (self.src_offset if self.token_major else offsets).cpu().tolist()
            bad = int(self.bad_token.cpu()[0])
        except RuntimeError:  # the context is gone: a kernel trapped
            self.raise_if_failed()
            raise
        self.raise_if_failed()
        err = None
        if bad >= 0:
            err = ValueError(f"dispatch: topk_idx row {bad} names an expert outside [-1, {c['experts'] - 1}] or the "
                             f"same expert twice: {topk_idx[bad].tolist()} (those entries were not dispatched)")
        # every rank's kernels finished (the bad entries ignored): a refusal leaves the Buffer usable
        self.agree.verdicts("the dispatch's read-back", err)
        total = host_offsets[self.R if self.token_major else epr]
        if fp8:
            rx = (rx[0][:total], rx[1][:total])
        else:
            rx = rx[:total]
        if self.token_major:  # counts: tokens per local expert, rounded up to the alignment (DeepEP's list)
            return rx, self.recv_idx[:total], rw[:total], host_counts, handle(total), None
        me = self.rank
        experts = [(me * epr + l) if c["placement"] == "blocked" else (l * self.R + me) for l in range(epr)]
        idx = torch.full((total,), -1, dtype=torch.int64)
        for l in range(epr):
            idx[host_offsets[l]: host_offsets[l] + host_counts[l]] = experts[l]
        return rx, idx.to(self.device, non_blocking=True), rw[:total], host_counts, handle(total), None

    # ------------------------------------------------------------------ combine
    def combine(self, y: torch.Tensor, handle: CudaHandle, topk_weights: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        with self.agree.call("combine"):
            try:
                a, out = self._combine_args(y, handle, topk_weights, out)
            except Exception as e:  # noqa: BLE001 - refused before the launch: the peers are in their kernels
                self.agree.fail(e, wait_s=0, fatal=True)
            self.lib.combine(a, torch.cuda.current_stream(self.device).cuda_stream)
            return out

    def _combine_args(self, y: torch.Tensor, handle: CudaHandle, topk_weights, out):
        """The argument checks, before anything touches the GPU; the launch arguments and `out`."""
        given = getattr(handle, "topk_weights", None)
        if topk_weights is not None and given is not None and not (
                isinstance(topk_weights, torch.Tensor) and topk_weights.shape == given.shape
                and torch.equal(topk_weights.to(given.device, given.dtype), given)):
            raise ValueError(WEIGHTS_DIFFER)
        if not isinstance(handle, CudaHandle):
            raise TypeError(f"combine: handle must be the handle dispatch returned, not {type(handle).__name__}")
        if handle.dispatch_index != self.dispatches:
            raise ValueError(f"combine: handle is from dispatch #{handle.dispatch_index}, but this Buffer has run "
                             f"dispatch #{self.dispatches} since; its routing and receive buffer are gone")
        H = self.c["hidden"]
        check_tensor("combine", "x", y, (handle.rows, H), (torch.bfloat16,), self.device)
        if out is None:
            out = torch.empty((handle.tokens, H), dtype=torch.bfloat16, device=self.device)
        else:
            check_tensor("combine", "out", out, (handle.tokens, H), (torch.bfloat16,), self.device)
        return self.args(y=y.data_ptr(), out=out.data_ptr()), out

    def synchronize(self) -> None:
        """Wait for this rank's kernels; a kernel that gave up (its report) or a lost context is
        posted to the group, and every rank raises GroupError (GroupTimeout for a wait that gave
        up) naming the rank that failed first."""
        self.agree.check()
        try:
            try:
                torch.cuda.current_stream(self.device).synchronize()
            except RuntimeError:
                self.raise_if_failed()
                raise
            self.raise_if_failed()
        except GroupError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure must reach the peers
            self.agree.fail(e)

    def check_routing(self, topk_idx=None) -> None:
        """Raise if the last dispatch met a bad top-k row (for sync=False callers); syncs."""
        bad = int(self.bad_token.cpu()[0])
        if bad >= 0:
            row = topk_idx[bad].tolist() if topk_idx is not None else "?"
            raise ValueError(f"dispatch: topk_idx row {bad} names an expert outside [-1, {self.c['experts'] - 1}] "
                             f"or the same expert twice: {row}")
