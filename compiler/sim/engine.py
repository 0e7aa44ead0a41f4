"""The fluid discrete-event simulator over a :class:`~epcc.plan.Plan` (the model: sim/__init__.py).

One :class:`_Engine` simulates one program's steps.  State is kept in numpy arrays indexed by
flow; the flow/resource incidence is a list of (flow, resource, weight) triples: a flow moving at
rate x takes weight x x of the resource (`Flow.weights`, 1 without them), and the weighted sum on a
resource stays within its capacity.  Between two events every rate is constant, so the state
advances exactly; at every event the rates are recomputed by progressive filling (max-min
fairness: every unfrozen flow's rate rises together) over the resources.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from ..plan import DirectKernels, Flow, Plan, PlanStep

INF = float("inf")
REL = 1e-9  # relative tolerance on fractions and simultaneous events


class SimulationError(Exception):
    """The plan cannot be simulated (unknown dependency, missing resource, deadlock)."""


@dataclass
class SimOptions:
    pipelining: bool = True  # follow `pipelined_deps` chunk by chunk (False: every dep is a barrier)
    latency: bool = True  # charge latency_s x ceil(chunks / depth) per flow
    priorities: bool = False  # strict priority by PlanStep.priority on shared resources (off: max-min)
    order_hints: bool = True  # honour PlanStep.order first/last on shared resources
    # RDMA steps as the GPU proxy path runs them (credit window, chunks staged and applied by one
    # SM each: sim/sm_terms.py); False: as paced SM roles writing the peer (`--rdma emulate`).
    rdma_proxy: bool = True
    # The plan runs as the CUDA target's direct kernels (sim/direct.py: one pool of SMs per rank and
    # program, launches before the first step); None: SM roles as kernel-formation laid them out
    # (sim/sm_terms.py).  `epcc simulate` sets it from the CUDA target's lowering.
    direct: DirectKernels | None = None


@dataclass
class StepTiming:
    name: str
    program: str
    verb: str
    link: str | None
    link_kind: str | None
    deps: tuple[str, ...]
    pipelined_deps: tuple[str, ...]
    ready_s: float  # deps satisfied (pipelined producers started)
    start_s: float  # first byte moved (or ready_s, for latency-only and empty steps)
    end_s: float  # last flow done, latency included
    bytes: float  # all ranks
    max_rank_bytes: float
    num_chunks: int
    chunk_times_s: list[float] = field(default_factory=list)  # the step's bytes cross k/num_chunks
    alone_s: float = 0.0  # duration when the step runs alone (serial sum's term)
    critical: bool = False
    moves_bytes: bool = True  # False: latency only (no flow uses a resource)

    @property
    def achieved_bps(self) -> float | None:
        """The busiest rank's bytes over the step's start..end (None for latency-only steps)."""
        if not self.moves_bytes or self.duration_s <= 0 or self.max_rank_bytes <= 0:
            return None
        return self.max_rank_bytes / self.duration_s

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class ResourceStat:
    name: str
    link_class: str
    link_kind: str | None
    capacity: float  # bytes/s
    bytes: float = 0.0
    active_s: float = 0.0  # wall time with any traffic on it

    @property
    def work_s(self) -> float:
        """Busy time: the time its bytes take at full capacity."""
        return self.bytes / self.capacity if self.capacity > 0 else 0.0


# ----------------------------------------------------------------------------- the engine


class _Engine:
    def __init__(self, steps: list[PlanStep], resources: dict[str, float], opts: SimOptions,
                 known_elsewhere: set[str] = frozenset(), start_s: float = 0.0):
        self.steps = steps
        self.opts = opts
        self.start_s = float(start_s)  # the program's first steps become ready then (kernel launches)
        ns = len(steps)
        self.index = {s.name: i for i, s in enumerate(steps)}
        if len(self.index) != ns:
            raise SimulationError("two steps of one program share a name")
        # Dependencies inside this program; deps on steps of another program are already done.
        self.deps: list[list[int]] = []
        self.pdeps: list[list[int]] = []
        for s in steps:
            d, p = [], []
            for name in s.deps:
                if name in self.index:
                    (p if (opts.pipelining and name in s.pipelined_deps) else d).append(self.index[name])
                elif name not in known_elsewhere:
                    raise SimulationError(f"step '{s.program}.{s.name}' depends on unknown step '{name}'")
            self.deps.append(d)
            self.pdeps.append(p)
        self._check_acyclic()

        # Flows.  Zero-byte flows over resources move nothing and are dropped; flows without
        # resources are latency-only (a metadata exchange without a link).
        fl: list[tuple[int, Flow]] = []
        for si, s in enumerate(steps):
            for f in s.flows:
                if f.bytes > 0 or not f.resources:
                    fl.append((si, f))
        self.nf = nf = len(fl)
        self.f_step = np.array([si for si, _ in fl], dtype=np.int64)
        self.f_bytes = np.array([f.bytes if f.resources else 0.0 for _, f in fl], dtype=float)
        self.f_src = np.array([f.src for _, f in fl], dtype=np.int64)
        self.f_dst = np.array([f.dst for _, f in fl], dtype=np.int64)
        self.f_nores = np.array([not f.resources for _, f in fl], dtype=bool)
        self.f_lat = np.array([self._exposed_latency(steps[si], f) + f.tail_s for si, f in fl], dtype=float)
        self.f_lead = np.array([f.lead_s for _, f in fl], dtype=float)
        self.f_prio = np.array([steps[si].priority for si, _ in fl], dtype=np.int64)

        names = sorted({r for _, f in fl for r in f.resources})
        for r in names:
            cap = resources.get(r)
            if cap is None:
                raise SimulationError(f"resource '{r}' has no capacity in the plan")
            if not cap > 0:
                raise SimulationError(f"resource '{r}' has capacity {cap}; it must be > 0")
        self.res_names = names
        self.res_index = {r: i for i, r in enumerate(names)}
        self.cap = np.array([resources[r] for r in names], dtype=float)
        pf, pr, pw = [], [], []
        for i, (si, f) in enumerate(fl):
            for r, w in _incidence(steps[si], f):
                pf.append(i)
                pr.append(self.res_index[r])
                pw.append(w)
        self.inc_f = np.array(pf, dtype=np.int64)
        self.inc_r = np.array(pr, dtype=np.int64)
        self.inc_w = np.array(pw, dtype=float)  # a flow's bytes per byte it moves, on that resource
        self.nr = len(names)

        self._f_state = None
        self._build_gates()
        self._build_holds()

    # ------------------------------------------------------------------ set-up
    def _check_acyclic(self) -> None:
        state = [0] * len(self.steps)

        def visit(i: int, path: list[int]) -> None:
            if state[i] == 2:
                return
            if state[i] == 1:
                cyc = " -> ".join(self.steps[j].name for j in path[path.index(i):] + [i])
                raise SimulationError(f"dependency cycle: {cyc}")
            state[i] = 1
            for d in self.deps[i] + self.pdeps[i]:
                visit(d, path + [i])
            state[i] = 2

        for i in range(len(self.steps)):
            visit(i, [])

    def _exposed_latency(self, s: PlanStep, f: Flow) -> float:
        if not self.opts.latency:
            return 0.0
        if s.chunk_bytes and s.chunk_bytes > 0 and f.resources:
            n = max(1, math.ceil(f.bytes / s.chunk_bytes - 1e-9))  # whole chunks (PlanStep.whole_chunks)
        else:
            n = max(1, int(s.num_chunks or 1))
        return f.latency_s * math.ceil(n / max(1, int(s.depth or 1)))

    def _ancestors(self) -> list[set[int]]:
        anc: list[set[int] | None] = [None] * len(self.steps)

        def get(i: int) -> set[int]:
            if anc[i] is None:
                a: set[int] = set()
                for d in self.deps[i] + self.pdeps[i]:
                    a.add(d)
                    a |= get(d)
                anc[i] = a
            return anc[i]

        return [get(i) for i in range(len(self.steps))]

    def _build_gates(self) -> None:
        """Pipelined dependencies: gate g = (producer step, landing rank x).  A consumer flow that
        reads rank x's buffer (its src) is capped by the fraction of the bytes the producer lands
        on x; a producer that lands nothing on x does not hold the flow back."""
        gate_of: dict[tuple[int, int], int] = {}
        members_f: list[int] = []
        members_g: list[int] = []
        pair_f: list[int] = []
        pair_g: list[int] = []
        pair_inv_n: list[float] = []
        by_step_dst: dict[tuple[int, int], list[int]] = {}
        for i in range(self.nf):
            if self.f_bytes[i] > 0:
                by_step_dst.setdefault((int(self.f_step[i]), int(self.f_dst[i])), []).append(i)
        for i in range(self.nf):
            si = int(self.f_step[i])
            if self.f_bytes[i] <= 0 or not self.pdeps[si]:
                continue
            n = self.steps[si].whole_chunks
            for p in self.pdeps[si]:
                key = (p, int(self.f_src[i]))
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
                pair_inv_n.append(min(1.0, 1.0 / n + float(self.steps[p].completion_lag)))
        self.ng = len(gate_of)
        self.gm_f = np.array(members_f, dtype=np.int64)
        self.gm_g = np.array(members_g, dtype=np.int64)
        self.g_bytes = np.bincount(self.gm_g, weights=self.f_bytes[self.gm_f], minlength=self.ng) \
            if self.ng else np.zeros(0)
        self.gp_f = np.array(pair_f, dtype=np.int64)
        self.gp_g = np.array(pair_g, dtype=np.int64)
        self.gp_inv = np.array(pair_inv_n, dtype=float)
        self.gated = np.zeros(self.nf, dtype=bool)
        self.gated[self.gp_f] = True

    def _build_holds(self) -> None:
        """Order hints: (held flow, blocking flow) pairs.  A flow of a `last` step waits on each of
        its resources for the flows there of every other step that is neither `last` nor one of
        its descendants; a flow of any other step waits for the flows of a `first` step on a
        shared resource unless it is an ancestor or a descendant of that step."""
        hf: list[int] = []
        hb: list[int] = []
        if self.opts.order_hints and any(s.order in ("first", "last") for s in self.steps):
            anc = self._ancestors()
            res_flows: dict[int, list[int]] = {}
            for f, r in zip(self.inc_f.tolist(), self.inc_r.tolist()):
                res_flows.setdefault(r, []).append(f)
            f_res: dict[int, list[int]] = {}
            for f, r in zip(self.inc_f.tolist(), self.inc_r.tolist()):
                f_res.setdefault(f, []).append(r)
            seen: set[tuple[int, int]] = set()
            for f in range(self.nf):
                sf = int(self.f_step[f])
                of = self.steps[sf].order
                for r in f_res.get(f, ()):
                    for b in res_flows[r]:
                        sb = int(self.f_step[b])
                        if sb == sf:
                            continue
                        ob = self.steps[sb].order
                        related = sb in anc[sf] or sf in anc[sb]
                        if related:
                            continue
                        blocks = (of == "last" and ob != "last") or (ob == "first" and of != "first")
                        if blocks and (f, b) not in seen:
                            seen.add((f, b))
                            hf.append(f)
                            hb.append(b)
        self.h_f = np.array(hf, dtype=np.int64)
        self.h_b = np.array(hb, dtype=np.int64)

    # ------------------------------------------------------------------ rates
    def _fill(self, cand: np.ndarray, bounds: np.ndarray) -> np.ndarray:
        """Max-min fair rates (progressive filling) for the flows in `cand`, each at most its
        bound; with `priorities`, strict priority levels share what the lower levels left."""
        rate = np.zeros(self.nf)
        rem = self.cap.copy()
        levels = [None]
        if self.opts.priorities:
            levels = sorted(set(self.f_prio[cand].tolist()))
        for lv in levels:
            unf = cand.copy() if lv is None else cand & (self.f_prio == lv)
            zero = unf & (bounds <= 0)
            unf &= ~zero
            level = 0.0  # the common rate of the unfrozen flows
            while unf.any():
                m = unf[self.inc_f]
                # what one more byte/s for every unfrozen flow takes of each resource
                n_r = np.bincount(self.inc_r[m], weights=self.inc_w[m], minlength=self.nr)
                used = n_r > 0
                # Each unfrozen flow has rate `level` so far: room left per resource.
                share = np.full(self.nr, INF)
                share[used] = level + np.maximum(rem[used] - 0.0, 0.0) / n_r[used]
                lam_r = share.min() if self.nr else INF
                b = bounds[unf]
                lam_b = b.min() if b.size else INF
                lam = min(lam_r, lam_b)
                if not math.isfinite(lam):
                    raise SimulationError("a flow has no resource to bound its rate")
                # Raise everyone to lam.
                rem -= (lam - level) * n_r
                level = lam
                sat = np.zeros(self.nr, dtype=bool)
                sat[used] = rem[used] <= REL * self.cap[used]
                frz = unf & (bounds <= lam * (1 + REL))
                if sat.any():
                    on_sat = np.zeros(self.nf, dtype=bool)
                    on_sat[self.inc_f[sat[self.inc_r] & m]] = True
                    frz |= on_sat & unf
                if not frz.any():  # numerical safety: freeze the tightest resource's flows
                    j = int(np.argmin(np.where(used, rem, INF)))
                    on = np.zeros(self.nf, dtype=bool)
                    on[self.inc_f[(self.inc_r == j) & m]] = True
                    frz = on & unf
                rate[frz] = lam
                unf &= ~frz
            rem = np.maximum(rem, 0.0)
        return rate

    # ------------------------------------------------------------------ gates
    def _gate_state(self, moved: np.ndarray, rate: np.ndarray):
        """Per gate: the producer's moved fraction F on the landing rank, dF/dt, and whether all
        its flows there are done (last byte moved and latency paid: the last chunk has landed)."""
        if self.ng == 0:
            return None
        gm = np.bincount(self.gm_g, weights=moved[self.gm_f], minlength=self.ng)
        gr = np.bincount(self.gm_g, weights=rate[self.gm_f], minlength=self.ng)
        F = np.minimum(gm / self.g_bytes, 1.0)
        dF = gr / self.g_bytes
        if self._f_state is not None:
            open_ = np.bincount(self.gm_g, weights=(self._f_state[self.gm_f] != 3).astype(float), minlength=self.ng)
            full = open_ == 0
        else:
            full = F >= 1.0 - REL
        F = np.where(full, 1.0, np.minimum(F, 1.0 - REL / 2))  # 1 only once landed
        return F, dF

    def _caps(self, F: np.ndarray, dF: np.ndarray):
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

    # ------------------------------------------------------------------ run
    def run(self):
        ns = len(self.steps)
        nf = self.nf
        t = self.start_s
        step_state = np.zeros(ns, dtype=np.int8)  # 0 waiting, 1 ready, 2 done
        ready_t = np.full(ns, np.nan)
        start_t = np.full(ns, np.nan)
        end_t = np.full(ns, np.nan)
        f_state = np.zeros(nf, dtype=np.int8)  # 0 waiting, 1 moving bytes, 2 latency tail, 3 done
        self._f_state = f_state
        moved = np.zeros(nf)
        tail_end = np.full(nf, INF)
        lead_end = np.zeros(nf)  # a flow moves no byte before (its step ready + Flow.lead_s)
        res_bytes = np.zeros(self.nr)
        res_active = np.zeros(self.nr)
        flows_of = [np.flatnonzero(self.f_step == i) for i in range(ns)]
        trace_t: list[float] = []
        trace_m: list[np.ndarray] = []
        events = 0

        def start_ready_steps(now: float) -> None:
            changed = True
            while changed:
                changed = False
                for i in range(ns):
                    if step_state[i] != 0:
                        continue
                    if all(step_state[d] == 2 for d in self.deps[i]) and all(step_state[p] >= 1 for p in self.pdeps[i]):
                        step_state[i] = 1
                        ready_t[i] = now
                        fs = flows_of[i]
                        if fs.size == 0:
                            step_state[i] = 2
                            start_t[i] = end_t[i] = now
                            changed = True
                            continue
                        f_state[fs] = 1
                        lead_end[fs] = now + self.f_lead[fs]
                        nores = fs[self.f_nores[fs] | (self.f_bytes[fs] <= 0)]
                        if nores.size:
                            f_state[nores] = 2
                            tail_end[nores] = now + self.f_lat[nores]
                            start_t[i] = now
                            done_now = nores[self.f_lat[nores] <= 0]
                            f_state[done_now] = 3
                        if (f_state[fs] == 3).all():
                            step_state[i] = 2
                            end_t[i] = now
                            changed = True

        start_ready_steps(t)
        while (step_state != 2).any():
            events += 1
            if events > 2_000_000:
                raise SimulationError("too many events; the plan does not converge")
            moving = f_state == 1
            bytes_done = f_state >= 2
            held = np.zeros(nf, dtype=bool)
            if self.h_f.size:
                np.logical_or.at(held, self.h_f, ~bytes_done[self.h_b])
            leading = moving & (lead_end > t + REL * max(t, 1e-9))
            cand = moving & ~held & ~leading
            bounds = np.full(nf, INF)
            gs = self._gate_state(moved, np.zeros(nf)) if self.ng else None
            cap = dcap = None
            at_cap = np.zeros(nf, dtype=bool)
            if gs is not None:
                F, _ = gs
                frac = np.divide(moved, self.f_bytes, out=np.ones(nf), where=self.f_bytes > 0)
                cap0, _, *_ = self._caps(F, np.zeros_like(F))
                at_cap = cand & self.gated & (frac >= cap0 - REL) & (cap0 < 1.0)
            rate = self._fill(cand, bounds)
            if at_cap.any():
                for _ in range(200):
                    F, dF = self._gate_state(moved, rate)
                    cap, dcap, *_ = self._caps(F, dF)
                    track = self.f_bytes * dcap
                    newb = bounds.copy()
                    newb[at_cap] = track[at_cap]
                    if np.allclose(newb[at_cap], bounds[at_cap], rtol=1e-12, atol=1e-3):
                        break
                    bounds = newb
                    rate = self._fill(cand, bounds)
                F, dF = self._gate_state(moved, rate)
                cap, dcap, *_ = self._caps(F, dF)
                track = self.f_bytes * dcap
                rate[at_cap] = np.minimum(rate[at_cap], track[at_cap])

            # Next event.
            dt = INF
            act = rate > 0
            if act.any():
                rem = self.f_bytes[act] - moved[act]
                dt = min(dt, float((np.maximum(rem, 0.0) / rate[act]).min()))
            tails = f_state == 2
            if tails.any():
                dt = min(dt, float(tail_end[tails].min()) - t)
            if leading.any():
                dt = min(dt, float(lead_end[leading].min()) - t)
            if self.ng:
                F, dF = self._gate_state(moved, rate)
                cap, dcap, cap_p, dcap_p, Fp, dFp = self._caps(F, dF)
                # Gates crossing their consumer's first chunk (cap leaves 0).
                pend = (Fp < self.gp_inv - REL) & (dFp > 0) & cand[self.gp_f]
                if pend.any():
                    dt = min(dt, float(((self.gp_inv[pend] - Fp[pend]) / dFp[pend]).min()))
                # Free gated flows catching up with their cap.
                free = cand & self.gated & ~at_cap & (rate > 0)
                if free.any():
                    fp = free[self.gp_f] & (Fp < 1.0) & (Fp >= self.gp_inv - REL)
                    if fp.any():
                        i = self.gp_f[fp]
                        v = rate[i] / self.f_bytes[i]
                        closing = v - dcap_p[fp]
                        gap = cap_p[fp] - moved[i] / self.f_bytes[i]
                        ok = closing > 0
                        if ok.any():
                            dt = min(dt, float((np.maximum(gap[ok], 0.0) / closing[ok]).min()))
            if not math.isfinite(dt):
                waiting = [self.steps[i].name for i in range(ns) if step_state[i] != 2]
                why = "held by order hints" if (held & moving).any() else "no flow can progress"
                raise SimulationError(f"deadlock at t={t * 1e3:.4f} ms ({why}); unfinished steps: "
                                      + ", ".join(waiting))
            dt = max(dt, 0.0)

            # Advance.
            if dt > 0:
                moved += rate * dt
                if self.nr:
                    rr = np.bincount(self.inc_r, weights=rate[self.inc_f] * self.inc_w, minlength=self.nr)
                    res_bytes += rr * dt
                    res_active[rr > 0] += dt
                first = act & np.isnan(start_t[self.f_step])
                if first.any():
                    for si in np.unique(self.f_step[first]):
                        if np.isnan(start_t[si]):
                            start_t[si] = t
            t += dt
            if self.ng and cap is not None:  # numerical: never past the cap
                F, _ = self._gate_state(moved, np.zeros(nf))
                capn, *_ = self._caps(F, np.zeros_like(F))
                g = self.gated & (f_state == 1)
                moved[g] = np.minimum(moved[g], np.maximum(capn[g], 0.0) * self.f_bytes[g])

            # Bytes done -> latency tail; tails done -> flow done.
            fin = (f_state == 1) & (moved >= self.f_bytes * (1 - REL))
            if fin.any():
                moved[fin] = self.f_bytes[fin]
                f_state[fin] = 2
                tail_end[fin] = t + self.f_lat[fin]
            tdone = (f_state == 2) & (tail_end <= t + REL * max(t, 1e-9))
            f_state[tdone] = 3
            # Steps done.
            changed = False
            for i in range(ns):
                if step_state[i] == 1 and (f_state[flows_of[i]] == 3).all():
                    step_state[i] = 2
                    end_t[i] = t
                    if np.isnan(start_t[i]):
                        start_t[i] = ready_t[i]
                    changed = True
            if changed or fin.any():
                start_ready_steps(t)
            trace_t.append(t)
            trace_m.append(np.bincount(self.f_step, weights=moved, minlength=ns) if nf else np.zeros(ns))

        for i in range(ns):
            if np.isnan(start_t[i]):
                start_t[i] = ready_t[i]
        self.ready_t, self.start_t, self.end_t = ready_t, start_t, end_t
        self.res_bytes, self.res_active = res_bytes, res_active
        self.events = events
        self.trace_t = np.array([self.start_s] + trace_t)
        self.trace_m = np.vstack([np.zeros(ns)] + trace_m) if trace_m else np.zeros((1, ns))
        return self

    def chunk_times(self, i: int) -> list[float]:
        """Times at which step i's moved bytes cross k/num_chunks (k = 1..n-1)."""
        n = max(1, int(self.steps[i].num_chunks or 1))
        total = float(np.sum(self.f_bytes[self.f_step == i]))
        if n <= 1 or total <= 0:
            return []
        m = self.trace_m[:, i] / total
        out = []
        for k in range(1, n):
            x = k / n
            j = int(np.searchsorted(m, x - 1e-12))
            if j >= len(m):
                break
            if j == 0:
                out.append(float(self.trace_t[0]))
                continue
            m0, m1 = m[j - 1], m[j]
            t0, t1 = self.trace_t[j - 1], self.trace_t[j]
            out.append(float(t0 + (t1 - t0) * ((x - m0) / (m1 - m0) if m1 > m0 else 1.0)))
        return out


def _incidence(s: PlanStep, f: Flow) -> list[tuple[str, float]]:
    """(resource, weight) for every resource of a flow: its `weights`, or 1 each without them (a
    resource listed twice then counts once).  A weighted flow lists each resource once, with a
    positive, finite weight."""
    if not f.weights:
        return [(r, 1.0) for r in dict.fromkeys(f.resources)]
    where = f"step '{s.program}.{s.name}', flow {f.src}->{f.dst} of rank {f.rank}"
    if len(f.weights) != len(f.resources):
        raise SimulationError(f"{where}: {len(f.weights)} weights for {len(f.resources)} resources")
    if len(set(f.resources)) != len(f.resources):
        raise SimulationError(f"{where}: a weighted flow lists a resource twice")
    bad = [w for w in f.weights if not (math.isfinite(w) and w > 0)]
    if bad:
        raise SimulationError(f"{where}: weight {bad[0]}; weights must be positive and finite")
    return list(zip(f.resources, (float(w) for w in f.weights)))


def simulate_steps(steps: list[PlanStep], resources: dict[str, float], opts: SimOptions | None = None,
                   known_elsewhere: set[str] = frozenset()) -> _Engine:
    return _Engine(steps, resources, opts or SimOptions(), known_elsewhere).run()


def step_alone(step: PlanStep, resources: dict[str, float], opts: SimOptions) -> float:
    """Duration of one step with the machine to itself (no deps, no pipelining, no hints)."""
    solo = dataclasses.replace(step, deps=(), pipelined_deps=(), order=None)
    e = _Engine([solo], resources, opts).run()
    return float(e.end_t[0] - e.ready_t[0])


def program_steps(plan: Plan) -> dict[str, list[PlanStep]]:
    out: dict[str, list[PlanStep]] = {}
    for s in plan.steps:
        out.setdefault(s.program, []).append(s)
    return out
