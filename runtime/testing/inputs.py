"""Deterministic inputs for running a plan: routings, routing weights, payload rows, expert outputs.

Everything comes from seeded NumPy Generators, one stream per purpose (routing, weights,
payload, expert outputs), so changing the hidden size does not change the routing.

Routings (`make_topk`), top-k expert indices [R, T, k]:

* `uniform`: k distinct experts per token, uniformly;
* `zipf:S`: expert popularity ~ 1 / rank^S over a seeded permutation of the experts (hot experts
  spread over the ranks), k distinct experts per token drawn by successive sampling;
* `one-hot`: all of a token's experts on one rank (a random rank per token); when k > E/R the
  token takes as few consecutive ranks as hold k experts (a note says so);
* `empty`: every token routes only to experts of the first half of the ranks (at least enough
  ranks to hold k experts), so the other ranks receive nothing;
* `no-remote`: every token's experts on its own home rank (when k > E/R, all of the home's
  experts plus the rest uniformly elsewhere; a note says so);
* `FILE.npy`: integer top-k indices [R, T, k] or [R*T, k] (-1: an empty slot), read by
  epcc/analysis/topk_file.py as the compiler reads measured routings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...analysis import topk_file
from ...limits import zipf_exponent
from ..bf16 import f32_to_bf16
from ..routing import expert_rank

NAMED = ("uniform", "one-hot", "empty", "no-remote")
FP8_GROUP = 128  # channels per fp32 scale
_STREAM = {"routing": 1, "weights": 2, "payload": 3, "outputs": 4}
_BATCH = 4096  # tokens per batch when drawing [tokens, E] keys


def rng_for(seed: int, purpose: str) -> np.random.Generator:
    return np.random.default_rng([int(seed), _STREAM[purpose]])


@dataclass
class TopkRouting:
    """Every rank's top-k indices drawn for a routing spec (make_topk)."""

    spec: str
    topk_idx: np.ndarray  # int64 [R, T, k]
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return self.spec + "".join(f" ({n})" for n in self.notes)


def check_spec(spec: str) -> None:
    """Reject a malformed routing name before anything is compiled (ValueError)."""
    if spec in NAMED or spec.endswith(".npy"):
        return
    if spec.startswith("zipf:"):
        _zipf_exponent(spec)
        return
    raise ValueError(f"routing '{spec}': expected uniform, zipf:S, one-hot, empty, no-remote or FILE.npy")


def _zipf_exponent(spec: str) -> float:
    try:
        return zipf_exponent(spec)  # the compiler's check: every command accepts the same exponents
    except ValueError as e:
        raise ValueError(f"routing '{spec}': {e}") from None


def _expert_of(rank: np.ndarray, local: np.ndarray, num_ranks: int, epr: int, placement: str) -> np.ndarray:
    return rank * epr + local if placement == "blocked" else local * num_ranks + rank


def _topk_by_keys(keys: np.ndarray, k: int) -> np.ndarray:
    """Column indices of the k largest keys per row (distinct)."""
    if k >= keys.shape[1]:
        return np.argsort(-keys, axis=1)[:, :k]
    return np.argpartition(-keys, k - 1, axis=1)[:, :k]


def _sample(n: int, k: int, log_w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """n draws of k distinct columns, successive sampling proportional to exp(log_w) (Gumbel top-k)."""
    out = np.empty((n, k), dtype=np.int64)
    for lo in range(0, n, _BATCH):
        hi = min(n, lo + _BATCH)
        keys = log_w[None, :] + rng.gumbel(size=(hi - lo, log_w.size))
        out[lo:hi] = _topk_by_keys(keys, k)
    return out


def _uniform_choice(n: int, m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """n draws of k distinct indices in 0..m-1, uniformly."""
    out = np.empty((n, k), dtype=np.int64)
    for lo in range(0, n, _BATCH):
        hi = min(n, lo + _BATCH)
        out[lo:hi] = _topk_by_keys(rng.random((hi - lo, m)), k)
    return out


def make_topk(spec: str, num_ranks: int, tokens: int, topk: int, experts: int, placement: str,
              seed: int = 0) -> TopkRouting:
    """Top-k indices [R, T, k] for a routing spec (see the module docstring); ValueError on a bad
    spec or file."""
    check_spec(spec)
    R, T, k, E = num_ranks, tokens, topk, experts
    rank_of, _ = expert_rank(E, R, placement)
    epr = E // R
    if not 1 <= k <= E:
        raise ValueError(f"topk: {k} experts per token out of {E}")
    rng = rng_for(seed, "routing")
    n = R * T
    notes: list[str] = []
    if spec.endswith(".npy"):
        return TopkRouting(spec, load_topk(spec, R, T, k, E))
    if spec == "uniform":
        idx = _uniform_choice(n, E, k, rng)
    elif spec.startswith("zipf:"):
        s = _zipf_exponent(spec)
        perm = rng.permutation(E)  # expert perm[i] has popularity rank i + 1
        log_w = np.empty(E)
        log_w[perm] = -s * np.log(np.arange(1, E + 1, dtype=float))
        idx = _sample(n, k, log_w, rng)
    elif spec == "one-hot":
        m = -(-k // epr)
        if m > 1:
            notes.append(f"topk {k} > {epr} experts per rank: each token's experts span {m} consecutive ranks")
        r0 = rng.integers(0, R, size=n)
        p = _uniform_choice(n, m * epr, k, rng)
        rank = (r0[:, None] + p // epr) % R
        idx = _expert_of(rank, p % epr, R, epr, placement)
    elif spec == "empty":
        half = max(1, R // 2)
        need = -(-k // epr)
        if need > half:
            notes.append(f"topk {k} needs {need} ranks' experts: tokens route to ranks 0..{need - 1}")
            half = need
        if half >= R:
            notes.append("every rank receives tokens (too few ranks to leave some empty)")
        p = _uniform_choice(n, half * epr, k, rng)
        idx = _expert_of(p // epr, p % epr, R, epr, placement)
    else:  # no-remote
        home = np.repeat(np.arange(R), T)
        if k <= epr:
            p = _uniform_choice(n, epr, k, rng)
            idx = _expert_of(home[:, None], p, R, epr, placement)
        else:
            notes.append(f"topk {k} > {epr} experts per rank: {k - epr} of each token's experts are remote")
            own = _expert_of(home[:, None], np.arange(epr)[None, :], R, epr, placement)
            q = _uniform_choice(n, E - epr, k - epr, rng)  # among the other ranks' experts
            other_rank = (home[:, None] + 1 + q // epr) % R
            far = _expert_of(other_rank, q % epr, R, epr, placement)
            idx = np.concatenate([own, far], axis=1)
    idx = idx.astype(np.int64).reshape(R, T, k)
    # a random order of the slots within each token (the router's order carries no meaning)
    if k > 1:
        o = np.argsort(rng.random((R, T, k)), axis=2)
        idx = np.take_along_axis(idx, o, axis=2)
    return TopkRouting(spec, idx, notes)


def load_topk(path: str, num_ranks: int, tokens: int, topk: int, experts: int) -> np.ndarray:
    """Top-k indices [R, T, k] from a .npy file of [R, T, k] or [R*T, k] (-1: an empty slot)."""
    # a regular file holding exactly [R, T, k] int64 at most (and its header): nothing larger is read
    arr = topk_file.read(path, num_ranks * tokens * topk * 8 + (1 << 16))
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{path}: expected integer top-k expert indices, got {arr.dtype}")
    if arr.ndim == 3:
        if arr.shape[0] != num_ranks:
            raise ValueError(f"{path}: top-k indices for {arr.shape[0]} ranks; the plan has {num_ranks}")
        arr = arr.reshape(-1, arr.shape[2])
    elif arr.ndim != 2:
        raise ValueError(f"{path}: expected top-k indices [R, T, k] or [R*T, k], got shape {list(arr.shape)}")
    elif arr.shape[0] % num_ranks:
        raise ValueError(f"{path}: {arr.shape[0]} rows of top-k indices cannot be split among {num_ranks} ranks")
    rows = topk_file.topk_rows(arr, path, topk, experts, empty_slots=True)
    per_rank = rows.shape[0] // num_ranks
    if per_rank != tokens:
        raise ValueError(f"{path}: {per_rank} tokens per rank; run with --tokens {per_rank}")
    return rows.reshape(num_ranks, per_rank, topk)


def make_weights(topk_idx: np.ndarray, seed: int = 0) -> np.ndarray:
    """Positive routing weights [R, T, k] float32, a softmax over each token's non-empty slots
    (empty slots: 0)."""
    rng = rng_for(seed, "weights")
    logits = rng.standard_normal(topk_idx.shape)
    logits = np.where(topk_idx >= 0, logits, -np.inf)
    mx = np.max(logits, axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    ex = np.exp(logits - mx)
    s = ex.sum(axis=-1, keepdims=True)
    return np.where(s > 0, ex / np.where(s > 0, s, 1.0), 0.0).astype(np.float32)


def row_bytes(hidden: int, dtype: str) -> int:
    if dtype == "bf16":
        return 2 * hidden
    if dtype == "fp8":
        if hidden % FP8_GROUP:
            raise ValueError(f"hidden: fp8 needs a multiple of {FP8_GROUP} channels, not {hidden}")
        return hidden + hidden // FP8_GROUP * 4
    raise ValueError(f"dtype: expected bf16 or fp8, got {dtype!r}")


def make_x_rows(num_ranks: int, tokens: int, hidden: int, dtype: str, seed: int = 0) -> np.ndarray:
    """Payload rows uint8 [R, T, row_bytes]: bf16: finite random values (little-endian bits);
    fp8: random e4m3 bytes (never a NaN encoding, 0x7f / 0xff), then one fp32 scale per 128
    channels."""
    rng = rng_for(seed, "payload")
    nb = row_bytes(hidden, dtype)
    if dtype == "bf16":
        v = f32_to_bf16(rng.standard_normal((num_ranks, tokens, hidden), dtype=np.float32))
        return np.ascontiguousarray(v).view(np.uint8).reshape(num_ranks, tokens, nb)
    q = rng.integers(0, 254, size=(num_ranks, tokens, hidden), dtype=np.uint8)
    q = np.where(q >= 0x7F, q + 1, q).astype(np.uint8)  # skip 0x7f; 0xfe + 1 never happens
    scales = rng.uniform(0.5, 2.0, size=(num_ranks, tokens, hidden // FP8_GROUP)).astype(np.float32) / 448.0
    sb = np.ascontiguousarray(scales.astype("<f4")).view(np.uint8).reshape(num_ranks, tokens, hidden // FP8_GROUP * 4)
    return np.concatenate([q, sb], axis=2)


def make_expert_outputs(rows_per_rank, hidden: int, seed: int = 0) -> list[np.ndarray]:
    """Expert outputs, bf16 bits uint16 [n_d, hidden] per rank (finite random values)."""
    rng = rng_for(seed, "outputs")
    return [f32_to_bf16(rng.standard_normal((int(n), hidden), dtype=np.float32)) for n in rows_per_rank]
