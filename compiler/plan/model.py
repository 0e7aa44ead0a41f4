"""The execution plan: what the passes decide, in a form the simulator and backends consume.

A :class:`Plan` is plain data (JSON-serialisable, no MLIR): the bundle carries it to machines
that run schedules without MLIR installed.  Passes fill it in stages:

* route analysis: one :class:`PlanStep` per step with its :class:`Flow` list (who moves how many
  bytes to whom over which resources) under the chosen routing distribution;
* derive-combine: the combine steps;
* chunk-and-pipeline: `chunk_bytes`, `num_chunks`, `depth`, and which dependencies may be
  pipelined chunk by chunk;
* overlap scheduling: `priority` (lower runs first on a shared resource) and `engine_slot`;
* buffer allocation: `buffers` with their sizes and the formula behind each size;
* kernel formation: `kernels` (roles on SM ranges, proxy loops, DMA queues) and `direct`, the
  direct kernels the CUDA target lowers a one-hop plan to (plan/direct.py decides), or why not.

Resources are named strings: `link:<name>:<port>:out|in` for a link port, `hbm:<rank>` for a
rank's local memory, with capacities in bytes/s in `Plan.resources`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from math import ceil
from typing import Any

from ..vendors import DEFAULT_ARCH, DEFAULT_VENDOR


# What may move a step's rows: GPU threads (sm; spc, a Biren compute cluster; tma), a copy engine
# (ce, dma), a NIC (nic) or the host proxy (proxy).  A link's `engines` and a step's `engine`
# choose among the COPY_ENGINES (p2p, d2d and local links).
ENGINES = ("sm", "spc", "tma", "ce", "dma", "nic", "proxy")
COPY_ENGINES = ("sm", "spc", "tma", "ce", "dma")


def ramp_sizes(tokens_per_chunk: int, halvings: int) -> list[int]:
    """Chunk sizes, in tokens, of one end of a ramped copy, smallest first: `tokens_per_chunk`
    tokens in chunks of tokens_per_chunk >> halvings, the next as many in chunks twice that, ...,
    the last in chunks of tokens_per_chunk >> 1 (halvings 3, 64 tokens: 8 x 8, 4 x 16, 2 x 32).
    A size never falls below one token; the halvings stop where it would."""
    out: list[int] = []
    for j in range(halvings, 0, -1):
        size = tokens_per_chunk >> j
        if size >= 1:
            out += [size] * (tokens_per_chunk // size)
    return out


def chunk_sizes(tokens: int, tokens_per_chunk: int | None, head: int = 0, tail: int = 0) -> list[int]:
    """How a copy of `tokens` tokens is cut into chunks (tokens each, in order): chunks of
    `tokens_per_chunk`; `head` / `tail` halvings make the first / last chunks smaller (ramp_sizes,
    the tail mirrored) where the copy is long enough to hold both ends and one whole chunk
    between them; a partial chunk (the remainder) comes last before the tail, as without
    halvings, where chunk c holds tokens c x tokens_per_chunk onwards.  One chunk without a
    chunk size; none without tokens."""
    if tokens <= 0:
        return []
    if not tokens_per_chunk:
        return [tokens]
    front = ramp_sizes(tokens_per_chunk, head)
    back = ramp_sizes(tokens_per_chunk, tail)[::-1]
    if sum(front) + sum(back) + tokens_per_chunk > tokens:
        front, back = [], []
    middle = tokens - sum(front) - sum(back)
    whole, rest = divmod(middle, tokens_per_chunk)
    return front + [tokens_per_chunk] * whole + ([rest] if rest else []) + back


def item_order(chunks_per_copy: list[int]) -> list[tuple[int, int]]:
    """The order a table-driven role processes its (copy, chunk) items in: chunk-major, interleaving
    the copies by progress (`(c + 0.5) / n`), so every destination sees its first chunks early and
    the consumers downstream start pipelining at once.  Blocks take items round-robin (the host's
    tables, the metadata kernels' meta_items and the simulator's per-block model, sim/blocks.py)."""
    items = [(ci, c) for ci, n in enumerate(chunks_per_copy) for c in range(n)]
    items.sort(key=lambda it: ((it[1] + 0.5) / chunks_per_copy[it[0]], it[0]))
    return items


@dataclass
class Flow:
    """Bytes one executing rank moves from `src` to `dst` in one step."""

    rank: int
    src: int
    dst: int
    bytes: float
    resources: tuple[str, ...]
    latency_s: float = 0.0
    # The selection this flow applies, evaluated: a token moves if its destination ranks hit
    # this set (None: every token in the source buffers).  Writes into `output` select the
    # receiver and place one row per (token, receiver's expert).
    select: tuple[int, ...] | None = None
    # Time the flow is not done after its last byte moved, besides latency: an RDMA channel's last
    # chunk applied by one SM, a pipelined role's last chunk on fewer SMs than it has (set by the
    # simulator's SM terms, sim/sm_terms.py).
    tail_s: float = 0.0
    # Time after its step is ready before the flow moves its first byte: an RDMA channel's first
    # chunk staged on an SM and posted by the proxy before the wire carries it (sim/sm_terms.py).
    lead_s: float = 0.0
    # What one byte of the flow costs on each of its resources, in the resource's own bytes (same
    # length as `resources`, each resource listed once; empty: 1 on every resource).  A pool of SMs
    # charged per byte written, read and reduced (sim/direct.py) is one resource with a weight per
    # flow; links carry a flow's bytes as they are.
    weights: tuple[float, ...] = ()


@dataclass
class PlanStep:
    name: str
    program: str  # dispatch | combine
    verb: str
    link: str | None
    link_kind: str | None
    deps: tuple[str, ...]  # steps that must finish (or, if pipelined, progress) first
    flows: list[Flow] = field(default_factory=list)
    title: str | None = None
    line: int = 0  # DSL line, carried to emitted code
    chunk_bytes: float | None = None
    num_chunks: int = 1
    depth: int = 1
    pipelined_deps: tuple[str, ...] = ()  # deps this step may follow chunk by chunk
    priority: int = 0
    order: str | None = None  # first | last (user hint)
    sms: int | None = None
    # Halvings of the first (head) and last (tail) chunks of each copy (chunk_sizes): a step
    # that others follow chunk by chunk hands them its first chunk sooner, one that follows a
    # producer spreads the producer's last chunk over its SMs (chunk-pipeline; 0: uniform chunks).
    ramp_head: int = 0
    ramp_tail: int = 0
    reverse_of: str | None = None  # combine steps derived from a dispatch step
    reverse_source: str | None = None  # ... and the dispatch source buffer whose copies they return
    weighted: bool = False  # a combine step that applies the routing weights (reads expert outputs)
    # Its flows count one row per (token, expert) (a permute, `dedup none`, or the reverse of
    # one; a combine moving expert outputs as they are), else one copy per token.
    rows: bool = False
    src_buffers: tuple[str, ...] = ()  # buffers the step reads (on the flow's src rank)
    dst_buffer: str | None = None  # buffer it writes (on the flow's dst rank)
    # Fraction of its bytes a step has moved before its first chunk is complete (its chunks in
    # flight: one per SM in a wave, fewer behind a slower producer): a pipelined consumer trails
    # it by that much more.  Set by the simulator's SM terms (sim/sm_terms.py); 0: chunks
    # complete as bytes move (the fluid model).
    completion_lag: float = 0.0
    # The engine that copies its rows (engine-selection): the link's `engine`, or of the link's
    # `engines` the one the cost model found fastest or the step named; None in a plan from
    # before engines were chosen per step (its roles say the engine) and for metadata exchanges
    # routed by the compiler.  `engine_why`: how it was chosen, both engines' rates and times
    # (None where the link offers one engine).
    engine: str | None = None
    engine_why: str | None = None

    @property
    def total_bytes(self) -> float:
        return sum(f.bytes for f in self.flows)

    def effective_engine(self, link: Any, default: str = "sm") -> str:
        """The engine the step runs on: engine-selection's choice, else its link's engine (`link`:
        the topology's link it goes over, None for a step without one), else `default`."""
        return self.engine or (link.engine if link is not None else default)

    def max_rank_bytes(self) -> float:
        per: dict[int, float] = {}
        for f in self.flows:
            per[f.rank] = per.get(f.rank, 0.0) + f.bytes
        return max(per.values(), default=0.0)

    def chunk_count(self, chunk_bytes: float | None) -> int:
        """Chunks of `chunk_bytes` its biggest flow takes (1 without a chunk size or bytes)."""
        biggest = max((f.bytes for f in self.flows), default=0.0)
        return max(1, ceil(biggest / chunk_bytes)) if chunk_bytes and biggest > 0 else 1

    @property
    def whole_chunks(self) -> int:
        """Its chunk count without the ramps' smaller chunks (chunk_count of its chunk size): what
        sets its latency rounds and how far it trails a producer in the middle of the copy, where
        chunks are whole (the ramps' first / last chunks enter the simulator as a step's
        completion lag and tail, sim/sm_terms.py)."""
        return self.chunk_count(self.chunk_bytes) if self.chunk_bytes else max(1, int(self.num_chunks or 1))

    def chunked(self, chunk_bytes: float, depth: int) -> "PlanStep":
        """A copy cut into chunks of `chunk_bytes`, `depth` in flight (at most its chunks), as the
        chunk-pipeline pass sets them."""
        n = self.chunk_count(chunk_bytes)
        return replace(self, chunk_bytes=chunk_bytes, num_chunks=n, depth=max(1, min(depth, n)))


@dataclass
class BufferPlan:
    program: str
    name: str
    bytes_per_rank: int
    formula: str  # how the size was computed, in words and numbers
    worst_case_bytes: int | None = None


# A role's block on an SM: 16 warps.  A role's rate per SM is the bytes it keeps in flight over
# the memory latency (each warp holds unroll x 16 B per lane); on 2x H200 the dispatch permute
# moved 36 GB/s per SM with 8 warps and 44 GB/s with 16 (bench/ep_bench.py role timeline,
# h200x2_2vnode): the rate the topologies' `sm copy` gives.  kernel-formation gives it to SM
# roles, the CUDA backend to the proxy path's pack and unpack roles.
WARPS_PER_SM = 16


@dataclass
class RolePlan:
    step: str
    role: str  # sender | puller | forwarder | permuter | reducer | copier | metadata | rdma_poster
    sm_begin: int
    sm_end: int
    warps: int
    engine: str
    # An RDMA step on the GPU proxy path (epcc compile --rdma proxy): blocks of the sender's pack
    # role and of the receiver's unpack role (kernel-formation sizes them for the link); 0 elsewhere.
    pack_sms: int = 0
    unpack_sms: int = 0


@dataclass
class KernelPlan:
    """A fused persistent kernel ("kernel"), a host proxy loop ("proxy"), or copy-engine work ("dma")."""

    name: str
    kind: str
    program: str
    sms: int
    roles: list[RolePlan] = field(default_factory=list)


@dataclass
class WorkloadPlan:
    """What the runtime needs of the workload (no MLIR, no model)."""

    tokens: int
    hidden: int
    dtype: str
    topk: int
    experts: int
    placement: str  # blocked | strided
    weights_travel: bool
    # expert (one output row per (token, local expert)) | token (one per (token, destination
    # rank)); left out of plan.json when expert, as plans from before the choice are
    layout: str = "expert"

    def rank_of_expert(self, e: int, num_ranks: int) -> int:
        epr = self.experts // num_ranks
        return e // epr if self.placement == "blocked" else e % num_ranks


@dataclass
class DirectKernels:
    """How the CUDA target runs a plan it lowers to direct kernels (plan/direct.py): per program,
    the SMs (blocks) of its one kernel, every warp doing every step, the kernel launches it takes
    and the metadata passes before its rows move.  The simulator charges them (sim/direct.py)."""

    sms: dict[str, int] = field(default_factory=dict)  # program -> SMs of its kernel
    launches: dict[str, int] = field(default_factory=dict)  # program -> kernel launches, metadata ones included
    meta_passes: dict[str, int] = field(default_factory=dict)  # program -> metadata passes before its rows move
    warps: dict[str, int] = field(default_factory=dict)  # program -> warps per block (default 16)

    def __post_init__(self) -> None:
        for what, d, least in (("sms", self.sms, 1), ("launches", self.launches, 0),
                               ("meta_passes", self.meta_passes, 0), ("warps", self.warps, 1)):
            for p, v in d.items():
                if not isinstance(v, int) or isinstance(v, bool) or v < least:
                    raise ValueError(f"DirectKernels.{what}[{p!r}] must be an integer >= {least}, got {v!r}")

    def with_sms(self, sms: int) -> "DirectKernels":
        """The same kernels on `sms` SMs per program, every block sending first (dispatch) and
        reducing first (combine): the default configuration's split."""
        return replace(self, sms={p: sms for p in self.sms})

    def cached(self) -> "DirectKernels":
        """The same kernels for a cached-handle dispatch (`Buffer.dispatch(x, handle=h)` of the last
        metadata's routing, DeepEP's cached mode): the dispatch launches no metadata kernel and its
        kernel counts none (host.cuh epcc_direct_dispatch, Args::cached): one launch, no metadata pass."""
        return replace(self, launches={p: 1 if p == "dispatch" else n for p, n in self.launches.items()},
                       meta_passes={p: 0 for p in self.meta_passes})


@dataclass
class LaunchPlan:
    """How the plan's kernels are launched on cards of several dies (plan/launch.py decides).

    `duplicate`: rank pairs [die 0's rank, die 1's rank], one per card, whose kernels one
    duplicate-mode launch covers (the same kernel and launch configuration on both dies of the card,
    each die reading its own rank's arguments); empty where the plan is not symmetric across
    the dies or the cards have one die, with the reason in `why`."""

    duplicate: list[list[int]] = field(default_factory=list)
    why: str = ""


@dataclass
class Plan:
    schedule: str
    num_ranks: int
    routing: str
    bytes_per_token: int
    steps: list[PlanStep] = field(default_factory=list)
    resources: dict[str, float] = field(default_factory=dict)  # bytes/s
    buffers: list[BufferPlan] = field(default_factory=list)
    kernels: list[KernelPlan] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    workload: WorkloadPlan | None = None
    rank_names: list[str] = field(default_factory=list)  # "rank 3 (node 0, gpu 3)", for messages
    sm_rates: dict[str, float] = field(default_factory=dict)  # the topology's `sm` line: bytes/s per SM
    # The `sm` line's `launch`: seconds one kernel launch costs before its first row moves (0: not
    # declared).  The simulator charges it once per program where it knows the kernels (sim/direct.py).
    sm_launch_s: float = 0.0
    # The `sm` line's `meta`: seconds one pass of a dispatch's metadata takes (counting a chunk of
    # tokens; finishing the chunks' ranks), exchange latency apart (0: not declared).
    sm_meta_s: float = 0.0
    # link name -> its `atomics` rate: fp32 bytes/s one GPU adds into another over it (per pair)
    atomics: dict[str, float] = field(default_factory=dict)
    # link name -> its `post`: seconds of the RDMA proxy's host time per chunk posted over it
    post_s: dict[str, float] = field(default_factory=dict)
    # The direct kernels the CUDA target lowers the plan to (kernel-formation, plan/direct.py), or
    # None with the reason in `direct_not_used`.
    direct: DirectKernels | None = None
    direct_not_used: str | None = None
    # Whose machine the topology is (`vendor biren arch br166`, epcc.vendors); nvidia hopper in a
    # plan from before topologies named it.
    vendor: str = DEFAULT_VENDOR
    arch: str = DEFAULT_ARCH
    # Duplicate-mode launches across the dies of a card (kernel-formation, plan/launch.py); None
    # in a plan from before they were decided.
    launch: LaunchPlan | None = None

    def step(self, name: str, program: str = "dispatch") -> PlanStep:
        for s in self.steps:
            if s.name == name and s.program == program:
                return s
        raise KeyError(f"{program}.{name}")

    def program_steps(self, program: str) -> list[PlanStep]:
        return [s for s in self.steps if s.program == program]

    def to_dict(self) -> dict[str, Any]:
        """The plan as plan.json holds it (without its format and version)."""
        d = asdict(self)
        if d["workload"] is not None and d["workload"]["layout"] == "expert":
            del d["workload"]["layout"]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Plan":
        return Plan.from_dict(json.loads(text))

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Plan":
        """The Plan of a parsed plan.json (consumed); a plan from outside is checked first
        (epcc.plan.check)."""
        steps = []
        for s in d.pop("steps"):
            flows = [Flow(**{**f, "resources": tuple(f["resources"]), "weights": tuple(f.get("weights", ())),
                             "select": None if f.get("select") is None else tuple(f["select"])})
                     for f in s.pop("flows")]
            for k in ("deps", "pipelined_deps", "src_buffers"):
                s[k] = tuple(s.get(k, ()))
            steps.append(PlanStep(**s, flows=flows))
        buffers = [BufferPlan(**b) for b in d.pop("buffers")]
        kernels = [KernelPlan(**{**k, "roles": [RolePlan(**r) for r in k["roles"]]}) for k in d.pop("kernels", [])]
        wl = d.pop("workload", None)
        direct = d.pop("direct", None)
        launch = d.pop("launch", None)
        return Plan(**d, steps=steps, buffers=buffers, kernels=kernels,
                    workload=WorkloadPlan(**wl) if wl else None,
                    direct=DirectKernels(**direct) if direct else None,
                    launch=LaunchPlan(**launch) if launch else None)
