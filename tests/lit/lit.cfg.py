# lit configuration of the pass tests: `.venv/bin/lit -v tests/lit` (README.md here says more).
#
# Every test is a small `.sched` (or `.mlir`) file whose `RUN:` lines compile it with epcc and
# pipe a stage to FileCheck, which matches the file's `CHECK:` lines.  The tools are the ones
# installed next to the Python that runs lit (the repository's .venv after `make setup`), so a
# test never picks up another epcc or FileCheck from PATH.

import os
import sys
from pathlib import Path

import lit.formats

config.name = "epcc"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".sched", ".mlir"]
config.excludes = ["tools", "README.md"]
config.test_source_root = os.path.dirname(__file__)
ROOT = Path(__file__).resolve().parents[2]
# %t files and lit's bookkeeping go under build/ (ignored by git), not into the source tree.
config.test_exec_root = str(ROOT / "build" / "lit")

BIN = Path(sys.executable).parent


def tool(name: str, package: str) -> str:
    path = BIN / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        lit_config.fatal(f"no '{name}' next to {sys.executable} ({package} is not installed there); "
                         f"run `make setup`, or run lit with the repository's .venv/bin/lit")
    return str(path)


# `%expect-exit N CMD ...` runs CMD and fails unless it exits with status N (lit's `not` accepts
# any failure, including an internal error's exit 3).
config.substitutions.append(("%expect-exit", f'"{sys.executable}" "{Path(__file__).parent / "tools" / "expect_exit.py"}"'))
config.substitutions.append(("%epcc", f'"{tool("epcc", "epcc")}"'))
config.substitutions.append(("%FileCheck", f'"{tool("filecheck", "the PyPI package filecheck")}"'))
