"""What `epcc simulate` needs to know of the direct kernels (direct.py): which plans run as them,
on how many SMs, and after how many kernel launches.

The compiler's simulator does not import the backends; the CLI asks this module and hands the
answer to the simulator as an `epcc.sim.DirectKernels` (compiler/sim/direct.py models it).
"""

from __future__ import annotations

import dataclasses

from epcc.plan import Plan
from epcc.sim import DirectKernels

from . import direct


def dispatch_launches(tokens: int, warps: int) -> int:
    """Kernel launches of one dispatch of `tokens` tokens (epcc_direct_dispatch in
    templates/direct.cu.j2): the dispatch kernel counts the metadata itself up to one metadata
    chunk when its blocks have the threads for it (meta_in_dispatch); otherwise meta_count_kernel
    runs first, and meta_finish_kernel after it when there is more than one chunk."""
    if tokens <= direct.META_CHUNK and warps * 32 >= direct.META_THREADS:
        return 1
    chunks = max(1, -(-tokens // direct.META_CHUNK))
    return 2 if chunks == 1 else 3


def meta_passes(tokens: int) -> int:
    """Metadata passes before a dispatch's rows move: one counts a chunk of META_CHUNK tokens (each
    chunk in parallel), a second finishes the ranks when there is more than one chunk."""
    return 1 if tokens <= direct.META_CHUNK else 2


def direct_kernels(plan: Plan, sms: int | None = None) -> tuple[DirectKernels | None, str | None]:
    """(the direct kernels of `plan`, None) when the CUDA target lowers the plan to them, else
    (None, why not).  Their configuration is default_config's (every block sends, then
    replicates; reduces, then sums), on `sms` SMs per program instead of the plan's if given."""
    why = direct.match(plan)
    if why is not None:
        return None, why
    cfg = direct.default_config(plan)
    if sms is not None:
        cfg = dataclasses.replace(cfg, send_blocks=sms, recv_blocks=0, combine_send_blocks=sms,
                                  combine_reduce_blocks=0)
    cfg.check()
    progs = {s.program for s in plan.steps}
    sms = {"dispatch": cfg.dispatch_sms, "combine": cfg.combine_sms}
    launches = {"dispatch": dispatch_launches(plan.workload.tokens, cfg.warps), "combine": 1}
    passes = {"dispatch": meta_passes(plan.workload.tokens)}
    warps = {"dispatch": cfg.warps, "combine": direct.COMBINE_THREADS // 32}
    return DirectKernels({p: n for p, n in sms.items() if p in progs},
                         {p: n for p, n in launches.items() if p in progs},
                         {p: n for p, n in passes.items() if p in progs},
                         {p: n for p, n in warps.items() if p in progs}), None
