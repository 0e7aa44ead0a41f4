"""The metadata kernels' routing exchange by a process group's collective (the manifest's
metadata "exchange": "collective"): what carries every rank's routing where the ranks span several
CUDA IPC domains, so no rank can map another's gather area.

A gather area (epcc_table_meta.cu) holds three rank-major regions, each rank's slot contiguous:
token counts [R] int32, top-k experts [R][T][K] int32 and weights [R][T][K] fp32.  Once this rank
wrote its own slot of each (gather_copy, collective mode), one in-place
`all_gather_into_tensor` per region (the output the region, the input this rank's slot of it)
fills every other rank's slot.  The collective runs on the current stream of the calling
context (NCCL: stream-ordered, no host sync, CUDA-graph capturable; NVLink inside a box, the NIC
between boxes; BCCL on Biren), with whatever backend the group has: gloo on the CPU in the tests.

A rank that does not come to an exchange (it skipped a dispatch, stalled or died) is bounded by
the Buffer's timeout and reported by epcc, as every other wait of epcc's is (docs/cuda.md):

* `Exchange` all-gathers in a process group of its own, made once with the Buffer by every rank
  of the Buffer's group (`exchange_group`): a stuck exchange can be aborted without touching the
  caller's group, and no collective of the caller's pairs with one of epcc's.
* On the GPU, the stream bumps `entered` before the all-gathers and `left` after them (two
  one-element adds on a device view of pinned host memory: launched, and captured in a CUDA
  graph, with the collectives).  The host's watched wait for a launch (gpu_proxy/watch.py
  wait_watched: the normal mode's, Buffer.synchronize(), close) looks at them (ExchangeWatch): an
  exchange that entered and has not left for the Buffer's timeout raises ExchangeTimeout; the
  engine aborts this group (the NCCL kernels return; the rest of the stream runs on, and the
  kernels' own bounded waits give up) and the agreement names the rank that does not answer.
* torch's own timeout of the group (its NCCL watchdog, which tears the process down by default)
  is a backstop past epcc's (`backstop_s`), for a process that blocks in CUDA while no epcc wait
  watches (a host read after a low-latency dispatch without Buffer.synchronize()).
* On the CPU (gloo) the all-gather blocks the host: the group's timeout is the Buffer's, and what
  gloo raises becomes ExchangeTimeout.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d  # aborting one group has no public name

from ..base import EngineError
from ..gpu_proxy.watch import WatchFailed
from ..tensors import device_view

#: The description torch gives the exchange's group in its logs.
GROUP_DESC = "epcc metadata exchange"


def backstop_s(timeout_s: float) -> float:
    """torch's timeout of a GPU exchange's group (its watchdog's, counted from when the host
    enqueued the all-gather): twice the Buffer's and a minute, so that epcc's own report (at the
    Buffer's timeout from when the exchange started on the GPU) and its abort of the group come
    first even behind a long queue of earlier work."""
    return 2 * timeout_s + 60


class ExchangeTimeout(WatchFailed):
    """The metadata exchange did not complete on this rank: a rank of the group did not come to it.
    `lost_why` is what the agreement says of a rank that does not answer (Agreement.fail)."""

    def __init__(self, bundle: str, rank: int, how: str):
        what = f"the metadata exchange of bundle '{bundle}' (the process group's all-gather of every rank's routing)"
        super().__init__(f"{what} {how} on rank {rank}: a rank of the group did not come to it (it skipped the "
                         f"dispatch, stalled, or its process died)")
        self.lost_why = (f"it did not come to the metadata exchange of bundle '{bundle}', the process group's "
                         f"all-gather of every rank's routing: it skipped the dispatch, stalled, or its process died")


def area_regions(area: torch.Tensor, num_ranks: int, tokens: int, topk: int, off_tokens: int, off_topk: int,
                 off_weights: int) -> list[torch.Tensor]:
    """The three regions of a gather area (a uint8 tensor; offsets from epcc_table_meta_area) as
    rank-major views: counts [R] int32, experts [R, T, K] int32, weights [R, T, K] fp32."""
    n = num_ranks * tokens * topk
    return [area[off_tokens:off_tokens + 4 * num_ranks].view(torch.int32),
            area[off_topk:off_topk + 4 * n].view(torch.int32).view(num_ranks, tokens, topk),
            area[off_weights:off_weights + 4 * n].view(torch.float32).view(num_ranks, tokens, topk)]


def all_gather_slots(regions: list[torch.Tensor], rank: int, group) -> None:
    """Every rank's slot of each rank-major region, in place: slot `rank` is this rank's input."""
    for region in regions:
        dist.all_gather_into_tensor(region, region[rank:rank + 1], group=group)


def exchange_group(group, timeout_s: float):
    """A process group of the exchange's own over the ranks of `group`, torch's timeout
    `timeout_s`; every rank of `group` makes it, once, in the same order (no other rank takes
    part).  Where the default group is bound to a device (its NCCL communicators are split from
    their parent, every rank of which must take part) it is split from `group`'s communicator;
    otherwise a new group of `group`'s ranks and backend, set up among them."""
    ranks = dist.get_process_group_ranks(group)
    timeout = timedelta(seconds=timeout_s)
    if dist.group.WORLD.bound_device_id is not None:
        return dist.split_group(parent_pg=group, split_ranks=[list(range(len(ranks)))], timeout=timeout,
                                group_desc=GROUP_DESC)
    return dist.new_group(ranks, timeout=timeout, backend=dist.get_backend(group), use_local_synchronization=True,
                          group_desc=GROUP_DESC)


class ExchangeWatch:
    """The host's look at the exchanges on the GPU: `marks` [entered, left] (pinned host memory the
    stream bumps around every exchange, read as it changes).  `check` raises ExchangeTimeout when
    an exchange has entered and not left for `timeout_s` of this watch's looks (counted from the
    first look that saw it so: the host starts looking when it waits)."""

    def __init__(self, marks: np.ndarray, timeout_s: float, bundle: str, rank: int):
        self.marks, self.timeout_s, self.bundle, self.rank = marks, float(timeout_s), bundle, rank
        self._since: tuple[tuple[int, int], float] | None = None  # (marks in flight, first seen)

    def check(self, now: float) -> None:
        seen = (int(self.marks[0]), int(self.marks[1]))
        if seen[0] == seen[1]:
            self._since = None
        elif self._since is None or self._since[0] != seen:
            self._since = (seen, now)
        elif now - self._since[1] >= self.timeout_s:
            raise ExchangeTimeout(self.bundle, self.rank, f"did not complete within {self.timeout_s:g} s")


class Exchange:
    """One Buffer's metadata exchange: its process group (made here, by every rank of `group`),
    the all-gathers of a gather area's regions, and on the GPU the marks around them and their
    watch (`watch`; None on the CPU).  `bundle` names the bundle in messages."""

    def __init__(self, group, timeout_s: float, bundle: str, device: torch.device):
        self.rank = dist.get_rank(group)
        self.bundle, self.timeout_s = bundle, float(timeout_s)
        self.on_device = device.type != "cpu"
        self.group = exchange_group(group, backstop_s(timeout_s) if self.on_device else timeout_s)
        self.watch: ExchangeWatch | None = None
        if self.on_device:
            self.marks = torch.zeros(2, dtype=torch.int64, pin_memory=True)
            marks = device_view(self.marks.data_ptr(), 16, torch.int64, (2,), device)
            self._entered, self._left = marks[0:1], marks[1:2]
            self.watch = ExchangeWatch(self.marks.numpy(), timeout_s, bundle, self.rank)

    def all_gather(self, regions: list[torch.Tensor]) -> None:
        """Every rank's slot of each region, in place (this rank's slot its input), on the current
        stream: on the GPU between the marks, no host sync; on the CPU ExchangeTimeout where the
        group's all-gather failed (a rank that did not come within the group's timeout, or left)."""
        if self.group is None:  # never the caller's default group in its place
            raise EngineError(f"the metadata exchange of bundle '{self.bundle}' was aborted by an earlier failure: "
                              f"make a new Buffer")
        if self.on_device:
            self._entered.add_(1)
            all_gather_slots(regions, self.rank, self.group)
            self._left.add_(1)
            return
        try:
            all_gather_slots(regions, self.rank, self.group)
        except RuntimeError as e:  # gloo's timeout, or a peer's closed connection (DistBackendError is one)
            raise ExchangeTimeout(self.bundle, self.rank, f"did not complete ({e})") from e

    def abort(self) -> None:
        """End the group now, on this rank alone (a stuck NCCL all-gather returns); once."""
        group, self.group = self.group, None
        if group is not None:
            c10d._abort_process_group(group)

    def close(self) -> None:
        """Destroy the group (every rank's exchanges done: Buffer.close's barriers)."""
        group, self.group = self.group, None
        if group is not None:
            dist.destroy_process_group(group)


__all__ = ["Exchange", "ExchangeTimeout", "ExchangeWatch", "all_gather_slots", "area_regions", "backstop_s",
           "exchange_group"]
