"""`epcc.runtime.Buffer`: dispatch and combine through a compiled bundle, shaped after DeepEP.

    buf = Buffer(group, "build/h200x4")          # a bundle written by `epcc compile -o`
    layout = buf.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = buf.dispatch(x, topk_idx, topk_weights)
    y = experts(recv_x)                           # rows are expert-major: the permute is fused
    combined_x = buf.combine(y, handle)

One process per rank, joined by a `torch.distributed` group.  The bundle's plan.json (and its
manifests) is all the runtime reads (no MLIR; epcc.plan.bundle loads it).  Buffer checks what
every backend shares (the bundle, the group, the arguments) and hands each call to the engine of
the bundle's backend (runtime/engines/base.py, the Engine protocol):

* cpu (runtime/engines/cpu/engine.py): the plan's roles JIT-compiled, this rank's as threads,
  buffers in peer memory (named shared memory that peers map, the CPU analogue of CUDA IPC);
* cuda: the direct one-hop kernels of a one-hop plan (runtime/engines/cuda_direct/engine.py), the
  table-driven kernels of any other plan, with the GPU proxy path for a bundle compiled with
  `--rdma proxy` (runtime/engines/cuda_table/engine.py), on this rank's GPU;
* supa: the bundle's SUPA sources (`--target supa`).  With EPCC_SUPA_SHIM=1 (never implied) they
  are built by nvcc through the SUPA-on-CUDA shim and run on this rank's NVIDIA GPU by the table
  engine (runtime/engines/supa_shim); otherwise Buffer says that no SUPA device is present (or,
  where torch_supa is importable, that running on it is not implemented yet).

When a call fails on one rank (an argument it refuses, a wait that gives up, a peer that stalls or
dies), every rank raises the same `GroupError` within the timeout and a few seconds, naming that
rank and why; `state` then says whether the Buffer can be used again ("ready") or must be made
anew ("failed"; its calls say so).  runtime/engines/agree.py is how.  A construction that fails
releases what its engine had acquired before the error leaves it, and the error holds none of the
Buffer's objects; a Buffer never closed is released at interpreter exit (runtime/engines/lifetime.py).

Differences from DeepEP's intranode `Buffer`: outputs are expert-major (one row per (token,
local expert), in the documented order: local expert, then source rank, then token), so
`recv_topk_idx` / `recv_topk_weights` hold the global expert and the weight of each row, and
`combine` takes expert outputs in that same row order.  `event` is None.  A bundle compiled with
the workload's `layout token` (the cpu backend, and the cuda backend where the bundle has direct
kernels: one-hop plans) returns DeepEP's token-major outputs instead: one row
per token and destination rank, in (source rank, token) order, `recv_topk_idx` / `recv_topk_weights`
[rows, topk] with local expert ids (-1 where the expert is elsewhere), and `combine` sums each
token's rows at its home rank, unweighted, as DeepEP's does.

`rdma_chunk_tokens` / `rdma_depth` re-chunk the plan's RDMA steps for this Buffer (tokens per
chunk, chunks in flight; plan/rdma.py `with_overrides`, as `epcc run` does with
EPCC_RDMA_CHUNK_TOKENS / EPCC_RDMA_DEPTH): the layout, the tables and the proxy path's rings and
FIFOs follow the new chunks, the compiled kernels do not change.  Only for a plan with RDMA steps.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..limits import MAX_DEPTH, timeout_seconds
from ..plan import bundle as bundle_io
from ..plan.bundle import BundleError
from ..plan.rdma import rdma_steps, with_overrides
from .engines.agree import Agreement
from .engines.base import (Engine, EngineError, GroupError, GroupTimeout, GroupTypeError,  # noqa: F401 - API
                           GroupValueError)
from .engines.lifetime import exit_hook, released_on_failure, untrack
from .engines.tensors import check_tensor, check_topk_idx

#: DeepEP's layout and stream arguments, which dispatch accepts and ignores (the plan's metadata
#: step computes the layout; epcc runs on the current stream).
DEEPEP_LAYOUT_ARGS = frozenset({"num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert",
                                "is_token_in_rank", "previous_event", "async_finish", "allocate_on_comm_stream"})


#: Buffer(backend="supa") runs the SUPA sources on NVIDIA GPUs through the SUPA-on-CUDA shim only
#: when this is "1": the shim is chosen explicitly, never because a SUPA device is missing.
SUPA_SHIM_ENV = "EPCC_SUPA_SHIM"


def supa_shim() -> bool:
    """True when Buffer(backend="supa") may run through the shim ($EPCC_SUPA_SHIM=1); otherwise an
    EngineError that says why it cannot run here (ValueError for another value of the variable)."""
    value = os.environ.get(SUPA_SHIM_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"Buffer(backend='supa'): ${SUPA_SHIM_ENV} is {value!r}; set it to 1 to run the SUPA kernels "
                         f"on NVIDIA GPUs through the SUPA-on-CUDA shim, or leave it unset (0)")
    if value == "1":
        return True
    if importlib.util.find_spec("torch_supa") is not None:
        raise EngineError("Buffer(backend='supa'): torch_supa is importable, but this runtime runs SUPA bundles only "
                          f"through the SUPA-on-CUDA shim on NVIDIA GPUs (${SUPA_SHIM_ENV}=1): building them with brcc "
                          "and running them on torch_supa devices with a BCCL group is not implemented yet")
    raise EngineError("Buffer(backend='supa'): no SUPA device is present (torch_supa is not importable); to run the "
                      f"bundle's SUPA kernels on NVIDIA GPUs through the SUPA-on-CUDA shim, set ${SUPA_SHIM_ENV}=1")


def engine_class(backend: str, bundle: bundle_io.Bundle | None = None) -> type:
    """The engine of a backend name for `bundle` (BundleError for an unknown one): on cuda, the
    direct kernels' where the bundle has them (a one-hop plan), else the table-driven kernels';
    on supa, the table-driven kernels' SUPA sources through the shim (supa_shim() says whether)."""
    if backend == "supa":
        supa_shim()
        from .engines.supa_shim.engine import SupaShimEngine  # torch.cuda and nvcc: only this backend

        return SupaShimEngine
    if backend == "cpu":
        from .engines.cpu.engine import CpuEngine  # llvmlite JITs the plan: only this backend needs it

        return CpuEngine
    if backend == "cuda":
        if bundle is None or "direct" in bundle_io.cuda_manifest(bundle.path):
            from .engines.cuda_direct.engine import CudaDirectEngine  # torch.cuda and nvcc: only this backend

            return CudaDirectEngine
        from .engines.cuda_table.engine import CudaTableEngine  # torch.cuda and nvcc: only this backend

        return CudaTableEngine
    raise BundleError(f"unknown backend '{backend}' (this runtime has: cpu, cuda, supa)")


class Buffer:
    def __init__(self, group: dist.ProcessGroup | None, bundle: str | Path, *, backend: str | None = None,
                 timeout_s: float = 30.0, config: dict | None = None, rdma_chunk_tokens: int | None = None,
                 rdma_depth: int | None = None):
        if not isinstance(bundle, (str, Path)):
            raise TypeError(f"Buffer: bundle must be a path (str or pathlib.Path), not {type(bundle).__name__}")
        timeout_s = timeout_seconds(timeout_s, "Buffer")  # positive, at most a day: deadlines fit 64 bits
        for name, v, top in (("rdma_chunk_tokens", rdma_chunk_tokens, None), ("rdma_depth", rdma_depth, MAX_DEPTH)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise TypeError(f"Buffer: {name} must be a whole number or None, not {type(v).__name__}")
            if v is not None and not (1 <= v <= (top or v)):
                raise ValueError(f"Buffer: {name} must be at least 1" + (f" and at most {top}" if top else "") +
                                 f", not {v}")
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.num_ranks = dist.get_world_size(self.group)
        self.engine: Engine | None = None
        exit_hook()  # before anything is acquired: what a failure leaves in a cycle is collected at exit
        # Every failure from here on reaches every rank (engines/agree.py), none waits unbounded;
        # and leaves nothing behind: what was acquired is released before the error leaves (lifetime.py)
        self.agree = Agreement.for_group(self.group, timeout_s)
        with released_on_failure(self._release_engine), self.agree.call("making the Buffer", numbered=False):
            self._make(bundle, backend, timeout_s, config, rdma_chunk_tokens, rdma_depth)

    def _release_engine(self) -> list[str]:
        """A failed construction: the engine's resources, released on this rank alone (an engine
        whose own construction failed released its own already)."""
        engine, self.engine = self.engine, None
        if engine is None:
            return []
        untrack(engine)
        return engine.release_locally()

    def _make(self, bundle, backend: str | None, timeout_s: float, config: dict | None,
              rdma_chunk_tokens: int | None, rdma_depth: int | None) -> None:
        loaded = bundle_io.load(bundle)
        if rdma_chunk_tokens is not None or rdma_depth is not None:
            if not rdma_steps(loaded.plan):
                raise ValueError(f"Buffer: rdma_chunk_tokens / rdma_depth re-chunk RDMA steps, and the plan of "
                                 f"{bundle} has none")
            loaded = replace(loaded, plan=with_overrides(loaded.plan, chunk_tokens=rdma_chunk_tokens,
                                                         depth=rdma_depth, env={}))
        self.plan, manifest = loaded.plan, loaded.manifest
        self.backend_name = backend or manifest.get("backend", "cpu")
        # Errors of the call itself first, the same on every rank and before any collective:
        # a machine without a GPU must not surface as a group-size or nvcc error further in.
        if self.backend_name == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("Buffer(backend='cuda'): no CUDA device is available (torch.cuda.is_available() is "
                               "False: a CPU-only torch, no driver, or CUDA_VISIBLE_DEVICES hides the GPUs); "
                               "use backend='cpu' on this machine")
        if self.backend_name == "supa" and supa_shim() and not torch.cuda.is_available():
            raise RuntimeError(f"Buffer(backend='supa') with ${SUPA_SHIM_ENV}=1 runs the SUPA kernels on NVIDIA GPUs "
                               "through the SUPA-on-CUDA shim, and no CUDA device is available")
        if self.backend_name != "cpu" and self.plan.workload is not None and self.plan.workload.layout == "token" \
                and not (self.backend_name == "cuda" and "direct" in bundle_io.cuda_manifest(loaded.path,
                                                                                             required=False)):
            raise BundleError(f"bundle {bundle} dispatches token-major (workload layout token), which the cpu backend "
                              f"and the cuda backend's direct kernels run; the {self.backend_name} kernels of this "
                              f"bundle write expert-major output")
        if self.backend_name != "cuda" and config:  # an empty mapping asks for nothing
            raise ValueError("Buffer: config (SMs, warps) applies to the cuda backend only")
        if self.plan.num_ranks != self.num_ranks:
            raise BundleError(f"bundle {bundle} was compiled for {self.plan.num_ranks} ranks "
                              f"({manifest.get('schedule', '?')}), but the group has {self.num_ranks}")
        self.timeout_s = timeout_s
        wl = self.plan.workload
        self.hidden, self.topk, self.experts, self.dtype = wl.hidden, wl.topk, wl.experts, wl.dtype
        self.engine: Engine = engine_class(self.backend_name, loaded)(self.group, loaded, timeout_s=timeout_s,
                                                                      config=config, agree=self.agree)

    @property
    def state(self) -> str:
        """"ready", or "failed" after a call that failed for good (every call then raises
        GroupError: make a new Buffer)."""
        return self.agree.state

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
        if self.engine.device.type == "cuda" and isinstance(topk_idx, torch.Tensor) and topk_idx.is_cuda:
            return self._layout_on_device(topk_idx)
        idx = check_topk_idx("get_dispatch_layout", topk_idx, self.topk, self.experts, self.backend_name)
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
                     device=self.engine.device)
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
        receive buffer, the counts come as device tensors (counts, offsets), recv_topk_idx is None;
        token-major bundles: recv_topk_idx is the whole [capacity, topk] buffer and the offsets are
        each source rank's first row, then the total; on the GPU proxy path synchronize (this
        Buffer's `synchronize()`, the stream or the device) before copying them into pageable memory
        on the default stream (`.cpu()`, `.item()`), a copy that holds the proxy's CUDA calls: docs/rdma.md;
        where the bundle's metadata exchange is the process group's collective, call `synchronize()`
        before reading them or blocking in another CUDA call: docs/cuda.md); `handle` (instead of
        topk_idx/topk_weights) reuses an earlier dispatch's routing (without a metadata kernel when
        it is the last one's)."""
        # a refused keyword reaches the peers as the engine's errors do
        with released_on_failure(), self.agree.call("dispatch"):
            unknown = sorted(set(deepep_layout) - DEEPEP_LAYOUT_ARGS)
            if unknown:
                raise TypeError(f"dispatch: unexpected keyword argument(s) {', '.join(unknown)} (besides x, topk_idx, "
                                f"topk_weights, sync, expert_alignment and handle it takes DeepEP's layout arguments, "
                                f"ignored: {', '.join(sorted(DEEPEP_LAYOUT_ARGS))})")
            return self.engine.dispatch(x, topk_idx, topk_weights, sync=sync, expert_alignment=expert_alignment,
                                        handle=handle)

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, handle, topk_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Sum each token's expert outputs, weighted by its routing weights, at its home rank
        (token-major bundles: sum each token's rows, unweighted).

        x: [recv rows, hidden] bfloat16, rows in dispatch's order.  The weights of dispatch are used
        (`topk_weights`, if given, must equal them: combine cannot re-route)."""
        with released_on_failure():
            return self.engine.combine(x, handle, topk_weights)

    def synchronize(self) -> None:
        """cuda: wait for this rank's kernels and raise the report of one that gave up (no-op on cpu)."""
        with released_on_failure():
            self.engine.synchronize()

    def close(self) -> None:
        """Release the engine's resources (collective: every rank closes; a Buffer left open is
        released on this rank alone at interpreter exit, engines/lifetime.py)."""
        with released_on_failure():
            self.engine.close()
