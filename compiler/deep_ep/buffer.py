"""`epcc.deep_ep.Buffer`: DeepEP V1's intranode normal-mode API over epcc's token-major bundles.

Code written for `deep_ep.Buffer` runs unchanged after `import epcc.deep_ep as deep_ep`:

    buffer = deep_ep.Buffer(group, int(1e9))                 # bundles from $EPCC_DEEP_EP_BUNDLES
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
    combined_x, combined_topk_weights, event = buffer.combine(expert_out, handle, topk_weights=recv_topk_weights)

How each call runs:

* get_dispatch_layout: computed here with torch ops on topk_idx's device (blocked placement, as
  DeepEP's); no bundle is needed.
* dispatch: one small all-gather of every rank's token count, tokens per destination rank and
  tokens per expert (on x's device; a host sync, as DeepEP's normal mode has) gives
  rank_prefix_matrix, the received counts and the most tokens any rank sends, which, with the
  tensors' shapes, picks the bundle (bundles.py); an `epcc.runtime.Buffer` over that bundle,
  made on first use and kept per (bundle, SMs), moves the rows.  Without topk_idx (DeepEP routes
  by is_token_in_rank alone) each token is routed to one expert of each rank it goes to: the rows
  are the same.  A cached dispatch (handle=...) reuses the routing and the counts of the handle,
  and the inner Buffer's own cached path where it has one for that bundle; on the direct kernels
  it makes no host round at all, as DeepEP's cached dispatch: the inner Buffer's low-latency mode,
  its outputs cut to the rows the handle's counts give.
* combine: the inner Buffer's combine (token-major: each token's rows summed at its home rank,
  unweighted, as DeepEP's), plus bias; combined_topk_weights are the given weights summed the same
  way, through one torch.distributed all_to_all_single of the [rows, topk] float32 weights.

Config.num_sms sets the SMs of the bundle's kernels where its engine takes a launch configuration
(`launch_config`); the chunk sizes are checked and otherwise unused.  Events: epcc runs each call
on the current stream; `async_finish=True` returns an event recorded after it there,
`previous_event` is waited for by the current stream first.

Not supported (each refused with a message): internode (num_rdma_bytes > 0,
num_tokens_per_rdma_rank), the low-latency API, `comm` (mpi4py), get_local_buffer_tensor.
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..plan import bundle as bundle_io
from ..runtime.buffer import Buffer as RuntimeBuffer
from ..runtime.engines.agree import Agreement
from ..runtime.engines.cuda_direct.engine import CudaHandle
from ..runtime.engines.tensors import FP8_GROUP, check_dtype_shape
from . import bundles as bsel
from .utils import Config, EventOverlap, stream_event

#: The direct kernels' launch configuration keys Config.num_sms sets (plan/direct.py DirectConfig).
DIRECT_SM_KEYS = ("send_blocks", "recv_blocks", "combine_send_blocks", "combine_reduce_blocks")


class Handle(NamedTuple):
    """What a dispatch returns for combine and for cached dispatches.  handle[0] is DeepEP's
    rank_prefix_matrix; the rest is epcc's."""

    rank_prefix_matrix: torch.Tensor  # [R, R] int32: [i][j] = tokens ranks 0..i send to rank j
    is_token_in_rank: torch.Tensor  # [T, R] bool: this rank's tokens per destination
    topk_idx: torch.Tensor | None  # the routing dispatch was given (None: routed by is_token_in_rank)
    topk_weights: torch.Tensor | None
    send_counts: list  # tokens this rank sends to each rank
    recv_counts: list  # rows this rank receives from each rank
    max_tokens: int  # the most tokens any rank dispatches: picks the bundle
    experts: int
    inner: dict  # (bundle path, SMs) -> that inner Buffer's handle of this routing


def launch_config(path: Path, sms: int, backend: str) -> dict | None:
    """The inner Buffer's launch configuration for `sms` SMs (0: the bundle's own).

    The direct kernels (a one-hop plan's): dispatch and combine on `sms` blocks, one per SM, all
    of them sending first (dispatch) and reducing first (combine), as the compiler's default
    configuration splits them.  Other engines take no configuration: the SMs are the bundle's
    (`sms N` in its schedule)."""
    if backend != "cuda" or sms == 0 or "direct" not in bundle_io.cuda_manifest(path, required=False):
        return None
    return dict(zip(DIRECT_SM_KEYS, (sms, 0, sms, 0)))


def _int(fn: str, name: str, v, least: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{fn}: {name} must be an int, not {type(v).__name__}")
    if v < least:
        raise ValueError(f"{fn}: {name} must be at least {least}, not {v}")
    return v


def _tensor(fn: str, name: str, t, dtypes: tuple, shape: tuple, device: torch.device | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, not {type(t).__name__}")
    check_dtype_shape(fn, name, t, shape, dtypes)
    if device is not None and t.device != device:
        raise ValueError(f"{fn}: {name} is on {t.device}, x on {device}")
    return t


def _wait(previous_event) -> None:
    if previous_event is None:
        return
    if not isinstance(previous_event, EventOverlap):
        raise TypeError(f"previous_event must be an EventOverlap (Buffer.capture()), not "
                        f"{type(previous_event).__name__}")
    if previous_event.event is not None:
        previous_event.current_stream_wait()


def _event(async_finish: bool, device: torch.device) -> EventOverlap:
    if not isinstance(async_finish, bool):
        raise TypeError(f"async_finish must be a bool, not {type(async_finish).__name__}")
    return EventOverlap(stream_event(device) if async_finish else None)


@contextmanager
def _torch_defaults():
    """torch's default dtype and device (float32, CPU) while the runtime works: its engines
    assume them, and DeepEP's tests set bfloat16 and cuda (torch.set_default_dtype/_device)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.set_default_dtype(dtype)


def _pad(t: torch.Tensor, rows: int, fill: float | int = 0) -> torch.Tensor:
    """`t` with rows appended up to `rows`, set to `fill` (fp8: zero bits)."""
    if t.dtype == torch.float8_e4m3fn:
        out = torch.zeros((rows, *t.shape[1:]), dtype=torch.uint8, device=t.device).view(t.dtype)
    else:
        out = torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


class Buffer:
    """DeepEP's `deep_ep.Buffer`, intranode normal mode, over epcc bundles.

    Besides DeepEP's arguments: `bundles` (a directory or a list of them; default
    $EPCC_DEEP_EP_BUNDLES), `backend` ("cuda" where a GPU is present, else "cpu"),
    `compile_missing` (compile a bundle no directory has, where MLIR is importable; default
    $EPCC_DEEP_EP_COMPILE=1) and `timeout_s` (the inner Buffers' timeout)."""

    #: The SMs of the default configurations (get_dispatch_config, get_combine_config).
    num_sms: int = 20

    def __init__(self, group: dist.ProcessGroup | None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, comm: Any = None, *, bundles=None, backend: str | None = None,
                 compile_missing: bool | None = None, timeout_s: float = 30.0) -> None:
        _int("Buffer", "num_nvl_bytes", num_nvl_bytes)
        _int("Buffer", "num_rdma_bytes", num_rdma_bytes)
        _int("Buffer", "num_qps_per_rank", num_qps_per_rank)
        if low_latency_mode:
            raise ValueError("Buffer: epcc.deep_ep has no low-latency mode (low_latency_mode=True); epcc's own "
                             "epcc.runtime.Buffer has one (dispatch(..., sync=False))")
        if num_rdma_bytes:
            raise ValueError(f"Buffer: num_rdma_bytes is {num_rdma_bytes}; epcc.deep_ep runs DeepEP's intranode mode "
                             f"only (internode and low-latency buffers are not supported): pass 0")
        if comm is not None:
            raise ValueError("Buffer: comm (an mpi4py communicator) is not supported; pass a torch.distributed group")
        if backend is None:
            backend = "cuda" if torch.cuda.is_available() else "cpu"
        if backend not in ("cpu", "cuda"):
            raise ValueError(f"Buffer: backend must be 'cpu' or 'cuda', not {backend!r}")
        if compile_missing is None:
            compile_missing = os.environ.get(bsel.COMPILE_ENV, "") == "1"
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = False, bool(explicitly_destroy)
        self.backend, self.compile_missing, self.timeout_s = backend, bool(compile_missing), timeout_s
        self.bundle_dirs = bsel.bundle_dirs(bundles)
        self._found: tuple[list[bsel.Candidate], list[str]] | None = None  # the scan, made on first need
        self._compiled: list[bsel.Candidate] = []
        # the rounds of a compile (rank 0 compiles, the others wait for it), made with the Buffer:
        # every rank makes its agreements in the same order
        self._agree = Agreement.for_group(self.group, timeout_s) if self.compile_missing else None
        self._inner: dict[tuple[str, int], RuntimeBuffer] = {}
        self._last: dict[tuple[str, int], Any] = {}  # inner Buffer -> the handle of its last dispatch
        self._destroyed = False

    # ------------------------------------------------------------------ DeepEP's static API
    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: epcc's CUDA kernels are built for sm_90a and its bundles dispatch fp8 (DeepEP's
        test gates its fp8 cases on this)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """The SMs of the default configurations (even, as DeepEP's)."""
        _int("Buffer.set_num_sms", "new_num_sms", new_num_sms, 2)
        if new_num_sms % 2:
            raise ValueError(f"Buffer.set_num_sms: the SM count must be even, not {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event after what is queued on the current stream (a finished one without a GPU)."""
        return EventOverlap(stream_event(torch.device("cuda" if torch.cuda.is_available() else "cpu")))

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """Config(Buffer.num_sms): epcc's kernels take the SMs from it, not DeepEP's chunk sizes."""
        _int("Buffer.get_dispatch_config", "num_ranks", num_ranks, 1)
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """Config(Buffer.num_sms), as get_dispatch_config."""
        _int("Buffer.get_combine_config", "num_ranks", num_ranks, 1)
        return Config(Buffer.num_sms)

    # DeepEP's low-latency calls need a Buffer made with low_latency_mode=True, which __init__
    # refuses (epcc.deep_ep has no such mode); as in DeepEP, a Buffer without it refuses them.
    @staticmethod
    def get_low_latency_rdma_size_hint(*_: Any) -> int:
        raise ValueError(_no_low_latency("Buffer.get_low_latency_rdma_size_hint"))

    def clean_low_latency_buffer(self, *_: Any) -> None:
        raise ValueError(_no_low_latency("Buffer.clean_low_latency_buffer"))

    def low_latency_dispatch(self, *_: Any, **__: Any):
        raise ValueError(_no_low_latency("Buffer.low_latency_dispatch"))

    def low_latency_combine(self, *_: Any, **__: Any):
        raise ValueError(_no_low_latency("Buffer.low_latency_combine"))

    def destroy(self) -> None:
        """Close every inner Buffer (a collective: every rank calls it); later calls raise."""
        self._live("destroy")
        self._destroyed = True
        with _torch_defaults():
            for inner in self._inner.values():
                inner.close()
        self._inner.clear()
        self._last.clear()

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """(num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32, is_token_in_rank
        [T, R] bool, event), on topk_idx's device."""
        self._live("get_dispatch_layout")
        _wait(previous_event)
        in_rank, per_expert = self._layout("get_dispatch_layout", topk_idx, num_experts)
        return (in_rank.sum(0, dtype=torch.int32), None, per_expert, in_rank,
                _event(async_finish, topk_idx.device))

    def _layout(self, fn: str, topk_idx, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        _int(fn, "num_experts", num_experts, 1)
        R = self.group_size
        if num_experts % R:
            raise ValueError(f"{fn}: num_experts {num_experts} is not a multiple of the group's {R} ranks")
        _tensor(fn, "topk_idx", topk_idx, (torch.int64, torch.int32), (None, None))
        idx = topk_idx.long()
        if idx.numel() and bool(((idx < -1) | (idx >= num_experts)).any()):
            raise ValueError(f"{fn}: topk_idx values must lie in [-1, {num_experts - 1}] (-1: no expert)")
        valid = idx >= 0
        dest = torch.where(valid, idx // (num_experts // R), R)  # R: a column for the -1 entries
        hits = torch.zeros((idx.shape[0], R + 1), dtype=torch.bool, device=idx.device)
        hits.scatter_(1, dest, True)
        # -1 entries counted in a last bin and dropped: no boolean indexing, which would sync with the host
        per_expert = torch.bincount(torch.where(valid, idx, num_experts).flatten(),
                                    minlength=num_experts + 1)[:num_experts].to(torch.int32)
        return hits[:, :R].contiguous(), per_expert

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x, handle: Handle | None = None, num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None, is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Config | None = None, previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event), as DeepEP's.

        recv_x: one row per (source rank, token) sent here, in that order ((fp8, scales) for an fp8
        x); recv_topk_idx: each row's top-k as local expert ids, -1 where the expert is elsewhere;
        num_worst_tokens > 0 pads the outputs to that many rows (recv_topk_idx -1, weights 0) and
        returns an empty list.  Cached (handle=...): (recv_x, None, None, None, None, event)."""
        fn = "dispatch"
        self._live(fn)
        config = self._config(fn, config, Buffer.get_dispatch_config(self.group_size))
        _int(fn, "expert_alignment", expert_alignment, 1)
        _int(fn, "num_worst_tokens", num_worst_tokens)
        if num_tokens_per_rdma_rank is not None:
            raise ValueError("dispatch: num_tokens_per_rdma_rank is internode; epcc.deep_ep runs intranode only")
        x8, scales = self._split_x(x)
        T, device = x8.shape[0], x8.device
        _wait(previous_event)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("dispatch: a cached dispatch (handle=...) takes no topk_idx / topk_weights: it reuses "
                                 "the handle's routing")
            if not isinstance(handle, Handle):
                raise TypeError(f"dispatch: handle must be the one an epcc.deep_ep dispatch returned, not "
                                f"{type(handle).__name__}")
            if handle.is_token_in_rank.shape[0] != T:
                raise ValueError(f"dispatch: x has {T} tokens, the handle's dispatch had "
                                 f"{handle.is_token_in_rank.shape[0]}")
            h, received = handle, []
        else:
            received, h = self._route(fn, T, device, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights)
        shape = bsel.Shape(self.group_size, x8.shape[1], "bf16" if scales is None else "fp8",
                           None if h.topk_idx is None else h.topk_idx.shape[1], h.experts, h.max_tokens)
        key, inner = self._inner_buffer(shape, config.num_sms)
        payload = x8 if scales is None else (x8, scales)
        if handle is not None and isinstance(h.inner.get(key), CudaHandle):
            out = self._cached_rows(inner, payload, h.inner[key], sum(h.recv_counts))
        elif handle is not None and key in h.inner and self.backend == "cuda":
            with _torch_defaults():
                out = inner.dispatch(payload, handle=h.inner[key])
        else:
            idx = h.topk_idx if h.topk_idx is not None else self._one_expert_per_rank(h, inner.topk)
            w = h.topk_weights if h.topk_weights is not None else torch.ones(idx.shape, dtype=torch.float32,
                                                                             device=device)
            with _torch_defaults():
                out = inner.dispatch(payload, idx, w)
        recv_x, recv_idx, recv_w, _, inner_handle, _ = out
        h.inner[key] = self._last[key] = inner_handle
        rows = sum(h.recv_counts)
        got = (recv_x[0] if isinstance(recv_x, tuple) else recv_x).shape[0]
        if got != rows:
            raise RuntimeError(f"dispatch: the bundle {key[0]} returned {got} rows, the gathered counts say {rows}")
        recv_x = tuple(self._owned(t) for t in recv_x) if isinstance(recv_x, tuple) else self._owned(recv_x)
        if handle is not None:
            if num_worst_tokens:
                recv_x = self._padded_x(recv_x, rows, num_worst_tokens)
            return recv_x, None, None, None, None, _event(async_finish, device)
        recv_topk_idx = recv_topk_weights = None
        if h.topk_idx is not None:
            recv_topk_idx = self._owned(recv_idx).to(h.topk_idx.dtype)
            recv_topk_weights = self._owned(recv_w)
        counts = [-(-int(c) // expert_alignment) * expert_alignment for c in received]  # rounded up, as DeepEP's
        if num_worst_tokens:
            recv_x = self._padded_x(recv_x, rows, num_worst_tokens)
            if recv_topk_idx is not None:
                recv_topk_idx, recv_topk_weights = _pad(recv_topk_idx, num_worst_tokens, -1), _pad(recv_topk_weights,
                                                                                                  num_worst_tokens, 0)
            counts = []
        return recv_x, recv_topk_idx, recv_topk_weights, counts, h, _event(async_finish, device)

    def _route(self, fn: str, T: int, device: torch.device, is_token_in_rank, num_tokens_per_expert, topk_idx,
               topk_weights) -> tuple[list[int], Handle]:
        """The rows each local expert receives, and the handle of a new routing: this rank's, and
        what every rank sends where (gathered)."""
        R = self.group_size
        if (topk_idx is None) != (topk_weights is None):
            raise TypeError("dispatch: pass topk_idx and topk_weights together (or neither, routing by "
                            "is_token_in_rank)")
        if topk_idx is not None:
            _tensor(fn, "topk_idx", topk_idx, (torch.int64, torch.int32), (T, None), device)
            _tensor(fn, "topk_weights", topk_weights, (torch.float32,), tuple(topk_idx.shape), device)
            if not isinstance(num_tokens_per_expert, torch.Tensor):
                raise TypeError("dispatch: num_tokens_per_expert is needed (its length is the number of experts), as "
                                "DeepEP's: get_dispatch_layout returns it")
            in_rank, per_expert = self._layout(fn, topk_idx, num_tokens_per_expert.shape[0])
        else:
            if is_token_in_rank is None or num_tokens_per_expert is None:
                raise TypeError("dispatch: without topk_idx (and without a handle), is_token_in_rank and "
                                "num_tokens_per_expert are needed, as DeepEP's (get_dispatch_layout returns them)")
            in_rank = _tensor(fn, "is_token_in_rank", is_token_in_rank, (torch.bool,), (T, R), device)
            per_expert = _tensor(fn, "num_tokens_per_expert", num_tokens_per_expert, (torch.int32, torch.int64),
                                 (None,), device).to(torch.int32)
            if per_expert.shape[0] % R:
                raise ValueError(f"dispatch: num_tokens_per_expert has {per_expert.shape[0]} experts, not a multiple "
                                 f"of the group's {R} ranks")
        experts = per_expert.shape[0]
        mine = torch.cat([torch.tensor([T], dtype=torch.int32, device=device), in_rank.sum(0, dtype=torch.int32),
                          per_expert])
        parts = [torch.empty_like(mine) for _ in range(R)]
        dist.all_gather(parts, mine, group=self.group)
        table = torch.stack(parts).cpu()  # [R, 1 + R + E]: one host sync, as DeepEP's normal mode
        sent = table[:, 1:1 + R]  # [source, destination] tokens
        local = experts // R
        received = table[:, 1 + R + self.rank * local:1 + R + (self.rank + 1) * local].sum(0).tolist()
        return received, Handle(rank_prefix_matrix=sent.cumsum(0).to(torch.int32).to(device), is_token_in_rank=in_rank,
                      topk_idx=topk_idx, topk_weights=topk_weights, send_counts=sent[self.rank].tolist(),
                      recv_counts=sent[:, self.rank].tolist(), max_tokens=int(table[:, 0].max()), experts=experts,
                      inner={})

    @staticmethod
    def _cached_rows(inner: RuntimeBuffer, payload, prev: CudaHandle, rows: int) -> tuple:
        """A cached dispatch on the direct kernels with no host round, as DeepEP's cached dispatch
        has none: the handle's counts already say how many rows arrive (`rows`, the first of the
        token-major receive buffer, source rank by source rank), so the inner Buffer runs its
        low-latency mode (no read-back, no rounds among the ranks) and its outputs are cut to those
        rows, the handle with them (combine checks its input against the handle's rows)."""
        with _torch_defaults():
            out = inner.dispatch(payload, handle=prev, sync=False)
        return first_rows(out, rows)

    def _one_expert_per_rank(self, h: Handle, topk: int) -> torch.Tensor:
        """A top-k routing that sends each token to the ranks is_token_in_rank names (to each rank's
        first expert): DeepEP's dispatch without topk_idx moves the same rows."""
        R, local = self.group_size, h.experts // self.group_size
        in_rank = h.is_token_in_rank
        if in_rank.shape[0] and int(in_rank.sum(1).max()) > topk:
            raise ValueError(f"dispatch: a token goes to {int(in_rank.sum(1).max())} ranks, more than the bundle's "
                             f"top-{topk} can route without topk_idx; pass topk_idx")
        first = torch.arange(R, device=in_rank.device) * local
        idx = torch.where(in_rank, first, -1)  # [T, R]
        idx = idx.sort(dim=1, descending=True).values[:, :topk]  # the ranks first, -1 after
        if idx.shape[1] < topk:
            idx = torch.cat([idx, idx.new_full((idx.shape[0], topk - idx.shape[1]), -1)], dim=1)
        return idx.contiguous()

    def _padded_x(self, recv_x, rows: int, worst: int):
        if rows > worst:
            raise ValueError(f"dispatch: {rows} rows arrived, more than num_worst_tokens {worst}")
        return tuple(_pad(t, worst) for t in recv_x) if isinstance(recv_x, tuple) else _pad(recv_x, worst)

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, handle: Handle, topk_weights: torch.Tensor | None = None, bias=None,
                config: Config | None = None, previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """(combined_x [T, hidden] bf16, combined_topk_weights [T, topk] float32 or None, event):
        each token's rows summed at its home rank, unweighted, plus bias; the weights summed alike.
        It runs on the inner Buffer (bundle and SMs) of the dispatch that made the handle."""
        fn = "combine"
        self._live(fn)
        self._config(fn, config, Buffer.get_combine_config(self.group_size))
        if not isinstance(handle, Handle) or not handle.inner:
            raise TypeError(f"combine: handle must be the one an epcc.deep_ep dispatch returned, not "
                            f"{type(handle).__name__}")
        rows = sum(handle.recv_counts)
        key = next(iter(handle.inner))
        inner = self._inner[key]
        _tensor(fn, "x", x, (torch.bfloat16,), (None, inner.hidden))
        if x.shape[0] < rows:
            raise ValueError(f"combine: x has {x.shape[0]} rows, the handle's dispatch received {rows}")
        _wait(previous_event)
        self._restore(key, handle)
        with _torch_defaults():
            combined = inner.combine(x[:rows].contiguous(), handle.inner[key])
        biases = [] if bias is None else list(bias) if isinstance(bias, tuple) else [bias]
        for b in biases:
            _tensor(fn, "bias", b, (torch.bfloat16,), tuple(combined.shape), combined.device)
        if biases:
            combined = (combined.float() + sum(b.float() for b in biases)).to(torch.bfloat16)
        combined_w = None
        if topk_weights is not None:
            _tensor(fn, "topk_weights", topk_weights, (torch.float32,), (None, None), x.device)
            if topk_weights.shape[0] < rows:
                raise ValueError(f"combine: topk_weights has {topk_weights.shape[0]} rows, the handle's dispatch "
                                 f"received {rows}")
            combined_w = self._sum_home(handle, topk_weights[:rows].contiguous())
        return combined, combined_w, _event(async_finish, combined.device)

    def _restore(self, key: tuple[str, int], h: Handle) -> None:
        """The cuda engines combine the routing of their last dispatch only (its metadata is on the
        GPU); DeepEP's combine takes any handle.  Where the inner Buffer has dispatched other
        routing since `h`'s, a cached dispatch of `h`'s routing (rows of zeros: combine reads the
        caller's x) puts its metadata back first."""
        if self.backend != "cuda" or self._last.get(key) is h.inner[key]:
            return
        inner = self._inner[key]
        T = h.is_token_in_rank.shape[0]
        device = h.rank_prefix_matrix.device
        zeros = torch.zeros((T, inner.hidden), dtype=torch.uint8 if inner.dtype == "fp8" else torch.bfloat16,
                            device=device)
        payload = zeros if inner.dtype != "fp8" else (
            zeros.view(torch.float8_e4m3fn), torch.ones((T, inner.hidden // FP8_GROUP), dtype=torch.float32,
                                                        device=device))
        if isinstance(h.inner[key], CudaHandle):
            out = self._cached_rows(inner, payload, h.inner[key], sum(h.recv_counts))
        else:
            with _torch_defaults():
                out = inner.dispatch(payload, handle=h.inner[key])
        h.inner[key] = self._last[key] = out[4]

    def _sum_home(self, h: Handle, w: torch.Tensor) -> torch.Tensor:
        """Each row's values sent back to its home rank and summed per token."""
        back = torch.empty((sum(h.send_counts), w.shape[1]), dtype=w.dtype, device=w.device)
        dist.all_to_all_single(back, w, output_split_sizes=h.send_counts, input_split_sizes=h.recv_counts,
                               group=self.group)
        tokens = torch.cat([h.is_token_in_rank[:, d].nonzero().flatten() for d in range(self.group_size)])
        out = torch.zeros((h.is_token_in_rank.shape[0], w.shape[1]), dtype=w.dtype, device=w.device)
        return out.index_add_(0, tokens.to(w.device), back)

    # ------------------------------------------------------------------ helpers
    def _live(self, fn: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"{fn}: this Buffer was destroyed")

    @staticmethod
    def _config(fn: str, config, default: Config) -> Config:
        if config is None:
            return default
        if not isinstance(config, Config):
            raise TypeError(f"{fn}: config must be an epcc.deep_ep.Config, not {type(config).__name__}")
        return config

    def _split_x(self, x) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x, None) for bf16, (x_fp8, scales) for fp8, scales made contiguous (DeepEP's test passes
        them column-major)."""
        if isinstance(x, tuple):
            if len(x) != 2:
                raise TypeError("dispatch: an fp8 x is a tuple (x_fp8, scales)")
            x8 = _tensor("dispatch", "x_fp8", x[0], (torch.float8_e4m3fn,), (None, None))
            if x8.shape[1] % FP8_GROUP:
                raise ValueError(f"dispatch: hidden {x8.shape[1]} is not a multiple of {FP8_GROUP} (fp8 scales)")
            sc = _tensor("dispatch", "scales", x[1], (torch.float32,), (x8.shape[0], x8.shape[1] // FP8_GROUP),
                         x8.device)
            return x8.contiguous(), sc.contiguous()
        return _tensor("dispatch", "x", x, (torch.bfloat16,), (None, None)).contiguous(), None

    def _owned(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor of the caller's: the cuda engines return views into their peer region, which
        the next call overwrites (DeepEP's normal mode returns fresh tensors); the cpu engine's
        outputs are copies already."""
        return t.clone() if self.backend == "cuda" else t

    def _scan(self) -> tuple[list[bsel.Candidate], list[str]]:
        if self._found is None:
            self._found = bsel.scan(self.bundle_dirs)
        return self._found[0] + self._compiled, self._found[1]

    def _inner_buffer(self, shape: bsel.Shape, sms: int) -> tuple[tuple[str, int], RuntimeBuffer]:
        found, unreadable = self._scan()
        try:
            chosen = bsel.choose(found, unreadable, self.bundle_dirs, shape, self.backend)
        except bsel.NoBundle:
            if not self.compile_missing:
                raise
            chosen = self._compile(shape, sms or Buffer.num_sms)
        key = (str(chosen.path), sms)
        if key not in self._inner:
            with _torch_defaults():
                self._inner[key] = RuntimeBuffer(self.group, chosen.path, backend=self.backend,
                                                 timeout_s=self.timeout_s,
                                                 config=launch_config(chosen.path, sms, self.backend))
        return key, self._inner[key]

    def _compile(self, shape: bsel.Shape, sms: int) -> bsel.Candidate:
        """The bundle for `shape`, compiled once for the group: rank 0 compiles while the others
        wait for it at a round (up to bsel.COMPILE_S and the Buffer's timeout), then every rank
        loads it.  Where the compile (or a rank's load) fails, every rank raises the same
        GroupError, with the compiler's message, as soon as it is known."""
        agree = self._agree
        assert agree is not None  # made in __init__ with compile_missing
        with agree.call("the compile of a missing bundle", numbered=False):
            path = str(bsel.compile_for(shape, sms, self.backend)) if self.rank == 0 else None
            path = agree.gather("rank 0's compile", path, timeout_s=bsel.COMPILE_S + self.timeout_s)[0]
            try:
                got, error = bsel.candidate(Path(path)), None
            except (bsel.BundleError, OSError) as e:
                got, error = None, e
            agree.verdicts("the compiled bundle's load", error)
        self._compiled.append(got)
        return got


def first_rows(out: tuple, rows: int) -> tuple:
    """A low-latency token-major dispatch's outputs (recv_x or (x_fp8, scales), recv_topk_idx,
    recv_topk_weights, counts, handle, event), each of the whole receive buffer, cut to its first
    `rows` rows, and the handle to them."""
    recv_x, recv_idx, recv_w, counts, h, event = out
    recv_x = tuple(t[:rows] for t in recv_x) if isinstance(recv_x, tuple) else recv_x[:rows]
    return (recv_x, None if recv_idx is None else recv_idx[:rows], None if recv_w is None else recv_w[:rows],
            counts, dataclasses.replace(h, rows=rows), event)


def _no_low_latency(fn: str) -> str:
    return (f"{fn}: DeepEP's low-latency mode, which epcc.deep_ep does not have (it runs DeepEP's intranode "
            f"normal mode); for a low-latency (CUDA-graph capturable, no host sync) dispatch use "
            f"epcc.runtime.Buffer's dispatch(..., sync=False)")
