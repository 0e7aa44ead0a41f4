"""Pipelined dependencies in the simulator (sim/__init__.py, "Pipelined dependencies").

A gate g = (producer step, landing rank x).  A consumer flow that reads rank x's buffer (its src)
is capped by the fraction of the bytes the producer lands on x, less one of the consumer's chunks
(and the producer's completion lag); a producer that lands nothing on x does not hold the flow
back; with several pipelined producers the smallest cap holds.
"""

from __future__ import annotations

import numpy as np

from ..plan import PlanStep
from .base import INF, REL


class Gates:
    """The gates of one program's flows (indexed as the engine indexes them)."""

    def __init__(self, steps: list[PlanStep], pdeps: list[list[int]], f_step: np.ndarray, f_bytes: np.ndarray,
                 f_src: np.ndarray, f_dst: np.ndarray):
        nf = self.nf = f_bytes.size
        gate_of: dict[tuple[int, int], int] = {}
        members_f: list[int] = []
        members_g: list[int] = []
        pair_f: list[int] = []
        pair_g: list[int] = []
        pair_inv_n: list[float] = []
        by_step_dst: dict[tuple[int, int], list[int]] = {}
        for i in range(nf):
            if f_bytes[i] > 0:
                by_step_dst.setdefault((int(f_step[i]), int(f_dst[i])), []).append(i)
        for i in range(nf):
            si = int(f_step[i])
            if f_bytes[i] <= 0 or not pdeps[si]:
                continue
            n = steps[si].whole_chunks
            for p in pdeps[si]:
                key = (p, int(f_src[i]))
                producers = by_step_dst.get(key)
                if not producers:
                    continue
                g = gate_of.get(key)
                if g is None:
                    g = gate_of[key] = len(gate_of)
                    members_f.extend(producers)
                    members_g.extend([g] * len(producers))
                pair_f.append(i)
                pair_g.append(g)
                pair_inv_n.append(min(1.0, 1.0 / n + float(steps[p].completion_lag)))
        self.ng = len(gate_of)
        self.gm_f = np.array(members_f, dtype=np.int64)
        self.gm_g = np.array(members_g, dtype=np.int64)
        self.g_bytes = np.bincount(self.gm_g, weights=f_bytes[self.gm_f], minlength=self.ng) \
            if self.ng else np.zeros(0)
        self.gp_f = np.array(pair_f, dtype=np.int64)
        self.gp_g = np.array(pair_g, dtype=np.int64)
        self.gp_inv = np.array(pair_inv_n, dtype=float)
        self.gated = np.zeros(nf, dtype=bool)
        self.gated[self.gp_f] = True

    def state(self, moved: np.ndarray, rate: np.ndarray, f_state: np.ndarray | None = None):
        """Per gate: the producer's moved fraction F on the landing rank, dF/dt, and whether all
        its flows there are done (last byte moved and latency paid: the last chunk has landed;
        `f_state` 3 for a done flow, None: judged by the bytes alone)."""
        if self.ng == 0:
            return None
        gm = np.bincount(self.gm_g, weights=moved[self.gm_f], minlength=self.ng)
        gr = np.bincount(self.gm_g, weights=rate[self.gm_f], minlength=self.ng)
        F = np.minimum(gm / self.g_bytes, 1.0)
        dF = gr / self.g_bytes
        if f_state is not None:
            open_ = np.bincount(self.gm_g, weights=(f_state[self.gm_f] != 3).astype(float), minlength=self.ng)
            full = open_ == 0
        else:
            full = F >= 1.0 - REL
        F = np.where(full, 1.0, np.minimum(F, 1.0 - REL / 2))  # 1 only once landed
        return F, dF

    def caps(self, F: np.ndarray, dF: np.ndarray):
        """Per gated flow: cap on its moved fraction and the cap's rate of change."""
        Fp = F[self.gp_g]
        dFp = dF[self.gp_g]
        full = Fp >= 1.0
        cap_p = np.where(full, 1.0, np.maximum(0.0, Fp - self.gp_inv))
        rising = (~full) & (Fp >= self.gp_inv - REL)
        dcap_p = np.where(rising, dFp, 0.0)
        cap = np.ones(self.nf)
        np.minimum.at(cap, self.gp_f, cap_p)
        tight = cap_p <= cap[self.gp_f] + REL
        dcap = np.full(self.nf, INF)
        np.minimum.at(dcap, self.gp_f[tight], dcap_p[tight])
        dcap[~self.gated] = 0.0
        return cap, dcap, cap_p, dcap_p, Fp, dFp
