"""The host's wait for the kernels of the GPU proxy path (and of a bundle whose metadata exchange
is the process group's collective: cuda_table/exchange.py), watched: a proxy that stops or stalls
on one rank, an exchange that does not complete, or a peer that failed first, ends the wait at
once instead of at the kernels' timeout (or never, for the exchange).

Without the watch, a proxy thread that fails (a transport error, a bad FIFO entry) or stops
taking its FIFO's entries leaves the kernels waiting: this rank's pack roles for FIFO slots, the
peers' unpack roles for chunks that never land.  Every rank's kernels then give up at about the
same moment, each reports a timed-out wait, and the lowest rank is named (agree.py), not the rank
whose proxy failed.  So, while the host waits for a launch of the proxy path, it looks at:

* its own proxies (every CHECK_S): a proxy thread that ended (its status and message), or a
  FIFO entry the kernels published that the proxy has not taken for `stall_s` (half the Buffer's
  timeout: a healthy proxy takes an entry within microseconds; the kernels' own wait for a FIFO
  slot gives up only at the timeout).  Either is posted to the group as this rank's failure
  (ProxyFailed) and raises the alarm;
* its peers' alarm (every agree.WATCH_S, one store lookup): a peer that failed first makes this
  rank give up at once (Agreement.heed) with the peer's error.

Any watch does (an object whose `check(now)` raises a WatchFailed): ProxyWatch here, the
collective exchange's watch (cuda_table/exchange.py ExchangeWatch); `Watches` looks at several.

The wait polls the launch's completion (`done`, a CUDA event's query) without sleeping for its
first SPIN_S, so a healthy launch returns as soon as it completes (the normal mode's timings
include this wait); after that it yields the core between polls.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Protocol

from ..agree import WATCH_S, Agreement
from ..base import GroupError, KernelTimeout

#: Seconds between two looks at this rank's proxies.
CHECK_S = 0.001
#: A FIFO entry not taken for this fraction of the Buffer's timeout is a stalled proxy.
STALL_FRACTION = 0.5
#: Busy-poll the launch for this long, then sleep YIELD_S between polls.
SPIN_S = 0.01
YIELD_S = 0.00005


class WatchFailed(KernelTimeout):
    """What a watch saw go wrong on this rank while the host waited (a watch's `check` raises it):
    posted to the group as this rank's failure.  A KernelTimeout (a wait that gave up, in agree.py's
    order of causes): it can follow from a peer's failure, so a rank that never answered comes
    first as the cause.  `lost_why`, where set, says what such a rank did not do (Agreement.fail)."""

    lost_why: str | None = None


class ProxyFailed(WatchFailed):
    """This rank's GPU proxy stopped or stalled while its kernels needed it (a proxy's failure can
    follow from a peer's: a write into a peer that died)."""


class Watch(Protocol):
    def check(self, now: float) -> None: ...


class Watches:
    """Several watches as one: `check` looks at each, in order."""

    def __init__(self, watches: Iterable[Watch]):
        self.watches = list(watches)

    def check(self, now: float) -> None:
        for w in self.watches:
            w.check(now)


class Proxy(Protocol):
    program: str

    def stopped(self) -> str | None: ...

    def waiting(self) -> list[tuple[int, int]]: ...


class ProxyWatch:
    """Looks at a rank's proxies (gpu_proxy.engine.GpuRdma: `stopped`, `waiting`): `check` raises
    ProxyFailed for one that ended, or whose FIFO kept one entry untaken for `stall_s`."""

    def __init__(self, proxies: Iterable[Proxy], stall_s: float):
        self.proxies = list(proxies)
        self.stall_s = float(stall_s)
        self._since: dict[tuple[int, int], tuple[int, float]] = {}  # (proxy, FIFO) -> (head, first seen)

    def check(self, now: float) -> None:
        for p, proxy in enumerate(self.proxies):
            why = proxy.stopped()
            if why:
                raise ProxyFailed(f"the GPU proxy of the {proxy.program} program stopped: {why}")
            waiting = dict(proxy.waiting())
            for key in [k for k in self._since if k[0] == p and k[1] not in waiting]:
                del self._since[key]
            for fifo, head in waiting.items():
                seen = self._since.get((p, fifo))
                if seen is None or seen[0] != head:
                    self._since[(p, fifo)] = (head, now)
                elif now - seen[1] >= self.stall_s:
                    raise ProxyFailed(f"the GPU proxy of the {proxy.program} program has not taken entry {head} of "
                                      f"FIFO {fifo} in {self.stall_s:g} s (stalled)")


def wait_watched(done: Callable[[], bool], watch: Watch, agree: Agreement, *,
                 on_fail: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic) -> None:
    """Until `done()` is true (it raises where the launch failed: the caller reports that): what
    the watch saw (a proxy of this rank that stopped or stalled, an exchange that did not complete)
    is posted to the group (Agreement.fail: every rank raises the same GroupError), a peer's alarm
    makes this rank give up with the peer's error (Agreement.heed).  `on_fail` runs first in both
    cases (stop this rank's proxies, begin the abort of its exchange): it must return at once, as
    the report waits for it."""
    start = clock()
    next_check, next_alarm = start, start + WATCH_S
    try:
        while not done():
            now = clock()
            if now >= next_check:
                watch.check(now)
                next_check = now + CHECK_S
            if now >= next_alarm:
                agree.heed()
                next_alarm = now + WATCH_S
            if now - start > SPIN_S:
                time.sleep(YIELD_S)
    except WatchFailed as e:
        on_fail()
        agree.fail(e)
    except GroupError:
        on_fail()
        raise
