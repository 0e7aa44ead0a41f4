"""Rewrite the CUDA backend's golden sources (tests/backends/golden_cuda/<variant>/): every file
`epcc compile schedules/<schedule>.sched --target cuda [options]` generates into the bundle's
cuda/ (the table-driven kernels, the launcher, the direct lowering's `<schedule>_direct.cu` and
`epcc_direct_config.cuh` when the plan is one-hop, manifest.json).  The static headers a
bundle also carries (backends/cuda/include/epcc/direct/*.cuh) have no golden: the tests check
that the bundle's copies are byte-identical to them.  One command, from the repository root:

    .venv/bin/python tests/backends/regen_cuda_golden.py

Review the diff before committing; test_cuda_codegen.py::test_golden_* compares (one test per
variant and file, so a failure names the file and shows the first differing lines).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from epcc import pipeline
from epcc.backends.cuda import codegen
from epcc.passes import PassOptions

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden_cuda"

# variant -> (schedule, PassOptions fields: what `epcc compile` takes as --dtype / --tokens)
VARIANTS: dict[str, tuple[str, dict]] = {
    "h200x4": ("h200x4", {}),
    "h200x4_fp8": ("h200x4", {"dtype": "fp8"}),  # the direct lowering's fp8 paths (scales, TMA of both)
    # the token-major direct kernels (DeepEP's output; epcc/direct/token.cuh), bf16 and fp8
    "h200x4_tok": ("h200x4", {"layout": "token"}),
    "h200x4_tok_fp8": ("h200x4", {"layout": "token", "dtype": "fp8"}),
}


def source_of(schedule: str) -> str:
    return f"schedules/{schedule}.sched"  # as given on the command line: it appears in comments


def generate(variant: str):
    """The CudaBundle of a variant, as `epcc compile` would write it."""
    schedule, opts = VARIANTS[variant]
    plan = pipeline.run(str(ROOT / source_of(schedule)), options=PassOptions(**opts)).passes.get("plan")
    return codegen.generate(plan, source_of(schedule))


def regenerate(variants: list[str] | None = None) -> None:
    for name in variants or list(VARIANTS):
        out = GOLDEN / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for file, text in generate(name).files.items():
            (out / file).write_text(text, encoding="utf-8")
            print((out / file).relative_to(ROOT))


if __name__ == "__main__":
    unknown = [v for v in sys.argv[1:] if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    regenerate(sys.argv[1:] or None)
