"""Routing distributions: how likely a token's top-k experts hit given sets of ranks.

Every analysis asks one question: P(a token's destination ranks hit every one of the rank sets
S_1..S_m).  For uniform top-k routing without node limit the answer is exact:

    P = sum over J ⊆ {1..m} of (-1)^|J| * C(E - |X_J|, k) / C(E, k)

(inclusion-exclusion over misses; X_J = experts on the union of the S_j).  For skewed routing
(Zipf popularity), node-limited routing, or a measured routing (a `.npy` file of top-k indices or
of per-expert popularity), the probabilities come from a fixed, seeded sample of tokens: the same
inputs give the same numbers on every machine, and `describe()` says that they are sampled.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import lru_cache
from itertools import combinations
from math import comb
from pathlib import Path

import numpy as np

from ..diagnostics import CompileError, Diagnostic
from ..limits import zipf_exponent
from ..sema import model
from . import topk_file

SAMPLE_TOKENS = 1 << 15
SAMPLE_SEED = 20261122


class Routing(ABC):
    """Probabilities of hitting rank sets, and rows per receiving rank."""

    name = "routing"

    def __init__(self, wl: model.Workload, space: model.RankSpace):
        self.wl = wl
        self.space = space

    @abstractmethod
    def p_hit_all(self, conds: tuple[frozenset[int], ...]) -> float:
        """P(the token's destination ranks hit every set in conds)."""

    @abstractmethod
    def rows(self, conds: tuple[frozenset[int], ...], r: int) -> float:
        """E[number of the token's experts on rank r, times 1{hit all conds}], per token."""

    def describe(self) -> str:
        return self.name


class UniformRouting(Routing):
    """Uniform top-k without replacement, no node limit: exact closed forms."""

    name = "uniform"

    def p_hit_all(self, conds):
        return _p_hit_all(canon(conds), self.wl.experts_per_rank, self.wl.topk, self.wl.experts)

    def rows(self, conds, r):
        wl = self.wl
        if any(not c for c in conds):
            return 0.0
        others = canon(tuple(c for c in conds if r not in c))
        p = wl.topk / wl.experts * wl.experts_per_rank
        if others:
            p *= _p_hit_all(others, wl.experts_per_rank, wl.topk - 1, wl.experts - 1)
        return p

    def describe(self):
        return "uniform top-k (exact)"


class SampledRouting(Routing):
    """Probabilities measured on a fixed sample of top-k expert choices [N, k]."""

    def __init__(self, wl, space, topk_idx: np.ndarray, name: str):
        super().__init__(wl, space)
        self.name = name
        ranks = np.asarray([wl.rank_of_expert(e) for e in range(wl.experts)], dtype=np.int64)
        r_of = ranks[topk_idx]  # [N, k]
        n = topk_idx.shape[0]
        self.hits = np.zeros((n, space.num_ranks), dtype=bool)
        self.counts = np.zeros((n, space.num_ranks), dtype=np.int32)
        rows = np.repeat(np.arange(n), topk_idx.shape[1])
        np.add.at(self.counts, (rows, r_of.reshape(-1)), 1)
        self.hits = self.counts > 0
        self._cache: dict[frozenset[int], np.ndarray] = {}
        self._p: dict[tuple[frozenset[int], ...], float] = {}
        self._rows: dict[tuple[tuple[frozenset[int], ...], int], float] = {}

    def _hit(self, s: frozenset[int]) -> np.ndarray:
        v = self._cache.get(s)
        if v is None:
            idx = np.fromiter(sorted(s), dtype=np.int64, count=len(s))
            v = self.hits[:, idx].any(axis=1) if len(idx) else np.zeros(self.hits.shape[0], dtype=bool)
            self._cache[s] = v
        return v

    def _mask(self, conds):
        m = np.ones(self.hits.shape[0], dtype=bool)
        for c in canon(conds):
            m &= self._hit(c)
        return m

    def p_hit_all(self, conds):
        key = canon(conds)
        p = self._p.get(key)
        if p is None:
            p = self._p[key] = float(np.count_nonzero(self._mask(key))) / self.hits.shape[0]
        return p

    def rows(self, conds, r):
        key = (canon(conds), r)
        v = self._rows.get(key)
        if v is None:
            m = self._mask(key[0])
            v = self._rows[key] = float(self.counts[m, r].sum()) / self.hits.shape[0]
        return v

    def describe(self):
        return f"{self.name} (sampled: {self.hits.shape[0]} tokens)"


def canon(conds: tuple[frozenset[int], ...]) -> tuple[frozenset[int], ...]:
    """Drop conditions implied by others (hitting S implies hitting any superset of S)."""
    uniq = sorted(set(conds), key=lambda c: (len(c), sorted(c)))
    keep: list[frozenset[int]] = []
    for c in uniq:
        if not any(k <= c for k in keep):
            keep.append(c)
    return tuple(sorted(keep, key=lambda c: (len(c), sorted(c))))


@lru_cache(maxsize=1 << 16)
def _p_hit_all(conds: tuple[frozenset[int], ...], epr: int, k: int, e: int) -> float:
    if any(not c for c in conds):
        return 0.0
    if k <= 0:
        return 1.0 if not conds else 0.0
    total = comb(e, k)
    acc = 0.0
    for size in range(len(conds) + 1):
        sign = -1.0 if size % 2 else 1.0
        for js in combinations(conds, size):
            union = frozenset().union(*js) if js else frozenset()
            acc += sign * comb(e - epr * len(union), k) / total
    return max(0.0, min(1.0, acc))


# --------------------------------------------------------------------------- sampling


def _sample_topk(weights: np.ndarray, k: int, n: int, rng: np.random.Generator,
                 allowed: np.ndarray | None = None) -> np.ndarray:
    """n draws of k distinct experts, successive sampling proportional to `weights`
    (Gumbel top-k), optionally restricted per token by a boolean mask [n, E]."""
    g = rng.gumbel(size=(n, weights.shape[0]))
    with np.errstate(divide="ignore"):
        keys = np.log(weights)[None, :] + g
    if allowed is not None:
        keys = np.where(allowed, keys, -np.inf)
    return np.argsort(-keys, axis=1)[:, :k]


def _node_limited(wl: model.Workload, space: model.RankSpace, weights: np.ndarray, n: int,
                  rng: np.random.Generator) -> np.ndarray:
    """DeepSeek-V3 node-limited routing: pick `node_limit` groups (by the best expert score in
    each), then the top-k experts inside them."""
    scope = wl.node_limit_scope
    rank_scope = [space.scope_key(r, scope) for r in range(space.num_ranks)]
    keys = {k: i for i, k in enumerate(dict.fromkeys(rank_scope))}
    expert_group = np.asarray([keys[rank_scope[wl.rank_of_expert(e)]] for e in range(wl.experts)])
    g = rng.gumbel(size=(n, wl.experts))
    with np.errstate(divide="ignore"):
        scores = np.log(weights)[None, :] + g
    n_groups = len(keys)
    best = np.full((n, n_groups), -np.inf)
    for gi in range(n_groups):
        best[:, gi] = scores[:, expert_group == gi].max(axis=1)
    chosen = np.argsort(-best, axis=1)[:, : wl.node_limit]
    allowed_group = np.zeros((n, n_groups), dtype=bool)
    np.put_along_axis(allowed_group, chosen, True, axis=1)
    allowed = allowed_group[:, expert_group]
    scores = np.where(allowed, scores, -np.inf)
    return np.argsort(-scores, axis=1)[:, : wl.topk]


def routing_model(spec: str, wl: model.Workload, space: model.RankSpace) -> Routing:
    """`uniform`, `zipf:S` (expert popularity ~ 1/rank^S), or `FILE.npy`: int [N, k] top-k indices
    (a measured routing) or float [E] expert popularity.  Bad specs raise CompileError."""
    rng = np.random.default_rng(SAMPLE_SEED)
    limited = wl.node_limit is not None and wl.node_limit < space.scope_instances(wl.node_limit_scope)
    if spec == "uniform":
        if not limited:
            return UniformRouting(wl, space)
        weights = np.ones(wl.experts)
        idx = _node_limited(wl, space, weights, SAMPLE_TOKENS, rng)
        return SampledRouting(wl, space, idx, f"uniform, node_limit {wl.node_limit} over {wl.node_limit_scope}")
    if spec.startswith("zipf:"):
        try:
            s = zipf_exponent(spec)
        except ValueError as e:
            raise _bad(f"--routing {spec}: {e}") from None
        # Popularity by a fixed random permutation of the experts, so that hot experts are spread.
        perm = np.random.default_rng(SAMPLE_SEED + 1).permutation(wl.experts)
        weights = 1.0 / np.power(np.arange(1, wl.experts + 1, dtype=float), s)[np.argsort(perm)]
        if limited:
            idx = _node_limited(wl, space, weights, SAMPLE_TOKENS, rng)
        else:
            idx = _sample_topk(weights, wl.topk, SAMPLE_TOKENS, rng)
        return SampledRouting(wl, space, idx, f"zipf:{s:g}")
    if spec.endswith(".npy"):
        return _from_file(spec, wl, space, rng, limited)
    raise _bad(f"--routing {spec}: expected 'uniform', 'zipf:S' or a .npy file")


def _from_file(path: str, wl, space, rng, limited) -> Routing:
    try:
        arr = topk_file.read(path)
        if arr.ndim == 2 and np.issubdtype(arr.dtype, np.integer):
            rows = topk_file.topk_rows(arr, path, wl.topk, wl.experts, empty_slots=False)
            return SampledRouting(wl, space, rows, f"measured {Path(path).name}")
    except topk_file.TopkFileError as e:
        raise _bad(str(e)) from None
    if arr.ndim == 1 and arr.shape[0] == wl.experts and np.issubdtype(arr.dtype, np.number):
        w = arr.astype(float)
        if not np.isfinite(w).all():
            raise _bad(f"{path}: popularity must be finite (entry {int(np.flatnonzero(~np.isfinite(w))[0])} is not)")
        if (w < 0).any() or not (w > 0).sum() >= wl.topk:
            raise _bad(f"{path}: popularity must be >= 0 with at least topk={wl.topk} positive entries")
        idx = (_node_limited(wl, space, w, SAMPLE_TOKENS, rng) if limited
               else _sample_topk(w, wl.topk, SAMPLE_TOKENS, rng))
        return SampledRouting(wl, space, idx, f"popularity {Path(path).name}")
    raise _bad(f"{path}: expected int [N, {wl.topk}] top-k indices or float [{wl.experts}] expert popularity, "
               f"got {arr.dtype} {list(arr.shape)}")


def _bad(msg: str) -> CompileError:
    return CompileError([Diagnostic("error", msg, None)])
