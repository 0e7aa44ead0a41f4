"""Regenerate the golden IR in tests/ir/golden/ after an intended change to IR emission.

    .venv/bin/python tests/ir/regen_golden.py              # every existing golden
    .venv/bin/python tests/ir/regen_golden.py h200x4 ...   # these (creates missing ones)

Golden NAME.mlir is the printed IR of schedules/NAME.sched, compiled exactly as
tests/ir/test_emit.py::test_golden does: from the repository root, by the relative path, so the
locations in the file do not depend on where the checkout lives.  Review the diff before
committing: a golden change is an IR change.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from epcc.dialect import new_context
from epcc.ir.emit import emit_module, print_module
from epcc.sema.check import check_file

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"


def golden_text(name: str) -> str:
    schedule, _warnings = check_file(f"schedules/{name}.sched")
    return print_module(emit_module(schedule, new_context()))


def main(argv: list[str]) -> int:
    os.chdir(REPO)
    names = argv or sorted(p.stem for p in GOLDEN.glob("*.mlir"))
    if not names:
        print("no goldens to regenerate; name the schedules, e.g. 'h200x4'", file=sys.stderr)
        return 2
    missing = [n for n in names if not (REPO / "schedules" / f"{n}.sched").exists()]
    if missing:
        print(f"no such schedule: {', '.join(f'schedules/{n}.sched' for n in missing)}", file=sys.stderr)
        return 2
    GOLDEN.mkdir(exist_ok=True)
    for name in names:
        path = GOLDEN / f"{name}.mlir"
        text = golden_text(name)
        old = path.read_text(encoding="utf-8") if path.exists() else None
        path.write_text(text, encoding="utf-8")
        state = "created" if old is None else ("unchanged" if old == text else "updated")
        print(f"{path.relative_to(REPO)}: {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
