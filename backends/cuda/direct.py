"""The direct lowering: one-hop plans inside one CUDA IPC domain as TMA-driven fused kernels.

A plan is *direct* when its dispatch is (an optional metadata exchange plus) send steps whose
flows go straight from every rank to every other rank, each carrying the tokens whose experts
live at the destination (`select == [dst]`), over peer links, plus a local permute for a rank's
own experts; its combine is the reverse.  That is DeepEP's intranode shape (h200x4.sched).  For
those plans this module replaces the general table-driven kernels (codegen.py) with kernels
written for the shape (templates/direct.cu.j2):

* the metadata step runs on the GPU (meta_kernel): per-expert ranks and counts, per-destination
  dedup indices, exchanged through peer memory with one release flag per peer: no host sync;
* dispatch sends each token once per destination GPU (deduplicated: 2.7 of 8 rows per token on
  the wire for top-8 of 256 over 4 GPUs), TMA load into a shared-memory ring and TMA store into
  the destination's expert-major output at the token's first row there; the destination's
  receiver blocks replicate it into its other rows as per-channel tails advance;
* combine reduces each (token, GPU) record into one weighted bf16 partial on the expert's GPU and
  stores it into the home GPU's staging area, where the home GPU sums the partials in fp32.

Every decision (sizes, offsets, block split, ring depths) is made here; the template lays out
text.  The runtime (direct_runtime.py) needs only the generated source and the manifest entry.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from epcc.plan import Plan, PlanStep

ABI = 1
ALIGN_MAX = 128  # largest per-expert row alignment a caller may ask for (grouped-GEMM padding)
MAX_CHANNELS = 128
DESC_RING = 64
ALLOW_PENDING = 16  # bulk-store groups (tokens) left in flight when a sender publishes its tails
PUBLISH_EVERY = 32
READ_ALLOW = 4  # bulk-store groups that may still be reading their stage (the ring needs more stages)
COMBINE_BATCH = 4
MAX_QUEUES = 128  # (source, channel) queues one receiver block polls
DISPATCH_THREADS = 128  # 4 warps: driver, 3 feeders (senders) / driver, feeder (receivers)
COMBINE_THREADS = 512
SMEM_BUDGET = 200 * 1024  # dynamic shared memory for stages (of 227 KB per block on sm_90)
MAX_IPC_RANKS = 8
FP8_GROUP = 128

WAITS = [
    ("META", "dispatch: metadata flag of rank a"),
    ("SEND_STAGE", "dispatch sender: a token row to land in shared memory"),
    ("SEND_DESC", "dispatch sender: the feeders' descriptor of a token (channel a)"),
    ("SEND_RING", "dispatch sender feeder: room in the descriptor ring (channel a)"),
    ("RECV_TAIL", "dispatch receiver: records of rank a, channel b"),
    ("RECV_RING", "dispatch receiver feeder: room in the descriptor ring (queue a)"),
    ("RECV_DESC", "dispatch receiver: the next replication descriptor"),
    ("RECV_STAGE", "dispatch receiver: a row to land in shared memory"),
    ("COMBINE_TAIL", "combine: partials from rank a, channel b"),
]


class DirectError(ValueError):
    """The plan does not have the direct shape (the reason says why)."""


@dataclass
class DirectConfig:
    """Launch configuration: what `epcc tune` sweeps.  Blocks are one per SM."""

    send_blocks: int  # dispatch channels (sender blocks)
    recv_blocks: int  # dispatch receiver (replication) blocks
    stages: int  # shared-memory ring stages per dispatch block
    combine_send_blocks: int
    combine_reduce_blocks: int

    @property
    def dispatch_sms(self) -> int:
        return self.send_blocks + self.recv_blocks

    @property
    def combine_sms(self) -> int:
        return self.combine_send_blocks + self.combine_reduce_blocks

    def check(self, max_stages: int) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise DirectError(f"config: {f.name} must be a positive integer, got {v!r}")
        if self.send_blocks > MAX_CHANNELS:
            raise DirectError(f"config: send_blocks is {self.send_blocks}, at most {MAX_CHANNELS}")
        if not READ_ALLOW + 1 <= self.stages <= max_stages:
            raise DirectError(f"config: stages must lie in [{READ_ALLOW + 1}, {max_stages}], got {self.stages}")

    def check_ranks(self, num_ranks: int) -> None:
        if -(-num_ranks * self.send_blocks // self.recv_blocks) > MAX_QUEUES:
            raise DirectError(f"config: {self.recv_blocks} recv_blocks for {num_ranks} x {self.send_blocks} queues: "
                              f"at most {MAX_QUEUES} queues per receiver block")

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
    return None


def default_config(plan: Plan) -> DirectConfig:
    """From the plan: the push step's SM budget, dispatch split 1:1 between senders and receivers
    (the receivers replicate ~1.2 rows per received token locally: as much work as the sends),
    combine 2:1 between partial senders and home reducers (the senders read ~2.2 rows per
    record).  Both splits are what `epcc tune` found best at 24 SMs on 4x H200; it rewrites them."""
    push = next((s for s in _steps(plan, "dispatch") if s.verb == "send"), None)
    sms = max(2, push.sms if push and push.sms else 24)
    csend = max(1, (2 * sms + 2) // 3)
    stages = min(8, max_stages(plan))
    return DirectConfig(send_blocks=sms - sms // 2, recv_blocks=sms // 2, stages=stages,
                        combine_send_blocks=csend, combine_reduce_blocks=max(1, sms - csend))


def stage_bytes(plan: Plan) -> int:
    x, s = row_parts(plan)
    return -(-(x + s) // 128) * 128


def row_parts(plan: Plan) -> tuple[int, int]:
    wl = plan.workload
    if wl.dtype == "fp8":
        return wl.hidden, wl.hidden // FP8_GROUP * 4
    return 2 * wl.hidden, 0


def max_stages(plan: Plan) -> int:
    return max(READ_ALLOW + 1, min(16, SMEM_BUDGET // stage_bytes(plan)))


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
    meta_chunk = 32 * max(1, 64 // K)  # tokens per metadata block: the lanes hold 64 expert ids
    put("OFF_CHUNKS", -(-T // meta_chunk) * (E + R + 1) * 4)
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
        "scale_bytes": sb, "stage_bytes": stage_bytes(plan), "max_stages": max_stages(plan),
        "desc_ring": DESC_RING, "allow_pending": ALLOW_PENDING, "publish_every": PUBLISH_EVERY,
        "history": ALLOW_PENDING + PUBLISH_EVERY, "feeder_warps": DISPATCH_THREADS // 32 - 1,
        "dispatch_threads": DISPATCH_THREADS, "combine_threads": COMBINE_THREADS, "capacity": cap,
        "placement": wl.placement, "dtype": wl.dtype, "align_max": ALIGN_MAX, "combine_unroll": 4,
        "meta_chunk": meta_chunk, "read_allow": READ_ALLOW, "max_queues": MAX_QUEUES, "combine_batch": COMBINE_BATCH,
        "offsets": offsets, "region_bytes": end,
        "waits": [{"key": k, "text": t} for k, t in WAITS],
    }


def describe_steps(plan: Plan) -> list[dict]:
    out = []
    for s in plan.steps:
        if s.verb == "exchange":
            low = "meta_kernel (counts and ranks on the GPU, exchanged through peer memory)"
        elif s.program == "dispatch" and s.verb == "send":
            low = "dispatch_kernel senders (TMA, one store per destination GPU) + receivers (replication)"
        elif s.program == "dispatch":
            low = "dispatch_kernel senders with this rank as destination (local permute)"
        elif s.link_kind == "p2p":
            low = "combine_kernel: weighted partial per (token, GPU) into the home GPU's staging"
        else:
            low = "combine_kernel: home-side sum of the partials (own partial included)"
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
