"""The GPU proxy path (rdma="proxy"): one rank's RDMA engine for one program, on a GPU machine.

The kernels' pack roles push one FIFO entry per chunk, the emitted proxy loop
(backends/rdma/templates/epcc_proxy.c.j2, `epcc_rdma_proxy_gpu`) writes each chunk through a
transport (here `emulated`: the copy engine, paced to the plan's RDMA link) into the receiver's
landing slot and then that slot's signal word, and the receiver's unpack roles apply it (see
templates/device.cu.j2, "GPU proxy path").  This module decides and allocates everything the
two sides share, from the rank's uploaded tables:

* channels: one per (step, sender, receiver); a chunk's sequence number on its channel is its
  position among the channel's items in the role's item order, which both sides' tables list in
  the same relative order (tables.item_order over copies sorted by flow), so no table carries it;
* per pack role (one per RDMA step): a FIFO of `depth` entries (host-pinned: the kernel writes, the
  proxy reads; the structs of all roles first, as the array the engine reads, then the entries) and
  `depth` send slots (device memory, the copy engine's source), a claim counter (device);
* per receive channel: `depth` landing slots and `depth` signal words (device memory, targets of
  the peer's writes), a consumed word (host-pinned: the unpack role writes it, the proxy returns
  it as credit) and the credit source word; per send channel: the credit word (device memory,
  written by the receiver's proxy, read by the pack role);
* the RdmaChan descriptors (one per CopyDesc) and the items' sequence numbers, in device memory,
  handed to the launcher with `Context.set_rdma`.

Transports: `emulated` (the copy engine, paced to the plan's RDMA links: RDMA-bound schedules on
one host) and `nvshmem` (put with signal over whatever NVSHMEM reaches: NVLink on one host,
IBRC/IBGDA on a cluster).  Links: every link class the program's RDMA steps use is one link of the
transport (step_links, in step order), and each channel posts its chunks and credits on its
step's link.  The emulated transport gets one BANDWIDTH,LATENCY per link in its spec
(emulated_spec: "50/25,5/5,DEVICE,signal" for steps over a 50 and a 25 GB/s link) and paces each
on send queues of its own, like the ports of a NIC; a one-link plan gets the spec it always had
("50,5,DEVICE,signal").  NVSHMEM has one link and is not paced: every step posts on it.  For `nvshmem` this module bootstraps NVSHMEM from rank 0's unique id
(all-gathered by the caller's exchange, i.e. torch.distributed) and allocates every region a peer
writes, and the send slots, in the symmetric heap (collective: every rank allocates the largest
size any rank needs, in the same order).

Depth and chunk size are the plan's (chunk-pipeline pass, from the cost model where the file gives
none); `rdma.with_overrides` re-chunks the plan before the layout is computed (bench/ep_bench.py
--rdma-chunks, or EPCC_RDMA_CHUNK_TOKENS / EPCC_RDMA_DEPTH), and everything here follows it.  Addresses and keys are exchanged
with the caller's all-gather (torch.distributed's all_gather_object).  The proxy thread spins on a
core for the engine's life (the emulated link is paced by its polling) and is stopped by close().
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field

import numpy as np

from epcc.backends.rdma.engine import (ENGINE, ERRLEN, RECV_CHAN, SEND_CHAN, SEND_ROLE, STATUS_OK, STATUS_TIMEOUT,
                                       TP_LOCAL, TP_REMOTE_WRITE, Transport, TransportError, c_string, load, u64_table)
from epcc.plan.rdma import rdma_steps

from .tables import PROGRAMS, parse_tables

ALIGN = 256
FIFO_WORDS = 8  # epcc_rdma_fifo: tail, head, retired, flushed, depth, entries, done, external
ENTRY_WORDS = 6  # epcc_rdma_entry: word, kind, chan, chan_seq, bytes, value
RETIRED_WORD, DEPTH_WORD, ENTRIES_WORD = 2, 4, 5  # epcc_rdma_fifo's words the host fills or the kernels read
RDMA_CHAN = np.dtype([("ring", "<u8"), ("signals", "<u8"), ("counter", "<u8"), ("credit", "<u8"),
                      ("entries", "<u8"), ("retired", "<u8"), ("depth", "<u4"), ("slot_bytes", "<u4"),
                      ("chan", "<u4"), ("chan_depth", "<u4")])  # epcc::RdmaChan (device.cu.j2)
assert RDMA_CHAN.itemsize == 64


TRANSPORTS = ("emulated", "nvshmem")
PACED = ("emulated",)  # transports that pace each link at its plan's speed: one transport link per link class


@dataclass(frozen=True)
class Link:
    """One link class a program's RDMA steps run over: one link (send queues) of the transport."""

    name: str
    bandwidth: float  # bytes/s (0: unknown)
    latency_s: float

    @property
    def text(self) -> str:
        return f"'{self.name}' {self.bandwidth / 1e9:g} GB/s {self.latency_s * 1e6:g} us"


def step_links(steps) -> tuple[list[Link], dict[str, int]]:
    """(the links, one per link class in the order the RDMA steps `steps` first use them; each
    step's link index).  Steps over one class share its link; a class's bandwidth and latency are
    the largest its steps give (the plan gives every step of a class the same)."""
    order: dict[str, list] = {}
    index: dict[str, int] = {}
    for s in sorted(steps, key=lambda s: s.index):
        got = order.setdefault(s.link, [len(order), 0.0, 0.0])
        got[1], got[2] = max(got[1], s.bandwidth), max(got[2], s.latency_s)
        index[s.step] = got[0]
    return [Link(name, bw, lat) for name, (_, bw, lat) in order.items()], index


def emulated_spec(program: str, links: list[Link], device: int) -> str:
    """The emulated transport's spec for `links` (transport_emulated.cu): '/'-separated bandwidths
    (GB/s) and latencies (us), one per link, then the device, write + signal only."""
    for link in links:
        if not link.bandwidth:
            raise RdmaGpuError(f"{program}: the RDMA link '{link.name}' has no bandwidth in the plan; give the "
                               f"transport spec")
    bw = "/".join(f"{link.bandwidth / 1e9:g}" for link in links)
    lat = "/".join(f"{link.latency_s * 1e6:g}" for link in links)
    return f"{bw},{lat},{device},signal"


def transport_links(program: str, transport: str, spec: str, have: int, links: list[Link],
                    step_link: dict[str, int]) -> dict[str, int]:
    """Each step's link on a transport of `have` links: its link class's (step_links) on a paced
    transport, which must have a link per class; link 0 on one that is not paced (nvshmem)."""
    if transport not in PACED:
        return {step: 0 for step in step_link}
    if have < len(links):
        raise RdmaGpuError(f"{program}: transport '{transport}' ({spec}) has {have} link{'s' if have != 1 else ''}, "
                           f"but the RDMA steps run over {len(links)} link classes "
                           f"({', '.join(link.text for link in links)}): give one BANDWIDTH_GBPS,LATENCY_US per "
                           f"link, '/'-separated (e.g. '50/25,5/5')")
    return dict(step_link)


class RdmaGpuError(RuntimeError):
    """The GPU proxy path cannot run (a bad transport spec, tables without its roles, a failure)."""


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


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class _Chan:
    key: tuple[str, int, int]  # (step, sender, receiver)
    step: str
    src: int
    dst: int
    depth: int
    slot_bytes: int = 0
    n_chunks: int = 0
    offset: int = 0  # receive channel: bytes into the landing region
    sig_offset: int = 0  # receive channel: bytes into the signal region
    index: int = 0


@dataclass
class _Role:
    index: int  # the kernel role
    step: str
    depth: int
    wire: int
    slot_bytes: int = 0
    chans: list = field(default_factory=list)


@dataclass(frozen=True)
class FifoLayout:
    """Where the FIFOs of a rank's pack roles lie in their one host-pinned region, in u64 words:
    the engine reads `epcc_rdma_fifo [n_roles]` as one array (epcc_proxy.c.j2, epcc_rdma_engine_init:
    `s->fifos = gpu_fifos`, role i's FIFO is `fifos[i]`), so the structs come first, contiguous,
    in role order, and each FIFO's `entries` word points at its own area of `depth` entries behind
    them (`done` is the proxy's, allocated by epcc_rdma_fifo_attach)."""

    depths: tuple[int, ...]

    @property
    def n(self) -> int:
        return len(self.depths)

    def struct_word(self, i: int) -> int:
        """Word offset of role i's epcc_rdma_fifo."""
        return FIFO_WORDS * i

    def entries_word(self, i: int) -> int:
        """Word offset of role i's first epcc_rdma_entry."""
        return FIFO_WORDS * self.n + ENTRY_WORDS * sum(self.depths[:i])

    @property
    def words(self) -> int:
        return FIFO_WORDS * self.n + ENTRY_WORDS * sum(self.depths)

    def fill(self, host: np.ndarray, base: int) -> None:
        """Write each FIFO's depth and entries pointer into the zeroed region `host` (u64 words)
        whose address is `base`; the counters start at 0."""
        if len(host) < self.words:
            raise RdmaGpuError(f"the FIFO region holds {len(host)} words, the layout needs {self.words}")
        for i, depth in enumerate(self.depths):
            host[self.struct_word(i) + DEPTH_WORD] = depth
            host[self.struct_word(i) + ENTRIES_WORD] = base + 8 * self.entries_word(i)

    def entries_ptr(self, base: int, i: int) -> int:
        return base + 8 * self.entries_word(i)

    def retired_ptr(self, base: int, i: int) -> int:
        return base + 8 * (self.struct_word(i) + RETIRED_WORD)


def fifo_layout(depths) -> FifoLayout:
    """The layout of the FIFOs of pack roles of these depths (in role order)."""
    depths = tuple(int(d) for d in depths)
    if any(d <= 0 for d in depths):
        raise RdmaGpuError(f"FIFO depths {list(depths)}: every pack role needs a depth of at least 1")
    return FifoLayout(depths)


def wire_pitch(manifest: dict, program: str) -> int:
    """Bytes of one row on the RDMA link: the dispatch wire row; combine rows travel as bf16."""
    wl = manifest["workload"]
    return int(wl["row_bytes"]) if program == "dispatch" else 2 * int(wl["hidden"])


def role_items(parsed: dict, ri: int, step: str):
    """Role ri's items in item order, as (item index, item, its copy, its channel); an item's
    channel is (step, the copy's sender, its receiver)."""
    rd = parsed["roles"][ri]
    begin = int(rd["item_begin"])
    for item in range(begin, begin + int(rd["item_count"])):
        it = parsed["items"][item]
        c = parsed["copies"][int(it["copy"])]
        yield item, it, c, (step, int(c["src_rank"]), int(c["dst_rank"]))


def item_sequences(manifest: dict, parsed: dict, program: str) -> tuple[np.ndarray, dict, dict]:
    """(seq uint32 [num_items], pack roles {role index: {channel key: [chunk bytes...]}}, unpack
    roles likewise): each item of a pack or unpack role numbered on its channel, in item order."""
    kernel = next(k for k in manifest["kernels"] if k["program"] == program and k["kind"] == "main")
    wire = wire_pitch(manifest, program)
    seq = np.zeros(max(len(parsed["items"]), 1), dtype=np.uint32)
    sides: dict[str, dict[int, dict]] = {"rdma-pack": {}, "rdma-unpack": {}}
    for i, role in enumerate(kernel["roles"]):
        side = role.get("lowered")
        if side not in sides:
            continue
        chans: dict[tuple[str, int, int], list[int]] = {}
        for item, it, _, key in role_items(parsed, i, role["step"]):
            got = chans.setdefault(key, [])
            seq[item] = len(got)
            got.append((int(it["row_end"]) - int(it["row_begin"])) * wire)
        sides[side][i] = chans
    return seq, sides["rdma-pack"], sides["rdma-unpack"]


@dataclass
class ChannelPlan:
    """One rank's side of a program's GPU proxy path, decided before anything is allocated."""

    roles: list[_Role]  # the pack roles in kernel role order: the engine's roles, FIFOs and send slots
    send: dict[tuple, _Chan]  # by (step, sender, receiver), sorted: a channel's index is its position
    recv: dict[tuple, _Chan]
    landing_bytes: int
    sig_bytes: int
    fifos: FifoLayout


def channel_plan(program: str, kernel: dict, pack: dict, unpack: dict, steps: dict, wire: int) -> ChannelPlan:
    """The channels, landing and signal offsets and FIFO layout of one rank, from its pack and
    unpack roles (item_sequences) and the program's RDMA steps (by name, with their depth)."""
    send: dict[tuple, _Chan] = {}
    recv: dict[tuple, _Chan] = {}
    roles: list[_Role] = []
    fed_by: dict[tuple, int] = {}
    for ri, chans in pack.items():
        step = kernel["roles"][ri]["step"]
        role = _Role(ri, step, steps[step].depth, wire)
        for key, sizes in chans.items():
            if fed_by.setdefault(key, ri) != ri:  # item_sequences numbers chunks per role and channel
                raise RdmaGpuError(f"{program} step '{step}': channel {key[1]}->{key[2]} is fed by pack roles "
                                   f"{fed_by[key]} and {ri}; one pack role per channel in this version")
            ch = send.setdefault(key, _Chan(key, step, key[1], key[2], steps[step].depth))
            ch.n_chunks += len(sizes)
            ch.slot_bytes = max(ch.slot_bytes, max(sizes, default=1))
            role.slot_bytes = max(role.slot_bytes, ch.slot_bytes)
            role.chans.append(key)
        roles.append(role)
    for ri, chans in unpack.items():
        step = kernel["roles"][ri]["step"]
        for key, sizes in chans.items():
            ch = recv.setdefault(key, _Chan(key, step, key[1], key[2], steps[step].depth))
            ch.n_chunks += len(sizes)
            ch.slot_bytes = max(ch.slot_bytes, max(sizes, default=1))
    send = dict(sorted(send.items()))
    recv = dict(sorted(recv.items()))
    for i, ch in enumerate(send.values()):
        ch.index = i
    landing_bytes = sig_bytes = 0
    for i, ch in enumerate(recv.values()):
        ch.index = i
        ch.slot_bytes = _align(ch.slot_bytes)
        ch.offset = landing_bytes
        landing_bytes += ch.depth * ch.slot_bytes
        ch.sig_offset = sig_bytes
        sig_bytes += 8 * ch.depth
    for role in roles:
        role.slot_bytes = _align(role.slot_bytes)
    return ChannelPlan(roles, send, recv, landing_bytes, sig_bytes, fifo_layout(r.depth for r in roles))


@dataclass(frozen=True)
class Regions:
    """The addresses the kernels' descriptors point into (device memory, or host-pinned and mapped)."""

    send_bufs: tuple[int, ...]  # per pack role: depth x slot_bytes send slots
    claims: int  # u64 [n pack roles]: FIFO indices claimed
    credits: int  # u64 [n send channels]: written by the receivers' proxies
    fifos: int  # the FIFO region (ChannelPlan.fifos)
    landing: int  # the landing slots of every receive channel
    signals: int  # their signal words
    consumed: int  # u64 [n receive channels], host-pinned


def descriptors(parsed: dict, kernel: dict, cp: ChannelPlan, at: Regions, peer_depth: dict) -> np.ndarray:
    """The kernels' RdmaChan table (one per CopyDesc): a pack role's copies point at the role's own
    send slots, claim counter, FIFO entries and retired word, and their channel's credit word; an
    unpack role's at their channel's landing slots, signal words and consumed word.  `peer_depth`:
    the receiver's landing slots of each send channel (the credit window)."""
    desc = np.zeros(max(len(parsed["copies"]), 1), dtype=RDMA_CHAN)
    for i, role in enumerate(cp.roles):
        for _, it, _, key in role_items(parsed, role.index, role.step):
            ch = cp.send[key]
            desc[int(it["copy"])] = (at.send_bufs[i], 0, at.claims + 8 * i, at.credits + 8 * ch.index,
                                     cp.fifos.entries_ptr(at.fifos, i), cp.fifos.retired_ptr(at.fifos, i), role.depth,
                                     role.slot_bytes, ch.index, peer_depth[ch.key])
    for ri, role in enumerate(kernel["roles"]):
        if role.get("lowered") != "rdma-unpack":
            continue
        for _, it, _, key in role_items(parsed, ri, role["step"]):
            ch = cp.recv[key]
            desc[int(it["copy"])] = (at.landing + ch.offset, at.signals + ch.sig_offset, at.consumed + 8 * ch.index,
                                     0, 0, 0, ch.depth, ch.slot_bytes, 0, 0)
    return desc


class GpuRdma:
    """The GPU proxy path of one rank and program: transport, rings, descriptors, proxy thread."""

    def __init__(self, *, proxy_lib: str, cuda_lib, ctx, plan, manifest: dict, blob: np.ndarray, program: str,
                 rank: int, device: int, exchange, timeout_s: float = 30.0, transport: str = "emulated",
                 spec: str | None = None, log=None):
        if program not in PROGRAMS:
            raise RdmaGpuError(f"program must be one of {PROGRAMS}, not {program!r}")
        self.cuda, self.program, self.rank = cuda_lib, program, rank
        self.keep: list = []
        self.device_ptrs: list[int] = []
        self.sym_ptrs: list[int] = []  # symmetric (NVSHMEM) allocations, freed collectively by close()
        self.thread: threading.Thread | None = None
        self.status: int | None = None
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
        parsed = parse_tables(blob)
        R = int(parsed["header"]["num_ranks"])
        seq, pack, unpack = item_sequences(manifest, parsed, program)
        kernel = next(k for k in manifest["kernels"] if k["program"] == program and k["kind"] == "main")
        wire = wire_pitch(manifest, program)
        step_index = {s.step: s.index for s in steps.values()}

        cp = channel_plan(program, kernel, pack, unpack, steps, wire)
        roles, send, recv = cp.roles, cp.send, cp.recv
        landing_bytes, sig_bytes = cp.landing_bytes, cp.sig_bytes

        # ---- memory: device (cudaMalloc'd, zeroed; peers write the first three) and host-pinned
        def dmalloc(n: int) -> int:
            p = cuda_lib.malloc(device, max(n, 8))
            self.device_ptrs.append(p)
            return p

        import torch  # pinned host memory the kernels and the proxy share

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
        desc = descriptors(parsed, kernel, cp, regions, peer_depth)
        self.desc_dev = dmalloc(desc.nbytes)
        self.seq_dev = dmalloc(seq.nbytes)
        cuda_lib.copy_to_device(self.desc_dev, desc.view(np.uint8))
        cuda_lib.copy_to_device(self.seq_dev, seq)
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

    def close(self) -> None:
        """Stop the proxy (every launch using it must have completed), release everything."""
        if self.thread is not None:
            self.stop[0] = 1
            self.thread.join()
            self.thread = None
        if getattr(self, "engine", None) is not None:
            self.lib.epcc_rdma_engine_fini(self.engine.ctypes.data)
            self.engine = None
        if getattr(self, "tp", None) is not None:
            self.tp.close()
            self.tp = None
        for p in self.device_ptrs:
            self.cuda.free(p)
        self.device_ptrs.clear()
        for p in reversed(self.sym_ptrs):  # collective: every rank closes its engines in the same order
            self.lib.epcc_nvshmem_free(p)
        self.sym_ptrs.clear()
