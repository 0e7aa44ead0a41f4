"""`epcc simulate` picks the SM model of the kernels that run the plan (Plan.direct, recorded by
kernel-formation from plan/direct.py: the direct kernels where the CUDA target lowers the plan to
them) and says which; --kernels and --sms; the bundles' simulate.json."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from epcc.cli import main
from epcc.plan.direct import direct_kernels, dispatch_launches, meta_passes
from epcc.sim.build import build_plan

REPO = Path(__file__).resolve().parents[2]
H200X4 = REPO / "schedules" / "h200x4.sched"
EP16 = REPO / "schedules" / "ubbv2_ep16.sched"


SM_LINE = "  sm copy 50 GB/s, read 200 GB/s, reduce 80 GB/s, launch 5 us\n"  # the tests' own rates


@pytest.fixture
def rated(tmp_path) -> str:
    """h200x4.sched with the tests' own `sm` line instead of its own (if any)."""
    text = re.sub(r"\n  sm [^\n]*", "", H200X4.read_text(encoding="utf-8"))
    assert "  rank gpu\n" in text
    path = tmp_path / "h200x4.sched"
    path.write_text(text.replace("  rank gpu\n", "  rank gpu\n" + SM_LINE, 1), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("tokens, passes", [(1, 1), (256, 1), (257, 2), (4096, 2)])
def test_meta_passes(tokens, passes):
    # one pass counts each chunk of 256 tokens; above one chunk a second finishes the ranks
    assert meta_passes(tokens) == passes


@pytest.mark.parametrize("tokens, warps, launches", [
    (128, 16, 1), (256, 16, 1), (128, 4, 2), (257, 16, 3), (4096, 16, 3), (4096, 4, 3)])
def test_dispatch_launches(tokens, warps, launches):
    # up to one metadata chunk the dispatch kernel counts the metadata itself when its blocks
    # have the threads; else meta_count_kernel, and meta_finish_kernel above one chunk
    assert dispatch_launches(tokens, warps) == launches


def test_only_plans_the_cuda_target_lowers_to_direct_kernels_get_them():
    ep16 = build_plan(str(EP16)).plan
    assert ep16.direct is None and "do not fit one CUDA IPC domain" in ep16.direct_not_used
    plan = build_plan(str(H200X4)).plan
    kernels = plan.direct  # kernel-formation recorded plan/direct.py's answer
    assert direct_kernels(plan) == (kernels, None) and plan.direct_not_used is None
    assert kernels.sms == {"dispatch": 24, "combine": 24}  # the push step's `sms 24`
    assert kernels.launches == {"dispatch": 3, "combine": 1}
    assert kernels.meta_passes == {"dispatch": 2}  # 4096 tokens: count the chunks, then finish them
    assert kernels.warps == {"dispatch": 16, "combine": 16}
    assert kernels.with_sms(64).sms == {"dispatch": 64, "combine": 64}


# --------------------------------------------------------------------------- epcc simulate


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_uses_the_direct_kernels_where_they_run_and_says_so(capsys, rated):
    code, out, err = run(["simulate", rated], capsys)
    assert code == 0, err
    assert "SM model: direct kernels: one pool of SMs per rank and program" in out
    assert "dispatch 24 SMs, 3 launches, 2 metadata passes, drain " in out
    assert "combine 24 SMs, 1 launch, drain " in out
    # one launch charged (the later ones queue behind the running kernel); no `meta` on this line
    assert "kernel launch and metadata 0.005 ms before the first step included" in out
    code, out, err = run(["simulate", rated, "--kernels", "table"], capsys)
    assert code == 0, err
    assert "SM model: SM roles of the table-driven kernels" in out
    code, out, err = run(["simulate", str(EP16)], capsys)
    assert code == 0, err
    assert "SM model: links only" in out


def test_simulate_json_names_the_model_and_the_launches(capsys, rated):
    code, out, err = run(["simulate", rated, "--json", "--sms", "64", "--tokens", "128"], capsys)
    assert code == 0, err
    d = json.loads(out)
    sm = d["model"]["sm"]
    assert sm["model"] == "direct" and sm["sms"] == {"dispatch": 64, "combine": 64}
    assert sm["launches"] == {"dispatch": 1, "combine": 1} and sm["launch_us"] == pytest.approx(5.0)
    assert sm["rates_gbps"] == {"copy": 50, "read": 200, "reduce": 80}
    assert d["programs"]["dispatch"]["launch_ms"] == pytest.approx(0.005)
    assert d["programs"]["combine"]["launch_ms"] == pytest.approx(0.005)


def test_more_sms_make_a_pool_bound_program_faster(capsys, rated):
    totals = []
    for sms in ("8", "16"):
        code, out, err = run(["simulate", rated, "--json", "--sms", sms], capsys)
        assert code == 0, err
        d = json.loads(out)
        assert d["programs"]["combine"]["bottleneck"]["link_class"] == "sm"
        totals.append(d["programs"]["combine"]["total_ms"] - d["programs"]["combine"]["launch_ms"])
    assert totals[1] == pytest.approx(totals[0] / 2, rel=0.02)


def test_a_cached_dispatch_runs_no_metadata(capsys):
    """--cached: the dispatch of a cached handle launches no metadata kernel and counts none in its
    kernel (h200x4.sched's `sm` line: launch 9 us, meta 5.8 us for the first pass; a second, at 4096
    tokens, sim/direct.py META_FINISH_S 14.7 us) nor publishes it to the 3 peers (0.35 us each,
    META_PEER_S); the combine is the same.  Measured, 4 x H100, 2026-11-27 (the decode run, after the
    peers' flags went parallel): the cached row 6.8-6.9 us under the fresh one at 128 tokens (the model:
    6.85); the 4096-token rows of the earlier run (the flags one after another) 28-30 us (the model: 21.55).
    """
    got = {}
    for tokens in ("4096", "128"):
        for argv in ([], ["--cached"], ["--sms", "64", "--cached"]):
            code, out, err = run(["simulate", str(H200X4), "--json", "--tokens", tokens, *argv], capsys)
            assert code == 0, err
            d = json.loads(out)
            got[tokens, tuple(argv)] = d
            assert d["model"]["sm"]["launches"]["dispatch"] == (1 if argv else 3 if tokens == "4096" else 1)
        fresh, cached = got[tokens, ()]["programs"], got[tokens, ("--cached",)]["programs"]
        meta = 0.0058 + (0.0147 if tokens == "4096" else 0.0) + 3 * 0.00035
        assert fresh["dispatch"]["launch_ms"] - cached["dispatch"]["launch_ms"] == pytest.approx(meta)
        assert fresh["dispatch"]["total_ms"] - cached["dispatch"]["total_ms"] == pytest.approx(meta)
        assert cached["combine"] == fresh["combine"]
        assert got[tokens, ("--sms", "64", "--cached")]["model"]["sm"]["sms"] == {"dispatch": 64, "combine": 64}


@pytest.mark.parametrize("argv, flag", [(["--kernels", "direct"], "--kernels direct"), (["--sms", "64"], "--sms"),
                                        (["--cached"], "--cached")])
def test_direct_options_on_a_plan_without_direct_kernels_exit_1(capsys, argv, flag):
    code, out, err = run(["simulate", str(EP16)] + argv, capsys)
    assert code == 1 and out == ""
    assert err == (f"epcc: error: {flag}: the CUDA target does not lower {EP16} to direct kernels: 16 ranks do not "
                   "fit one CUDA IPC domain (at most 8)\n")


@pytest.mark.parametrize("argv, msg", [
    (["--sms", "0"], "--sms 0: SMs must be at least 1"),
    (["--sms", "many"], "--sms many: expected a whole number of SMs"),
    (["--sms", "8", "--kernels", "table"],
     "--sms applies to the direct kernels, not to --kernels table (the plan's `sms` give the roles)"),
    (["--cached", "--kernels", "table"],
     "--cached applies to the direct kernels, not to --kernels table (a cached handle of the table-driven kernels "
     "runs the same kernels)"),
])
def test_bad_sms_exit_1(capsys, argv, msg):
    code, out, err = run(["simulate", str(H200X4)] + argv, capsys)
    assert code == 1 and out == "" and err == f"epcc: error: {msg}\n"


def test_the_bundles_simulate_json_uses_the_model_their_kernels_run(capsys, tmp_path, gpu_bundles):
    # tests/gpu/bundles.py stores `epcc simulate --json` beside every bundle: the one-hop plans'
    # with the direct kernels' pool, the RDMA plans' (table-driven kernels) with their SM roles
    b = gpu_bundles
    code, out, err = run(["simulate", str(b.ep2_source(tmp_path)), "--json", "--rdma", "proxy"], capsys)
    assert code == 0, err
    assert json.loads(out)["model"]["sm"]["model"] == "direct"
    code, out, err = run(["simulate", str(b.rdma_source(tmp_path, "h200x2_2vnode_50")), "--json", "--rdma", "emulate"],
                         capsys)
    assert code == 0, err
    assert json.loads(out)["model"]["sm"]["model"] == "roles"


def _sim(capsys, *argv: str) -> dict:
    code, out, err = run(["simulate", str(H200X4), "--json", *argv], capsys)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("argv", [[], ["--dtype", "fp8"], ["--tokens", "128"], ["--sms", "64", "--cached"]])
def test_token_major_is_simulated_with_a_smaller_dispatch(capsys, argv):
    """`--layout token` runs as the token-major direct kernels (sim/token_major.py): the same pool,
    launches and metadata as the expert-major ones, one row per token and GPU instead of one per
    expert (the permute's rows / e), no replication, the dispatch's peer links at the store rate:
    a smaller dispatch than the expert-major one at the same shape."""
    expert, token = _sim(capsys, *argv), _sim(capsys, "--layout", "token", *argv)
    assert expert["model"]["sm"]["layout"] == "expert" and token["model"]["sm"]["layout"] == "token"
    assert "token-major direct kernels" in token["model"]["sm"]["text"]
    for key in ("sms", "launches", "meta_passes"):
        assert token["model"]["sm"][key] == expert["model"]["sm"][key]
    assert token["programs"]["dispatch"]["launch_ms"] == expert["programs"]["dispatch"]["launch_ms"]
    assert token["programs"]["dispatch"]["total_ms"] < expert["programs"]["dispatch"]["total_ms"]
    assert token["model"]["sm"]["drain_us"]["dispatch"] == 0  # no second phase: a row is done when it lands

    def step_bytes(d: dict, program: str, name: str) -> float:
        return next(s["bytes"] for s in d["steps"] if s["program"] == program and s["name"] == name)
    # a send counts its tokens in both layouts; a token-major row adds the top-k ids (int64), weights (fp32)
    # and its token (int32) to the payload, where an expert-major one carries 8 bytes per top-k slot
    assert step_bytes(token, "dispatch", "push") == pytest.approx(step_bytes(expert, "dispatch", "push") * (
        1 + (8 * 12 + 4 - 8 * 8) / (14400 if "fp8" not in argv else 7456)))
    # the own GPU's rows: one per token, not one per local expert (2.21 expected of the 8 on 4 GPUs)
    assert step_bytes(token, "dispatch", "keep") < step_bytes(expert, "dispatch", "keep") / 2
    assert step_bytes(token, "combine", "push") == pytest.approx(step_bytes(expert, "combine", "push"))


def test_token_major_dispatch_is_bound_by_the_link_at_the_store_rate(capsys):
    """4 GPUs, 4096 tokens: the token-major dispatch moves its remote rows at 341 / 279 x the declared
    NVLink rate (costmodel/rates.py STORE_ONLY_GAIN), whatever the SMs; the combine at the declared rate."""
    from_24, from_96 = (_sim(capsys, "--layout", "token", "--cached", "--sms", n) for n in ("24", "96"))
    for d in (from_24, from_96):
        assert d["programs"]["dispatch"]["bottleneck"]["link_class"] == "nvlink"
    assert from_96["programs"]["dispatch"]["total_ms"] == pytest.approx(from_24["programs"]["dispatch"]["total_ms"],
                                                                        rel=0.01)
    sent = next(s for s in from_24["steps"] if s["program"] == "dispatch" and s["name"] == "push")
    # a rank's port carries its sends to the 3 peers: bytes of the busiest rank / (279 GB/s x 341 / 279)
    kernel = from_24["programs"]["dispatch"]["total_ms"] - from_24["programs"]["dispatch"]["launch_ms"]
    assert kernel == pytest.approx(sent["max_rank_bytes"] / 341e9 * 1e3, rel=0.03)


def test_token_major_needs_the_direct_kernels(capsys):
    """No token-major kernels to simulate: the table-driven ones (--kernels table) and a plan the CUDA
    target does not lower to direct kernels write expert-major output (as `epcc compile` says)."""
    code, out, err = run(["simulate", str(H200X4), "--layout", "token", "--kernels", "table"], capsys)
    assert code == 1 and out == ""
    assert err == (f"epcc: error: {H200X4}: cannot simulate the token-major layout: --kernels table: the table-driven "
                   f"kernels write expert-major output\n")
    code, out, err = run(["simulate", str(EP16), "--layout", "token"], capsys)
    assert code == 1 and out == ""
    assert err == (f"epcc: error: {EP16}: cannot simulate the token-major layout: the CUDA target writes token-major "
                   f"output with its direct kernels only, and this plan is not lowered to them (16 ranks do not fit "
                   f"one CUDA IPC domain (at most 8))\n")
