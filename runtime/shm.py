"""Peer memory for ranks that are separate processes on one host: named POSIX shared memory.

The CPU analogue of CUDA IPC handles.  Every rank creates the segments of its own buffers and
flags and maps those of its peers by name, so a rank's kernels write straight into a peer's
buffer and bump a peer's counters with atomics, exactly as GPU kernels do over NVLink.

Names are deterministic: `epcc-<session>-<buffer>-r<rank>-g<generation>`.  Every rank computes
the same sizes from the same global layout, so every rank takes the same decision to grow a
segment (new generation) without talking; only a barrier orders "owner recreated it" before
"peers map it".  The session id is broadcast once when the runtime starts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np

GROWTH = 1.5


@dataclass
class _Seg:
    generation: int
    capacity: int
    shm: shared_memory.SharedMemory | None  # None until mapped


def _attach(name: str) -> shared_memory.SharedMemory:
    """Map a peer's segment without tracking it: it is the owner's to unlink.  (Python < 3.13
    registers attached segments with the resource tracker, which unlinks them when the attaching
    process exits, and processes started together share one tracker.)"""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name, create=False, track=False)
    register = resource_tracker.register
    resource_tracker.register = lambda *_a, **_k: None
    try:
        return shared_memory.SharedMemory(name, create=False)
    finally:
        resource_tracker.register = register


class PeerMemory:
    """Segments `(name, rank)`; this process owns those of `rank` and maps the others."""

    def __init__(self, session: str, rank: int, num_ranks: int):
        self.session = session
        self.rank = rank
        self.num_ranks = num_ranks
        self._segs: dict[tuple[str, int], _Seg] = {}

    def _seg_name(self, name: str, rank: int, gen: int) -> str:
        return f"epcc-{self.session}-{name}-r{rank}-g{gen}"

    def plan(self, name: str, sizes: list[int]) -> bool:
        """Make room for `sizes[r]` bytes of `name` on every rank r.  Returns True when some
        segment had to grow (the caller then barriers before mapping peers with `map_peers`)."""
        grew = False
        for r, need in enumerate(sizes):
            need = max(int(need), 8)
            seg = self._segs.get((name, r))
            if seg is not None and seg.capacity >= need:
                continue
            cap = need if seg is None else max(need, int(seg.capacity * GROWTH))
            gen = 0 if seg is None else seg.generation + 1
            if seg is not None and seg.shm is not None:
                self._release(name, r, seg)
            new = _Seg(gen, cap, None)
            if r == self.rank:
                new.shm = shared_memory.SharedMemory(self._seg_name(name, r, gen), create=True, size=cap)
            self._segs[(name, r)] = new
            grew = True
        return grew

    def map_peers(self) -> None:
        """Map every peer segment that is not mapped yet (after the owners created them)."""
        for (name, r), seg in self._segs.items():
            if seg.shm is None:
                seg.shm = _attach(self._seg_name(name, r, seg.generation))

    def array(self, name: str, rank: int, dtype, shape: tuple[int, ...]) -> np.ndarray:
        seg = self._segs[(name, rank)]
        count = int(np.prod(shape)) if shape else 1
        return np.ndarray(shape, dtype=dtype, buffer=seg.shm.buf, offset=0) if count else \
            np.zeros(shape, dtype=dtype)

    def _release(self, name: str, rank: int, seg: _Seg) -> None:
        try:
            seg.shm.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes when it does
        if rank == self.rank:
            seg.shm.unlink()

    def close(self) -> None:
        for (name, r), seg in list(self._segs.items()):
            if seg.shm is not None:
                self._release(name, r, seg)
        self._segs.clear()
