"""The simulator's vocabulary: its options, what it reports per step and per resource, its error,
and the tolerance of its arithmetic."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..plan import DirectKernels

INF = float("inf")
REL = 1e-9  # relative tolerance on fractions and simultaneous events


class SimulationError(Exception):
    """The plan cannot be simulated (unknown dependency, missing resource, deadlock)."""


@dataclass(frozen=True)
class DeviceMetadata:
    """The metadata kernels a table-driven CUDA bundle runs before every dispatch (its manifest's
    "metadata" with lowering "device"; sim/meta.py models them): the blocks of each phase (the
    most of any rank), the plan steps whose work they do, (program, step), and how they launch."""

    count_blocks: int
    rows_blocks: int
    items_blocks: int
    steps: tuple[tuple[str, str], ...] = ()
    exchange: str = "ipc"  # how the routing reaches every rank: "ipc" or "collective" (the group's all-gather)
    # the phases in one cooperative kernel, meta_fused (the manifest's "launches"); False: the steps as
    # launches of their own
    fused: bool = False
    scan_blocks: int = 1  # the scan's (a bundle compiled before they were recorded: one block)


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
    # The table-driven kernels get their tables from the metadata kernels on the GPU (sim/meta.py:
    # their time before the dispatch's first step); None: no such kernels (direct kernels, or the
    # host lays the routing out).  `epcc simulate` sets it from the CUDA target's manifest.
    metadata: DeviceMetadata | None = None
    # The Buffer call's copies around the table-driven kernels (sim/calls.py: x into the input
    # buffer; the expert outputs in, the partials cleared, the result converted), in each program's
    # time.  `epcc simulate` sets it for every table-driven CUDA bundle (device- or host-built tables).
    calls: bool = False
    # With `calls`: the programs whose kernel reads the caller's rows where they are (the dispatch's
    # tokens, the combine's expert outputs: the CUDA manifest's dispatch_input / combine_input
    # caller_rows), so the call does not copy them in (sim/calls.py).  `epcc simulate` sets it
    # from the manifest.
    caller_rows: frozenset[str] = frozenset()
    # With `calls`: the Buffer clears the combine's partial buffers beside the dispatch kernel (on a
    # stream of its own, hidden under it), not in the combine call: device-built tables
    # (runtime/engines/cuda_table _zero_beside).  `epcc simulate` sets it (--clear-partials).
    zero_beside: bool = False
    # The combine kernel converts its fp32 sums into the caller's bf16 tokens itself (the bundle's
    # combine_output: in-kernel), so the call runs no conversion after it (sim/calls.py).  `epcc
    # simulate` sets it (--combine-output).
    convert_in_kernel: bool = False
    # The table-driven kernels' blocks (sim/blocks.py): a layout of the plan (runtime/layout's
    # Layout, or anything with its `copies`) whose chunks the roles' blocks take one by one, dealt
    # as `dealing` says (round-robin: as the kernels deal them; free: to the block free first);
    # None: the fluid model alone.  `epcc simulate` lays out one routing drawn for the plan.
    layout: Any = None
    dealing: str = "round-robin"


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
    engine: str | None = None  # the engine that copies its rows (PlanStep.engine)

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
