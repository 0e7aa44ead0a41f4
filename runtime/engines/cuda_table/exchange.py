"""The metadata kernels' routing exchange by a process group's collective (the manifest's
metadata "exchange": "collective"): what carries every rank's routing where the ranks span several
CUDA IPC domains, so no rank can map another's gather area.

A gather area (epcc_table_meta.cu) holds two rank-major regions, each rank's slot contiguous:
token counts [R] int32 and slot words [R][T][K] int64 (each a top-k slot's expert, weight and the
exchange's tag: epcc/table/meta.cuh slot_word).  The kernels read the peers' slot words only (a
token past a rank's count is a word of its own), so the metadata's exchange gathers that region
alone; the counts region's own slot is this rank's.  Once this rank
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
  one-element adds in device memory: launched, and captured in a CUDA graph, with the
  collectives; no kernel writes host memory).  The host's watched wait for a launch
  (gpu_proxy/watch.py wait_watched: the normal mode's, Buffer.synchronize(), close) reads them
  (DeviceMarks: a copy on a stream of its own, which runs while the dispatch's stream waits in
  the exchange) and watches them (ExchangeWatch): an exchange that entered and has not left for
  the Buffer's timeout raises ExchangeTimeout; the engine aborts this group (the NCCL kernels
  return; the rest of the stream runs on, and the kernels' own bounded waits give up: the abort,
  which waits for them, runs on a thread of its own) and at once posts the failure: the agreement
  names the rank that does not answer.
* torch's own timeout of the group (its NCCL watchdog, which tears the process down by default)
  is a backstop past epcc's (`backstop_s`), for a process that blocks in CUDA while no epcc wait
  watches (a host read after a low-latency dispatch without Buffer.synchronize()).
* On the CPU (gloo) the all-gather blocks the host: the group's timeout is the Buffer's, and what
  gloo raises becomes ExchangeTimeout.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from ..base import EngineError
from ..gpu_proxy.watch import WatchFailed

#: The description torch gives the exchange's group in its logs.
GROUP_DESC = "epcc metadata exchange"
#: How often a wait reads the marks (each read a copy of 16 bytes), the first time included: a
#: healthy launch is done before.
READ_S = 0.01


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


def area_regions(area: torch.Tensor, num_ranks: int, tokens: int, topk: int, off_tokens: int,
                 off_routing: int) -> list[torch.Tensor]:
    """The two regions of a gather area (a uint8 tensor; offsets from epcc_table_meta_area) as
    rank-major views: counts [R] int32, slot words [R, T, K] int64."""
    n = num_ranks * tokens * topk
    return [area[off_tokens:off_tokens + 4 * num_ranks].view(torch.int32),
            area[off_routing:off_routing + 8 * n].view(torch.int64).view(num_ranks, tokens, topk)]


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


class DeviceMarks:
    """[entered, left] on the GPU (bumped on the dispatch's stream around every exchange) and the
    host's latest copy of them, made on a stream of its own: it lands while the dispatch's stream
    waits in an exchange."""

    def __init__(self, device: torch.device):
        self.dev = torch.zeros(2, dtype=torch.int64, device=device)
        self.entered, self.left = self.dev[0:1], self.dev[1:2]
        self.host = torch.zeros(2, dtype=torch.int64, pin_memory=True)
        self.stream = torch.cuda.Stream(device)
        self.copied = torch.cuda.Event()
        self.pending = False
        self.seen: tuple[int, int] | None = None

    def read(self) -> tuple[int, int] | None:
        """The marks as the last copy that landed saw them (None: none landed yet); the next copy
        starts."""
        if self.pending:
            if not self.copied.query():
                return self.seen
            self.seen = (int(self.host[0]), int(self.host[1]))
        with torch.cuda.stream(self.stream):
            self.host.copy_(self.dev, non_blocking=True)
            self.copied.record(self.stream)
        self.pending = True
        return self.seen


class ExchangeWatch:
    """One wait's look at the exchanges on the GPU (`read`: the latest [entered, left], None when
    none yet; every READ_S, the first READ_S after the wait's first look).  `check` raises
    ExchangeTimeout when an exchange has entered and not left for `timeout_s`, counted from the
    first read that saw it so: the bound runs from when the host waits, as a kernel's runs from
    when it waits."""

    def __init__(self, read: Callable[[], tuple[int, int] | None], timeout_s: float, bundle: str, rank: int):
        self.read, self.timeout_s, self.bundle, self.rank = read, float(timeout_s), bundle, rank
        self._next: float | None = None  # the next read
        self._since: tuple[tuple[int, int], float] | None = None  # (marks in flight, first seen)

    def check(self, now: float) -> None:
        if self._next is None:  # the wait's first look
            self._next = now + READ_S
        if now < self._next:
            return
        self._next = now + READ_S
        seen = self.read()
        if seen is None or seen[0] == seen[1]:
            self._since = None
        elif self._since is None or self._since[0] != seen:
            self._since = (seen, now)
        elif now - self._since[1] >= self.timeout_s:
            raise ExchangeTimeout(self.bundle, self.rank, f"did not complete within {self.timeout_s:g} s")


class Exchange:
    """One Buffer's metadata exchange: its process group (made here, by every rank of `group`),
    the all-gathers of a gather area's regions, and on the GPU the marks around them (`marks`,
    None on the CPU) and a watch of them for each wait (`watch`).  `bundle` names the bundle in
    messages."""

    def __init__(self, group, timeout_s: float, bundle: str, device: torch.device):
        self.rank = dist.get_rank(group)
        self.bundle, self.timeout_s = bundle, float(timeout_s)
        self.on_device = device.type != "cpu"
        self.group = exchange_group(group, backstop_s(timeout_s) if self.on_device else timeout_s)
        self.marks = DeviceMarks(device) if self.on_device else None
        self._aborting: threading.Thread | None = None
        self.abort_s: float | None = None  # how long the group's abort took (abort, join)
        self.abort_error: str | None = None

    def watch(self) -> ExchangeWatch:
        """A watch of the marks for one wait (the GPU's)."""
        if self.marks is None:
            raise EngineError("the metadata exchange on the CPU blocks the host: it has no marks to watch")
        return ExchangeWatch(self.marks.read, self.timeout_s, self.bundle, self.rank)

    def all_gather(self, regions: list[torch.Tensor]) -> None:
        """Every rank's slot of each region, in place (this rank's slot its input), on the current
        stream: on the GPU between the marks, no host sync; on the CPU ExchangeTimeout where the
        group's all-gather failed (a rank that did not come within the group's timeout, or left)."""
        if self.group is None:  # never the caller's default group in its place
            raise EngineError(f"the metadata exchange of bundle '{self.bundle}' was aborted by an earlier failure: "
                              f"make a new Buffer")
        if self.marks is not None:
            self.marks.entered.add_(1)
            all_gather_slots(regions, self.rank, self.group)
            self.marks.left.add_(1)
            return
        try:
            all_gather_slots(regions, self.rank, self.group)
        except RuntimeError as e:  # gloo's timeout, or a peer's closed connection
            # (not only DistError: gloo's timeout is a plain RuntimeError in torch 2.13, which
            # tests/runtime_api/test_meta_exchange.py's skipping rank meets; e's text says which)
            raise ExchangeTimeout(self.bundle, self.rank, f"did not complete ({e})") from e

    # Neither ends the group's registration with torch: a group made without every rank of the
    # world is named by its ranks and the number of groups registered, so a group of the same
    # ranks made after one was unregistered would take its name, and its rendezvous would read
    # the old group's keys in the store.
    def abort(self) -> None:
        """End the group on this rank alone (a stuck NCCL all-gather returns), once, on a thread of
        its own: it returns at once (`join` waits for the abort).  torch's abort of an NCCL group
        returns when NCCL has torn its communicator down, which waits for the device: for the rest
        of this rank's stream, whose kernels after the all-gather wait for the rank that did not
        come up to the Buffer's timeout.  The report of the failure must not wait for that: on
        2 x H200 (2026-11-27, a 5 s timeout), with the abort before the report, rank 0 reported
        10.0 to 10.4 s after its call began instead of about 5, so its grace for the peers' answer
        (agree.GRACE_S) ran while a stalled rank came back, and it named itself, not that rank."""
        group, self.group = self.group, None
        if group is not None:
            self._aborting = threading.Thread(target=self._abort, args=(group,), name="epcc-exchange-abort",
                                              daemon=True)
            self._aborting.start()

    def _abort(self, group) -> None:
        t0 = time.monotonic()
        try:
            group.abort()
        except Exception as e:  # noqa: BLE001 - the thread's error has no caller: kept for the one who joins
            self.abort_error = f"{type(e).__name__}: {e}"
        self.abort_s = time.monotonic() - t0

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait up to `timeout_s` (None: for good) for the abort begun by `abort`; True when none
        is running.  `abort_s` is then how long it took, `abort_error` what it raised (if it did)."""
        if self._aborting is not None:
            self._aborting.join(timeout_s)
        return self._aborting is None or not self._aborting.is_alive()

    def close(self) -> None:
        """Shut the group down (every rank's exchanges done: Buffer.close's barriers); once."""
        group, self.group = self.group, None
        if group is not None:
            group.shutdown()


__all__ = ["DeviceMarks", "Exchange", "ExchangeTimeout", "ExchangeWatch", "all_gather_slots", "area_regions",
           "backstop_s", "exchange_group"]
