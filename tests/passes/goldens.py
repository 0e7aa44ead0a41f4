"""Per-pass IR goldens: the exact IR after every pass of one real plan, end to end.

Each pass's own decisions are pinned by the few CHECK lines of its lit tests (tests/lit/<pass>/);
this golden keeps the whole IR of ubbv2_ep16 (seed 000's EP16 relay: five staging buffers, a
routing exchange, SPC and DMA engines, order hints, multi-source sends), so an unintended change
anywhere in the printed IR of a real plan shows up as a diff.
`python tests/passes/goldens.py` rewrites it (review the diff before committing);
test_pass_goldens.py compares.  Paths in locations are relative to the repository root.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from epcc import pipeline
from epcc.passes import PIPELINE

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"
SCHEDULES = ("ubbv2_ep16",)


def ir_after_each_pass(name: str) -> dict[str, str]:
    texts: dict[str, str] = {}
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        pipeline.run(f"schedules/{name}.sched", pipeline.STAGES[-1].name,
                     print_after=lambda p, text: texts.__setitem__(p, text))
    finally:
        os.chdir(cwd)
    return texts


def golden_path(schedule: str, index: int, pass_name: str) -> Path:
    return GOLDEN / schedule / f"{index:02d}-{pass_name}.mlir"


def regenerate() -> None:
    for name in SCHEDULES:
        texts = ir_after_each_pass(name)
        (GOLDEN / name).mkdir(parents=True, exist_ok=True)
        for old in (GOLDEN / name).glob("*.mlir"):
            old.unlink()
        for i, p in enumerate(PIPELINE, 1):
            path = golden_path(name, i, p)
            path.write_text(texts[p], encoding="utf-8")
            print(f"{path.relative_to(ROOT)}: {len(texts[p].splitlines())} lines")


if __name__ == "__main__":
    sys.exit(regenerate())
