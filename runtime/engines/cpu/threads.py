"""Run a plan's JIT-compiled drivers as threads over NumPy buffers (the cpu engine).

    from epcc.runtime.engines.cpu import threads
    out = threads.run_dispatch(plan, layout, x_rows)     # x_rows[r]: uint8 [T, row_bytes]
    res = threads.run_combine(plan, layout, y)           # y[r]: bf16 (uint16) [n_d, hidden]

backends/cpu/codegen.py writes the plan as one LLVM module with a driver per (program, role);
jit.py compiles it; this module runs it.

Memory.  A *memory* gives every rank's buffers and flag counters as NumPy arrays:

* `buffer(program, name, rank)`: dispatch buffers (`input`, staging, `output`) are uint8
  `[rows, row_bytes]`; combine's `output` holds the expert outputs, bf16 as uint16
  `[rows, hidden]`; every other combine buffer (`result`: the partials of `input`, `[T,
  hidden]`, and the partial buffers, `Layout.combine_rows` rows) is float32 `[rows, hidden]`;
* `flags(rank)`: int64 `[len(layout.flags)]` (at least 1): the counter `flag_id` lives at
  `flags(FlagInfo.rank)[flag_id]`, the rank whose buffer its copy writes.

`HostMemory` keeps all of them in this process (run_dispatch / run_combine); the Buffer engine
(engine.py) passes peer memory instead (every rank a process, buffers in shared memory) and
calls `execute` for its own rank only.

Execution.  One thread per (executing rank, role) that has copies; it calls the role's driver
(ctypes releases the GIL, so the threads run in parallel) with a table built here: the copies
of that step on that rank, each with the address of every source and destination row, its chunk
boundaries, its flag, and per chunk the flags and values to wait for.  The driver waits (bounded),
moves the chunk's rows, and bumps the flag (release).  A wait that times out makes every other
wait of the run give up (a shared abort word), and `execute` raises `CpuBackendTimeout` naming
the first stuck wait, followed back to the root of the chain of stuck producers, in the format
of runtime/native/epcc_sync.c.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from epcc.backends.cpu import codegen
from epcc.backends.cpu.codegen import COPY_FIELDS, ERR_FIELDS, OP_ACC_BF16, OP_ACC_F32, OP_COPY, ROLE_FIELDS
from epcc.limits import timeout_seconds
from epcc.plan import Plan

from ...layout import Copy, Layout
from ..base import KernelTimeout
from .jit import JitPlan, compile_plan

PROGRAMS = ("dispatch", "combine")


class CpuBackendTimeout(KernelTimeout):
    """A bounded wait of a driver gave up: which rank, step, chunk and flag, and how far the flag got."""

    def __init__(self, message: str, *, rank: int, program: str, step: str, chunk: int, flag_id: int,
                 flag: str, value: int, expected: int, timeout_s: float, stuck: list[str]):
        super().__init__(message)
        self.rank, self.program, self.step, self.chunk = rank, program, step, chunk
        self.flag_id, self.flag, self.value, self.expected = flag_id, flag, value, expected
        self.timeout_s = timeout_s
        self.stuck = stuck  # every wait that gave up, one line each (timed out or aborted)


class Memory(Protocol):
    def buffer(self, program: str, name: str, rank: int) -> np.ndarray: ...

    def flags(self, rank: int) -> np.ndarray: ...


class HostMemory:
    """Every rank's buffers and counters of one program in this process, zeroed on creation.

    In combine, `input` and `result` are one buffer: the partials of `input` are the result."""

    def __init__(self, layout: Layout, program: str):
        self.layout = layout
        self.program = program
        self._bufs: dict[tuple[str, int], np.ndarray] = {}
        self._lock = threading.Lock()  # ranks may run execute() in threads of their own
        self._flags = [np.zeros(max(len(layout.flags), 1), dtype=np.int64) for _ in range(layout.num_ranks)]

    def _key(self, name: str) -> str:
        return self.layout.canonical(self.program, name)

    def shape(self, name: str, rank: int) -> tuple[np.dtype, tuple[int, int]]:
        return self.layout.spec(self.program, name, rank)

    def set_buffer(self, name: str, rank: int, arr: np.ndarray) -> None:
        dt, shape = self.shape(self._key(name), rank)
        if arr.dtype != dt or arr.shape != shape:
            raise ValueError(f"{self.program} buffer '{name}' of rank {rank} must be {dt} {list(shape)}, "
                             f"got {arr.dtype} {list(arr.shape)}")
        self._bufs[(self._key(name), rank)] = np.ascontiguousarray(arr).copy()

    def buffer(self, program: str, name: str, rank: int) -> np.ndarray:
        if program != self.program:
            raise ValueError(f"this memory holds {self.program} buffers, not {program}")
        key = (self._key(name), rank)
        with self._lock:
            if key not in self._bufs:
                dt, shape = self.shape(key[0], rank)
                a = np.empty(shape, dtype=dt)
                a.fill(0)  # touch every page now, not from hundreds of threads at once
                self._bufs[key] = a
            return self._bufs[key]

    def flags(self, rank: int) -> np.ndarray:
        return self._flags[rank]


# ---------------------------------------------------------------------------------------------


def _row_len(layout: Layout, program: str) -> int:
    return layout.row_bytes if program == "dispatch" else layout.hidden


def _expect(arr: np.ndarray, dtype, row_len: int, what: str) -> None:
    if arr.dtype != np.dtype(dtype) or arr.ndim != 2 or arr.shape[1] != row_len:
        raise ValueError(f"{what} must be {np.dtype(dtype)} [rows, {row_len}], got {arr.dtype} {list(arr.shape)}")
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ValueError(f"{what} must be a writeable C-contiguous array")


def _row_addresses(arr: np.ndarray, slots: np.ndarray, what: str) -> np.ndarray:
    slots = np.asarray(slots, dtype=np.int64)
    if slots.size and (slots.min() < 0 or slots.max() >= arr.shape[0]):
        bad = slots[(slots < 0) | (slots >= arr.shape[0])][0]
        raise ValueError(f"{what}: slot {int(bad)} is outside the buffer's {arr.shape[0]} rows")
    return (np.uint64(arr.ctypes.data) + slots.astype(np.uint64) * np.uint64(arr.strides[0])).astype(np.uint64)


@dataclass
class _Thread:
    rank: int
    program: str
    step: str
    fn: object  # the driver (ctypes)
    table: np.ndarray  # struct epcc.role
    err: np.ndarray  # struct epcc.err
    copies: list[Copy]
    status: int = -1


class _Tables:
    """The descriptor tables of one run, and every array they point into (kept alive)."""

    def __init__(self, plan: Plan, layout: Layout, program: str, mem: Memory, timeout_ns: int,
                 abort: np.ndarray | None = None):
        self.plan, self.layout, self.program, self.mem = plan, layout, program, mem
        self.timeout_ns = timeout_ns
        self.keep: list[np.ndarray] = []
        self.abort = np.zeros(1, dtype=np.int64) if abort is None else abort
        self.scratch = np.zeros(1, dtype=np.int64)  # the counter of a copy with flag_id -1
        self.flag_rank = {f.flag_id: f.rank for f in layout.flags}
        self._flag_arrays: dict[int, np.ndarray] = {}

    def _arr(self, a) -> np.ndarray:
        a = np.ascontiguousarray(a)
        self.keep.append(a)
        return a

    def flag_address(self, flag_id: int, what: str) -> int:
        if flag_id == -1:
            return self.scratch.ctypes.data
        if flag_id not in self.flag_rank:
            raise ValueError(f"{what}: flag {flag_id} is not in layout.flags")
        r = self.flag_rank[flag_id]
        fl = self._flag_arrays.get(r)
        if fl is None:
            fl = self.mem.flags(r)
            if fl.dtype != np.int64 or fl.ndim != 1 or not fl.flags.c_contiguous:
                raise ValueError(f"flags of rank {r} must be a C-contiguous int64 vector")
            self._flag_arrays[r] = fl
        if not 0 <= flag_id < fl.shape[0]:
            raise ValueError(f"{what}: flag {flag_id} is outside rank {r}'s {fl.shape[0]} counters")
        return fl.ctypes.data + 8 * flag_id

    def copy_row(self, c: Copy, op: str) -> list[int]:
        what = f"{c.program} step '{c.step}' flow {c.flow_index} (rank {c.rank}: {c.src} -> {c.dst})"
        row_len = _row_len(self.layout, c.program)
        n = int(np.asarray(c.dst_slots).shape[0])
        if np.asarray(c.src_slots).shape[0] != n or len(c.src_buffers) != n:
            raise ValueError(f"{what}: src_slots, src_buffers and dst_slots differ in length")
        src_dtype, dst_dtype = {OP_COPY: (np.uint8, np.uint8), OP_ACC_BF16: (np.uint16, np.float32),
                                OP_ACC_F32: (np.float32, np.float32)}[op]
        dst = self.mem.buffer(c.program, c.dst_buffer, c.dst)
        _expect(dst, dst_dtype, row_len, f"{what}: destination '{c.dst_buffer}' on rank {c.dst}")
        dst_rows = self._arr(_row_addresses(dst, c.dst_slots, f"{what}: destination '{c.dst_buffer}'"))
        src_rows = np.zeros(n, dtype=np.uint64)
        names = np.asarray(c.src_buffers, dtype=object)
        for name in dict.fromkeys(c.src_buffers):
            if op == OP_ACC_BF16 and name != "output":
                raise ValueError(f"{what}: a weighted combine step reads the expert outputs ('output'), "
                                 f"not '{name}'")
            if op == OP_ACC_F32 and name == "output":
                raise ValueError(f"{what}: an unweighted combine step reads partials, not 'output'")
            src = self.mem.buffer(c.program, name, c.src)
            _expect(src, src_dtype, row_len, f"{what}: source '{name}' on rank {c.src}")
            m = names == name
            src_rows[m] = _row_addresses(src, np.asarray(c.src_slots)[m], f"{what}: source '{name}'")
        src_rows = self._arr(src_rows)
        weights = 0
        if op == OP_ACC_BF16:
            if c.weights is None or np.asarray(c.weights).shape != (n,):
                raise ValueError(f"{what}: a weighted combine copy needs weights [{n}]")
            weights = self._arr(np.asarray(c.weights, dtype=np.float32)).ctypes.data
        elif c.weights is not None:
            raise ValueError(f"{what}: weights on a copy of an unweighted step")
        cs = self._arr(np.asarray(c.chunk_starts, dtype=np.int64))
        n_chunks = cs.shape[0] - 1
        if n_chunks < 0 or cs[0] != 0 or cs[-1] != n or np.any(np.diff(cs) < 0):
            raise ValueError(f"{what}: chunk_starts {cs.tolist()} must rise from 0 to {n}")
        waits = c.waits if c.waits else [[] for _ in range(n_chunks)]
        if len(waits) != n_chunks:
            raise ValueError(f"{what}: {len(waits)} wait lists for {n_chunks} chunks")
        ws = self._arr(np.cumsum([0] + [len(w) for w in waits], dtype=np.int64))
        wflags = self._arr(np.array([self.flag_address(int(f), what) for w in waits for f, _ in w] or [0],
                                    dtype=np.uint64))
        wvals = self._arr(np.array([int(v) for w in waits for _, v in w] or [0], dtype=np.int64))
        fields = {"n_chunks": n_chunks, "chunk_starts": cs.ctypes.data, "src_rows": src_rows.ctypes.data,
                  "dst_rows": dst_rows.ctypes.data, "weights": weights,
                  "flag": self.flag_address(int(c.flag_id), what), "wait_starts": ws.ctypes.data,
                  "wait_flags": wflags.ctypes.data, "wait_values": wvals.ctypes.data}
        return [int(fields[f]) for f in COPY_FIELDS]

    def role(self, rank: int, step: str, op: str, fn, copies: list[Copy]) -> _Thread:
        rows = [self.copy_row(c, op) for c in copies]
        cps = self._arr(np.array(rows, dtype=np.uint64).reshape(len(rows), len(COPY_FIELDS)))
        err = self._arr(np.zeros(len(ERR_FIELDS), dtype=np.int64))
        max_chunks = max((int(r[COPY_FIELDS.index("n_chunks")]) for r in rows), default=0)
        fields = {"n_copies": len(rows), "row_len": _row_len(self.layout, self.program),
                  "timeout_ns": self.timeout_ns, "max_chunks": max_chunks, "copies": cps.ctypes.data,
                  "err": err.ctypes.data, "abort": self.abort.ctypes.data}
        table = self._arr(np.array([int(fields[f]) for f in ROLE_FIELDS], dtype=np.uint64))
        return _Thread(rank, self.program, step, fn, table, err, copies)


def _threads(jp: JitPlan, plan: Plan, layout: Layout, program: str, mem: Memory, ranks, timeout_ns: int,
             skip_steps=frozenset(), abort: np.ndarray | None = None):
    tables = _Tables(plan, layout, program, mem, timeout_ns, abort)
    by_role: dict[tuple[int, str], list[Copy]] = {}
    for c in layout.program_copies(program):
        if (program, c.step) not in jp.drivers:
            raise ValueError(f"the layout has copies of step '{c.step}' of {program}, which is no role "
                             f"of the plan's kernels")
        if c.step in skip_steps:
            continue  # run by someone else (the RDMA proxy loop, rdma_host.py)
        if ranks is None or c.rank in ranks:
            by_role.setdefault((c.rank, c.step), []).append(c)
    threads = []
    for k in plan.kernels:  # in the plan's kernel and role order
        if k.program != program:
            continue
        for r in k.roles:
            info, fn = jp.driver(program, r.step)
            for rank in range(layout.num_ranks):
                copies = by_role.get((rank, r.step))
                if copies:
                    threads.append(tables.role(rank, r.step, info.op, fn, copies))
    return tables, threads


def rank_desc(layout: Layout, rank: int) -> str:
    name = layout.rank_names[rank] if rank < len(layout.rank_names) else str(rank)
    return name if name.startswith("rank ") else f"rank {name}"


def timeout_message(timeout_ns: int, rank_desc: str, step: str, flag: str, value: int, expected: int) -> str:
    """The message of runtime/native/epcc_sync.c's format_timeout, for the same wait."""
    secs, msecs = timeout_ns // 1_000_000_000, (timeout_ns % 1_000_000_000) // 1_000_000
    return (f"epcc: wait timed out after {secs}.{msecs:03d} s: {rank_desc} step '{step}' flag '{flag}' "
            f"(value {value}, waiting for >= {expected})")


def _raise_stuck(layout: Layout, program: str, threads: list[_Thread], timeout_ns: int, timeout_s: float):
    E = {f: i for i, f in enumerate(ERR_FIELDS)}
    flags = {f.flag_id: f for f in layout.flags}
    stuck = {}
    for t in threads:
        if t.status == codegen.STATUS_OK:
            continue
        e = t.err
        c = t.copies[int(e[E["copy"]])]
        chunk, w = int(e[E["chunk"]]), int(e[E["wait"]])
        flag_id = int(c.waits[chunk][w][0])
        stuck[(t.rank, t.step)] = dict(rank=t.rank, step=t.step, copy=c, chunk=chunk, flag_id=flag_id,
                                       value=int(e[E["observed"]]), expected=int(e[E["expected"]]),
                                       status=int(e[E["status"]]), time=int(e[E["time_ns"]]))
    if not stuck:
        raise RuntimeError(f"epcc cpu backend: a {program} driver failed without an error record")
    producer = {c.flag_id: (c.rank, c.step) for c in layout.program_copies(program) if c.flag_id != -1}
    timed_out = [s for s in stuck.values() if s["status"] == codegen.STATUS_TIMEOUT] or list(stuck.values())
    cur = min(timed_out, key=lambda s: s["time"])
    seen = {(cur["rank"], cur["step"])}
    # Follow the chain: the flag did not move because its producer is itself stuck in a wait.
    while True:
        p = producer.get(cur["flag_id"])
        if p is None or p not in stuck or p in seen:
            break
        seen.add(p)
        cur = stuck[p]

    def flag_name(fid: int) -> str:
        return flags[fid].name() if fid in flags else f"flag {fid}"

    lines = [f"{rank_desc(layout, s['rank'])} step '{s['step']}' chunk {s['chunk']}: "
             f"{'timed out' if s['status'] == codegen.STATUS_TIMEOUT else 'gave up'} on "
             f"'{flag_name(s['flag_id'])}' (value {s['value']}, waiting for >= {s['expected']})"
             for s in sorted(stuck.values(), key=lambda s: (s["rank"], s["step"]))]
    msg = timeout_message(timeout_ns, rank_desc(layout, cur["rank"]), cur["step"], flag_name(cur["flag_id"]),
                          cur["value"], cur["expected"])
    raise CpuBackendTimeout(msg, rank=cur["rank"], program=program, step=cur["step"], chunk=cur["chunk"],
                            flag_id=cur["flag_id"], flag=flag_name(cur["flag_id"]), value=cur["value"],
                            expected=cur["expected"], timeout_s=timeout_s, stuck=lines)


def execute(plan: Plan, layout: Layout, program: str, mem: Memory, *, ranks=None, timeout_s: float = 10.0,
            skip_steps=frozenset(), abort: np.ndarray | None = None) -> None:
    """Run every role of `program` for the executing ranks in `ranks` (None: all) over `mem`.

    The caller zeroes the counters (and combine's partials) before any rank runs; `execute`
    never resets them, since peers in other processes may already be signalling.  Steps in
    `skip_steps` are left to another engine (the RDMA proxy loop, cpu_procs.py), which shares the
    `abort` word (int64 [1]) with the drivers: a timeout on either side stops both."""
    if program not in PROGRAMS:
        raise ValueError(f"program must be one of {PROGRAMS}, not {program!r}")
    timeout_s = timeout_seconds(timeout_s, "execute", allow_zero=True)
    ranks = None if ranks is None else {int(r) for r in ranks}
    jp = compile_plan(plan)
    timeout_ns = int(round(timeout_s * 1e9))
    tables, threads = _threads(jp, plan, layout, program, mem, ranks, timeout_ns, skip_steps, abort)

    def run(t: _Thread) -> None:
        t.status = int(t.fn(t.table.ctypes.data))

    pool = [threading.Thread(target=run, args=(t,), name=f"epcc-{program}-r{t.rank}-{t.step}", daemon=True)
            for t in threads]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    del tables  # the arrays the drivers pointed into may go now
    if any(t.status != codegen.STATUS_OK for t in threads):
        _raise_stuck(layout, program, threads, timeout_ns, timeout_s)


# ---------------------------------------------------------------------------------------------


def run_dispatch(plan: Plan, layout: Layout, x_rows: list[np.ndarray], *, timeout_s: float = 10.0) -> list[np.ndarray]:
    """Dispatch every rank's token rows (`x_rows[r]`: uint8 [T, row_bytes]); returns every rank's
    `output` rows (uint8 [n_d, row_bytes], expert-major in the layout's order)."""
    R = layout.num_ranks
    if len(x_rows) != R:
        raise ValueError(f"run_dispatch: x_rows has {len(x_rows)} ranks, the layout {R}")
    mem = HostMemory(layout, "dispatch")
    for r, x in enumerate(x_rows):
        mem.set_buffer("input", r, np.asarray(x))
    execute(plan, layout, "dispatch", mem, timeout_s=timeout_s)
    return [mem.buffer("dispatch", "output", r) for r in range(R)]


def run_combine(plan: Plan, layout: Layout, y: list[np.ndarray], *, timeout_s: float = 10.0) -> list[np.ndarray]:
    """Combine every rank's expert outputs (`y[r]`: bf16 as uint16 [n_d, hidden], the rows of
    dispatch's `output`); returns every rank's combined tokens (float32 [T, hidden])."""
    R = layout.num_ranks
    if len(y) != R:
        raise ValueError(f"run_combine: y has {len(y)} ranks, the layout {R}")
    mem = HostMemory(layout, "combine")
    for r, yr in enumerate(y):
        mem.set_buffer("output", r, np.asarray(yr))
    execute(plan, layout, "combine", mem, timeout_s=timeout_s)
    return [mem.buffer("combine", "result", r) for r in range(R)]
