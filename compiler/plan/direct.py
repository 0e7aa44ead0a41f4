"""Which plans the CUDA target lowers to its direct one-hop kernels, and their shape.

A plan is *direct* when its dispatch is (an optional metadata exchange plus) send steps whose
flows go straight from every rank to every other rank, each carrying the tokens whose experts
live at the destination (`select == [dst]`), over peer links, plus a local permute for a rank's
own experts; its combine is the reverse.  That is DeepEP's intranode shape (h200x4.sched).  For
those plans the CUDA target writes fused, warp-specialized kernels (backends/cuda/direct.py,
include/epcc/direct/) instead of the general table-driven ones.

Decided here, from the plan alone (no code generation): `match` (direct or why not),
`default_config` (the launch configuration `epcc tune` sweeps, DirectConfig) and
`direct_kernels` (per program the SMs, launches and metadata passes the simulator charges).
kernel-formation records the result in `Plan.direct` / `Plan.direct_not_used`, which the CUDA
code generator and `epcc simulate` read.  The limits below are the kernels' (their templates
assert the same).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .model import DirectKernels, Plan, PlanStep

MAX_CHANNELS = 1024  # dispatch channels (contiguous token ranges) the peer region has tails for
CHANNELS_PER_WARP = 4  # dispatch channels per sender warp (taken in order: uneven ones even out)
DISPATCH_THREADS = 512  # at most 16 warps per dispatch block (the configuration's `warps`)
COMBINE_THREADS = 512
MAX_WARPS = DISPATCH_THREADS // 32
# combine: 16-byte vectors per lane in a warp's shared-memory ring of cp.async loads (combine.cuh,
# reduce_rows).  The loads in flight hold no registers: one SM keeps 16 warps x 32 lanes x RING x
# 16 B = 192 KB of rows coming.  With loads into registers (at most ~8 vectors per lane before
# 128 registers spilled, 4 for a 4-row record) the combine read ~64 GB/s per SM against the ~170
# an SM reads (bench/README, measured on 2 x H200).
COMBINE_RING = 24
MAX_IPC_RANKS = 8
META_THREADS = 256  # threads per metadata block, one token each: META_CHUNK tokens per block
META_CHUNK = META_THREADS
META_SHARED = 48 * 1024  # a block's static shared memory, which meta_count_kernel's masks must fit
FP8_GROUP = 128
DEFAULT_SMS = 24  # SMs per program where the push step gives none


def meta_shared_bytes(experts: int, ranks: int) -> int:
    """meta_count_kernel's shared memory: a mask per (warp, expert or rank) and a count per expert or
    rank, (warps + 1) x (E + R) ints, plus a few scalars (meta.cuh asserts the same)."""
    return (META_THREADS // 32 + 1) * (experts + ranks) * 4 + 64


class DirectError(ValueError):
    """The plan does not have the direct shape, or a launch configuration is bad (the reason says why)."""


@dataclass
class DirectConfig:
    """Launch configuration: what `epcc tune` sweeps.  Blocks are one per SM."""

    send_blocks: int  # dispatch blocks whose warps send channels, then replicate
    recv_blocks: int  # dispatch blocks that only replicate (0: every SM sends first)
    warps: int  # warps per dispatch block
    combine_send_blocks: int  # combine blocks whose warps reduce records into partials, then sum partials
    combine_reduce_blocks: int  # combine blocks that only sum partials (0: every SM reduces records first)

    @property
    def dispatch_sms(self) -> int:
        return self.send_blocks + self.recv_blocks

    @property
    def combine_sms(self) -> int:
        return self.combine_send_blocks + self.combine_reduce_blocks

    def channels(self, tokens: int | None = None) -> int:
        """Dispatch channels (contiguous token ranges, taken by sender warps in order): a few per
        sender warp so uneven ones even out, as many as the peer region has tails for, and no
        more than there are tokens (an empty channel still costs its sender warp a take and a
        replicating warp a queue per peer: at 128 tokens most of 1024 would be empty).  Each rank
        counts its own tokens, so ranks that dispatch different numbers of tokens have different
        channel counts: each publishes its count with its metadata, and the peers' loops over its
        channels follow it (epcc/direct/meta.cuh, dispatch.cuh, combine.cuh)."""
        c = max(1, min(MAX_CHANNELS, CHANNELS_PER_WARP * self.send_blocks * self.warps))
        return c if tokens is None else max(1, min(c, tokens))

    def check(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            least = 0 if f.name in ("recv_blocks", "combine_reduce_blocks") else 1
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                what = "a whole number >= 0" if least == 0 else "a positive integer"
                raise DirectError(f"config: {f.name} must be {what}, got {v!r}")
        if self.warps > MAX_WARPS:
            raise DirectError(f"config: warps must lie in [1, {MAX_WARPS}], got {self.warps}")

    @classmethod
    def from_dict(cls, d: dict) -> "DirectConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise DirectError(f"config: unknown key(s) {', '.join(unknown)}")
        missing = sorted(names - set(d))
        if missing:
            raise DirectError(f"config: missing key(s) {', '.join(missing)}")
        return cls(**d)


def program_steps(plan: Plan, program: str) -> list[PlanStep]:
    return [s for s in plan.steps if s.program == program]


def match(plan: Plan) -> str | None:
    """None when the plan has the direct shape, else the reason it has not (in words)."""
    wl = plan.workload
    if wl is None:
        return "the plan has no workload"
    R = plan.num_ranks
    if R > MAX_IPC_RANKS:
        return f"{R} ranks do not fit one CUDA IPC domain (at most {MAX_IPC_RANKS})"
    if R < 1 or wl.experts % R:
        return f"{wl.experts} experts cannot be divided among {R} ranks"
    if meta_shared_bytes(wl.experts, R) > META_SHARED:
        most = next(e for e in range(wl.experts, 0, -1) if meta_shared_bytes(e, R) <= META_SHARED)
        return (f"{wl.experts} experts: the metadata kernel's per-expert masks do not fit in a block's shared "
                f"memory (at most {most})")
    if wl.dtype == "bf16" and wl.hidden % 8:
        return f"hidden {wl.hidden} is not a multiple of 8 (16-byte bulk copies of bf16 rows)"
    if wl.dtype == "fp8" and wl.hidden % (4 * FP8_GROUP):
        return f"hidden {wl.hidden} is not a multiple of 512 (16-byte bulk copies of fp8 rows and their scales)"
    pairs: set[tuple[int, int]] = set()
    for s in program_steps(plan, "dispatch"):
        if s.verb == "exchange":
            continue
        if s.verb == "send" and s.link_kind == "p2p":
            for f in s.flows:
                if f.src == f.dst or tuple(f.select or ()) != (f.dst,):
                    return (f"step '{s.name}' (line {s.line}) sends rank {f.src}'s tokens for {f.select} to rank "
                            f"{f.dst}: not one hop to the experts' rank")
                pairs.add((f.src, f.dst))
            continue
        if s.verb == "permute" and all(f.src == f.dst for f in s.flows):
            continue
        return f"step '{s.name}' (line {s.line}) is a {s.verb} over {s.link_kind or 'no link'}: not one hop"
    want = {(a, b) for a in range(R) for b in range(R) if a != b}
    if not want:
        return "one rank: no step sends, and the direct kernels are built around the push to the other ranks"
    if pairs != want:
        missing = sorted(want - pairs)[:3]
        return f"the send steps do not join every pair of ranks (missing e.g. {missing})"
    for s in program_steps(plan, "combine"):
        if s.reverse_of is None:
            return f"combine step '{s.name}' (line {s.line}) is not the reverse of a dispatch step"
    rows = max(min(wl.topk, wl.experts // R), R)  # most rows a combine warp reduces at once
    if 2 * rows > COMBINE_RING:
        return (f"a token can have {rows} rows to reduce on one rank: the combine's ring of {COMBINE_RING} vectors "
                f"per lane double-buffers at most {COMBINE_RING // 2}")
    return None


def default_config(plan: Plan) -> DirectConfig:
    """From the plan: the push step's SM budget (DEFAULT_SMS when it gives none), every block
    sending first and then replicating (dispatch), reducing records first and then summing
    partials (combine): no dedicated replicators or reducers.  `epcc tune` also tries dedicated ones."""
    push = next((s for s in program_steps(plan, "dispatch") if s.verb == "send"), None)
    sms = max(1, push.sms if push and push.sms else DEFAULT_SMS)
    return DirectConfig(send_blocks=sms, recv_blocks=0, warps=MAX_WARPS, combine_send_blocks=sms,
                        combine_reduce_blocks=0)


def dispatch_launches(tokens: int, warps: int) -> int:
    """Kernel launches of one dispatch of `tokens` tokens (epcc_direct_dispatch in
    backends/cuda/include/epcc/direct/host.cuh): the dispatch kernel counts the metadata itself up to one metadata
    chunk when its blocks have the threads for it (meta_in_dispatch); otherwise meta_count_kernel
    runs first, and meta_finish_kernel after it when there is more than one chunk."""
    if tokens <= META_CHUNK and warps * 32 >= META_THREADS:
        return 1
    chunks = max(1, -(-tokens // META_CHUNK))
    return 2 if chunks == 1 else 3


def meta_passes(tokens: int) -> int:
    """Metadata passes before a dispatch's rows move: one counts a chunk of META_CHUNK tokens (each
    chunk in parallel), a second finishes the ranks when there is more than one chunk."""
    return 1 if tokens <= META_CHUNK else 2


def direct_kernels(plan: Plan) -> tuple[DirectKernels | None, str | None]:
    """(the direct kernels of `plan`, None) when the CUDA target lowers the plan to them, else
    (None, why not).  Their configuration is default_config's (every block sends, then
    replicates; reduces, then sums)."""
    why = match(plan)
    if why is not None:
        return None, why
    cfg = default_config(plan)
    cfg.check()
    progs = {s.program for s in plan.steps}
    sms = {"dispatch": cfg.dispatch_sms, "combine": cfg.combine_sms}
    launches = {"dispatch": dispatch_launches(plan.workload.tokens, cfg.warps), "combine": 1}
    passes = {"dispatch": meta_passes(plan.workload.tokens)}
    warps = {"dispatch": cfg.warps, "combine": COMBINE_THREADS // 32}
    return DirectKernels({p: n for p, n in sms.items() if p in progs},
                         {p: n for p, n in launches.items() if p in progs},
                         {p: n for p, n in passes.items() if p in progs},
                         {p: n for p, n in warps.items() if p in progs}), None
