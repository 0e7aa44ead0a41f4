"""The GPU proxy path's shared decisions for one rank and program, from its uploaded tables
(`from_tables`: a layout the host computed) or from the placement of the tables the metadata
kernels write (`from_placement`: decided once, for every routing).

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
  handed to the launcher with `Context.set_rdma`: from host tables the host numbers the items;
  from a placement the metadata kernels do, per dispatch (meta.cuh Args.seq), and every channel
  any routing can use is set up, its slots sized for the most bytes one of its chunks can hold
  (PlacedCopy.chunk_rows_cap), so nothing here depends on a routing;
* links: every link class the program's RDMA steps use is one link of the transport (step_links,
  in step order); the emulated transport paces each (emulated_spec), NVSHMEM has one.

Nothing here allocates or talks to a device: engine.py does, with these decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from epcc.backends.cuda.placement import Placement

from ..base import EngineError
from ..cuda_table.tables import parse_tables

ALIGN = 256
FIFO_WORDS = 8  # epcc_rdma_fifo: tail, head, retired, flushed, depth, entries, done, external
ENTRY_WORDS = 6  # epcc_rdma_entry: word, kind, chan, chan_seq, bytes, value
HEAD_WORD, RETIRED_WORD, DEPTH_WORD, ENTRIES_WORD = 1, 2, 4, 5  # epcc_rdma_fifo's words the host reads or fills
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


class RdmaGpuError(EngineError):
    """The GPU proxy path cannot run (a bad transport spec, tables without its roles, a failure)."""


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

    def waiting(self, host: np.ndarray) -> list[tuple[int, int]]:
        """(FIFO, head) of every FIFO whose entry at its head is valid but not yet taken by the
        proxy (the test of epcc_rdma_fifo_peek, read from the host-pinned region `host`)."""
        out = []
        for i, depth in enumerate(self.depths):
            head = int(host[self.struct_word(i) + HEAD_WORD])
            if int(host[self.entries_word(i) + ENTRY_WORDS * (head % depth)]) == (head << 1) | 1:
                out.append((i, head))
        return out


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


def placed_sequences(manifest: dict, pl: Placement) -> tuple[dict, dict]:
    """(pack roles, unpack roles) as item_sequences gives them, from a placement alone (the tables
    the metadata kernels write, for any routing): every channel the roles' copies can use, each
    copy at its most chunks, each chunk at the most bytes one can hold.  The channel plan then
    sizes the rings once for every routing; the chunk counts it derives are bounds, which the GPU
    proxy loop does not read (it follows the FIFO entries and consumed words the kernels write)."""
    wire = wire_pitch(manifest, pl.program)
    sides: dict[str, dict[int, dict]] = {"rdma-pack": {}, "rdma-unpack": {}}
    for ri, pr in enumerate(pl.roles):
        if pr.side not in sides:
            continue
        chans: dict[tuple[str, int, int], list[int]] = {}
        for pc in pr.copies:
            c = pl.copy_meta[pc.copy]
            chans.setdefault((pr.step, int(c.src), int(c.dst)), []).extend([pc.chunk_rows_cap * wire] * pc.chunks_cap)
        sides[pr.side][ri] = chans
    return sides["rdma-pack"], sides["rdma-unpack"]


@dataclass(frozen=True)
class Source:
    """What a rank's GPU proxy path of one program is set up from: its pack and unpack roles'
    channels (item_sequences' form), the copies those roles move (CopyDesc index, role index,
    side, channel), the tables' CopyDesc count, and the items' sequence numbers (None: the
    metadata kernels write them per dispatch)."""

    pack: dict
    unpack: dict
    copies: tuple[tuple[int, int, str, tuple], ...]
    num_copies: int
    seq: np.ndarray | None


def from_tables(manifest: dict, blob: np.ndarray, program: str) -> Source:
    """From host-built tables (a layout the host computed): this layout's chunks, numbered here."""
    parsed = parse_tables(blob)
    seq, pack, unpack = item_sequences(manifest, parsed, program)
    kernel = next(k for k in manifest["kernels"] if k["program"] == program and k["kind"] == "main")
    copies = {}
    for ri, role in enumerate(kernel["roles"]):
        if role.get("lowered") in ("rdma-pack", "rdma-unpack"):
            for _, it, _, key in role_items(parsed, ri, role["step"]):
                copies[int(it["copy"])] = (int(it["copy"]), ri, role["lowered"], key)
    return Source(pack, unpack, tuple(copies.values()), len(parsed["copies"]), seq)


def from_placement(manifest: dict, pl: Placement) -> Source:
    """From the placement of the tables the metadata kernels write: every channel, at its bounds."""
    pack, unpack = placed_sequences(manifest, pl)
    copies = tuple((pc.index, pc.role, pr.side, (pr.step, int(pl.copy_meta[pc.copy].src),
                                                 int(pl.copy_meta[pc.copy].dst)))
                   for pr in pl.roles if pr.side in ("rdma-pack", "rdma-unpack") for pc in pr.copies)
    return Source(pack, unpack, copies, len(pl.copies), None)


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


def descriptors(copies, num_copies: int, cp: ChannelPlan, at: Regions, peer_depth: dict) -> np.ndarray:
    """The kernels' RdmaChan table (one per CopyDesc, `num_copies`; Source.copies says which copy a
    pack or unpack role moves over which channel): a pack role's copies point at the role's own
    send slots, claim counter, FIFO entries and retired word, and their channel's credit word; an
    unpack role's at their channel's landing slots, signal words and consumed word.  `peer_depth`:
    the receiver's landing slots of each send channel (the credit window)."""
    desc = np.zeros(max(num_copies, 1), dtype=RDMA_CHAN)
    fifo = {role.index: i for i, role in enumerate(cp.roles)}
    for index, ri, side, key in copies:
        if side == "rdma-pack":
            i = fifo[ri]
            role, ch = cp.roles[i], cp.send[key]
            desc[index] = (at.send_bufs[i], 0, at.claims + 8 * i, at.credits + 8 * ch.index,
                           cp.fifos.entries_ptr(at.fifos, i), cp.fifos.retired_ptr(at.fifos, i), role.depth,
                           role.slot_bytes, ch.index, peer_depth[ch.key])
        else:
            ch = cp.recv[key]
            desc[index] = (at.landing + ch.offset, at.signals + ch.sig_offset, at.consumed + 8 * ch.index,
                           0, 0, 0, ch.depth, ch.slot_bytes, 0, 0)
    return desc
