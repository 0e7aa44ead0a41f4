"""The direct lowering: one-hop plans inside one CUDA IPC domain as fused, warp-specialized kernels.

A plan is *direct* when its dispatch is (an optional metadata exchange plus) send steps whose
flows go straight from every rank to every other rank, each carrying the tokens whose experts
live at the destination (`select == [dst]`), over peer links, plus a local permute for a rank's
own experts; its combine is the reverse.  That is DeepEP's intranode shape (h200x4.sched).  For
those plans this module replaces the general table-driven kernels (codegen.py) with kernels
written for the shape (templates/direct.cu.j2):

* the metadata step runs on the GPU (meta_count_kernel, and meta_finish_kernel when there is more than
  one chunk of META_CHUNK tokens; up to one chunk, decode, the dispatch kernel's block 0 does it,
  so a decode dispatch is one launch): per-expert ranks and counts, per-destination dedup
  indices, exchanged through peer memory with one release flag per peer: no host sync;
* dispatch sends each token once per destination GPU (deduplicated: 2.7 of 8 rows per token on
  the wire for top-8 of 256 over 4 GPUs), warp loads and 16-byte stores into the destination's
  expert-major output at the token's first row there (bench/sm_probe.cu measured bulk copies
  slower per SM); on the destination, every warp that has no channel left to send replicates it
  into its other rows as per-channel tails advance;
* combine reduces each (token, GPU) record into one weighted bf16 partial on the expert's GPU and
  stores it into the home GPU's staging area, where the home GPU sums the partials in fp32 (every
  warp, once no record is left to reduce); both read rows through a per-warp shared-memory ring
  of cp.async loads (COMBINE_RING vectors per lane), so an SM keeps 192 KB of rows in flight
  without spending registers on them.

Blocks have no fixed role: one SM writes ~46-50 GB/s whatever it writes (sm_probe), so a fixed
sender/receiver split (14+10 was the best of 24 SMs on 2 GPUs) leaves SMs idle while the other
side finishes; a warp goes from sending to replicating (from partials to sums) when its first
kind of work runs out.

Every decision (sizes, offsets, block split, ring depths) is made here; the template lays out
text.  The runtime (direct_runtime.py) needs only the generated source and the manifest entry.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from epcc.plan import Plan, PlanStep

ABI = 2
ALIGN_MAX = 128  # largest per-expert row alignment a caller may ask for (grouped-GEMM padding)
MAX_CHANNELS = 1024  # dispatch channels (contiguous token ranges) the peer region has tails for
PUBLISH_EVERY = 4  # tokens a sender warp copies between two releases of its tails
COMBINE_BATCH = 4  # records an expert-side warp reduces between two releases of its queue's progress
CHANNELS_PER_WARP = 4  # dispatch channels per sender warp (taken in order: uneven ones even out)
DISPATCH_THREADS = 512  # at most 16 warps per dispatch block (the configuration's `warps`)
COMBINE_THREADS = 512
# combine: 16-byte vectors per lane in a warp's shared-memory ring of cp.async loads (direct.cu.j2,
# reduce_rows).  The loads in flight hold no registers: one SM keeps 16 warps x 32 lanes x RING x
# 16 B = 192 KB of rows coming.  With loads into registers (at most ~8 vectors per lane before
# 128 registers spilled, 4 for a 4-row record) the combine read ~64 GB/s per SM against the ~170
# an SM reads (bench/README, "Session 13").
COMBINE_RING = 24
MAX_SMEM = 227 * 1024  # dynamic shared memory one block may have (sm_90)


def ring_stages(nmax: int, ring: int = COMBINE_RING) -> list[int]:
    """S(N) for N = 1..nmax rows: the ring slots of a reduction of N rows, each slot N vectors per
    lane; S - 1 steps in flight, S x N <= ring, at least 2 (one being summed, one coming)."""
    if ring < 2 * nmax:
        raise DirectError(f"a combine ring of {ring} vectors per lane cannot double-buffer {nmax} rows")
    return [ring // n for n in range(1, nmax + 1)]


MAX_WARPS = DISPATCH_THREADS // 32
TIMELINE_BLOCKS = 256  # blocks per kernel with a slot in the role timeline
TIMELINE_WORDS = 1 + MAX_WARPS  # a block's start, then the end of each warp's role
MAX_IPC_RANKS = 8
META_THREADS = 256  # threads per metadata block, one token each: META_CHUNK tokens per block
META_CHUNK = META_THREADS
META_SHARED = 48 * 1024  # a block's static shared memory, which meta_count_kernel's masks must fit


def meta_shared_bytes(experts: int, ranks: int) -> int:
    """meta_count_kernel's shared memory: a mask per (warp, expert or rank) and a count per expert or
    rank, (warps + 1) x (E + R) ints, plus a few scalars (direct.cu.j2 asserts the same)."""
    return (META_THREADS // 32 + 1) * (experts + ranks) * 4 + 64
FP8_GROUP = 128

WAITS = [
    ("META", "dispatch: metadata flag of rank a"),
    ("RECV_TAIL", "dispatch receiver: records of rank a, channel b"),
    ("COMBINE_TAIL", "combine: partials from rank a, channel b"),
]


class DirectError(ValueError):
    """The plan does not have the direct shape (the reason says why)."""


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
        replicating warp a queue per peer: at 128 tokens most of 1024 would be empty)."""
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


def _steps(plan: Plan, program: str) -> list[PlanStep]:
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
    for s in _steps(plan, "dispatch"):
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
    if pairs != want:
        missing = sorted(want - pairs)[:3]
        return f"the send steps do not join every pair of ranks (missing e.g. {missing})"
    for s in _steps(plan, "combine"):
        if s.reverse_of is None:
            return f"combine step '{s.name}' (line {s.line}) is not the reverse of a dispatch step"
    rows = max(min(wl.topk, wl.experts // R), R)  # most rows a combine warp reduces at once
    if 2 * rows > COMBINE_RING:
        return (f"a token can have {rows} rows to reduce on one rank: the combine's ring of {COMBINE_RING} vectors "
                f"per lane double-buffers at most {COMBINE_RING // 2}")
    return None


def default_config(plan: Plan) -> DirectConfig:
    """From the plan: the push step's SM budget (24 when it gives none), every block sending
    first and then replicating (dispatch), reducing records first and then summing partials
    (combine): no dedicated replicators or reducers.  `epcc tune` also tries dedicated ones."""
    push = next((s for s in _steps(plan, "dispatch") if s.verb == "send"), None)
    sms = max(1, push.sms if push and push.sms else 24)
    return DirectConfig(send_blocks=sms, recv_blocks=0, warps=MAX_WARPS, combine_send_blocks=sms,
                        combine_reduce_blocks=0)


def row_parts(plan: Plan) -> tuple[int, int]:
    """(payload bytes, scale bytes) of one dispatched row."""
    wl = plan.workload
    if wl.dtype == "fp8":
        return wl.hidden, wl.hidden // FP8_GROUP * 4
    return 2 * wl.hidden, 0


def _round(n: int, a: int) -> int:
    return -(-n // a) * a


def constants(plan: Plan) -> dict:
    """Everything the template needs, offsets of the peer region included."""
    wl = plan.workload
    R, E, K, H, T = plan.num_ranks, wl.experts, wl.topk, wl.hidden, wl.tokens
    epr = E // R
    kl = min(K, epr)
    ri = _round(2 + kl, 4)
    xb, sb = row_parts(plan)
    cap = R * T * kl + epr * (ALIGN_MAX - 1)
    offs: list[tuple[str, int]] = []
    cur = 0

    def put(name: str, nbytes: int, align: int = 4096) -> None:
        nonlocal cur
        cur = _round(cur, align)
        offs.append((name, cur))
        cur += nbytes

    meta_flags = 0
    meta_counts = _round(R * 8, 256)
    meta_channels = meta_counts + _round(R * E * 4, 256)
    meta_stride = _round(meta_channels + R * MAX_CHANNELS * 2 * 4, 4096)
    put("OFF_STATE", 256 + 8 * (epr + 1))
    put("OFF_META", 2 * meta_stride)
    put("OFF_DTAIL", R * MAX_CHANNELS * 8)
    put("OFF_CTAIL", R * MAX_CHANNELS * 8)
    put("OFF_RANK_TJ", T * K * 4)
    put("OFF_DEDUP", T * R * 4)
    put("OFF_MYCHAN", (MAX_CHANNELS + 1) * R * 4)
    put("OFF_CHUNKS", -(-T // META_CHUNK) * (E + R + 1) * 4)
    put("OFF_RECORDS", R * T * ri * 4)
    put("OFF_RECV_W", cap * 4)
    put("OFF_RECV_X", cap * xb)
    put("OFF_RECV_S", cap * sb)
    put("OFF_CSTAGE", R * T * H * 2)
    end = _round(cur, 4096)
    offsets = offs + [("META_STRIDE", meta_stride), ("META_FLAGS", meta_flags), ("META_COUNTS", meta_counts),
                      ("META_CHANNELS", meta_channels), ("OFF_END", end)]
    return {
        "abi": ABI, "num_ranks": R, "experts": E, "experts_per_rank": epr, "topk": K, "max_local": kl,
        "hidden": H, "max_tokens": T, "max_channels": MAX_CHANNELS, "record_ints": ri, "x_bytes": xb,
        "scale_bytes": sb, "publish_every": PUBLISH_EVERY, "max_warps": MAX_WARPS,
        "dispatch_threads": DISPATCH_THREADS, "combine_threads": COMBINE_THREADS, "capacity": cap,
        "placement": wl.placement, "dtype": wl.dtype, "align_max": ALIGN_MAX,
        "meta_chunk": META_CHUNK, "meta_threads": META_THREADS, "meta_shared": META_SHARED,
        "combine_batch": COMBINE_BATCH,
        "timeline_blocks": TIMELINE_BLOCKS, "timeline_words": TIMELINE_WORDS,
        "combine_ring": COMBINE_RING, "max_smem": MAX_SMEM, "expert_stages": ring_stages(kl), "home_stages": ring_stages(R),
        "offsets": offsets, "region_bytes": end,
        "waits": [{"key": k, "text": t} for k, t in WAITS],
    }


def describe_steps(plan: Plan) -> list[dict]:
    out = []
    for s in plan.steps:
        if s.verb == "exchange":
            low = (f"meta_count_kernel (+ meta_finish_kernel above one chunk; up to {META_CHUNK} tokens dispatch_kernel's "
                   "block 0): counts and ranks on the GPU, exchanged through peer memory")
        elif s.program == "dispatch" and s.verb == "send":
            low = "dispatch_kernel: warps send (one row store per destination GPU), then replicate received rows"
        elif s.program == "dispatch":
            low = "dispatch_kernel senders with this rank as destination (local permute)"
        elif s.link_kind == "p2p":
            low = "combine_kernel: weighted partial per (token, GPU) into the home GPU's staging (first)"
        else:
            low = "combine_kernel: home-side sum of the partials (own partial included; every warp, after its partials)"
        out.append({"program": s.program, "name": s.name, "line": s.line, "title": s.title, "lowered": low})
    return out


def generate(plan: Plan, source: str, env, version: str) -> tuple[str, dict]:
    """(the .cu text, the manifest's `direct` entry); DirectError when the plan is not direct."""
    why = match(plan)
    if why:
        raise DirectError(why)
    c = constants(plan)
    disp, comb = _steps(plan, "dispatch"), _steps(plan, "combine")
    meta = next((s for s in disp if s.verb == "exchange"), None)
    push = next(s for s in disp if s.verb == "send")
    keep = next((s for s in disp if s.verb == "permute"), None)
    cpush = next((s for s in comb if s.link_kind == "p2p"), comb[0] if comb else push)
    ckeep = next((s for s in comb if s is not cpush), None)
    steps = describe_steps(plan)
    text = env.get_template("direct.cu.j2").render(
        schedule=plan.schedule, source=source, version=version, c=c, steps=steps,
        meta_step=meta or push, push_step=push, keep_step=keep, combine_push=cpush, combine_keep=ckeep)
    cfg = default_config(plan)
    file = f"{plan.schedule}_direct.cu"
    entry = {
        "abi": ABI,
        "source": file,
        "library": f"lib{plan.schedule}_direct.so",
        "constants": {**{k: v for k, v in c.items() if k not in ("offsets", "waits")},
                      "offsets_named": dict(c["offsets"])},
        "waits": [t for _, t in WAITS],
        "config": asdict(cfg),
        "steps": steps,
    }
    return text, entry
