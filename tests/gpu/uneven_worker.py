"""GPU check of `Buffer(backend="cuda")` when the ranks dispatch different numbers of tokens; one
process per GPU:

    torchrun --nproc-per-node 2 tests/gpu/uneven_worker.py .gpu/bundles/h200x2_t128 .gpu/bundles/h200x2

Every rank picks its own channel count from its own token count (C = min(channels, T)), so the
peers' loops over a rank's channels must follow that rank's count, which it publishes with its
metadata; and every rank lays out its receive buffer with its own expert alignment.  Per bundle,
the token counts are a pattern rotated over the ranks, every rotation once: 127 / 120 / 0 / 128
on a 128-token bundle (two ranks: 127 and 120, 120 and 0, 0 and 128, 128 and 127); 4096 / 200 / 0
/ 257 on a larger one (its metadata counted by the dispatch kernel itself on one rank, in 1 or 2
or 16 chunks on the others).  For each: uniform routing and routing with empty (-1) slots and
tokens with no expert at all, in normal mode (sync=True) and low-latency mode (sync=False); each
rank with another expert alignment (1, 64, 8, 128 rotated); a CUDA graph of dispatch + combine
captured once and replayed on new inputs.  Everything against the oracle (ep_worker.Case: rows
bit-exact, counts, weights, combine within bf16 rounding of the partials), under the default
launch configuration and one of few, narrow blocks (channels of several tokens; a 128-token
bundle's metadata then by meta_count_kernel).

Kernel waits give up after EPCC_GPU_KERNEL_TIMEOUT seconds (default 5; a correct round takes
milliseconds): a wait that never ends (a peer's channel nobody serves) fails within seconds
with the kernel's report, it is not waited out.  Prints one line per check on rank 0 and exits 1
if any rank failed (the same verdicts and summary as ep_worker.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist

from ep_worker import Case, Checks, aligned_errors, graph_checks, main
from epcc.plan.direct import META_CHUNK
from epcc.runtime.buffer import Buffer

KERNEL_TIMEOUT_S = float(os.environ.get("EPCC_GPU_KERNEL_TIMEOUT", "5"))
ALIGNMENTS = (1, 64, 8, 128)
# the default launch configuration, and few narrow blocks: 2 x 2 warps take 16 channels of several tokens each
CONFIGS = {"default": None, "narrow": {"send_blocks": 2, "recv_blocks": 0, "warps": 2, "combine_send_blocks": 2,
                                       "combine_reduce_blocks": 1}}


def token_patterns(tmax: int, ranks: int) -> list[list[int]]:
    """Per round the tokens of each rank: a base pattern rotated over the ranks, every rotation."""
    if tmax <= META_CHUNK:
        base = (tmax - 1, tmax - 8, 0, tmax)  # 127 / 120 / 0 / 128 on a 128-token bundle
    else:
        base = (tmax, META_CHUNK - 56, 0, META_CHUNK + 1)  # one chunk of metadata, none, two
    return [[base[(r + k) % len(base)] for r in range(ranks)] for k in range(len(base))]


def run_uneven(path: Path, dev, checks: Checks) -> None:
    for label, config in CONFIGS.items():
        buf = Buffer(dist.group.WORLD, path, backend="cuda", timeout_s=KERNEL_TIMEOUT_S, config=config)

        def report(what: str, errs: list[str]) -> None:
            checks.report(buf, path.name, f"{label} {what}", errs)

        R, tmax = buf.num_ranks, buf.plan.workload.tokens
        for k, tokens in enumerate(token_patterns(tmax, R)):
            chans = "/".join(str(buf.engine.config.channels(t)) for t in tokens)
            tag = f"T={'/'.join(map(str, tokens))} C={chans}"
            for spec in ("uniform", "masked"):
                case = Case(buf, spec, 31 * k + len(spec), dev, tokens=tokens)
                x, idx, w = case.gpu_inputs()
                for sync in (True, False):
                    rx, ridx, rw, counts, h, _ = buf.dispatch(x, idx, w, sync=sync)
                    errs = case.check_dispatch(rx, rw, counts if sync else counts[0].cpu().tolist(), ridx)
                    errs += case.check_combine(buf.combine(case.y_for(rx, h.rows), h))
                    buf.synchronize()
                    report(f"{tag} {spec} {'sync' if sync else 'low-latency'}", errs)
            align = ALIGNMENTS[(buf.rank + k) % len(ALIGNMENTS)]
            aligns = "/".join(str(ALIGNMENTS[(r + k) % len(ALIGNMENTS)]) for r in range(R))
            report(f"{tag} expert_alignment={aligns}",
                   aligned_errors(buf, Case(buf, "uniform", 500 + k, dev, tokens=tokens), align, dev))
            graph_checks(buf, Case(buf, "uniform", 600 + k, dev, tokens=tokens),
                         [lambda i=i: Case(buf, ("masked", "zipf:1.2")[i], 700 + 10 * k + i, dev, tokens=tokens)
                          for i in range(2)], dev, report, f"{tag} cuda graph replay")
        buf.synchronize()
        dist.barrier()
        buf.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], run=run_uneven))
