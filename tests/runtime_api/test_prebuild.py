"""python -m epcc.runtime.prebuild: which libraries it builds for each kind of bundle, and its
errors (exit 1 naming the bundle or the setting).  Building for real needs nvcc: that case skips
where none is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from epcc.runtime.build_cache import find_nvcc
from epcc.runtime.prebuild import main, tasks

ROOT = Path(__file__).resolve().parents[2]


def bundle(tmp_path: Path, name: str, cuda: dict | None = None, supa: dict | None = None) -> Path:
    b = tmp_path / name
    for sub, manifest in (("cuda", cuda), ("supa", supa)):
        if manifest is not None:
            (b / sub).mkdir(parents=True)
            (b / sub / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return b


def test_each_kind_of_bundle_gets_the_libraries_its_engines_build(tmp_path):
    direct = bundle(tmp_path, "one_hop", cuda={"build": {"library": "x.so"}, "direct": {"library": "d.so"}})
    proxy = bundle(tmp_path, "vnode_proxy", cuda={"build": {"library": "x.so"}, "options": {"rdma": "proxy"}})
    supa = bundle(tmp_path, "supa", supa={"build": {}})
    assert [t[0] for t in tasks(direct, ("emulated",))] == ["table", "direct"]
    assert tasks(proxy, ("emulated", "nvshmem")) == [
        ("table", str(proxy / "cuda"), ""), ("proxy", str(proxy / "cuda" / "rdma"), "emulated"),
        ("proxy", str(proxy / "cuda" / "rdma"), "nvshmem")]
    assert tasks(supa, ("emulated",)) == [("supa-shim", str(supa / "supa"), "")]
    odd = bundle(tmp_path, "odd", cuda={"build": {"library": "x.so"}, "options": 5})  # not the compiler's
    assert tasks(odd, ("emulated",)) == [("table", str(odd / "cuda"), "")]


def test_a_folder_that_is_no_bundle_is_named(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 1
    assert capsys.readouterr().err == (f"prebuild: error: {tmp_path / 'empty'}: no cuda/manifest.json or "
                                       f"supa/manifest.json (not a bundle of `epcc compile --target cuda|supa`)\n")


def test_a_manifest_that_is_not_json_is_named(tmp_path, capsys):
    b = tmp_path / "broken"
    (b / "cuda").mkdir(parents=True)
    (b / "cuda" / "manifest.json").write_text("{not json", encoding="utf-8")
    assert main([str(b)]) == 1
    assert capsys.readouterr().err == (f"prebuild: error: {b}: not valid JSON: Expecting property name enclosed in "
                                       f"double quotes: line 1 column 2 (char 1)\n")


@pytest.mark.parametrize("argv, message", [
    (["--transports", "verbs"], "--transports: unknown transport 'verbs' (choose from emulated, nvshmem)"),
    (["--transports", "emulated,ucx,verbs"],
     "--transports: unknown transports 'ucx', 'verbs' (choose from emulated, nvshmem)"),
    (["--transports", ","], "--transports: no transport given (choose from emulated, nvshmem)"),
    (["--jobs", "0"], "--jobs must be >= 1, got 0"),
])
def test_bad_settings_exit_1_naming_the_setting(tmp_path, capsys, argv, message):
    b = bundle(tmp_path, "one_hop", cuda={"build": {"library": "x.so"}})
    assert main([str(b), *argv]) == 1
    assert capsys.readouterr().err == f"prebuild: error: {message}\n"


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed: the libraries are built with it")
def test_a_compiled_bundle_builds_into_the_cache_and_is_found_there_again(tmp_path):
    out = tmp_path / "h200x4"
    subprocess.run([sys.executable, "-m", "epcc.cli", "compile", str(ROOT / "schedules" / "h200x4.sched"),
                    "--target", "cuda", "-o", str(out)], check=True, capture_output=True)
    env = {**os.environ, "EPCC_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "epcc.runtime.prebuild", str(out), "-j", "2"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr
    assert "2 of 2 libraries built or found in the cache" in first.stdout
    assert sorted((tmp_path / "cache" / "cuda").iterdir())  # the libraries landed in the cache
    again = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert again.returncode == 0 and "2 of 2 libraries" in again.stdout
