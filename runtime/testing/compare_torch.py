"""oracle.compare_combine on torch tensors, where they live (a GPU's memory): the same verdict and
the same CombineCheck, field for field, without copying the fp32 results to the host.

The GPU checks (tests/gpu) compare a [4096, 7168] combine per check; copied to the host and
compared in NumPy that took 5 to 6 s on one Xeon core (2026-11-27; float64 temporaries of 29 M
values), against about 1 ms of kernels.  Every step here is the NumPy one on the same IEEE
values: the bf16 rounding and the ulp distance on the integer bits, the differences, ratios and
the bound in float64 (correctly rounded on the CPU and on CUDA alike), so no value can be
accepted here and refused there.  Rows are compared a chunk at a time to bound the float64
temporaries.  On a CPU this is no faster than NumPy: the gain is where the tensors already are.
"""

from __future__ import annotations

import torch

from .oracle import MAX_REL, MAX_ULP, CombineCheck

_U32 = 0xFFFFFFFF
CHUNK_ROWS = 1024  # rows (all but the last axis flattened) per step: ~60 MB of float64 per temporary at 7168 channels


def f32_to_bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """bf16.f32_to_bf16 on a float32 tensor: round to nearest, ties to even, NaN kept quiet; the
    bits as int64 (0..0xFFFF)."""
    u = x.contiguous().view(torch.int32).to(torch.int64) & _U32
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) & _U32) >> 16
    return torch.where(torch.isnan(x), (u >> 16) | 0x40, rounded)


def bf16_ulp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16.bf16_ulp_diff on bf16 bits held as int64; +0 and -0 are equal."""
    def ordered(i):
        return torch.where((i & 0x8000) != 0, -(i & 0x7FFF), i)
    return (ordered(a) - ordered(b)).abs()


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The index in `shape` (C order) of flat position `flat`."""
    out = []
    for n in reversed(shape):
        flat, i = divmod(flat, n)
        out.append(i)
    return tuple(reversed(out))


def compare_combine(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor, topk: int,
                    partial_rounding: float = 0.0, chunk_rows: int = CHUNK_ROWS) -> CombineCheck:
    """oracle.compare_combine (see there) of tensors of one shape on one device; `got` is taken as
    float32, `want` and `mag` keep their dtype for the float64 differences as NumPy's does."""
    if not (got.shape == want.shape == mag.shape):
        raise ValueError(f"got, want, mag: shapes {list(got.shape)}, {list(want.shape)}, {list(mag.shape)} differ")
    shape = tuple(got.shape)
    if not shape:
        raise ValueError("got, want, mag: expected at least one axis, got scalars")
    width = shape[-1]
    got = got.float()
    g_all = got.reshape(-1, width)
    w_all, m_all = want.reshape(-1, width), mag.reshape(-1, width)
    coef = 2.0 * max(topk, 1) * 2.0 ** -24 + partial_rounding
    max_ulp, max_rel, beyond, first = 0, 0.0, 0, None
    for lo in range(0, g_all.shape[0], max(1, chunk_rows)):
        g, w, m = g_all[lo:lo + chunk_rows], w_all[lo:lo + chunk_rows], m_all[lo:lo + chunk_rows]
        ulp = bf16_ulp_diff(f32_to_bf16_bits(g), f32_to_bf16_bits(w.float()))
        g64, w64 = g.double(), w.double()
        diff = (g64 - w64).abs()
        scale = w64.abs()
        inf = torch.full_like(diff, float("inf"))
        rel = torch.where(scale > 0, diff / scale, torch.where(diff > 0, inf, torch.zeros_like(diff)))
        ok = (ulp <= MAX_ULP) | (rel <= MAX_REL) | (diff <= coef * m.double())
        ok &= torch.isfinite(g) | ~torch.isfinite(w)
        if ulp.numel():
            max_ulp = max(max_ulp, int(ulp.max()))
            max_rel = max(max_rel, float(torch.where(torch.isfinite(rel), rel, torch.zeros_like(rel)).max()))
            beyond += int((ulp > MAX_ULP).sum())
        if first is None and not bool(ok.all()):
            r, c = (int(v) for v in torch.nonzero(~ok)[0])
            first = _unravel((lo + r) * width + c, shape)
    return CombineCheck(ok=first is None, max_ulp=max_ulp, max_rel=max_rel, first_bad=first,
                        got=float(got[first]) if first else 0.0, want=float(want[first]) if first else 0.0,
                        beyond_ulp=beyond)
