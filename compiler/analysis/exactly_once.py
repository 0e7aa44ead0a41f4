"""The exactly-once engine: does exactly one route fire for every destination set a token can have?

A (home h, destination d) pair has routes, each with `conds`: rank sets S that the token's
destination set D must hit for the route to fire (verify-delivery builds them from the dispatch
streams, derive-combine from the derived combine's contributions).  The number of routes that
fire depends on D only through the truth values "D hits S_i" of the few distinct sets S_1..S_m
in those conds (sets containing d are always hit and are dropped first).  We enumerate the
truth assignments A ⊆ {1..m} and, for each, decide exactly whether some *realizable* D has that
pattern:

* D must contain d, must avoid every S_i with i ∉ A, and must hit every S_i with i ∈ A;
* a token picks `topk` distinct experts, and with E/R experts on every rank (sema requires an
  even split) its destination set D is realizable iff ceil(topk / (E/R)) <= |D| <= min(topk, R):
  at most topk ranks, and enough of them to hold topk experts (with one expert per rank, as at
  EP256 with 256 experts, every D has exactly topk ranks; "any 1 <= |D| <= topk" would admit
  destination sets no token can have).

Let the *atoms* be the regions of the Venn diagram of S_1..S_m (ranks with the same membership
mask).  Ranks in an avoided set are forbidden; the allowed ranks are those whose mask ⊆ A, and d
(mask 0) is one of them.  Hitting every S_i, i ∈ A, takes one rank from each of a family of
atoms whose masks unite to exactly A: g[A] = the fewest atoms whose masks unite to A, a DP over
bitmasks (g[U | a] <= g[U] + 1 for every atom a).  Extra ranks from allowed atoms change no truth
value, so the pattern A is realizable iff g[A] is finite and

    max(1 + g[A], ceil(topk / (E/R))) <= min(topk, R, #allowed ranks(A)).

For every realizable A the number of routes whose condition masks ⊆ A must be 1; the first A
(fewest hits first) where it is not gives a concrete D (d, the smallest rank of each covering
atom, padded with the smallest allowed ranks) for the error message.

Cost per (h, d) pair: O(2^m * (#atoms + m)) with m the number of distinct sets not containing d;
results are cached per (d, conds signature).  Every shipped schedule, and a DeepEP-style EP256
plan, has m = 0 for every pair (each delivered stream's conds reduce to {d}): one pattern, O(1).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

#: Beyond this many distinct condition sets for one (home, destination) pair the exact
#: enumeration (2^m patterns) is skipped with a warning.  No real plan comes close.
MAX_SETS = 14


@dataclass(frozen=True)
class Failure:
    """A concrete destination set D under which a (home, d) pair is not delivered exactly once."""

    dest_set: tuple[int, ...]  # D, ascending
    fired: tuple[int, ...]  # indices of the routes that deliver under D
    missed: tuple[tuple[int, frozenset[int]], ...]  # (route index, a set D misses) for the others


class TooComplex(Exception):
    """More than MAX_SETS distinct condition sets for one pair (the count is the argument)."""


class ExactlyOnce:
    """Decides "exactly one route fires for every realizable destination set D ∋ d"."""

    def __init__(self, num_ranks: int, topk: int, experts_per_rank: int):
        self.n = num_ranks
        self.kmax = min(topk, num_ranks)
        self.kmin = max(1, -(-topk // max(experts_per_rank, 1)))
        self.patterns = 0  # destination patterns (classes of D) checked, cache hits included
        self.pairs = 0
        self._cache: dict[tuple, tuple[Failure | None, int]] = {}

    def check(self, d: int, routes: Sequence[tuple[frozenset[int], ...]]) -> Failure | None:
        """`routes[i]` is the conds of route i; returns None if exactly one fires for every D."""
        self.pairs += 1
        rc = tuple(tuple(c for c in conds if d not in c) for conds in routes)
        if all(not c for c in rc):  # every route fires for every D ∋ d: one pattern
            self.patterns += 1
            if len(rc) == 1:
                return None
            return Failure(self._pad([d], lambda r: True), tuple(range(len(rc))), ())
        key = (d, rc)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._solve(d, rc)
            self._cache[key] = hit
        self.patterns += hit[1]
        return hit[0]

    # ------------------------------------------------------------------ exact enumeration
    def _solve(self, d: int, rc: tuple[tuple[frozenset[int], ...], ...]) -> tuple[Failure | None, int]:
        sets: list[frozenset[int]] = []
        index: dict[frozenset[int], int] = {}
        for conds in rc:
            for c in conds:
                if c not in index:
                    index[c] = len(sets)
                    sets.append(c)
        m = len(sets)
        if m > MAX_SETS:
            raise TooComplex(m)
        route_mask = [sum(1 << index[c] for c in conds) for conds in rc]
        # Venn atoms: membership mask -> ranks (ranks in no set form mask 0, d among them).
        rank_mask: dict[int, int] = defaultdict(int)
        for i, s in enumerate(sets):
            for r in s:
                rank_mask[r] |= 1 << i
        atoms: dict[int, list[int]] = defaultdict(list)
        for r, mk in rank_mask.items():
            atoms[mk].append(r)
        for v in atoms.values():
            v.sort()
        count0 = self.n - len(rank_mask)
        full = 1 << m
        # allowed[A] = #ranks whose mask ⊆ A (subset-sum / zeta transform).
        allowed = [0] * full
        allowed[0] = count0
        for mk, rs in atoms.items():
            allowed[mk] += len(rs)
        for i in range(m):
            bit = 1 << i
            for a in range(full):
                if a & bit:
                    allowed[a] += allowed[a ^ bit]
        # g[U] = fewest atoms whose masks unite to exactly U; parent for reconstruction.
        inf = 1 << 30
        g = [inf] * full
        parent: list[tuple[int, int] | None] = [None] * full
        g[0] = 0
        masks = sorted(atoms)
        for u in range(full):
            if g[u] == inf:
                continue
            for a in masks:
                v = u | a
                if v != u and g[u] + 1 < g[v]:
                    g[v] = g[u] + 1
                    parent[v] = (u, a)
        checked = 0
        for a in sorted(range(full), key=lambda x: (bin(x).count("1"), x)):
            if g[a] == inf:
                continue
            lo = max(1 + g[a], self.kmin)
            hi = min(self.kmax, allowed[a])
            if lo > hi:
                continue
            checked += 1
            fired = tuple(i for i, mk in enumerate(route_mask) if mk & ~a == 0)
            if len(fired) == 1:
                continue
            # A concrete D: d, the smallest rank of each covering atom, then padding.
            chosen = [d]
            u = a
            while u:
                pu, atom = parent[u]
                chosen.append(atoms[atom][0])
                u = pu
            dest = self._pad(chosen, lambda r, a=a: rank_mask.get(r, 0) & ~a == 0, lo)
            missed = []
            for i, conds in enumerate(rc):
                if i not in fired:
                    miss = next(c for c in conds if not (a >> index[c]) & 1)
                    missed.append((i, miss))
            return Failure(dest, fired, tuple(missed)), checked
        return None, checked

    def _pad(self, chosen: list[int], ok, size: int | None = None) -> tuple[int, ...]:
        """`chosen` plus the smallest allowed ranks until D reaches the smallest realizable size."""
        want = max(size or 0, self.kmin)
        out = set(chosen)
        r = 0
        while len(out) < want and r < self.n:
            if r not in out and ok(r):
                out.add(r)
            r += 1
        return tuple(sorted(out))
