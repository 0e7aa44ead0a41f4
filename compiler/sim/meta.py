"""The table-driven kernels' metadata on the GPU in the cost model: the time before a dispatch's
first step.

Where the CUDA target lowers a plan's metadata to the device (docs/cuda.md "Tables written on the
GPU"; the manifest's "metadata" says lowering "device"), the metadata's work runs stream-ordered
before every dispatch kernel, and the dispatch's first steps become ready after it (as the direct
kernels' launches, sim/direct.py).  The manifest's metadata "launches" says how: on CUDA one
cooperative kernel, `meta_fused` (after `gather_copy` with the collective exchange), the phases
with a grid barrier after count and after scan and the items' waits for their copies' rows;
elsewhere (SUPA; a bundle compiled before the launches were recorded) the steps as launches of
their own, `gather_copy`, `meta_count`, `meta_scan`, `meta_rows`, `meta_items`.
`SimOptions.metadata` (a DeviceMetadata: the phases' blocks and the launches, from the manifest)
turns the term on; the plan's metadata steps (`exchange`), whose work the kernels do, then cost
nothing of their own.  The combine has no
metadata: the dispatch's kernels wrote both programs' tables.  Per dispatch, in seconds:

* exchange over CUDA IPC (the manifest's metadata "exchange": "ipc", one box): the routing copy
  writes the rank's top-k (T x K slot words of 8 bytes: expert, fp32 weight, the exchange's tag)
  into every peer's gather area, zeroes a scratch and restores the tables' static fields,
  GATHER_S plus the bytes over the plan's link between ranks (the fastest `p2p` link, else the
  fastest other link between ranks: the 2-vnode plans declare only their RDMA-class link, which
  bounds it from above); a link of
  per-GPU ports carries the rank's copies to all R - 1 peers, a link of GPU pairs one copy per
  pair; the wait for every peer's routing, SIGNAL_S (count polls its tokens' slot words; fitted
  when a flag followed the routing: a round trip and the two ranks' arrival apart as the
  calibration's timed dispatches had it; the model does not know how far apart other ranks
  arrive);
* exchange by the process group's all-gather ("collective": ranks in several boxes):
  `gather_copy` writes the rank's own slot only, GATHER_S; then one ring all-gather of the slot
  words in which every rank receives the R - 1 other slots (T x K x 8 bytes each): the B - 1 of
  its own box over the plan's link inside a box (as above), the R - B of the other boxes over the
  slowest link between boxes (its slowest `rdma` link; a plan without one, its slowest link
  between ranks), B the ranks of the largest box (`boxes`: the ranks the plan's `p2p` and `d2d`
  flows join); plus the all-gather's latency in NCCL's own cost model (ring_latency, Simple);
* `count`, one block per (home rank, 128-token block): PASS_S + waves x COUNT_WAVE_S;
* `scan`, three blocks of offsets and one per 4 of its sums over token blocks (two per token set,
  one per (home rank, expert); not more with the tokens): PASS_S + waves x SCAN_WAVE_S;
* `rows`, one block per (part, 128-token block) and per (home rank, 128-token block):
  PASS_S + waves x ROWS_WAVE_S;
* `items`, one block per copy (at most a wave): PASS_S, where the plan has copies;
* `meta_fused` only: `barriers`, BARRIER_S for each of its two grid barriers (before scan and rows)
  and for the items blocks' wait for their own copies' rows (a grid barrier before items when the
  constants were measured);
* `gaps`: GAP_S per launch (meta_fused: one, two with the collective's gather_copy; the steps:
  five, gather_copy and the four phases, one fewer without copies; the all-gathers' launches are
  in their latency).

waves = ceil(blocks / META_SMS): where a phase has more blocks than the calibration's, each wave
beyond costs what it costs as a launch of its own (in meta_fused the grid's blocks loop over the
phase's blocks).  The constants come from one device call (2 x H100, 2026-11-27, below), which
timed the code's steps as launches of their own and then meta_fused in the same processes: a
pass's floor is the smallest kernel's time (meta_items), each wave of count, scan and rows the
rest of theirs, the gaps the earlier calibration's (2 x H100, 2026-11-26), whose profile timed the flag
wait apart, the signal what the events around the six launches hold beyond the kernels and the
gaps.  meta_fused's phases and exchange are charged as those launches measured them: its one
measured device time includes the exchange and the wait for the peer, so it does not split them;
what its one launch saves beyond the five gaps it does not pay (the events: 76.5 -> 68.2 us, five
gaps 12.3) is what its three grid barriers cost, BARRIER_S each.  The model does not know the GPU:
one set of constants for H100 and H200 (132 SMs both; the code before meta_fused took the same
per-kernel times on both, below).
"""

from __future__ import annotations

import math

from ..plan import Plan
from .base import DeviceMetadata, SimulationError


# Measured 2026-11-27 on 2 x H100 80GB HBM3 (132 SMs, NVLink 450 GB/s per direction), in one device call,
# `torchrun --nproc-per-node 2 bench/meta_time.py BUNDLE --iters 200 --grid 0,default --profile` for
# h200x2_2vnode_50 (2 ranks x 4096 tokens, top-8 of 256 experts; the phases' blocks: count 64, scan 137,
# rows 256, items 6): the steps as launches of their own (grid 0), mean device us per dispatch of each kernel (rank 0,
# a profile of 20 dispatches), and the median of the events around the launches (the most of the two
# ranks, 200 dispatches): STEP_*; then meta_fused at the runtime's grid (256 blocks): FUSED_*.
STEP_MEASURED_US = {"gather_copy": 14.7, "meta_count": 12.4, "meta_scan": 6.8, "meta_rows": 11.4, "meta_items": 3.9}
STEP_WHOLE_US = 76.5  # p10 72.2, p90 84.6; host enqueue 37.1
# The profile's flag wait (gather_signal_wait) holds the peer's lateness under the profiler, more than
# the events leave it: not used.  SIGNAL_S is what the events leave.
STEP_PROFILED_SIGNAL_US = 18.4
FUSED_WHOLE_US = 68.2  # p10 66.3, p90 71.7; host enqueue 12.3
# meta_fused's device time in the profile: the exchange, the wait for the peer and the four phases
# together, so not split into them.  Not used but to check that it lies under the events.
FUSED_DEVICE_US = 56.4
# The earlier calibrations, of the code before meta_fused (its six kernels; since, the scan's tail runs
# as three blocks beside the sums, count adds the totals, and only what is added into is zeroed):
# 2 x H200, 2026-11-27, after meta_rows read meta_count's per-token records: gather_copy 7.9, meta_count
# 13.0, meta_scan 16.5, meta_rows 21.5, meta_items 3.4 us, 108.2 us between the events (the profile's
# flag wait 56.0); the same command on 2 x H100 in the device call above, before meta_fused: gather_copy
# 12.4, meta_count 13.0, meta_scan 16.6, meta_rows 20.0, meta_items 3.7 us, 91.2 us (flag wait 60.8).
# And 2 x H100, 2026-11-26, before the per-token records, whose profile timed the flag wait apart (8.5
# us), so the events' 100.0 us less its six kernels is the six launch gaps alone: GAP_S.
H100_MEASURED_US = {"gather_copy": 8.3, "gather_signal_wait": 8.5, "meta_count": 12.4, "meta_scan": 20.1,
                    "meta_rows": 32.2, "meta_items": 3.7}
H100_WHOLE_US = 100.0
# the calibration's steps over CUDA IPC: gather_copy, gather_signal_wait (a flag wait, since gone),
# meta_count, meta_scan, meta_rows, meta_items
LAUNCHES = 6
STEP_LAUNCHES = 5  # the steps now, either exchange: gather_copy, meta_count, meta_scan, meta_rows, meta_items
BARRIERS = 3  # meta_fused's grid barriers before scan and rows, and the items' waits for their copies' rows (the count needs none after the exchange)
META_SMS = 132  # the calibration GPU's SMs (H100 SXM; H200 SXM has as many)
_CAL_BYTES, _CAL_BPS = 4096 * 8 * 8, 450e9  # the gather's bytes to the one peer, over NVLink
_CAL_COUNT_BLOCKS, _CAL_SCAN_BLOCKS, _CAL_ROWS_BLOCKS = 64, 137, 256


def waves(blocks: int) -> int:
    """Waves of `blocks` blocks over the GPU's META_SMS SMs (0 for none)."""
    return math.ceil(blocks / META_SMS)


PASS_S = STEP_MEASURED_US["meta_items"] * 1e-6  # a kernel's floor: a block per copy, less than a wave
COUNT_WAVE_S = (STEP_MEASURED_US["meta_count"] * 1e-6 - PASS_S) / waves(_CAL_COUNT_BLOCKS)
ROWS_WAVE_S = (STEP_MEASURED_US["meta_rows"] * 1e-6 - PASS_S) / waves(_CAL_ROWS_BLOCKS)
SCAN_WAVE_S = (STEP_MEASURED_US["meta_scan"] * 1e-6 - PASS_S) / waves(_CAL_SCAN_BLOCKS)
GATHER_S = STEP_MEASURED_US["gather_copy"] * 1e-6 - _CAL_BYTES / _CAL_BPS
GAP_S = (H100_WHOLE_US - sum(H100_MEASURED_US.values())) * 1e-6 / LAUNCHES
# the flag wait: one round trip and the ranks' arrival apart, as the timed dispatches had it
SIGNAL_S = (STEP_WHOLE_US - sum(STEP_MEASURED_US.values())) * 1e-6 - LAUNCHES * GAP_S
# a grid barrier of meta_fused: what its events hold beyond the steps' less five of their six gaps
BARRIER_S = (FUSED_WHOLE_US * 1e-6 - (STEP_WHOLE_US * 1e-6 - (LAUNCHES - 1) * GAP_S)) / BARRIERS

# NCCL's cost model of a ring all-gather (src/graph/tuning.cc, ncclTopoTuneModel: the latency of
# R - 1 steps, nodes - 1 of them over the network), in us: (base, per step inside a node, per step
# between nodes) for the LL protocol (small messages) and Simple (the slot words).  Not
# measured here: the one-box 2-GPU runs of tests/gpu are the first check.
NCCL_RING_US = {"LL": (3.6, 0.47, 2.7), "Simple": (8.4, 3.4, 9.6)}
NCCL_LL_NODES_FACTOR = 1.8  # LL's per-step latency inside a node where there are several nodes


def from_manifest(metadata: dict | None, where: str = "manifest.json") -> DeviceMetadata | None:
    """The DeviceMetadata of a CUDA manifest's "metadata" entry; None where the bundle has no
    metadata kernels (no entry: direct kernels; lowering "host").  A device entry without the
    kernels' blocks (a bundle compiled before they were recorded) is a SimulationError; one
    without its "launches" (compiled before meta_fused) launches the steps."""
    if not metadata or metadata.get("lowering") != "device":
        return None
    blocks = metadata.get("blocks")
    keys = ("meta_count", "meta_rows", "meta_items")
    if not isinstance(blocks, dict) or not all(isinstance(blocks.get(k), int) and blocks[k] >= 0 for k in keys) \
            or not (isinstance(blocks.get("meta_scan", 1), int) and blocks.get("meta_scan", 1) >= 0):
        raise SimulationError(f"{where}: the metadata kernels' blocks are not recorded (\"metadata\": {{\"blocks\": "
                              f"{{{', '.join(keys)}}}}}): recompile the bundle")
    steps = tuple((str(s["program"]), str(s["step"])) for s in metadata.get("steps", []))
    exchange = metadata.get("exchange", "ipc")  # a bundle compiled before the choice: over CUDA IPC
    if exchange not in ("ipc", "collective"):
        raise SimulationError(f"{where}: the metadata exchange {exchange!r} is none this epcc knows (ipc, "
                              f"collective): recompile the bundle")
    launches = metadata.get("launches", [])
    if not isinstance(launches, list) or not all(isinstance(k, str) for k in launches):
        raise SimulationError(f"{where}: the metadata's \"launches\" is not a list of kernel names: recompile the "
                              f"bundle")
    return DeviceMetadata(blocks["meta_count"], blocks["meta_rows"], blocks["meta_items"], steps, exchange,
                          "meta_fused" in launches, blocks.get("meta_scan", 1))


def exchange_link(plan: Plan) -> tuple[str | None, float, bool]:
    """(the link the gather's bytes are charged to, its rate in bytes/s, whether it is a link of
    per-GPU ports): the fastest `p2p` link the plan's steps use, else the fastest other link
    between ranks; (None, 0, False) where the plan has none."""
    kinds = {s.link: s.link_kind for s in plan.steps if s.link and s.link_kind not in (None, "local")}
    best: tuple[int, float, str] | None = None
    for name, kind in kinds.items():
        caps = [c for r, c in plan.resources.items() if r.startswith(f"link:{name}:")]
        if caps and (best is None or (kind == "p2p", max(caps)) > best[:2]):
            best = (kind == "p2p", max(caps), name)
    if best is None:
        return None, 0.0, False
    name = best[2]
    ports = any(r.startswith(f"link:{name}:") and r.endswith((":out", ":in")) for r in plan.resources)
    return name, best[1], ports


def boxes(plan: Plan) -> list[list[int]]:
    """The plan's boxes: its ranks grouped by the flows over box-internal links (`p2p`, `d2d`)
    that join them, largest first (a rank no such flow reaches is a box of its own: the 2-vnode
    plans' virtual nodes, joined by an RDMA-class link only)."""
    parent = list(range(plan.num_ranks))

    def root(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for s in plan.steps:
        if s.link_kind in ("p2p", "d2d"):
            for f in s.flows:
                parent[root(f.src)] = root(f.dst)
    out: dict[int, list[int]] = {}
    for r in range(plan.num_ranks):
        out.setdefault(root(r), []).append(r)
    return sorted(out.values(), key=lambda b: (-len(b), b[0]))


def between_boxes_link(plan: Plan) -> tuple[str | None, float]:
    """(the link the collective's bytes from other boxes are charged to, its rate in bytes/s): the
    slowest `rdma` link the plan's steps use, else its slowest link between ranks; (None, 0)
    where it has none."""
    kinds = {s.link: s.link_kind for s in plan.steps if s.link and s.link_kind not in (None, "local")}
    rdma = [n for n, k in kinds.items() if k == "rdma"] or list(kinds)
    slowest: tuple[float, str] | None = None
    for name in rdma:
        caps = [c for r, c in plan.resources.items() if r.startswith(f"link:{name}:")]
        if caps and (slowest is None or min(caps) < slowest[0]):
            slowest = (min(caps), name)
    return (None, 0.0) if slowest is None else (slowest[1], slowest[0])


def ring_latency(num_ranks: int, boxes: int, protocol: str) -> float:
    """Seconds of one ring all-gather's latency over `num_ranks` ranks in `boxes` boxes, as NCCL's
    tuning model counts it (NCCL_RING_US)."""
    base, intra, inter = NCCL_RING_US[protocol]
    if boxes > 1 and protocol == "LL":
        intra *= NCCL_LL_NODES_FACTOR
    steps, between = num_ranks - 1, boxes - 1
    return (base + (steps - between) * intra + between * inter) * 1e-6


def collective_terms(plan: Plan) -> tuple[float, float]:
    """(transfer, latency) seconds of the collective exchange (module docstring)."""
    wl = plan.workload
    R = plan.num_ranks
    if R < 2:
        return 0.0, 0.0
    slot = wl.tokens * wl.topk * 8
    groups = boxes(plan)
    in_box = len(groups[0])
    _, intra_bps, _ = exchange_link(plan)
    _, inter_bps = between_boxes_link(plan)
    transfer = ((in_box - 1) * slot / intra_bps if intra_bps > 0 else 0.0) + \
        ((R - in_box) * slot / inter_bps if inter_bps > 0 else 0.0)
    latency = ring_latency(R, len(groups), "Simple")
    return transfer, latency


def metadata_terms(plan: Plan, meta: DeviceMetadata) -> dict[str, float]:
    """Seconds of each part of the metadata before a dispatch (module docstring), in launch order:
    gather, transfer, signal (over CUDA IPC) or collective (the group's all-gathers' latency),
    count, scan, rows, items, barriers (meta_fused only), gaps."""
    wl = plan.workload
    if wl is None:
        raise SimulationError("the plan has no workload: the metadata kernels' exchange has no size")
    if meta.exchange == "collective":
        transfer, wait = collective_terms(plan)
        exchange = {"gather": GATHER_S, "transfer": transfer, "collective": wait}
        launches = 2 if meta.fused else STEP_LAUNCHES - 1 + (1 if meta.items_blocks else 0)
    else:
        _, bps, ports = exchange_link(plan)
        per_peer = wl.tokens * wl.topk * 8
        moved = per_peer * (plan.num_ranks - 1 if ports else 1) if plan.num_ranks > 1 else 0
        exchange = {"gather": GATHER_S, "transfer": moved / bps if bps > 0 else 0.0, "signal": SIGNAL_S}
        launches = 1 if meta.fused else STEP_LAUNCHES - 1 + (1 if meta.items_blocks else 0)
    return {
        **exchange,
        "count": PASS_S + waves(meta.count_blocks) * COUNT_WAVE_S,
        "scan": PASS_S + waves(meta.scan_blocks) * SCAN_WAVE_S,
        "rows": PASS_S + waves(meta.rows_blocks) * ROWS_WAVE_S,
        "items": PASS_S if meta.items_blocks else 0.0,
        **({"barriers": BARRIERS * BARRIER_S} if meta.fused else {}),
        "gaps": launches * GAP_S,
    }


__all__ = ["between_boxes_link", "boxes", "collective_terms", "from_manifest", "exchange_link", "metadata_terms",
           "ring_latency", "waves"]
