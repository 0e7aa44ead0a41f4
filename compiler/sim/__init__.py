"""epcc.sim: a cost model and fluid discrete-event simulator over a :class:`~epcc.plan.Plan`.

The model (what `epcc simulate` prints and tests/sim pins):

Resources.  Every name in `Plan.resources` is a resource with a capacity in bytes/s: a dedicated
directed link pair (`link:<name>:<src>><dst>`), a shared port (`link:<name>:<port>:out|in`), or a
rank's local memory (`hbm:<rank>`); the SM models add pools of SMs (`sm:...`).  A flow occupies
every resource it lists, taking weight x its rate of each (`Flow.weights`; 1 without them: a link
carries the flow's bytes, a pool of SMs what they cost it in stored bytes).

SM models (only with the topology's `sm` rates): the table-driven kernels run each step as a role
on its own SMs (sim/sm_terms.py); the direct kernels of a one-hop plan share one pool of SMs per
rank and program among all its steps, and start each program after its kernel launches
(sim/direct.py).  `SimOptions.direct` picks the second; `epcc simulate` sets it where the CUDA
target lowers the plan to direct kernels.  Where the table-driven kernels' tables are written on
the GPU per dispatch, `SimOptions.metadata` starts the dispatch after those metadata kernels
(sim/meta.py); `epcc simulate` sets it from the CUDA target's manifest.
With `SimOptions.layout` (a layout of the plan, which `epcc simulate` builds), the table-driven
roles' chunks are also dealt to their blocks as the kernels deal them, each block a serial
timeline at the per-SM rate, and each role's flows held until its blocks publish their last chunk
(sim/blocks.py; `SimOptions.dealing`).

Rates.  Between two events every rate is constant; at every event the rates of all moving flows
are recomputed by progressive filling: all unfrozen flows rise together, a resource that fills up
freezes the flows crossing it, until every flow is frozen.  The result is the max-min fair
allocation over all resources at once (a flow's rate is set by its tightest resource, and what it
cannot use there is left to the others).  Events: a flow's last byte, the end of its latency, a
step becoming ready, a pipelined consumer catching up with (or being released by) its producer.
The state advances exactly between events, so the result is exact for the model and
deterministic (no sampling, no time step).  Chunk boundaries change no rate in this fluid model
(a consumer's cap moves continuously with its producer), so they are not events of their own;
their times are read off the progress trace (the Gantt chart's ticks).

Steps.  A step becomes ready when every dependency is done; its flows start at once.  A step is
done when all its flows are.  Zero-byte flows over resources move nothing and are dropped.  Flows
without resources (a metadata exchange with no link) take their latency_s and nothing else.

Pipelined dependencies (`PlanStep.pipelined_deps`).  The consumer becomes ready when its
non-pipelined deps are done and its pipelined producers have started.  Its flows are then capped:
a flow that reads rank x's buffer (its `src`) may have moved a fraction of its bytes at most

    cap = F - 1/n    (F < 1),      cap = 1    (F = 1),

where F is the fraction of the bytes the producer lands on x (its flows with dst == x) that has
moved, and n the consumer's whole chunks (`PlanStep.whole_chunks`: a ramped step's smaller first
and last chunks enter as the producer's completion lag and the consumer's tail, sm_terms.py):
it trails its producer by one of its own chunks, and
finishes the last chunk after the producer's last byte.  A producer that lands nothing on x does
not hold the flow back; with several pipelined producers the smallest cap holds.  A flow at its
cap moves at the rate the cap rises (b x dF/dt), found together with the fair rates of everyone
else by a fixed point (the producer's rate can depend on what the consumer takes from a shared
resource).  Closed form for one producer (time Tp alone) and one consumer (Tc alone, n chunks) on
separate resources: the consumer ends at max(Tp + Tc/n, Tp/n + Tc), the classic two-stage pipeline.

Latency.  A flow of n chunks (ceil(bytes / chunk_bytes) when the step has a chunk size, else
`num_chunks`) with `depth` chunks in flight pays latency_s x ceil(n / depth), once its last byte
has moved (a tail; it occupies no bandwidth).  Why: with a window of `depth` outstanding chunks
the sender waits for completions once per window, so ceil(n/depth) round trips are exposed when
chunks are short next to the latency; with long chunks only one would be, so this is the
conservative end.  Without chunking (n = 1) it is one latency per flow.  An RDMA step run as
paced SM roles (SimOptions.rdma_proxy False, with SM rates) pays one latency: the roles replay one
serial link whose chunks land a latency after their last byte, pipelined (sm_terms.py).  The pipelined caps use
moved bytes, i.e. the producer's per-chunk latency is not added to the consumer's trail.

Order hints (`PlanStep.order`, seed 000 §1.2 "send d0_5 last").  A flow of a `last` step does not
move while any flow of another step (not `last`, not one of its descendants) that shares one of
its resources has bytes left, including steps not yet started; symmetrically, flows sharing a
resource with a `first` step wait for that step's flows there (ancestors and descendants of the
`first` step excepted).  A hint on a step whose resources no other step uses changes nothing:
with dedicated per-pair links (ubbv2's BLink) `fwd1 ... last` is such a case.  `priority` is NOT
used by default (max-min fairness across steps); `SimOptions(priorities=True)` serves shared
resources in strict priority order (lower number first, the rest share what is left).

Programs.  Dispatch and combine are simulated separately, each from t = 0 (expert compute sits
between them; with the direct kernels' launches, its first steps become ready after them);
"together" is their sum.  A dependency on a step of the other program counts as
done.

Outputs.  Per step: ready, start (first byte), end, bytes, the busiest rank's bytes, chunk
boundary times (when the step's moved bytes cross k/n), its time alone.  Per resource: bytes,
busy time = bytes / capacity (the time it is busy at full rate) and active time (wall time with any
traffic).  Per link class: the busiest instance's busy time.  The bottleneck is the link class
whose busy time is largest (closest to the makespan), with busy / makespan as its utilisation.
Makespan = the last step's end (with overlap); the serial sum adds every step's time alone (and
the launches).

The simulator reads a Plan only (plan/, costmodel/; no MLIR): a GPU machine simulates a bundle's
plan.json with it.  build.py runs the compiler to get a plan from a .sched file (`build_plan`),
which needs lark and MLIR; import it from there.
"""

from .base import ResourceStat, SimOptions, SimulationError, StepTiming
from .simulate import Bottleneck, LinkClassStat, ProgramResult, SimResult, simulate, simulate_subset

__all__ = [
    "Bottleneck", "LinkClassStat", "ProgramResult", "ResourceStat", "SimOptions", "SimResult", "SimulationError",
    "StepTiming", "simulate", "simulate_subset",
]
