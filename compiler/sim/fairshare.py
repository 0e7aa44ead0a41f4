"""Max-min fair rates by progressive filling over weighted flow/resource incidences.

A flow moving at rate x takes weight x x of each resource it crosses; every unfrozen flow's rate
rises together until a resource fills up (its flows freeze at that rate) or a flow reaches its own
bound.  The result is the max-min fair allocation over all resources at once.
"""

from __future__ import annotations

import math

import numpy as np

from .base import INF, REL, SimulationError


def max_min_rates(cand: np.ndarray, bounds: np.ndarray, cap: np.ndarray, inc_f: np.ndarray, inc_r: np.ndarray,
                  inc_w: np.ndarray, prio: np.ndarray | None = None) -> np.ndarray:
    """Rates of the flows in `cand` (bool [flows]), each at most its bound, over resources of
    capacity `cap` crossed as (inc_f, inc_r, inc_w): flow, resource, bytes per byte moved.  With
    `prio` (int [flows]), strict priority levels, lowest first, share what the lower levels left."""
    nf, nr = cand.size, cap.size
    """Max-min fair rates (progressive filling) for the flows in `cand`, each at most its
    bound; with `priorities`, strict priority levels share what the lower levels left."""
    rate = np.zeros(nf)
    rem = cap.copy()
    levels = [None]
    if prio is not None:
        levels = sorted(set(prio[cand].tolist()))
    for lv in levels:
        unf = cand.copy() if lv is None else cand & (prio == lv)
        zero = unf & (bounds <= 0)
        unf &= ~zero
        level = 0.0  # the common rate of the unfrozen flows
        while unf.any():
            m = unf[inc_f]
            # what one more byte/s for every unfrozen flow takes of each resource
            n_r = np.bincount(inc_r[m], weights=inc_w[m], minlength=nr)
            used = n_r > 0
            # Each unfrozen flow has rate `level` so far: room left per resource.
            share = np.full(nr, INF)
            share[used] = level + np.maximum(rem[used] - 0.0, 0.0) / n_r[used]
            lam_r = share.min() if nr else INF
            b = bounds[unf]
            lam_b = b.min() if b.size else INF
            lam = min(lam_r, lam_b)
            if not math.isfinite(lam):
                raise SimulationError("a flow has no resource to bound its rate")
            # Raise everyone to lam.
            rem -= (lam - level) * n_r
            level = lam
            sat = np.zeros(nr, dtype=bool)
            sat[used] = rem[used] <= REL * cap[used]
            frz = unf & (bounds <= lam * (1 + REL))
            if sat.any():
                on_sat = np.zeros(nf, dtype=bool)
                on_sat[inc_f[sat[inc_r] & m]] = True
                frz |= on_sat & unf
            if not frz.any():  # numerical safety: freeze the tightest resource's flows
                j = int(np.argmin(np.where(used, rem, INF)))
                on = np.zeros(nf, dtype=bool)
                on[inc_f[(inc_r == j) & m]] = True
                frz = on & unf
            rate[frz] = lam
            unf &= ~frz
        rem = np.maximum(rem, 0.0)
    return rate
