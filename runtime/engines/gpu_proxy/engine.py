"""The GPU proxy path (rdma="proxy"): one rank's RDMA engine for one program, on a GPU machine.

The kernels' pack roles push one FIFO entry per chunk, the emitted proxy loop
(backends/rdma/templates/epcc_proxy.c.j2, `epcc_rdma_proxy_gpu`) writes each chunk through a
transport (here `emulated`: the copy engine, paced to the plan's RDMA link) into the receiver's
landing slot and then that slot's signal word, and the receiver's unpack roles apply it (see
backends/cuda/templates/device.cu.j2, "GPU proxy path").  This module allocates everything the
two sides share (FIFOs, send and landing slots, signal, credit and consumed words, the kernels'
RdmaChan descriptors, handed to the launcher with `Context.set_rdma`) and runs the proxy; what
they share is decided from the rank's uploaded tables (channels.py).

Transports: `emulated` (the copy engine, paced to the plan's RDMA links: RDMA-bound schedules on
one host; it maps every rank's landing slots, signal and credit words over CUDA IPC, so every rank
must be in one CUDA IPC domain: the table engine refuses it otherwise, ipc_domain.py) and `nvshmem`
(put with signal over whatever NVSHMEM reaches: NVLink on one host, IBRC/IBGDA on a cluster; no
CUDA IPC of epcc's memory, so its ranks may span domains).  Links: every link class the program's RDMA steps use is one link of the
transport (step_links, in step order), and each channel posts its chunks and credits on its
step's link.  The emulated transport gets one BANDWIDTH,LATENCY per link in its spec
(emulated_spec: "50/25,5/5,DEVICE,signal" for steps over a 50 and a 25 GB/s link) and paces each
on send queues of its own, like the ports of a NIC; a one-link plan gets the spec it always had
("50,5,DEVICE,signal").  NVSHMEM has one link and is not paced: every step posts on it.  For `nvshmem` this module bootstraps NVSHMEM from rank 0's unique id
(all-gathered by the caller's exchange, i.e. torch.distributed) and allocates every region a peer
writes, and the send slots, in the symmetric heap (collective: every rank allocates the largest
size any rank needs, in the same order).

Depth and chunk size are the plan's (chunk-pipeline pass, from the cost model where the file gives
none); plan/rdma.py's `with_overrides` re-chunks the plan before the layout is computed (bench/ep_bench.py
--rdma-chunks, or EPCC_RDMA_CHUNK_TOKENS / EPCC_RDMA_DEPTH), and everything here follows it.  Addresses and keys are exchanged
with the caller's all-gather (torch.distributed's all_gather_object).  The proxy thread spins on a
core for the engine's life (the emulated link is paced by its polling) and is stopped by close().
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from epcc.backends.rdma.abi import ENGINE, RECV_CHAN, SEND_CHAN, SEND_ROLE
from epcc.plan.rdma import rdma_steps

from ..cuda_table.tables import PROGRAMS
from ..lifetime import note
from ..transport import (ERRLEN, STATUS_OK, STATUS_TIMEOUT, TP_LOCAL, TP_REMOTE_WRITE, Transport, TransportError,
                         c_string, load, u64_table)
from .channels import (RETIRED_WORD, TRANSPORTS, RdmaGpuError, Regions, Source, channel_plan, descriptors,
                       emulated_spec, step_links, transport_links, wire_pitch)


def nvshmem_bootstrap(lib, rank: int, nranks: int, device: int, exchange) -> None:
    """Initialise NVSHMEM in this process as PE `rank` of `nranks` on `device`: rank 0 makes the
    unique id, `exchange` (an all-gather, e.g. torch.distributed's all_gather_object) hands it to
    every rank.  Collective; a second call in the same process only checks the ranks."""
    err = ctypes.create_string_buffer(ERRLEN)
    lib.epcc_nvshmem_uid.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_char_p,
                                     ctypes.c_size_t]
    lib.epcc_nvshmem_init.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_char_p, ctypes.c_size_t]
    lib.epcc_nvshmem_malloc.argtypes, lib.epcc_nvshmem_malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    lib.epcc_nvshmem_free.argtypes, lib.epcc_nvshmem_free.restype = [ctypes.c_void_p], None
    uid = b""
    if rank == 0:
        buf, n = ctypes.create_string_buffer(1024), ctypes.c_size_t(1024)
        if lib.epcc_nvshmem_uid(buf, ctypes.byref(n), err, ERRLEN) != 0:
            raise RdmaGpuError(f"rank 0: {err.value.decode(errors='replace')}")
        uid = buf.raw[: n.value]
    uid = exchange(uid)[0]
    if lib.epcc_nvshmem_init(uid, len(uid), rank, nranks, device, err, ERRLEN) != 0:
        raise RdmaGpuError(f"rank {rank}: {err.value.decode(errors='replace')}")


#: How long close() waits for the proxy thread beyond the timeout of its transport calls.
STOP_GRACE_S = 5.0


class GpuRdma:
    """The GPU proxy path of one rank and program: transport, rings, descriptors, proxy thread.
    `source` (channels.py): host-built tables (`from_tables`: this layout's channels, numbered
    here) or the placement of the tables the metadata kernels write (`from_placement`: every
    channel at its bounds, set up once for every routing; the kernels number the items into
    `seq_dev`, uint32 [the blob's items] in device memory)."""

    def __init__(self, *, proxy_lib: str, cuda_lib, ctx, plan, manifest: dict, source: Source | None,
                 program: str, rank: int, device: int, exchange, timeout_s: float = 30.0,
                 transport: str = "emulated", spec: str | None = None, log=None, seq_dev: int = 0):
        if program not in PROGRAMS:
            raise RdmaGpuError(f"program must be one of {PROGRAMS}, not {program!r}")
        self.cuda, self.program, self.rank = cuda_lib, program, rank
        self.keep: list = []
        self.device_ptrs: list[int] = []
        self.sym_ptrs: list[int] = []  # symmetric (NVSHMEM) allocations, freed collectively by close()
        self.thread: threading.Thread | None = None
        self.status: int | None = None
        self.timeout_s = float(timeout_s)
        self.engine: np.ndarray | None = None  # the proxy loop's engine table (epcc_rdma_engine_init)
        self.tp: Transport | None = None
        try:
            self._setup(proxy_lib, ctx, plan, manifest, source, device, exchange, timeout_s, transport, spec, log,
                        seq_dev)
        except BaseException as e:
            try:  # what it acquired before the failure, on this rank alone
                self._release(collective=False)
            except Exception as r:  # noqa: BLE001 - the failure that matters is the first one
                note(e, f"releasing what was acquired before the failure: {r}")
            raise

    def _setup(self, proxy_lib: str, ctx, plan, manifest: dict, source: Source | None, device: int, exchange,
               timeout_s: float, transport: str, spec: str | None, log, seq_dev: int) -> None:
        cuda_lib, program, rank = self.cuda, self.program, self.rank
        steps = {s.step: s for s in rdma_steps(plan) if s.program == program}
        if not steps:
            raise RdmaGpuError(f"{program}: the plan has no RDMA step")
        if transport not in TRANSPORTS:
            raise RdmaGpuError(f"transport '{transport}': the GPU proxy path runs {' or '.join(TRANSPORTS)}")
        links, step_link = step_links(steps.values())
        if transport == "emulated" and spec is None:  # each link paced to its link class in the plan
            spec = emulated_spec(program, links, device)
        elif spec is None:
            spec = "signal"  # write + signal only: no immediates to read
        self.lib = load(proxy_lib)
        if not hasattr(self.lib, "epcc_rdma_proxy_gpu"):
            raise RdmaGpuError(f"{proxy_lib}: no epcc_rdma_proxy_gpu (a proxy library of an older epcc?)")
        self.lib.epcc_rdma_proxy_gpu.argtypes, self.lib.epcc_rdma_proxy_gpu.restype = [ctypes.c_void_p], ctypes.c_int
        if source.seq is None and not seq_dev:
            raise RdmaGpuError(f"{program}: tables the metadata kernels write need their sequence numbers' memory")
        R = plan.num_ranks
        kernel = next(k for k in manifest["kernels"] if k["program"] == program and k["kind"] == "main")
        wire = wire_pitch(manifest, program)
        step_index = {s.step: s.index for s in steps.values()}

        cp = channel_plan(program, kernel, source.pack, source.unpack, steps, wire)
        roles, send, recv = cp.roles, cp.send, cp.recv
        landing_bytes, sig_bytes = cp.landing_bytes, cp.sig_bytes

        # ---- memory: device (cudaMalloc'd, zeroed; peers write the first three) and host-pinned
        def dmalloc(n: int) -> int:
            p = cuda_lib.malloc(device, max(n, 8))
            self.device_ptrs.append(p)
            return p

        import torch  # pinned host memory the kernels and the proxy share: torch is the runtime extra

        def pinned(words: int) -> tuple[np.ndarray, int]:
            t = torch.zeros(max(words, 1), dtype=torch.int64, pin_memory=True)
            self.keep.append(t)
            return t.numpy().view(np.uint64), int(t.data_ptr())

        # what peers write (landing slots, signal words, credit words) and the send slots
        shared = [landing_bytes, sig_bytes, 8 * len(send), *(r.depth * r.slot_bytes for r in roles)]
        if transport == "nvshmem":
            if not hasattr(self.lib, "epcc_nvshmem_init"):
                raise RdmaGpuError(f"{proxy_lib}: built without NVSHMEM (build_gpu(..., 'nvshmem') links it)")
            nvshmem_bootstrap(self.lib, rank, R, device, exchange)
            sizes = exchange(shared)
            if len({len(x) for x in sizes}) != 1:
                raise RdmaGpuError(f"rank {rank}: {program}: ranks allocate {[len(x) for x in sizes]} symmetric "
                                   f"regions (tables of another layout?)")
            shared = [self._symmetric(max(col)) for col in zip(*sizes)]
        else:
            shared = [dmalloc(n) for n in shared]
        landing, signals, credits, *send_bufs = shared
        claims = dmalloc(8 * len(roles))
        fifo_host, fifo_ptr = pinned(cp.fifos.words)
        cp.fifos.fill(fifo_host, fifo_ptr)
        self._fifo_host, self._fifos = fifo_host, cp.fifos
        consumed_host, consumed_ptr = pinned(len(recv))
        self._consumed_host, self._n_recv = consumed_host, len(recv)
        _, credit_src_ptr = pinned(len(recv))

        # ---- transport: open, register, exchange, connect
        try:
            self.tp = Transport(self.lib, transport, spec, rank, R)
        except TransportError as e:
            raise RdmaGpuError(f"rank {rank}: transport '{transport}' ({spec}): {e}") from None
        self.description = self.tp.description
        try:
            step_link = transport_links(program, transport, spec, self.tp.links, links, step_link)
        except RdmaGpuError as e:
            raise RdmaGpuError(f"rank {rank}: {e}") from None

        def reg(ptr: int, n: int, access: int) -> tuple[int, int, int]:
            try:
                return self.tp.reg_ptr(ptr, max(n, 8), access)
            except TransportError as e:
                raise RdmaGpuError(f"rank {rank}: registering memory: {e}") from None

        _, land_addr, land_key = reg(landing, landing_bytes, TP_REMOTE_WRITE)
        _, sig_addr, sig_key = reg(signals, sig_bytes, TP_REMOTE_WRITE)
        _, cred_addr, cred_key = reg(credits, 8 * len(send), TP_REMOTE_WRITE)
        send_mrs = [reg(p, r.depth * r.slot_bytes, TP_LOCAL)[0] for p, r in zip(send_bufs, roles)]
        mine = {"addr": self.tp.address(),
                "recv": {k: (land_addr + ch.offset, land_key, ch.slot_bytes, ch.depth, sig_addr + ch.sig_offset,
                             sig_key, ch.index) for k, ch in recv.items()},
                "send": {k: (cred_addr + 8 * ch.index, cred_key) for k, ch in send.items()}}
        everyone = exchange(mine)
        for k, ch in send.items():
            if k not in everyone[ch.dst]["recv"]:
                raise RdmaGpuError(f"rank {rank}: {program} step '{ch.step}': rank {ch.dst} has no landing ring for "
                                   f"channel {ch.src}->{ch.dst} (tables of another layout?)")
            got = everyone[ch.dst]["recv"][k]
            if got[2] < ch.slot_bytes:
                raise RdmaGpuError(f"rank {rank}: {program} step '{ch.step}': a chunk of {ch.slot_bytes} B does not fit "
                                   f"rank {ch.dst}'s landing slots of {got[2]} B")
        self.tp.connect([e["addr"] for e in everyone])

        # ---- the proxy loop's tables
        def cstr(text: str) -> int:
            return c_string(self.keep, text)

        def table(t, rows: list[dict]) -> np.ndarray:
            return u64_table(self.keep, t, rows)

        name = {k: f"{program}.{k[0]}[{k[1]}->{k[2]}]" for k in (*send, *recv)}
        send_rows = []
        for k, ch in send.items():
            raddr, rkey, slot, depth, saddr, skey, imm_chan = everyone[ch.dst]["recv"][k]
            send_rows.append(dict(peer=ch.dst, remote_addr=raddr, remote_key=rkey, slot_bytes=slot, depth=depth,
                                  n_chunks=ch.n_chunks, imm_chan=imm_chan, credit=0,
                                  credit_name=cstr(name[k] + ".credit"), signal_addr=saddr, signal_key=skey,
                                  link=step_link[ch.step]))
        recv_rows = []
        for k, ch in recv.items():
            craddr, crkey = everyone[ch.src]["send"][k]
            recv_rows.append(dict(peer=ch.src, step=step_index[ch.step], n_chunks=ch.n_chunks,
                                  landing=landing + ch.offset, slot_bytes=ch.slot_bytes, depth=ch.depth,
                                  row_len=wire, src_row_bytes=wire, credit_raddr=craddr, credit_rkey=crkey,
                                  credit_src=credit_src_ptr + 8 * ch.index, credit_mr=0,
                                  name=cstr(name[k] + ".landed"), consumed=consumed_ptr + 8 * ch.index,
                                  link=step_link[ch.step]))
        role_rows = [dict(step=step_index[r.step], depth=r.depth, slot_bytes=r.slot_bytes, src_row_bytes=r.wire,
                          send_buf=p, mr=mr) for r, p, mr in zip(roles, send_bufs, send_mrs)]
        self.err = ctypes.create_string_buffer(ERRLEN)
        self.stop = np.zeros(1, dtype=np.uint64)
        self.abort = np.zeros(1, dtype=np.uint64)
        rank_desc = f"rank {rank} ({program}, GPU proxy over {self.description})"
        self.engine = table(ENGINE, [dict(
            tp=self.tp.ptr.value, rank_desc=cstr(rank_desc), timeout_ns=int(timeout_s * 1e9),
            abort=self.abort.ctypes.data, stop=self.stop.ctypes.data, n_roles=len(role_rows),
            roles=table(SEND_ROLE, role_rows).ctypes.data, n_send_chans=len(send_rows),
            send_chans=table(SEND_CHAN, send_rows).ctypes.data, n_recv_chans=len(recv_rows),
            recv_chans=table(RECV_CHAN, recv_rows).ctypes.data, err=ctypes.addressof(self.err), errlen=ERRLEN,
            gpu_fifos=fifo_ptr if roles else 0)])
        if self.lib.epcc_rdma_engine_init(self.engine.ctypes.data) != 0:
            raise RdmaGpuError(f"rank {rank}: the proxy engine could not be set up (FIFO depth or memory)")

        # ---- the kernels' descriptors: one RdmaChan per CopyDesc, the items' sequence numbers
        regions = Regions(send_bufs=tuple(send_bufs), claims=claims, credits=credits, fifos=fifo_ptr, landing=landing,
                          signals=signals, consumed=consumed_ptr)
        peer_depth = {k: everyone[ch.dst]["recv"][k][3] for k, ch in send.items()}
        desc = descriptors(source.copies, source.num_copies, cp, regions, peer_depth)
        self.desc_dev = dmalloc(desc.nbytes)
        cuda_lib.copy_to_device(self.desc_dev, desc.view(np.uint8))
        if source.seq is not None:
            self.seq_dev = dmalloc(source.seq.nbytes)
            cuda_lib.copy_to_device(self.seq_dev, source.seq)
        else:  # written by the metadata kernels before every dispatch
            self.seq_dev = seq_dev
        ctx.set_rdma(program, self.desc_dev, self.seq_dev)
        self.summary = (f"{program}: {len(send)} send / {len(recv)} receive channels, depth "
                        f"{', '.join(str(r.depth) for r in roles) or '-'}, send slots of "
                        f"{', '.join(str(r.slot_bytes) for r in roles) or '-'} B over {self.description}")
        if len(set(step_link.values())) > 1:  # which step went out on which link
            self.summary += "; links: " + ", ".join(f"{step} {i}" for step, i in step_link.items())
        if log:
            log(self.summary)

    def _symmetric(self, n: int) -> int:
        p = self.lib.epcc_nvshmem_malloc(max(n, 8))  # collective, zeroed
        if not p:
            raise RdmaGpuError(f"rank {self.rank}: {self.program}: NVSHMEM's symmetric heap has no {n} B left "
                               f"(raise NVSHMEM_SYMMETRIC_SIZE)")
        self.sym_ptrs.append(p)
        return p

    # -- the proxy thread -------------------------------------------------------------------
    def start(self) -> None:
        def run():
            # the transport's CUDA calls must not fail while the caller captures a CUDA graph
            if hasattr(self.lib, "epcc_tp_proxy_thread") and self.lib.epcc_tp_proxy_thread() != 0:
                self.err.value = b"epcc rdma: the GPU proxy thread could not leave CUDA graph capture checks"
                self.status = -1
                return
            self.status = int(self.lib.epcc_rdma_proxy_gpu(self.engine.ctypes.data))

        self.thread = threading.Thread(target=run, name=f"epcc-rdma-gpu-{self.program}", daemon=True)
        self.thread.start()

    def failure(self) -> str | None:
        """The proxy's message once it stopped on a failure (None while it runs or after a clean stop)."""
        if self.status in (None, STATUS_OK):
            return None
        return self.err.value.decode(errors="replace") or f"epcc rdma: the GPU proxy failed (status {self.status})"

    def timed_out(self) -> bool:
        return self.status == STATUS_TIMEOUT

    def stopped(self) -> str | None:
        """Why the started proxy no longer serves its FIFOs (its failure, or a thread that ended),
        or None while it runs (watch.py)."""
        why = self.failure()
        if why:
            return why
        if self.thread is not None and not self.thread.is_alive():
            return f"its thread ended (status {self.status})"
        return None

    def waiting(self) -> list[tuple[int, int]]:
        """(FIFO, entry) of each FIFO whose next entry the kernels published and the proxy has not
        taken (watch.py: one that stays so is a stalled proxy)."""
        return self._fifos.waiting(self._fifo_host)

    def abort_proxy(self) -> None:
        """Ask the proxy thread to stop at its next idle pass (the Buffer failed: nobody will wait
        for what it would post)."""
        self.abort[0] = 1

    def stats(self) -> dict:
        """The transport's counters (writes, bytes, completions, post_ns: host time in post calls)
        and the proxy's backlog (drained chunk entries over the FIFO passes that found any)."""
        out = self.tp.stats()
        if self.engine is not None and hasattr(self.lib, "epcc_rdma_engine_drained"):
            p = self.engine.ctypes.data
            out["drained"] = int(self.lib.epcc_rdma_engine_drained(p))
            out["passes"] = int(self.lib.epcc_rdma_engine_passes(p))
        return out

    def state(self) -> str:
        """One line for a failure report: what the proxy saw and did (FIFO counters, consumed words)."""
        f, lay = self._fifo_host, self._fifos
        posted = int(self.lib.epcc_rdma_engine_posted(self.engine.ctypes.data)) if self.engine is not None else -1
        words = ", ".join(f"0x{int(v):x}" for v in self._consumed_host[: self._n_recv])
        fifos = ", ".join(f"head {int(f[lay.struct_word(i) + 1])} retired {int(f[lay.struct_word(i) + RETIRED_WORD])}"
                          for i in range(lay.n))
        return (f"{self.program} proxy: status {self.status}, posted {posted}, FIFOs [{fifos}], consumed [{words}], "
                f"transport {self.tp.stats() if self.tp else '-'}")

    def close(self, collective: bool = True) -> None:
        """Stop the proxy (every launch using it must have completed), release everything.  The
        proxy loop polls its stop word between transport calls, each bounded by the timeout; a
        thread still running after that bound and STOP_GRACE_S is reported (RdmaGpuError with the
        proxy's state) instead of waited for without end, and what it may still touch (engine,
        transport, rings) is left allocated: a leak, not a crash.  `collective` False: this rank
        alone (a failed Buffer, a construction that failed): the proxy is also aborted (nobody waits
        for what it would post), and NVSHMEM's symmetric memory, which every rank frees together,
        stays."""
        self.stop_thread(abort=not collective)
        self._release(collective)

    def stop_thread(self, abort: bool = False) -> None:
        """Stop the proxy thread (`abort`: at its next idle pass, without finishing what it was
        given) and wait for it, bounded as close() says; everything stays allocated."""
        if self.thread is not None:
            self.stop[0] = 1
            if abort:
                self.abort[0] = 1
            self.thread.join(self.timeout_s + STOP_GRACE_S)
            if self.thread.is_alive():
                raise RdmaGpuError(f"rank {self.rank}: {self.program}: the GPU proxy thread did not stop within "
                                   f"{self.timeout_s + STOP_GRACE_S:g} s of its stop word ({self.state()}); its "
                                   f"memory stays allocated")
            self.thread = None

    def _release(self, collective: bool) -> None:
        """What this engine acquired, last first (no proxy thread runs): the proxy loop's state, the
        transport (its registrations first), device memory, and with `collective` the symmetric
        memory.  Every step runs even after one that fails; the first failure is raised after."""
        failures: list[Exception] = []

        def step(release, *args) -> None:
            try:
                release(*args)
            except Exception as e:  # noqa: BLE001 - the rest must still be released
                failures.append(e)

        if getattr(self, "engine", None) is not None:  # fini frees what a failed init left too
            step(self.lib.epcc_rdma_engine_fini, self.engine.ctypes.data)
            self.engine = None
        if getattr(self, "tp", None) is not None:
            step(self.tp.close)
            self.tp = None
        for p in reversed(self.device_ptrs):
            step(self.cuda.free, p)
        self.device_ptrs.clear()
        if collective:
            for p in reversed(self.sym_ptrs):  # every rank closes its engines in the same order
                step(self.lib.epcc_nvshmem_free, p)
            self.sym_ptrs.clear()
        self.keep = []  # the pinned rings and the loop's tables
        if failures:
            raise failures[0]
