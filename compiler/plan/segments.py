"""The layout of a plan as a static program over token *segments*: what a GPU needs to lay out
any routing itself (the metadata kernels of the table-driven CUDA target).

compute_layout (runtime/layout) follows every token copy through the plan.  Which copies exist
is static; only which tokens they hold depends on the routing, and only through each token's
set of destination ranks D.  A *segment* is the run of entries that one path through the plan
leaves in a buffer: the tokens of one home rank h that took one chain of flows from h's `input`.
A flow passes a token iff D hits its selection, so a token is in a segment iff D hits every
selection along the segment's chain (`masks`).  compute_layout appends entries step by step,
flow by flow, source buffer by source buffer, source entry by source entry, so a buffer's entries
are its segments one after the other in creation order, each holding its tokens in token order.

Hence, for a routing, a segment's entries are the tokens of its home that satisfy its masks; the
slot of such a token is its segment's offset in the buffer (the sizes of the segments before it)
plus its rank among the segment's tokens.  Every row a copy moves is found the same way:

* a dispatch copy reads its source segments in order (`parts`); into a staging buffer each part
  is the new segment its tokens form there; into `output` each part holds the tokens of its source
  segment that have an expert on the copy's destination (`out_mask`), one row per such expert,
  in local-expert order, at the row the documented expert-major order gives it;
* a derived combine copy runs dispatch copies (`pool`) backwards over their parts that read the
  combine step's `reverse_source`, keeping the rows whose slot delivered something downstream
  (`live`, unless it is weighted: every expert row is).

`segment_program(plan)` returns that static program; runtime/testing/device_layout.py computes a
layout from it with only per-token predicates and prefix sums (what the kernels do) and is
checked against compute_layout.  Written-out combines (no `reverse_of`) are not covered: their
partial slots are created by first contribution, which needs the layout's order of
contributions (`SegmentProgramError`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .model import Plan


class SegmentProgramError(ValueError):
    """The plan has a shape the segment program does not cover (the message says which)."""


def rank_mask(ranks) -> int:
    """A set of ranks as an integer bit mask (bit r: rank r)."""
    m = 0
    for r in ranks:
        m |= 1 << int(r)
    return m


@dataclass(frozen=True)
class Segment:
    id: int
    buffer: str  # a dispatch buffer (`input` or a staging buffer)
    rank: int  # the rank whose buffer holds it
    origin: int  # the home rank of all its tokens
    parent: int  # the segment its tokens came from (-1: origin's input)
    writer: int  # the dispatch copy that wrote it (-1: input)
    masks: tuple[int, ...]  # a token is in it iff its destination ranks hit every mask


@dataclass(frozen=True)
class Part:
    """One source segment of a copy: `src` read out of the step's `src_buffers[src_buffer]`,
    written into segment `dst` (a staging copy) or into `output` (dst -1: rows for the tokens of
    `src` that have an expert on the copy's destination rank)."""

    src_buffer: int
    src: int
    dst: int


@dataclass
class DispatchCopy:
    id: int  # = its flag id (compute_layout numbers dispatch copies first, in this order)
    step_index: int
    flow_index: int
    step: str
    rank: int
    src: int
    dst: int
    src_buffers: tuple[str, ...]
    dst_buffer: str
    mask: int  # the flow's selection (-1: every token)
    tpc: int | None  # tokens per chunk (None: one chunk)
    ramp_head: int
    ramp_tail: int
    parts: list[Part] = field(default_factory=list)

    @property
    def into_output(self) -> bool:
        return self.dst_buffer == "output"


@dataclass
class CombineCopy:
    """A derived combine copy: `pool` dispatch copies run backwards over their parts that read
    source buffer index `src_buffer` (the step's reverse_source), weighted (expert rows) or not
    (only rows that delivered something downstream)."""

    id: int  # = its flag id: after every dispatch copy
    step_index: int
    flow_index: int
    step: str
    rank: int
    src: int
    dst: int
    src_buffer_name: str  # the combine buffer it reads (mirrors the dispatch copies' destination)
    dst_buffer: str  # the combine buffer it accumulates into (mirrors their source)
    weighted: bool
    src_buffer: int  # index of the reverse_source among the dispatch step's src_buffers
    pool: list[int]  # dispatch copy ids, in the order their rows follow each other
    tpc: int | None
    ramp_head: int
    ramp_tail: int


@dataclass
class SegmentProgram:
    num_ranks: int
    segments: list[Segment]
    buffers: dict[tuple[str, int], list[int]]  # (dispatch buffer, rank) -> its segments in slot order
    dispatch: list[DispatchCopy]
    combine: list[CombineCopy]
    partial_of: dict[str, str]  # combine buffer -> the dispatch buffer it mirrors

    def copies_into(self, buffer: str, rank: int) -> list[int]:
        """The dispatch copies writing (buffer, rank), in order."""
        return sorted({self.segments[s].writer for s in self.buffers.get((buffer, rank), [])
                       if self.segments[s].writer >= 0})


def _tpc(chunk_bytes: float | None, bytes_per_token: int) -> int | None:
    if not chunk_bytes or bytes_per_token <= 0:
        return None
    return max(1, int(chunk_bytes // bytes_per_token))


def segment_program(plan: Plan) -> SegmentProgram:
    """The static program of `plan`'s layout (see the module docstring)."""
    R = plan.num_ranks
    segs: list[Segment] = []
    buffers: dict[tuple[str, int], list[int]] = defaultdict(list)
    for h in range(R):
        segs.append(Segment(h, "input", h, h, -1, -1, ()))
        buffers[("input", h)].append(h)
    dispatch: list[DispatchCopy] = []
    bpt = plan.bytes_per_token
    dsteps = plan.program_steps("dispatch")
    for si, st in enumerate(dsteps):
        if st.verb == "exchange":
            continue
        if not st.src_buffers or st.dst_buffer is None:
            raise SegmentProgramError(f"dispatch step '{st.name}' names no source or destination buffer")
        pending: dict[tuple[str, int], list[int]] = defaultdict(list)
        for fi, f in enumerate(st.flows):
            c = DispatchCopy(len(dispatch), si, fi, st.name, f.rank, f.src, f.dst, tuple(st.src_buffers),
                             st.dst_buffer, -1 if f.select is None else rank_mask(f.select),
                             _tpc(st.chunk_bytes, bpt), st.ramp_head, st.ramp_tail)
            dispatch.append(c)
            for bi, b in enumerate(st.src_buffers):
                for sid in buffers.get((b, f.src), []):
                    s = segs[sid]
                    if c.into_output:
                        c.parts.append(Part(bi, sid, -1))
                        continue
                    masks = s.masks + (() if c.mask == -1 else (c.mask,))
                    n = Segment(len(segs), st.dst_buffer, f.dst, s.origin, sid, c.id, masks)
                    segs.append(n)
                    pending[(st.dst_buffer, f.dst)].append(n.id)
                    c.parts.append(Part(bi, sid, n.id))
        for key, ids in pending.items():  # a step reads what earlier steps wrote
            buffers[key].extend(ids)
    combine, partial_of = _derived_combine(plan, dispatch, len(dispatch))
    return SegmentProgram(R, segs, dict(buffers), dispatch, combine, partial_of)


def _derived_combine(plan: Plan, dispatch: list[DispatchCopy], first_id: int):
    steps = plan.program_steps("combine")
    data = [s for s in steps if s.verb != "exchange"]
    if any(s.reverse_of is None for s in data):
        raise SegmentProgramError("the combine program is written out (steps without `reverse of`): its partial "
                                  "slots follow the order contributions arrive in, which the segment program "
                                  "does not model")
    dsteps = plan.program_steps("dispatch")
    index = {s.name: i for i, s in enumerate(dsteps)}
    by_step: dict[int, list[DispatchCopy]] = defaultdict(list)
    for c in dispatch:
        by_step[c.step_index].append(c)
    partial_of = {"result": "input", "output": "output"}
    out: list[CombineCopy] = []
    bpt = 2 * plan.workload.hidden
    for ci, cs in enumerate(steps):
        if cs.verb == "exchange":
            continue
        if cs.reverse_of not in index:
            raise SegmentProgramError(f"combine step '{cs.name}' reverses '{cs.reverse_of}', which dispatch does not have")
        x = dsteps[index[cs.reverse_of]]
        if cs.reverse_source not in x.src_buffers or cs.dst_buffer is None or len(cs.src_buffers) != 1:
            raise SegmentProgramError(f"combine step '{cs.name}' does not mirror dispatch step '{x.name}'")
        partial_of.setdefault(cs.dst_buffer, cs.reverse_source)
        partial_of.setdefault(cs.src_buffers[0], x.dst_buffer)
        pool: dict[tuple[int, int, int], list[int]] = defaultdict(list)
        for d in by_step[index[x.name]]:
            pool[(d.rank, d.src, d.dst)].append(d.id)
        for fi, f in enumerate(cs.flows):
            out.append(CombineCopy(first_id + len(out), ci, fi, cs.name, f.rank, f.src, f.dst, cs.src_buffers[0],
                                   cs.dst_buffer, bool(cs.weighted), x.src_buffers.index(cs.reverse_source),
                                   pool.pop((f.rank, f.dst, f.src), []), _tpc(cs.chunk_bytes, bpt),
                                   cs.ramp_head, cs.ramp_tail))
    return out, partial_of
