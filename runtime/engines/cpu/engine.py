"""`Buffer(..., backend="cpu")`: this rank's drivers over peer memory (the Engine protocol, base.py).

One process per rank, joined by a torch.distributed group.  Per call: the routing of every rank is
all-gathered (the plan's metadata step), every rank computes the same token-level layout
(runtime/layout), buffers live in peer memory (runtime/shm.py: named shared memory that peers
map, the CPU analogue of CUDA IPC handles), and threads.py runs this rank's drivers, which write
into peers' buffers and bump peers' counters directly.  `event` is None.

Every exchange between the ranks is a bounded round of the Buffer's agreement (agree.py), four
per call: the routing (after every rank checked its arguments: a refusal reaches every rank
there, and the Buffer stays usable), the peer buffers allocated, the inputs written, the run
ended.  While the drivers run, a peer's failure makes their waits give up at once.
"""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ....plan.bundle import Bundle
from ...layout import Layout, compute_layout
from ...shm import PeerMemory
from ..agree import Agreement
from ..lifetime import exit_hook, released_on_failure, track, untrack
from ..tensors import FP8_GROUP, WEIGHTS_DIFFER, check_tensor, check_token_count, check_topk_idx
from .threads import execute


@dataclass
class Handle:
    """What combine needs from the dispatch it reverses."""

    layout: Layout
    tokens: int
    recv_rows: int
    weights: np.ndarray | None = None  # [tokens, topk] float32: the routing weights dispatch was given


class CpuEngine:
    def __init__(self, group, bundle: Bundle, *, timeout_s: float, config: dict | None = None,
                 agree: Agreement | None = None):
        # `config` (a launch configuration) is the cuda engine's; Buffer refuses one for this engine
        self.group, self.plan, self.timeout_s = group, bundle.plan, timeout_s
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.device = torch.device("cpu")
        wl = self.plan.workload
        self.hidden, self.topk, self.experts, self.dtype = wl.hidden, wl.topk, wl.experts, wl.dtype
        self.agree = agree or Agreement.for_group(group, timeout_s)
        self.memory: PeerMemory | None = None
        exit_hook()
        with released_on_failure(self.release_locally), self.agree.call("making the Buffer", numbered=False):
            session = self.agree.gather("the peer memory's name", uuid.uuid4().hex[:12] if self.rank == 0 else None)
            self.memory = PeerMemory(session[0], self.rank, self.num_ranks)
        track(self)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x, topk_idx, topk_weights, *, sync: bool, expert_alignment: int, handle):
        with self.agree.call("dispatch"):
            return self._dispatch(x, topk_idx, topk_weights, sync=sync, expert_alignment=expert_alignment,
                                  handle=handle)

    def _dispatch(self, x, topk_idx, topk_weights, *, sync: bool, expert_alignment: int, handle):
        if handle is not None:
            raise ValueError("dispatch: handle (cached dispatch) needs the cuda backend")
        if topk_idx is None:
            raise TypeError("dispatch: topk_idx is required")
        if sync is not True:
            raise ValueError("dispatch: sync=False (low-latency mode) needs the cuda backend")
        if expert_alignment != 1:
            raise ValueError("dispatch: expert_alignment needs the cuda backend")
        rows, tokens = self._pack_x(x)
        check_token_count(tokens, self.plan.workload.tokens)
        idx = check_topk_idx("dispatch", topk_idx, self.topk, self.experts, "cpu", tokens)
        w = self._check_weights("dispatch", topk_weights, idx.shape)
        idx_all, w_all = self._gather_routing(idx, w)
        layout = compute_layout(self.plan, idx_all, w_all)
        mem = self._prepare("dispatch", layout,
                            lambda m: m.buffer("dispatch", "input", self.rank).__setitem__(slice(0, tokens), rows))
        out = self._run("dispatch", layout, mem)
        recv = out[self.rank]
        entries = layout.entries[("output", self.rank)]
        recv_x = _unpack_rows(recv, self.dtype, self.hidden)
        if layout.token_major:  # DeepEP's: each row's top-k, local expert ids on this rank, -1 elsewhere
            recv_idx = torch.from_numpy(np.ascontiguousarray(layout.recv_topk_idx[self.rank], dtype=np.int64))
            recv_w = torch.from_numpy(np.ascontiguousarray(layout.recv_topk_weights[self.rank], dtype=np.float32))
        else:
            recv_idx = torch.from_numpy(entries[:, 2].astype(np.int64))
            recv_w = torch.from_numpy(np.ascontiguousarray(layout.output_weights[self.rank], dtype=np.float32))
        counts = [int(c) for c in layout.recv_counts[self.rank]]
        return recv_x, recv_idx, recv_w, counts, Handle(layout, tokens, recv.shape[0], w), None

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, handle: Handle, topk_weights: torch.Tensor | None = None) -> torch.Tensor:
        with self.agree.call("combine"):
            return self._combine(x, handle, topk_weights)

    def _combine(self, x: torch.Tensor, handle: Handle, topk_weights: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(handle, Handle):
            raise TypeError(f"combine: handle must be the handle dispatch returned, not {type(handle).__name__}")
        check_tensor("combine", "x", x, (handle.recv_rows, self.hidden), (torch.bfloat16,))
        if topk_weights is not None:
            check_tensor("combine", "topk_weights", topk_weights, (handle.tokens, self.topk), (torch.float32,))
            if not np.array_equal(topk_weights.detach().numpy(), handle.weights):
                raise ValueError(WEIGHTS_DIFFER)
        y = (np.zeros((0, self.hidden), dtype=np.uint16) if x.shape[0] == 0 else
             x.detach().contiguous().view(torch.int16).numpy().view(np.uint16))
        # every rank accepted its arguments before any allocates (a refused call leaves every
        # rank's peer memory as it was: their next sizes agree)
        self.agree.barrier("the arguments' check")
        mem = self._prepare("combine", handle.layout,
                            lambda m: m.buffer("combine", "output", self.rank).__setitem__(slice(None), y))
        result = self._run("combine", handle.layout, mem)[self.rank]
        return torch.from_numpy(np.ascontiguousarray(result[: handle.tokens])).to(torch.bfloat16)

    def synchronize(self) -> None:
        """Nothing runs after a call returns on the CPU."""

    def close(self) -> None:
        untrack(self)
        self.release_locally()

    def release_locally(self) -> list[str]:
        """This rank's shared memory: its own segments unlinked, the peers' unmapped (a peer's own
        mapping stays valid until it unmaps it)."""
        if self.memory is not None:
            self.memory.close()
        return []

    def release_at_exit(self) -> None:
        self.release_locally()

    # ------------------------------------------------------------------ helpers
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
        """Every rank's top-k indices and weights: the first round of a dispatch, after every rank
        checked its arguments (a rank that refused one posts that instead: every rank raises).
        Ranks may dispatch different numbers of tokens: the shorter ones are padded with tokens
        of no expert (-1, weight 0), which no step moves and combine's result leaves out."""
        mine = (struct.pack("<q", idx.shape[0]) + np.ascontiguousarray(idx, dtype="<i8").tobytes()
                + np.ascontiguousarray(w, dtype="<f4").tobytes())
        parts = self.agree.exchange("the routing exchange", mine)
        counts = [struct.unpack_from("<q", p)[0] for p in parts]
        shape = (self.num_ranks, max(counts), self.topk)
        idx_all = np.full(shape, -1, dtype=np.int64)
        w_all = np.zeros(shape, dtype=np.float32)
        for r, (p, t) in enumerate(zip(parts, counts)):
            n = t * self.topk
            idx_all[r, :t] = np.frombuffer(p, dtype="<i8", count=n, offset=8).reshape(t, self.topk)
            w_all[r, :t] = np.frombuffer(p, dtype="<f4", count=n, offset=8 + 8 * n).reshape(t, self.topk)
        return idx_all, w_all

    def _prepare(self, program: str, layout: Layout, fill) -> "_Memory":
        """Peer buffers sized for this layout, this rank's counters and partials zeroed and its
        inputs written by `fill`, all before the barrier after which peers may read and write."""
        mem = _Memory(self.memory, program, layout)
        mem.allocate()  # every rank takes the same decisions: sizes come from the global layout
        self.agree.barrier("the peer buffers' allocation")  # owners created grown segments before peers map them
        self.memory.map_peers()
        mem.reset_own()
        fill(mem)
        self.agree.barrier("the inputs' writing")  # zeroed counters and written inputs, on every rank
        return mem

    def _run(self, program: str, layout: Layout, mem: "_Memory"):
        """This rank's drivers, every wait bounded by the timeout; a peer that fails meanwhile (its
        alarm) makes them give up at once.  A failure here reaches the peers in the last round,
        where the others meet when their drivers are done: after it, no peer writes into this
        rank any more, and this rank reads its results."""
        abort = np.zeros(1, dtype=np.int64)
        with self.agree.watch(lambda: abort.__setitem__(0, 1)):
            execute(self.plan, layout, program, mem, ranks=[self.rank], timeout_s=self.timeout_s, abort=abort)
        self.agree.barrier("the end of the run")
        return {self.rank: mem.result(self.rank)}


class _Memory:
    """The buffers and counters of one program, on every rank, in peer memory (threads.py's
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
