"""tests/gpu/test_gpu.py's comparison of the GPU proxy runs with `epcc simulate` (sim_mismatches),
on the CPU with reports written here, so the check that decides the GPU test can be seen to fail:
it must pass a run that matches the simulation and name every number that does not."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_gpu as G  # noqa: E402

MIXED = "h200x2_2vnode_mixed_50_proxy"


def _report(tmp_path: Path, dispatch_ms: float, combine_ms: float, there_end_ms: float | None,
            name: str = MIXED) -> Path:
    sim = {"dispatch": {"total_ms": 2.755, "steps": {"there": [0.005, 1.308], "relay": [0.084, 2.559]}},
           "combine": {"total_ms": 3.668, "steps": {"relay": [0.36, 3.185], "there": [0.593, 3.668]}}}
    roles = [{"step": "there (pack)", "start_ms": 0.0, "end_ms": 1.2}]
    if there_end_ms is not None:
        roles.append({"step": "there (unpack)", "start_ms": 0.1, "end_ms": there_end_ms})
    epcc = {"summary": {"dispatch": {"median_ms": dispatch_ms}, "combine": {"median_ms": combine_ms}},
            "per_rank": [{"timeline": {"dispatch": {"roles": roles, "end_ms": 2.8}}}]}
    path = tmp_path / "ep_bench.json"
    path.write_text(json.dumps({"bundles": [{"name": name, "simulate": sim, "methods": {"epcc": epcc}},
                                            {"name": "h200x4_2vnode_50_proxy", "methods": {}}]}), encoding="utf-8")
    return path


def test_a_run_that_matches_the_simulation_passes(tmp_path):
    assert G.sim_mismatches(_report(tmp_path, 2.70, 3.80, 1.35)) == []


def test_every_number_off_the_simulation_is_named(tmp_path):
    got = G.sim_mismatches(_report(tmp_path, 3.30, 3.0, 2.30))
    assert got == [f"{MIXED}: dispatch measured 3.300 ms, simulated 2.755 ms (+20 %)",
                   f"{MIXED}: combine measured 3.000 ms, simulated 3.668 ms (-18 %)",
                   f"{MIXED}: dispatch 'there' landed by 2.300 ms on rank 0, simulated 1.308 ms (+76 %)"]


def test_a_missing_timeline_is_a_miss_not_a_pass(tmp_path):
    assert G.sim_mismatches(_report(tmp_path, 2.70, 3.80, None)) == [
        f"{MIXED}: no dispatch timeline of 'there (unpack)' or no simulated 'there'"]


def test_bundles_not_checked_against_the_simulation_are_left_alone(tmp_path):
    assert G.sim_mismatches(_report(tmp_path, 9.0, 9.0, 9.0, name="h200x4_ubb2x2_50_proxy")) == []
