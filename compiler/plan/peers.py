"""Which peers each rank's table-driven kernels reach over peer memory (NVLink: CUDA IPC
mappings), decided from the plan alone: what a rank must map, and so what must share its CUDA
IPC domain.

A copy of a step's flow runs on the flow's executing rank (`Flow.rank`) and reads the flow's
`src` rank's buffers and writes the `dst` rank's buffer, bumps its counter in the `dst` rank's
flag area, and waits for the counters of the copies that wrote its source rows, which live where
those rows are (the `src` rank).  So an executing rank touches `src` and `dst`, and both touch it
back in the sense that matters for the kernels' entry barrier: every launch begins with a barrier
in which each rank bumps the barrier word of each rank whose flag area it has mapped and waits
for as many arrivals as it has mapped areas, so the relation must be symmetric (a rank must
count, and be counted by, everyone that reads or writes its memory).

RDMA steps lowered to the GPU proxy path (`--rdma proxy`), or left to a proxy outside the
kernels, are the proxy's business: their pack role reads the sender's own buffers and waits on
its own counters, the proxy carries the chunk to the receiver's landing slots (its transport's
memory, not the kernels' buffers), the unpack role writes the receiver's own buffers and bumps
its own counter.  Without the proxy path the kernels emulate those steps by peer copies, which
count like any other flow.  Metadata exchanges (`verb exchange`) move no rows.
"""

from __future__ import annotations

from .model import Plan


def step_peers(plan: Plan, proxied: set[tuple[str, str]]) -> dict[tuple[int, int], tuple[str, str]]:
    """Every pair of distinct ranks {a, b} (a < b) some copy connects over peer memory, with the
    first (program, step) that does; `proxied`: the (program, step) pairs whose rows the kernels
    do not move over peer memory (the GPU proxy path's, in a bundle compiled `--rdma proxy`, or
    RDMA steps left to a proxy outside the kernels; empty where every step is a peer copy)."""
    out: dict[tuple[int, int], tuple[str, str]] = {}
    for s in plan.steps:
        if s.verb == "exchange" or (s.program, s.name) in proxied:
            continue
        for f in s.flows:
            for other in (f.src, f.dst):
                if other != f.rank:
                    out.setdefault((min(f.rank, other), max(f.rank, other)), (s.program, s.name))
    return out


def peer_sets(plan: Plan, proxied: set[tuple[str, str]]) -> list[frozenset[int]]:
    """Per rank, the other ranks whose buffers or flag areas its kernels read or write over peer
    memory, or that read or write its own (symmetric; the rank itself is not in its set)."""
    sets: list[set[int]] = [set() for _ in range(plan.num_ranks)]
    for a, b in step_peers(plan, proxied):
        sets[a].add(b)
        sets[b].add(a)
    return [frozenset(s) for s in sets]


def foreign_reads(plan: Plan, program: str, buffer: str, proxied: set[tuple[str, str]]) -> str | None:
    """Why a copy of `program` may touch `buffer` of a rank other than the copy's executing rank
    (the first step that does, and how), or None where every copy that reads it runs on the rank
    whose buffer it is and no step writes it.  Then a rank's kernels read only their own
    `buffer`, and a launch may read it from memory the caller gives in its place (the combine's
    expert rows, read where the caller has them: backends/cuda/codegen.py `combine_input`).
    A copy reads its flow's `src` rank's buffers and runs on the flow's `rank`; a step in
    `proxied` (the GPU proxy path's) is read by its pack role on the `src` rank itself."""
    for s in plan.steps:
        if s.program != program or s.verb == "exchange":
            continue
        if s.dst_buffer == buffer:
            return f"{program} step '{s.name}' (line {s.line}) writes {buffer}"
        if buffer not in s.src_buffers or (s.program, s.name) in proxied:
            continue
        f = _remote_flow(s, "src")
        if f is not None:
            return (f"{program} step '{s.name}' (line {s.line}) reads {buffer} of rank {f.src} on rank {f.rank} "
                    f"(over {s.link_kind or 'a link'})")
    return None


def foreign_writes(plan: Plan, program: str, buffer: str, proxied: set[tuple[str, str]]) -> str | None:
    """Why a copy of `program` may write `buffer` of a rank from another rank (the first step
    that does, and how), or None where every copy that writes it runs on the rank whose buffer it
    is.  Then every write into a rank's `buffer` comes from its own GPU, and its kernel can tell
    when a row has all of them (the combine's conversion in the kernel: backends/cuda/codegen.py
    `combine_output`).  A step in `proxied` (the GPU proxy path's) is written by its unpack role on
    the `dst` rank itself."""
    for s in plan.steps:
        if s.program != program or s.verb == "exchange" or s.dst_buffer != buffer or (s.program, s.name) in proxied:
            continue
        f = _remote_flow(s, "dst")
        if f is not None:
            return (f"{program} step '{s.name}' (line {s.line}) writes {buffer} of rank {f.dst} from rank {f.rank} "
                    f"(over {s.link_kind or 'a link'})")
    return None


def _remote_flow(step, end: str):
    """The first flow of `step` whose `end` ("src": the rank it reads, "dst": the rank it writes) is
    not the rank that runs it, or None."""
    return next((f for f in step.flows if getattr(f, end) != f.rank), None)


def publishes_in_order(steps, name: str) -> bool:
    """Whether the role of step `name` must publish its chunks in chunk order: where a step of its
    program (`steps`, the program's) depends on it, whose chunks wait on its counters and read
    "counter >= v" as chunks 0..v-1 written.  Else only the kernel's drain reads its counters, for
    their total, and a block publishes each chunk once written (the CUDA backend's run_role
    `ordered`, the simulator's blocks: sim/blocks.py)."""
    return any(name in s.deps for s in steps)


__all__ = ["foreign_reads", "foreign_writes", "peer_sets", "publishes_in_order", "step_peers"]
