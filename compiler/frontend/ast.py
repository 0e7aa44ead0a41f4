"""The .sched abstract syntax tree: frozen dataclasses, a source span on every node.

The AST is exactly what the user wrote, names unresolved; compiler/sema resolves it into the
schedule model.  `epcc compile --emit ast` prints it with :func:`dump`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Union

from ..diagnostics import Diagnostic, Span


@dataclass(frozen=True)
class Name:
    text: str
    span: Span


@dataclass(frozen=True)
class Quantity:
    """`20 GB/s`: a value and its unit as written (unit None when missing)."""

    value: int | float
    is_int: bool
    unit: str | None
    span: Span
    unit_span: Span | None


# --------------------------------------------------------------------------- topology


@dataclass(frozen=True)
class Level:
    name: Name
    count: int
    count_span: Span
    span: Span


@dataclass(frozen=True)
class Group:
    name: Name
    size: int
    size_span: Span
    level: Name
    span: Span


# Index-map expressions (`card -> card ^ 5`).
@dataclass(frozen=True)
class Lit:
    value: int
    span: Span


@dataclass(frozen=True)
class Var:
    name: str
    span: Span


@dataclass(frozen=True)
class BinOp:
    op: str
    lhs: "Expr"
    rhs: "Expr"
    span: Span


Expr = Union[Lit, Var, BinOp]


@dataclass(frozen=True)
class SameRule:
    level: Name
    span: Span


@dataclass(frozen=True)
class OtherRule:
    level: Name
    span: Span


@dataclass(frozen=True)
class AnyRule:
    level: Name
    span: Span


@dataclass(frozen=True)
class MapRule:
    level: Name
    expr: Expr
    span: Span


Rule = Union[SameRule, OtherRule, AnyRule, MapRule]


@dataclass(frozen=True)
class RuleList:
    rules: tuple[Rule, ...]
    span: Span


@dataclass(frozen=True)
class RelName:
    name: Name
    span: Span


@dataclass(frozen=True)
class TableRef:
    table: Name
    column: Name
    span: Span


@dataclass(frozen=True)
class PairList:
    pairs: tuple[tuple[int, int, Span], ...]
    level: Name
    span: Span


RelAlt = Union[RuleList, RelName, TableRef, PairList]


@dataclass(frozen=True)
class RelExpr:
    alts: tuple[RelAlt, ...]
    span: Span


@dataclass(frozen=True)
class Relation:
    name: Name
    expr: RelExpr
    span: Span


@dataclass(frozen=True)
class TableRow:
    key: int
    key_span: Span
    values: tuple[tuple[int, Span], ...]
    span: Span


@dataclass(frozen=True)
class Table:
    name: Name
    level: Name
    columns: tuple[Name, ...]
    rows: tuple[TableRow, ...]
    span: Span


@dataclass(frozen=True)
class LinkProp:
    key: str  # connects | bandwidth | latency | engine | lanes | efficiency | shared | atomics | post | engines
    value: object  # RelExpr | Quantity | Name | int | tuple[EngineRate, ...]
    span: Span


@dataclass(frozen=True)
class EngineRate:
    """`spc 27.9 GB/s` in a link's `engines`: what that copy engine reaches over the link."""

    engine: Name
    rate: Quantity
    span: Span


@dataclass(frozen=True)
class Link:
    name: Name
    kind: Name
    props: tuple[LinkProp, ...]
    span: Span


@dataclass(frozen=True)
class SmRate:
    """`copy 28 GB/s` in an `sm` line: what one SM moves per second doing that kind of work."""

    work: Name
    rate: Quantity
    span: Span


@dataclass(frozen=True)
class Vendor:
    """`vendor biren arch br166`: whose machine the topology is."""

    name: Name
    arch: Name | None
    span: Span


@dataclass(frozen=True)
class Topology:
    name: Name
    levels: tuple[Level, ...]
    levels_span: Span | None
    rank: Name | None
    groups: tuple[Group, ...]
    relations: tuple[Relation, ...]
    tables: tuple[Table, ...]
    links: tuple[Link, ...]
    span: Span
    extra_ranks: tuple[Name, ...] = ()  # `rank` given more than once (an error)
    sm_rates: tuple[SmRate, ...] = ()  # every `sm` line's rates, in source order
    vendors: tuple[Vendor, ...] = ()  # every `vendor` line (more than one is an error)


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class WorkloadItem:
    key: str  # tokens | hidden | dtype | topk | experts | node_limit | weights | layout
    values: tuple[object, ...]  # ints and Names, as written
    span: Span


@dataclass(frozen=True)
class Workload:
    items: tuple[WorkloadItem, ...]
    span: Span


# --------------------------------------------------------------------------- programs


@dataclass(frozen=True)
class RankTerm:
    """`me`, `all`, `peer`, `vnode`, `mate.vnode` ... resolved by sema."""

    base: Name
    member: Name | None
    span: Span


@dataclass(frozen=True)
class RankSet:
    terms: tuple[tuple[str, RankTerm], ...]  # (op, term); the first op is '+'
    span: Span


@dataclass(frozen=True)
class Selection:
    mode: str  # all | any | for | of
    ranks: RankSet | None
    span: Span


@dataclass(frozen=True)
class BufRef:
    """`stage` (a buffer of the executing rank) or `mate.stage` (of each related rank)."""

    rel: Name | None
    buf: Name
    span: Span


@dataclass(frozen=True)
class Action:
    verb: str  # send | pull | copy | permute | reduce | exchange
    selection: Selection | None
    sources: tuple[BufRef, ...]
    dest: BufRef | None
    what: Name | None  # exchange: counts | routing
    peers: RankSet | None  # exchange: with whom
    span: Span


@dataclass(frozen=True)
class StepOpt:
    key: str  # over | chunk | depth | after | parallel | order | sms | dedup | engine
    value: object
    span: Span


@dataclass(frozen=True)
class Step:
    name: Name
    title: str | None
    action: Action
    opts: tuple[StepOpt, ...]
    span: Span


@dataclass(frozen=True)
class Buffer:
    name: Name
    capacity: Quantity | None
    span: Span


@dataclass(frozen=True)
class Defaults:
    opts: tuple[StepOpt, ...]
    span: Span


@dataclass(frozen=True)
class Program:
    kind: str  # dispatch | combine
    buffers: tuple[Buffer, ...]
    defaults: tuple[Defaults, ...]
    steps: tuple[Step, ...]
    span: Span
    head_span: Span


@dataclass(frozen=True)
class CombineReverse:
    of: Name
    span: Span


@dataclass(frozen=True)
class ScheduleDecl:
    name: Name
    title: str | None
    span: Span


@dataclass(frozen=True)
class File:
    path: str
    schedule: tuple[ScheduleDecl, ...]
    topologies: tuple[Topology, ...]
    workloads: tuple[Workload, ...]
    programs: tuple[Program, ...]
    reverses: tuple[CombineReverse, ...]
    span: Span
    # What the reader noticed in the text itself (bidirectional controls), for sema to report
    # with its own warnings.
    warnings: tuple[Diagnostic, ...] = ()


def dump(node: object, indent: int = 0) -> str:
    """A readable, stable text form of an AST (for `--emit ast` and golden tests)."""
    pad = "  " * indent
    if dataclasses.is_dataclass(node):
        name = type(node).__name__
        if isinstance(node, Name):
            return f"{pad}Name {node.text!r} @{node.span.line}:{node.span.col}"
        fields = [f for f in dataclasses.fields(node) if f.name not in ("span", "warnings")]
        span = getattr(node, "span", None)
        where = f" @{span.line}:{span.col}" if isinstance(span, Span) else ""
        lines = [f"{pad}{name}{where}"]
        for f in fields:
            v = getattr(node, f.name)
            if isinstance(v, Span) or v is None or v == ():
                continue
            if dataclasses.is_dataclass(v) or (isinstance(v, tuple) and v and _has_nodes(v)):
                lines.append(f"{pad}  {f.name}:")
                lines.append(dump(v, indent + 2))
            else:
                lines.append(f"{pad}  {f.name}: {_plain(v)}")
        return "\n".join(lines)
    if isinstance(node, tuple):
        return "\n".join(dump(x, indent) for x in node)
    return f"{pad}{_plain(node)}"


def _has_nodes(t: tuple) -> bool:
    return any(dataclasses.is_dataclass(x) or (isinstance(x, tuple) and _has_nodes(x)) for x in t)


def _plain(v: object) -> str:
    if isinstance(v, tuple):
        return "(" + ", ".join(_plain(x) for x in v) + ")"
    if isinstance(v, Span):
        return f"@{v.line}:{v.col}"
    return repr(v)
