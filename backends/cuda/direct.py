"""The direct lowering: one-hop plans inside one CUDA IPC domain as fused, warp-specialized kernels.

Which plans are direct (the one-hop shape: DeepEP's intranode h200x4.sched) and their launch
configuration are decided with the plan (epcc/plan/direct.py, recorded by kernel-formation in
`Plan.direct`).  For those plans this module replaces the general table-driven kernels
(codegen.py) with kernels written for the shape (include/epcc/direct/):

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

The kernels are static CUDA: device headers under include/epcc/direct/ (common.cuh: State, Args,
waits, memory operations, timers, the error record; meta.cuh: the metadata kernels; rows.cuh:
work items and warp row copies; dispatch.cuh; combine.cuh; host.cuh: the extern "C" entry
points), compiled with a generated config header `epcc_direct_config.cuh` (the plan's
constants, the peer region's offsets, the ring slots, the waits and the steps they belong to)
and a generated `<schedule>_direct.cu` that includes both.  Every code-generation decision
(sizes, offsets, ring depths) is made here; the templates lay out text.  A bundle carries the
static headers beside the generated files (`headers` in the manifest entry), so a GPU machine
without the compiler builds it; the runtime (runtime/engines/cuda_direct) needs only those files
and the manifest entry.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from epcc.plan import Plan, PlanStep
from epcc.plan.direct import (COMBINE_RING, COMBINE_THREADS, DISPATCH_THREADS, FP8_GROUP, MAX_CHANNELS, MAX_WARPS,
                              META_CHUNK, META_SHARED, META_THREADS, DirectError, default_config, program_steps)

ABI = 2
ALIGN_MAX = 128  # largest per-expert row alignment a caller may ask for (grouped-GEMM padding)
PUBLISH_EVERY = 4  # tokens a sender warp copies between two releases of its tails
COMBINE_BATCH = 4  # records an expert-side warp reduces between two releases of its queue's progress
MAX_SMEM = 227 * 1024  # dynamic shared memory one block may have (sm_90)
TIMELINE_BLOCKS = 256  # blocks per kernel with a slot in the role timeline
TIMELINE_WORDS = 1 + MAX_WARPS  # a block's start, then the end of each warp's role
SENDER_INTS = 2  # what a sender publishes of its dispatch beside its counts: its channels, its expert alignment

#: the static device headers, relative to INCLUDE_DIR and to a bundle's cuda/, in include order
INCLUDE_DIR = Path(__file__).resolve().parent / "include"
HEADERS = tuple(f"epcc/direct/{n}" for n in ("common.cuh", "meta.cuh", "rows.cuh", "dispatch.cuh", "combine.cuh",
                                             "host.cuh"))
#: the token-major kernels' header, carried (and included by host.cuh) only by token-major bundles
TOKEN_HEADERS = ("epcc/direct/token.cuh",)
ENTRY_HEADER = "epcc/direct/host.cuh"  # what the generated source includes after its config
#: the generated config header: one name in every bundle, like the table-driven kernels' header (a
#: plan.json may hold any schedule name; the name of an #include must not depend on it)
CONFIG_FILE = "epcc_direct_config.cuh"

#: the parts of the kernels and the plan step each lowers (ROLES keys), in the config's list
PARTS = [
    ("META_STEP", "meta.cuh: meta_count_kernel, meta_finish_kernel (or dispatch_kernel's block 0), meta_publish"),
    ("PUSH_STEP", "dispatch.cuh: dispatch_kernel's senders (dispatch_channel) and replicators (dispatch_replicate)"),
    ("KEEP_STEP", "dispatch.cuh: dispatch_channel's rows on the sender's own rank"),
    ("COMBINE_PUSH_STEP", "combine.cuh: combine_kernel's expert side (combine_partials)"),
    ("COMBINE_KEEP_STEP", "combine.cuh: combine_kernel's home side (combine_sums)"),
]

#: PARTS of the token-major kernels (token.cuh)
TOKEN_PARTS = [
    ("META_STEP", "meta.cuh: meta_count_kernel, meta_finish_kernel (or tok_dispatch_kernel's block 0), meta_publish"),
    ("PUSH_STEP", "token.cuh: tok_dispatch_kernel's senders (tok_channel): each token once per destination GPU"),
    ("KEEP_STEP", "token.cuh: tok_channel's row on the sender's own rank"),
    ("COMBINE_PUSH_STEP", "token.cuh: tok_combine_kernel's expert side (tok_partials): rows to their home's staging"),
    ("COMBINE_KEEP_STEP", "token.cuh: tok_combine_kernel's home side (tok_sums): unweighted sums"),
]

#: the bounded waits (ErrorRecord::where = index + 1): key, the runtime's text, the step whose data it waits for
WAITS = [
    ("META", "dispatch: metadata flag of rank a", "META_STEP"),
    ("RECV_TAIL", "dispatch receiver: records of rank a, channel b", "PUSH_STEP"),
    ("COMBINE_TAIL", "combine: partials from rank a, channel b", "COMBINE_PUSH_STEP"),
]


def ring_stages(nmax: int, ring: int = COMBINE_RING) -> list[int]:
    """S(N) for N = 1..nmax rows: the ring slots of a reduction of N rows, each slot N vectors per
    lane; S - 1 steps in flight, S x N <= ring, at least 2 (one being summed, one coming)."""
    if ring < 2 * nmax:
        raise DirectError(f"a combine ring of {ring} vectors per lane cannot double-buffer {nmax} rows")
    return [ring // n for n in range(1, nmax + 1)]


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
    token = token_major(plan)
    # receive rows: token-major one per (source rank, token), expert-major one per (token, local
    # expert) and the experts' alignment padding
    cap = R * T if token else R * T * kl + epr * (ALIGN_MAX - 1)
    offs: list[tuple[str, int]] = []
    cur = 0

    def put(name: str, nbytes: int, align: int = 4096) -> None:
        nonlocal cur
        cur = _round(cur, align)
        offs.append((name, cur))
        cur += nbytes

    # a meta area (one per parity): per sender its flag, its counts per expert, its channel ranges
    # per channel, and its shape (SENDER_INTS: channels, expert alignment), which the receivers'
    # loops over that sender's channels and layout follow (ranks may pass different T, hence C)
    meta_flags = 0
    meta_counts = _round(R * 8, 256)
    meta_channels = meta_counts + _round(R * E * 4, 256)
    meta_senders = meta_channels + _round(R * MAX_CHANNELS * 2 * 4, 256)
    # then the tokens per (sender, destination) [R][R] (epcc/direct/common.cuh META_TOKENS)
    meta_stride = _round(meta_senders + R * SENDER_INTS * 4 + R * R * 4, 4096)
    put("OFF_STATE", 256 + 8 * (epr + 1))
    put("OFF_META", 2 * meta_stride)
    put("OFF_DTAIL", R * MAX_CHANNELS * 8)
    put("OFF_CTAIL", R * MAX_CHANNELS * 8)
    put("OFF_RANK_TJ", T * K * 4)
    put("OFF_DEDUP", T * R * 4)
    put("OFF_MYCHAN", (MAX_CHANNELS + 1) * R * 4)
    put("OFF_CHUNKS", -(-T // META_CHUNK) * (E + R + 1) * 4)
    put("OFF_RECORDS", 0 if token else R * T * ri * 4)  # token-major rows need no records
    put("OFF_RECV_W", cap * (K if token else 1) * 4)  # token-major: recv_topk_weights [rows][K]
    if token:
        put("OFF_RECV_IDX", cap * K * 8)  # recv_topk_idx [rows][K] int64: local expert ids, -1 elsewhere
        put("OFF_ROW_TOKEN", cap * 4)  # each row's token on its source rank (the combine sends it there)
    put("OFF_RECV_X", cap * xb)
    put("OFF_RECV_S", cap * sb)
    put("OFF_CSTAGE", R * T * H * 2)
    end = _round(cur, 4096)
    offsets = offs + [("META_STRIDE", meta_stride), ("META_FLAGS", meta_flags), ("META_COUNTS", meta_counts),
                      ("META_CHANNELS", meta_channels), ("META_SENDERS", meta_senders), ("OFF_END", end)]
    layout = {"layout": "token"} if token else {}  # expert-major bundles' constants read as before
    return {
        **layout, "abi": ABI, "num_ranks": R, "experts": E, "experts_per_rank": epr, "topk": K, "max_local": kl,
        "hidden": H, "max_tokens": T, "max_channels": MAX_CHANNELS, "record_ints": ri, "x_bytes": xb,
        "scale_bytes": sb, "publish_every": PUBLISH_EVERY, "max_warps": MAX_WARPS,
        "dispatch_threads": DISPATCH_THREADS, "combine_threads": COMBINE_THREADS, "capacity": cap,
        "placement": wl.placement, "dtype": wl.dtype, "align_max": ALIGN_MAX,
        "meta_chunk": META_CHUNK, "meta_threads": META_THREADS, "meta_shared": META_SHARED,
        "combine_batch": COMBINE_BATCH,
        "timeline_blocks": TIMELINE_BLOCKS, "timeline_words": TIMELINE_WORDS, "sender_ints": SENDER_INTS,
        "combine_ring": COMBINE_RING, "max_smem": MAX_SMEM, "expert_stages": ring_stages(kl),
        "home_stages": ring_stages(R),
        "offsets": offsets, "region_bytes": end,
    }


def token_major(plan: Plan) -> bool:
    """The plan dispatches token-major (the workload's `layout token`): DeepEP's intranode output."""
    return getattr(plan.workload, "layout", "expert") == "token"


def headers_of(plan: Plan) -> tuple[str, ...]:
    """The static headers a bundle of `plan` carries, in include order (token.cuh for token-major)."""
    return HEADERS + (TOKEN_HEADERS if token_major(plan) else ())


#: what each kind of step lowers to, per output layout (describe_steps)
_LOWERED = {
    "expert": {
        "exchange": (f"meta_count_kernel (+ meta_finish_kernel above one chunk; up to {META_CHUNK} tokens "
                     "dispatch_kernel's block 0): counts and ranks on the GPU, exchanged through peer memory"),
        "send": "dispatch_kernel: warps send (one row store per destination GPU), then replicate received rows",
        "local": "dispatch_kernel senders with this rank as destination (local permute)",
        "p2p": "combine_kernel: weighted partial per (token, GPU) into the home GPU's staging (first)",
        "home": "combine_kernel: home-side sum of the partials (own partial included; every warp, after its partials)",
    },
    "token": {  # include/epcc/direct/token.cuh
        "exchange": ("meta_count_kernel (+ meta_finish_kernel above one chunk): counts, tokens per destination and "
                     "dedup ranks on the GPU, exchanged through peer memory (none for a cached handle)"),
        "send": "tok_dispatch_kernel: warps store each token once per destination GPU, in (source rank, token) order",
        "local": "tok_dispatch_kernel senders with this rank as destination (its own token-major rows)",
        "p2p": "tok_combine_kernel: each received row copied into its home GPU's staging (first)",
        "home": "tok_combine_kernel: home-side unweighted sum of a token's rows (its own read in place)",
    },
}


def describe_steps(plan: Plan) -> list[dict]:
    """Each step of the plan with what the direct kernels of its layout lower it to."""
    lowered = _LOWERED["token" if token_major(plan) else "expert"]
    out = []
    for s in plan.steps:
        kind = ("exchange" if s.verb == "exchange"
                else ("send" if s.verb == "send" else "local") if s.program == "dispatch"
                else "p2p" if s.link_kind == "p2p" else "home")
        out.append({"program": s.program, "name": s.name, "line": s.line, "title": s.title, "lowered": lowered[kind]})
    return out


def config_decls(c: dict) -> list[tuple[str, str]]:
    """The config header's declarations, (C++ declaration, what it is), from constants()."""
    ints = [
        ("ABI", "abi", "the host API's version (the manifest's direct.abi)"),
        ("R", "num_ranks", "ranks (GPUs), one IPC domain"),
        ("E", "experts", "experts"),
        ("EPR", "experts_per_rank", "experts per rank"),
        ("K", "topk", "top-k"),
        ("KL", "max_local", "most rows one token can have on one rank: min(K, EPR)"),
        ("H", "hidden", "hidden size"),
        ("TMAX", "max_tokens", "tokens per rank (capacity)"),
        ("ALIGN_MAX", "align_max", "largest expert alignment a dispatch may ask for"),
        ("CMAX", "max_channels", "most sender channels"),
        ("RI", "record_ints", "ints per record: token, n, rows[KL], padding"),
        ("XB", "x_bytes", f"payload bytes per row ({c['dtype']})"),
        ("SB", "scale_bytes", "fp32 scale bytes per row (fp8: one per 128 channels)"),
        ("PUB", "publish_every", "a sender warp publishes its tails every PUB tokens"),
        ("DTHREADS", "dispatch_threads", "threads per dispatch block, at most"),
        ("CTHREADS", "combine_threads", "threads per combine block"),
        ("MTHREADS", "meta_threads", "metadata block: one token per thread"),
        ("MC", "meta_chunk", "tokens per metadata chunk: 32 per warp"),
        ("META_SHARED", "meta_shared", "a metadata block's static shared memory (meta_shared_bytes)"),
        ("CB", "combine_batch", "records a warp reduces between two releases of its queue's progress"),
        ("RING", "combine_ring", "16-byte vectors per lane in a combine warp's shared-memory ring"),
        ("MAX_SMEM", "max_smem", "dynamic shared memory one block may have"),
        ("TL_BLOCKS", "timeline_blocks", "blocks per kernel that stamp the role timeline"),
        ("TL_WORDS", "timeline_words", "a block's start, then the end of each of (at most) 16 warps"),
        ("SENDER_INTS", "sender_ints", "ints a sender publishes beside its counts: channels, expert alignment"),
    ]
    out = [(f"constexpr int {name} = {c[key]};", what) for name, key, what in ints]
    out.append((f"constexpr bool BLOCKED = {'true' if c['placement'] == 'blocked' else 'false'};",
                f"expert placement: {c['placement']}"))
    out.append((f"constexpr bool FP8 = {'true' if c['dtype'] == 'fp8' else 'false'};", f"dispatch dtype: {c['dtype']}"))
    for name, side, n in (("EXPERT_STAGES", "expert_stages", "KL"), ("HOME_STAGES", "home_stages", "R")):
        out.append((f"constexpr int {name}[{n}] = {{{', '.join(map(str, c[side]))}}};",
                    f"ring slots S(n) of a reduction of n = 1..{n} rows ({side.split('_')[0]} side)"))
    return out


def step_roles(plan: Plan) -> dict[str, PlanStep | None]:
    """The plan step each part of the kernels lowers (PARTS): the metadata exchange (the push step
    where the plan has none), the push and its local permute, the combine's push and its home sum."""
    disp, comb = program_steps(plan, "dispatch"), program_steps(plan, "combine")
    meta = next((s for s in disp if s.verb == "exchange"), None)
    push = next(s for s in disp if s.verb == "send")
    keep = next((s for s in disp if s.verb == "permute"), None)
    cpush = next((s for s in comb if s.link_kind == "p2p"), comb[0] if comb else push)
    ckeep = next((s for s in comb if s is not cpush), None)
    return {"META_STEP": meta or push, "PUSH_STEP": push, "KEEP_STEP": keep, "COMBINE_PUSH_STEP": cpush,
            "COMBINE_KEEP_STEP": ckeep}


def _cite(step: PlanStep | None, source: str) -> str:
    if step is None:
        return "no step of the plan"
    return f"{step.program} step '{step.name}' ({source}:{step.line})"


def generate(plan: Plan, source: str, env, version: str) -> tuple[dict[str, str], dict]:
    """({file name: text} of the generated files, the manifest's `direct` entry); DirectError when
    the plan is not direct (kernel-formation recorded why not in `Plan.direct_not_used`).  The
    static headers (HEADERS, under INCLUDE_DIR) go into the bundle beside them, unchanged; the
    entry's `headers` lists every header the source includes, relative to the bundle's cuda/."""
    if plan.direct is None:
        raise DirectError(plan.direct_not_used or "the plan does not record its direct kernels (recompile it)")
    c = constants(plan)
    roles = step_roles(plan)
    cites = {k: _cite(s, source) for k, s in roles.items()}
    steps = describe_steps(plan)
    file = f"{plan.schedule}_direct.cu"
    common = dict(schedule=plan.schedule, source=source, version=version, config_file=CONFIG_FILE)
    headers = headers_of(plan)
    files = {
        CONFIG_FILE: env.get_template("direct_config.cuh.j2").render(
            **common, decls=config_decls(c), offsets=c["offsets"], token_major=token_major(plan),
            roles=[{"key": k, "cite": cites[k], "part": part}
                   for k, part in (TOKEN_PARTS if token_major(plan) else PARTS)],
            waits=[{"key": k, "text": text, "cite": cites[part]} for k, text, part in WAITS]),
        file: env.get_template("direct.cu.j2").render(**common, steps=steps, headers=headers,
                                                      entry_header=ENTRY_HEADER),
    }
    cfg = default_config(plan)
    entry = {
        "abi": ABI,
        "source": file,
        "headers": [CONFIG_FILE, *headers],
        "library": f"lib{plan.schedule}_direct.so",
        "constants": {**{k: v for k, v in c.items() if k != "offsets"}, "offsets_named": dict(c["offsets"])},
        "waits": [text for _, text, _ in WAITS],
        "config": asdict(cfg),
        "steps": steps,
    }
    return files, entry
