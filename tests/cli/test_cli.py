"""The `epcc` command line: exit statuses, the ok line, --emit, viz output, usage errors.

The CLI runs in-process through `epcc.cli.main` (output captured with capsys), from the
repository root so that paths in messages are relative; one test runs it as a real process to
check the exit statuses the shell sees.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from epcc import __version__
from epcc.cli import main
from epcc.cli.simulate import sim_options
from epcc.sema.check import check_file
from epcc.sim import SimOptions, simulate
from epcc.sim.build import build_plan
from epcc.sim.direct import describe
from epcc.viz import build_scheduled_graph

REPO = Path(__file__).resolve().parents[2]
SCHEDULES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "schedules").glob("*.sched"))
SMALL = "tests/cli/data/small.sched"  # 4 GPUs, a p2p and a local link, no metadata exchange


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch):
    monkeypatch.chdir(REPO)


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse: --help, --version, usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def no_crash(err: str) -> bool:
    return "Traceback" not in err and "internal compiler error" not in err


# --------------------------------------------------------------------------- usage


def test_version(capsys):
    rc, out, err = run(["--version"], capsys)
    assert (rc, out, err) == (0, "epcc 0.1.0\n", "")
    assert __version__ == "0.1.0"


def test_help_lists_the_commands(capsys):
    rc, out, err = run(["--help"], capsys)
    assert rc == 0 and err == ""
    assert out.startswith("usage: epcc ")
    for cmd in ("check", "compile", "viz"):
        assert re.search(rf"^\s+{cmd}\s+\S", out, re.M), f"'{cmd}' is not described in --help"


@pytest.mark.parametrize("cmd", ["check", "compile", "viz"])
def test_subcommand_help(cmd, capsys):
    rc, out, _err = run([cmd, "--help"], capsys)
    assert rc == 0
    assert out.startswith(f"usage: epcc {cmd} ")
    assert "FILE" in out


def test_no_arguments_is_a_usage_error(capsys):
    rc, out, err = run([], capsys)
    assert rc == 2 and out == ""
    assert "usage: epcc" in err and "required: COMMAND" in err


def test_unknown_command_is_a_usage_error(capsys):
    rc, out, err = run(["frobnicate", SMALL], capsys)
    assert rc == 2 and out == ""
    assert "invalid choice: 'frobnicate'" in err


def test_missing_file_argument_is_a_usage_error(capsys):
    rc, _out, err = run(["check"], capsys)
    assert rc == 2
    assert "required: FILE" in err


def test_unknown_emit_stage_is_a_usage_error(capsys):
    rc, out, err = run(["compile", SMALL, "--emit", "bytecode"], capsys)
    assert rc == 2 and out == ""
    assert "invalid choice: 'bytecode'" in err


def test_viz_needs_an_output(capsys):
    rc, _out, err = run(["viz", SMALL], capsys)
    assert rc == 2
    assert "-o/--output" in err


# --------------------------------------------------------------------------- check


@pytest.mark.parametrize("rel", SCHEDULES)
def test_check_shipped_schedule(rel, capsys):
    rc, out, err = run(["check", rel], capsys)
    assert rc == 0, err
    assert " error: " not in err and no_crash(err)
    sched, _warnings = check_file(rel)
    combine = "derived from dispatch" if sched.combine is None else f"{len(sched.combine.steps)} steps"
    assert out == (f"{rel}: ok: {sched.topology.num_ranks} ranks, {len(sched.dispatch.steps)} dispatch steps, "
                   f"combine {combine}\n")


def test_check_small(capsys):
    rc, out, err = run(["check", SMALL], capsys)
    assert (rc, err) == (0, "")
    assert out == f"{SMALL}: ok: 4 ranks, 2 dispatch steps, combine derived from dispatch\n"


def test_check_error_exits_1_with_a_located_diagnostic(tmp_path, capsys):
    bad = tmp_path / "bad.sched"
    bad.write_text((REPO / SMALL).read_text().replace("topk 2", "topk 9"))
    rc, out, err = run(["check", str(bad)], capsys)
    assert (rc, out) == (1, "")
    line = (REPO / SMALL).read_text().splitlines().index("  topk 2") + 1
    assert err == f"{bad}:{line}:3: error: topk 9 is more than the 8 experts\n    topk 9\n    ^~~~~~\n"


# --------------------------------------------------------------------------- compile --emit


@pytest.mark.parametrize("rel", SCHEDULES + [SMALL])
def test_emit_ast(rel, capsys):
    rc, out, err = run(["compile", rel, "--emit", "ast"], capsys)
    assert rc == 0 and no_crash(err)
    assert out.startswith("File @1:1\n")
    assert f"  path: '{rel}'\n" in out
    assert out.endswith("\n") and not out.endswith("\n\n")


@pytest.mark.parametrize("rel", SCHEDULES + [SMALL])
def test_emit_model(rel, capsys):
    rc, out, err = run(["compile", rel, "--emit", "model"], capsys)
    assert rc == 0 and no_crash(err)
    sched, _warnings = check_file(rel)
    assert out.startswith(f"schedule {sched.name}")
    assert f"= {sched.topology.num_ranks} ranks\n" in out
    for st in sched.dispatch.steps:
        assert re.search(rf"^  step {re.escape(st.name)}: .*# line {st.span.line}$", out, re.M), st.name


def test_emit_model_of_small_schedule(capsys):
    rc, out, _err = run(["compile", SMALL, "--emit", "model"], capsys)
    assert rc == 0
    assert "topology t: 1 node x 4 gpu = 4 ranks\n" in out
    assert "  link nv p2p: 100 GB/s, 2 us, engine sm connects peer (6 pairs)\n" in out
    assert "  step keep: permute input into output over hbm    # line 28\n" in out
    assert out.endswith("combine: reverse of dispatch (derived by the compiler)\n")


def test_emit_stops_at_the_first_error(tmp_path, capsys):
    bad = tmp_path / "bad.sched"
    bad.write_text((REPO / SMALL).read_text().replace("over nv", "over nvl"))
    rc, out, err = run(["compile", str(bad), "--emit", "model"], capsys)
    assert (rc, out) == (1, "")
    assert "error: unknown link 'nvl'" in err
    # The parse stage alone succeeds: --emit ast does not run the checker.
    rc, out, err = run(["compile", str(bad), "--emit", "ast"], capsys)
    assert rc == 0 and err == ""
    assert "Name 'nvl'" in out


def test_compile_bundle(tmp_path, capsys):
    rel = "schedules/h200x4.sched"
    out_dir = tmp_path / "bundle"
    rc, out, err = run(["compile", rel, "-o", str(out_dir)], capsys)
    assert rc == 0, err
    assert out.startswith(f"{rel}: compiled to {out_dir}/ (h200x4.mlir, ") and out.endswith("manifest.json)\n")
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["schedule"] == "h200x4"
    assert manifest["num_ranks"] == 4
    assert manifest["source"] == rel
    assert manifest["source_sha256"] == hashlib.sha256((REPO / rel).read_bytes()).hexdigest()
    assert manifest["files"]["ir"] == "h200x4.mlir"
    for f in manifest["files"].values():
        assert (out_dir / f).is_file(), f
    assert (out_dir / "h200x4.mlir").read_text().startswith("module @h200x4")


def test_huge_integer_is_a_user_error_not_a_crash(tmp_path, capsys):
    bad = tmp_path / "huge.sched"
    bad.write_text((REPO / SMALL).read_text().replace("hidden 256", "hidden 99999999999999999999999999999999"))
    rc, _out, err = run(["compile", str(bad), "--emit", "mlir"], capsys)
    assert no_crash(err), err
    assert rc == 1
    assert re.search(rf"^{re.escape(str(bad))}:\d+:\d+: error: ", err, re.M)


# --------------------------------------------------------------------------- viz


def _check_dot(rel: str, path: Path) -> None:
    dot = path.read_text(encoding="utf-8")
    assert dot.startswith("digraph ")
    sched, _warnings = check_file(rel)
    for st in sched.dispatch.steps:
        # Each step is a node whose label starts with its name and, for data steps, says the link.
        m = re.search(rf'^\s*"?{re.escape(st.name)}"? \[label="([^"]*)"', dot, re.M)
        assert m, f"no node for step '{st.name}'"
        label = m.group(1)
        assert label.startswith(st.name)
        assert f"line {st.span.line}" in label
        if st.link is not None:
            assert f"{st.link.kind} '{st.link.name}'" in label
    for kind in ("p2p", "d2d", "rdma", "local"):  # the legend
        assert f"legend_{kind} [label={kind}" in dot


def test_viz_dot_small(tmp_path, capsys):
    out_file = tmp_path / "small.dot"
    rc, out, err = run(["viz", SMALL, "-o", str(out_file)], capsys)
    assert (rc, err) == (0, "")
    assert out == f"{SMALL}: DAG written to {out_file}\n"
    _check_dot(SMALL, out_file)
    dot = out_file.read_text()
    assert "p2p 'nv'" in dot and "local 'hbm'" in dot
    assert "input -> push" in dot and "push -> output" in dot and "keep -> output" in dot


@pytest.mark.parametrize("rel", SCHEDULES)
def test_viz_dot_shipped(rel, tmp_path, capsys):
    out_file = tmp_path / "dag.dot"
    rc, out, err = run(["viz", rel, "-o", str(out_file)], capsys)
    assert no_crash(err), err
    assert rc == 0
    _check_dot(rel, out_file)


def test_viz_creates_the_output_directory(tmp_path, capsys):
    out_file = tmp_path / "a" / "b" / "dag.dot"
    rc, _out, err = run(["viz", SMALL, "-o", str(out_file)], capsys)
    assert (rc, err) == (0, "")
    assert out_file.is_file()


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' is not installed")
def test_viz_svg(tmp_path, capsys):
    out_file = tmp_path / "small.svg"
    rc, out, err = run(["viz", SMALL, "-o", str(out_file)], capsys)
    assert (rc, err) == (0, "")
    svg = out_file.read_text(encoding="utf-8")
    assert "<svg" in svg and svg.rstrip().endswith("</svg>")
    assert ">push<" in svg and ">keep<" in svg


def test_viz_unknown_format(tmp_path, capsys):
    out_file = tmp_path / "small.jpg"
    rc, out, err = run(["viz", SMALL, "-o", str(out_file)], capsys)
    assert (rc, out) == (1, "")
    assert err == f"epcc: error: {out_file}: unknown picture format '.jpg'; use one of .svg, .png, .dot, .pdf\n"
    assert not out_file.exists()


def test_viz_of_a_broken_schedule_writes_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.sched"
    bad.write_text((REPO / SMALL).read_text().replace("dtype bf16", "dtype fp16"))
    out_file = tmp_path / "bad.dot"
    rc, out, err = run(["viz", str(bad), "-o", str(out_file)], capsys)
    assert (rc, out) == (1, "")
    assert "error: unsupported dtype 'fp16'" in err
    assert not out_file.exists()


# --------------------------------------------------------------------------- viz --scheduled: the SM model

H200X4 = "schedules/h200x4.sched"  # one-hop: the CUDA target lowers it to the direct kernels
EP16 = "schedules/ubbv2_ep16.sched"  # 16 ranks: table-driven kernels only
ROLE_RANGE = re.compile(r"^\w+: \w+, SMs \d+-\d+$", re.M)  # kernel-formation's "kernel: role, SMs a-b" line


def _scheduled_dot(argv: list[str], tmp_path, capsys) -> str:
    out_file = tmp_path / "scheduled.dot"
    rc, out, err = run(["viz", *argv, "-o", str(out_file), "--scheduled"], capsys)
    assert (rc, err) == (0, ""), err
    assert out == f"{argv[0]}: scheduled DAG written to {out_file}\n"
    return out_file.read_text(encoding="utf-8")


def _cluster_label(dot: str, program: str) -> str:
    m = re.search(rf'subgraph cluster_{program} {{\n\s*color="#666666" label="([^"]*)"', dot)
    assert m, f"no cluster for program {program}"
    return m.group(1)


def _node_label(dot: str, program: str, step: str) -> str:
    m = re.search(rf'^\s*"{program}\.{step}" \[label="([^"]*)"', dot, re.M)
    assert m, f"no node {program}.{step}"
    return m.group(1)


def _critical_nodes(dot: str) -> set[str]:
    return set(re.findall(r'^\s*"(\w+\.\w+)" \[label="[^"]*" color="#d62728" [^\]]*penwidth=3\]', dot, re.M))


def _simulated(rel: str, sms=None, table=False):
    plan = build_plan(rel).plan
    kernels = None if table or plan.direct is None else plan.direct if sms is None else plan.direct.with_sms(sms)
    # the table-driven kernels as `epcc simulate` runs them (their metadata kernels, the Buffer's
    # calls, the roles' blocks); the direct kernels' model alone
    opts = sim_options(plan, None) if kernels is None else SimOptions(direct=kernels)
    return plan, kernels, describe(plan, kernels), simulate(plan, opts)


@pytest.mark.parametrize("argv", [[], ["--kernels", "auto"], ["--kernels", "direct"]])
def test_viz_scheduled_draws_the_direct_kernels_where_they_run(argv, tmp_path, capsys):
    dot = _scheduled_dot([H200X4, *argv], tmp_path, capsys)
    plan, kernels, model, res = _simulated(H200X4)
    assert kernels is not None and model["model"] == "direct"
    # the model as describe() words it, in the graph's label; per program its pool, launches,
    # metadata passes and drain
    assert f"\nSM model: {model['text']}\"" in dot
    assert model["per_program"]["dispatch"].startswith("3 launches, 2 metadata passes, drain ")
    assert model["per_program"]["combine"].startswith("1 launch, drain ")
    for program, pres in res.programs.items():
        assert _cluster_label(dot, program) == (
            f"{program}: {pres.makespan_s * 1e3:.3f} ms\ndirect kernel: {kernels.sms[program]} SMs per rank, shared "
            f"by all its steps, {model['per_program'][program]} ({pres.launch_s * 1e3:.3f} ms of launch and "
            f"metadata before its first step)")
        for st in pres.steps:
            label = _node_label(dot, program, st.name)
            assert label.endswith(f"\n{st.start_s * 1e3:.3f}-{st.end_s * 1e3:.3f} ms")
            assert "chunks x" not in label and "SMs" not in label
            if st.verb != "exchange":
                assert f"\nin the {program} kernel, not chunked\n" in label
    # no SM role of the table-driven kernels anywhere; times and the critical path are the direct model's
    assert not ROLE_RANGE.search(dot)
    assert f"total {res.total_s * 1e3:.3f} ms (serial {res.serial_s * 1e3:.3f} ms)" in dot
    assert _critical_nodes(dot) == {f"{p}.{s}" for p, pr in res.programs.items() for s in pr.critical_path}


def test_viz_scheduled_table_model_is_the_table_driven_drawing(tmp_path, capsys):
    dot = _scheduled_dot([H200X4, "--kernels", "table"], tmp_path, capsys)
    plan, _kernels, model, res = _simulated(H200X4, table=True)
    assert model["model"] == "roles"
    # what the table-driven kernels run, as for a plan without direct kernels (_simulated)
    assert dot == build_scheduled_graph(build_plan(H200X4), res).source
    assert "SM model" not in dot and "direct kernel" not in dot and "not chunked" not in dot
    roles = {(k.program, r.step): (k.name, r) for k in plan.kernels for r in k.roles}
    for program, pres in res.programs.items():
        assert _cluster_label(dot, program) == f"{program}: {pres.makespan_s * 1e3:.3f} ms"
        for st in pres.steps:
            kname, r = roles[(program, st.name)]
            assert f"\n{kname}: {r.role}, SMs {r.sm_begin}-{r.sm_end - 1}\n" in _node_label(dot, program, st.name)
    assert _critical_nodes(dot) == {f"{p}.{s}" for p, pr in res.programs.items() for s in pr.critical_path}


def test_viz_scheduled_direct_and_table_models_differ_on_h200x4(tmp_path, capsys):
    # the reason for --kernels: the two models give h200x4 different times (and here critical paths)
    direct = _scheduled_dot([H200X4], tmp_path, capsys)
    table = _scheduled_dot([H200X4, "--kernels", "table"], tmp_path, capsys)
    assert direct != table
    _p, _k, _m, dres = _simulated(H200X4)
    _p, _k, _m, tres = _simulated(H200X4, table=True)
    assert f"total {dres.total_s * 1e3:.3f} ms" in direct and f"total {tres.total_s * 1e3:.3f} ms" in table
    assert round(dres.total_s * 1e3, 3) != round(tres.total_s * 1e3, 3)


def test_viz_scheduled_sms_sets_the_pool(tmp_path, capsys):
    dot = _scheduled_dot([H200X4, "--sms", "64"], tmp_path, capsys)
    _plan, kernels, model, res = _simulated(H200X4, sms=64)
    assert kernels.sms == {"dispatch": 64, "combine": 64}
    assert f"\nSM model: {model['text']}\"" in dot and "dispatch 64 SMs" in model["text"]
    for program in ("dispatch", "combine"):
        assert "\ndirect kernel: 64 SMs per rank, shared by all its steps, " in _cluster_label(dot, program)
    assert f"total {res.total_s * 1e3:.3f} ms" in dot


def test_viz_scheduled_direct_kernels_without_sm_rates(tmp_path, capsys):
    # the direct kernels run the plan, but without the topology's `sm` line there is no pool to charge
    text = re.sub(r"\n  sm [^\n]*", "", (REPO / H200X4).read_text(encoding="utf-8"))
    assert "\n  sm " not in text
    src = tmp_path / "h200x4_no_sm.sched"
    src.write_text(text, encoding="utf-8")
    dot = _scheduled_dot([str(src)], tmp_path, capsys)
    _plan, kernels, model, _res = _simulated(str(src))
    assert model["model"] == "direct" and "no SM pool" in model["text"]
    assert f"\nSM model: {model['text']}\"" in dot
    for program in ("dispatch", "combine"):
        assert _cluster_label(dot, program).endswith(
            f"\ndirect kernel: {kernels.sms[program]} SMs per rank (no SM pool: the topology gives no `sm` copy "
            f"rate), {model['per_program'][program]}")
        assert model["per_program"][program].startswith(f"{kernels.launches[program]} launch")
    assert not ROLE_RANGE.search(dot)


def test_viz_scheduled_auto_on_a_plan_without_direct_kernels_draws_the_roles(tmp_path, capsys):
    dot = _scheduled_dot([EP16, "--tokens", "256"], tmp_path, capsys)
    assert "SM model" not in dot and "direct kernel" not in dot
    assert ROLE_RANGE.search(dot)


VIZ_ONLY_SCHEDULED = "only with --scheduled: the DAG without it is not simulated"


@pytest.mark.parametrize("argv, msg", [
    (["--kernels", "direct"], f"--kernels applies {VIZ_ONLY_SCHEDULED}"),
    (["--kernels", "auto"], f"--kernels applies {VIZ_ONLY_SCHEDULED}"),
    (["--sms", "8"], f"--sms applies {VIZ_ONLY_SCHEDULED}"),
    (["--cached"], f"--cached applies {VIZ_ONLY_SCHEDULED}"),
    (["--kernels", "table", "--sms", "8"], f"--kernels and --sms apply {VIZ_ONLY_SCHEDULED}"),
])
def test_viz_kernel_options_need_scheduled(argv, msg, tmp_path, capsys):
    out_file = tmp_path / "dag.dot"
    rc, out, err = run(["viz", H200X4, "-o", str(out_file), *argv], capsys)
    assert (rc, out, err) == (1, "", f"epcc: error: {msg}\n")
    assert not out_file.exists()


@pytest.mark.parametrize("command", ["simulate", "viz"])
@pytest.mark.parametrize("rel, argv, msg", [
    (H200X4, ["--sms", "0"], "--sms 0: SMs must be at least 1"),
    (H200X4, ["--sms", "many"], "--sms many: expected a whole number of SMs"),
    (H200X4, ["--sms", "8", "--kernels", "table"],
     "--sms applies to the direct kernels, not to --kernels table (the plan's `sms` give the roles)"),
    (EP16, ["--kernels", "direct"], f"--kernels direct: the CUDA target does not lower {EP16} to direct kernels: "
                                    "16 ranks do not fit one CUDA IPC domain (at most 8)"),
    (EP16, ["--sms", "64"], f"--sms: the CUDA target does not lower {EP16} to direct kernels: 16 ranks do not fit "
                            "one CUDA IPC domain (at most 8)"),
    (EP16, ["--cached"], f"--cached: the CUDA target does not lower {EP16} to direct kernels: 16 ranks do not "
                         "fit one CUDA IPC domain (at most 8)"),
])
def test_kernel_option_errors_are_the_same_in_simulate_and_viz(command, rel, argv, msg, tmp_path, capsys):
    out_file = tmp_path / "scheduled.dot"
    extra = ["-o", str(out_file), "--scheduled"] if command == "viz" else []
    rc, out, err = run([command, rel, *extra, *argv], capsys)
    assert (rc, out, err) == (1, "", f"epcc: error: {msg}\n")
    assert not out_file.exists()


def test_viz_kernels_is_a_choice(capsys):
    rc, out, err = run(["viz", H200X4, "-o", "x.dot", "--scheduled", "--kernels", "fast"], capsys)
    assert rc == 2 and out == ""
    assert "argument --kernels: invalid choice: 'fast' (choose from 'auto', 'direct', 'table')" in err


# --------------------------------------------------------------------------- a real process


def test_exit_statuses_of_the_real_process(tmp_path):
    def epcc(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "epcc.cli", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=120)

    ok = epcc("check", SMALL)
    assert (ok.returncode, ok.stderr) == (0, "")
    assert ok.stdout == f"{SMALL}: ok: 4 ranks, 2 dispatch steps, combine derived from dispatch\n"

    bad = tmp_path / "bad.sched"
    bad.write_text((REPO / SMALL).read_text().replace("topk 2", "topk 9"))
    err = epcc("check", str(bad))
    assert err.returncode == 1 and err.stdout == ""
    assert f"{bad}:" in err.stderr and "error: topk 9 is more than the 8 experts" in err.stderr

    usage = epcc()
    assert usage.returncode == 2 and "usage: epcc" in usage.stderr

    version = epcc("--version")
    assert (version.returncode, version.stdout) == (0, "epcc 0.1.0\n")


# --------------------------------------------------------------------------- hardening (from a fuzzing audit)

def test_an_output_path_that_cannot_be_written_is_a_user_error(capsys, tmp_path):
    for argv, text in ((["compile", SMALL, "-o", "/proc/epcc_out"], "/proc/epcc_out: No such file or directory"),
                       (["compile", SMALL, "-o", SMALL], f"-o {SMALL}: would overwrite the input {SMALL}"),
                       (["compile", SMALL, "-o", "tests/cli/data/small.sched/x"], "tests/cli/data/small.sched/x: Not a directory"),
                       (["viz", SMALL, "-o", "/proc/epcc_out.svg"], "/proc/epcc_out.svg: No such file or directory")):
        rc, out, err = run(argv, capsys)
        assert (rc, err) == (1, f"epcc: error: {text}\n"), argv


def test_tokens_and_hidden_beyond_the_files_limits_are_refused(capsys):
    for argv, text in ((["simulate", SMALL, "--tokens", "99999999999"],
                        "--tokens 99999999999: out of range (at most 16777216, as in a .sched file)"),
                       (["run", SMALL, "--hidden", "2000000"],
                        "--hidden 2000000: out of range (at most 1048576, as in a .sched file)")):
        rc, out, err = run(argv, capsys)
        assert (rc, err) == (1, f"epcc: error: {text}\n"), argv


def test_rdma_without_the_cuda_target_is_refused(capsys, tmp_path):
    rc, out, err = run(["compile", SMALL, "--rdma", "proxy", "-o", str(tmp_path / "b")], capsys)
    assert rc == 1 and "--rdma proxy chooses how a target's kernels run RDMA steps: add --target cuda or --target supa" in err


def _variant(tmp_path: Path, name: str, old: str, new: str) -> str:
    text = (REPO / "schedules" / name).read_text(encoding="utf-8")
    assert text.count(old) == 1, old
    path = tmp_path / name
    path.write_text(text.replace(old, new), encoding="utf-8")
    return str(path)


def test_a_link_slow_enough_to_overflow_the_wait_timeout_still_compiles(capsys, tmp_path):
    # 2 B/s: a step's estimate is ~1e10 s, 100 x that in ns passes int64; the timeout is clamped
    src = _variant(tmp_path, "h200x4.sched", "bandwidth 450 GB/s", "bandwidth 2 B/s")
    rc, out, err = run(["compile", src, "-o", str(tmp_path / "b")], capsys)
    assert rc == 0 and no_crash(err), err


def test_a_chunk_smaller_than_a_token_is_an_error_reported_once(capsys, tmp_path):
    src = _variant(tmp_path, "h200x2_2vnode.sched", "chunk 64 tokens depth 8\n  step keep_far",
                   "chunk 1 B depth 8\n  step keep_far")
    rc, out, err = run(["compile", src, "-o", str(tmp_path / "b")], capsys)
    assert rc == 1 and no_crash(err)
    assert err.count("error: a chunk of 1 B holds no whole token: one token of dispatch is 14400 B") == 1, err
    assert "1 error generated" in err or err.count(" error: ") == 1


def test_an_expression_too_long_is_located(capsys, tmp_path):
    src = _variant(tmp_path, "ubbv2_ep16.sched", "relation mate = ", "relation mate = ")
    text = Path(src).read_text(encoding="utf-8")
    line = next(l for l in text.splitlines() if l.strip().startswith("relation mate = "))
    rhs = line.split("->", 1)[1].split("#")[0].strip()
    long = line.split("->", 1)[0] + "-> " + rhs + " + 0" * 300
    Path(src).write_text(text.replace(line, long), encoding="utf-8")
    rc, out, err = run(["check", src], capsys)
    assert rc == 1 and no_crash(err)
    assert re.search(r"ubbv2_ep16\.sched:\d+:\d+: error: expression too long: more than 200 operators nested", err)


def test_an_empty_or_non_finite_routing_file_is_refused(capsys, tmp_path):
    empty, inf = tmp_path / "empty.npy", tmp_path / "inf.npy"
    np.save(empty, np.zeros((0, 8), dtype=np.int64))
    pop = np.ones(256)
    pop[3] = np.inf
    np.save(inf, pop)
    for path, msg in ((empty, "no tokens (shape [0, 8]): a measured routing needs at least one row"),
                      (inf, "popularity must be finite (entry 3 is not)")):
        rc, out, err = run(["simulate", "schedules/h200x4.sched", "--routing", str(path)], capsys)
        assert (rc, err) == (1, f"epcc: error: {path}: {msg}\n")


def test_rdma_options_reach_the_supa_target(capsys, tmp_path):
    """--rdma is the target's choice, SUPA's too: emulate compiles, proxy is refused by the SUPA
    backend with its own reason (its kernels may not write host memory), not as a missing target."""
    sched = str(Path(__file__).resolve().parents[2] / "schedules" / "h200x4_2vnode.sched")
    rc, out, err = run(["compile", sched, "--target", "supa", "--rdma", "emulate", "-o", str(tmp_path / "e")], capsys)
    assert rc == 0, err
    assert (tmp_path / "e" / "supa" / "manifest.json").is_file()
    rc, out, err = run(["compile", sched, "--target", "supa", "--rdma", "proxy", "-o", str(tmp_path / "p")], capsys)
    assert rc == 1 and "--target supa: rdma 'proxy' (the GPU proxy path)" in err


def test_metadata_exchange_chooses_how_the_routing_reaches_every_rank(capsys, tmp_path):
    sched = str(Path(__file__).resolve().parents[2] / "schedules" / "h200x2_2vnode.sched")
    rc, out, err = run(["compile", sched, "--metadata-exchange", "collective", "-o", str(tmp_path / "none")], capsys)
    assert (rc, err) == (1, "epcc: error: --metadata-exchange collective chooses how a target's metadata kernels "
                            "exchange the routing: add --target cuda or --target supa\n")
    for how, want in (("auto", "ipc"), ("ipc", "ipc"), ("collective", "collective")):
        rc, out, err = run(["compile", sched, "--target", "cuda", "--metadata-exchange", how,
                            "-o", str(tmp_path / how)], capsys)
        assert rc == 0, err
        m = json.loads((tmp_path / how / "cuda" / "manifest.json").read_text())
        assert m["metadata"]["exchange"] == want and m["options"]["metadata_exchange"] == want
    ep16 = str(Path(__file__).resolve().parents[2] / EP16)
    rc, out, err = run(["compile", ep16, "--target", "cuda", "--metadata-exchange", "ipc", "-o", str(tmp_path / "e")],
                       capsys)
    assert rc == 1 and err.endswith("epcc: error: --metadata-exchange ipc: metadata exchange 'ipc' maps every rank's "
                                    "gather area over CUDA IPC, but the plan's 16 ranks span more than one CUDA IPC "
                                    "domain (at most 8): use 'collective' or 'auto'\n"), err
    assert not (tmp_path / "e").exists()  # an option the plan cannot have: refused before anything is written


def test_proxy_tables_choose_where_the_proxy_paths_tables_come_from(capsys, tmp_path):
    sched = str(Path(__file__).resolve().parents[2] / "schedules" / "h200x2_2vnode.sched")
    rc, out, err = run(["compile", sched, "--target", "cuda", "--proxy-tables", "device", "-o", str(tmp_path / "a")],
                       capsys)
    assert (rc, err) == (1, "epcc: error: --proxy-tables device is for the GPU proxy path: add --rdma proxy\n")
    for tables, lowering in (("host", "host"), ("device", "device"), (None, "device")):  # device by default
        choice = ["--proxy-tables", tables] if tables else []
        rc, out, err = run(["compile", sched, "--target", "cuda", "--rdma", "proxy", *choice,
                            "-o", str(tmp_path / str(tables))], capsys)
        assert rc == 0, err
        m = json.loads((tmp_path / str(tables) / "cuda" / "manifest.json").read_text())
        assert m["metadata"]["lowering"] == lowering and m["options"]["proxy_device_tables"] == (lowering == "device")
