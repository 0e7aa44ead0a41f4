"""The parts of bench/ep_bench/ and tests/gpu/bundles.py that run on a CPU: the simulator
predictions printed beside measured times, the arguments, the dry run end to end, and the derived
emulated-RDMA schedules."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from epcc.plan import Plan
from epcc.sim import SimOptions, simulate
from epcc.sim import SimulationError
from epcc.sim.build import build_plan
from epcc.sim.report import to_dict

ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ep_bench():
    """The modules of the package bench/ep_bench/ (as bench/ep_bench.py imports them)."""
    pytest.importorskip("torch")
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    return SimpleNamespace(**{m: importlib.import_module(f"ep_bench.{m}") for m in ("cli", "predict", "report")})


@pytest.fixture(scope="module")
def bundles():
    return _load(ROOT / "tests" / "gpu" / "bundles.py", "gpu_bundles_under_test")


def _sim_json(tokens: int) -> dict:
    prog = lambda t, s: {"total_ms": t, "serial_ms": s, "bottleneck": {"link_class": "rdma"}}  # noqa: E731
    steps = [{"name": "rdma", "program": "dispatch", "start_ms": 0.005, "end_ms": 1.2},
             {"name": "fwd", "program": "dispatch", "start_ms": 0.05, "end_ms": 1.25}]
    return {"tokens": tokens, "programs": {"dispatch": prog(1.25, 1.6), "combine": prog(1.2, 1.5)}, "steps": steps}


def _report(sim: dict | None, tokens: int, d_ms: float, c_ms: float) -> dict:
    b = {"name": "v", "workload": {"tokens": tokens},
         "methods": {"epcc": {"summary": {"dispatch": {"median_ms": d_ms}, "combine": {"median_ms": c_ms}}}}}
    if sim is not None:
        b["simulate"] = sim
    return {"bundles": [b]}


def test_prediction_loaded_and_compared(ep_bench, tmp_path):
    (tmp_path / "simulate.json").write_text(json.dumps(_sim_json(4096)))
    sim = ep_bench.predict.load_prediction(tmp_path)
    assert sim["dispatch"]["total_ms"] == 1.25 and sim["combine"]["bottleneck"] == "rdma"
    lines = ep_bench.report.format_predictions(_report(sim, 4096, 1.5, 1.2))
    assert lines[0].startswith("against epcc simulate")
    assert "dispatch measured 1.500 ms, simulate 1.250 ms (+20 %" in lines[1]
    assert "combine measured 1.200 ms, simulate 1.200 ms (+0 %" in lines[1]


def test_timeline_printed_beside_the_simulated_steps(ep_bench, tmp_path):
    (tmp_path / "simulate.json").write_text(json.dumps(_sim_json(4096)))
    rep = _report(ep_bench.predict.load_prediction(tmp_path), 4096, 1.3, 1.2)
    role = lambda s, a, b: {"step": s, "blocks": 4, "start_ms": a, "end_ms": b}  # noqa: E731
    tl = {"dispatch": {"roles": [role("rdma", 0.01, 1.21), role("fwd", None, None)], "end_ms": 1.3},
          "combine": {"roles": [role("rdma", 0.0, 1.1)], "end_ms": 1.2}}
    rep["bundles"][0]["methods"]["epcc"]["per_rank"] = [{"timeline": tl}]
    lines = ep_bench.report.format_predictions(rep)
    assert lines[2] == ("  dispatch rank 0 timeline, ms: rdma 0.010-1.210 (sim 0.005-1.200), fwd no rows "
                        "(sim 0.050-1.250); kernel end 1.300")
    assert lines[3] == "  combine rank 0 timeline, ms: rdma 0.000-1.100; kernel end 1.200"


def test_the_metadata_kernels_are_named_and_left_out_of_the_timeline(ep_bench, tmp_path):
    # simulate.json of a bundle whose metadata kernels run before the dispatch kernel: the line says
    # how much of the prediction they are; the role timeline starts at the dispatch kernel's barrier
    sim = _sim_json(4096)
    sim["programs"]["dispatch"]["metadata_us"] = {"gather": 2.0, "rows": 3.0}
    sim["programs"]["combine"]["metadata_us"] = {}
    (tmp_path / "simulate.json").write_text(json.dumps(sim))
    pred = ep_bench.predict.load_prediction(tmp_path)
    assert pred["dispatch"]["metadata_us"] == {"gather": 2.0, "rows": 3.0} and pred["combine"]["metadata_us"] == {}
    rep = _report(pred, 4096, 1.3, 1.2)
    role = lambda s, a, b: {"step": s, "blocks": 4, "start_ms": a, "end_ms": b}  # noqa: E731
    tl = {"dispatch": {"roles": [role("rdma", 0.01, 1.21)], "end_ms": 1.3},
          "combine": {"roles": [role("rdma", 0.0, 1.1)], "end_ms": 1.2}}
    rep["bundles"][0]["methods"]["epcc"]["per_rank"] = [{"timeline": tl}]
    lines = ep_bench.report.format_predictions(rep)
    assert "dispatch measured 1.300 ms, simulate 1.250 ms (+4 %; metadata kernels 5 us included, serial sum" in lines[1]
    assert "combine measured 1.200 ms, simulate 1.200 ms (+0 %; serial sum" in lines[1]
    assert lines[2] == "  dispatch rank 0 timeline, ms: rdma 0.010-1.210 (sim 0.000-1.195); kernel end 1.300"


def test_prediction_for_other_tokens_not_compared(ep_bench, tmp_path):
    lines = ep_bench.report.format_predictions(_report({"tokens": 4096, **_sim_json(4096)}, 64, 1.0, 1.0))
    assert lines[1] == "v: simulate.json is for 4096 tokens, the run for 64: not compared"


@pytest.mark.parametrize("run_sms, compared", [({"dispatch": 24, "combine": 24}, True),
                                               ({"dispatch": 64, "combine": 24}, False)])
def test_prediction_for_other_sms_not_compared(ep_bench, tmp_path, run_sms, compared):
    # simulate.json of a direct-kernel bundle names the SMs it assumed; a tuned run may use others
    sim = dict(_sim_json(4096), model={"sm": {"model": "direct", "sms": {"dispatch": 24, "combine": 24}}})
    (tmp_path / "simulate.json").write_text(json.dumps(sim))
    pred = ep_bench.predict.load_prediction(tmp_path)
    assert pred["sms"] == {"dispatch": 24, "combine": 24}
    rep = _report(pred, 4096, 1.0, 1.0)
    rep["bundles"][0]["methods"]["epcc"]["sms"] = run_sms
    lines = ep_bench.report.format_predictions(rep)
    if compared:
        assert lines[1].startswith("v: dispatch measured 1.000 ms, simulate 1.250 ms")
    else:
        assert lines[1] == ("v: simulate.json is for 24/24 SMs, the run used 64/24: not compared "
                            "(`epcc simulate --sms N` predicts other SM counts)")


def test_no_prediction_no_lines(ep_bench, tmp_path):
    assert ep_bench.predict.load_prediction(tmp_path) is None
    assert ep_bench.report.format_predictions(_report(None, 64, 1.0, 1.0)) == []


@pytest.mark.parametrize("name", ["h200x4_2vnode_13", "h200x4_ubb2x2_13"])
def test_rdma_variant_changes_only_the_rdma_bandwidth(bundles, tmp_path, name):
    sched, link, gbps = bundles.RDMA_VARIANTS[name]
    shipped = (ROOT / "schedules" / f"{sched}.sched").read_text(encoding="utf-8").splitlines()
    derived = bundles.rdma_source(tmp_path, name).read_text(encoding="utf-8").splitlines()
    assert derived[0].startswith("# derived from")
    changed = [(a, b) for a, b in zip(shipped, derived[1:]) if a != b]
    assert len(derived) == len(shipped) + 1 and len(changed) == 1
    assert changed[0][0].strip().startswith("bandwidth 50 GB/s") and changed[0][1].strip() == f"bandwidth {gbps} GB/s"


def test_rdma_variant_at_the_shipped_rate_is_the_shipped_file(bundles, tmp_path):
    assert bundles.rdma_source(tmp_path, "h200x4_2vnode_50") == ROOT / "schedules" / "h200x4_2vnode.sched"


def test_rdma_variant_of_a_file_without_the_link_is_refused(bundles, tmp_path, monkeypatch):
    monkeypatch.setitem(bundles.RDMA_VARIANTS, "x", ("h200x4", "rdma", 13))
    with pytest.raises(SystemExit) as e:
        bundles.rdma_source(tmp_path, "x")
    assert str(e.value) == f"{ROOT / 'schedules' / 'h200x4.sched'}: cannot find the bandwidth line of link 'rdma'"


@pytest.mark.parametrize("strict", [False, True])
def test_strict_exits_1_when_a_bundle_failed(tmp_path, strict):
    """--strict (what the GPU tests run) turns any failed bundle or method into exit status 1."""
    pytest.importorskip("torch")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cmd = [sys.executable, str(ROOT / "bench" / "ep_bench.py"), "--dry-run", "--methods", "epcc", "--out",
           str(tmp_path), "--bundles", str(tmp_path / "no_such_bundle"), *(["--strict"] if strict else [])]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == (1 if strict else 0), r.stdout + r.stderr
    report = json.loads((tmp_path / "ep_bench.json").read_text())
    assert "error" in report["bundles"][0]
    assert ("--strict: 1 failed: no_such_bundle: " in r.stdout) == strict


def test_rdma_chunkings_parse_and_refuse(ep_bench):
    assert ep_bench.cli.rdma_chunkings("32x16,64x8,64x,x4,64x8", {}) == [(32, 16), (64, 8), (64, None), (None, 4)]
    assert ep_bench.cli.rdma_chunkings(None, {}) == []
    assert ep_bench.cli.rdma_chunkings(None, {"EPCC_RDMA_CHUNK_TOKENS": "48"}) == [(48, None)]
    assert ep_bench.cli.chunking_label((64, None)) == "64x"
    for bad, msg in (
            ("64", "--rdma-chunks: '64' is not TOKENSxDEPTH (e.g. 64x8, 64x or x8)"),
            ("x", "--rdma-chunks: 'x' gives neither tokens nor depth"),
            ("0x8", "--rdma-chunks 0x8: tokens=0: must be >= 1"),
            ("64x99999", "--rdma-chunks 64x99999: depth=99999: must be between 1 and 65536"),
            ("ax8", "--rdma-chunks ax8: tokens='a': expected a positive whole number")):
        with pytest.raises(ValueError) as e:
            ep_bench.cli.rdma_chunkings(bad, {})
        assert str(e.value) == msg
    with pytest.raises(ValueError) as e:
        ep_bench.cli.rdma_chunkings(None, {"EPCC_RDMA_DEPTH": "0"})
    assert str(e.value) == "EPCC_RDMA_DEPTH=0: must be between 1 and 65536"


def test_a_bad_rdma_chunking_exits_1_naming_it(ep_bench, capsys):
    with pytest.raises(SystemExit) as e:
        ep_bench.cli.parse(["--bundles", "b", "--out", "o", "--rdma-chunks", "64x0"])
    assert e.value.code == 1
    assert capsys.readouterr().err == "ep_bench: error: --rdma-chunks 64x0: depth=0: must be between 1 and 65536\n"


def test_a_rechunked_plan_is_predicted_as_if_compiled_so(ep_bench, tmp_path):
    """--rdma-chunks re-chunks the bundle's plan at run time and simulates it there (no MLIR on
    the GPU machine): the same prediction as compiling the schedule with that chunking."""
    src = (ROOT / "schedules" / "h200x2_2vnode.sched").read_text(encoding="utf-8")
    plan = Plan.from_json(build_plan(str(ROOT / "schedules" / "h200x2_2vnode.sched")).plan.to_json())
    rechunked = ep_bench.predict.rechunk(plan, (32, 4))
    assert ep_bench.predict.rdma_chunking_of(rechunked) == {
        "dispatch.rdma": {"chunk_tokens": 32, "depth": 4, "chunks": 128},
        "combine.rdma": {"chunk_tokens": 32, "depth": 4, "chunks": 128}}
    text = src.replace("send tokens for rail.vnode from input to rail.rdma_recv over rdma\n",
                       "send tokens for rail.vnode from input to rail.rdma_recv over rdma chunk 32 tokens depth 4\n")
    assert text != src
    (tmp_path / "h200x2_2vnode.sched").write_text(text, encoding="utf-8")
    compiled = build_plan(str(tmp_path / "h200x2_2vnode.sched")).plan
    want = ep_bench.predict.prediction(to_dict(simulate(compiled, SimOptions(rdma_proxy=True)), tokens=4096))
    got = ep_bench.predict.predict(rechunked, T=4096)
    assert got == want
    assert got["dispatch"]["total_ms"] != ep_bench.predict.predict(plan, T=4096)["dispatch"]["total_ms"]
    # a bundle whose manifest has the metadata kernels: their time before the dispatch, from the manifest
    manifest = {"metadata": {"lowering": "device", "blocks": {"meta_count": 64, "meta_rows": 256, "meta_items": 6},
                             "steps": [{"program": "dispatch", "step": "meta"}]}}
    meta = ep_bench.predict.predict(rechunked, T=4096, manifest=manifest)
    assert sum(meta["dispatch"]["metadata_us"].values()) > 50 and meta["combine"]["metadata_us"] == {}
    assert meta["dispatch"]["total_ms"] > got["dispatch"]["total_ms"]
    # and the Buffer call's copies beside the kernels (sim/calls.py), in both programs
    for p in ("dispatch", "combine"):
        assert meta[p]["calls_us"] and not got[p]["calls_us"]
    assert meta["combine"]["total_ms"] == pytest.approx(got["combine"]["total_ms"]
                                                        + sum(meta["combine"]["calls_us"].values()) / 1e3)
    # host-built tables (`--proxy-tables host`): no metadata kernels, the same copies
    host = ep_bench.predict.predict(rechunked, T=4096, manifest={"metadata": {"lowering": "host", "why": "x"}})
    assert host["dispatch"]["metadata_us"] == {}
    for p in ("dispatch", "combine"):
        assert host[p]["calls_us"] == pytest.approx(meta[p]["calls_us"])
    # a combine that reads the caller's expert outputs in place (manifest combine_input): no copy of them
    assert "rows" in meta["combine"]["calls_us"]
    caller = {**manifest, "combine_input": {"buffer": "output", "caller_rows": True, "why": "x"}}
    zcopy = ep_bench.predict.predict(rechunked, T=4096, manifest=caller)
    assert list(zcopy["combine"]["calls_us"]) == ["zero", "convert", "gaps"]
    assert zcopy["dispatch"] == meta["dispatch"]
    assert zcopy["combine"]["total_ms"] < meta["combine"]["total_ms"] - meta["combine"]["calls_us"]["rows"] / 1e3 * 0.99


def test_rechunked_proxy_bundle_runs_through_buffer(tmp_path):
    """--rdma-chunks end to end, on the CPU: a proxy bundle runs once per chunking (2 ranks, gloo)
    through Buffer(backend="cpu", rdma_chunk_tokens=, rdma_depth=), each run's layout at that
    chunking and every result checked against the oracle; the cached-handle row is skipped
    (the cpu backend has none); a bundle without the proxy path runs once."""
    pytest.importorskip("torch")
    bundle = tmp_path / "b"
    r = subprocess.run([sys.executable, "-m", "epcc.cli", "compile", str(ROOT / "schedules" / "h200x2_2vnode.sched"),
                        "--target", "cuda", "--rdma", "proxy", "-o", str(bundle)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "bench" / "ep_bench.py"), "--dry-run", "--strict", "--methods", "epcc", "--tokens", "32",
           "--iters", "2", "--warmup", "1", "--out", str(tmp_path / "out"), "--bundles", str(bundle),
           "--rdma-chunks", "8x2,16x"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "ep_bench.json").read_text())
    runs = {b["name"]: b for b in report["bundles"]}
    assert set(runs) == {"b@8x2", "b@16x"}
    got = runs["b@8x2"]["rdma_chunking"]["dispatch.rdma"]  # chunks: of the plan's 4096 tokens per rank
    assert (got["chunk_tokens"], got["depth"]) == (8, 2) and got["chunks"] > 500
    assert runs["b@16x"]["rdma_chunking"]["combine.rdma"]["chunk_tokens"] == 16
    # the engines laid out and ran the plan at that chunking (the layout their handles carry)
    assert {r["rdma_chunk_rows"]["dispatch.rdma"] for r in runs["b@8x2"]["methods"]["epcc"]["per_rank"]} == {8}
    assert {r["rdma_chunk_rows"]["combine.rdma"] for r in runs["b@16x"]["methods"]["epcc"]["per_rank"]} == {16}
    for b in runs.values():  # both ranks' results matched the oracle, timed 2 iterations
        epcc = b["methods"]["epcc"]
        assert len(epcc["check"]) == 2 and all(c and c["max_ulp"] <= 2 for c in epcc["check"]), epcc["check"]
        assert len(epcc["summary"]["dispatch"]["iter_max_over_ranks_ms"]) == 2
        assert epcc["host_ms_max"] > 0 and epcc["sms"] == {"dispatch": 32, "combine": 33}  # keep_far on 16 SMs
        assert "no cached-handle dispatch" in b["methods"]["epcc_cached"]["skipped"]
    assert "against epcc simulate: not compared (a dry run: wall-clock times on the CPU)" in r.stdout


def test_a_plan_that_cannot_be_simulated_has_no_prediction_and_says_why(ep_bench, monkeypatch, capsys):
    plan = Plan.from_json(build_plan(str(ROOT / "schedules" / "h200x2_2vnode.sched")).plan.to_json())

    def fail(*a, **k):
        raise SimulationError("step 'rdma' has no resources")

    monkeypatch.setattr(ep_bench.predict, "simulate", fail)  # the simulator as the bench calls it
    assert ep_bench.predict.predict(plan, T=4096) is None
    assert capsys.readouterr().err == ("ep_bench: cannot simulate the re-chunked plan: SimulationError: "
                                       "step 'rdma' has no resources\n")


def test_proxy_cost_line(ep_bench):
    """What the bench prints per program for the GPU proxy: writes, mean host time per post call,
    chunks found waiting per FIFO pass; the backlog only where the proxy loop counted it."""
    st = {"writes_posted": 4590, "post_ns": 26_392_500, "drained": 4500, "passes": 411}
    assert ep_bench.report.proxy_cost(st) == ("4590 writes, 5.75 us mean host time per post call, "
                                       "10.9 chunks waiting per FIFO pass")
    assert ep_bench.report.proxy_cost({"writes_posted": 0, "post_ns": 0}) == "0 writes"
    assert ep_bench.report.proxy_cost({"writes_posted": 8, "post_ns": 8000}) == "8 writes, 1.00 us mean host time per post call"
    # a paced (emulated) transport also says how long its link idled inside streams and how late its signals went
    paced = {"writes_posted": 128, "post_ns": 256_000, "link_idle_ns": 90_000, "link_gaps": 6, "signal_lag_ns": 320_000,
             "signals": 64}
    assert ep_bench.report.proxy_cost(paced) == (
        "128 writes, 2.00 us mean host time per post call, link idle 90 us inside streams in 6 gaps (15.0 us each), "
        "signals issued 5.00 us after their paced landing on average")
    assert "link idle" not in ep_bench.report.proxy_cost({**paced, "link_gaps": 0, "link_idle_ns": 0})
