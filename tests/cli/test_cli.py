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

import pytest

from epcc import __version__
from epcc.cli import main
from epcc.sema.check import check_file

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
