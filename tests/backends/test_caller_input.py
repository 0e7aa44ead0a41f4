"""The kernels reading their input rows where the caller has them -- the dispatch's tokens and the
combine's expert rows (manifest dispatch_input / combine_input, backends/cuda/codegen.py
caller_input, plan/peers.py foreign_reads) -- instead of from a copy in the program's input
buffer (`input`, `output`).

Allowed only where no copy of any rank reads another rank's input buffer: checked here against
every rank's decoded tables of every shipped schedule (each RDMA lowering it has), for a few
routings, so the plan's decision is both safe (no table reads a peer's buffer where it says yes)
and tight (some table does where it says no).  Then the manifest fields, the generated sources
(the kernel argument, the launcher's buffer indices and entry points) and an nvcc build of a
bundle that qualifies (sm_90a, as the GPU machine builds it)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from test_cuda_codegen import ALL, plan_of, small_case, source_of
from test_peer_sets import ROUTINGS, SIZES

from epcc.backends.cuda import codegen
from epcc.backends.target import SUPA
from epcc.plan.cuda_manifest import CALLER_INPUTS, check_cuda_manifest, reads_caller_rows
from epcc.plan.peers import foreign_reads
from epcc.plan.schema import SchemaError
from epcc.runtime import build_cache
from epcc.runtime.engines.cuda_table import launcher
from epcc.runtime.engines.cuda_table.engine import reads_caller_rows as engine_reads
from epcc.runtime.engines.cuda_table.tables import build_tables, copy_rows, parse_tables
from epcc.runtime.layout import compute_layout
from epcc.runtime.testing import inputs
from epcc.sim.calls import reads_caller_rows as sim_reads

# the shipped schedules whose kernel of each program reads only its own rank's input rows (every lowering)
CALLER_ROWS = {
    "combine": {"h200x2_2vnode", "h200x2_2vnode_mixed", "h200x2_2vnode_relay", "h200x4_ubb2x2", "ocs_ep16",
                "ubbv2_ep16", "ubbv2_ep32", "ubbv2_ep32_port10"},
    # ocs_ep16's p1_peer pulls the peer's tokens
    "dispatch": set(ALL) - {"ocs_ep16"},
}


def _lowerings(plan) -> list[str]:
    return ["emulate", "proxy"] if any(k.kind == "proxy" for k in plan.kernels) else ["emulate"]


def _foreign(plan, bundle, routings, program: str) -> list[tuple]:
    """(rank, src rank, what) of every copy of `program` whose tables write its input buffer, or
    read it of another rank than the table's own (the rank whose kernel runs the copy).  The GPU
    proxy path's copies are not: their pack role reads the sender's own rows and stages them, the
    receiver's unpack role reads the staged chunk, though the copy names the sender's buffer."""
    manifest = bundle.manifest
    names = [b["name"] for b in manifest["buffers"][program]]
    out_id = names.index(CALLER_INPUTS[program])
    order = [s.name for s in plan.steps if s.program == program]
    proxied = {order.index(r.step) for k in bundle.kernels if k.program == program for r in k.roles
               if r.lowered in ("rdma-pack", "rdma-unpack")}
    wl, R = plan.workload, plan.num_ranks
    bad = []
    for spec, seed in routings:
        idx = inputs.make_topk(spec, R, int(wl.tokens), wl.topk, wl.experts, wl.placement, seed=seed).topk_idx
        lay = compute_layout(plan, idx, inputs.make_weights(idx, seed=seed + 1))
        for rank in range(R):
            t = parse_tables(build_tables(manifest, lay, program, rank).blob)
            for i, c in enumerate(t["copies"]):
                if int(c["dst_buf"]) == out_id:
                    bad.append((rank, int(c["dst_rank"]), "writes"))
                bufs, *_ = copy_rows(t, i)
                if (bufs == out_id).any() and int(c["src_rank"]) != rank and int(c["step_index"]) not in proxied:
                    bad.append((rank, int(c["src_rank"]), "reads"))
    return bad


@pytest.mark.parametrize("name", ALL)
def test_the_decision_matches_what_every_ranks_tables_read(name):
    tokens, chunk = SIZES.get(name, (24, 3))
    plan, *_ = small_case(name, tokens, chunk)
    plan.workload.tokens = tokens
    routings = ROUTINGS if plan.num_ranks <= 8 else ROUTINGS[:1]
    for rdma in _lowerings(plan):
        b = codegen.generate(plan, source_of(name), codegen.CudaOptions(rdma=rdma))
        m = b.manifest
        for program, buf in CALLER_INPUTS.items():
            ci = m[f"{program}_input"]
            assert ci["buffer"] == buf
            assert ci["caller_rows"] == (name in CALLER_ROWS[program]), (rdma, program, ci)
            bad = _foreign(plan, b, routings, program)
            if ci["caller_rows"]:
                assert not bad, (rdma, program, bad[:5])
            else:
                assert bad, (rdma, program, ci["why"])  # tight: some rank's kernel does read a peer's rows
                assert f"reads {buf} of rank" in ci["why"]


def test_the_reason_names_the_step_and_its_line():
    m = codegen.generate(plan_of("h200x4_2vnode"), source_of("h200x4_2vnode")).manifest
    text = Path(source_of("h200x4_2vnode")).read_text(encoding="utf-8")
    line = text[:text.index('  step fwd "')].count("\n") + 1  # where the schedule declares the step
    assert m["combine_input"] == {"buffer": "output", "caller_rows": False,
                                  "why": f"combine step 'fwd' (line {line}) reads output of rank 1 on rank 0 (over p2p)"}


def test_the_dispatch_reason_names_the_pulling_step_and_its_line():
    m = codegen.generate(plan_of("ocs_ep16"), source_of("ocs_ep16"), codegen.CudaOptions(rdma="emulate")).manifest
    text = Path(source_of("ocs_ep16")).read_text(encoding="utf-8")
    line = text[:text.index('  step p1_peer ')].count("\n") + 1
    assert m["dispatch_input"] == {"buffer": "input", "caller_rows": False,
                                   "why": f"dispatch step 'p1_peer' (line {line}) reads input of rank 1 on rank 0 "
                                          f"(over p2p)"}


def test_a_step_writing_the_input_buffer_or_left_to_an_outside_proxy_refuses():
    plan = copy.deepcopy(plan_of("h200x2_2vnode"))
    assert foreign_reads(plan, "combine", "output", set()) is None
    kernel = next(k for k in codegen.generate(plan, source_of("h200x2_2vnode")).kernels if k.program == "combine")
    outside = codegen.caller_input(plan, "combine", kernel, [{"program": "combine", "step": "keep", "kind": "rdma"}])
    assert not outside["caller_rows"]
    assert outside["why"] == "combine step 'keep' is left to a proxy outside the kernels, which reads output itself"
    assert codegen.caller_input(plan, "combine", None, []) == {"buffer": "output", "caller_rows": False,
                                                               "why": "the plan has no combine kernel"}
    kernel = next(k for k in codegen.generate(plan, source_of("h200x2_2vnode")).kernels if k.program == "dispatch")
    outside = codegen.caller_input(plan, "dispatch", kernel, [{"program": "dispatch", "step": "rdma", "kind": "rdma"}])
    assert outside == {"buffer": "input", "caller_rows": False,
                       "why": "dispatch step 'rdma' is left to a proxy outside the kernels, which reads input itself"}
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


@pytest.mark.parametrize("program", CALLER_INPUTS)
def test_the_manifest_field_is_checked_and_optional(program):
    m = codegen.generate(plan_of("h200x2_2vnode"), source_of("h200x2_2vnode")).manifest
    field = f"{program}_input"
    check_cuda_manifest(m)
    older = {k: v for k, v in m.items() if k != field}  # a bundle of an older epcc
    check_cuda_manifest(older)
    wrong = dict(m, **{field: dict(m[field], buffer="nowhere")})
    with pytest.raises(SchemaError, match=f"{field}.buffer: no {program} buffer named 'nowhere'"):
        check_cuda_manifest(wrong)
    with pytest.raises(SchemaError):
        check_cuda_manifest(dict(m, **{field: {"buffer": CALLER_INPUTS[program], "caller_rows": "yes", "why": ""}}))


def test_the_supa_manifest_carries_the_same_decision():
    for name in ("h200x2_2vnode", "h200x4_2vnode", "ocs_ep16"):
        cuda = codegen.generate(plan_of(name), source_of(name)).manifest
        supa = codegen.generate(plan_of(name), source_of(name), target=SUPA).manifest
        for program in CALLER_INPUTS:
            assert cuda[f"{program}_input"] == supa[f"{program}_input"]


@pytest.mark.parametrize("name,indices", [("h200x2_2vnode", "0, 0"), ("h200x4_2vnode", "0, -1"),
                                          ("ocs_ep16", "-1, 0")])
def test_the_sources_take_the_rows_as_a_kernel_argument(name, indices):
    b = codegen.generate(plan_of(name), source_of(name), codegen.CudaOptions(rdma="proxy"))
    launcher_src = next(t for f, t in b.files.items() if f.endswith("_launcher.cu"))
    assert f"constexpr int32_t kCallerBuffer[2] = {{{indices}}};" in launcher_src
    assert "int epcc_cuda_launch_combine_rows(void* ctx, uint64_t out, uint64_t tokens, uint64_t rows," in launcher_src
    assert "int epcc_cuda_launch_dispatch_rows(void* ctx, uint64_t rows, uint64_t stream) {" in launcher_src
    assert "a.caller_buf = caller_rows != 0 ? static_cast<uint32_t>(kCallerBuffer[program]) : 0u;" in launcher_src
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
    assert b.manifest["combine_input"]["caller_rows"] and b.manifest["dispatch_input"]["caller_rows"]
    b.write(tmp_path / "cuda")
    log: list[str] = []
    lib = launcher.Library(launcher.build_library(tmp_path / "cuda", nvcc=NVCC, log=log))
    assert "sm_90a" in " ".join(b.manifest["build"]["command"])
    assert lib.has_caller_rows == {"dispatch": True, "combine": True}


def test_one_reading_of_the_field_for_the_simulator_and_the_runtime():
    """compiler/sim/calls.py and the table engine ask the same question of a manifest: caller rows
    of the program's input buffer; any other buffer, or no field (an older bundle), is a copy."""
    both = {"dispatch": True, "combine": True}
    for m, want in (({"combine_input": {"buffer": "output", "caller_rows": True, "why": ""}}, {"combine"}),
                    ({"combine_input": {"buffer": "output", "caller_rows": False, "why": ""}}, set()),
                    ({"combine_input": {"buffer": "partials", "caller_rows": True, "why": ""}}, set()),
                    ({"dispatch_input": {"buffer": "input", "caller_rows": True, "why": ""}}, {"dispatch"}),
                    ({"dispatch_input": {"buffer": "output", "caller_rows": True, "why": ""}}, set()),
                    ({"dispatch_input": {"buffer": "input", "caller_rows": True, "why": ""},
                      "combine_input": {"buffer": "output", "caller_rows": True, "why": ""}}, {"dispatch", "combine"}),
                    ({}, set()), (None, set())):
        assert {p for p in CALLER_INPUTS if reads_caller_rows(m, p)} == want, m
        assert sim_reads(m) == want, m
        assert {p for p, ok in engine_reads(m or {}, both, CALLER_INPUTS).items() if ok} == want, m
    # a library of an older epcc without the entry point, or a bundle without the program: a copy
    m = {"dispatch_input": {"buffer": "input", "caller_rows": True, "why": ""}}
    assert not engine_reads(m, {"combine": True}, CALLER_INPUTS)["dispatch"]
    assert not engine_reads(m, both, ("combine",))["dispatch"]
