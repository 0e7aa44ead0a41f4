"""The fluid discrete-event simulator over a :class:`~epcc.plan.Plan` (the model: sim/__init__.py).

One :class:`_Engine` simulates one program's steps.  State is kept in numpy arrays indexed by
flow; the flow/resource incidence is a list of (flow, resource, weight) triples: a flow moving at
rate x takes weight x x of the resource (`Flow.weights`, 1 without them), and the weighted sum on a
resource stays within its capacity.  Between two events every rate is constant, so the state
advances exactly; at every event the rates are recomputed by progressive filling (fairshare.py)
over the resources, held back where a pipelined producer gates a flow (gates.py).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..plan import Flow, Plan, PlanStep
from .base import INF, REL, SimOptions, SimulationError
from .fairshare import max_min_rates
from .gates import Gates

# ----------------------------------------------------------------------------- the engine


class _Engine:
    def __init__(self, steps: list[PlanStep], resources: dict[str, float], opts: SimOptions,
                 known_elsewhere: set[str] = frozenset(), start_s: float = 0.0,
                 holds: dict[tuple[int, int], float] | None = None, trace_flows: bool = False):
        """`holds`: (step index, flow index in the step) -> the time before which that flow is not
        done (its last byte moved, it waits; sim/blocks.py: the role's blocks publish its last chunk
        then).  `trace_flows`: keep every flow's moved bytes per event (flow_crossing)."""
        self.steps = steps
        self.trace_flows = trace_flows
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
        self.flow_at: dict[tuple[int, int], int] = {}  # (step index, flow index in the step) -> flow
        for si, s in enumerate(steps):
            for fi, f in enumerate(s.flows):
                if f.bytes > 0 or not f.resources:
                    self.flow_at[(si, fi)] = len(fl)
                    fl.append((si, f))
        self.nf = len(fl)
        self.f_hold = np.full(self.nf, -INF)
        for key, t in (holds or {}).items():
            if key in self.flow_at:
                self.f_hold[self.flow_at[key]] = t
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

        self.gates = Gates(steps, self.pdeps, self.f_step, self.f_bytes, self.f_src, self.f_dst)
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
        return max_min_rates(cand, bounds, self.cap, self.inc_f, self.inc_r, self.inc_w,
                             self.f_prio if self.opts.priorities else None)

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
        moved = np.zeros(nf)
        tail_end = np.full(nf, INF)
        lead_end = np.zeros(nf)  # a flow moves no byte before (its step ready + Flow.lead_s)
        res_bytes = np.zeros(self.nr)
        res_active = np.zeros(self.nr)
        f_done = np.full(nf, np.nan)
        trace_f: list[np.ndarray] = []
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
                            tail_end[nores] = np.maximum(now + self.f_lat[nores], self.f_hold[nores])
                            start_t[i] = now
                            done_now = nores[tail_end[nores] <= now]
                            f_state[done_now] = 3
                            f_done[done_now] = now
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
            gs = self.gates.state(moved, np.zeros(nf), f_state) if self.gates.ng else None
            cap = dcap = None
            at_cap = np.zeros(nf, dtype=bool)
            if gs is not None:
                F, _ = gs
                frac = np.divide(moved, self.f_bytes, out=np.ones(nf), where=self.f_bytes > 0)
                cap0, _, *_ = self.gates.caps(F, np.zeros_like(F))
                at_cap = cand & self.gates.gated & (frac >= cap0 - REL) & (cap0 < 1.0)
            rate = self._fill(cand, bounds)
            if at_cap.any():
                for _ in range(200):
                    F, dF = self.gates.state(moved, rate, f_state)
                    cap, dcap, *_ = self.gates.caps(F, dF)
                    track = self.f_bytes * dcap
                    newb = bounds.copy()
                    newb[at_cap] = track[at_cap]
                    if np.allclose(newb[at_cap], bounds[at_cap], rtol=1e-12, atol=1e-3):
                        break
                    bounds = newb
                    rate = self._fill(cand, bounds)
                F, dF = self.gates.state(moved, rate, f_state)
                cap, dcap, *_ = self.gates.caps(F, dF)
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
            if self.gates.ng:
                F, dF = self.gates.state(moved, rate, f_state)
                cap, dcap, cap_p, dcap_p, Fp, dFp = self.gates.caps(F, dF)
                # Gates crossing their consumer's first chunk (cap leaves 0).
                pend = (Fp < self.gates.gp_inv - REL) & (dFp > 0) & cand[self.gates.gp_f]
                if pend.any():
                    dt = min(dt, float(((self.gates.gp_inv[pend] - Fp[pend]) / dFp[pend]).min()))
                # Free gated flows catching up with their cap.
                free = cand & self.gates.gated & ~at_cap & (rate > 0)
                if free.any():
                    fp = free[self.gates.gp_f] & (Fp < 1.0) & (Fp >= self.gates.gp_inv - REL)
                    if fp.any():
                        i = self.gates.gp_f[fp]
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
            if self.gates.ng and cap is not None:  # numerical: never past the cap
                F, _ = self.gates.state(moved, np.zeros(nf), f_state)
                capn, *_ = self.gates.caps(F, np.zeros_like(F))
                g = self.gates.gated & (f_state == 1)
                moved[g] = np.minimum(moved[g], np.maximum(capn[g], 0.0) * self.f_bytes[g])

            # Bytes done -> latency tail; tails done -> flow done.
            fin = (f_state == 1) & (moved >= self.f_bytes * (1 - REL))
            if fin.any():
                moved[fin] = self.f_bytes[fin]
                f_state[fin] = 2
                tail_end[fin] = np.maximum(t + self.f_lat[fin], self.f_hold[fin])
            tdone = (f_state == 2) & (tail_end <= t + REL * max(t, 1e-9))
            f_state[tdone] = 3
            f_done[tdone] = t
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
            if self.trace_flows:
                trace_f.append(moved.copy())

        for i in range(ns):
            if np.isnan(start_t[i]):
                start_t[i] = ready_t[i]
        self.ready_t, self.start_t, self.end_t = ready_t, start_t, end_t
        self.res_bytes, self.res_active = res_bytes, res_active
        self.events = events
        f_done[np.isnan(f_done)] = self.start_s  # flows done when their step became ready (nothing to move)
        self.f_done = f_done
        self.trace_f = np.vstack([np.zeros(nf)] + trace_f) if trace_f else None
        self.trace_t = np.array([self.start_s] + trace_t)
        self.trace_m = np.vstack([np.zeros(ns)] + trace_m) if trace_m else np.zeros((1, ns))
        return self

    def flow_crossing(self, f: int, frac: float) -> float:
        """When flow f had moved `frac` of its bytes (its end, latency and hold included, at 1;
        the program's start at 0).  Needs trace_flows."""
        if frac >= 1.0 - REL:
            return float(self.f_done[f])
        if frac <= 0.0 or self.f_bytes[f] <= 0:
            return self.start_s
        m = self.trace_f[:, f] / self.f_bytes[f]
        j = int(np.searchsorted(m, frac - REL))
        if j >= len(m):
            return float(self.f_done[f])
        if j == 0:
            return float(self.trace_t[0])
        m0, m1 = m[j - 1], m[j]
        t0, t1 = self.trace_t[j - 1], self.trace_t[j]
        return float(t0 + (t1 - t0) * ((frac - m0) / (m1 - m0) if m1 > m0 else 1.0))

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
