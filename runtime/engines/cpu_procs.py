"""The cpu engine as separate processes, one per rank, with RDMA steps over a real transport.

    from epcc.runtime.engines import cpu_procs
    be = cpu_procs.ProcessBackend("libfabric-tcp")
    out = be.run_dispatch(plan, layout, x_rows)      # as cpu/threads.py's, one process per rank
    res = be.run_combine(plan, layout, y)

Per program: every rank's buffers and counters are allocated in shared memory (anonymous
MAP_SHARED mappings made before the ranks start: the peer memory of runtime/shm.py, inherited
instead of mapped by name), the plan is JIT-compiled and its proxy loop compiled
(rdma_host.py) once, then one process per rank is forked.  The ranks meet in the bounded rounds
of an agreement (agree.py) over a FileStore of their own (file rendezvous): each opens the
transport (libfabric, provider tcp), exchanges addresses and keys, and runs its roles: the
kernels' roles as JIT drivers over peer memory (NVLink-class copies write straight into peers'
buffers), the RDMA steps through the proxy loop (rdma_host.py: pack, write-with-immediate,
in-order apply, credits).  The parent reads the results from shared memory.  A failure in any
rank (an error, a bounded wait, the transport, a rank that stalls or dies) reaches every rank
within the timeout and a few seconds, each reporting the same message naming that rank
(`RankFailed`, with every rank's report in `per_rank`).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import multiprocessing as mp
import os
import tempfile
import time
import traceback

import numpy as np

from epcc.limits import timeout_seconds
from epcc.plan import Plan
from epcc.plan.rdma import bf16_partials, rdma_steps

from ..bf16 import BF16_ROUNDOFF
from ..layout import Layout
from .agree import Agreement, GaveUp
from .base import GroupError, KernelTimeout
from .cpu.jit import compile_plan
from .cpu.threads import CpuBackendTimeout, execute, rank_desc
from .rdma_host import RdmaEngine, build_proxy, build_transport
from .transport import Transport, cost_phrase, load

#: `epcc run --transport` values: name -> (transport, provider spec) or None (threads, no transport).
TRANSPORTS = {"inproc": None, "libfabric-tcp": ("libfabric", "tcp")}


class TransportUnavailable(RuntimeError):
    """The transport cannot run here (one line, naming it and why)."""


class RankFailed(RuntimeError):
    """A rank's process failed: the message every rank reported (which rank, and why: a bounded
    wait's report, a transport error, an exception, no answer); `per_rank`: {rank: its report}."""

    def __init__(self, message: str, per_rank: dict[int, str] | None = None):
        super().__init__(message)
        self.per_rank = dict(per_rank or {})


class SharedMemory:
    """Every rank's buffers and counters of one program in anonymous shared mappings (the Memory
    protocol of cpu/threads.py), created before the rank processes fork, zeroed."""

    def __init__(self, layout: Layout, program: str):
        self.layout, self.program = layout, program
        names = {layout.canonical(program, b) for c in layout.program_copies(program)
                 for b in (*c.src_buffers, c.dst_buffer)}
        names |= {"input", "output"} if program == "dispatch" else {"output", "result"}
        self._maps: list[mmap.mmap] = []
        self._bufs = {}
        for name in sorted(names):
            for r in range(layout.num_ranks):
                dt, shape = layout.spec(program, name, r)
                self._bufs[(name, r)] = self._alloc(dt, shape)
        n = max(len(layout.flags), 1)
        self._flags = [self._alloc(np.dtype(np.int64), (n,)) for _ in range(layout.num_ranks)]

    def _alloc(self, dt, shape) -> np.ndarray:
        nbytes = int(np.prod(shape)) * dt.itemsize
        m = mmap.mmap(-1, max(nbytes, 8), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._maps.append(m)
        return np.ndarray(shape, dtype=dt, buffer=m, offset=0)

    def buffer(self, program: str, name: str, rank: int) -> np.ndarray:
        if program != self.program:
            raise ValueError(f"this memory holds {self.program} buffers, not {program}")
        return self._bufs[(self.layout.canonical(program, name), rank)]

    def flags(self, rank: int) -> np.ndarray:
        return self._flags[rank]


def _worker(rank: int, nranks: int, init_file: str, plan: Plan, layout: Layout, program: str, mem: SharedMemory,
            lib_path, transport: tuple[str, str], timeout_s: float, conn) -> None:
    """One rank: the transport, the JIT roles and the proxy loop, meeting its peers in the rounds
    of an agreement over a FileStore at `init_file`.  Sends one message to the parent:
    ("ok", stats) or ("error", kind, message); every rank's message of a failed run is the same
    (GroupError's), unless the rank failed before it could tell the others."""
    msg = ("error", "crash", f"rank {rank}: exited without a report")
    eng = tp = None
    try:
        import torch.distributed as dist  # torch is the runtime extra: only the ranks' store needs it

        agree = Agreement(dist.FileStore(init_file, nranks), rank, nranks, timeout_s)
        with agree.call(program):
            abort = np.zeros(1, dtype=np.int64)
            skip = frozenset()
            stats = {"transport": None, "posted": 0, "applied": 0}
            if lib_path is not None:
                lib = load(lib_path)
                tp = Transport(lib, transport[0], transport[1], rank, nranks)
                flag_rank = {f.flag_id: f.rank for f in layout.flags}
                scratch = np.zeros(1, dtype=np.int64)

                def flag_address(fid: int, what: str) -> int:
                    if fid == -1:
                        return scratch.ctypes.data
                    return mem.flags(flag_rank[fid]).ctypes.data + 8 * fid

                eng = RdmaEngine(lib, tp, plan, layout, program, mem, rank,
                                 lambda obj: agree.gather("the transport addresses' exchange", obj),
                                 timeout_s=timeout_s, abort=abort, flag_address=flag_address,
                                 rank_desc=rank_desc(layout, rank))
                skip = frozenset(eng.step_names)
                agree.barrier("the transport's connection")  # every rank registered and connected before anyone writes
                eng.start()
            jit_error, alarmed = None, []
            # a peer's failure (its alarm) makes this rank's waits, the drivers' and the proxy's, give up
            with agree.watch(lambda: (alarmed.append(True), abort.__setitem__(0, 1))):
                try:
                    execute(plan, layout, program, mem, ranks=[rank], timeout_s=timeout_s, skip_steps=skip,
                            abort=abort)
                except Exception as e:  # noqa: BLE001 - reported below, after the proxy loop is down
                    jit_error = e
                if eng is not None:
                    eng.join_local()
            if eng is not None:
                failure = eng.failure()
                if failure is None and jit_error is None:
                    tp.flush(timeout_s)
                stats.update(transport=tp.description, **tp.stats())
                stats["posted"], stats["applied"] = eng.counts()
                stats["drained"], stats["passes"] = eng.backlog()
                if failure is not None and (eng.timed_out() or jit_error is None or
                                            not isinstance(jit_error, CpuBackendTimeout)):
                    if eng.timed_out():
                        raise KernelTimeout(failure)
                    raise GaveUp(failure) if alarmed else RankFailed(failure)
            if jit_error is not None:
                raise jit_error
            agree.barrier("the end of the run")  # every rank done: no more writes into anyone's memory
        msg = ("ok", stats)
    except GroupError as e:
        msg = ("error", "group", str(e))
    except BaseException as e:  # noqa: BLE001
        if os.environ.get("EPCC_DEBUG"):
            traceback.print_exc()
        msg = ("error", "crash", f"{type(e).__name__}: {e}")
    finally:
        try:
            conn.send(msg)
        except OSError:
            pass
        if eng is not None:
            eng.stop_proxy()
            eng.close()
        if tp is not None:
            tp.close()
        os._exit(0)  # no atexit handlers of the parent's libraries in a forked child


def _probe(transport, conn) -> None:
    try:
        lib = load(build_transport(transport[0]))
        tp = Transport(lib, transport[0], transport[1], 0, 1)
        desc = tp.description
        tp.close()
        conn.send(("ok", desc))
    except BaseException as e:  # noqa: BLE001
        conn.send(("error", str(e)))
    finally:
        os._exit(0)


def check_transport(name: str) -> str:
    """Raise TransportUnavailable (one line) unless transport `name` works here; returns what
    it opened (e.g. "libfabric tcp;ofi_rxm (FI_EP_RDM, ...)"), '' for inproc."""
    if name not in TRANSPORTS:
        raise TransportUnavailable(f"--transport {name}: unknown transport (choose from {', '.join(TRANSPORTS)})")
    t = TRANSPORTS[name]
    if t is None:
        return ""
    ctx = mp.get_context("fork")  # probe in a child: the provider's state never enters the parent
    a, b = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_probe, args=(t, b), daemon=True)
    p.start()
    b.close()
    ok = a.poll(120)
    res = a.recv() if ok else ("error", "the probe did not answer in 120 s")
    p.join(5)
    if res[0] != "ok":
        raise TransportUnavailable(f"--transport {name}: not available here: {res[1]}".replace("\n", " "))
    return res[1]


@functools.cache
def _libfabric_ready(lib_path) -> None:
    """Initialise libfabric's providers once, here, before the ranks are forked: each rank then
    finds them ready instead of loading and probing every provider itself (libfabric 1.20 reads
    /proc/kallsyms twice while it does), work that grows with the rank count and, 32 ranks on two
    cores, was most of the kernel time of a run.  fi_getinfo without hints does it and opens
    nothing (no fabric, no thread); its answer is freed at once.  Once per process: a run's two
    programs and later runs find the providers ready."""
    lib = ctypes.CDLL(str(lib_path))  # the proxy library: libfabric is among its dependencies
    info = ctypes.c_void_p()
    lib.fi_getinfo.argtypes = [ctypes.c_uint32, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint64,
                               ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    if lib.fi_getinfo((1 << 16) | 9, None, None, 0, None, ctypes.byref(info)) == 0 and info.value:
        lib.fi_freeinfo.argtypes = [ctypes.c_void_p]
        lib.fi_freeinfo(info)
    # a failure here is the ranks' to report (their own fi_getinfo names the provider and the cause)


class ProcessBackend:
    """run_dispatch / run_combine (the `epcc run` backend protocol) as one process per rank."""

    def __init__(self, transport: str = "libfabric-tcp", *, timeout_s: float = 30.0):
        if transport not in TRANSPORTS or TRANSPORTS[transport] is None:
            raise ValueError(f"ProcessBackend: transport must be one of "
                             f"{', '.join(k for k, v in TRANSPORTS.items() if v)}, not {transport!r}")
        self.transport_name = transport
        self.transport = TRANSPORTS[transport]
        self.timeout_s = timeout_seconds(timeout_s, "ProcessBackend")
        self.last_stats: dict[str, list[dict]] = {}

    def partial_rounding(self, plan: Plan) -> float:
        """What the combine check must admit: combine partials that cross an RDMA step travel as
        bf16 (plan/rdma.py), rounded once to its unit roundoff; 0 without such a step."""
        return BF16_ROUNDOFF if bf16_partials(plan) else 0.0

    def _run(self, plan: Plan, layout: Layout, program: str, mem: SharedMemory) -> None:
        import torch.distributed  # noqa: F401 - torch is the runtime extra; imported once here, inherited by every rank

        compile_plan(plan)  # JIT once, inherited by the forked ranks
        has_rdma = any(s.program == program for s in rdma_steps(plan))
        lib_path = build_proxy(plan, self.transport[0]) if has_rdma else None
        R = layout.num_ranks
        if lib_path is not None and self.transport[0] == "libfabric":
            _libfabric_ready(lib_path)
        ctx = mp.get_context("fork")
        with tempfile.TemporaryDirectory(prefix="epcc-rdv-") as d:
            init_file = os.path.join(d, "rendezvous")
            pipes, procs = [], []
            for r in range(R):
                a, b = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker, args=(r, R, init_file, plan, layout, program, mem, lib_path,
                                                      self.transport, self.timeout_s, b), daemon=True,
                                name=f"epcc-rank{r}")
                p.start()
                b.close()
                pipes.append(a)
                procs.append(p)
            results: dict[int, tuple] = {}
            deadline = time.monotonic() + 3 * self.timeout_s + 120
            first_error_at = None
            while len(results) < R:
                now = time.monotonic()
                if now > deadline or (first_error_at is not None and now > first_error_at + 5):
                    break
                for r, a in enumerate(pipes):
                    if r in results:
                        continue
                    if a.poll(0.01):
                        try:
                            results[r] = a.recv()
                        except EOFError:
                            procs[r].join(1)
                            results[r] = ("error", "crash", f"rank {r}: the process died (exit code "
                                                            f"{procs[r].exitcode})")
                        if results[r][0] != "ok" and first_error_at is None:
                            first_error_at = time.monotonic()
                    elif not procs[r].is_alive() and not a.poll(0):
                        procs[r].join(1)
                        results[r] = ("error", "crash", f"rank {r}: the process died (exit code {procs[r].exitcode})")
                        if first_error_at is None:
                            first_error_at = time.monotonic()
            for p in procs:  # every rank has reported (or the run gave up): none has more to do
                if p.is_alive():
                    p.terminate()
            stop_by = time.monotonic() + 5
            for p in procs:
                p.join(max(0.0, stop_by - time.monotonic()))
                if p.is_alive():
                    p.kill()
        errors = {r: v for r, v in sorted(results.items()) if v[0] != "ok"}
        if errors:
            # The ranks that met their peers agree on one message (agree.py: the root cause); a
            # rank's own crash report is the word only where none got that far.
            agreed = [v[2] for v in errors.values() if v[1] == "group"]
            raise RankFailed(agreed[0] if agreed else next(iter(errors.values()))[2],
                             {r: v[2] for r, v in errors.items()})
        if len(results) < R:
            missing = [r for r in range(R) if r not in results]
            raise RankFailed(f"ranks {missing} did not finish within {3 * self.timeout_s + 120:.0f} s")
        self.last_stats[program] = [results[r][1] for r in range(R)]

    def run_dispatch(self, plan: Plan, layout: Layout, x_rows: list[np.ndarray]) -> list[np.ndarray]:
        R = layout.num_ranks
        if len(x_rows) != R:
            raise ValueError(f"run_dispatch: x_rows has {len(x_rows)} ranks, the layout {R}")
        mem = SharedMemory(layout, "dispatch")
        for r, x in enumerate(x_rows):
            mem.buffer("dispatch", "input", r)[...] = np.asarray(x)
        self._run(plan, layout, "dispatch", mem)
        return [mem.buffer("dispatch", "output", r).copy() for r in range(R)]

    def run_combine(self, plan: Plan, layout: Layout, y: list[np.ndarray]) -> list[np.ndarray]:
        R = layout.num_ranks
        if len(y) != R:
            raise ValueError(f"run_combine: y has {len(y)} ranks, the layout {R}")
        mem = SharedMemory(layout, "combine")
        for r, yr in enumerate(y):
            mem.buffer("combine", "output", r)[...] = np.asarray(yr)
        self._run(plan, layout, "combine", mem)
        return [mem.buffer("combine", "result", r).copy() for r in range(R)]

    def summary(self) -> str:
        """What went over the transport in the last runs, one phrase."""
        parts = []
        for program, stats in self.last_stats.items():
            total = {k: sum(s.get(k, 0) or 0 for s in stats)
                     for k in ("writes_posted", "posted", "bytes_posted", "post_ns", "drained", "passes")}
            cost = cost_phrase(total)
            parts.append(f"{program} {total['posted']} chunks / {total['writes_posted']} writes / "
                         f"{total['bytes_posted'] / 1e6:.2f} MB" + (f" ({cost})" if cost else ""))
        desc = next((s["transport"] for st in self.last_stats.values() for s in st if s.get("transport")), None)
        return f"{desc or 'no RDMA step'}: " + ", ".join(parts) if parts else ""
