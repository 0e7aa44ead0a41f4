"""Typed builders for the epcc dialect: the one place that spells its op and attribute names.

The dialect is defined in IRDL (``dialect/epcc.irdl.mlir``), so the bindings have no generated
op classes for it; ops are created generically with :meth:`mlir.ir.Operation.create`.  Doing that
from many places would scatter string names and the dialect's encoding rules through the compiler,
so every epcc op (and every container module) is built here, from plain Python values:

* ``None`` becomes the dialect's zero value for "not given" ("" / 0 / ``[]``), because IRDL
  attributes cannot be optional (see the header of the .irdl.mlir file);
* ``operandSegmentSizes`` is computed for the ops with several variable-length operand groups;
* integers are i64, rates and times f64, flags i1.

Builders insert at the current :class:`mlir.ir.InsertionPoint`, like upstream op builders, and
take a mandatory ``loc``: every op epcc builds points at the source it came from.  Ops with a
result return the :class:`mlir.ir.Value`; the others return the :class:`mlir.ir.Operation`.

The few decoders at the end turn encoded attributes (relation targets, link pairs) back into the
model's Python values, so that passes do not re-implement the encoding either.

Why this file is over 400 lines: it is one concern, the dialect's spelling, kept in one place on
purpose.  Every builder is the same few lines over the same private encoders (`_str`, `_i64`,
`_segments`, `_create`), and the compiler uses the module as one namespace (`ops.TRANSFER`,
`ops.transfer`, `ops.STEP_OPS`); split by op family, each part would need those encoders and this
module would be left re-exporting its sixty-odd names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from mlir import ir
from mlir.dialects import builtin

from ..textsafe import mlir_text

# --------------------------------------------------------------------------- names

DIALECT = "epcc"

LEVEL = "epcc.level"
GROUP = "epcc.group"
RELATION = "epcc.relation"
LINK = "epcc.link"
WORKLOAD = "epcc.workload"
BUFFER = "epcc.buffer"
SELECT = "epcc.select"
TRANSFER = "epcc.transfer"
COPY = "epcc.copy"
PERMUTE = "epcc.permute"
REDUCE = "epcc.reduce"
EXCHANGE = "epcc.exchange"
SIGNAL = "epcc.signal"
WAIT = "epcc.wait"
CHUNK_LOOP = "epcc.chunk_loop"
ROLE = "epcc.role"

#: The step ops: one per step of a program, each returning an !epcc.event.
STEP_OPS = (TRANSFER, COPY, PERMUTE, REDUCE, EXCHANGE)

BUF_TYPE = "!epcc.buf"
EVENT_TYPE = "!epcc.event"
SEL_TYPE = "!epcc.sel"

MODULE = "builtin.module"
SYM_NAME = "sym_name"
SEGMENTS = "operandSegmentSizes"

# Attributes of the container modules (builtin.module is not verified by IRDL; these are the
# names passes look for).
SCHEDULE_ATTR = "epcc.schedule"
TITLE_ATTR = "epcc.title"
SOURCE_ATTR = "epcc.source"
NUM_RANKS_ATTR = "epcc.num_ranks"
TOPOLOGY_ATTR = "epcc.topology"
PROGRAM_ATTR = "epcc.program"
DERIVED_FROM_ATTR = "epcc.derived_from"
KIND_ATTR = "epcc.kind"

TOPOLOGY_MODULE = "topology"
LINKS_MODULE = "links"
CODE_KINDS = ("kernel", "proxy", "dma")

ORDER_NONE = ""


# --------------------------------------------------------------------------- attributes

def _str(s: str | None) -> ir.StringAttr:
    return ir.StringAttr.get(mlir_text(s))  # user text (titles, paths): printable, valid Unicode


def _i64(v: int | None) -> ir.IntegerAttr:
    return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), 0 if v is None else int(v))


def _f64(v: float) -> ir.FloatAttr:
    return ir.FloatAttr.get_f64(float(v))


def _bool(v: bool) -> ir.BoolAttr:
    return ir.BoolAttr.get(bool(v))


def _strs(items: Iterable[str]) -> ir.ArrayAttr:
    return ir.ArrayAttr.get([_str(s) for s in items])


def _i64s(items: Iterable[int]) -> ir.DenseI64ArrayAttr:
    return ir.DenseI64ArrayAttr.get([int(x) for x in items])


def _segments(*sizes: int) -> ir.DenseI32ArrayAttr:
    return ir.DenseI32ArrayAttr.get(list(sizes))


def _type(spelling: str) -> ir.Type:
    return ir.Type.parse(spelling)


def buf_type() -> ir.Type:
    return _type(BUF_TYPE)


def event_type() -> ir.Type:
    return _type(EVENT_TYPE)


def sel_type() -> ir.Type:
    return _type(SEL_TYPE)


def _create(name: str, attrs: dict[str, ir.Attribute], loc: ir.Location, *,
            operands: Sequence[ir.Value] = (), result: ir.Type | None = None) -> ir.Operation:
    return ir.Operation.create(name, results=[result] if result is not None else [],
                               operands=list(operands), attributes=attrs, loc=loc)


# --------------------------------------------------------------------------- containers

def schedule_module(name: str, title: str | None, source: str, num_ranks: int, *,
                    loc: ir.Location) -> ir.Module:
    """The top-level module of a schedule (a new ir.Module, not inserted anywhere)."""
    module = ir.Module.create(loc=loc)
    attrs = module.operation.attributes
    attrs[SYM_NAME] = _str(name)
    attrs[SCHEDULE_ATTR] = _str(name)
    attrs[TITLE_ATTR] = _str(title)
    attrs[SOURCE_ATTR] = _str(source)
    attrs[NUM_RANKS_ATTR] = _i64(num_ranks)
    return module


def _nested_module(sym_name: str, attrs: dict[str, ir.Attribute], loc: ir.Location) -> builtin.ModuleOp:
    mod = builtin.ModuleOp(loc=loc)
    mod.operation.attributes[SYM_NAME] = _str(sym_name)
    for k, v in attrs.items():
        mod.operation.attributes[k] = v
    return mod


def topology_module(topology_name: str, *, loc: ir.Location) -> builtin.ModuleOp:
    """`module @topology`: levels, groups and relations (one namespace, as in the language)."""
    return _nested_module(TOPOLOGY_MODULE, {TOPOLOGY_ATTR: _str(topology_name)}, loc)


def links_module(*, loc: ir.Location) -> builtin.ModuleOp:
    """`module @links` inside @topology: links have a namespace of their own in the language."""
    return _nested_module(LINKS_MODULE, {}, loc)


def program_module(kind: str, *, derived_from: str | None = None, loc: ir.Location) -> builtin.ModuleOp:
    """`module @dispatch` / `module @combine`; `derived_from` marks a program a pass must build."""
    attrs: dict[str, ir.Attribute] = {PROGRAM_ATTR: _str(kind)}
    if derived_from is not None:
        attrs[DERIVED_FROM_ATTR] = _str(derived_from)
    return _nested_module(kind, attrs, loc)


def code_module(name: str, kind: str, *, loc: ir.Location) -> builtin.ModuleOp:
    """A container for generated code: `epcc.kind = "kernel"` (device) or `"proxy"` (host loop)."""
    if kind not in CODE_KINDS:
        raise ValueError(f"code module kind must be one of {CODE_KINDS}, not {kind!r}")
    return _nested_module(name, {KIND_ATTR: _str(kind)}, loc)


# --------------------------------------------------------------------------- topology

def level(name: str, count: int, depth: int, *, loc: ir.Location) -> ir.Operation:
    return _create(LEVEL, {SYM_NAME: _str(name), "count": _i64(count), "depth": _i64(depth)}, loc)


def group(name: str, level_name: str, size: int, *, loc: ir.Location) -> ir.Operation:
    return _create(GROUP, {SYM_NAME: _str(name), "level": _str(level_name), "size": _i64(size)}, loc)


def relation(name: str, text: str, targets: Sequence[Sequence[int]], *, loc: ir.Location) -> ir.Operation:
    """`targets[r]` are the ranks rank r is related to; stored as one i64 array per rank."""
    return _create(RELATION, {
        SYM_NAME: _str(name),
        "text": _str(text),
        "targets": ir.ArrayAttr.get([_i64s(t) for t in targets]),
    }, loc)


def link(name: str, kind: str, *, bandwidth_Bps: float, latency_s: float, engine: str, lanes: int,
         efficiency: float, connects: str, pairs: Iterable[tuple[int, int]], shared_per: str | None = None,
         loc: ir.Location) -> ir.Operation:
    """`pairs` is flattened in ascending order, so equal link sets print equally.

    `shared_per` ("" when not shared): one port per instance of that level/group, shared by the
    flows of all its ranks (a NIC per card, an NVSwitch port per GPU)."""
    flat = [x for pair in sorted(pairs) for x in pair]
    return _create(LINK, {
        SYM_NAME: _str(name),
        "kind": _str(kind),
        "bandwidth_Bps": _f64(bandwidth_Bps),
        "latency_s": _f64(latency_s),
        "engine": _str(engine),
        "lanes": _i64(lanes),
        "efficiency": _f64(efficiency),
        "connects": _str(connects),
        "pairs": _i64s(flat),
        "shared_per": _str(shared_per or ""),
    }, loc)


def workload(*, tokens: int, hidden: int, dtype: str, topk: int, experts: int, placement: str,
             node_limit: int | None, node_limit_scope: str | None, weights_travel: bool,
             bytes_per_token: int, combine_bytes_per_token: int, loc: ir.Location) -> ir.Operation:
    return _create(WORKLOAD, {
        "tokens": _i64(tokens),
        "hidden": _i64(hidden),
        "dtype": _str(dtype),
        "topk": _i64(topk),
        "experts": _i64(experts),
        "placement": _str(placement),
        "node_limit": _i64(node_limit),
        "node_limit_scope": _str(node_limit_scope),
        "weights_travel": _bool(weights_travel),
        "bytes_per_token": _i64(bytes_per_token),
        "combine_bytes_per_token": _i64(combine_bytes_per_token),
    }, loc)


# --------------------------------------------------------------------------- programs

def buffer(name: str, role: str, *, capacity_tokens: int | None, capacity_bytes: int | None,
           loc: ir.Location) -> ir.Value:
    return _create(BUFFER, {
        SYM_NAME: _str(name),
        "role": _str(role),
        "capacity_tokens": _i64(capacity_tokens),
        "capacity_bytes": _i64(capacity_bytes),
    }, loc, result=buf_type()).result


def select(mode: str, ranks: str | None, *, loc: ir.Location) -> ir.Value:
    return _create(SELECT, {"mode": _str(mode), "ranks": _str(ranks)}, loc, result=sel_type()).result


@dataclass(frozen=True)
class StepInfo:
    """What every step op records about its step: its name and title, and the options that sema
    resolved for it (``None``: not given).  Not every op uses every field: see :func:`_step_attrs`.
    """

    step: str
    title: str | None = None
    chunk_tokens: int | None = None
    chunk_bytes: int | None = None
    depth: int | None = None
    sms: int | None = None
    order: str | None = None
    after: tuple[str, ...] = ()
    parallel: tuple[str, ...] = ()


def _step_attrs(info: StepInfo, *, pipelined: bool) -> dict[str, ir.Attribute]:
    """Attributes common to step ops; `pipelined` ops (data movers) also carry chunking options."""
    attrs: dict[str, ir.Attribute] = {
        "step": _str(info.step),
        "title": _str(info.title),
        "order": _str(info.order if info.order is not None else ORDER_NONE),
        "after": _strs(info.after),
        "parallel": _strs(info.parallel),
    }
    if pipelined:
        attrs.update({
            "chunk_tokens": _i64(info.chunk_tokens),
            "chunk_bytes": _i64(info.chunk_bytes),
            "depth": _i64(info.depth),
            "sms": _i64(info.sms),
        })
    return attrs


def transfer(srcs: Sequence[ir.Value], dst: ir.Value, sel: ir.Value, deps: Sequence[ir.Value], info: StepInfo, *,
             direction: str, relation: str, src_relations: Sequence[str | None], link: str, link_kind: str,
             engine: str, dedup: str, loc: ir.Location) -> ir.Value:
    """A `send` (direction "push") or `pull` between ranks; returns its completion event."""
    if len(src_relations) != len(srcs):
        raise ValueError("transfer: one src_relations entry per source is required")
    attrs = _step_attrs(info, pipelined=True)
    attrs.update({
        "direction": _str(direction),
        "relation": _str(relation),
        "src_relations": _strs(r or "" for r in src_relations),
        "link": _str(link),
        "link_kind": _str(link_kind),
        "engine": _str(engine),
        "dedup": _str(dedup),
        SEGMENTS: _segments(len(srcs), 1, 1, len(deps)),
    })
    return _create(TRANSFER, attrs, loc, operands=[*srcs, dst, sel, *deps], result=event_type()).result


def copy(srcs: Sequence[ir.Value], dst: ir.Value, sel: ir.Value, deps: Sequence[ir.Value], info: StepInfo, *,
         link: str | None, engine: str, dedup: str, loc: ir.Location) -> ir.Value:
    """A local `copy` of the selected tokens between the executing rank's buffers."""
    attrs = _step_attrs(info, pipelined=True)
    attrs.update({
        "link": _str(link),
        "engine": _str(engine),
        "dedup": _str(dedup),
        SEGMENTS: _segments(len(srcs), 1, 1, len(deps)),
    })
    return _create(COPY, attrs, loc, operands=[*srcs, dst, sel, *deps], result=event_type()).result


def permute(srcs: Sequence[ir.Value], dst: ir.Value, deps: Sequence[ir.Value], info: StepInfo, *,
            link: str | None, engine: str, loc: ir.Location) -> ir.Value:
    """Dispatch's local placement of the executing rank's tokens into expert-major order."""
    attrs = _step_attrs(info, pipelined=True)
    attrs.update({
        "link": _str(link),
        "engine": _str(engine),
        SEGMENTS: _segments(len(srcs), 1, len(deps)),
    })
    return _create(PERMUTE, attrs, loc, operands=[*srcs, dst, *deps], result=event_type()).result


def reduce(src: ir.Value, dst: ir.Value, deps: Sequence[ir.Value], info: StepInfo, *,
           link: str | None, engine: str, loc: ir.Location) -> ir.Value:
    """Combine's local weighted sum of expert outputs per home token."""
    attrs = _step_attrs(info, pipelined=True)
    attrs.update({"link": _str(link), "engine": _str(engine)})
    return _create(REDUCE, attrs, loc, operands=[src, dst, *deps], result=event_type()).result


def exchange(deps: Sequence[ir.Value], info: StepInfo, *, what: str, peers: str, link: str | None,
             loc: ir.Location) -> ir.Value:
    """A metadata exchange with the ranks of `peers`; `link` None: the compiler routes it."""
    attrs = _step_attrs(info, pipelined=False)
    attrs.update({"what": _str(what), "peers": _str(peers), "link": _str(link)})
    return _create(EXCHANGE, attrs, loc, operands=list(deps), result=event_type()).result


# --------------------------------------------------------------------------- lowering ops

def signal(deps: Sequence[ir.Value], *, step: str, flag: str, value: int, mode: str = "add",
           relation: str | None = None, loc: ir.Location) -> ir.Value:
    """Bump (`mode` "add") or set a completion flag, on the executing rank or its `relation` ranks."""
    return _create(SIGNAL, {
        "step": _str(step),
        "flag": _str(flag),
        "relation": _str(relation),
        "mode": _str(mode),
        "value": _i64(value),
    }, loc, operands=list(deps), result=event_type()).result


def wait(deps: Sequence[ir.Value], *, step: str, flag: str, value: int, timeout_ns: int,
         loc: ir.Location) -> ir.Value:
    """Wait until the executing rank's flag reaches `value`, or time out after `timeout_ns`."""
    return _create(WAIT, {
        "step": _str(step),
        "flag": _str(flag),
        "value": _i64(value),
        "timeout_ns": _i64(timeout_ns),
    }, loc, operands=list(deps), result=event_type()).result


def chunk_loop(*, step: str, chunks: int, chunk_tokens: int, depth: int, loc: ir.Location) -> ir.Operation:
    """Marks step `step` as pipelined in `chunks` chunks of `chunk_tokens`, `depth` in flight."""
    return _create(CHUNK_LOOP, {
        "step": _str(step),
        "chunks": _i64(chunks),
        "chunk_tokens": _i64(chunk_tokens),
        "depth": _i64(depth),
    }, loc)


def role(*, step: str, role: str, sm_begin: int, sm_end: int, warps: int, engine: str,
         loc: ir.Location) -> ir.Operation:
    """One role of a fused kernel or proxy loop: who runs `step`, on which SMs."""
    return _create(ROLE, {
        "step": _str(step),
        "role": _str(role),
        "sm_begin": _i64(sm_begin),
        "sm_end": _i64(sm_end),
        "warps": _i64(warps),
        "engine": _str(engine),
    }, loc)


# --------------------------------------------------------------------------- decoders

def relation_targets(op: ir.Operation) -> tuple[tuple[int, ...], ...]:
    """An epcc.relation's rank -> targets map, exactly as sema evaluated it."""
    _expect(op, RELATION)
    return tuple(tuple(ir.DenseI64ArrayAttr(a)) for a in ir.ArrayAttr(op.attributes["targets"]))


def link_pairs(op: ir.Operation) -> frozenset[tuple[int, int]]:
    """The (a, b) rank pairs an epcc.link joins."""
    _expect(op, LINK)
    flat = list(ir.DenseI64ArrayAttr(op.attributes["pairs"]))
    return frozenset(zip(flat[0::2], flat[1::2]))


def _expect(op: ir.Operation, name: str) -> None:
    if op.name != name:
        raise ValueError(f"expected an {name} op, got {op.name}")
