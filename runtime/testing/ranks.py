"""Processes joined as torchrun joins its workers, each one's own exit status kept.

torchrun stops the other workers once one has exited with an error (SIGTERM) and exits 1 itself,
so its status cannot tell a rank that ended with status 1 from one that crashed, and its report
shows a signal it sent for a rank that was only slower to exit.  `run_ranks` starts the ranks
with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) and hosts their TCPStore itself, as torchrun's agent does
(TORCHELASTIC_USE_AGENT_STORE: every rank a client, so no rank's exit takes the store away from
the others), and waits for every rank on its own.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: still running at the deadline (then killed); negative: the signal
    output: str  # stdout and stderr, interleaved

    def ended(self) -> str:
        """How it ended, in words."""
        if self.returncode is None:
            return "did not end in time"
        if self.returncode < 0:
            return f"was killed by signal {-self.returncode}"
        return f"exited {self.returncode}"


def join_group():
    """This torchrun worker's GPU and process group: GPU LOCAL_RANK modulo the host's GPUs, and NCCL;
    where the host runs more ranks (LOCAL_WORLD_SIZE, else WORLD_SIZE) than it has GPUs, the ranks
    share them, their kernels time-sliced, over gloo (NCCL wants a GPU per rank).  (device,
    shared), or None where no CUDA device is visible (nothing joined)."""
    import torch  # reason: the runtime extra; only the GPU workers call this
    import torch.distributed as dist  # reason: the same

    gpus = torch.cuda.device_count()
    if gpus == 0:
        return None
    shared = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))) > gpus
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % gpus)
    torch.cuda.set_device(dev)
    if shared:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl", device_id=dev)
    return dev, shared


def run_ranks(cmd: list[str], ranks: int, *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
              timeout_s: float = 600.0) -> list[RankResult]:
    """Run `cmd` as `ranks` processes of one group (env:// rendezvous on a store hosted here);
    every rank's exit status and output.  Ranks still running after `timeout_s` are killed."""
    import torch.distributed as dist  # the store: torch is the runtime extra, and only the callers here need it

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = dict(os.environ, **(env or {}))
    base.update(WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True")
    with tempfile.TemporaryDirectory(prefix="epcc-ranks-") as tmp:
        logs = [Path(tmp) / f"rank{r}.log" for r in range(ranks)]
        procs = []
        try:
            for r in range(ranks):
                with open(logs[r], "wb") as out:  # a file, not a pipe: a rank never blocks on its output
                    procs.append(subprocess.Popen(cmd, cwd=cwd, env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                                                  stdout=out, stderr=subprocess.STDOUT))
        except BaseException:  # a rank that could not start: the ones started do not run on alone
            for p in procs:
                p.kill()
                p.wait()
            raise
        deadline = time.monotonic() + timeout_s
        codes: list[int | None] = []
        for p in procs:
            try:
                codes.append(p.wait(max(deadline - time.monotonic(), 0.0)))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for p, code in zip(procs, codes):
            if code is None:
                p.kill()
                p.wait()
        results = [RankResult(r, codes[r], logs[r].read_text(encoding="utf-8", errors="replace"))
                   for r in range(ranks)]
    del store  # the server goes once every rank has ended
    return results


def spawn_ranks(target, args_of, ranks: int, *, timeout_s: float = 120.0, daemon: bool = False) -> list[int]:
    """Run `target(*args_of(r))` for r in range(ranks), each in a process of its own (the spawn start
    method: no state inherited from the test's process), and wait for all of them until one shared
    deadline `timeout_s` from now; those still running then are killed.  The ranks that were (an
    empty list when every one ended in time): what each rank found goes where `target` writes it."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=tuple(args_of(r)), daemon=daemon) for r in range(ranks)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    return hung


__all__ = ["RankResult", "run_ranks", "spawn_ranks"]
