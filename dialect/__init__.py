"""The epcc MLIR dialect, defined in IRDL (``epcc.irdl.mlir``) and loaded at run time.

The upstream MLIR Python bindings have no epcc dialect compiled in, so the dialect is parsed from
its IRDL definition and registered in each :class:`mlir.ir.Context` that needs it.  The same file
is what ``mlir-opt --irdl-file=...`` reads, so Python and the command-line tools verify the IR
against one definition.

Loading is per context and must happen at most once: registering the same IRDL dialect twice in
one context trips an LLVM assertion that aborts the whole process.  :func:`load` is therefore
idempotent, and it asks the context itself whether the dialect is already there, so it stays
correct even when someone else loaded the file into that context.
"""

from __future__ import annotations

import weakref
from importlib import resources
from pathlib import Path

from mlir import ir
from mlir.dialects import irdl

#: The IRDL definition of the dialect (a real file: the package is installed in editable mode or
#: as a plain directory, never zipped, because mlir-opt needs a path).
DIALECT_PATH: Path = Path(str(resources.files(__name__).joinpath("epcc.irdl.mlir")))

DIALECT_NAME = "epcc"

# An op the dialect defines; its registration tells whether a context has the dialect.
_PROBE_OP = "epcc.transfer"

# Contexts this module loaded the dialect into.  Weak, so that caching never keeps a context alive.
_loaded: "weakref.WeakSet[ir.Context]" = weakref.WeakSet()


def load(ctx: ir.Context) -> ir.Context:
    """Register the epcc dialect in ``ctx`` unless it is already there; returns ``ctx``."""
    if ctx in _loaded:
        return ctx
    if not ctx.is_registered_operation(_PROBE_OP):
        definition = ir.Module.parse(DIALECT_PATH.read_text(encoding="utf-8"), context=ctx)
        irdl.load_dialects(definition)
    _loaded.add(ctx)
    return ctx


def new_context() -> ir.Context:
    """A fresh context with the epcc dialect loaded (and the upstream dialects registered)."""
    return load(ir.Context())


__all__ = ["DIALECT_NAME", "DIALECT_PATH", "load", "new_context"]
