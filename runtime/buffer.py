"""`epcc.runtime.Buffer`: dispatch and combine through a compiled bundle, shaped after DeepEP.

    buf = Buffer(group, "build/h200x4")          # a bundle written by `epcc compile -o`
    layout = buf.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = buf.dispatch(x, topk_idx, topk_weights)
    y = experts(recv_x)                           # rows are expert-major: the permute is fused
    combined_x = buf.combine(y, handle)

One process per rank, joined by a `torch.distributed` group.  The bundle's plan.json is all the
runtime reads (no MLIR).  Per call: the routing of every rank is all-gathered (the plan's
metadata step), every rank computes the same token-level layout (runtime/layout.py), buffers
live in peer memory (runtime/shm.py: named shared memory that peers map, the CPU analogue of
CUDA IPC handles), and the backend runs this rank's kernels and proxy loops, which write into
peers' buffers and bump peers' counters directly.

Differences from DeepEP's intranode `Buffer`: outputs are expert-major (one row per (token,
local expert), in the documented order: local expert, then source rank, then token), so
`recv_topk_idx` / `recv_topk_weights` hold the global expert and the weight of each row, and
`combine` takes expert outputs in that same row order.  `event` is None (CPU).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..plan import bundle as bundle_io
from ..plan.bundle import BundleError
from .layout import compute_layout
from .layout_types import Layout
from .shm import PeerMemory

FP8_GROUP = 128


WEIGHTS_DIFFER = ("combine: topk_weights differ from the weights dispatch was given (combine applies dispatch's; "
                  "dispatch again to change them)")


#: DeepEP's layout and stream arguments, which dispatch accepts and ignores (the plan's metadata
#: step computes the layout; epcc runs on the current stream).
DEEPEP_LAYOUT_ARGS = frozenset({"num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert",
                                "is_token_in_rank", "previous_event", "async_finish", "allocate_on_comm_stream"})


@dataclass
class Handle:
    """What combine needs from the dispatch it reverses."""

    layout: Layout
    tokens: int
    recv_rows: int
    weights: np.ndarray | None = None  # [tokens, topk] float32: the routing weights dispatch was given


class Buffer:
    def __init__(self, group: dist.ProcessGroup | None, bundle: str | Path, *, backend: str | None = None,
                 timeout_s: float = 30.0, config: dict | None = None):
        if not isinstance(bundle, (str, Path)):
            raise TypeError(f"Buffer: bundle must be a path (str or pathlib.Path), not {type(bundle).__name__}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0 \
                or timeout_s == float("inf"):
            raise ValueError(f"Buffer: timeout_s must be a positive number of seconds, not {timeout_s!r}")
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.num_ranks = dist.get_world_size(self.group)
        loaded = bundle_io.load(bundle)
        self.plan, manifest = loaded.plan, loaded.manifest
        self.backend_name = backend or manifest.get("backend", "cpu")
        # Errors of the call itself first, the same on every rank and before any collective:
        # a machine without a GPU must not surface as a group-size or nvcc error further in.
        if self.backend_name == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("Buffer(backend='cuda'): no CUDA device is available (torch.cuda.is_available() is "
                               "False: a CPU-only torch, no driver, or CUDA_VISIBLE_DEVICES hides the GPUs); "
                               "use backend='cpu' on this machine")
        if self.backend_name != "cuda" and config is not None:
            raise ValueError("Buffer: config (SMs, warps) applies to the cuda backend only")
        if self.plan.num_ranks != self.num_ranks:
            raise BundleError(f"bundle {bundle} was compiled for {self.plan.num_ranks} ranks "
                              f"({manifest.get('schedule', '?')}), but the group has {self.num_ranks}")
        self.timeout_s = timeout_s
        wl = self.plan.workload
        self.hidden, self.topk, self.experts, self.dtype = wl.hidden, wl.topk, wl.experts, wl.dtype
        self._cuda = None
        if self.backend_name == "cuda":
            from .cuda_buffer import CudaEngine  # torch.cuda, nvcc: only for this backend

            self._cuda = CudaEngine(self.group, Path(bundle), self.plan, manifest, timeout_s=timeout_s, config=config)
            self.memory = None
            return
        self.backend = _backend(self.backend_name)
        session = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(session, src=_global_rank(self.group, 0), group=self.group)
        self.memory = PeerMemory(session[0], self.rank, self.num_ranks)

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        """DeepEP's layout: (num_tokens_per_rank [R] int32, None (no RDMA ranks in this plan's
        view), num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, None)."""
        if isinstance(num_experts, bool) or not isinstance(num_experts, int):
            raise TypeError(f"get_dispatch_layout: num_experts must be an int, not {type(num_experts).__name__}")
        if num_experts != self.experts:
            raise ValueError(f"get_dispatch_layout: num_experts is {num_experts}, but the bundle was compiled "
                             f"for {self.experts} experts")
        wl = self.plan.workload
        if self._cuda is not None and isinstance(topk_idx, torch.Tensor) and topk_idx.is_cuda:
            return self._layout_on_device(topk_idx)
        idx = self._check_topk_idx("get_dispatch_layout", topk_idx)
        rank_of = np.asarray([wl.rank_of_expert(e, self.num_ranks) for e in range(self.experts)])
        valid = idx >= 0
        in_rank = np.zeros((idx.shape[0], self.num_ranks), dtype=bool)
        rows = np.nonzero(valid)
        in_rank[rows[0], rank_of[idx[valid]]] = True
        per_expert = np.bincount(idx[valid], minlength=self.experts)
        return (torch.from_numpy(in_rank.sum(0).astype(np.int32)), None,
                torch.from_numpy(per_expert.astype(np.int32)), torch.from_numpy(in_rank), None)

    def _layout_on_device(self, topk_idx: torch.Tensor):
        check_tensor("get_dispatch_layout", "topk_idx", topk_idx, (None, self.topk), (torch.int64, torch.int32),
                     device=self._cuda.device)
        wl = self.plan.workload
        e = torch.arange(self.experts, device=topk_idx.device)
        rank_of = e // (self.experts // self.num_ranks) if wl.placement == "blocked" else e % self.num_ranks
        idx = topk_idx.long()
        valid = (idx >= 0) & (idx < self.experts)
        safe = idx.clamp(0, self.experts - 1)
        hits = torch.zeros((idx.shape[0], self.num_ranks), dtype=torch.int32, device=idx.device)
        hits.scatter_add_(1, rank_of[safe], valid.int())  # invalid entries add 0
        in_rank = hits > 0
        per_expert = torch.bincount(safe[valid], minlength=self.experts).int()
        return in_rank.sum(0, dtype=torch.int32), None, per_expert, in_rank, None

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x, topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None, *,
                 sync: bool = True, expert_alignment: int = 1, handle=None, **deepep_layout: Any):
        """Returns (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event).

        x: [T, hidden] bfloat16, or (x_fp8 [T, hidden] float8_e4m3fn, scales [T, hidden/128] float32) for
        an fp8 bundle.  The DeepEP layout arguments (num_tokens_per_rank, ...) are accepted and ignored:
        the plan's metadata step computes them.

        cuda backend only: `expert_alignment` pads each local expert's rows to a multiple (grouped GEMM);
        `sync=False` is the low-latency mode (no host sync, CUDA-graph capturable: recv_x is the whole
        receive buffer, the counts come as device tensors (counts, offsets), recv_topk_idx is None);
        `handle` (instead of topk_idx/topk_weights) reuses an earlier dispatch's routing."""
        unknown = sorted(set(deepep_layout) - DEEPEP_LAYOUT_ARGS)
        if unknown:
            raise TypeError(f"dispatch: unexpected keyword argument(s) {', '.join(unknown)} (besides x, topk_idx, "
                            f"topk_weights, sync, expert_alignment and handle it takes DeepEP's layout arguments, "
                            f"ignored: {', '.join(sorted(DEEPEP_LAYOUT_ARGS))})")
        if self._cuda is not None:
            return self._cuda.dispatch(x, topk_idx, topk_weights, sync=sync, expert_alignment=expert_alignment,
                                       handle=handle)
        if handle is not None:
            raise ValueError("dispatch: handle (cached dispatch) needs the cuda backend")
        if topk_idx is None:
            raise TypeError("dispatch: topk_idx is required")
        if sync is not True:
            raise ValueError("dispatch: sync=False (low-latency mode) needs the cuda backend")
        if expert_alignment != 1:
            raise ValueError("dispatch: expert_alignment needs the cuda backend")
        rows, tokens = self._pack_x(x)
        idx = self._check_topk_idx("dispatch", topk_idx, tokens)
        w = self._check_weights("dispatch", topk_weights, idx.shape)
        idx_all, w_all = self._gather_routing(idx, w)
        layout = compute_layout(self.plan, idx_all, w_all)
        mem = self._prepare("dispatch", layout,
                            lambda m: m.buffer("dispatch", "input", self.rank).__setitem__(slice(0, tokens), rows))
        out = self._run("dispatch", layout, mem)
        recv = out[self.rank]
        entries = layout.entries[("output", self.rank)]
        recv_x = _unpack_rows(recv, self.dtype, self.hidden)
        recv_idx = torch.from_numpy(entries[:, 2].astype(np.int64))
        recv_w = torch.from_numpy(np.ascontiguousarray(layout.output_weights[self.rank], dtype=np.float32))
        counts = [int(c) for c in layout.recv_counts[self.rank]]
        return recv_x, recv_idx, recv_w, counts, Handle(layout, tokens, recv.shape[0], w), None

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, handle: Handle, topk_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Sum each token's expert outputs, weighted by its routing weights, at its home rank.

        x: [recv rows, hidden] bfloat16, rows in dispatch's order.  The weights of dispatch are used
        (`topk_weights`, if given, must equal them: combine cannot re-route)."""
        if self._cuda is not None:
            given = getattr(handle, "topk_weights", None)
            if topk_weights is not None and given is not None and not (
                    isinstance(topk_weights, torch.Tensor) and topk_weights.shape == given.shape
                    and torch.equal(topk_weights.to(given.device, given.dtype), given)):
                raise ValueError(WEIGHTS_DIFFER)
            return self._cuda.combine(x, handle)
        if not isinstance(handle, Handle):
            raise TypeError(f"combine: handle must be the handle dispatch returned, not {type(handle).__name__}")
        check_tensor("combine", "x", x, (handle.recv_rows, self.hidden), (torch.bfloat16,))
        if topk_weights is not None:
            check_tensor("combine", "topk_weights", topk_weights, (handle.tokens, self.topk), (torch.float32,))
            if not np.array_equal(topk_weights.detach().numpy(), handle.weights):
                raise ValueError(WEIGHTS_DIFFER)
        y = (np.zeros((0, self.hidden), dtype=np.uint16) if x.shape[0] == 0 else
             x.detach().contiguous().view(torch.int16).numpy().view(np.uint16))
        mem = self._prepare("combine", handle.layout,
                            lambda m: m.buffer("combine", "output", self.rank).__setitem__(slice(None), y))
        result = self._run("combine", handle.layout, mem)[self.rank]
        return torch.from_numpy(np.ascontiguousarray(result[: handle.tokens])).to(torch.bfloat16)

    # ------------------------------------------------------------------ helpers
    def _check_topk_idx(self, fn: str, topk_idx, tokens: int | None = None) -> np.ndarray:
        if not isinstance(topk_idx, torch.Tensor):
            raise TypeError(f"{fn}: topk_idx must be a torch.Tensor, not {type(topk_idx).__name__}")
        if topk_idx.device.type != "cpu":
            raise ValueError(f"{fn}: topk_idx is on {topk_idx.device}, but this Buffer runs the "
                             f"'{self.backend_name}' backend on the CPU")
        if topk_idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{fn}: topk_idx must be int64 or int32, not {topk_idx.dtype}")
        if topk_idx.dim() != 2 or topk_idx.shape[1] != self.topk or (tokens is not None and topk_idx.shape[0] != tokens):
            want = f"[{tokens if tokens is not None else 'tokens'}, {self.topk}]"
            raise ValueError(f"{fn}: topk_idx must have shape {want}, got {list(topk_idx.shape)}")
        idx = topk_idx.numpy().astype(np.int64)
        if idx.size and (idx.min() < -1 or idx.max() >= self.experts):
            raise ValueError(f"{fn}: topk_idx values must lie in [-1, {self.experts - 1}] (-1: no expert)")
        for row in np.nonzero([len(set(r[r >= 0])) != int((r >= 0).sum()) for r in idx])[0][:1]:
            raise ValueError(f"{fn}: topk_idx row {int(row)} names the same expert twice: {idx[row].tolist()}")
        return idx

    def _check_weights(self, fn: str, w, shape) -> np.ndarray:
        if w is None:
            return np.ones(shape, dtype=np.float32)
        check_tensor(fn, "topk_weights", w, tuple(shape), (torch.float32,))
        out = w.detach().numpy().astype(np.float32)
        if not np.isfinite(out).all():
            bad = np.argwhere(~np.isfinite(out))[0]
            raise ValueError(f"{fn}: topk_weights[{bad[0]}, {bad[1]}] is {out[tuple(bad)]}; routing weights must be finite")
        return out

    def _pack_x(self, x) -> tuple[np.ndarray, int]:
        if self.dtype == "fp8":
            if not (isinstance(x, tuple) and len(x) == 2):
                raise TypeError("dispatch: this bundle dispatches fp8: pass x as (x_fp8, scales)")
            x8, sc = x
            check_tensor("dispatch", "x_fp8", x8, (None, self.hidden), (torch.float8_e4m3fn,))
            check_tensor("dispatch", "scales", sc, (x8.shape[0], self.hidden // FP8_GROUP), (torch.float32,))
            rows = np.concatenate([x8.contiguous().view(torch.uint8).numpy(),
                                   sc.contiguous().view(torch.uint8).numpy()], axis=1)
            return rows, x8.shape[0]
        if isinstance(x, tuple):
            raise TypeError("dispatch: this bundle dispatches bf16: pass x as one [tokens, hidden] bfloat16 tensor")
        check_tensor("dispatch", "x", x, (None, self.hidden), (torch.bfloat16,))
        if x.shape[0] == 0:  # no rows: torch cannot view an empty tensor of any stride as bytes
            return np.zeros((0, 2 * self.hidden), dtype=np.uint8), 0
        return x.detach().contiguous().view(torch.uint8).numpy(), x.shape[0]

    def _gather_routing(self, idx: np.ndarray, w: np.ndarray):
        t = torch.from_numpy(np.concatenate([idx.astype(np.float64), w.astype(np.float64)], axis=1))
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.num_ranks)]
        dist.all_gather(sizes, torch.tensor([idx.shape[0]], dtype=torch.int64), group=self.group)
        counts = [int(s) for s in sizes]
        if len(set(counts)) != 1:
            raise ValueError(f"dispatch: every rank must dispatch the same number of tokens; ranks have "
                             f"{counts} (pad with -1 in topk_idx)")
        parts = [torch.zeros_like(t) for _ in range(self.num_ranks)]
        dist.all_gather(parts, t, group=self.group)
        allr = torch.stack(parts).numpy()
        return allr[:, :, : self.topk].astype(np.int64), allr[:, :, self.topk:].astype(np.float32)

    def _prepare(self, program: str, layout: Layout, fill) -> "_Memory":
        """Peer buffers sized for this layout, this rank's counters and partials zeroed and its
        inputs written by `fill`, all before the barrier after which peers may read and write."""
        mem = _Memory(self.memory, program, layout)
        mem.allocate()  # every rank takes the same decisions: sizes come from the global layout
        dist.barrier(group=self.group)  # owners created grown segments before peers map them
        self.memory.map_peers()
        mem.reset_own()
        fill(mem)
        dist.barrier(group=self.group)  # zeroed counters and written inputs, on every rank
        return mem

    def _run(self, program: str, layout: Layout, mem: "_Memory"):
        try:
            self.backend.execute(self.plan, layout, program, mem, ranks=[self.rank], timeout_s=self.timeout_s)
        finally:
            dist.barrier(group=self.group)  # peers finish writing into this rank before it reads
        return {self.rank: mem.result(self.rank)}

    def synchronize(self) -> None:
        """cuda: wait for this rank's kernels and raise the report of one that gave up (no-op on cpu)."""
        if self._cuda is not None:
            self._cuda.synchronize()

    def close(self) -> None:
        if self._cuda is not None:
            self._cuda.close()
        else:
            self.memory.close()


class _Memory:
    """The buffers and counters of one program, on every rank, in peer memory (the backend's
    Memory protocol: `buffer(program, name, rank)`, `flags(rank)`)."""

    def __init__(self, peer: PeerMemory, program: str, layout: Layout):
        self.peer, self.program, self.layout = peer, program, layout
        names = {layout.canonical(program, b) for c in layout.program_copies(program)
                 for b in (*c.src_buffers, c.dst_buffer)}
        names |= {"input", "output"} if program == "dispatch" else {"output", "result"}
        self.names = sorted(names)
        self.num_flags = max(len(layout.flags), 1)

    def allocate(self) -> bool:
        """Room for every buffer on every rank; True when a segment had to grow."""
        grew = False
        for name in self.names:
            sizes = []
            for r in range(self.layout.num_ranks):
                dt, shape = self.layout.spec(self.program, name, r)
                sizes.append(int(np.prod(shape)) * dt.itemsize)
            grew |= self.peer.plan(f"{self.program}.{name}", sizes)
        grew |= self.peer.plan(f"{self.program}.flags", [8 * self.num_flags] * self.layout.num_ranks)
        return grew

    def buffer(self, program: str, name: str, rank: int) -> np.ndarray:
        dt, shape = self.layout.spec(program, name, rank)
        return self.peer.array(f"{program}.{self.layout.canonical(program, name)}", rank, dt, shape)

    def flags(self, rank: int) -> np.ndarray:
        return self.peer.array(f"{self.program}.flags", rank, np.int64, (self.num_flags,))

    def reset_own(self) -> None:
        r = self.peer.rank
        self.flags(r)[:] = 0
        if self.program == "combine":
            for name in self.names:
                if name != "output":
                    self.buffer("combine", name, r)[:] = 0

    def result(self, rank: int) -> np.ndarray:
        return self.buffer(self.program, "output" if self.program == "dispatch" else "result", rank)


def check_tensor(fn: str, arg: str, t, shape: tuple, dtypes: tuple, device: torch.device | None = None) -> None:
    """The argument checks of every backend: a tensor, on the backend's device (None: the cpu
    backend's rule), of one of `dtypes`, of `shape` (None: any size); on a device, contiguous."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {arg} must be a torch.Tensor, not {type(t).__name__}")
    if device is None and t.device.type != "cpu":
        raise ValueError(f"{fn}: {arg} is on {t.device}; the cpu backend needs CPU tensors")
    if device is not None and t.device != device:
        raise ValueError(f"{fn}: {arg} is on {t.device}; this Buffer runs on {device}")
    if t.dtype not in dtypes:
        raise TypeError(f"{fn}: {arg} must be {' or '.join(str(d) for d in dtypes)}, not {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and a != s for a, s in zip(t.shape, shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{fn}: {arg} must have shape {want}, got {list(t.shape)}")
    if device is not None and not t.is_contiguous():
        raise ValueError(f"{fn}: {arg} must be contiguous")


def _unpack_rows(rows: np.ndarray, dtype: str, hidden: int):
    if rows.shape[0] == 0:  # a rank no token chose: torch cannot view an empty byte array as wider types
        if dtype == "fp8":
            return (torch.empty((0, hidden), dtype=torch.float8_e4m3fn),
                    torch.empty((0, hidden // FP8_GROUP), dtype=torch.float32))
        return torch.empty((0, hidden), dtype=torch.bfloat16)
    # A copy: `rows` lies in this rank's peer segment, which the next call reuses (or unmaps when it
    # grows): recv_x must stay the caller's after that.
    t = torch.from_numpy(np.array(rows, copy=True, order="C"))
    if dtype == "fp8":
        x8 = t[:, :hidden].contiguous().view(torch.float8_e4m3fn)
        sc = t[:, hidden:].contiguous().view(torch.float32)
        return x8, sc
    return t.view(torch.bfloat16)


def _global_rank(group, r: int) -> int:
    return dist.get_global_rank(group, r) if group is not dist.group.WORLD else r


def _backend(name: str):
    if name == "cpu":
        from epcc.backends import cpu

        return cpu
    raise BundleError(f"unknown backend '{name}' (this runtime has: cpu, cuda)")
