"""The bundles the GPU tests and bench/ep_bench.py run, compiled on a CPU machine (MLIR is not on
the GPU machine) into one directory that travels with the tree:

    .venv/bin/python tests/gpu/bundles.py .gpu/bundles

h200x4 (EP4, 4096 tokens, bf16), h200x4_fp8 (--dtype fp8), h200x4_t128 (128 tokens: decode /
low-latency shape), and the same one-hop schedule on two GPUs (h200x2, h200x2_fp8, h200x2_t128):
h200x4.sched with `gpu 4` replaced by `gpu 2`, written next to the bundles.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
H200X4 = ROOT / "schedules" / "h200x4.sched"

VARIANTS = {  # name -> (ranks, extra compile options)
    "h200x4": (4, []),
    "h200x4_fp8": (4, ["--dtype", "fp8"]),
    "h200x4_t128": (4, ["--tokens", "128"]),
    "h200x2": (2, []),
    "h200x2_fp8": (2, ["--dtype", "fp8"]),
    "h200x2_t128": (2, ["--tokens", "128"]),
}


def ep2_source(out_dir: Path) -> Path:
    text = H200X4.read_text(encoding="utf-8")
    if "levels node 1, gpu 4" not in text or 'schedule h200x4 "' not in text:
        raise SystemExit(f"{H200X4}: cannot derive the EP2 schedule (levels line or name changed)")
    text = text.replace("levels node 1, gpu 4", "levels node 1, gpu 2").replace('schedule h200x4 "', 'schedule h200x2 "')
    path = out_dir / "h200x2.sched"
    path.write_text("# derived from schedules/h200x4.sched by tests/gpu/bundles.py: two GPUs\n" + text, encoding="utf-8")
    return path


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else ".gpu/bundles")
    out.mkdir(parents=True, exist_ok=True)
    ep2 = ep2_source(out)
    epcc = Path(sys.executable).parent / "epcc"
    for name, (ranks, extra) in VARIANTS.items():
        src = H200X4 if ranks == 4 else ep2
        cmd = [str(epcc), "compile", str(src), "--target", "cuda", "-o", str(out / name), *extra]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            print(res.stdout + res.stderr, file=sys.stderr)
            return 1
        print(f"{name}: {out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
