"""Hostile inputs to the command line: every bad input is exit 1 with an exact message.

* Inputs are regular files of bounded size (epcc.files): a FIFO, a device, a directory or an
  empty name is refused by its type before anything is opened (nothing blocks), a file past its
  size cap by its size; a .npy's header is checked against its data before an array exists.
* No command writes over one of its inputs: compile -o, viz -o, simulate --gantt.
* A plan.json from outside is checked field by field (epcc.plan.check); a run that cannot fit
  in memory is refused with the estimate; a malformed bundle manifest stops `epcc tune`.
* What a diagnostic echoes is terminal-safe (escape sequences shown, not sent), bidirectional
  controls draw a located warning, and carets stand under the right column after CR-only line
  endings, control characters and wide characters.
* Every command refuses the same routings (`zipf:inf`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from epcc import limits
from epcc.runtime.engines.cpu_procs import ProcessBackend
from epcc.runtime.testing.check import run_bytes
from epcc.cli import main
from epcc.plan.check import check_plan_json

from bundle_tools import edit_json, rehash
from test_cli import REPO, SMALL, _at_repo_root, no_crash  # noqa: F401 (the fixture applies here too)
from test_cli import run as run_cli

SMALL_TEXT = (REPO / SMALL).read_text(encoding="utf-8")


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    rc, out, err = run_cli(argv, capsys)
    assert no_crash(err), err
    return rc, out, err


def refused(argv: list[str], message: str, capsys) -> None:
    """`epcc ARGV` exits 1 with exactly `epcc: error: MESSAGE` on stderr and nothing on stdout."""
    rc, out, err = run(argv, capsys)
    assert (rc, out, err) == (1, "", f"epcc: error: {message}\n"), argv


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


# --------------------------------------------------------------------------- special and large files

COMMANDS = [["check"], ["compile", "--emit", "ast"], ["viz", "-o", "x.dot"], ["simulate"], ["run"]]


def _argv(cmd: list[str], file: str) -> list[str]:
    return [cmd[0], file, *cmd[1:]]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c[0])
def test_a_fifo_as_the_schedule_is_refused_without_blocking(cmd, tmp_path, capsys):
    fifo = _fifo(tmp_path / "s.sched")  # opening it for reading would block: no writer
    refused(_argv(cmd, str(fifo)), f"{fifo}: is a named pipe (FIFO), not a .sched file", capsys)


def test_a_fifo_never_blocks_the_real_process(tmp_path):
    fifo = _fifo(tmp_path / "s.sched")
    npy = _fifo(tmp_path / "r.npy")
    for argv, msg in ((["check", str(fifo)], f"{fifo}: is a named pipe (FIFO), not a .sched file"),
                      (["simulate", SMALL, "--routing", str(npy)],
                       f"{npy}: is a named pipe (FIFO), not a routing .npy file")):
        r = subprocess.run([sys.executable, "-m", "epcc.cli", *argv], cwd=REPO, capture_output=True, text=True,
                           timeout=60)
        assert (r.returncode, r.stdout, r.stderr) == (1, "", f"epcc: error: {msg}\n")


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom", "/dev/null"])
def test_a_link_to_a_device_is_refused_unread(device, tmp_path, capsys):
    if not os.path.exists(device):
        pytest.skip(f"no {device}")
    link = tmp_path / "s.sched"
    link.symlink_to(device)
    refused(["check", str(link)], f"{link}: is a character device, not a .sched file", capsys)
    npy = tmp_path / "r.npy"
    npy.symlink_to(device)
    refused(["simulate", SMALL, "--routing", str(npy)], f"{npy}: is a character device, not a routing .npy file",
            capsys)


def test_a_socket_and_an_empty_name_are_refused(tmp_path, capsys):
    path = tmp_path / "s.sched"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        refused(["check", str(path)], f"{path}: is a socket, not a .sched file", capsys)
    refused(["check", ""], "empty file name: expected a .sched file", capsys)
    refused(["compile", "", "--emit", "ast"], "empty file name: expected a .sched file", capsys)


def test_a_schedule_past_the_size_cap_is_refused_by_its_size(tmp_path, capsys):
    big = tmp_path / "big.sched"
    with open(big, "wb") as fh:  # sparse: 5 MiB that never need to be read
        fh.truncate(5 << 20)
    refused(["check", str(big)], f"{big}: 5242880 bytes is too large for a .sched file (at most 4 MiB)", capsys)


def test_utf32_files_are_named_as_such(tmp_path, capsys):
    for enc, name in (("utf-32", "UTF-32"), ("utf-32-be", None), ("utf-16", "UTF-16")):
        p = tmp_path / f"{enc}.sched"
        data = SMALL_TEXT.encode(enc)
        p.write_bytes(data if name else b"\x00\x00\xfe\xff" + data)
        refused(["check", str(p)], f"{p}: the file is {name or 'UTF-32'} encoded; save it as UTF-8", capsys)


# --------------------------------------------------------------------------- .npy routings


def _npy_with_header(path: Path, shape: tuple, descr: str = "<i8", data: bytes = b"\0" * 64) -> Path:
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape!r}, }}"
    header += " " * (127 - 10 - len(header)) + "\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + data)
    return path


ROUTING_COMMANDS = [["compile", SMALL, "-o", "{out}"], ["simulate", SMALL], ["viz", SMALL, "-o", "{out}.dot",
                                                                            "--scheduled"], ["run", SMALL]]


def _routing_refused(cmd: list[str], path: Path, message: str, tmp_path, capsys) -> None:
    argv = [a.replace("{out}", str(tmp_path / "out")) for a in cmd] + ["--routing", str(path)]
    prefix = f"--routing {path}: " if cmd[0] == "run" else ""
    refused(argv, f"{prefix}{path}: {message}", capsys)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.dot").exists()


@pytest.mark.parametrize("cmd", ROUTING_COMMANDS, ids=lambda c: c[0])
def test_an_empty_npy_is_a_user_error(cmd, tmp_path, capsys):
    p = tmp_path / "empty.npy"
    p.write_bytes(b"")
    _routing_refused(cmd, p, "an empty file, not a NumPy .npy array", tmp_path, capsys)


@pytest.mark.parametrize("cmd", ROUTING_COMMANDS, ids=lambda c: c[0])
def test_a_npy_whose_header_claims_a_huge_shape_allocates_nothing(cmd, tmp_path, capsys):
    shape = (4 * 64 * 10 ** 9, 2) if cmd[0] != "run" else (4, 64 * 10 ** 9, 2)
    p = _npy_with_header(tmp_path / "huge.npy", shape)
    n = 4 * 64 * 10 ** 9 * 2 * 8
    _routing_refused(cmd, p, f"the header gives shape {list(shape)} of int64 ({n} bytes), but 64 bytes of data "
                             f"follow it", tmp_path, capsys)


def test_npy_that_is_truncated_or_holds_objects_or_is_not_npy(tmp_path, capsys):
    p = tmp_path / "short.npy"
    np.save(p, np.zeros((256, 2), np.int64))
    p.write_bytes(p.read_bytes()[:-8])
    refused(["simulate", SMALL, "--routing", str(p)],
            f"{p}: the header gives shape [256, 2] of int64 (4096 bytes), but 4088 bytes of data follow it", capsys)
    p = tmp_path / "objects.npy"
    np.save(p, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    refused(["simulate", SMALL, "--routing", str(p)],
            f"{p}: the array holds Python objects (object); expected numbers", capsys)
    p = _npy_with_header(tmp_path / "negative.npy", (-4, 2))
    refused(["simulate", SMALL, "--routing", str(p)],
            f"{p}: not a NumPy .npy array (the header gives shape [-4, 2])", capsys)
    p = tmp_path / "text.npy"
    p.write_text("uniform\n")
    rc, out, err = run(["simulate", SMALL, "--routing", str(p)], capsys)
    assert rc == 1 and err.startswith(f"epcc: error: {p}: not a NumPy .npy array (")


def test_run_reads_no_more_of_a_routing_than_the_plan_needs(tmp_path, capsys):
    p = tmp_path / "long.npy"
    np.save(p, np.zeros((4 * 64 * 1000, 2), np.int64))  # 1000 x the tokens of the plan
    size = p.stat().st_size
    assert 4 * 64 * 2 * 8 + (1 << 16) == 68 << 10  # [R, T, k] int64 and a header
    refused(["run", SMALL, "--routing", str(p)],
            f"--routing {p}: {p}: {size} bytes is too large for a routing .npy file (at most 68 KiB)", capsys)


# --------------------------------------------------------------------------- no command writes over its input


def _copy_small(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SMALL_TEXT, encoding="utf-8")
    return path


def test_compile_does_not_write_over_its_schedule(tmp_path, capsys):
    d = tmp_path / "bundle"
    src = _copy_small(d / "t.mlir")  # the schedule's name is its topology's, t: compile writes d/t.mlir
    refused(["compile", str(src), "-o", str(d)], f"-o {d}: would overwrite the input {src}", capsys)
    for name in ("plan.json", "manifest.json"):
        src = _copy_small(d / name)
        refused(["compile", str(src), "-o", str(d)], f"-o {d}: would overwrite the input {src}", capsys)
        refused(["compile", str(src), "-o", str(d / ".." / "bundle")],
                f"-o {d / '..' / 'bundle'}: would overwrite the input {src}", capsys)
        assert src.read_text(encoding="utf-8") == SMALL_TEXT
    src = _copy_small(d / "cuda" / "s.sched")  # the bundle directory is the compiler's, cuda/ included
    for target in ([], ["--target", "cuda"]):
        refused(["compile", str(src), *target, "-o", str(d)], f"-o {d}: the output directory holds the input {src}",
                capsys)
    refused(["compile", str(src), "-o", str(src)], f"-o {src}: would overwrite the input {src}", capsys)
    assert sorted(p.name for p in d.rglob("*")) == ["cuda", "manifest.json", "plan.json", "s.sched", "t.mlir"]
    # beside its output is fine
    rc, out, err = run(["compile", str(d / "cuda" / "s.sched"), "-o", str(tmp_path / "other")], capsys)
    assert rc == 0, err


def test_compile_does_not_write_over_its_routing(tmp_path, capsys):
    d = tmp_path / "bundle"
    d.mkdir()
    npy = d / "plan.json"
    np.save(npy.with_suffix(".npy"), np.tile(np.arange(2), (256, 1)))
    npy = npy.with_suffix(".npy")
    link = d / "plan.json"
    link.symlink_to(npy)
    with_npy = tmp_path / "r.npy"
    with_npy.symlink_to(link)  # --routing r.npy -> bundle/plan.json -> bundle/plan.npy
    refused(["compile", SMALL, "--routing", str(with_npy), "-o", str(d)],
            f"-o {d}: would overwrite the input {with_npy}", capsys)


def test_viz_does_not_write_over_its_schedule(tmp_path, capsys):
    src = _copy_small(tmp_path / "y.dot")
    refused(["viz", str(src), "-o", str(src)], f"-o {src}: would overwrite the input {src}", capsys)
    link = tmp_path / "picture.dot"
    link.symlink_to(src)
    refused(["viz", str(src), "-o", str(link), "--scheduled"], f"-o {link}: would overwrite the input {src}", capsys)
    hard = tmp_path / "hard.dot"
    os.link(src, hard)
    refused(["viz", str(src), "-o", str(hard)], f"-o {hard}: would overwrite the input {src}", capsys)
    assert src.read_text(encoding="utf-8") == SMALL_TEXT


def test_simulate_does_not_write_over_its_inputs(tmp_path, capsys):
    src = _copy_small(tmp_path / "z.svg")
    refused(["simulate", str(src), "--gantt", str(src)], f"--gantt {src}: would overwrite the input {src}", capsys)
    npy = tmp_path / "r.npy"
    np.save(npy, np.tile(np.arange(2), (256, 1)))
    gantt = tmp_path / "g.svg"
    os.link(npy, gantt)
    refused(["simulate", SMALL, "--routing", str(npy), "--gantt", str(gantt)],
            f"--gantt {gantt}: would overwrite the input {npy}", capsys)
    assert src.read_text(encoding="utf-8") == SMALL_TEXT


# --------------------------------------------------------------------------- epcc run on a plan.json


@pytest.fixture(scope="module")
def plan_dict(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("plan")
    assert main(["compile", str(REPO / SMALL), "-o", str(out)]) == 0
    return json.loads((out / "plan.json").read_text(encoding="utf-8"))


def _edit(d: dict, path: str, value) -> dict:
    d = json.loads(json.dumps(d))
    *head, last = path.split(".")
    node = d
    for k in head:
        node = node[int(k)] if isinstance(node, list) else node[k]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return d


NOT_A_PLAN = "not a plan written by 'epcc compile'"
PLAN_CASES = [
    ("workload.hidden", 256.5, "workload.hidden: expected a whole number, got 256.5"),
    ("steps.0.chunk_bytes", 1e300, "steps[0].chunk_bytes: expected a number of magnitude at most 1e+30, got 1e+300"),
    ("steps.0.chunk_bytes", 0.5, "steps[0].chunk_bytes: 0.5 is out of range (expected 1..1.09951e+12)"),
    ("steps.0.flows.0.select", "abc", "steps[0].flows[0].select: expected a list, got the string 'abc'"),
    ("steps.0.flows.0.select", [1, 9], "steps[0].flows[0].select[1]: 9 is out of range (a rank 0..3)"),
    ("steps.0.flows.0.dst", -1, "steps[0].flows[0].dst: -1 is out of range (a rank 0..3)"),
    ("num_ranks", "4", "num_ranks: expected a whole number, got the string '4'"),
    ("num_ranks", True, "num_ranks: expected a whole number, got true"),
    ("num_ranks", 10 ** 30, "num_ranks: expected a whole number of magnitude at most 2^53, got "
                            "100000000000... (31 digits)"),
    ("workload.dtype", "fp16", "workload.dtype: 'fp16' is not one of bf16, fp8"),
    ("workload.tokens", 0, "workload.tokens: 0 is out of range (expected 1..1.67772e+07)"),
    ("workload", [], "workload: expected an object, got a list"),
    ("steps.0.deps", ["nowhere"], "steps[0].deps[0]: no dispatch step named 'nowhere'"),
    ("steps.0.depth", None, "steps[0].depth: expected a whole number, got null"),
    ("rank_names", ["a"], "rank_names: 1 names for 4 ranks"),
    ("schedule", {"a": 1}, "schedule: expected a string, got an object"),
]


@pytest.mark.parametrize("path, value, message", PLAN_CASES, ids=[f"{p}={v!r}"[:40] for p, v, _ in PLAN_CASES])
def test_a_tampered_plan_is_a_user_error(path, value, message, plan_dict, tmp_path, capsys):
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(_edit(plan_dict, path, value)), encoding="utf-8")
    refused(["run", str(p), "--backend", "reference"], f"{p}: {NOT_A_PLAN}: {message}", capsys)


def test_plans_that_are_not_json_or_not_plans(plan_dict, tmp_path, capsys):
    p = tmp_path / "plan.json"
    for text, message in (
            ("[" * 100_000 + "]" * 100_000, f"{p}: {NOT_A_PLAN}: JSON nested more than 32 levels deep"),
            ("[" * 40 + "]" * 40, f"{p}: {NOT_A_PLAN}: JSON nested more than 32 levels deep"),
            (json.dumps(plan_dict).replace('"tail_s": 0.0', '"tail_s": NaN', 1),
             f"{p}: {NOT_A_PLAN}: not valid JSON: NaN is not a number JSON allows\n"),
            (json.dumps(plan_dict).replace('"tail_s": 0.0', '"tail_s": 1e999', 1),
             f"{p}: {NOT_A_PLAN}: not valid JSON: 1e999 is out of range of a double\n"),
            ('{"format": "epcc-plan", "version": 1, "schedule": 1}',
             f"{p}: {NOT_A_PLAN}: schedule: expected a string, got 1"),
            ('{"format": "epcc-plan", "version": 1}', f"{p}: {NOT_A_PLAN}: schedule: missing"),
            ("{}", f"{p}: {NOT_A_PLAN}: format: missing (a plan.json of an older epcc has none: recompile)"),
            ('{"format": "epcc-plan"}', f"{p}: {NOT_A_PLAN}: version: missing (a plan.json of an older epcc has "
                                        f"none: recompile)"),
            ('{"format": "epcc-plan", "version": "1"}', f"{p}: {NOT_A_PLAN}: version: expected a whole number, "
                                                        f"got the string '1'"),
            ('{"format": "epcc-manifest", "version": 1}', f"{p}: {NOT_A_PLAN}: format: expected 'epcc-plan', got "
                                                          f"the string 'epcc-manifest'"),
            (json.dumps({**plan_dict, "version": 2}), f"{p}: compiled by a newer epcc (plan.json version 2, this "
                                                      f"epcc reads version 1): recompile it with this epcc"),
            (json.dumps({**plan_dict, "version": 0}), f"{p}: compiled by an older epcc (plan.json version 0, this "
                                                      f"epcc reads version 1): recompile it with this epcc"),
            (json.dumps({**plan_dict, "extra": 1}), f"{p}: {NOT_A_PLAN}: extra: not a field of Plan"),
            ("{\udcff}", f"{p}: {NOT_A_PLAN}: not UTF-8 text (byte 0xff at offset 1)\n")):
        p.write_bytes(text.encode("utf-8", "surrogateescape"))
        rc, out, err = run(["run", str(p), "--backend", "reference"], capsys)
        assert (rc, out) == (1, "") and err.startswith(f"epcc: error: {message}"), (err, message)
    d = json.loads(json.dumps(plan_dict))
    d["steps"][0]["flows"].append(dict(d["steps"][0]["flows"][0]))
    p.write_text(json.dumps(d), encoding="utf-8")
    f = d["steps"][0]["flows"][0]
    refused(["run", str(p), "--backend", "reference"], f"{p}: {NOT_A_PLAN}: steps[0].flows[{len(d['steps'][0]['flows']) - 1}]: "
                                                       f"a second flow of rank {f['rank']} from {f['src']} to {f['dst']}",
            capsys)


def test_every_shipped_kind_of_plan_passes_the_check(tmp_path):
    for rel in ("schedules/h200x4.sched", "schedules/h200x4_2vnode.sched", "schedules/ubbv2_ep16.sched",
                "schedules/nvl8_hybrid.sched"):
        out = tmp_path / Path(rel).stem
        assert main(["compile", rel, "-o", str(out), "--tokens", "256", "--target", "none"]) == 0  # the plan alone
        check_plan_json(json.loads((out / "plan.json").read_text(encoding="utf-8")))


def test_random_edits_of_a_plan_give_a_user_error_or_a_run(plan_dict, tmp_path, capsys):
    """Random field edits of a compiled plan: `epcc run` exits 0 or 1, never 3 (no internal error)."""
    rng = random.Random(20261126)
    leaves = []

    def walk(v, path):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{path}.{k}" if path else k)
        elif isinstance(v, list):
            for i, x in enumerate(v[:3]):
                walk(x, f"{path}.{i}")
        else:
            leaves.append(path)

    walk(plan_dict, "")
    values = [None, True, -1, 0, 1, 2, 3, 4, 7, 2 ** 40, 2 ** 63, 0.5, 1e300, -1e-9, "", "x", "dispatch", [], [0],
              [5], {}, {"a": 1}]
    p = tmp_path / "plan.json"
    codes = {0: 0, 1: 0}
    for _ in range(60):
        path, value = rng.choice(leaves), rng.choice(values)
        p.write_text(json.dumps(_edit(plan_dict, path, value)), encoding="utf-8")
        capsys.readouterr()
        rc = main(["run", str(p), "--backend", "reference"])
        _out, err = capsys.readouterr()
        assert rc in (0, 1) and "internal compiler error" not in err, (path, value, err)
        codes[rc] += 1
    assert codes[1] > 0


# --------------------------------------------------------------------------- epcc run: memory


def test_a_run_that_cannot_fit_in_memory_is_refused_with_the_estimate(monkeypatch, capsys):
    monkeypatch.setattr(limits, "available_memory", lambda: 64 << 30)
    need = run_bytes(4, 1000, 1048576, "bf16", 2)
    # per token: its bf16 row, 2 x top-2 dispatched rows, 2 x top-2 expert outputs, 2 fp32 and 5 float64 results
    assert need == 4 * 1000 * (2 * 1048576 * 5 + 2 * 2 * 1048576 + 1048576 * 48)
    refused(["run", SMALL, "--tokens", "1000", "--hidden", "1048576"],
            "4 ranks x 1000 tokens x hidden 1048576 (bf16): the run needs about 242.2 GiB of memory (inputs, "
            "dispatched rows, expert outputs, combine results, the oracle's sums), 64.0 GiB are available; use "
            "smaller --tokens or --hidden", capsys)


# --------------------------------------------------------------------------- epcc tune: the manifest


@pytest.fixture(scope="module")
def cuda_bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cuda") / "b"
    assert main(["compile", str(REPO / "schedules" / "h200x4.sched"), "--target", "cuda", "-o", str(out),
                 "--tokens", "64"]) == 0
    return out


def _drop(d: dict, key: str) -> dict:
    del d[key]
    return d


def _role_blocks(d: dict) -> dict:
    d["kernels"][0]["roles"][0]["blocks"] = [0, 9999]
    return d


@pytest.mark.parametrize("edit, why", [
    (lambda d: [], "the top level is not a JSON object"),
    (lambda d: {**d, "num_ranks": "2"}, "num_ranks: expected a whole number, got the string '2'"),
    (lambda d: {**d, "num_ranks": 0}, "num_ranks: 0 is out of range (expected 1..4096)"),
    (lambda d: {**d, "num_ranks": 2.5}, "num_ranks: expected a whole number, got 2.5"),
    (lambda d: _drop(d, "num_ranks"), "num_ranks: missing"),
    (lambda d: {**d, "direct": []}, "direct: expected an object, got a list"),
    (lambda d: _drop(d, "version"), "version: missing (a cuda/manifest.json of an older epcc has none: recompile)"),
    (lambda d: {**d, "build": {**d["build"], "sources": ["../../x.cu"]}},
     "build.sources[0]: expected a file name (letters, digits, _ . + -), got the string '../../x.cu'"),
    (_role_blocks, "kernels[0].roles[0].blocks[1]: 9999 is out of range (expected 0..4096)"),
], ids=["list", "ranks-string", "ranks-0", "ranks-fraction", "no-ranks", "direct-list", "no-version", "path",
        "blocks"])
def test_tune_refuses_a_malformed_manifest(edit, why, cuda_bundle, tmp_path, capsys):
    b = tmp_path / "b"
    shutil.copytree(cuda_bundle, b)
    man = b / "cuda" / "manifest.json"
    edit_json(man, edit, bundle=b)
    refused(["tune", str(b)], f"{man}: not a manifest written by epcc ({why}); recompile the bundle", capsys)


def test_tune_refuses_manifests_of_another_version_or_changed(cuda_bundle, tmp_path, capsys):
    b = tmp_path / "b"
    shutil.copytree(cuda_bundle, b)
    man = b / "cuda" / "manifest.json"
    edit_json(man, lambda d: {**d, "num_ranks": 2})
    refused(["tune", str(b)], f"{b}: cuda/manifest.json is not the file 'epcc compile' wrote (its sha256 differs "
                              f"from the one manifest.json records): the bundle was changed after it was compiled; "
                              f"recompile it", capsys)
    for version, which in ((2, "a newer"), (0, "an older")):
        edit_json(man, lambda d: {**d, "version": version}, bundle=b)
        refused(["tune", str(b)], f"{man}: compiled by {which} epcc (cuda/manifest.json version {version}, this "
                                  f"epcc reads version 1): recompile it with this epcc", capsys)


def test_tune_refuses_manifests_that_are_not_json_or_not_files(cuda_bundle, tmp_path, capsys):
    b = tmp_path / "b"
    shutil.copytree(cuda_bundle, b)
    man = b / "cuda" / "manifest.json"
    man.write_text("{", encoding="utf-8")
    rehash(b)
    refused(["tune", str(b)], f"{man}: not a manifest written by epcc (not valid JSON: Expecting property name "
                              f"enclosed in double quotes: line 1 column 2 (char 1)); recompile the bundle", capsys)
    man.write_text("[" * 5000 + "]" * 5000, encoding="utf-8")
    rehash(b)
    refused(["tune", str(b)], f"{man}: not a manifest written by epcc (JSON nested more than 32 levels deep); "
                              f"recompile the bundle", capsys)
    man.unlink()
    _fifo(man)
    refused(["tune", str(b)], f"{man}: is a named pipe (FIFO), not a CUDA bundle manifest", capsys)
    man.unlink()
    refused(["tune", str(b)], f"{b}: no cuda/manifest.json; write the bundle with `epcc compile FILE "
                              f"--target cuda -o {b}`", capsys)
    shutil.copy(cuda_bundle / "cuda" / "manifest.json", man)
    edit_json(man, lambda d: {**_drop(d, "direct"), "lowering": "tables", "direct_not_used": "x"}, bundle=b)
    refused(["tune", str(b)], f"{b}: nothing to tune: the plan is not one-hop (x)", capsys)


# --------------------------------------------------------------------------- what diagnostics echo


def _variant(tmp_path: Path, old: str, new: str, name: str = "s.sched", newline: str = "\n") -> Path:
    assert SMALL_TEXT.count(old) == 1, old
    p = tmp_path / name
    p.write_bytes(SMALL_TEXT.replace(old, new).replace("\n", newline).encode("utf-8"))
    return p


def test_escape_sequences_in_the_source_are_shown_not_sent(tmp_path, capsys):
    p = _variant(tmp_path, "  topk 2", "  topk 2 \x1b[31mRED\x1b[0m")
    rc, out, err = run(["check", str(p)], capsys)
    line = SMALL_TEXT.splitlines().index("  topk 2") + 1
    assert (rc, out) == (1, "")
    assert err == (f"{p}:{line}:10: error: unexpected character U+001B; expected one of 'dtype', 'experts', 'hidden', "
                   f"'layout', 'node_limit', 'tokens', 'topk', 'weights' or '}}'\n"
                   f"    topk 2 \\x1b[31mRED\\x1b[0m\n"
                   f"           ^~~~\n")


def test_a_file_name_with_escape_sequences_is_shown_not_sent(tmp_path, capsys):
    name = "s\x1b]0;owned\x07\n\x1b[2J.sched"
    p = tmp_path / name
    p.write_text(SMALL_TEXT.replace("topk 2", "topk 9"), encoding="utf-8")
    shown = str(tmp_path) + "/s\\x1b]0;owned\\x07\\n\\x1b[2J.sched"
    rc, out, err = run(["check", str(p)], capsys)
    line = SMALL_TEXT.splitlines().index("  topk 2") + 1
    assert (rc, out) == (1, "")
    assert err == f"{shown}:{line}:3: error: topk 9 is more than the 8 experts\n    topk 9\n    ^~~~~~\n"
    p.write_text(SMALL_TEXT, encoding="utf-8")
    rc, out, err = run(["check", str(p)], capsys)
    assert (rc, err) == (0, "")
    assert out == f"{shown}: ok: 4 ranks, 2 dispatch steps, combine derived from dispatch\n"
    refused(["check", str(p) + "x"], f"{shown}x: no such file", capsys)


def test_bidirectional_controls_draw_a_located_warning(tmp_path, capsys):
    p = _variant(tmp_path, "  step push: send", '  step push "admin\u202e \u2066only": send')
    rc, out, err = run(["check", str(p)], capsys)
    line = SMALL_TEXT.splitlines().index("  step push: send tokens for peer from input to peer.output over nv") + 1
    src = '    step push "admin\\u202e \\u2066only": send tokens for peer from input to peer.output over nv'
    assert rc == 0 and out.endswith(": ok: 4 ranks, 2 dispatch steps, combine derived from dispatch\n")
    assert err == (f"{p}:{line}:19: warning: bidirectional control character U+202E (RIGHT-TO-LEFT OVERRIDE): the line "
                   f"may display in an order other than the one epcc reads\n{src}\n"
                   f"  {' ' * 18}^~~~~~\n"
                   f"{p}:{line}:21: warning: bidirectional control character U+2066 (LEFT-TO-RIGHT ISOLATE): the line "
                   f"may display in an order other than the one epcc reads\n{src}\n"
                   f"  {' ' * 25}^~~~~~\n")


def test_a_bidi_control_in_a_comment_warns_next_to_a_syntax_error(tmp_path, capsys):
    p = _variant(tmp_path, "# A small valid", "# \u202eA small valid")
    p.write_text(p.read_text(encoding="utf-8") + "garbage\n", encoding="utf-8")
    rc, out, err = run(["check", str(p)], capsys)
    assert (rc, out) == (1, "")
    first = err.splitlines()[0]
    assert first == (f"{p}:1:3: warning: bidirectional control character U+202E (RIGHT-TO-LEFT OVERRIDE): the line "
                     f"may display in an order other than the one epcc reads")
    assert f"{p}:{len(SMALL_TEXT.splitlines()) + 1}:1: error: unexpected name 'garbage'" in err


def test_cr_only_line_endings_put_the_caret_under_the_right_line(tmp_path, capsys):
    line = SMALL_TEXT.splitlines().index("  topk 2") + 1
    for newline in ("\r", "\r\n"):
        p = _variant(tmp_path, "  topk 2", "  topk 9", newline=newline)
        rc, out, err = run(["check", str(p)], capsys)
        assert (rc, out) == (1, "")
        assert err == f"{p}:{line}:3: error: topk 9 is more than the 8 experts\n    topk 9\n    ^~~~~~\n"


def test_carets_count_display_columns_after_wide_characters(tmp_path, capsys):
    p = _variant(tmp_path, "  step push: send tokens for peer from input to peer.output over nv",
                 '  step push "日本語の名前": send tokens for peer from input to peer.outputx over nv')
    line = SMALL_TEXT.splitlines().index("  step push: send tokens for peer from input to peer.output over nv") + 1
    rc, out, err = run(["check", str(p)], capsys)
    assert (rc, out) == (1, "")
    head, src, caret = err.splitlines()[:3]
    assert head == f"{p}:{line}:63: error: unknown buffer 'outputx'"
    assert src == '    step push "日本語の名前": send tokens for peer from input to peer.outputx over nv'
    # 62 characters before 'outputx', 6 of them wide: 68 columns, where a terminal shows 'outputx'
    assert caret == "  " + " " * 68 + "^~~~~~~"


def test_a_form_feed_inside_a_line_does_not_shift_the_lines(tmp_path, capsys):
    p = _variant(tmp_path, "# metadata exchange.", "# metadata\x0cexchange.\x85")
    p.write_text(p.read_text(encoding="utf-8").replace("topk 2", "topk 9"), encoding="utf-8")
    line = SMALL_TEXT.splitlines().index("  topk 2") + 1
    rc, out, err = run(["check", str(p)], capsys)
    assert err == f"{p}:{line}:3: error: topk 9 is more than the 8 experts\n    topk 9\n    ^~~~~~\n"


# --------------------------------------------------------------------------- every command, the same routings


@pytest.mark.parametrize("spec, why", [
    ("zipf:inf", "the Zipf exponent must be a finite number in 0..16, not inf"),
    ("zipf:nan", "the Zipf exponent must be a finite number in 0..16, not nan"),
    ("zipf:-1", "the Zipf exponent must be a finite number in 0..16, not -1"),
    ("zipf:17", "the Zipf exponent must be a finite number in 0..16, not 17"),
    ("zipf:1e999", "the Zipf exponent must be a finite number in 0..16, not 1e999"),
])
def test_every_command_refuses_the_same_zipf_exponents(spec, why, tmp_path, capsys):
    refused(["compile", SMALL, "--routing", spec, "-o", str(tmp_path / "b")], f"--routing {spec}: {why}", capsys)
    refused(["simulate", SMALL, "--routing", spec], f"--routing {spec}: {why}", capsys)
    refused(["viz", SMALL, "--routing", spec, "--scheduled", "-o", str(tmp_path / "g.dot")],
            f"--routing {spec}: {why}", capsys)
    refused(["run", SMALL, "--routing", spec], f"--routing '{spec}': {why}", capsys)
    for ok in ("zipf:0", "zipf:16"):
        rc, out, err = run(["simulate", SMALL, "--routing", ok], capsys)
        assert rc == 0, err


def test_timeouts_are_bounded_everywhere_they_are_accepted():
    for bad in (1e18, float("inf"), 86400.5, 0, -1, "5", True, float("nan")):
        with pytest.raises(ValueError) as e:
            ProcessBackend("libfabric-tcp", timeout_s=bad)
        assert str(e.value) == (f"ProcessBackend: timeout_s must be a number of seconds > 0 and at most 86400 (one "
                                f"day), not {bad!r}")
    assert limits.timeout_seconds(86400, "x") == 86400.0
    assert limits.timeout_seconds(0, "x", allow_zero=True) == 0.0
    with pytest.raises(ValueError) as e:
        limits.timeout_seconds(1e18, "execute", allow_zero=True)
    assert str(e.value) == "execute: timeout_s must be a number of seconds >= 0 and at most 86400 (one day), not 1e+18"
