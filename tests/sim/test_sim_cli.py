"""`epcc simulate`: the table, --json, --gantt, and its errors (exit 1 for bad values, 2 for usage)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from epcc.cli import main

REPO = Path(__file__).resolve().parents[2]
EP16 = str(REPO / "schedules" / "ubbv2_ep16.sched")
H200 = str(REPO / "schedules" / "h200x4.sched")


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_table(capsys):
    code, out, err = run(["simulate", EP16], capsys)
    assert code == 0, err
    assert "schedule ubbv2_ep16: 16 ranks" in out
    assert "plan after passes: instantiate, route-analysis" in out
    for needle in ("step", "start", "end", "MB/rank", "GB/s", "fwd1", "blink", "link busy", "bottleneck: blink",
                   "critical path:", "dispatch: total", "serial sum"):
        assert needle in out, needle
    # The reorder row: 58.98 MB per rank at the HBM's 200 GB/s.
    row = next(l for l in out.splitlines() if l.lstrip("* ").startswith("reorder"))
    assert "58.98" in row and "200.0" in row


def test_json(capsys):
    code, out, err = run(["simulate", H200, "--json"], capsys)
    assert code == 0, err
    d = json.loads(out)  # ONE object
    for key in ("total_ms", "serial_ms", "bottleneck", "steps", "routing", "link_busy_ms"):
        assert key in d, key
    assert d["routing"].startswith("uniform")
    assert d["tokens"] == 4096
    push = next(s for s in d["steps"] if s["name"] == "push" and s["program"] == "dispatch")
    assert set(push) >= {"name", "program", "link", "start_ms", "end_ms", "bytes"}
    assert push["link"] == "nvlink" and push["end_ms"] > push["start_ms"]
    assert d["bottleneck"]["link_class"] == "nvlink"
    assert 0 < d["bottleneck"]["utilisation"] <= 1
    assert d["total_ms"] == pytest.approx(sum(p["total_ms"] for p in d["programs"].values()))
    assert d["total_ms"] <= d["serial_ms"] + 1e-9
    assert d["link_busy_ms"]["nvlink"] > 0


def test_tokens_and_routing_change_the_plan(capsys, tmp_path):
    _, out, _ = run(["simulate", H200, "--json"], capsys)
    base = json.loads(out)
    _, out, _ = run(["simulate", H200, "--json", "--tokens", "2048"], capsys)
    half = json.loads(out)
    assert half["tokens"] == 2048
    # the bytes halve; the time a little less than halves: launches and the metadata's fixed
    # part (the passes, the peers' flags) do not shrink with the tokens
    assert half["link_busy_ms"]["nvlink"] == pytest.approx(base["link_busy_ms"]["nvlink"] / 2, rel=0.02)
    assert base["total_ms"] / 2 < half["total_ms"] < base["total_ms"] / 2 * 1.10
    _, out, _ = run(["simulate", H200, "--json", "--routing", "zipf:1.2"], capsys)
    assert json.loads(out)["routing"].startswith("zipf:1.2")
    pop = tmp_path / "pop.npy"
    np.save(pop, np.linspace(1, 2, 256))
    code, out, err = run(["simulate", H200, "--json", "--routing", str(pop)], capsys)
    assert code == 0, err
    assert "popularity pop.npy" in json.loads(out)["routing"]


def test_gantt(capsys, tmp_path):
    svg = tmp_path / "g.svg"
    code, out, err = run(["simulate", EP16, "--gantt", str(svg)], capsys)
    assert code == 0, err
    assert f"Gantt chart written to {svg}" in out
    root = ET.parse(svg).getroot()  # well-formed XML
    assert root.tag.endswith("svg")
    text = svg.read_text()
    for needle in ("time (ms)", "fwd1 (blink)", "dispatch", "combine", "critical path", "#1f77b4"):
        assert needle in text, needle


@pytest.mark.parametrize("argv, msg", [
    (["--routing", "zipf:abc"], "the Zipf exponent must be a number"),
    (["--routing", "pareto"], "expected 'uniform', 'zipf:S' or a .npy file"),
    (["--routing", "/nonexistent/r.npy"], "no such file"),
    (["--tokens", "0"], "tokens per rank must be at least 1"),
    (["--tokens", "-5"], "tokens per rank must be at least 1"),
    (["--tokens", "many"], "expected a whole number of tokens per rank"),
    (["--gantt", "chart.png"], "name the file *.svg"),
])
def test_bad_values_exit_1(capsys, argv, msg):
    code, out, err = run(["simulate", H200] + argv, capsys)
    assert code == 1
    assert msg in err
    assert out == ""


def test_missing_file_exits_1(capsys, tmp_path):
    code, _, err = run(["simulate", str(tmp_path / "none.sched")], capsys)
    assert code == 1
    assert "error" in err


def test_bad_usage_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["simulate"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["simulate", H200, "--frobnicate"])
    assert e.value.code == 2


TWO_VNODE = str(REPO / "schedules" / "h200x2_2vnode.sched")


def _calls(capsys, *extra) -> dict:
    code, out, err = run(["simulate", TWO_VNODE, "--json", "--rdma", "emulate", *extra], capsys)
    assert code == 0, err
    return {p: d["calls_us"] for p, d in json.loads(out)["programs"].items()}


def test_copy_inputs_and_clear_partials_charge_what_the_buffer_would_copy(capsys):
    """--copy-inputs charges the copy of a program's rows the kernels could read in place;
    --clear-partials in-combine the partials' clearing in the combine call; --combine-output
    finish-kernel the conversion after the combine kernel, which the bundle's (combine_output
    in-kernel) writes itself."""
    plain = _calls(capsys)
    assert plain["dispatch"] == {"gaps": 0.0} and plain["combine"] == {"gaps": 0.0}
    copied = _calls(capsys, "--copy-inputs", "dispatch,combine")
    assert list(copied["dispatch"]) == ["input", "gaps"] and "rows" in copied["combine"]
    assert copied["dispatch"]["input"] > 0 and copied["dispatch"]["gaps"] > 0
    # the partials cleared in the combine call: each row's contributions counted there too
    assert list(_calls(capsys, "--clear-partials", "in-combine")["combine"]) == ["zero", "count", "gaps"]
    older = _calls(capsys, "--combine-output", "finish-kernel")["combine"]
    assert list(older) == ["convert", "gaps"]
    assert older["convert"] == pytest.approx(6.0 * 4096 * 7168 / (0.87 * 3000e9) * 1e6)  # T x hidden x (4 + 2) B
    assert _calls(capsys, "--combine-output", "in-kernel") == plain


def test_the_report_says_where_the_combine_converts(capsys):
    code, out, err = run(["simulate", TWO_VNODE, "--rdma", "emulate"], capsys)
    assert code == 0, err
    assert ("combine Buffer call's copies beside the kernels: none (the expert outputs read where the caller has "
            "them, not copied; the partials cleared beside the dispatch kernel; the bf16 tokens written by the "
            "combine kernel)\n") in out
    code, out, err = run(["simulate", TWO_VNODE, "--rdma", "emulate", "--combine-output", "finish-kernel"], capsys)
    assert "combine Buffer call's copies beside the kernels: 70.0 us (convert 67.5, gaps 2.5 us; " in out


def test_combine_output_takes_its_three_values(capsys):
    with pytest.raises(SystemExit) as e:
        main(["simulate", TWO_VNODE, "--combine-output", "sometimes"])
    assert e.value.code == 2


@pytest.mark.parametrize("value", ["x", "dispatch,", "DISPATCH"])
def test_copy_inputs_names_programs(capsys, value):
    code, out, err = run(["simulate", TWO_VNODE, "--copy-inputs", value], capsys)
    bad = next(v for v in value.split(",") if v not in ("dispatch", "combine"))
    assert (code, out, err) == (1, "", f"epcc: error: --copy-inputs: {bad!r} is not a program (dispatch, combine)\n")
