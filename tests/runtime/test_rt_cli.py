"""`epcc run`: the summary line, exit statuses, user errors, the missing-backend message, and
the first differing rank/token/expert when a backend or a hand-edited plan goes wrong."""

from __future__ import annotations

import json
from pathlib import Path
import re
import sys
import types

import numpy as np
import pytest

from epcc import cli
from epcc.cli import main
from epcc.runtime.testing import reference

from rt_helpers import REPO

SMALL = "tests/cli/data/small.sched"  # 4 GPUs, top-2 of 8 experts, 64 tokens, hidden 256
QUICK = ["--tokens", "32", "--hidden", "128"]


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch):
    monkeypatch.chdir(REPO)


def run(argv, capsys):
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "internal compiler error" not in err
    return rc, out, err


SUMMARY = re.compile(
    r"^(?P<sched>\w+): (?P<R>\d+) ranks x (?P<T>\d+) tokens, hidden (?P<H>\d+) (?P<dt>bf16|fp8), top-\d+ of \d+, "
    r"routing (?P<routing>.+), seed \d+, backend (?P<backend>\w+): (?P<rows>\d+) rows received \(\d+\.\.\d+ per "
    r"rank\); dispatch OK \(bit-exact\); combine OK \(max \|error\| \S+ of sum\|w\*y\|, (max [0-2] bf16 ulp|"
    r"\d+ of \d+ values beyond 2 bf16 ulp \(sums that cancel: within the fp32 reordering bound\))\); "
    r"compile [\d.]+ ms, inputs [\d.]+ ms, layout [\d.]+ ms, dispatch [\d.]+ ms, combine [\d.]+ ms, "
    r"oracle [\d.]+ ms\n$")


def test_run_reference_ok(capsys):
    rc, out, err = run(["run", "schedules/h200x4_2vnode.sched", "--backend", "reference", *QUICK], capsys)
    assert rc == 0, err
    m = SUMMARY.match(out)
    assert m, out
    assert m.group("sched", "R", "T", "H", "dt", "routing", "backend") == (
        "h200x4_2vnode", "4", "32", "128", "bf16", "uniform", "reference")


@pytest.mark.parametrize("routing", ["uniform", "zipf:1.2", "one-hot", "empty", "no-remote"])
def test_run_every_routing(capsys, routing):
    rc, out, err = run(["run", SMALL, "--backend", "reference", "--routing", routing, "--seed", "7"], capsys)
    assert rc == 0, err
    m = SUMMARY.match(out)
    assert m and m.group("routing") == routing and "seed 7" in out
    if routing == "empty":
        assert "(0.." in out  # ranks 2 and 3 receive nothing


SCHEDULES = sorted(p.name for p in (Path(__file__).resolve().parents[2] / "schedules").glob("*.sched"))


@pytest.mark.parametrize("routing", ["uniform", "zipf:1.2", "one-hot", "empty", "no-remote"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_run_cpu_every_schedule_and_routing(capsys, schedule, routing):
    """The CPU backend's acceptance: `epcc run --backend cpu` on every shipped schedule (scaled
    down) under every routing equals the oracle."""
    rc, out, err = run(["run", f"schedules/{schedule}", "--backend", "cpu", "--routing", routing,
                        "--tokens", "24", "--hidden", "128" if "hybrid" in schedule else "64"], capsys)
    assert rc == 0, err
    assert ", backend cpu: " in out and "dispatch OK" in out, out


def test_run_fp8(capsys):
    rc, out, err = run(["run", "schedules/nvl8_hybrid.sched", "--backend", "reference", "--tokens", "16",
                        "--hidden", "256", "--routing", "zipf:1.2"], capsys)
    assert rc == 0, err
    assert SUMMARY.match(out).group("dt") == "fp8"


def test_run_routing_file(capsys, tmp_path):
    idx = np.random.default_rng(0).permuted(np.tile(np.arange(8), (4 * 64, 1)), axis=1)[:, :2]
    idx[3, 1] = -1
    p = tmp_path / "route.npy"
    np.save(p, idx)
    rc, out, err = run(["run", SMALL, "--backend", "reference", "--routing", str(p)], capsys)
    assert rc == 0, err
    assert SUMMARY.match(out).group("routing") == str(p)
    rc, out, err = run(["run", SMALL, "--backend", "reference", "--routing", str(p), "--tokens", "10"], capsys)
    assert rc == 1 and out == ""
    assert "64 tokens per rank; run with --tokens 64" in err


@pytest.mark.parametrize("argv, message", [
    (["--routing", "sideways"], "epcc: error: --routing 'sideways': expected uniform, zipf:S, one-hot, empty, "
                                "no-remote or FILE.npy"),
    (["--routing", "zipf:x"], "the Zipf exponent must be a number"),
    (["--routing", "nowhere.npy"], "nowhere.npy: no such file"),
    (["--tokens", "0"], "tokens per rank must be at least 1"),
    (["--hidden", "abc"], "--hidden abc: expected a whole number"),
    (["--hidden", "0"], "the hidden size must be at least 1"),
    (["--seed", "-3"], "--seed -3: the seed must be >= 0"),
])
def test_run_user_errors(capsys, argv, message):
    rc, out, err = run(["run", SMALL, "--backend", "reference", *argv], capsys)
    assert rc == 1 and out == ""
    assert message in err


def test_run_fp8_needs_hidden_multiple_of_128(capsys):
    rc, out, err = run(["run", "schedules/nvl8_hybrid.sched", "--backend", "reference", "--hidden", "100"], capsys)
    assert rc == 1
    assert "--hidden 100: nvl8_hybrid dispatches fp8, which needs a hidden size divisible by 128" in err


def test_run_bad_schedule_and_backend_name(capsys, tmp_path):
    rc, _, err = run(["run", str(tmp_path / "missing.sched"), "--backend", "reference"], capsys)
    assert rc == 1 and "missing.sched" in err
    rc, _, err = run(["run", SMALL, "--backend", "gpu"], capsys)
    assert rc == 2 and "invalid choice: 'gpu'" in err


def test_missing_cpu_backend_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "epcc.runtime.engines.cpu.threads", None)  # import fails
    rc, out, err = run(["run", SMALL, "--backend", "cpu"], capsys)
    assert rc == 1 and out == ""
    assert err.startswith("epcc: error: backend 'cpu' is not available: importing epcc.runtime.engines.cpu.threads failed: ")
    assert "'--backend reference' runs the NumPy reference executor" in err


def test_help_lists_run(capsys):
    rc, out, _ = run(["run", "--help"], capsys)
    assert rc == 0 and "--backend cpu|reference" in out and "no-remote" in out


# --------------------------------------------------------------------------- mismatches


def _fake_backend(monkeypatch, run_dispatch=None, run_combine=None):
    mod = types.ModuleType("epcc_fake_backend")
    mod.run_dispatch = run_dispatch or reference.run_dispatch
    mod.run_combine = run_combine or reference.run_combine
    monkeypatch.setitem(sys.modules, "epcc_fake_backend", mod)
    monkeypatch.setitem(cli.RUN_BACKENDS, "reference", ("epcc_fake_backend", "a test double"))


def test_corrupted_row_names_rank_token_expert(capsys, monkeypatch):
    def bad_dispatch(plan, layout, x):
        out = reference.run_dispatch(plan, layout, x)
        out[1][2, 5] ^= 0xFF
        return out

    _fake_backend(monkeypatch, run_dispatch=bad_dispatch)
    rc, out, err = run(["run", SMALL, "--backend", "reference"], capsys)
    assert rc == 1
    assert "dispatch MISMATCH, combine not run" in out
    assert re.match(r"epcc: error: dispatch differs from the oracle: rank 1 \(node 0, gpu 1\): output row 2 "
                    r"\(token \d+ of rank \d \(node 0, gpu \d\), expert [23]\) differs from the token's payload "
                    r"from byte 5 on\n$", err), err


def test_wrong_combine_names_token_and_channel(capsys, monkeypatch):
    def bad_combine(plan, layout, y):
        res = reference.run_combine(plan, layout, y)
        res[2][3, 5] += 1.0
        return res

    _fake_backend(monkeypatch, run_combine=bad_combine)
    rc, out, err = run(["run", SMALL, "--backend", "reference"], capsys)
    assert rc == 1
    assert "dispatch OK (bit-exact); combine MISMATCH" in out
    assert re.match(r"epcc: error: combine differs from the oracle: token 3 of rank 2 \(node 0, gpu 2\) "
                    r"\(experts \[\d, \d\]\), channel 5: got \S+, expected \S+\n$", err), err


def test_backend_failure_is_reported(capsys, monkeypatch):
    def boom(plan, layout, x):
        raise RuntimeError("rank 1 (node 0, gpu 1): wait on push.ready timed out")

    _fake_backend(monkeypatch, run_dispatch=boom)
    rc, out, err = run(["run", SMALL, "--backend", "reference"], capsys)
    assert rc == 1 and "dispatch FAILED" in out
    assert err == ("epcc: error: backend 'reference' failed in dispatch: RuntimeError: rank 1 (node 0, gpu 1): "
                   "wait on push.ready timed out\n")


def test_compiled_plan_runs_and_a_dropped_flow_is_caught(capsys, tmp_path):
    rc, _, err = run(["compile", "schedules/h200x4_2vnode.sched", "-o", str(tmp_path), "--tokens", "32"], capsys)
    assert rc == 0, err
    plan_file = tmp_path / "plan.json"
    rc, out, err = run(["run", str(plan_file), "--backend", "reference"], capsys)
    assert rc == 0, err
    assert re.match(r"h200x4_2vnode: 4 ranks x 32 tokens, hidden 7168 .*; load [\d.]+ ms, inputs", out), out
    rc, out, err = run(["run", str(plan_file), "--backend", "reference", "--hidden", "256"], capsys)
    assert rc == 1 and "is a compiled plan, whose hidden size is fixed" in err
    # Hand edit: drop the forward of rank 2's RDMA-received tokens to rank 3.  Its reverse in the
    # combine is left without a flow to reverse: refused when the plan is loaded.
    d = json.loads(plan_file.read_text())
    fwd = next(s for s in d["steps"] if s["program"] == "dispatch" and s["name"] == "fwd")
    fwd["flows"] = [f for f in fwd["flows"] if (f["src"], f["dst"]) != (2, 3)]
    plan_file.write_text(json.dumps(d))
    i, back = next((i, s) for i, s in enumerate(d["steps"]) if s["program"] == "combine" and s["reverse_of"] == "fwd")
    j = next(j for j, f in enumerate(back["flows"]) if (f["src"], f["dst"]) == (3, 2))
    rc, out, err = run(["run", str(plan_file), "--backend", "reference"], capsys)
    assert (rc, out) == (1, "") and err == (f"epcc: error: {plan_file}: not a plan written by 'epcc compile': "
                                            f"steps[{i}].flows: {len(back['flows'])} flows reverse dispatch step "
                                            f"'fwd', which has {len(fwd['flows'])}\n"), err
    # Dropped from both programs, the plan is consistent but would lose rank 0's tokens for rank 3
    # (they cross to rank 2 over RDMA, then had the forward to rank 3): refused at load, by the pair.
    del back["flows"][j]
    plan_file.write_text(json.dumps(d))
    rc, out, err = run(["run", str(plan_file), "--backend", "reference"], capsys)
    assert (rc, out) == (1, "") and err == (f"epcc: error: {plan_file}: not a plan written by 'epcc compile': "
                                            "steps: no chain of dispatch flows carries rank 0's tokens routed to "
                                            "rank 3 into its output (every selection along it must include 3): "
                                            "they would be lost\n"), err


def test_not_a_plan(capsys, tmp_path):
    p = tmp_path / "plan.json"
    p.write_text('{"schedule": 1}')
    rc, out, err = run(["run", str(p), "--backend", "reference"], capsys)
    assert rc == 1 and "not a plan written by 'epcc compile'" in err
