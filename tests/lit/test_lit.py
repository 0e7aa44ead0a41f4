"""Runs the lit + FileCheck tests in this directory (README.md) as one pytest test.

lit runs with the interpreter that runs pytest, so it finds that venv's epcc, filecheck and
mlir-opt (lit.cfg.py).  A missing lit or filecheck is a failure, never a skip: they are test
dependencies (pyproject.toml, `make setup`).  Every test file must run and pass: one that lit
does not discover, or reports UNSUPPORTED, fails this test too.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

LIT_DIR = Path(__file__).resolve().parent
SUFFIXES = (".sched", ".mlir")  # lit.cfg.py's config.suffixes


def lit_files() -> list[Path]:
    return sorted(p for p in LIT_DIR.rglob("*") if p.suffix in SUFFIXES and "tools" not in p.relative_to(LIT_DIR).parts)


def test_lit_suite():
    missing = [m for m in ("lit", "filecheck") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not installed in {sys.executable}: the lit tests need the test "
                    f"dependencies of pyproject.toml; run `make setup`")
    lit = Path(sys.executable).parent / "lit"
    assert lit.is_file(), f"no lit script at {lit}; run `make setup`"
    res = subprocess.run([str(lit), "-sv", str(LIT_DIR)], capture_output=True, text=True, timeout=1200)
    report = res.stdout + res.stderr
    assert res.returncode == 0, f"lit failed (exit {res.returncode}):\n{report[-20000:]}"
    passed = re.search(r"^\s*Passed\s*:\s*(\d+)", report, re.M)
    assert passed, f"no pass count in lit's report:\n{report[-5000:]}"
    assert int(passed.group(1)) == len(lit_files()), (
        f"lit passed {passed.group(1)} tests, but there are {len(lit_files())} test files:\n{report[-5000:]}")
