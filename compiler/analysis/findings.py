"""What the delivery analyses hand to the passes, and how their messages name routes.

A :class:`Problem` is one diagnostic to be: instances with the same `group` (kind, location)
are reported once, with a count (verify-delivery's `report`).  A :class:`CombineVolume` is what
one combine step moves, per executing rank, whichever analysis computed it.  Routes are written
hop by hop (`route_text`); a program is pointed at by its keyword (`head_span`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from ..diagnostics import Note, Span
from ..sema import model

Hop = tuple[str, int, int]


def route_text(start: int, path: Iterable[Hop]) -> str:
    """`rank 0 -reorder-> 0 -fwd1-> 10 -final-> 10`: where a token (or partial) went, step by step."""
    out = f"rank {start}"
    for step, _a, b in path:
        out += f" -{step}-> {b}"
    return out


def head_span(p: model.Program) -> Span:
    """The program's keyword (`dispatch` / `combine`): where a problem of no one step points."""
    s = p.span
    return Span(s.path, s.line, s.col, s.line, s.col + len(p.kind))


@dataclass
class Problem:
    """One diagnostic to be (see the module docstring)."""

    group: tuple  # instances with equal groups are one diagnostic
    span: Span
    message: str
    notes: list[Note] = field(default_factory=list)


@dataclass
class CombineVolume:
    """What one combine step moves when each rank runs it (expected partials or rows)."""

    name: str
    copies: list[float]
    bytes: list[float]
    per_flow: list[list[tuple[int, int, float]]]  # per executing rank: (src, dst, copies)
