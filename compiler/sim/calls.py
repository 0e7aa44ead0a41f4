"""The runtime's stream work around the table-driven kernels in one Buffer call, in the cost model.

Besides the kernels, a Buffer call of a table-driven bundle (runtime/engines/cuda_table) runs
copies on the same stream, each a grid-wide copy bound by the GPU's memory (read + write bytes):

* dispatch: x copied into the kernel's input buffer, T x row bytes (`input`);
* combine: the expert outputs copied into the kernel's receive buffer (the rows received, T x K
  expected per rank, 2 x hidden bytes each: `copy_rows`), the fp32 partial buffers cleared
  (`zero_partials`: the result's T rows and every staging buffer's rows the dispatch landed,
  4 x hidden bytes each, written), and after the kernel the fp32 result converted to bf16 (T x
  hidden x (4 + 2) bytes);
* a launch gap (sim/meta.py GAP_S) per copy: each is a launch of its own.

Where the tables come from the GPU the Buffer clears the partials beside the dispatch kernel
instead (a stream of its own, at most 32 SMs), so the combine has no `zero` and one launch fewer
(`zero_beside`), and the dispatch is charged nothing for it: the model takes the clearing as
hidden under the dispatch kernel.  Measured only where it is: 2 x H100, 2026-11-27, one device
call, h200x2_2vnode_50 (0.23 GB of partials under a 1.2 ms kernel): its combine 1.503 -> 1.403 ms,
its dispatch 1.307 -> 1.306.  A plan whose clearing outlasts its dispatch kernel on those SMs
(1.2 GB for ubbv2_ep16's) would be predicted too fast.

An fp8 dispatch still copies its tokens once: the Buffer packs x and its scales side by side
(one tensor of T rows) for the kernel to read in place, so its `input` stays.

Where the bundle's kernel of a program reads the caller's rows in place (the CUDA manifest's
`dispatch_input` / `combine_input` with `caller_rows`: no copy reads them on another rank,
backends/cuda/codegen.py caller_input), the Buffer hands it their address and copies nothing: no
`input` in the dispatch; no `rows` and one launch fewer in the combine (`caller_rows`: the
programs that do).  Measured, 2 x H200, 2026-11-27, one device call (4096 tokens, the cached row's
timeline): the combine's call less its kernel's end 0.416 ms before that change and 0.127 after
(h200x2_2vnode_50), 0.422 and 0.121 (_13); the model's rows are 0.36 ms of its 0.52 (0.16 left).

They run at COPY_EFFICIENCY x the topology's local (`hbm`) link bandwidth, in bytes read plus
bytes written.  Fitted on the measurements below: the timed call less the kernel's end in the role
timeline, less the metadata (sim/meta.py), over these bytes.  `SimOptions.calls` turns the term on
(`epcc simulate` sets it for every table-driven CUDA bundle: the Buffer runs these copies whether the
metadata kernels or the host write the tables; with host-built tables the launcher clears the
partials and converts the result itself.  Measured, 4 x H100, 2026-11-27: the combine's call less its
kernel is 0.556 ms with host-built tables and 0.552 with the GPU's for h200x4_2vnode_50, 0.727 and
0.744 for h200x4_ubb2x2_50).
"""

from __future__ import annotations

from ..plan import Plan
from ..plan.cuda_manifest import PROGRAMS
from ..plan.cuda_manifest import reads_caller_rows as manifest_reads_caller_rows

# Fitted 2026-11-26 on ep_bench (results/2026-11-26_4xH100_b.md, 4 x H100; results/2026-11-26_2xH200.md,
# 2 x H200): the combine's call less its kernel is 0.554 ms (h200x4_2vnode_50, 1.35 GB moved: 2.44 TB/s) and
# 0.70-0.73 ms (h200x4_ubb2x2_50, 1.68 GB: 2.3-2.4 TB/s) on H100, 0.42 ms (h200x2_2vnode_50 and _13,
# 1.35 GB: 3.2 TB/s) on H200; the dispatch's copy of x 0.03-0.04 ms (117 MB) on H100.  One rate for both
# (the model does not know the GPU): 2.6 TB/s, 0.87 of the schedules' 3000 GB/s `hbm` link.
COPY_EFFICIENCY = 0.87
LOCAL = ("input", "output")


def local_rate(plan: Plan) -> float:
    """Bytes/s of the GPU's memory: the plan's `hbm:<rank>` capacity (the topology's local link);
    0 where the topology declares none."""
    return max((c for r, c in plan.resources.items() if r.startswith("hbm:")), default=0.0)


def staged_tokens(plan: Plan) -> float:
    """Tokens the dispatch lands in staging buffers (not input, not output) on its busiest rank:
    the combine's fp32 partial buffers of the same names hold as many rows."""
    per: dict[int, float] = {}
    bpt = plan.bytes_per_token or 1.0
    for s in plan.steps:
        if s.program != "dispatch" or s.dst_buffer in LOCAL or s.dst_buffer is None or s.rows:
            continue
        for f in s.flows:
            if f.resources and f.bytes > 0:
                per[f.dst] = per.get(f.dst, 0.0) + f.bytes / bpt
    return max(per.values(), default=0.0)


def reads_caller_rows(manifest: dict | None) -> frozenset[str]:
    """The programs whose table-driven kernel reads the caller's rows in place (the dispatch's
    tokens, the combine's expert outputs): its CUDA manifest's `dispatch_input` / `combine_input`
    says `caller_rows` (absent in a bundle of an older epcc: the Buffer copies them)."""
    return frozenset(p for p in PROGRAMS if manifest_reads_caller_rows(manifest, p))


def call_bytes(plan: Plan, caller_rows: frozenset[str] = frozenset(), zero_beside: bool = False,
               convert_in_kernel: bool = False) -> dict[str, dict[str, float]]:
    """Per program, the bytes (read + written) of each copy a Buffer call runs beside the kernel;
    `caller_rows`: the programs whose kernel reads the caller's rows in place (the dispatch: no
    `input`; the combine: no `rows`); `zero_beside`: the partials cleared beside the dispatch (no
    `zero` in the combine); `convert_in_kernel`: the combine kernel writes the bf16 tokens itself
    (no `convert`; a `count` of each row's contributions where the combine clears the partials)."""
    wl = plan.workload
    if wl is None:
        return {}
    T, H = wl.tokens, wl.hidden
    packs = "dispatch" not in caller_rows or wl.dtype == "fp8"  # fp8: x and its scales packed into one tensor
    out = {"dispatch": {"input": 2.0 * T * plan.bytes_per_token} if packs else {}}
    if any(s.program == "combine" for s in plan.steps):
        rows = {} if "combine" in caller_rows else {"rows": 2.0 * T * wl.topk * 2 * H}
        zero = {} if zero_beside else {"zero": 4.0 * H * (T + staged_tokens(plan))}
        # the kernel writes the bf16 tokens: each row's contributions counted first, beside the dispatch
        # with the clearing, else in the combine call (a memset and two small launches: one gap here)
        convert = ({} if zero_beside else {"count": 4.0 * T}) if convert_in_kernel else {"convert": 6.0 * T * H}
        out["combine"] = {**rows, **zero, **convert}
    return out


def call_terms(plan: Plan, gap_s: float, caller_rows: frozenset[str] = frozenset(),
               zero_beside: bool = False, convert_in_kernel: bool = False) -> dict[str, dict[str, float]]:
    """Seconds of each part of the call's stream work beside the kernels, per program (module
    docstring); {} where the topology gives no local link to price them.  `caller_rows`: the
    programs whose kernel reads the caller's rows in place (no copy; the combine's copy has a
    launch of its own); `zero_beside`: the partials cleared beside the dispatch (the combine's
    clearing and its launch gone); `convert_in_kernel`: no conversion after the combine kernel (nor
    its launch)."""
    rate = COPY_EFFICIENCY * local_rate(plan)
    if rate <= 0:
        return {}
    # a launch gap for each copy (its own launch)
    return {p: {**{k: b / rate for k, b in parts.items()}, "gaps": len(parts) * gap_s}
            for p, parts in call_bytes(plan, caller_rows, zero_beside, convert_in_kernel).items()}


__all__ = ["COPY_EFFICIENCY", "call_bytes", "call_terms", "local_rate", "reads_caller_rows", "staged_tokens"]
