"""Which table-driven roles publish their chunks in chunk order (backends/cuda/codegen.py
RoleSpec.ordered, device.cu.j2 run_role's `ordered`): those some step of the program reads.  A
role no step reads publishes each chunk as soon as it is written; that is safe only where no
chunk of any copy, on any rank, waits on its counters (only the drain reads them, for their
total).  Checked here against every rank's decoded tables of every shipped schedule (each RDMA
lowering it has), for a few routings: safe (no chunk waits on an unordered role) and tight (some
chunk waits on every ordered one); and in the generated kernel source."""

from __future__ import annotations

import pytest
from test_cuda_codegen import ALL, plan_of, small_case, source_of
from test_peer_sets import ROUTINGS, SIZES

from epcc.backends.cuda import codegen
from epcc.runtime.engines.cuda_table.tables import build_tables, parse_tables
from epcc.runtime.layout import compute_layout
from epcc.runtime.testing import inputs

RUN_ROLE = ("sm", "dma-on-sm", "rdma-on-sm")  # the lowerings run_role runs


@pytest.mark.parametrize("name", ALL)
def test_no_chunk_waits_on_a_role_that_publishes_out_of_order(name):
    tokens, chunk = SIZES.get(name, (24, 3))
    plan, *_ = small_case(name, tokens, chunk)
    plan.workload.tokens = tokens
    wl, R = plan.workload, plan.num_ranks
    rdmas = ["emulate", "proxy"] if any(k.kind == "proxy" for k in plan.kernels) else ["emulate"]
    bundles = [codegen.generate(plan, source_of(name), codegen.CudaOptions(rdma=rdma)) for rdma in rdmas]
    for b, k in ((b, k) for b in bundles for k in b.kernels):
        order = [s.name for s in plan.program_steps(k.program)]
        mine = {r.step: r.ordered for r in k.roles if r.lowered in RUN_ROLE}
        read = set()  # the run_role roles some chunk of some rank waits on, over the routings
        for spec, seed in ROUTINGS if R <= 8 else ROUTINGS[:1]:
            idx = inputs.make_topk(spec, R, tokens, wl.topk, wl.experts, wl.placement, seed=seed).topk_idx
            lay = compute_layout(plan, idx, inputs.make_weights(idx, seed=seed + 1))
            tables = [parse_tables(build_tables(b.manifest, lay, k.program, rank).blob) for rank in range(R)]
            waited = {(int(w["flag_rank"]), int(w["flag_id"])) for t in tables for w in t["waits"]}
            read |= {order[int(c["step_index"])] for t in tables for c in t["copies"]
                     if (int(c["flag_rank"]), int(c["flag_id"])) in waited}
        # safe: no chunk waits on a role that publishes out of order; tight: every role that
        # publishes in order is waited on by some chunk
        assert {step for step, ordered in mine.items() if ordered} == read & set(mine), (k.program, mine, read)


def test_the_kernel_source_says_which_roles_publish_in_any_order():
    b = codegen.generate(*_two_vnode())
    dispatch = next(t for f, t in b.files.items() if f.endswith("_dispatch.cu"))
    # keep and keep_far write the output, which no dispatch step reads; rdma lands what keep_far reads
    assert dispatch.count("/*ordered=*/false);") == 2 and dispatch.count("/*ordered=*/true);") == 1
    assert dispatch.count("publishes each chunk once written, in any order: no step of the program reads what "
                          "it writes") == 2
    roles = {r.step: r.ordered for k in b.kernels for r in k.roles if k.program == "dispatch"}
    assert roles == {"keep": False, "keep_far": False, "rdma": True}


def _two_vnode():
    return plan_of("h200x2_2vnode"), source_of("h200x2_2vnode"), codegen.CudaOptions(rdma="emulate")


def test_ordered_is_a_launch_constant_of_every_run_role_call():
    b = codegen.generate(*_two_vnode())
    for f, text in b.files.items():
        if f.endswith(("_dispatch.cu", "_combine.cu")):
            calls = text.count("epcc::run_role<")
            assert calls and calls == text.count("/*ordered=*/"), f
