"""The workload's output layout on the command line and in plan.json: `layout token` in a .sched
file and `--layout token` on compile / run, what they write, what refuses them (exact text), and
`epcc run` of token-major plans on the CPU backend against the token-major oracle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from epcc.cli import main
from epcc.plan.bundle import BundleError, load

from bundle_tools import edit_json
from test_cli import REPO, SMALL, _at_repo_root, no_crash, run  # noqa: F401 (the fixture applies here too)


def _workload(bundle: Path) -> dict:
    return json.loads((bundle / "plan.json").read_text(encoding="utf-8"))["workload"]


def test_the_default_plan_has_no_layout_field_and_token_is_written(tmp_path, capsys):
    assert run(["compile", SMALL, "-o", str(tmp_path / "e")], capsys)[0] == 0
    assert "layout" not in _workload(tmp_path / "e")  # absent: expert-major, as before the option
    assert load(tmp_path / "e").plan.workload.layout == "expert"
    assert run(["compile", SMALL, "-o", str(tmp_path / "t"), "--layout", "token"], capsys)[0] == 0
    assert _workload(tmp_path / "t")["layout"] == "token"
    assert load(tmp_path / "t").plan.workload.layout == "token"


def test_the_sched_option_and_the_flag_agree(tmp_path, capsys):
    text = (REPO / SMALL).read_text(encoding="utf-8")
    assert "  experts 8\n" in text
    src = tmp_path / "tok.sched"
    src.write_text(text.replace("  experts 8\n", "  experts 8\n  layout token\n"), encoding="utf-8")
    assert run(["compile", str(src), "-o", str(tmp_path / "a")], capsys)[0] == 0
    assert _workload(tmp_path / "a")["layout"] == "token"
    # the flag overrides the file, either way
    assert run(["compile", str(src), "-o", str(tmp_path / "b"), "--layout", "expert"], capsys)[0] == 0
    assert "layout" not in _workload(tmp_path / "b")


def test_a_bad_layout_flag_is_named(capsys):
    rc, out, err = run(["compile", SMALL, "--layout", "tokens"], capsys)
    assert (rc, out) == (1, "")
    assert err == ("epcc: error: --layout tokens: expected expert or token (expert: one row per token and local "
                   "expert; token: one row per token and destination rank); did you mean 'token'?\n")
    rc, _, err = run(["run", SMALL, "--layout", "rows"], capsys)
    assert rc == 1 and err.startswith("epcc: error: --layout rows: expected expert or token (")


def test_cuda_direct_kernels_take_token_major_other_targets_refuse_the_cost_model_follows(tmp_path, capsys):
    # a one-hop plan: the CUDA target's direct kernels write token-major rows (epcc/direct/token.cuh)
    out = tmp_path / "c"
    rc, _, err = run(["compile", SMALL, "--layout", "token", "--target", "cuda", "-o", str(out)], capsys)
    assert rc == 0, err
    man = json.loads((out / "cuda" / "manifest.json").read_text())
    assert man["lowering"] == "direct" and man["direct"]["constants"]["layout"] == "token"
    assert man["direct"]["headers"][-1] == "epcc/direct/token.cuh"
    assert "#define EPCC_DIRECT_TOKEN_MAJOR 1" in (out / "cuda" / "epcc_direct_config.cuh").read_text()
    # a plan the CUDA target lowers to its table-driven kernels: refused, with the reason
    multi = str(REPO / "schedules" / "h200x4_2vnode.sched")
    rc, _, err = run(["compile", multi, "--layout", "token", "--target", "cuda", "-o", str(tmp_path / "m")], capsys)
    assert rc == 1 and no_crash(err)
    assert err.startswith(f"epcc: error: {multi}: the CUDA target writes token-major output with its direct kernels "
                          f"only, and this plan is not lowered to them (")
    assert err.endswith("; use --target none (the CPU backend runs every plan token-major) or the expert layout\n")
    rc, _, err = run(["compile", SMALL, "--layout", "token", "--target", "supa", "-o", str(tmp_path / "s")], capsys)
    assert rc == 1 and no_crash(err)
    assert err.endswith(f"epcc: error: {SMALL}: the token-major layout runs on the CPU backend and the CUDA target's "
                        f"direct kernels: the supa target's kernels write expert-major output; use --target none (the "
                        f"CPU backend runs every plan token-major) or the expert layout\n")
    # the cost model follows: the token-major direct kernels where the CUDA target runs them, else refused
    rc, out, err = run(["simulate", SMALL, "--layout", "token", "--json"], capsys)
    assert rc == 0, err
    assert json.loads(out)["model"]["sm"]["layout"] == "token"
    rc, _, err = run(["simulate", multi, "--layout", "token"], capsys)
    assert rc == 1 and no_crash(err)
    assert err.startswith(f"epcc: error: {multi}: cannot simulate the token-major layout: the CUDA target writes "
                          f"token-major output with its direct kernels only, and this plan is not lowered to them (")


def test_a_tampered_layout_in_plan_json_is_named(tmp_path, capsys):
    b = tmp_path / "b"
    assert run(["compile", SMALL, "-o", str(b)], capsys)[0] == 0

    def set_layout(d):
        d["workload"]["layout"] = "token-major"
        return d

    edit_json(b / "plan.json", set_layout, bundle=b)
    with pytest.raises(BundleError) as e:
        load(b)
    assert str(e.value) == (f"{b / 'plan.json'}: not a plan written by 'epcc compile': workload.layout: "
                            f"'token-major' is not one of expert, token")


@pytest.mark.parametrize("schedule,routing", [
    ("schedules/h200x4.sched", "uniform"), ("schedules/h200x4.sched", "zipf:1.2"),
    ("schedules/h200x4.sched", "one-hot"), ("schedules/h200x4_2vnode.sched", "uniform"),
    ("schedules/h200x2_2vnode_relay.sched", "empty")])
def test_epcc_run_token_major_on_the_cpu_backend(schedule, routing, capsys):
    rc, out, err = run(["run", schedule, "--layout", "token", "--tokens", "48", "--hidden", "128",
                        "--routing", routing, "--seed", "5"], capsys)
    assert rc == 0, err
    assert ", token-major; dispatch OK (bit-exact); combine OK (" in out


def test_epcc_run_of_a_token_major_plan_json(tmp_path, capsys):
    b = tmp_path / "b"
    assert run(["compile", "schedules/h200x4.sched", "-o", str(b), "--layout", "token", "--tokens", "32"],
               capsys)[0] == 0
    shutil.rmtree(b / "cuda", ignore_errors=True)
    rc, out, err = run(["run", str(b / "plan.json"), "--tokens", "16"], capsys)
    assert rc == 0, err
    assert "token-major; dispatch OK (bit-exact)" in out
