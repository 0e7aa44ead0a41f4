"""Compile time of epcc's whole pipeline, per shipped schedule and for generated large EP.

    .venv/bin/python bench/compile_time.py [--repeat N]

The budget: a 32-node x 8-GPU schedule compiles in under 10 s on a 2-core machine.
Each case is compiled `--repeat` times (default 3) in this process; the table gives the median
wall time of a whole `epcc compile` (parse, check, emit, all nine passes) and of each stage.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from epcc import pipeline

ROOT = Path(__file__).resolve().parents[1]


def deepep_like(nodes: int, gpus: int, node_limit: int | None) -> str:
    limit = f" node_limit {node_limit}" if node_limit else ""
    return f"""schedule ep{nodes * gpus} "DeepEP-like internode dispatch, {nodes} nodes x {gpus} GPUs"
topology big {{
  levels node {nodes}, gpu {gpus}
  rank gpu
  relation nvl = other gpu
  relation rail = other node
  link nvlink p2p {{ connects nvl bandwidth 160 GB/s latency 3 us shared per gpu }}
  link rdma rdma {{ connects rail bandwidth 50 GB/s latency 5 us engine nic shared per gpu }}
  link hbm local {{ bandwidth 3000 GB/s }}
}}
workload {{ tokens 4096 per rank hidden 7168 dtype bf16 topk 8 experts 256 blocked{limit} weights travel }}
dispatch {{
  buffer rdma_recv
  step meta: exchange counts with all
  step rdma: send tokens for rail.node from input to rail.rdma_recv over rdma
  step intra: send tokens for nvl from input to nvl.output over nvlink
  step keep: permute input into output
  step fwd: send tokens for nvl from rdma_recv to nvl.output over nvlink
  step keep_far: permute rdma_recv into output
}}
combine reverse of dispatch
"""


def time_compile(path: str, repeat: int) -> tuple[float, dict[str, float]]:
    totals, per_stage = [], {}
    for _ in range(repeat):
        marks: dict[str, float] = {}
        t0 = time.perf_counter()
        last = [t0]

        def after(name: str, _text: str) -> None:
            now = time.perf_counter()
            marks[name] = now - last[0]
            last[0] = now

        pipeline.run(path, pipeline.STAGES[-1].name, print_after=after)
        totals.append(time.perf_counter() - t0)
        for k, v in marks.items():
            per_stage.setdefault(k, []).append(v)
    return statistics.median(totals), {k: statistics.median(v) for k, v in per_stage.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    cases = [(p.stem, str(p)) for p in sorted((ROOT / "schedules").glob("*.sched"))]
    tmp = Path(tempfile.mkdtemp(prefix="epcc-bench-"))
    for nodes, gpus, limit in ((32, 8, None), (32, 8, 4)):
        p = tmp / f"ep{nodes * gpus}{'_nl' if limit else ''}.sched"
        p.write_text(deepep_like(nodes, gpus, limit), encoding="utf-8")
        cases.append((f"EP{nodes * gpus} ({nodes}x{gpus}{', node_limit ' + str(limit) if limit else ''})", str(p)))
    print(f"{'schedule':34s} {'compile (s)':>11s}  slowest passes")
    for name, path in cases:
        total, stages = time_compile(path, args.repeat)
        slow = sorted(stages.items(), key=lambda kv: -kv[1])[:3]
        print(f"{name:34s} {total:11.2f}  " + ", ".join(f"{k} {v:.2f}" for k, v in slow))
    return 0


if __name__ == "__main__":
    sys.exit(main())
