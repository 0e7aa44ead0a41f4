"""Rewrite tests/sema/cases/*.expected from the current output of `epcc check`.

    .venv/bin/python tests/sema/regen_expected.py            # every golden case
    .venv/bin/python tests/sema/regen_expected.py NAME ...   # these cases (creates missing ones)

Runs exactly as tests/sema/test_diagnostics.py::test_golden does: in-process, from the repository
root, with the case path relative to it.  This is for reviewing intended message changes: read
the `git diff` of the .expected files before keeping them.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

from epcc.cli import main as epcc_main

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CASES = HERE / "cases"


def current_stderr(name: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = epcc_main(["check", f"{CASES.relative_to(REPO).as_posix()}/{name}.sched"])
    return rc, err.getvalue()


def main(argv: list[str]) -> int:
    os.chdir(REPO)
    names = argv or sorted(p.stem for p in CASES.glob("*.sched"))
    changed = 0
    for name in names:
        rc, text = current_stderr(name)
        if rc != (0 if name.startswith("warn_") else 1) or "internal compiler error" in text:
            print(f"WARNING {name}: exit {rc}; not a clean user error", file=sys.stderr)
        path = CASES / f"{name}.expected"
        old = path.read_text(encoding="utf-8") if path.exists() else None
        if old != text:
            path.write_text(text, encoding="utf-8")
            changed += 1
            print(f"{'updated' if old is not None else 'created'} {path.relative_to(REPO)}")
    print(f"{changed} file(s) changed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
