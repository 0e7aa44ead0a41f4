"""`epcc compile`'s target follows the topology's vendor (`vendor biren arch br166`): the one
decision (epcc.vendors.choose_target), what the CLI does with it, and where plan.json records
the vendor.  The SUPA code generator is registered by its own backend; here a recording stand-in
takes its place in compile.TARGETS, so what is checked is the CLI's dispatch, not SUPA code."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from epcc.cli import compile as compile_cmd
from epcc.cli import main
from epcc.plan import Plan
from epcc.plan.check import PlanJsonError, check_plan_json
from epcc.vendors import VENDORS, choose_target

REPO = Path(__file__).resolve().parents[2]
BIREN = [p.stem for p in sorted((REPO / "schedules").glob("*.sched"))
         if "vendor biren" in p.read_text(encoding="utf-8")]


def run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_decision():
    assert choose_target("biren", "br166", None).target == "supa"
    assert choose_target("nvidia", "hopper", None).target is None  # the plan alone, as before vendors
    assert choose_target("biren", "br166", "none").target is None
    c = choose_target("biren", "br166", "cuda")
    assert (c.target, c.note) == ("cuda", "--target cuda: emitting CUDA code for a biren br166 topology")
    c = choose_target("nvidia", "hopper", "supa")
    assert (c.target, c.note) == ("supa", "--target supa: emitting SUPA code for a nvidia hopper topology")
    assert choose_target("nvidia", "hopper", "cuda").note is None


def test_shipped_biren_schedules_name_their_vendor():
    assert set(BIREN) >= {"ubbv2_ep16", "ubbv2_ep32", "ubbv2_ep32_port10", "ocs_ep16", "ubbv2_card"}
    assert "h200x4_ubb2x2" not in BIREN  # runs on H200: nvidia hopper


def test_biren_default_without_a_supa_generator_is_a_user_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(compile_cmd, "TARGETS", {k: v for k, v in compile_cmd.TARGETS.items() if k != "supa"})
    rc, out, err = run(["compile", "schedules/ubbv2_ep32.sched", "-o", str(tmp_path / "b")], capsys)
    assert rc == 1
    assert err == ("epcc: error: schedules/ubbv2_ep32.sched: target supa (the default for a biren br166 topology): "
                   "this epcc has no supa code generator; --target none writes the plan alone, or name one of cuda\n")
    assert not (tmp_path / "b").exists()


def test_biren_default_runs_the_supa_generator(tmp_path, capsys, monkeypatch):
    """The Makefile's demo line: no --target, a Biren topology: the supa generator writes DIR/supa/."""
    seen = []

    def supa(plan, source, args):
        seen.append((plan.vendor, plan.arch, source))

        def write(d: Path) -> list[Path]:
            d.mkdir()
            (d / "kernels.su").write_text(f"// {plan.schedule}\n", encoding="utf-8")
            return [d / "kernels.su"]

        return compile_cmd.Generated(write, lambda out, file, paths: [f"{file}: SUPA sources in {out}/supa/"])

    monkeypatch.chdir(REPO)
    monkeypatch.setitem(compile_cmd.TARGETS, "supa", supa)
    out_dir = tmp_path / "b"
    rc, out, err = run(["compile", "schedules/ubbv2_ep32.sched", "-o", str(out_dir)], capsys)
    assert rc == 0, err
    assert seen == [("biren", "br166", "schedules/ubbv2_ep32.sched")]
    assert (out_dir / "supa" / "kernels.su").read_text() == "// ubbv2_ep32\n"
    assert out.splitlines()[-1] == f"schedules/ubbv2_ep32.sched: SUPA sources in {out_dir}/supa/"
    assert "supa/kernels.su" in json.loads((out_dir / "manifest.json").read_text())["sha256"]
    assert not (out_dir / "cuda").exists()


def test_cuda_on_a_biren_topology_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    rc, out, err = run(["compile", "schedules/ubbv2_ep16.sched", "--target", "cuda", "-o", str(tmp_path / "b")],
                       capsys)
    assert rc == 0, err
    assert err == "schedules/ubbv2_ep16.sched: note: --target cuda: emitting CUDA code for a biren br166 topology\n"
    assert (tmp_path / "b" / "cuda" / "manifest.json").is_file()


def test_target_none_and_the_nvidia_default_write_the_plan_alone(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    for sched, extra in (("ubbv2_ep16", ["--target", "none"]), ("h200x4", [])):
        out_dir = tmp_path / sched
        rc, out, err = run(["compile", f"schedules/{sched}.sched", "-o", str(out_dir), *extra], capsys)
        assert (rc, err) == (0, "")
        assert sorted(p.name for p in out_dir.iterdir()) == sorted([f"{sched}.mlir", "manifest.json", "plan.json"])


def test_plan_json_records_the_vendor(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    for sched, vendor in (("ubbv2_ep16", ("biren", "br166")), ("h200x4", ("nvidia", "hopper"))):
        assert main(["compile", f"schedules/{sched}.sched", "-o", str(tmp_path / sched), "--target", "none"]) == 0
        d = json.loads((tmp_path / sched / "plan.json").read_text(encoding="utf-8"))
        assert (d["vendor"], d["arch"]) == vendor
        # a plan.json from before vendors were named reads as nvidia hopper
        old = Plan.from_dict(check_plan_json({k: v for k, v in json.loads(json.dumps(d)).items()
                                              if k not in ("vendor", "arch", "launch")}))
        assert (old.vendor, old.arch, old.launch) == ("nvidia", "hopper", None)
        for field, bad, text in (("vendor", "amd", "vendor: 'amd' is not one of nvidia, biren"),
                                 ("arch", "br100", f"arch: 'br100' is not a {vendor[0]} architecture "
                                                   f"({', '.join(a.name for a in VENDORS[vendor[0]].archs)})")):
            with pytest.raises(PlanJsonError, match=f"^{re.escape(text)}$"):
                check_plan_json({**d, field: bad})
    capsys.readouterr()


def test_a_plan_the_metadata_kernels_do_not_cover_is_said_at_compile_time(capsys, tmp_path):
    """A keep_far ramped 6 halvings cuts 126 chunks at its end, beyond the metadata kernels' 64: the
    bundle falls back to tables the host lays out per dispatch, which `epcc compile` says on stderr
    (with the step, the numbers and the fix); asked for (--proxy-tables host), it says nothing."""
    text = (REPO / "schedules" / "h200x2_2vnode.sched").read_text(encoding="utf-8")
    assert text.count("depth 8 ramp 3") == 1
    src = tmp_path / "ramp6.sched"
    src.write_text(text.replace("depth 8 ramp 3", "depth 8 ramp 6"), encoding="utf-8")
    code, out, err = run(["compile", str(src), "--target", "cuda", "--rdma", "emulate", "-o", str(tmp_path / "b")],
                         capsys)
    why = ("dispatch step 'keep_far': its ramped ends are 0 and 126 chunks, the metadata kernels take at most 64 at "
           "each end (give it a smaller `ramp`)")
    assert code == 0 and err == (f"{src}: warning: the host lays out the tables on every dispatch, not the GPU's "
                                 f"metadata kernels ({why}): a fresh routing costs milliseconds per call, and the "
                                 f"low-latency mode is not available\n"), err
    manifest = json.loads((tmp_path / "b" / "cuda" / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["metadata"] == {"lowering": "host", "why": why}
    code, out, err = run(["compile", str(REPO / "schedules" / "h200x2_2vnode.sched"), "--target", "cuda", "--rdma",
                          "proxy", "--proxy-tables", "host", "-o", str(tmp_path / "h")], capsys)
    assert code == 0 and "warning" not in err, err
