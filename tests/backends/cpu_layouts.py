"""Plans and layouts built by hand for the cpu engine's tests (no compiler, no compute_layout)."""

from __future__ import annotations

import numpy as np

from epcc.plan import KernelPlan, Plan, PlanStep, RolePlan
from epcc.runtime.layout import Copy, FlagInfo, Layout


def step(program: str, name: str, *, verb: str = "send", deps=(), src=("input",), dst="output",
         weighted: bool = False, line: int = 1, reverse_of: str | None = None) -> PlanStep:
    return PlanStep(name=name, program=program, verb=verb, link=None, link_kind=None, deps=tuple(deps),
                    line=line, src_buffers=tuple(src), dst_buffer=dst, weighted=weighted,
                    reverse_of=reverse_of)


def kernel(name: str, kind: str, program: str, *steps: str, role: str = "sender") -> KernelPlan:
    roles = [RolePlan(s, role, i, i + 1 if kind == "kernel" else i, 8 if kind == "kernel" else 0,
                      "sm" if kind == "kernel" else ("nic" if kind == "proxy" else "dma"))
             for i, s in enumerate(steps)]
    return KernelPlan(name, kind, program, len(steps) if kind == "kernel" else 0, roles)


def plan_of(name: str, num_ranks: int, steps: list[PlanStep], kernels: list[KernelPlan]) -> Plan:
    return Plan(schedule=name, num_ranks=num_ranks, routing="test", bytes_per_token=0, steps=steps,
                kernels=kernels, rank_names=[rank_name(r) for r in range(num_ranks)])


def rank_name(r: int) -> str:
    return f"rank {r} (node 0, gpu {r})"


class LayoutBuilder:
    """Buffers by row count, copies with their chunks and waits, one flag per copy (+ gates)."""

    def __init__(self, num_ranks: int, tokens: int, *, row_bytes: int = 0, hidden: int = 0):
        self.R, self.T, self.row_bytes, self.hidden = num_ranks, tokens, row_bytes, hidden
        self.rows: dict[tuple[str, int], int] = {("input", r): tokens for r in range(num_ranks)}
        self.copies: list[Copy] = []
        self.flags: list[FlagInfo] = []

    def buffer(self, name: str, rank: int, rows: int) -> None:
        self.rows[(name, rank)] = rows

    def _flag(self, program: str, step: str, flow: int, rank: int, chunks: int) -> int:
        fid = len(self.flags)
        self.flags.append(FlagInfo(fid, rank, program, step, flow, chunks))
        return fid

    def gate(self, program: str, step: str, flow: int, rank: int) -> int:
        """A counter no copy bumps (the test sets it, or nobody does)."""
        return self._flag(program, step, flow, rank, 1)

    def copy(self, program: str, step: str, *, rank: int, src: int, dst: int, src_buffer, src_slots,
             dst_buffer: str, dst_slots, chunk_starts=None, waits=None, weights=None, flow: int = 0,
             step_index: int = 0) -> Copy:
        src_slots = np.asarray(src_slots, dtype=np.int64)
        dst_slots = np.asarray(dst_slots, dtype=np.int64)
        n = len(dst_slots)
        cs = np.asarray([0, n] if chunk_starts is None else chunk_starts, dtype=np.int64)
        src_buffers = list(src_buffer) if isinstance(src_buffer, (list, tuple)) else [src_buffer] * n
        fid = self._flag(program, step, flow, dst, len(cs) - 1)
        c = Copy(program=program, step=step, step_index=step_index, flow_index=flow, rank=rank, src=src, dst=dst,
                 src_buffers=src_buffers, src_slots=src_slots, dst_buffer=dst_buffer, dst_slots=dst_slots,
                 weights=None if weights is None else np.asarray(weights, dtype=np.float32), chunk_starts=cs,
                 waits=[list(w) for w in waits] if waits is not None else [[] for _ in range(len(cs) - 1)],
                 flag_id=fid)
        self.copies.append(c)
        return c

    def layout(self, experts: int = 0) -> Layout:
        entries = {}
        for (name, r), n in self.rows.items():
            cols = 3 if name == "output" else 2
            e = np.zeros((n, cols), dtype=np.int64)
            if name == "input":
                e[:, 0], e[:, 1] = r, np.arange(n)
            entries[(name, r)] = e
        order = {"dispatch": 0, "combine": 1}
        copies = sorted(self.copies, key=lambda c: order[c.program])
        return Layout(num_ranks=self.R, tokens=self.T, topk=1, experts=experts or self.R, hidden=self.hidden,
                      row_bytes=self.row_bytes, entries=entries, copies=copies, flags=self.flags,
                      recv_counts=np.zeros((self.R, 1), dtype=np.int64),
                      rank_names=[rank_name(r) for r in range(self.R)])
