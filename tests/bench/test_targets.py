"""bench/targets.py: the GPU targets judged from ep_bench reports (no GPU: reports are written here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def targets(bench_script):
    return bench_script("targets")


def _method(d_ms, c_ms, gbps=None, sms=None):
    disp = {"median_ms": d_ms}
    if gbps is not None:
        disp["gbps_remote_dedup"] = gbps
    r = {"summary": {"dispatch": disp, "combine": {"median_ms": c_ms}}}
    if sms is not None:
        r["sms"] = {"dispatch": sms, "combine": sms}
    return r


def _bundle(name, tokens, dtype, epcc, torch=None, a2a=None, sim=None):
    methods = {"epcc": epcc}
    if torch is not None:
        methods["torch_megatron"] = torch
    if a2a is not None:
        methods["nccl_a2a"] = a2a
    b = {"name": name, "workload": {"tokens": tokens, "dtype": dtype}, "methods": methods}
    if sim is not None:
        b["simulate"] = {"dispatch": {"total_ms": sim[0]}, "combine": {"total_ms": sim[1]}}
    return b


def report(bf16=(0.40, 0.44, 380.0, 24), torch_ms=2.0, a2a=(0.50, 0.50), decode=(0.035, 0.045), sims=None):
    """A 4x H200 report; by default every target is met."""
    sims = sims or {"bf16": (0.40, 0.44), "fp8": (0.30, 0.44), "decode": (0.035, 0.045)}
    d, c, g, sms = bf16
    return {"world": 4, "device": "NVIDIA H200", "bundles": [
        _bundle("h200x4", 4096, "bf16", _method(d, c, g, sms), _method(torch_ms, 4.0), _method(*a2a), sims["bf16"]),
        _bundle("h200x4_fp8", 4096, "fp8", _method(0.30, 0.44, 300.0, sms), _method(2.0, 4.0), _method(0.29, 0.5),
                sims["fp8"]),
        _bundle("h200x4_t128", 128, "bf16", _method(*decode, 70.0, 24), _method(2.0, 0.17), _method(0.037, 0.037),
                sims["decode"]),
    ]}


def _write(tmp_path, rep, name="ep_bench.json"):
    p = tmp_path / name
    p.write_text(json.dumps(rep), encoding="utf-8")
    return str(p)


def _rows(text):
    return {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}


def test_every_target_met(targets, tmp_path, capsys):
    assert targets.main([_write(tmp_path, report())]) == 0
    out = capsys.readouterr().out
    assert out.startswith("The targets (stated for 4x H200) on 4 x NVIDIA H200:")
    rows = _rows(out)
    assert len(rows) == len(targets.TARGETS) + 1  # the header row too
    assert rows["dispatch 4096 tokens BF16 (fused permute) <= 0.42 ms with <= 24 SMs"].endswith(
        "| 0.400 ms at 24 SMs: **yes** |")
    assert "| 380 GB/s: **yes** |" in rows[">= 360 GB/s remote NVLink (that dispatch, deduplicated, self not counted)"]
    assert "5.0x (2.000 / 0.400 ms): **yes**" in rows[">= 4x faster than the torch+NCCL dispatcher (4096 BF16)"]
    assert "35 us at 24 SMs: **yes**" in rows["128-token dispatch <= 40 us"]
    assert "bf16 +0 % / +0 %; fp8 +0 % / +0 %; decode +0 % / +0 %: **yes**" in \
        rows["`epcc simulate` within 15 % (dispatch / combine)"]


@pytest.mark.parametrize("change, target, cell", [
    # in time but on more SMs than the target allows
    ({"bf16": (0.40, 0.44, 380.0, 64)}, "dispatch 4096 tokens BF16 (fused permute) <= 0.42 ms with <= 24 SMs",
     "0.400 ms at 64 SMs: **no**"),
    ({"bf16": (0.43, 0.44, 380.0, 24)}, "dispatch 4096 tokens BF16 (fused permute) <= 0.42 ms with <= 24 SMs",
     "0.430 ms at 24 SMs: **no**"),
    ({"bf16": (0.40, 0.44, 359.0, 24)}, ">= 360 GB/s remote NVLink (that dispatch, deduplicated, self not counted)",
     "359 GB/s: **no**"),
    ({"bf16": (0.40, 0.46, 380.0, 24)}, "combine 4096 tokens <= 0.45 ms", "0.460 ms at 24 SMs: **no**"),
    ({"torch_ms": 1.58}, ">= 4x faster than the torch+NCCL dispatcher (4096 BF16)", "4.0x (1.580 / 0.400 ms): **no**"),
    # faster than all_to_all must hold for both programs; a tie is not faster
    ({"a2a": (0.50, 0.44)}, "faster than bare NCCL all_to_all (4096 BF16)",
     "dispatch 0.400 vs 0.500 ms; combine 0.440 vs 0.440 ms: **no**"),
    ({"decode": (0.041, 0.045)}, "128-token dispatch <= 40 us", "41 us at 24 SMs: **no**"),
    ({"decode": (0.035, 0.051)}, "128-token combine <= 50 us", "51 us at 24 SMs: **no**"),
    ({"sims": {"bf16": (0.40, 0.44), "fp8": (0.30, 0.44), "decode": (0.030, 0.045)}},
     "`epcc simulate` within 15 % (dispatch / combine)", "decode +17 % / +0 %: **no**"),
])
def test_each_target_can_fail(targets, tmp_path, capsys, change, target, cell):
    assert targets.main([_write(tmp_path, report(**change))]) == 0
    row = _rows(capsys.readouterr().out)[target]
    assert cell in row, row
    assert row.count("**no**") == 1


def test_predictions_for_other_sms_are_not_compared(targets, tmp_path, capsys):
    # a tuned run: simulate.json was made for the plan's 24 SMs
    rep = report()
    for b in rep["bundles"]:
        b["simulate"]["sms"] = {"dispatch": 24, "combine": 24}
    rep["bundles"][0]["methods"]["epcc"]["sms"] = {"dispatch": 64, "combine": 64}
    rep["bundles"][2]["simulate"]["dispatch"]["total_ms"] = 0.020  # decode off by +75 %: still judged
    assert targets.main([_write(tmp_path, rep)]) == 0
    row = _rows(capsys.readouterr().out)["`epcc simulate` within 15 % (dispatch / combine)"]
    assert row.endswith("| bf16 not compared (simulated on 24/24 SMs, run on 64/64); fp8 +0 % / +0 %; "
                        "decode +75 % / +0 %: **no** |")
    for b in rep["bundles"]:
        b["methods"]["epcc"]["sms"] = {"dispatch": 96, "combine": 96}
    assert targets.main([_write(tmp_path, rep)]) == 0
    row = _rows(capsys.readouterr().out)["`epcc simulate` within 15 % (dispatch / combine)"]
    assert "| not measured (every prediction is for other SMs than the run's: bf16 not compared" in row


def test_tuned_report_is_a_second_column_and_missing_figures_say_so(targets, tmp_path, capsys):
    tuned = report(bf16=(0.30, 0.33, 500.0, 64))
    for b in tuned["bundles"]:
        del b["methods"]["torch_megatron"]
    del tuned["bundles"][1]["simulate"]
    assert targets.main([_write(tmp_path, report()), _write(tmp_path, tuned, "tuned.json")]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["target"] == "| target | default | after `epcc tune` |"
    assert rows["dispatch 4096 tokens BF16 (fused permute) <= 0.42 ms with <= 24 SMs"].endswith(
        "| 0.400 ms at 24 SMs: **yes** | 0.300 ms at 64 SMs: **no** |")
    assert rows[">= 4x faster than the torch+NCCL dispatcher (4096 BF16)"].endswith(
        "| not measured (bundle 'h200x4' has no torch_megatron result (not run)) |")
    assert rows["`epcc simulate` within 15 % (dispatch / combine)"].endswith(
        "| not measured (bundle 'h200x4_fp8' has no simulated dispatch (simulate.json)) |")


@pytest.mark.parametrize("content, message", [
    ("{", "{path}:1:2: not JSON: Expecting property name enclosed in double quotes"),
    ("[]", "{path}: not a bench/ep_bench.py report (no 'bundles' list)"),
    (json.dumps({"bundles": [{"name": "x", "workload": {"tokens": 4096, "dtype": "bf16"}}]}),
     "{path}: no bundle of the fp8, decode shape(s) (4096 tokens bf16 and fp8, 128 tokens); it has x"),
])
def test_bad_reports_are_errors_that_name_the_file(targets, tmp_path, capsys, content, message):
    path = tmp_path / "ep_bench.json"
    path.write_text(content, encoding="utf-8")
    assert targets.main([str(path)]) == 1
    assert capsys.readouterr().err.strip() == "bench/targets.py: " + message.format(path=path)


def test_two_bundles_of_one_shape_are_an_error(targets, tmp_path, capsys):
    rep = report()
    rep["bundles"].append(dict(rep["bundles"][0], name="h200x4_prev"))
    path = _write(tmp_path, rep)
    assert targets.main([path]) == 1
    assert capsys.readouterr().err.strip() == (
        f"bench/targets.py: {path}: two bundles of the bf16 shape ('h200x4' and 'h200x4_prev'); "
        "give a report with one of each")


def test_missing_file(targets, tmp_path, capsys):
    assert targets.main([str(tmp_path / "nope.json")]) == 1
    assert capsys.readouterr().err.strip() == f"bench/targets.py: {tmp_path / 'nope.json'}: cannot read: No such file or directory"


def test_a_bundle_with_a_malformed_workload_counts_as_no_shape(targets, tmp_path, capsys):
    rep = report()
    rep["bundles"][1]["workload"] = "4096 fp8"
    del rep["bundles"][1]["name"]
    path = _write(tmp_path, rep)
    assert targets.main([path]) == 1
    assert capsys.readouterr().err.strip() == (
        f"bench/targets.py: {path}: no bundle of the fp8 shape(s) (4096 tokens bf16 and fp8, 128 tokens); "
        "it has h200x4, ?, h200x4_t128")
