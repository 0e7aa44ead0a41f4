"""How every method is timed, and how ranks agree on failures.

Before every iteration, dispatch and combine separately: the device is synchronised, a gloo
barrier carries every rank's ok / failed status, the L2 is flushed (a 256 MB memset), a ~2 ms
device sleep lets the host enqueue the timed work, and a one-element NCCL all_reduce lines the
GPUs up; then CUDA events around the operation.  An iteration's time is the maximum over ranks
(report.py), the table gives the median.  A dry run times the wall clock on the CPU.
"""

from __future__ import annotations

import datetime
import sys
import time
import traceback

import torch
import torch.distributed as dist

from .data import CheckFailed

PG_TIMEOUT = datetime.timedelta(seconds=300)  # NCCL groups (a hang ends in the watchdog's abort)
GLOO_TIMEOUT = datetime.timedelta(seconds=600)  # host agreement; rank 0 may be running nvcc meanwhile
L2_FLUSH_BYTES = 256 << 20
SLEEP_CYCLES = 4_000_000  # about 2 ms at 2 GHz: the host enqueues the timed work meanwhile (GPU time is
# measured, not the host's launch cost, which a training step hides by running ahead)


class PeerFailed(RuntimeError):
    """Another rank reported a failure at the per-iteration barrier."""


class Comm:
    """The collectives one process needs: the default group (NCCL; gloo in a dry run, and where
    ranks share GPUs) and a gloo group for host-side agreement.  `shared`: more ranks than GPUs,
    rank r on GPU r mod #GPUs (NCCL wants a GPU per rank), so device tensors cross gloo through
    the host."""

    def __init__(self, dry: bool, dev: torch.device, cpu_group, shared: bool = False):
        self.dry, self.dev, self.cpu, self.shared = dry, dev, cpu_group, shared
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def all_gather_object(self, obj):
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.cpu)
        return out

    def barrier(self):
        dist.barrier(group=self.cpu)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[world, *t.shape] (every rank's t)."""
        out = torch.empty((self.world,) + tuple(t.shape), dtype=t.dtype, device=t.device)
        if self.dry or self.shared:
            parts = self.all_gather_object(t.detach().cpu().contiguous())
            for r, p in enumerate(parts):
                out[r].copy_(p)
        else:
            dist.all_gather_into_tensor(out.view(-1), t.contiguous().view(-1))
        return out

    def a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None) -> None:
        """all_to_all_single; in a dry run emulated over gloo with all_gather (gloo has no all_to_all)."""
        if not self.dry:
            dist.all_to_all_single(out, inp, out_splits, in_splits)
            return
        W = self.world
        ins = list(in_splits) if in_splits is not None else [inp.shape[0] // W] * W
        parts = self.all_gather_object((inp.contiguous(), ins))
        chunks = []
        for src_inp, src_splits in parts:
            lo = sum(src_splits[:self.rank])
            chunks.append(src_inp[lo:lo + src_splits[self.rank]])
        got = torch.cat(chunks) if chunks else inp[:0]
        if got.shape != out.shape:
            raise RuntimeError(f"a2a emulation: got {list(got.shape)}, out is {list(out.shape)}")
        out.copy_(got)


class Timer:
    """Per-iteration alignment and event timing (wall clock in a dry run)."""

    def __init__(self, comm: Comm, flush: bool):
        self.comm, self.dry = comm, comm.dry
        if not self.dry:
            self.l2 = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=comm.dev) if flush else None
            self.tick = torch.zeros(1, dtype=torch.float32, device=comm.dev)

    def align(self, ok: bool = True, why: str = "") -> None:
        """Every rank: device idle, then a gloo barrier that carries each rank's status (PeerFailed
        if another rank failed), then (GPU) L2 flush, device sleep, and an NCCL all_reduce that
        lines the GPUs up (not where ranks share GPUs: no NCCL group there); the host
        meanwhile enqueues the timed work."""
        if not self.dry:
            torch.cuda.synchronize()
        st = self.comm.all_gather_object((ok, why))
        bad = [(r, w) for r, (o, w) in enumerate(st) if not o]
        if bad:
            raise PeerFailed("; ".join(f"rank {r}: {w}" for r, w in bad))
        if self.dry:
            return
        if self.l2 is not None:
            self.l2.zero_()
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(SLEEP_CYCLES)
        if not self.comm.shared:
            dist.all_reduce(self.tick)

    def time(self, fn, after=None) -> tuple[float, object]:
        """Milliseconds of fn() on this rank (events around it on the current stream), its result."""
        self.align()
        if self.dry:
            t0 = time.perf_counter()
            res = fn()
            if after:
                after()
            return (time.perf_counter() - t0) * 1e3, res
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        res = fn()
        e.record()
        if after:
            after()
        e.synchronize()
        return s.elapsed_time(e), res


def run_iterations(timer: Timer, warmup: int, iters: int, step, check) -> dict:
    """warm-up, one checked iteration (set 0; CheckFailed raised by `check` is shared with every
    rank before anyone goes on), then the timed ones alternating the input sets.  step(set, phase)
    -> (dispatch ms, combine ms, outputs)."""
    for i in range(warmup):
        step(i % 2, "warmup")
    _, _, outs = step(0, "check")
    try:
        info = check(outs)
        ok, why = True, ""
    except Exception as e:  # noqa: BLE001 - CheckFailed, or a bug in the check: either way no numbers
        info, ok, why = None, False, f"check failed: {e}"
    del outs
    try:
        timer.align(ok, why)
    except PeerFailed as e:
        raise CheckFailed(str(e)) from None
    disp, comb = [], []
    for i in range(iters):
        d, c, _ = step(1 - i % 2, "timed")
        disp.append(d)
        comb.append(c)
    return {"dispatch_ms": disp, "combine_ms": comb, "check": info}


def guard(comm: Comm, fn) -> dict:
    """Run one method; a failure becomes {"error": ...} (check failures and peers' too)."""
    try:
        return fn()
    except CheckFailed as e:
        return {"error": f"WRONG: {e}"}
    except PeerFailed as e:
        return {"error": f"a peer failed: {e}"}
    except Exception as e:  # noqa: BLE001 - report, and tell the peers waiting at the next align()
        msg = f"{type(e).__name__}: {e}"
        sys.stderr.write(f"[rank {comm.rank}] {msg}\n{traceback.format_exc()}")
        notify_failure(comm, msg)
        return {"error": msg}


def stop_rows(out: dict, comm: Comm, row: str, e: Exception, detail: str) -> None:
    """A child's failure that ends its rows (its CUDA context may be gone): `row` gets the error,
    `out` is marked failed; this rank's own failure (`detail`: what it says) is told to the peers,
    a peer's (PeerFailed) is recorded as such."""
    if isinstance(e, PeerFailed):
        out["methods"][row] = {"error": f"a peer failed: {e}"}
    else:
        sys.stderr.write(f"[rank {comm.rank}] {row}: {detail}\n{traceback.format_exc()}")
        notify_failure(comm, detail)
        out["methods"][row] = {"error": detail}
    out["failed"] = True


def notify_failure(comm: Comm, msg: str) -> None:
    """Meet the peers' next Timer.align() (a gloo all_gather of statuses) with a failure, so
    that they stop too.  Host-side only: works with a dead CUDA context."""
    try:
        comm.all_gather_object((False, msg))
    except Exception:  # noqa: BLE001
        pass
