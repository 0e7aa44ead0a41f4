"""Rewrite the CUDA backend's golden sources (tests/backends/golden_cuda/<schedule>/): every
file `epcc compile schedules/<schedule>.sched --target cuda` writes into the bundle's cuda/.

    python tests/backends/regen_cuda_golden.py

Review the diff before committing; test_cuda_codegen.py::test_golden_h200x4 compares.
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden_cuda"
SCHEDULES = ("h200x4",)


def regenerate() -> None:
    from epcc import pipeline
    from epcc.backends import cuda

    for name in SCHEDULES:
        plan = pipeline.run(str(ROOT / "schedules" / f"{name}.sched")).passes.get("plan")
        out = GOLDEN / name
        shutil.rmtree(out, ignore_errors=True)
        for p in cuda.generate(plan, f"schedules/{name}.sched").write(out):
            print(p.relative_to(ROOT))


if __name__ == "__main__":
    regenerate()
