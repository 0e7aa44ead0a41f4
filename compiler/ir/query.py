"""Finding things in epcc IR and annotating them: what passes use instead of spelling op names.

Analysis results go on ops as discardable `epcc.*` attributes (IRDL checks the attributes an op
declares and lets others through), so a pass can record what it decided without changing the
dialect, and `--emit <pass>` shows it.
"""

from __future__ import annotations

from typing import Iterator

from mlir import ir

from ..textsafe import mlir_text
from . import ops


def program_module(top: ir.Operation, kind: str) -> ir.Operation | None:
    for op in top.regions[0].blocks[0].operations:
        if op.operation.name == ops.MODULE and ops.PROGRAM_ATTR in op.attributes:
            if ir.StringAttr(op.attributes[ops.PROGRAM_ATTR]).value == kind:
                return op.operation
    return None


def body(op: ir.Operation) -> ir.Block:
    return op.regions[0].blocks[0]


def step_ops(prog: ir.Operation) -> dict[str, ir.Operation]:
    """Step name -> its op, in program order."""
    out: dict[str, ir.Operation] = {}
    for op in body(prog).operations:
        o = op.operation
        if o.name in ops.STEP_OPS:
            out[ir.StringAttr(o.attributes["step"]).value] = o
    return out


def walk(op: ir.Operation) -> Iterator[ir.Operation]:
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield child.operation
                yield from walk(child.operation)


def to_attr(v) -> ir.Attribute:
    """Plain Python values to attributes: bool, int (i64), float (f64), str, lists, dicts."""
    if isinstance(v, ir.Attribute):
        return v
    if isinstance(v, bool):
        return ir.BoolAttr.get(v)
    if isinstance(v, int):
        return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), v)
    if isinstance(v, float):
        return ir.FloatAttr.get_f64(v)
    if isinstance(v, str):
        return ir.StringAttr.get(mlir_text(v))
    if isinstance(v, dict):
        return ir.DictAttr.get({k: to_attr(x) for k, x in v.items()})
    if isinstance(v, (list, tuple)):
        if v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return ir.DenseI64ArrayAttr.get(list(v))
        return ir.ArrayAttr.get([to_attr(x) for x in v])
    raise TypeError(f"cannot make an attribute of {type(v).__name__}")


def named_loc(op: ir.Operation, name: str) -> ir.Location:
    """The source position of `op` under another name (ops a pass adds for a step: its waits,
    signals and chunk loops point at the step's source but must not take the step's SSA name)."""
    loc = op.location
    child = loc.child_loc if loc.is_a_name() else loc
    return ir.Location.name(name, childLoc=child)


def annotate(op: ir.Operation, name: str, value) -> None:
    op.attributes[name if name.startswith("epcc.") else f"epcc.{name}"] = to_attr(value)
