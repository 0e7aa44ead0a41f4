"""The combine kernel reading the expert rows where the caller has them (manifest combine_input,
backends/cuda/codegen.py combine_input, plan/peers.py foreign_reads) instead of from a copy in
the combine's input buffer `output`.

Allowed only where no copy of any rank reads another rank's `output`: checked here against every
rank's decoded tables of every shipped schedule (each RDMA lowering it has), for a few routings,
so the plan's decision is both safe (no table reads a peer's `output` where it says yes) and
tight (some table does where it says no).  Then the manifest field, the generated sources (the
kernel argument, the launcher's buffer index and entry point) and an nvcc build of a bundle that
qualifies (sm_90a, as the GPU machine builds it)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from test_cuda_codegen import ALL, plan_of, small_case, source_of
from test_peer_sets import ROUTINGS, SIZES

from epcc.backends.cuda import codegen
from epcc.backends.target import SUPA
from epcc.plan.cuda_manifest import check_cuda_manifest
from epcc.plan.peers import foreign_reads
from epcc.plan.schema import SchemaError
from epcc.runtime import build_cache
from epcc.runtime.engines.cuda_table import launcher
from epcc.runtime.engines.cuda_table.tables import build_tables, copy_rows, parse_tables
from epcc.runtime.layout import compute_layout
from epcc.runtime.testing import inputs

# the shipped schedules whose combine reads only its own rank's expert rows (every lowering)
CALLER_ROWS = {"h200x2_2vnode", "h200x2_2vnode_mixed", "h200x2_2vnode_relay", "h200x4_ubb2x2", "ocs_ep16",
               "ubbv2_ep16", "ubbv2_ep32", "ubbv2_ep32_port10"}


def _lowerings(plan) -> list[str]:
    return ["emulate", "proxy"] if any(k.kind == "proxy" for k in plan.kernels) else ["emulate"]


def _foreign(plan, manifest: dict, routings) -> list[tuple]:
    """(rank, src rank, what) of every combine copy whose tables read or write `output` of another
    rank than the table's own (the rank whose kernel runs the copy)."""
    names = [b["name"] for b in manifest["buffers"]["combine"]]
    out_id = names.index("output")
    wl, R = plan.workload, plan.num_ranks
    bad = []
    for spec, seed in routings:
        idx = inputs.make_topk(spec, R, int(wl.tokens), wl.topk, wl.experts, wl.placement, seed=seed).topk_idx
        lay = compute_layout(plan, idx, inputs.make_weights(idx, seed=seed + 1))
        for rank in range(R):
            t = parse_tables(build_tables(manifest, lay, "combine", rank).blob)
            for i, c in enumerate(t["copies"]):
                if int(c["dst_buf"]) == out_id:
                    bad.append((rank, int(c["dst_rank"]), "writes"))
                bufs, *_ = copy_rows(t, i)
                if (bufs == out_id).any() and int(c["src_rank"]) != rank:
                    bad.append((rank, int(c["src_rank"]), "reads"))
    return bad


@pytest.mark.parametrize("name", ALL)
def test_the_decision_matches_what_every_ranks_tables_read(name):
    tokens, chunk = SIZES.get(name, (24, 3))
    plan, *_ = small_case(name, tokens, chunk)
    plan.workload.tokens = tokens
    routings = ROUTINGS if plan.num_ranks <= 8 else ROUTINGS[:1]
    for rdma in _lowerings(plan):
        m = codegen.generate(plan, source_of(name), codegen.CudaOptions(rdma=rdma)).manifest
        ci = m["combine_input"]
        assert ci["buffer"] == "output"
        assert ci["caller_rows"] == (name in CALLER_ROWS), (rdma, ci)
        bad = _foreign(plan, m, routings)
        if ci["caller_rows"]:
            assert not bad, (rdma, bad[:5])
        else:
            assert bad, (rdma, ci["why"])  # tight: some rank's kernel does read a peer's expert rows
            assert "reads output of rank" in ci["why"]


def test_the_reason_names_the_step_and_its_line():
    m = codegen.generate(plan_of("h200x4_2vnode"), source_of("h200x4_2vnode")).manifest
    text = Path(source_of("h200x4_2vnode")).read_text(encoding="utf-8")
    line = text[:text.index('  step fwd "')].count("\n") + 1  # where the schedule declares the step
    assert m["combine_input"] == {"buffer": "output", "caller_rows": False,
                                  "why": f"combine step 'fwd' (line {line}) reads output of rank 1 on rank 0 (over p2p)"}


def test_a_step_writing_the_input_buffer_or_left_to_an_outside_proxy_refuses():
    plan = copy.deepcopy(plan_of("h200x2_2vnode"))
    assert foreign_reads(plan, "combine", "output", set()) is None
    kernel = next(k for k in codegen.generate(plan, source_of("h200x2_2vnode")).kernels if k.program == "combine")
    outside = codegen.combine_input(plan, kernel, [{"program": "combine", "step": "keep", "kind": "rdma"}])
    assert not outside["caller_rows"]
    assert outside["why"] == "combine step 'keep' is left to a proxy outside the kernels, which reads output itself"
    assert codegen.combine_input(plan, None, []) == {"buffer": "output", "caller_rows": False,
                                                     "why": "the plan has no combine kernel"}
    step = next(s for s in plan.steps if s.program == "combine" and s.name == "keep")
    step.dst_buffer = "output"
    assert foreign_reads(plan, "combine", "output", set()) == f"combine step 'keep' (line {step.line}) writes output"


def test_a_proxied_step_reads_on_its_sender():
    """The GPU proxy path's pack role reads the sender's own rows: a step that pulls a peer's
    `output` over RDMA is foreign when emulated by peer copies, not when proxied."""
    plan = copy.deepcopy(plan_of("h200x2_2vnode"))
    rdma = next(s for s in plan.steps if s.program == "combine" and s.name == "rdma")
    rdma.src_buffers = ("output",)
    assert foreign_reads(plan, "combine", "output", set()) == (
        f"combine step 'rdma' (line {rdma.line}) reads output of rank 1 on rank 0 (over rdma)")
    assert foreign_reads(plan, "combine", "output", {("combine", "rdma")}) is None


def test_the_manifest_field_is_checked_and_optional():
    m = codegen.generate(plan_of("h200x2_2vnode"), source_of("h200x2_2vnode")).manifest
    check_cuda_manifest(m)
    older = {k: v for k, v in m.items() if k != "combine_input"}  # a bundle of an older epcc
    check_cuda_manifest(older)
    wrong = dict(m, combine_input=dict(m["combine_input"], buffer="nowhere"))
    with pytest.raises(SchemaError, match="combine_input.buffer"):
        check_cuda_manifest(wrong)
    with pytest.raises(SchemaError):
        check_cuda_manifest(dict(m, combine_input={"buffer": "output", "caller_rows": "yes", "why": ""}))


def test_the_supa_manifest_carries_the_same_decision():
    for name in ("h200x2_2vnode", "h200x4_2vnode"):
        cuda = codegen.generate(plan_of(name), source_of(name)).manifest["combine_input"]
        supa = codegen.generate(plan_of(name), source_of(name), target=SUPA).manifest["combine_input"]
        assert cuda == supa


@pytest.mark.parametrize("name,index", [("h200x2_2vnode", 0), ("h200x4_2vnode", -1)])
def test_the_sources_take_the_rows_as_a_kernel_argument(name, index):
    b = codegen.generate(plan_of(name), source_of(name), codegen.CudaOptions(rdma="proxy"))
    launcher_src = next(t for f, t in b.files.items() if f.endswith("_launcher.cu"))
    assert f"constexpr int32_t kCallerBuffer = {index};" in launcher_src
    assert "int epcc_cuda_launch_combine_rows(void* ctx, uint64_t out, uint64_t tokens, uint64_t rows," in launcher_src
    assert "a.caller_rows = reinterpret_cast<const uint8_t*>(caller_rows);" in launcher_src
    device = b.files["epcc_cuda_device.cuh"]
    assert "const uint8_t* caller_rows;" in device
    # every row address of a role or pack goes through the substitution; none reads a.buffers directly
    assert device.count("src_base(a, buf, c.src_rank)") == 2
    assert "a.buffers[buf * R + c.src_rank]" not in device


NVCC = build_cache.find_nvcc()


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: the CUDA sources are not compiled")
def test_a_qualifying_bundle_builds_for_sm90a_and_exports_the_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("EPCC_CACHE", str(tmp_path / "cache"))
    b = codegen.generate(plan_of("h200x2_2vnode"), source_of("h200x2_2vnode"), codegen.CudaOptions(rdma="proxy"))
    assert b.manifest["combine_input"]["caller_rows"]
    b.write(tmp_path / "cuda")
    log: list[str] = []
    lib = launcher.Library(launcher.build_library(tmp_path / "cuda", nvcc=NVCC, log=log))
    assert "sm_90a" in " ".join(b.manifest["build"]["command"])
    assert lib.has_caller_rows


def test_one_reading_of_the_field_for_the_simulator_and_the_runtime():
    """compiler/sim/calls.py and the table engine ask the same question of a manifest: caller rows
    of the combine's input buffer; any other buffer, or no field (an older bundle), is a copy."""
    from epcc.plan.cuda_manifest import combine_reads_caller_rows
    from epcc.sim.calls import reads_caller_rows
    for m, want in (({"combine_input": {"buffer": "output", "caller_rows": True, "why": ""}}, True),
                    ({"combine_input": {"buffer": "output", "caller_rows": False, "why": ""}}, False),
                    ({"combine_input": {"buffer": "partials", "caller_rows": True, "why": ""}}, False),
                    ({}, False), (None, False)):
        assert combine_reads_caller_rows(m) is want and reads_caller_rows(m) is want, m
