"""The oracle on hand-computed cases, the bf16 helpers, input validation and the generators."""

from __future__ import annotations

import numpy as np
import pytest

from epcc.runtime.bf16 import bf16_to_f32, bf16_ulp_diff, f32_to_bf16
from epcc.runtime.testing import inputs, oracle

# 2 ranks, 2 tokens each, top-2 of 4 experts.  Rank 1's second token has an empty slot.
TOPK = np.array([[[0, 3], [1, 2]],
                 [[2, 0], [3, -1]]])
W = np.array([[[0.25, 0.75], [0.5, 0.5]],
              [[0.125, 0.875], [1.0, 0.0]]], dtype=np.float32)


def rows(R, T, nb=4):
    """Row (h, t) = bytes [h, t, h, t]: easy to read back."""
    x = np.zeros((R, T, nb), np.uint8)
    for h in range(R):
        for t in range(T):
            x[h, t] = [h, t, h, t]
    return x


def test_dispatch_blocked_by_hand():
    got = oracle.dispatch_oracle(TOPK, 4, "blocked", rows(2, 2), W)
    # rank 0 holds experts 0 (local 0) and 1 (local 1); rank 1 holds 2 and 3.
    assert got[0].src.tolist() == [[0, 0, 0], [1, 0, 0], [0, 1, 1]]
    assert got[0].counts.tolist() == [2, 1]
    assert got[0].weights.tolist() == [0.25, 0.875, 0.5]
    assert got[0].rows[:, :2].tolist() == [[0, 0], [1, 0], [0, 1]]
    assert got[1].src.tolist() == [[0, 1, 2], [1, 0, 2], [0, 0, 3], [1, 1, 3]]
    assert got[1].counts.tolist() == [2, 2]
    assert got[1].weights.tolist() == [0.5, 0.125, 0.75, 1.0]
    assert got[1].rows.dtype == np.uint8 and got[1].rows.shape == (4, 4)


def test_dispatch_strided_by_hand():
    got = oracle.dispatch_oracle(TOPK, 4, "strided", rows(2, 2), W)
    # strided: expert e on rank e % 2, local index e // 2: rank 0 holds 0 (local 0) and 2 (local 1).
    assert got[0].src.tolist() == [[0, 0, 0], [1, 0, 0], [0, 1, 2], [1, 0, 2]]
    assert got[0].counts.tolist() == [2, 2]
    assert got[1].src.tolist() == [[0, 1, 1], [0, 0, 3], [1, 1, 3]]
    assert got[1].counts.tolist() == [1, 2]


def test_combine_by_hand():
    disp = oracle.dispatch_oracle(TOPK, 4, "blocked", rows(2, 2), W)
    # expert output of row (h, t, e) = [100 h + 10 t + e, -1]
    y = [np.array([[100 * h + 10 * t + e, -1.0] for h, t, e in d.src], np.float32) for d in disp]
    out = oracle.combine_oracle(TOPK, 4, "blocked", W, y)
    assert out.shape == (2, 2, 2) and out.dtype == np.float32
    assert out[0, 0].tolist() == [0.25 * 0 + 0.75 * 3, -1.0]
    assert out[0, 1].tolist() == [0.5 * 11 + 0.5 * 12, -1.0]
    assert out[1, 0].tolist() == [0.125 * 102 + 0.875 * 100, -1.0]
    assert out[1, 1].tolist() == [1.0 * 113, -1.0]  # the empty slot contributes nothing
    # bf16 expert outputs give the same (the values are exact in bf16)
    yb = [f32_to_bf16(v) for v in y]
    assert np.array_equal(oracle.combine_oracle(TOPK, 4, "blocked", W, yb), out)


def test_bf16_round_to_nearest_even():
    one = np.float32(1.0)
    vals = np.array([1.0, -2.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, 0.0, -0.0,
                     np.inf, -np.inf, np.finfo(np.float32).max], dtype=np.float32)
    b = f32_to_bf16(vals)
    assert b.dtype == np.uint16
    assert [hex(v) for v in b[:7]] == ["0x3f80", "0xc000", "0x3f80", "0x3f82", "0x3f81", "0x0", "0x8000"]
    assert b[7] == 0x7F80 and b[8] == 0xFF80 and b[9] == 0x7F80  # the largest float32 rounds to inf
    assert np.isnan(bf16_to_f32(f32_to_bf16(np.array([np.nan], np.float32))))[0]
    assert bf16_to_f32(np.array([0x3F80], np.uint16))[0] == one
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    back = bf16_to_f32(f32_to_bf16(x))
    assert (np.abs(back - x) <= np.abs(x) * 2 ** -8).all()
    assert np.array_equal(f32_to_bf16(back), f32_to_bf16(x))  # exact round trip of bf16 values


def test_bf16_ulp_diff():
    a = np.array([0x0000, 0x3F80, 0x0001, 0x3F80], np.uint16)
    b = np.array([0x8000, 0x3F81, 0x8001, 0x3F7F], np.uint16)
    assert bf16_ulp_diff(a, b).tolist() == [0, 1, 2, 1]


@pytest.mark.parametrize("bad, what", [
    (np.zeros((2, 2, 2), np.float32), "dtype"),
    (np.zeros((4, 2), np.int64), "shape"),
    (np.array([[[0, 4], [1, 2]], [[2, 0], [3, -1]]]), "-1..3"),
    (np.array([[[0, -2], [1, 2]], [[2, 0], [3, -1]]]), "-1..3"),
    (np.array([[[0, 0], [1, 2]], [[2, 0], [3, -1]]]), "twice"),
])
def test_topk_validation(bad, what):
    with pytest.raises(ValueError, match="topk_idx") as e:
        oracle.dispatch_oracle(bad, 4, "blocked", rows(2, 2), None)
    assert what in str(e.value)


def test_weights_and_rows_validation():
    with pytest.raises(ValueError, match="weights"):
        oracle.dispatch_oracle(TOPK, 4, "blocked", rows(2, 2), W[:, :1])
    with pytest.raises(ValueError, match="x_rows"):
        oracle.dispatch_oracle(TOPK, 4, "blocked", rows(2, 3), W)
    with pytest.raises(ValueError, match="experts"):
        oracle.dispatch_oracle(TOPK, 5, "blocked", rows(2, 2), W)
    with pytest.raises(ValueError, match="placement"):
        oracle.dispatch_oracle(TOPK, 4, "round-robin", rows(2, 2), W)


def test_compare_combine_catches_a_dropped_contribution():
    disp = oracle.dispatch_oracle(TOPK, 4, "blocked", rows(2, 2), W)
    rng = np.random.default_rng(1)
    y = [f32_to_bf16(rng.standard_normal((d.rows.shape[0], 8)).astype(np.float32)) for d in disp]
    want, mag = oracle.combine_oracle(TOPK, 4, "blocked", W, y, return_abs=True)
    assert oracle.compare_combine(want, want, mag, 2).ok
    # the same sum in another order passes
    assert oracle.compare_combine(want + np.float32(1e-7) * mag, want, mag, 2).ok
    bad = want.copy()
    bad[1, 0] -= 0.875 * bf16_to_f32(y[0][1])  # drop rank 0's expert-0 row of token (1, 0)
    chk = oracle.compare_combine(bad, want, mag, 2)
    assert not chk.ok and chk.first_bad[:2] == (1, 0)


# --------------------------------------------------------------------------- generators


@pytest.mark.parametrize("placement", ["blocked", "strided"])
def test_routings_have_their_shape(placement):
    R, T, k, E = 4, 200, 3, 16
    rank_of, _ = oracle.expert_rank(E, R, placement)
    for spec in ("uniform", "zipf:1.2", "one-hot", "empty", "no-remote"):
        ro = inputs.make_topk(spec, R, T, k, E, placement, seed=3)
        idx = ro.topk_idx
        assert idx.shape == (R, T, k) and idx.dtype == np.int64
        oracle.check_topk(idx, E)  # distinct, in range
        again = inputs.make_topk(spec, R, T, k, E, placement, seed=3).topk_idx
        assert np.array_equal(idx, again)  # deterministic
        ranks = rank_of[idx]
        if spec == "one-hot":
            assert (ranks == ranks[..., :1]).all()
        if spec == "empty":
            assert (ranks < R // 2).all()
        if spec == "no-remote":
            assert (ranks == np.arange(R)[:, None, None]).all()
        assert not ro.notes
    assert not np.array_equal(inputs.make_topk("uniform", R, T, k, E, placement, 1).topk_idx,
                              inputs.make_topk("uniform", R, T, k, E, placement, 2).topk_idx)


def test_routings_that_cannot_be_pure_say_so():
    R, T, E = 4, 50, 8  # 2 experts per rank
    ro = inputs.make_topk("one-hot", R, T, 3, E, "blocked")
    assert "span 2 consecutive ranks" in ro.describe()
    d = (ro.topk_idx // 2 - ro.topk_idx[..., :1] // 2) % R  # two consecutive ranks, either way round
    assert ((d <= 1).all(-1) | ((d == 0) | (d == R - 1)).all(-1)).all()
    ro = inputs.make_topk("no-remote", R, T, 3, E, "blocked")
    assert "1 of each token's experts are remote" in ro.describe()
    assert ((ro.topk_idx // 2 == np.arange(R)[:, None, None]).sum(-1) == 2).all()
    ro = inputs.make_topk("empty", 2, T, 3, 4, "blocked")
    assert "every rank receives" in ro.describe()


def test_zipf_is_skewed():
    idx = inputs.make_topk("zipf:1.5", 4, 2000, 2, 32, "blocked").topk_idx
    counts = np.bincount(idx.reshape(-1), minlength=32)
    assert counts.max() > 5 * np.median(counts)


def test_bad_routing_specs():
    for spec in ("nope", "zipf:x", "zipf:-1", "zipf:inf"):
        with pytest.raises(ValueError, match="routing"):
            inputs.check_spec(spec)


def test_routing_files(tmp_path):
    idx = inputs.make_topk("uniform", 2, 5, 2, 8, "blocked").topk_idx
    idx[0, 1, 1] = -1
    for shape in ((2, 5, 2), (10, 2)):
        p = tmp_path / f"r{len(shape)}.npy"
        np.save(p, idx.reshape(shape))
        assert np.array_equal(inputs.make_topk(str(p), 2, 5, 2, 8, "blocked").topk_idx, idx)
    p = tmp_path / "r.npy"
    np.save(p, idx)
    with pytest.raises(ValueError, match="--tokens 5"):
        inputs.make_topk(str(p), 2, 6, 2, 8, "blocked")
    with pytest.raises(ValueError, match="topk is 3"):
        inputs.make_topk(str(p), 2, 5, 3, 8, "blocked")
    np.save(p, idx + 8)
    with pytest.raises(ValueError, match="must lie in"):
        inputs.make_topk(str(p), 2, 5, 2, 8, "blocked")
    np.save(p, idx.astype(np.float32))
    with pytest.raises(ValueError, match="integer"):
        inputs.make_topk(str(p), 2, 5, 2, 8, "blocked")
    with pytest.raises(ValueError, match="no such file"):
        inputs.make_topk(str(tmp_path / "missing.npy"), 2, 5, 2, 8, "blocked")


def test_weights_and_payloads():
    idx = inputs.make_topk("uniform", 2, 10, 3, 8, "blocked").topk_idx
    idx[1, 2, 0] = -1
    w = inputs.make_weights(idx, 0)
    assert w.dtype == np.float32 and (w[idx >= 0] > 0).all() and w[1, 2, 0] == 0
    assert np.allclose(w.sum(-1), 1.0)
    x = inputs.make_x_rows(2, 10, 256, "bf16", 0)
    assert x.shape == (2, 10, 512) and x.dtype == np.uint8
    assert np.isfinite(bf16_to_f32(x.view(np.uint16))).all()
    x8 = inputs.make_x_rows(2, 10, 256, "fp8", 0)
    assert x8.shape == (2, 10, 256 + 2 * 4)
    q = x8[..., :256]
    assert not ((q & 0x7F) == 0x7F).any()  # no e4m3 NaN encodings
    scales = np.ascontiguousarray(x8[..., 256:]).view("<f4")
    assert scales.shape == (2, 10, 2) and (scales > 0).all() and np.isfinite(scales).all()
    with pytest.raises(ValueError, match="multiple of 128"):
        inputs.make_x_rows(1, 1, 100, "fp8")
    ys = inputs.make_expert_outputs([3, 0], 8, 0)
    assert ys[0].shape == (3, 8) and ys[0].dtype == np.uint16 and ys[1].shape == (0, 8)


def test_compare_combine_partial_rounding_covers_bf16_partials_only():
    """Partials rounded to bf16 on the way (the direct CUDA combine) pass with partial_rounding
    2^-8 under cancellation, where the plain criteria reject them; a dropped term still fails."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((1, 64, 32)).astype(np.float32)
    b = (-a * np.float32(1.0 - 2.0 ** -12)).astype(np.float32)  # a + b cancels to ~a * 2^-12
    want = a.astype(np.float64) + b.astype(np.float64)
    mag = (np.abs(a) + np.abs(b)).astype(np.float32)
    got = bf16_to_f32(f32_to_bf16(a)) + bf16_to_f32(f32_to_bf16(b))  # each partial rounded to bf16
    want32 = want.astype(np.float32)
    assert not oracle.compare_combine(got, want32, mag, 2).ok
    assert oracle.compare_combine(got, want32, mag, 2, partial_rounding=2.0 ** -8).ok
    dropped = bf16_to_f32(f32_to_bf16(a))  # b missing
    assert not oracle.compare_combine(dropped, want32, mag, 2, partial_rounding=2.0 ** -8).ok
