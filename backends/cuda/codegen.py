"""CUDA code generation: a plan's kernels as table-driven persistent kernels for sm_90a.

Every decision is made here, in Python; the templates (templates/*.cu.j2) only lay out text.  One
module of ~550 lines on purpose: the roles, their blocks and access widths, the launcher and the
manifest are decided from one walk of the plan, and the manifest must say what the sources do.

* One persistent kernel per program (`epcc_<schedule>_<program>_kernel`), launched
  cooperatively so every block is resident: blocks are split into roles by the plan's SM ranges
  (`RolePlan.sm_begin/sm_end`, one block per SM), `blockIdx.x` selects the role, the role's
  warps split each chunk's rows (one row per warp at a time).
* DMA roles (plan kind `dma`: copy-engine / D2D steps) are lowered as extra roles of the same
  kernel, `dma_blocks` blocks each, appended after the SM roles: SM copies standing in for the
  copy engine.  The targets of such steps are peers of the same node, mapped through CUDA IPC,
  so an SM can do the copy.  (The SUPA target issues a dispatch step the plan puts on the DMA
  engine as a copy lane of its launcher instead: `dma-engine`, backends/supa; this target keeps
  the SM roles.)
* Proxy roles (plan kind `proxy`: RDMA steps) with `rdma="emulate"` are lowered the same way,
  `proxy_blocks` blocks each, paced to the link's bandwidth from the plan: valid when every rank
  is in one CUDA IPC domain (h200x4_2vnode: two virtual nodes on one box).  With
  `rdma="external"` they are left out of the kernel (`not_lowered` in the manifest): a host
  proxy must post them and bump their counters; the SM roles still wait on
  those counters.  The default, `auto`, emulates for plans of at most 8 ranks (one HGX box)
  and leaves RDMA to the proxy above that (dgx_h800_2node, ocs_ep16, ubbv2_ep32).
* Metadata exchanges (`exchange` steps) are lowered to the metadata kernels
  (templates/table_meta.cu.j2, device_metadata): every rank's routing is all-gathered (over CUDA
  IPC inside one box, by the process group's all-gather across boxes) and each rank writes its
  tables on its GPU per dispatch; where they do not cover the plan the host computes the layout
  (runtime/layout) and uploads the tables, and the manifest says why.
* The combine's home partials (`result`, fp32) become the caller's bf16 tokens in the kernel: the
  warp that adds a row's last contribution converts it, counting down per-row counts that a small
  kernel (`..._combine_count_kernel`) writes from the combine's tables before the launch
  (combine_output says where this holds); elsewhere a conversion kernel
  (`..._combine_finish_kernel`) runs on the same stream after the main kernel.

Combine partials that cross an RDMA-class link travel as bf16 (`accum_bf16_wire`, BF16_WIRE):
the receiver adds bf16(partial), as DeepEP's internode combine does, so the NIC carries half
the bytes of fp32; checks admit that rounding (runtime/engines/cuda_table/tables.py partial_rounding
for runtime/testing/oracle.py's compare_combine).

Row operations: dispatch copies wire rows (`row_bytes`) with the widest access that divides the
row (16 B for bf16 rows of a hidden size divisible by 8, and for fp8 rows of a hidden size
divisible by 128): rows are packed at a pitch of `row_bytes`, so a wider access would be
misaligned on every other row.  Combine accumulates with fp32 atomic adds (`red.add.v4.f32`
where the hidden size allows): weighted steps `w * bf16 -> f32`, the others fp32 partials.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import jinja2

from epcc import __version__ as EPCC_VERSION
from epcc.plan import WARPS_PER_SM, KernelPlan, Plan, PlanStep, RolePlan
from epcc.plan.cuda_manifest import CALLER_INPUTS
from epcc.plan.peers import foreign_reads, foreign_writes, publishes_in_order
from epcc.plan.rdma import rdma_steps
from epcc.plan.segments import SegmentProgramError, segment_program
from epcc.plan.schema import CUDA_FORMAT, SUPA_FORMAT
from epcc.textsafe import c_template_value, for_c_templates

from ..rdma import emit as rdma_emit
from ..rdma.sources import STATIC_SOURCES
from ..supa import build as supa_build
from ..target import CUDA, Target

from . import abi, direct
from .meta_program import Capacity, check_shared, encode, shared_bytes
from .placement import PlacementError, placement

TARGET_ARCH = "sm_90a"
GENCODE = "-gencode=arch=compute_90a,code=sm_90a"
NVCC_FLAGS = ["-O3", "-std=c++17", GENCODE, "-Xcompiler", "-fPIC"]
HEADER_FILE = CUDA.device_header
STEP_NAME_BYTES = 48
MAX_SLEEP_NS = 1024
FINISH_BLOCK = 256
_TEMPLATES = Path(__file__).resolve().parent / "templates"

# User text (paths, titles, names) reaches the sources only through the c_comment and c_string
# filters; the finalize hook refuses plain text that could leave its comment or string.
_ENV = for_c_templates(jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(_TEMPLATES)),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    autoescape=False,
    finalize=c_template_value,
))


class CudaCodegenError(ValueError):
    """The plan cannot be lowered to CUDA (no workload, no kernels, an unknown step kind)."""


PROXY_BLOCK_BPS = 12.5e9  # what one paced block of an emulated RDMA copy role is given (a 50 GB/s link: 4 blocks)
PROXY_MAX_BLOCKS = 16
# Warps of a role the plan gives none (its blocks are chosen here): 8 for the paced and DMA
# stand-in roles, whose rate is set by pacing; an SM role's WARPS_PER_SM for the proxy path's
# pack and unpack roles, which stage or apply one whole chunk per block, so a chunk's staging
# time (one SM's copy rate) is part of every credit round trip.  With 16 warps instead of 8 the
# 2-GPU vnode plan at 50 GB/s went 1.615 -> 1.492 ms dispatch and 2.937 -> 2.688 ms combine
# (2 x H200, 2026-11-23, chunk 128 tokens depth 4, median of 20; docs/rdma.md).
ROLE_WARPS = 8
ONE_IPC_DOMAIN_RANKS = 8  # an HGX box: the most GPUs that can map each other's memory over NVLink
METADATA_EXCHANGES = ("auto", "ipc", "collective")  # CudaOptions.metadata_exchange


@dataclass
class CudaOptions:
    # emulate: proxy (RDMA) roles as paced SM roles over peer memory; proxy: a pack role on the
    # sender pushes chunks to the host proxy loop (backends/rdma), which writes them through a
    # transport (emulated: copy engine, paced), and an unpack role on the receiver applies them;
    # external: the kernels leave the steps to a host proxy of the caller's; auto: emulate when the
    # plan has at most ONE_IPC_DOMAIN_RANKS ranks, else external.
    rdma: str = "auto"
    dma_blocks: int = 2  # blocks per DMA role (SM stand-in for the copy engine)
    proxy_blocks: int = 4  # blocks per emulated RDMA role, at least; more for fast links (PROXY_BLOCK_BPS); the
    # pack and unpack roles of rdma="proxy" take theirs from the plan (kernel-formation's pack_sms / unpack_sms)
    pace_rdma: bool = True  # emulated RDMA roles keep to the link's bandwidth
    copy_unroll: int = 8  # loads in flight per lane, dispatch row copies
    accum_unroll: int = 8  # loads in flight per lane, combine accumulates (4: 5-7 % slower combine on H200)
    # rdma="proxy": the GPU proxy path's channels set up once and its tables written on the GPU
    # (device_metadata), both modes; off (`--proxy-tables host`): host-built tables per routing,
    # normal mode only
    proxy_device_tables: bool = True
    # how the metadata kernels' routing reaches every rank (device_metadata): ipc (each rank writes
    # its slot into every peer's gather area over CUDA IPC, then a flag), collective (the process
    # group's all-gather, in place, between the own slot's write and the table kernels), auto: ipc
    # when the plan has at most ONE_IPC_DOMAIN_RANKS ranks, else collective
    metadata_exchange: str = "auto"


@dataclass
class RoleSpec:
    index: int
    step: str
    title: str | None
    line: int
    role: str  # the plan's role (sender, permuter, ...)
    engine: str
    lowered: str  # sm | dma-on-sm | dma-engine (SUPA: no block, the launcher's copy lane) | rdma-on-sm | rdma-pack | rdma-unpack
    block_begin: int
    block_end: int
    plan_sms: tuple[int, int] | None
    warps: int
    op: str  # copy | accum_weighted | accum | accum_bf16_wire
    op_type: str  # the C++ row operation
    access_bytes: int
    unroll: int
    verb: str
    link: str | None
    link_kind: str | None
    src_buffers: list[str]
    dst_buffer: str | None
    bytes_per_s: float | None  # pacing (emulated links), None: full speed
    fn: str
    latency_ns: int = 0  # pacing: each chunk lands this long after its last byte (the link's latency)
    # whether its chunks are published in chunk order: where a step of the program reads what it
    # writes (its chunks' waits read "counter >= v" as chunks 0..v-1 written); else a block publishes
    # its chunk as soon as it is written (only the drain, which waits for the total, reads the counter)
    ordered: bool = True
    # combine with the conversion in the kernel (FinishSpec.in_kernel): the role adds into `result`
    # and writes the caller's bf16 token of each row whose last contributions it adds (run_role's kFinish)
    finishes: bool = False
    comment: list[str] = field(default_factory=list)
    summary: str = ""

    @property
    def blocks(self) -> int:
        return self.block_end - self.block_begin

    @property
    def rate(self) -> str:
        if not self.bytes_per_s:
            return "0.f"
        g = f"{self.bytes_per_s / 1e9:.6g}"  # bytes per ns = GB/s
        return g + ("f" if any(ch in g for ch in ".e") else ".f")


@dataclass
class FinishSpec:
    """How the combine's fp32 home partials (`result`) become the caller's bf16 tokens.
    in_kernel: the combine kernel converts each row once its last contribution is added (the role
    that adds it: run_role's kFinish), from per-row counts of the contributions still to come that
    the count kernel (`name`) writes from the combine's tables before each launch (the launcher's
    combine_prepare); else the finish kernel (`name`) converts every row after the kernel.  `why`:
    the reason (combine_output)."""
    name: str
    launch_fn: str
    load_fn: str  # loads the kernel into the context (epcc_cuda_create calls it: see the launcher)
    block: int
    in_kernel: bool = False
    why: str = ""


@dataclass
class GateSpec:
    """The DMA lanes' gate kernel (SUPA): one warp that waits for a chunk's producer counters
    and publishes a chunk the DMA engine copied (templates/program.cu.j2)."""
    name: str
    launch_fn: str
    block: int


@dataclass
class KernelSpec:
    program: str
    name: str
    file: str
    launch_fn: str
    occupancy_fn: str
    grid: int
    block: int
    roles: list[RoleSpec]
    not_lowered: list[dict]
    finish: FinishSpec | None
    gate: GateSpec | None = None

    @property
    def dma_roles(self) -> list[RoleSpec]:
        """Roles the DMA engine runs (no block of the kernel: the launcher's copy lanes)."""
        return [r for r in self.roles if r.lowered == "dma-engine"]


RDMA_DIR = "rdma"  # the proxy sources of a plan's RDMA steps, inside the bundle's cuda/ (docs/rdma.md)


@dataclass
class CudaBundle:
    """The generated sources (file name -> text) and the launch manifest.  A plan with RDMA
    steps also has the host proxy loop (backends/rdma): written by `write` into RDMA_DIR/, the
    files listed in manifest["rdma"] (paths relative to the bundle's cuda/).  `static`: the
    static sources the generated ones include (the direct kernels' headers), bundle-relative
    name -> the file shipped with epcc, copied unchanged by `write`."""

    files: dict[str, str]
    manifest: dict
    kernels: list[KernelSpec]
    plan: Plan | None = None
    static: dict[str, Path] = field(default_factory=dict)

    def write(self, out_dir: str | Path) -> list[Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for name, text in self.files.items():
            p = out / name
            p.write_text(text, encoding="utf-8")
            written.append(p)
        for name, src in self.static.items():
            p = out / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(src.read_bytes())
            written.append(p)
        if self.manifest.get("rdma"):
            paths = rdma_emit.emit(self.plan, out / RDMA_DIR)
            got = [p.relative_to(out).as_posix() for p in paths]
            if got != self.manifest["rdma"]:
                raise CudaCodegenError(f"the RDMA proxy sources written ({got}) are not the manifest's "
                                       f"({self.manifest['rdma']})")
            written += paths
        return written


def ident(name: str) -> str:
    """A C identifier from a step or schedule name ('final.sendbuf' -> 'final_sendbuf')."""
    s = re.sub(r"[^0-9A-Za-z_]", "_", name)
    return s if s and not s[0].isdigit() else "_" + s


def _widest(n: int, widths: tuple[int, ...]) -> int:
    return next(w for w in widths if n % w == 0)


def wire_row_bytes(plan: Plan) -> int:
    """The dispatch wire row (payload only: the routing weights travel on the host's side)."""
    wl = plan.workload
    if wl.dtype == "fp8":
        return wl.hidden + (wl.hidden // 128) * 4
    return 2 * wl.hidden


def _link_rate(plan: Plan, link: str | None) -> float | None:
    if not link:
        return None
    rates = [v for k, v in plan.resources.items() if k.startswith(f"link:{link}:")]
    return min(rates) if rates else None


def _buffers(plan: Plan, program: str) -> list[dict]:
    """Buffer ids of a program: dispatch `input`, `output`, then the staging buffers in order
    of appearance; combine `output` (bf16 expert outputs), `result`, then the partials."""
    fixed = ["input", "output"] if program == "dispatch" else ["output", "result"]
    names = list(fixed)
    for s in plan.program_steps(program):
        for b in (*s.src_buffers, s.dst_buffer):
            if b and b not in names:
                names.append(b)
    out = []
    for n in names:
        rows = "wire" if program == "dispatch" else ("bf16" if n == "output" else "f32")
        out.append({"name": n, "rows": rows})
    return out


def _op(plan: Plan, step: PlanStep, opts: CudaOptions) -> tuple[str, str, int, int]:
    """(op, C++ type, access bytes, unroll) of a step's row operation."""
    hidden = plan.workload.hidden
    if step.program == "dispatch":
        v = _widest(wire_row_bytes(plan), (16, 8, 4, 2, 1))
        return "copy", f"epcc::CopyRows<{v}, {opts.copy_unroll}>", v, opts.copy_unroll
    if step.weighted:
        e = _widest(hidden, (8, 4, 2, 1))
        return "accum_weighted", f"epcc::AccumWeightedBf16<{e}, {opts.accum_unroll}>", 2 * e, opts.accum_unroll
    e = _widest(hidden, (4, 2, 1))
    if step.link_kind == "rdma":  # partials cross the NIC as bf16 (BF16_WIRE)
        return "accum_bf16_wire", f"epcc::AccumF32Bf16Wire<{e}, {opts.accum_unroll}>", 4 * e, opts.accum_unroll
    return "accum", f"epcc::AccumF32<{e}, {opts.accum_unroll}>", 4 * e, opts.accum_unroll


def _proxy_op(plan: Plan, step: PlanStep, opts: CudaOptions, how: str) -> tuple[str, str, int, int]:
    """(op, C++ type, access bytes, unroll) of a GPU proxy role (rdma="proxy").  On the wire a
    dispatch row is the wire row, a combine row bf16: expert outputs as they are, fp32 partials
    rounded (BF16_WIRE).  pack: source row -> send slot; unpack: landing slot -> destination."""
    hidden = plan.workload.hidden
    if step.program == "dispatch":
        v = _widest(wire_row_bytes(plan), (16, 8, 4, 2, 1))
        return ("pack_copy" if how == "rdma-pack" else "copy"), f"epcc::CopyRows<{v}, {opts.copy_unroll}>", v, \
            opts.copy_unroll
    e = _widest(hidden, (8, 4, 2, 1))
    if how == "rdma-unpack":
        op = "accum_weighted" if step.weighted else "accum_bf16_wire"
        return op, f"epcc::AccumWeightedBf16<{e}, {opts.accum_unroll}>", 2 * e, opts.accum_unroll
    if step.weighted:
        return "pack_bf16", f"epcc::CopyBf16Rows<{2 * e}, {opts.copy_unroll}>", 2 * e, opts.copy_unroll
    e = _widest(hidden, (4, 2, 1))
    return "pack_f32_bf16", f"epcc::PackF32Bf16<{e}, {opts.accum_unroll}>", 4 * e, opts.accum_unroll


def _op_words(plan: Plan, op: str, access: int, unroll: int) -> str:
    if op == "pack_copy":
        return f"wire rows of {wire_row_bytes(plan)} B packed into the send slot, {access}-byte accesses"
    if op == "pack_bf16":
        return f"bf16 expert outputs ({plan.workload.hidden} channels) packed into the send slot, {access}-byte accesses"
    if op == "pack_f32_bf16":
        return (f"fp32 partials ({plan.workload.hidden} channels) rounded to bf16 into the send slot (they cross the "
                f"RDMA link as bf16), {access}-byte loads")
    if op == "copy":
        return (f"wire rows of {wire_row_bytes(plan)} B copied, {access}-byte accesses, "
                f"{unroll} loads in flight per lane")
    if op == "accum_bf16_wire":
        return (f"fp32 partial += bf16(fp32 partial) ({plan.workload.hidden} channels): the partial crosses the "
                f"RDMA link as bf16, {access}-byte loads, atomic fp32 adds")
    if op == "accum_weighted":
        return (f"fp32 partial += weight * bf16 expert output ({plan.workload.hidden} channels), "
                f"{access}-byte loads, atomic fp32 adds")
    return f"fp32 partial += fp32 partial ({plan.workload.hidden} channels), {access}-byte loads, atomic fp32 adds"


def _proxy_block_bps(plan: Plan, step: PlanStep) -> float:
    """What one paced block of an emulated RDMA role is given.  A dispatch role copies rows to the
    peer, well above PROXY_BLOCK_BPS per block; a combine role adds fp32 partials into the peer's
    with atomics, which one block issues at about the topology's `add` rate (bench/sm_probe.cu:
    11.7 GB/s per SM for red.add into HBM, 9.4 GB/s paced into a peer), so it is given half of
    that, else the atomics, not the pacing, would set the step's rate."""
    if step.program != "combine":
        return PROXY_BLOCK_BPS
    add = plan.sm_rates.get("add") or plan.sm_rates.get("reduce")
    return min(PROXY_BLOCK_BPS, add / 2) if add else PROXY_BLOCK_BPS / 2


def _proxy_blocks(plan: Plan, step: PlanStep, opts: CudaOptions) -> int:
    """Blocks of an emulated RDMA role: enough that each keeps to what `_proxy_block_bps` gives it
    of the paced link (a block moves above that, so the pacing, not the SMs, sets the rate), at
    least opts.proxy_blocks and at most PROXY_MAX_BLOCKS."""
    rate = _link_rate(plan, step.link) if opts.pace_rdma else None
    want = math.ceil(rate / _proxy_block_bps(plan, step)) if rate else opts.proxy_blocks
    return max(opts.proxy_blocks, min(PROXY_MAX_BLOCKS, want))


def _pack_blocks(r: RolePlan, how: str, opts: CudaOptions) -> int:
    """Blocks of a GPU proxy path's pack or unpack role: what kernel-formation sized for the link
    (RolePlan.pack_sms / unpack_sms), opts.proxy_blocks for a plan written before it did."""
    return (r.pack_sms if how == "rdma-pack" else r.unpack_sms) or opts.proxy_blocks


def _kernel(plan: Plan, program: str, source: str, opts: CudaOptions, target: Target = CUDA) -> KernelSpec | None:
    sched = ident(plan.schedule)
    groups: dict[str, list[tuple[KernelPlan, RolePlan]]] = {"kernel": [], "dma": [], "proxy": [], "meta": []}
    for kp in plan.kernels:
        if kp.program != program:
            continue
        for r in kp.roles:
            step = plan.step(r.step, program)
            if step.verb == "exchange" or r.role == "metadata":
                groups["meta"].append((kp, r))
            elif kp.kind in ("kernel", "dma", "proxy"):
                groups[kp.kind].append((kp, r))
            else:
                raise CudaCodegenError(f"{program} kernel '{kp.name}' has kind '{kp.kind}', which the CUDA "
                                       f"backend does not know")
    not_lowered = [{"program": program, "step": r.step, "kind": "metadata",
                    "reason": "metadata exchange: the tables are written before this kernel runs, where the "
                              "manifest's 'metadata' says (on the GPU by the metadata kernels, or by the host "
                              "from runtime/layout)"} for _, r in groups["meta"]]
    lowered: list[tuple[RolePlan, str]] = [(r, "sm") for _, r in groups["kernel"]]
    lowered += [(r, _dma_lowering(plan, program, target)) for _, r in groups["dma"]]
    for _, r in groups["proxy"]:
        if opts.rdma == "emulate":
            lowered.append((r, "rdma-on-sm"))
        elif opts.rdma == "proxy":  # the sender packs and pushes, the host proxy writes, the receiver unpacks
            lowered += [(r, "rdma-pack"), (r, "rdma-unpack")]
        else:
            not_lowered.append({"program": program, "step": r.step, "kind": "rdma",
                                "reason": "RDMA: posted by a host proxy (not in this version); the SM roles wait "
                                          "on its counters"})
    if not lowered:
        return None
    roles: list[RoleSpec] = []
    at = 0
    used = set()
    # SM roles keep the plan's SM ranges (one block per SM); the others follow.
    for r, how in lowered:
        step = plan.step(r.step, program)
        if how == "dma-engine":  # no block of the kernel: the launcher's copy lane (DMA_ENGINE_WHY)
            begin = end = -1
            plan_sms = None
        elif how == "sm":
            if r.sm_end <= r.sm_begin:
                raise CudaCodegenError(f"{program} step '{r.step}' has no SMs in the plan")
            begin, end = r.sm_begin, r.sm_end
            plan_sms = (r.sm_begin, r.sm_end)
        else:
            n = (opts.dma_blocks if how == "dma-on-sm"
                 else _pack_blocks(r, how, opts) if how in ("rdma-pack", "rdma-unpack")
                 else _proxy_blocks(plan, step, opts))
            begin, end = at, at + n
            plan_sms = None
        at = max(at, end)
        warps = r.warps or (WARPS_PER_SM if how in ("rdma-pack", "rdma-unpack") else ROLE_WARPS)
        op, op_type, access, unroll = (_proxy_op(plan, step, opts, how) if how in ("rdma-pack", "rdma-unpack")
                                       else _op(plan, step, opts))
        rate = _link_rate(plan, step.link) if how == "rdma-on-sm" and opts.pace_rdma else None
        latency_ns = round(max((f.latency_s for f in step.flows), default=0.0) * 1e9) if rate else 0
        fn = f"epcc_{sched}_{program}_{ident(r.step)}"
        ordered = publishes_in_order(plan.program_steps(program), r.step)
        while fn in used:
            fn += "_"
        used.add(fn)
        roles.append(RoleSpec(index=len(roles), step=r.step, title=step.title, line=step.line, role=r.role,
                              engine=r.engine, lowered=how, block_begin=begin, block_end=end, plan_sms=plan_sms,
                              warps=warps, op=op, op_type=op_type, access_bytes=access, unroll=unroll,
                              verb=step.verb, link=step.link, link_kind=step.link_kind,
                              src_buffers=list(step.src_buffers), dst_buffer=step.dst_buffer, bytes_per_s=rate,
                              fn=fn, latency_ns=latency_ns, ordered=ordered))
    grid = max(rs.block_end for rs in roles)
    if grid <= 0:
        raise CudaCodegenError(f"{program}: every step is a DMA-engine copy; the kernel would have no block to "
                               f"wait for and publish its counters")
    for rs in roles:
        if rs.lowered == "dma-engine":  # after the kernel's blocks, in the plan's order (the tables' role order)
            rs.block_begin = rs.block_end = grid
    roles.sort(key=lambda x: x.block_begin)
    for i, rs in enumerate(roles):
        rs.index = i
        if rs.lowered == "dma-engine":
            continue
        if i and rs.block_begin != roles[i - 1].block_end:
            raise CudaCodegenError(f"{program}: roles '{roles[i - 1].step}' and '{rs.step}' do not tile the blocks "
                                   f"([{roles[i - 1].block_begin}, {roles[i - 1].block_end}) then "
                                   f"[{rs.block_begin}, {rs.block_end}))")
    if roles[0].block_begin != 0:
        raise CudaCodegenError(f"{program}: the first role starts at SM {roles[0].block_begin}, not 0")
    finish = None
    if program == "combine":
        in_kernel, why = combine_output(plan, roles, not_lowered, target)
        what = "count" if in_kernel else "finish"
        finish = FinishSpec(f"epcc_{sched}_combine_{what}_kernel", f"epcc_{sched}_combine_{what}_launch",
                            f"epcc_{sched}_combine_{what}_load", FINISH_BLOCK, in_kernel, why)
        for rs in roles:
            rs.finishes = in_kernel and rs.dst_buffer == "result" and rs.lowered != "rdma-pack"
    for rs in roles:
        title = f" ({rs.title})" if rs.title else ""
        sized = {"rdma-pack": "the plan's pack_sms", "rdma-unpack": "the plan's unpack_sms"}.get(
            rs.lowered, "the plan gives it no SMs")
        where = (f"blocks [{rs.block_begin}, {rs.block_end}) = plan SMs [{rs.plan_sms[0]}, {rs.plan_sms[1]})"
                 if rs.plan_sms else "no block: the launcher's DMA lane" if rs.lowered == "dma-engine"
                 else f"blocks [{rs.block_begin}, {rs.block_end}) ({sized})")
        how = {"sm": "", "dma-on-sm": "; copy-engine step run by " + (
                   "SMs in this version" if target.name == CUDA.name else
                   "compute units: " + DMA_ON_SM_WHY[target.name]),
               "dma-engine": "; " + DMA_ENGINE_WHY,
               "rdma-on-sm": "; RDMA emulated by SMs over peer memory" + (
                   f", paced to one link of {rs.bytes_per_s / 1e9:g} GB/s, {rs.latency_ns / 1e3:g} us"
                   if rs.bytes_per_s else ""),
               "rdma-pack": "; RDMA sender: packs each chunk into a send slot and pushes it to the host proxy's FIFO",
               "rdma-unpack": "; RDMA receiver: applies each chunk from its landing slot once its signal landed",
               }[rs.lowered]
        moves = f"{', '.join(rs.src_buffers) or '?'} -> {rs.dst_buffer or '?'}"
        rs.comment = [
            f"step '{rs.step}'{title}, {source}:{rs.line}",
            f"  {rs.role} on {where}" + ("" if rs.lowered == "dma-engine" else f", {rs.warps} warps")
            + f", engine {rs.engine}{how}",
            f"  {rs.verb} over link '{rs.link or '?'}' ({rs.link_kind or '?'}): {moves}",
            f"  {_op_words(plan, rs.op, rs.access_bytes, rs.unroll)}",
        ]
        if rs.finishes:
            rs.comment.append("  converts each row of result whose last contribution it adds into the caller's "
                              "bf16 tokens")
        if not rs.ordered and rs.lowered not in ("rdma-pack", "rdma-unpack", "dma-engine"):
            rs.comment.append("  publishes each chunk once written, in any order: no step of the program reads what "
                              "it writes")
        rs.summary = f"{rs.role}, {rs.verb} {moves}" + ("" if rs.lowered == "sm" else f" [{rs.lowered}]")
    block = target.warp_size * max(rs.warps for rs in roles if rs.lowered != "dma-engine")
    if block > target.max_block_threads:
        raise CudaCodegenError(f"{program}: a role of {block // target.warp_size} warps needs {block} threads a block; "
                               f"{target.name} blocks have at most {target.max_block_threads}")
    name = f"epcc_{sched}_{program}_kernel"
    gate = None
    if any(rs.lowered == "dma-engine" for rs in roles):
        gate = GateSpec(f"epcc_{sched}_{program}_dma_gate", f"epcc_{sched}_{program}_dma_gate_launch",
                        target.warp_size)
    return KernelSpec(program=program, name=name, file=f"{plan.schedule}_{program}{target.source_suffix}",
                      launch_fn=f"epcc_{sched}_{program}_launch", occupancy_fn=f"epcc_{sched}_{program}_occupancy",
                      grid=grid, block=block, roles=roles, not_lowered=not_lowered, finish=finish, gate=gate)


# The DMA engine's copies on SUPA (RoleSpec.lowered "dma-engine"): what the comments and the
# manifest say of them.
DMA_ENGINE_WHY = ("copied by the DMA engine: the launcher issues each chunk's row runs as stream-ordered "
                  "copies (epcc_rt_memcpy_async) on this role's own stream, between gate kernels that wait for "
                  "the chunk's producer counters and then publish its counter, the same counters the compute-unit "
                  "roles wait on and bump")
# Why a target's DMA step stays on the compute units (RoleSpec.lowered "dma-on-sm").
DMA_ON_SM_WHY = {"supa": "a copy engine copies but does not add, and a combine step accumulates fp32 partials into "
                         "its destination rows (SDK 1.x's suMemcpyReduceAsync adds, but no source shows it on "
                         "scattered rows, and no other runtime has it)"}


def _dma_lowering(plan: Plan, program: str, target: Target) -> str:
    """How a DMA step is lowered for `target`: by the DMA engine (the SUPA launcher's copy lanes) where
    the target has one and the step only copies rows (dispatch), else by blocks of the kernel."""
    if "dma" in target.copy_engines and program == "dispatch":
        return "dma-engine"
    return "dma-on-sm"


def _structs() -> list[dict]:
    out = []
    for name, (doc, _) in abi.STRUCTS.items():
        fields = [{"name": f, "ctype": ct, "offset": off, "doc": c} for f, ct, off, c in abi.struct_layout(name)]
        out.append({"name": name, "doc": doc, "fields": fields, "size": abi.dtype(name).itemsize})
    return out


IPC_HANDLE_BYTES = 64  # what the runtime exchanges per IPC handle (runtime/engines/cuda_table/launcher.py)


def generate(plan: Plan, source: str | None = None, options: CudaOptions | None = None,
             target: Target = CUDA) -> CudaBundle:
    """The sources and launch manifest of a final plan (after kernel formation) for `target`
    (backends/target.py: CUDA, or SUPA's `.su` sources from the same templates)."""
    opts = options or CudaOptions()
    if opts.rdma not in ("auto", "emulate", "external", "proxy"):
        raise CudaCodegenError(f"rdma must be 'auto', 'emulate', 'external' or 'proxy', not {opts.rdma!r}")
    if opts.rdma == "proxy" and not target.kernel_writes_host_memory:
        raise CudaCodegenError(f"rdma 'proxy' (the GPU proxy path) has kernels write FIFO entries into host-mapped "
                               f"memory, which {target.language} kernels may not write: use rdma 'emulate' or "
                               f"'external' with --target {target.name}")
    if opts.rdma == "auto":
        opts = replace(opts, rdma="emulate" if plan.num_ranks <= ONE_IPC_DOMAIN_RANKS else "external")
    opts = replace(opts, metadata_exchange=metadata_exchange(plan, opts.metadata_exchange))
    if plan.workload is None:
        raise CudaCodegenError("the plan has no workload (compiled by an older epcc?): recompile it")
    if not plan.kernels:
        raise CudaCodegenError("the plan has no kernels: run the whole pipeline (kernel-formation)")
    source = source or f"{plan.schedule}.sched"
    sched = ident(plan.schedule)
    kernels = [k for k in (_kernel(plan, p, source, opts, target) for p in abi.PROGRAMS) if k is not None]
    if not kernels:
        raise CudaCodegenError("the plan has no step a GPU kernel runs")
    cuda = target.name == CUDA.name
    header_file = target.device_header
    launcher_file = f"{plan.schedule}_launcher{target.source_suffix}"
    files: dict[str, str] = {}
    common = dict(version=EPCC_VERSION, source=source, schedule=plan.schedule, header_file=header_file,
                  target=target, cuda=cuda, rt=target.rt, abi=target.abi_prefix, api_header=supa_build.API_HEADER,
                  rc_runtime=target.name.upper(), launcher_file=launcher_file, ipc_handle_bytes=IPC_HANDLE_BYTES,
                  error_memory=("host-mapped, so it survives the trap" if target.kernel_writes_host_memory
                                else "device memory: the launcher reads it back after the stream"))
    files[header_file] = _ENV.get_template("device.cu.j2").render(
        **common, table_version=abi.TABLE_VERSION, table_magic=abi.TABLE_MAGIC,
        row_buf_shift=abi.ROW_BUF_SHIFT, structs=_structs(), step_name_bytes=STEP_NAME_BYTES,
        max_sleep_ns=MAX_SLEEP_NS)
    for k in kernels:
        files[k.file] = _ENV.get_template("program.cu.j2").render(**common, k=k)
    buffers = {p: _buffers(plan, p) for p in abi.PROGRAMS}
    by_program = {k.program: k for k in kernels}
    not_lowered = [n for k in kernels for n in k.not_lowered]
    caller = {p: caller_input(plan, p, by_program.get(p), not_lowered) for p in abi.PROGRAMS}
    library = f"libepcc_{plan.schedule}.so" if cuda else f"libepcc_{plan.schedule}_{target.name}.so"
    progs = []
    for i, p in enumerate(abi.PROGRAMS):
        k = by_program.get(p)
        progs.append({
            "index": i, "name": p, "kernel": k, "buffers": buffers[p],
            "result_buffer": next((j for j, b in enumerate(buffers[p]) if b["name"] == "result"), -1),
            "caller_buffer": next((j for j, b in enumerate(buffers[p]) if b["name"] == caller[p]["buffer"]), -1)
            if caller[p]["caller_rows"] else -1,
            "step_crcs": [abi.step_crc(r.step) for r in k.roles] if k else [],
            "row_bytes_multiple": (max([r.access_bytes for r in k.roles if r.op in ("copy", "pack_copy")] or [1])
                                   if k else 1),
            "hidden_multiple": (max([r.access_bytes // (2 if r.op in ("accum_weighted", "pack_bf16") else 4)
                                     for r in k.roles if r.op not in ("copy", "pack_copy")] or [1]) if k else 1),
            "rdma": bool(k and any(r.lowered in ("rdma-pack", "rdma-unpack") for r in k.roles)),
        })
    files[launcher_file] = _ENV.get_template("launcher.cu.j2").render(
        **common, sched=sched, num_ranks=plan.num_ranks, programs=progs, table_version=abi.TABLE_VERSION,
        step_name_bytes=STEP_NAME_BYTES, launch_why=_launch_why(plan), result_rows=plan.workload.tokens,
        **_twins(plan.num_ranks, _duplicate_pairs(plan, target)))
    sources = [k.file for k in kernels] + [launcher_file]
    static_headers = [target.prelude] + ([] if cuda else [h for h in supa_build.HEADERS if h != target.prelude])
    fmt = CUDA_FORMAT if cuda else SUPA_FORMAT
    manifest = {
        "format": fmt.name,
        "version": fmt.version,
        "table_version": abi.TABLE_VERSION,
        "epcc_version": EPCC_VERSION,
        "schedule": plan.schedule,
        "source": source,
        "num_ranks": plan.num_ranks,
        "target": TARGET_ARCH if cuda else f"{target.name}:{supa_build.ARCH}",
        "workload": {"hidden": plan.workload.hidden, "dtype": plan.workload.dtype, "tokens": plan.workload.tokens,
                     "topk": plan.workload.topk, "experts": plan.workload.experts,
                     "row_bytes": wire_row_bytes(plan)},
        "options": asdict(opts),
        "build": ({"library": library, "sources": sources, "headers": [header_file, *static_headers],
                   "command": ["nvcc", *NVCC_FLAGS, "-shared", "-o", library, *sources]} if cuda
                  else supa_build.build_section(library, sources, [header_file, *static_headers])),
        "buffers": buffers,
        "flags": {"regions": list(abi.PROGRAMS), "words_per_region": "flag_capacity (>= 1 + 2 x layout flags)",
                  "barrier_word": 0, "flag_word": "1 + (epoch % 2) * ((flag_capacity - 1) // 2) + flag_id"},
        "kernels": [],
        "not_lowered": not_lowered,
        **{f"{p}_input": caller[p] for p in abi.PROGRAMS},
    }
    if not cuda:
        manifest["machine"] = _machine(target)
        manifest["duplicate"] = {"pairs": _duplicate_pairs(plan, target), "why": _launch_why(plan),
                                 "entry_points": [f"{target.abi_prefix}_launch_dispatch_card",
                                                  f"{target.abi_prefix}_launch_combine_card"]}
    # The direct lowering (direct.py) for one-hop plans in one IPC domain: the runtime uses it
    # when present ("lowering": "direct"); the table-driven kernels above stay the general path.
    if plan.direct is not None and cuda:
        direct_files, entry = direct.generate(plan, source, _ENV, EPCC_VERSION)
        files.update(direct_files)
        entry["command"] = ["nvcc", *NVCC_FLAGS, "-shared", "-o", entry["library"], entry["source"]]
        manifest["direct"] = entry
        manifest["lowering"] = "direct"
    else:
        manifest["lowering"] = "tables"
        manifest["direct_not_used"] = (plan.direct_not_used if cuda or plan.direct is None else
                                       f"the direct kernels are written for CUDA only (warp shuffles and votes, "
                                       f"cp.async, host-mapped memory): the {target.language} target runs the "
                                       f"table-driven kernels")
    for k in kernels:
        manifest["kernels"].append({
            "name": k.name, "kind": "main", "program": k.program, "file": k.file,
            "launch": "cooperative" if target.residency == "cooperative" else "plain",
            "launch_fn": k.launch_fn, "grid": k.grid, "block": k.block, "shared_bytes": 0,
            **({"dma_lanes": {"roles": [r.index for r in k.dma_roles], "gate": k.gate.name, "how": DMA_ENGINE_WHY}}
               if k.gate else {}),
            "roles": [{"index": r.index, "step": r.step, "title": r.title, "line": r.line, "role": r.role,
                       "engine": r.engine, "lowered": r.lowered, "blocks": [r.block_begin, r.block_end],
                       "sms": r.blocks, "plan_sms": list(r.plan_sms) if r.plan_sms else None, "warps": r.warps,
                       "op": r.op, "access_bytes": r.access_bytes, "unroll": r.unroll,
                       "src_buffers": r.src_buffers, "dst_buffer": r.dst_buffer,
                       "paced_bytes_per_s": r.bytes_per_s, "function": r.fn} for r in k.roles],
        })
        if k.finish:
            manifest["kernels"].append({
                "name": k.finish.name, "kind": "count" if k.finish.in_kernel else "finish", "program": k.program,
                "file": k.file, "launch": "plain", "launch_fn": k.finish.launch_fn,
                "grid": "2 x SMs" if not k.finish.in_kernel else "SMs", "block": k.finish.block, "shared_bytes": 0,
                "roles": [],
            })
            manifest["combine_output"] = {"convert": "in-kernel" if k.finish.in_kernel else "finish-kernel",
                                          "why": k.finish.why}
    manifest["rdma"] = _rdma_sources(plan)
    static = {n: target.include_dir / n for n in static_headers}
    if manifest["lowering"] == "direct":
        static.update({n: direct.INCLUDE_DIR / n for n in direct.headers_of(plan)})
    # the table-driven kernels' metadata, also where the direct kernels run (they compute their own
    # on the GPU): the bundle's general path gets its tables on the GPU too
    manifest["metadata"] = device_metadata(plan, manifest, target)
    if manifest["metadata"]["lowering"] == "device":
        meta_source = f"{META_STEM}{target.source_suffix}"
        cap = manifest["metadata"]["capacity"]
        capacity = dict(cap, macros=Capacity(**{f: cap[f] for f in CAPACITY_FIELDS}).macros())
        files[meta_source] = _ENV.get_template("table_meta.cu.j2").render(**common, file=meta_source,
                                                                           capacity=capacity)
        static[META_HEADER] = direct.INCLUDE_DIR / META_HEADER
        build = manifest["build"]
        build["sources"].append(meta_source)
        build["headers"].append(META_HEADER)
        if cuda:
            build["command"].append(meta_source)
        else:
            manifest["build"] = supa_build.build_section(library, build["sources"], build["headers"])
        manifest["metadata"]["steps"] = [{"program": n["program"], "step": n["step"]}
                                         for n in manifest["not_lowered"] if n["kind"] == "metadata"]
        manifest["not_lowered"] = [n for n in manifest["not_lowered"] if n["kind"] != "metadata"]
    files["manifest.json"] = json.dumps(manifest, indent=1) + "\n"
    return CudaBundle(files=files, manifest=manifest, kernels=kernels, plan=plan, static=static)


def _duplicate_pairs(plan: Plan, target: Target) -> list[list[int]]:
    """The plan's duplicate-mode pairs [die 0's rank, die 1's rank] (plan.launch) where the target
    has dies (SUPA), else none."""
    if target.name == CUDA.name or plan.launch is None:
        return []
    return [list(p) for p in plan.launch.duplicate]


def _twins(num_ranks: int, pairs: list[list[int]]) -> dict:
    """Per rank, its twin die in a duplicate pair and which die it is (-1: in no pair)."""
    twin, die = [-1] * num_ranks, [-1] * num_ranks
    for d0, d1 in pairs:
        twin[d0], twin[d1], die[d0], die[d1] = d1, d0, 0, 1
    return {"dup_twin": twin, "dup_die": die}


def _launch_why(plan: Plan) -> str:
    return plan.launch.why if plan.launch is not None else "the plan predates duplicate-mode launch (recompile it)"


def _machine(target: Target) -> dict:
    """What the kernels were generated for (backends/target.py), as a manifest records it."""
    return {"warp_size": target.warp_size, "max_block_threads": target.max_block_threads,
            "shared_bytes_per_block": target.shared_bytes_per_block, "blocks_per_cu": target.blocks_per_cu,
            "vector_bytes": target.vector_bytes, "residency": target.residency, "atomics": target.atomics,
            "timer": target.timer, "backoff": target.backoff, "peer_memory": target.peer_memory,
            "copy_engines": list(target.copy_engines), "kernel_writes_host_memory": target.kernel_writes_host_memory}


META_STEM = "epcc_table_meta"  # the metadata kernels' driver: generated per target (templates/table_meta.cu.j2)
META_SOURCE = f"{META_STEM}.cu"
META_HEADER = "epcc/table/meta.cuh"  # static (cuda/include/), target-neutral through the prelude


CAPACITY_FIELDS = ("set_words", "out_sets", "experts", "topk", "home", "sets")


def combine_output(plan: Plan, roles: list[RoleSpec], not_lowered: list[dict], target: Target) -> tuple[bool, str]:
    """Whether the combine kernel converts its fp32 home partials (`result`) into the caller's bf16
    tokens itself, each row by the warp that adds its last contribution (FinishSpec.in_kernel),
    and why (not).  It needs every contribution into a rank's `result` to come from that rank's own
    kernel, where one count per row tells the last one: no copy writes it from another rank
    (plan/peers.py foreign_writes; the GPU proxy path's unpack role writes its own rank's), and no
    proxy outside the kernels writes it.  Else, and on targets without warp votes, a finish kernel
    converts every row after the combine kernel (one more pass over T x hidden x 6 bytes, and a
    launch).  Measured, 2 H100s, 2026-11-27, one device call (h200x2_2vnode_50, 4096 tokens): the
    combine call ended 78 us after its kernel with the finish kernel, 10 us converting in the kernel
    (1.352 -> 1.284 ms)."""
    if target.name != CUDA.name:
        return False, (f"a finish kernel converts the rows after the combine kernel: the {target.language} target's "
                       f"warps have no votes and shuffles the conversion in the kernel uses")
    if not any(rs.dst_buffer == "result" for rs in roles):
        return False, "no combine step of the kernel writes result"
    outside = [n["step"] for n in not_lowered if n["program"] == "combine" and n.get("kind") == "rdma"
               and plan.step(n["step"], "combine").dst_buffer == "result"]
    if outside:
        return False, (f"combine step '{outside[0]}' is left to a proxy outside the kernels, which writes result "
                       f"itself: the kernel cannot count its rows")
    proxied = {("combine", r.step) for r in roles if r.lowered in ("rdma-pack", "rdma-unpack")}
    why = foreign_writes(plan, "combine", "result", proxied)
    if why is not None:
        return False, f"{why}: the last contribution of a row may come from another GPU"
    return True, "every contribution into a rank's result is added on its own GPU: the last one converts the row"


def caller_input(plan: Plan, program: str, kernel, not_lowered: list[dict]) -> dict:
    """Whether `program`'s kernel may read this rank's input rows where the caller has them (a
    launch argument, KernelArgs.caller_rows: the dispatch's tokens `x`, the combine's expert rows
    `y`) instead of from a copy in the program's input buffer (CALLER_INPUTS): where no copy reads
    that buffer of another rank than the one it runs on, none writes it (plan/peers.py
    foreign_reads; the GPU proxy path's pack role reads its own rank's), and no step the kernels
    leave to a proxy outside them reads it (that proxy reads the buffer itself).  `kernel`: the
    program's main kernel (None: none); `not_lowered`: the kernels'."""
    buf = CALLER_INPUTS[program]

    def entry(ok: bool, why: str) -> dict:
        return {"buffer": buf, "caller_rows": ok, "why": why}

    if kernel is None:
        return entry(False, f"the plan has no {program} kernel")
    proxied = {(program, r.step) for r in kernel.roles if r.lowered in ("rdma-pack", "rdma-unpack")}
    outside = [n["step"] for n in not_lowered if n["program"] == program and n.get("kind") == "rdma"
               and buf in plan.step(n["step"], program).src_buffers]
    if outside:
        return entry(False, f"{program} step '{outside[0]}' is left to a proxy outside the kernels, which reads "
                            f"{buf} itself")
    why = foreign_reads(plan, program, buf, proxied)
    if why is not None:
        return entry(False, why)
    return entry(True, f"every {program} copy reads {buf} on its own rank")


def device_metadata(plan: Plan, manifest: dict, target: Target = CUDA) -> dict:
    """How the table-driven kernels get their tables: "device" (the metadata kernels,
    include/epcc/table/meta.cuh: every rank's routing all-gathered, each rank's tables written on its
    GPU per dispatch) where they cover the plan, else "host" (the runtime lays the routing out on the
    host: runtime/layout) with the reason.  The routing reaches every rank by the options'
    `metadata_exchange` (exchange_entry): over CUDA IPC inside one box, or by the process group's
    all-gather where the ranks span several boxes (or where the option asks for it); the kernels
    compute every rank's tables from the gathered routing whatever moved it (up to 64 ranks).  The
    GPU proxy path (rdma="proxy") is covered too: its channels and rings are sized once from the
    placement (every channel any routing can use, its largest chunk) and the metadata kernels number
    each RDMA chunk on its channel (meta.cuh Args.seq) for the pack and unpack roles; an external
    proxy (rdma="external") needs nothing of the routing.  `capacity`: what the kernels' shared
    memory is sized for (meta_program.Capacity, the most any rank's program needs), within the
    target's shared memory per block (else "host", with the numbers)."""
    def host(why: str) -> dict:
        return {"lowering": "host", "why": why}

    lanes = [k["program"] for k in manifest["kernels"] if k.get("dma_lanes")]
    if lanes:
        return host(f"the DMA engine's copies ({', '.join(lanes)}) are issued by the launcher from the rows of "
                    f"host-built tables; tables written on the GPU keep their rows there")
    if manifest["options"]["rdma"] == "proxy" and not manifest["options"].get("proxy_device_tables"):
        return host("the GPU proxy path's tables are laid out on the host per routing (`--proxy-tables host`)")
    blocks = {"meta_count": 0, "meta_scan": 0, "meta_rows": 0, "meta_items": 0}
    cap: Capacity | None = None
    try:
        prog = segment_program(plan)
        for rank in range(plan.num_ranks):
            pls = {p: placement(manifest, prog, p, rank, plan.workload.tokens) for p in abi.PROGRAMS
                   if any(k["program"] == p and k["kind"] == "main" for k in manifest["kernels"])}
            mp = encode(manifest, plan.workload.placement, prog, pls, rank, plan.workload.tokens)
            for phase, n in mp.phase_blocks().items():
                blocks[f"meta_{phase}"] = max(blocks[f"meta_{phase}"], n)
            need = mp.capacity()
            # each field the most any rank needs; home/sets: the rank with the most sets (the error's)
            cap = need if cap is None else replace(
                need if need.sets > cap.sets else cap,
                **{f: max(getattr(need, f), getattr(cap, f)) for f in ("set_words", "out_sets", "experts", "topk")})
        check_shared(cap, target.shared_bytes_per_block, target.language)
    except (SegmentProgramError, PlacementError) as e:
        return host(str(e))
    # blocks: what each phase has per dispatch, the most of any rank (meta_rows: the rows and the
    # received rows), a kernel's blocks where the phases are launches of their own; `epcc simulate`
    # charges the kernels' waves by them (sim/meta.py).  launches: per dispatch, in stream order
    # (CUDA: the cooperative meta_fused runs the phases; its steps' kernels stay, its fallback)
    exchange = exchange_entry(plan, manifest["options"]["metadata_exchange"])
    ipc = exchange["exchange"] == "ipc"
    steps = ["meta_count", "meta_scan", "meta_rows", "meta_items"]
    fused = target.residency == "cooperative"  # one launch needs every block resident at once
    launches = (["meta_fused"] if ipc else ["gather_copy", "meta_fused"]) if fused else ["gather_copy", *steps]
    return {"lowering": "device", **exchange,
            "kernels": [*(["meta_fused"] if fused else []), "gather_copy", *steps, "zero_partials"],
            "launches": launches, "blocks": blocks,
            "capacity": {**{f: getattr(cap, f) for f in CAPACITY_FIELDS}, "shared_bytes": shared_bytes(cap)}}


def metadata_exchange(plan: Plan, how: str) -> str:
    """CudaOptions.metadata_exchange resolved for `plan` ("ipc" or "collective"); CudaCodegenError
    where the plan cannot have it."""
    if how not in METADATA_EXCHANGES:
        raise CudaCodegenError(f"metadata exchange must be one of {', '.join(METADATA_EXCHANGES)}, not {how!r}")
    if how == "auto":
        return "ipc" if plan.num_ranks <= ONE_IPC_DOMAIN_RANKS else "collective"
    if how == "ipc" and plan.num_ranks > ONE_IPC_DOMAIN_RANKS:
        raise CudaCodegenError(f"metadata exchange 'ipc' maps every rank's gather area over CUDA IPC, but the "
                               f"plan's {plan.num_ranks} ranks span more than one CUDA IPC domain (at most "
                               f"{ONE_IPC_DOMAIN_RANKS}): use 'collective' or 'auto'")
    return how


def exchange_bytes(plan: Plan) -> int:
    """What each rank receives of the routing per dispatch, either exchange: every other rank's
    slot words in the gather area, `tokens` x `topk` of 8 bytes (an expert, the exchange's tag, an
    fp32 weight; padded to the bundle's tokens, a token past the rank's count a word of its own: the
    slot's size does not follow the routing, so no count travels)."""
    wl = plan.workload
    return (plan.num_ranks - 1) * wl.tokens * wl.topk * 8


def exchange_entry(plan: Plan, how: str) -> dict:
    """The manifest's words on the routing's exchange (`how`: "ipc" or "collective", resolved)."""
    if how == "ipc":
        text = ("every rank writes its routing as 8-byte slot words (expert, fp32 weight and the exchange's tag, "
                "one store each; no flag, no fence) into its slot of every peer's gather area over CUDA IPC; each "
                "count block of the table kernels polls its own tokens' words until they carry the exchange's "
                "tag")
    else:
        why = (f"its {plan.num_ranks} ranks span more than one CUDA IPC domain (at most {ONE_IPC_DOMAIN_RANKS})"
               if plan.num_ranks > ONE_IPC_DOMAIN_RANKS else "asked for (`--metadata-exchange collective`)")
        text = ("every rank writes its routing as 8-byte slot words (expert, fp32 weight and the exchange's tag) "
                "into its slot of its own gather area (gather_copy); one in-place all-gather of the Buffer's "
                "process group (torch.distributed.all_gather_into_tensor, on the dispatch's stream: NCCL over "
                f"NVLink and the NIC) fills every rank's slot, before the table kernels: {why}")
    return {"exchange": how, "exchange_how": text, "exchange_bytes_per_rank": exchange_bytes(plan)}


def _rdma_sources(plan: Plan) -> list[str]:
    """The proxy sources `rdma.emit` writes for the plan's RDMA steps, relative to cuda/; [] when
    it has none.  They are the host side of rdma="external" (the SM roles wait on the counters the
    proxy bumps); with rdma="emulate" the kernels do not need them, but the bundle stays complete."""
    if not rdma_steps(plan):
        return []
    return [f"{RDMA_DIR}/{n}" for n in (rdma_emit.proxy_file_name(plan), *STATIC_SOURCES)]


def emit(plan: Plan, out_dir: str | Path, source: str | None = None,
         options: CudaOptions | None = None) -> list[Path]:
    """Write the sources and manifest.json into `out_dir` (a bundle's `cuda/`); returns the paths."""
    return generate(plan, source, options).write(out_dir)
