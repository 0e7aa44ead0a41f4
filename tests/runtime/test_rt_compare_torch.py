"""compare_torch.compare_combine (the GPU checks' comparison, on tensors) against the oracle's NumPy
one: the same CombineCheck, field for field, on arbitrary float32 values (NaN, infinities, signed
zeros, values a few bits apart, bf16 rounding ties), in any chunking."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from epcc.runtime.testing import compare_torch, oracle

F32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
BF16_ULPS = st.tuples(st.integers(-8, 8), st.integers(-2, 2)).map(lambda kd: kd[0] * 32768 + kd[1])
TIES = st.sampled_from([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 2 ** -126 * (1 + 2 ** -8), 0.0, -0.0])


def same_value(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def assert_same_check(a: oracle.CombineCheck, b: oracle.CombineCheck) -> None:
    assert (a.ok, a.max_ulp, a.max_rel, a.first_bad, a.beyond_ulp) == (b.ok, b.max_ulp, b.max_rel, b.first_bad,
                                                                       b.beyond_ulp)
    assert same_value(a.got, b.got) and same_value(a.want, b.want)


@st.composite
def combine_results(draw):
    shape = draw(st.tuples(st.integers(1, 3), st.integers(0, 6), st.integers(1, 9)))
    want = draw(hnp.arrays(np.float32, shape, elements=F32 | TIES))
    # got: want moved by a few bits or whole and half bf16 ulps (the criteria's edges), or any value
    delta = draw(hnp.arrays(np.int64, shape, elements=st.integers(-70000, 70000) | BF16_ULPS))
    near = (want.view(np.uint32).astype(np.int64) + delta).astype(np.uint32).view(np.float32)
    other = draw(hnp.arrays(np.float32, shape, elements=F32))
    pick = draw(hnp.arrays(np.bool_, shape))
    got = np.where(pick, near, other).astype(np.float32)
    mag = np.abs(draw(hnp.arrays(np.float32, shape, elements=F32 | st.just(0.0))))
    return got, want, mag


@settings(max_examples=300, deadline=None)
@given(combine_results(), st.integers(0, 16), st.sampled_from([0.0, 2.0 ** -8]), st.sampled_from([1, 2, 5, 1024]))
def test_torch_comparison_is_the_oracles(arrays, topk, rounding, chunk):
    got, want, mag = arrays
    with np.errstate(invalid="ignore", over="ignore"):
        a = oracle.compare_combine(got, want, mag, topk, partial_rounding=rounding)
    b = compare_torch.compare_combine(torch.from_numpy(got), torch.from_numpy(want), torch.from_numpy(mag), topk,
                                      partial_rounding=rounding, chunk_rows=chunk)
    assert_same_check(a, b)


@pytest.mark.parametrize("got, want, mag, rounding", [
    (1.015625, 1.0, 0.0, 0.0),  # 2 bf16 ulp, 1.6 % off: the ulp criterion alone
    (3.9179106, 3.8812172, 0.0, 0.0),  # 3 bf16 ulp, 0.95 % off: the relative one alone
    (1.05, 1.0, 13.0, 2.0 ** -8),  # 5 % off under cancellation: the bound with bf16 partials alone
])
def test_each_criterion_alone_accepts_in_both(got, want, mag, rounding):
    arrays = [np.array([[[v]]], np.float32) for v in (got, want, mag)]
    a = oracle.compare_combine(*arrays, 8, partial_rounding=rounding)
    b = compare_torch.compare_combine(*(torch.from_numpy(v) for v in arrays), 8, partial_rounding=rounding)
    assert a.ok
    assert_same_check(a, b)
    if rounding:  # without the partials' rounding that value is beyond every criterion
        assert not compare_torch.compare_combine(*(torch.from_numpy(v) for v in arrays), 8).ok


def test_a_wrong_value_past_the_first_chunk_is_named_as_the_oracle_names_it():
    rng = np.random.default_rng(0)
    want = rng.standard_normal((1, 9, 16)).astype(np.float32)
    mag = np.abs(want)
    got = want.copy()
    got[0, 7, 3] *= 1.05  # a whole term off: beyond every criterion
    a = oracle.compare_combine(got, want, mag, 8)
    b = compare_torch.compare_combine(*(torch.from_numpy(v) for v in (got, want, mag)), 8, chunk_rows=2)
    assert not a.ok and a.first_bad == (0, 7, 3)
    assert_same_check(a, b)
    bf = compare_torch.compare_combine(torch.from_numpy(got).to(torch.bfloat16), torch.from_numpy(want),
                                       torch.from_numpy(mag), 8)
    assert bf.first_bad == (0, 7, 3)


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="shapes \\[2, 3\\], \\[2, 3\\], \\[3, 2\\] differ"):
        compare_torch.compare_combine(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3, 2), 8)
