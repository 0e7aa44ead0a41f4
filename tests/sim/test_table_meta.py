"""The table-driven kernels' metadata on the GPU in the simulator (compiler/sim/meta.py): its
calibration reproduces the measurement it came from, it grows with tokens and ranks, it sits
before the dispatch's first step only, it is zero where the bundle has no metadata kernels (direct
kernels; the host lays the routing out), and `epcc simulate` reports it with its parts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from epcc.cli import main
from epcc.cli.simulate import table_metadata
from epcc.passes import PassOptions
from epcc.sim import SimOptions, SimulationError, simulate
from epcc.sim.base import DeviceMetadata
from epcc.sim.build import build_plan
from epcc.sim.meta import (BARRIER_S, FUSED_DEVICE_US, FUSED_WHOLE_US, GAP_S, H100_MEASURED_US, H100_WHOLE_US,
                           STEP_MEASURED_US, STEP_PROFILED_SIGNAL_US, STEP_WHOLE_US, between_boxes_link, boxes,
                           exchange_link, from_manifest, metadata_terms, ring_latency, waves)

REPO = Path(__file__).resolve().parents[2]
VNODE2 = str(REPO / "schedules" / "h200x2_2vnode.sched")
VNODE4 = str(REPO / "schedules" / "h200x4_2vnode.sched")


def _plan(path: str, tokens: int | None = None):
    return build_plan(path, PassOptions(tokens=tokens)).plan


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_calibration_gives_back_the_measurement():
    # h200x2_2vnode_50 as measured (2 x H100, 2026-11-27, one device call of bench/meta_time.py --grid
    # 0,default): 64 count blocks, 256 rows blocks, 6 items blocks, the gather's 256 KiB over NVLink
    # (450 GB/s) rather than the plan's RDMA link; the CUDA bundle launches meta_fused
    plan = _plan(VNODE2)
    meta = table_metadata(plan, "emulate")
    assert (meta.count_blocks, meta.scan_blocks, meta.rows_blocks, meta.items_blocks, meta.fused) == (64, 137, 256, 6,
                                                                                                      True)
    assert meta.steps == (("dispatch", "meta"),)
    nvlink = 4096 * 8 * 8 / 450e9 * 1e6
    fused = {k: v * 1e6 for k, v in metadata_terms(plan, meta).items()}
    assert list(fused) == ["gather", "transfer", "signal", "count", "scan", "rows", "items", "barriers", "gaps"]
    assert fused["transfer"] == pytest.approx(4096 * 8 * 8 / 50e9 * 1e6)  # the plan's one link: rdma at 50 GB/s
    assert sum(fused.values()) - fused["transfer"] + nvlink == pytest.approx(FUSED_WHOLE_US)
    assert fused["gaps"] == pytest.approx(GAP_S * 1e6)  # one launch
    # the steps as launches of their own (grid 0, the same processes): each kernel as profiled
    t = {k: v * 1e6 for k, v in metadata_terms(plan, dataclasses.replace(meta, fused=False)).items()}
    assert list(t) == ["gather", "transfer", "signal", "count", "scan", "rows", "items", "gaps"]
    assert t["gather"] + nvlink == pytest.approx(STEP_MEASURED_US["gather_copy"])
    for part, kernel in (("count", "meta_count"), ("scan", "meta_scan"), ("rows", "meta_rows"), ("items", "meta_items")):
        assert t[part] == pytest.approx(STEP_MEASURED_US[kernel]) == pytest.approx(fused[part]), part
    assert sum(t.values()) - t["transfer"] + nvlink + GAP_S * 1e6 == pytest.approx(STEP_WHOLE_US)
    # the gaps: the 2 x H100 calibration's of 2026-11-26 (its events less its six kernels, the flag wait
    # timed apart); the flag wait, the rest of the events: above that calibration's round trip, below the
    # profiler's wait (which holds the peer's lateness under the profiler)
    # (the calibration's six launches; a flag wait's launch, gather_signal_wait, since gone: five)
    assert t["gaps"] * 6 / 5 == pytest.approx(H100_WHOLE_US - sum(H100_MEASURED_US.values()))
    assert H100_MEASURED_US["gather_signal_wait"] < t["signal"] < STEP_PROFILED_SIGNAL_US
    assert t["signal"] == pytest.approx(12.5)
    # the one launch saves five gaps and pays three grid barriers: 1.3 us each, near the design's ~1 us
    # (docs/cuda.md); its profiled device time (the exchange, the wait and the phases) lies under its events
    assert sum(t.values()) + GAP_S * 1e6 - sum(fused.values()) == pytest.approx(STEP_WHOLE_US - FUSED_WHOLE_US)
    assert fused["barriers"] == pytest.approx(3 * BARRIER_S * 1e6) and 1.0 < BARRIER_S * 1e6 < 1.5
    assert FUSED_DEVICE_US < FUSED_WHOLE_US


def test_it_grows_with_the_tokens():
    per_tokens = {}
    for tokens in (1024, 4096, 16384):
        plan = _plan(VNODE2, tokens)
        meta = table_metadata(plan, "emulate")
        assert meta.count_blocks == 2 * tokens // 128
        per_tokens[tokens] = metadata_terms(plan, meta)
    small, mid, big = (per_tokens[t] for t in (1024, 4096, 16384))
    assert big["transfer"] == pytest.approx(4 * mid["transfer"]) and mid["transfer"] == pytest.approx(4 * small["transfer"])
    assert waves(256) == 2 and waves(1024) == 8
    assert big["rows"] > mid["rows"] > small["rows"]  # 8 waves of rows blocks at 16384 tokens, 2 at 4096, 1 at 1024
    assert big["count"] > mid["count"]  # 256 count blocks: 2 waves
    assert big["scan"] == mid["scan"] == small["scan"]  # its sums are per set and (rank, expert), not per token
    assert sum(big.values()) > sum(mid.values()) > sum(small.values())


def test_it_grows_with_the_ranks():
    two, four = _plan(VNODE2), _plan(VNODE4)
    t2 = metadata_terms(two, table_metadata(two, "emulate"))
    m4 = table_metadata(four, "emulate")
    t4 = metadata_terms(four, m4)
    assert m4.count_blocks == 4 * 32 and m4.rows_blocks > 256 and m4.scan_blocks > 2 * 132
    assert t4["rows"] > t2["rows"] and t4["scan"] > t2["scan"] and sum(t4.values()) > sum(t2.values())
    # h200x4_2vnode's peers: the fastest p2p link, NVLink of per-GPU ports (the rank's 3 copies through one port)
    name, bps, ports = exchange_link(four)
    assert (name, ports) == ("nvlink", True)
    assert t4["transfer"] == pytest.approx(3 * 4096 * 8 * 8 / bps)
    assert exchange_link(two)[0::2] == ("rdma", False)  # no p2p link: the RDMA-class pair link


def test_it_delays_the_dispatch_only_and_replaces_the_exchange_step():
    plan = _plan(VNODE2)
    meta = table_metadata(plan, "emulate")
    without = simulate(plan, SimOptions(rdma_proxy=False))
    with_meta = simulate(plan, SimOptions(rdma_proxy=False, metadata=meta))
    total = sum(metadata_terms(plan, meta).values())
    d0, d1 = without.programs["dispatch"], with_meta.programs["dispatch"]
    assert d1.launch_s == pytest.approx(total) and d1.metadata == metadata_terms(plan, meta)
    exchange = d0.step("meta").end_s  # the plan's exchange step: a latency the kernels now pay
    assert exchange > 0 and d1.step("meta").end_s == pytest.approx(total)
    assert d1.makespan_s == pytest.approx(d0.makespan_s + total - exchange)
    assert d1.serial_s == pytest.approx(d0.serial_s + total - exchange)
    c0, c1 = without.programs["combine"], with_meta.programs["combine"]
    assert c1.launch_s == 0 and c1.metadata == {} and c1.makespan_s == c0.makespan_s


def test_zero_without_metadata_kernels():
    # a one-hop plan: its direct kernels have their own metadata (sim/direct.py), and the bundle's
    # table-driven path (`--kernels table`) has the metadata kernels, over CUDA IPC
    assert table_metadata(_plan(str(REPO / "schedules" / "h200x4.sched")), "emulate").exchange == "ipc"
    # the GPU proxy path with host-built tables (`--proxy-tables host`); by default it has them
    assert table_metadata(_plan(VNODE2), "proxy", proxy_device_tables=False) is None
    assert table_metadata(_plan(VNODE2), "proxy") is not None
    # beyond one box the metadata kernels too, the routing all-gathered by the process group
    ep16 = _plan(str(REPO / "schedules" / "ubbv2_ep16.sched"))
    assert table_metadata(ep16, "proxy").exchange == table_metadata(ep16, "emulate").exchange == "collective"


def test_the_collective_exchange_is_charged_by_box():
    """Beyond one box (ubbv2_ep32: 2 nodes of 16 dies, joined by the NIC): every rank receives the
    31 other slots (count and T x K x 8 bytes), 15 over the link inside a box (the fastest p2p:
    blink), 16 over the slowest link between boxes (the NIC); three ring all-gathers' latency as
    NCCL's model counts it; no signal kernel."""
    plan = _plan(str(REPO / "schedules" / "ubbv2_ep32.sched"))
    meta = table_metadata(plan, "proxy")
    assert meta.exchange == "collective"
    t = metadata_terms(plan, meta)
    assert list(t) == ["gather", "transfer", "collective", "count", "scan", "rows", "items", "barriers", "gaps"]
    wl = plan.workload
    slot = wl.tokens * wl.topk * 8  # slot words only: no rank reads another's token count
    assert [b[0] for b in boxes(plan)] == [0, 16] and [len(b) for b in boxes(plan)] == [16, 16]
    assert (exchange_link(plan)[:2], between_boxes_link(plan)) == (("blink", 20e9), ("nic", 10.4e9))
    assert t["transfer"] == pytest.approx(15 * slot / 20e9 + 16 * slot / 10.4e9)
    ll = (3.6 + 30 * 0.47 * 1.8 + 1 * 2.7) * 1e-6
    simple = (8.4 + 30 * 3.4 + 1 * 9.6) * 1e-6
    assert ring_latency(32, 2, "LL") == pytest.approx(ll) and ring_latency(32, 2, "Simple") == pytest.approx(simple)
    assert t["collective"] == pytest.approx(simple)  # one all-gather, of the slot words
    # gather_copy and meta_fused (the all-gathers' launches are in their latency), where over CUDA IPC
    # meta_fused alone; the steps: gather_copy and the four phases either way
    ipc = metadata_terms(plan, dataclasses.replace(meta, exchange="ipc"))
    assert t["gaps"] == pytest.approx(2 * GAP_S) and ipc["gaps"] == pytest.approx(GAP_S)
    steps = {x: metadata_terms(plan, dataclasses.replace(meta, exchange=x, fused=False)) for x in ("collective", "ipc")}
    assert steps["collective"]["gaps"] == pytest.approx(steps["ipc"]["gaps"]) == pytest.approx(5 * GAP_S)
    assert "barriers" not in steps["collective"] and t["barriers"] == ipc["barriers"] == pytest.approx(3 * BARRIER_S)
    # the 2-vnode plan that asks for the collective (the 2-GPU runs of tests/gpu): two virtual nodes
    # joined by its one link, as the exchange over CUDA IPC is charged
    two = _plan(VNODE2)
    t2 = metadata_terms(two, table_metadata(two, "emulate", metadata_exchange="collective"))
    assert boxes(two) == [[0], [1]]
    assert t2["transfer"] == pytest.approx(4096 * 8 * 8 / 50e9)
    assert t2["collective"] == pytest.approx((8.4 + 9.6) * 1e-6)  # one step, between the two
    # 16 dies of one node (ubbv2_ep16: no RDMA-class link): one box, every slot over blink
    ep16 = _plan(str(REPO / "schedules" / "ubbv2_ep16.sched"))
    assert [len(b) for b in boxes(ep16)] == [16] and between_boxes_link(ep16) == ("blink", 20e9)
    t16 = metadata_terms(ep16, table_metadata(ep16, "proxy"))
    assert t16["transfer"] == pytest.approx(15 * ep16.workload.tokens * ep16.workload.topk * 8 / 20e9)


def test_the_manifest_entry_is_read_or_refused():
    assert from_manifest(None) is None
    assert from_manifest({"lowering": "host", "why": "x"}) is None
    entry = {"lowering": "device", "blocks": {"meta_count": 64, "meta_rows": 256, "meta_items": 0},
             "steps": [{"program": "dispatch", "step": "meta"}]}
    # before the choice: ipc; before the launches were recorded: the steps as launches of their own
    assert from_manifest(entry) == DeviceMetadata(64, 256, 0, (("dispatch", "meta"),))
    assert from_manifest({**entry, "exchange": "collective"}).exchange == "collective"
    with pytest.raises(SimulationError, match="the metadata exchange 'nvshmem' is none this epcc knows"):
        from_manifest({**entry, "exchange": "nvshmem"})
    # CUDA: meta_fused (after gather_copy with the collective); SUPA: a launch per step
    assert from_manifest({**entry, "launches": ["meta_fused"]}).fused
    assert from_manifest({**entry, "exchange": "collective", "launches": ["gather_copy", "meta_fused"]}).fused
    supa = ["gather_copy", "meta_count", "meta_scan", "meta_rows", "meta_items"]
    assert not from_manifest({**entry, "launches": supa}).fused
    with pytest.raises(SimulationError, match=r"b/cuda/manifest.json: the metadata's \"launches\" is not a list"):
        from_manifest({**entry, "launches": "meta_fused"}, "b/cuda/manifest.json")
    # no meta_items launch where the plan has no copy: four launches, not five; meta_fused: one either way
    plan = _plan(VNODE2)
    t = metadata_terms(plan, from_manifest(entry))
    five = metadata_terms(plan, dataclasses.replace(from_manifest(entry), items_blocks=6))
    assert t["items"] == 0 and t["gaps"] == pytest.approx(five["gaps"] * 4 / 5)
    fused = metadata_terms(plan, from_manifest({**entry, "launches": ["meta_fused"]}))
    assert fused["items"] == 0 and fused["gaps"] == pytest.approx(GAP_S)
    with pytest.raises(SimulationError, match="recompile the bundle"):
        from_manifest({"lowering": "device", "steps": []}, "b/cuda/manifest.json")


def test_epcc_simulate_reports_the_term(capsys, gpu_bundles, tmp_path):
    # the bundles' simulate.json (tests/gpu/bundles.py): the emulated-RDMA bundle and the proxy
    # path's by default have the metadata kernels, the proxy twin with host-built tables and the
    # one-hop bundle do not
    src = str(gpu_bundles.rdma_source(tmp_path, "h200x2_2vnode_13"))
    code, out, err = run(["simulate", src, "--json", "--rdma", "emulate"], capsys)
    assert code == 0, err
    d = json.loads(out)
    parts = d["programs"]["dispatch"]["metadata_us"]
    assert list(parts) == ["gather", "transfer", "signal", "count", "scan", "rows", "items", "barriers", "gaps"]
    assert parts["transfer"] == pytest.approx(4096 * 8 * 8 / 13e9 * 1e6)
    # launch_ms: the metadata and the Buffer call's copies beside the kernels (sim/calls.py)
    calls = d["programs"]["dispatch"]["calls_us"]
    assert calls == {"gaps": 0.0}  # the kernel reads x where the caller has it (manifest dispatch_input)
    assert d["programs"]["dispatch"]["launch_ms"] == pytest.approx((sum(parts.values()) + sum(calls.values())) / 1e3)
    combine_calls = d["programs"]["combine"]["calls_us"]
    # the plan's combine reads the caller's expert outputs in place (manifest combine_input): no rows
    # copied; its partials are cleared beside the dispatch kernel (tables from the GPU); its kernel
    # writes the bf16 tokens itself (manifest combine_output): no conversion after it
    assert combine_calls == {"gaps": 0.0}
    assert d["programs"]["combine"]["metadata_us"] == {}
    assert d["programs"]["combine"]["launch_ms"] == pytest.approx(sum(combine_calls.values()) / 1e3)
    assert d["model"]["sm"]["metadata"] == {"blocks": {"meta_count": 64, "meta_scan": 137, "meta_rows": 256,
                                                       "meta_items": 6},
                                            "exchange": "ipc", "fused": True, "steps": ["dispatch.meta"]}
    code, out, err = run(["simulate", src, "--json", "--rdma", "proxy", "--proxy-tables", "host"], capsys)
    assert code == 0 and json.loads(out)["programs"]["dispatch"]["metadata_us"] == {}
    assert "metadata" not in json.loads(out)["model"]["sm"]
    # host-built tables: no metadata kernels, but the Buffer's copies around the kernels all the same
    host = json.loads(out)["programs"]
    assert host["dispatch"]["calls_us"] == {"gaps": 0.0}
    # the launcher clears the partials in the combine call (and counts each row's contributions
    # there: its kernel writes the bf16 tokens all the same)
    assert list(host["combine"]["calls_us"]) == ["zero", "count", "gaps"]
    assert host["combine"]["launch_ms"] == pytest.approx(sum(host["combine"]["calls_us"].values()) / 1e3)
    code, out, err = run(["simulate", src, "--json", "--rdma", "proxy"], capsys)
    assert code == 0 and list(json.loads(out)["programs"]["dispatch"]["metadata_us"]) == list(parts)
    code, out, err = run(["simulate", src, "--rdma", "emulate", "--proxy-tables", "host"], capsys)
    assert (code, err) == (1, "epcc: error: --proxy-tables host is for the GPU proxy path: use it with --rdma proxy\n")
    code, out, err = run(["simulate", src, "--json", "--rdma", "emulate", "--metadata-exchange", "collective"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert list(d["programs"]["dispatch"]["metadata_us"]) == ["gather", "transfer", "collective", "count", "scan",
                                                              "rows", "items", "barriers", "gaps"]
    assert d["model"]["sm"]["metadata"]["exchange"] == "collective"
    ep16 = str(REPO / "schedules" / "ubbv2_ep16.sched")
    code, out, err = run(["simulate", ep16, "--metadata-exchange", "ipc"], capsys)
    assert (code, out) == (1, "") and err == ("epcc: error: --metadata-exchange ipc: metadata exchange 'ipc' maps every "
                                              "rank's gather area over CUDA IPC, but the plan's 16 ranks span more than "
                                              "one CUDA IPC domain (at most 8): use 'collective' or 'auto'\n")
    code, out, err = run(["simulate", str(gpu_bundles.ep2_source(tmp_path)), "--json"], capsys)
    assert code == 0 and json.loads(out)["programs"]["dispatch"]["metadata_us"] == {}
    code, out, err = run(["simulate", src, "--rdma", "emulate"], capsys)
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("dispatch metadata kernels on the GPU:"))
    assert f"{sum(parts.values()):.1f} us before the first step (gather " in line
    assert "metadata kernels on the GPU before the dispatch (sim/meta.py)" in out
    line = next(x for x in out.splitlines() if x.startswith("combine Buffer call's copies beside the kernels:"))
    assert line.endswith(": none (the expert outputs read where the caller has them, not copied; the partials "
                         "cleared beside the dispatch kernel; the bf16 tokens written by the combine kernel)")
    line = next(x for x in out.splitlines() if x.startswith("dispatch Buffer call's copies beside the kernels:"))
    assert line.endswith(": none (the tokens read where the caller has them, not copied)")
