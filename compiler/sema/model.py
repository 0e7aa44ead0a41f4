"""The resolved schedule model: what a checked .sched file means.

Names are resolved, quantities are in SI base units (bytes, bytes/s, seconds), relations are
evaluated to explicit rank maps, and every object keeps the span it came from so that later
stages (IR emission, passes, backends) can carry source locations to the emitted code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from math import prod
from typing import Callable, Mapping, Sequence

from ..diagnostics import Span
from ..costmodel.uniform import hit_probability
from ..plan.model import COPY_ENGINES, ENGINES  # noqa: F401 - the engines a link or step names
from ..vendors import DEFAULT_ARCH, DEFAULT_VENDOR

LINK_KINDS = ("p2p", "d2d", "rdma", "local")
DEFAULT_ENGINE = {"p2p": "sm", "d2d": "sm", "rdma": "nic", "local": "sm"}
DTYPES = ("bf16", "fp8")
PLACEMENTS = ("blocked", "strided")
# Dispatch output layouts: expert-major (one row per (token, local expert), the permute fused) or
# token-major (one row per (token, destination rank), DeepEP's intranode layout).
LAYOUTS = ("expert", "token")

# Per-token metadata that travels with a token when routing weights travel:
# one fp32 weight and one int32 expert index per top-k slot.
TOPK_META_BYTES = 4 + 4
FP8_SCALE_GROUP = 128  # channels per fp32 scale (DeepSeek-V3 e4m3 recipe)


@dataclass(frozen=True)
class LevelInfo:
    name: str
    count: int
    depth: int
    span: Span


@dataclass(frozen=True)
class GroupInfo:
    """`group vnode = 4 card`: consecutive blocks of `size` instances of `level`."""

    name: str
    level: str
    depth: int
    size: int
    span: Span


class RankSpace:
    """Ranks are the instances of the innermost level, numbered row-major over the levels."""

    def __init__(self, levels: Sequence[LevelInfo], groups: Mapping[str, GroupInfo]):
        self.levels = list(levels)
        self.groups = dict(groups)
        self.counts = [lv.count for lv in self.levels]
        self.num_ranks = prod(self.counts)
        self._strides = [prod(self.counts[i + 1:]) for i in range(len(self.counts))]
        self.level_index = {lv.name: i for i, lv in enumerate(self.levels)}

    @property
    def rank_level(self) -> LevelInfo:
        return self.levels[-1]

    def coords(self, r: int) -> tuple[int, ...]:
        return tuple((r // s) % c for s, c in zip(self._strides, self.counts))

    def rank(self, coords: Sequence[int]) -> int:
        return sum(c * s for c, s in zip(coords, self._strides))

    def describe(self, r: int) -> str:
        inner = ", ".join(f"{lv.name} {c}" for lv, c in zip(self.levels, self.coords(r)))
        return f"rank {r} ({inner})"

    def global_index(self, r: int, level: str) -> int:
        """Index of r's instance of `level` counted over the whole machine (e.g. GPU number)."""
        d = self.level_index[level]
        return r // self._strides[d]

    def instances(self, level: str) -> int:
        d = self.level_index[level]
        return prod(self.counts[: d + 1])

    def scope_key(self, r: int, scope: str) -> tuple[int, ...]:
        """Identifies r's instance of a level or group: ranks with equal keys share it."""
        c = self.coords(r)
        if scope in self.level_index:
            d = self.level_index[scope]
            return c[: d + 1]
        g = self.groups[scope]
        return c[: g.depth] + (c[g.depth] // g.size,)

    def scope_instances(self, scope: str) -> int:
        if scope in self.level_index:
            return self.instances(scope)
        g = self.groups[scope]
        return self.instances(g.level) // g.size

    def members(self, r: int, scope: str) -> frozenset[int]:
        key = self.scope_key(r, scope)
        return frozenset(q for q in self._members_by_key(scope)[key])

    def _members_by_key(self, scope: str) -> dict[tuple[int, ...], list[int]]:
        cache = self.__dict__.setdefault("_member_cache", {})
        if scope not in cache:
            by: dict[tuple[int, ...], list[int]] = {}
            for q in range(self.num_ranks):
                by.setdefault(self.scope_key(q, scope), []).append(q)
            cache[scope] = by
        return cache[scope]

    def scope_names(self) -> list[str]:
        return [lv.name for lv in self.levels] + list(self.groups)


@dataclass(frozen=True)
class RelationInfo:
    """A named map rank -> ranks (`peer`, `mate`, ...), evaluated for every rank."""

    name: str
    targets: tuple[tuple[int, ...], ...]
    text: str
    span: Span

    def of(self, r: int) -> tuple[int, ...]:
        return self.targets[r]

    @cached_property
    def pairs(self) -> frozenset[tuple[int, int]]:
        return frozenset((r, f) for r, ts in enumerate(self.targets) for f in ts)

    @property
    def fanout(self) -> int:
        return max((len(t) for t in self.targets), default=0)

    def self_pair(self) -> int | None:
        """A rank the relation relates to itself, or None."""
        return next((r for r, ts in enumerate(self.targets) if r in ts), None)


@dataclass(frozen=True)
class LinkInfo:
    name: str
    kind: str
    bandwidth: float  # bytes/s per lane, one direction
    latency: float  # seconds
    engine: str
    lanes: int
    efficiency: float  # 0 < e <= 1
    pairs: frozenset[tuple[int, int]]  # symmetric; empty for local links
    relation_text: str
    span: Span
    # `shared per card`: one physical port per instance of that level/group, shared by every
    # rank pair whose sending rank lies in it (a NIC per card serving both dies).  None: each
    # rank has its own port.
    shared_per: str | None = None
    # `atomics 180 GB/s`: the fp32 atomic adds (red.add) one GPU makes into another's memory over
    # this link saturate at this rate per direction and GPU pair, below what plain stores reach
    # (the combine roles that add into a peer's partials).  None: not declared.
    atomics: float | None = None
    # `post 10 us` (RDMA links): host time the proxy spends on each chunk it posts over this link,
    # the credit it returns for one included; one proxy thread per rank and program posts them
    # one after another, so a channel moves at most chunk / post.  0: not declared.
    post: float = 0.0
    # `engines spc 27.9 GB/s, dma 15 GB/s`: the copy engines that can drive this link and the rate
    # each reaches over it (per direction and rank pair), in the order written; a step over the
    # link runs on the one the cost model finds fastest (engine-selection) unless it names one
    # (`engine dma`).  Empty: the link's one `engine`, at the link's rate.
    engine_rates: Mapping[str, float] = field(default_factory=dict)

    def connects(self, a: int, b: int) -> bool:
        if self.kind == "local":
            return a == b
        return (a, b) in self.pairs

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth * self.lanes * self.efficiency


# Kinds of SM work: row copies (dispatch, RDMA staging; in the direct kernels, row stores); row
# loads that feed several stores (the direct kernels: a row loaded once, stored to every expert
# row); weighted reduction of a token's expert rows into its fp32 partial (weighted combine
# steps, rows gathered per token); adding one partial per token into another (unweighted combine
# steps, the apply of a combine RDMA step: an atomic scatter-add, bench/sm_probe.cu `red`).
SM_WORK = ("copy", "read", "reduce", "add")
# The `sm` line's times: what a kernel launch costs before its first row moves, and what the first
# pass of the dispatch's metadata (counting a chunk of tokens and publishing it) takes; a second,
# finishing pass and the peers' flags are compiler/sim/direct.py's terms.
SM_LAUNCH = "launch"
SM_META = "meta"
SM_TIMES = {SM_LAUNCH: "kernel launch", SM_META: "metadata pass"}


@dataclass(frozen=True)
class Topology:
    name: str
    space: RankSpace
    relations: Mapping[str, RelationInfo]
    links: Mapping[str, LinkInfo]
    span: Span
    # Relations and links that were declared but whose declaration has errors (already
    # reported): later uses stay silent instead of calling them unknown.
    broken_relations: frozenset[str] = frozenset()
    broken_links: frozenset[str] = frozenset()
    # `sm copy 44 GB/s, reduce 23 GB/s, add 12 GB/s`: bytes/s one SM of a role kernel moves, by kind of work
    # (SM_WORK); empty: SM throughput is not modelled (the simulator sees links only).
    sm_rates: Mapping[str, float] = field(default_factory=dict)
    # the `sm` line's `launch 9 us`: seconds per kernel launch (0: not given)
    sm_launch: float = 0.0
    # the `sm` line's `meta 6 us`: seconds of a dispatch's first metadata pass (0: not given)
    sm_meta: float = 0.0
    # `vendor biren arch br166` (epcc.vendors): whose machine it is; nvidia hopper when not given
    vendor: str = DEFAULT_VENDOR
    arch: str = DEFAULT_ARCH

    @property
    def num_ranks(self) -> int:
        return self.space.num_ranks

    def local_links(self) -> list[LinkInfo]:
        return [l for l in self.links.values() if l.kind == "local"]


@dataclass(frozen=True)
class Workload:
    tokens: int  # per rank
    hidden: int
    dtype: str
    topk: int
    experts: int
    placement: str
    node_limit: int | None
    node_limit_scope: str | None
    weights_travel: bool
    num_ranks: int
    span: Span
    layout: str = "expert"  # LAYOUTS

    @property
    def experts_per_rank(self) -> int:
        return self.experts // self.num_ranks

    def rank_of_expert(self, e: int) -> int:
        if self.placement == "blocked":
            return e // self.experts_per_rank
        return e % self.num_ranks

    def experts_of_rank(self, r: int) -> list[int]:
        if self.placement == "blocked":
            n = self.experts_per_rank
            return list(range(r * n, (r + 1) * n))
        return list(range(r, self.experts, self.num_ranks))

    @property
    def payload_bytes(self) -> int:
        """Bytes of one token's hidden state on the wire (fp8: plus one fp32 scale per 128)."""
        if self.dtype == "bf16":
            return self.hidden * 2
        return self.hidden + (self.hidden // FP8_SCALE_GROUP) * 4

    @property
    def bytes_per_token(self) -> int:
        return self.payload_bytes + (self.topk * TOPK_META_BYTES if self.weights_travel else 0)

    @property
    def combine_bytes_per_token(self) -> int:
        """Combine moves BF16 partial sums; no metadata rides along."""
        return self.hidden * 2

    def p_hits(self, n_experts: int) -> float:
        """P(a token's top-k hits at least one of n given experts) under uniform top-k routing.

        Exact: 1 - C(E - n, k) / C(E, k).  (Node-limited routing is handled in route analysis.)
        """
        return hit_probability(self.experts, self.topk, n_experts)


# --------------------------------------------------------------------------- programs


@dataclass(frozen=True)
class BufferInfo:
    name: str
    role: str  # source | sink | staging
    capacity_tokens: int | None
    capacity_bytes: int | None
    span: Span | None  # None for built-in buffers


@dataclass(frozen=True)
class BufAccess:
    """A buffer of the executing rank (relation None) or of each related rank."""

    buffer: BufferInfo
    relation: RelationInfo | None
    span: Span

    def text(self) -> str:
        return f"{self.relation.name}.{self.buffer.name}" if self.relation else self.buffer.name


@dataclass(frozen=True)
class RankSetExpr:
    """A rank set in a step, evaluated against (executing rank, far rank)."""

    text: str
    evaluate: Callable[[int, int | None], frozenset[int]]
    span: Span


@dataclass(frozen=True)
class Selection:
    mode: str  # all | any | for | of
    ranks: RankSetExpr | None
    span: Span

    def text(self) -> str:
        if self.mode == "all":
            return "all tokens"
        if self.mode == "any":
            return "tokens"
        return f"tokens {self.mode} {self.ranks.text}"


@dataclass
class Step:
    name: str
    title: str | None
    verb: str  # send | pull | copy | permute | reduce | exchange
    span: Span
    index: int
    selection: Selection | None = None
    sources: tuple[BufAccess, ...] = ()
    dest: BufAccess | None = None
    relation: RelationInfo | None = None  # the far side of a send/pull
    link: LinkInfo | None = None
    exchange_what: str | None = None
    exchange_peers: RankSetExpr | None = None
    chunk_tokens: int | None = None
    chunk_bytes: int | None = None
    depth: int | None = None
    sms: int | None = None
    engine: str | None = None  # `engine dma`: the copy engine this step runs on (None: engine-selection picks)
    ramp: int | None = None  # most halvings of its first / last chunks (None: chunk-pipeline's default)
    order: str | None = None  # first | last
    dedup: str = "rank"  # rank | none
    after: tuple[str, ...] = ()
    parallel: tuple[str, ...] = ()
    data_deps: tuple[str, ...] = ()  # earlier steps whose writes this step reads
    opt_spans: dict[str, Span] = field(default_factory=dict)

    @property
    def deps(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.data_deps + self.after))

    @property
    def direction(self) -> str:
        if self.verb == "send":
            return "push"
        if self.verb == "pull":
            return "pull"
        return "local" if self.verb != "exchange" else "exchange"

    def flows(self, r: int) -> list[tuple[int, int]]:
        """(source rank, destination rank) of the data this step moves when rank r runs it."""
        if self.verb == "send":
            return [(r, f) for f in self.relation.of(r)]
        if self.verb == "pull":
            return [(f, r) for f in self.relation.of(r)]
        return [(r, r)]

    def describe(self) -> str:
        if self.verb == "exchange":
            return f"exchange {self.exchange_what} with {self.exchange_peers.text}"
        srcs = ", ".join(s.text() for s in self.sources)
        if self.verb in ("permute", "reduce"):
            return f"{self.verb} {srcs} into {self.dest.text()}"
        prep = "to" if self.verb == "send" else "into"
        return f"{self.verb} {self.selection.text()} from {srcs} {prep} {self.dest.text()}"


@dataclass(frozen=True)
class Program:
    kind: str  # dispatch | combine
    buffers: Mapping[str, BufferInfo]
    steps: tuple[Step, ...]
    derived: bool  # combine declared as the reverse of dispatch (built by a later pass)
    span: Span

    def step(self, name: str) -> Step:
        for s in self.steps:
            if s.name == name:
                return s
        raise KeyError(name)


@dataclass(frozen=True)
class Schedule:
    name: str
    title: str | None
    path: str
    topology: Topology
    workload: Workload
    dispatch: Program
    combine: Program | None  # None when declared `combine reverse of dispatch`
    combine_reverse_span: Span | None

    @property
    def programs(self) -> list[Program]:
        return [p for p in (self.dispatch, self.combine) if p is not None]
