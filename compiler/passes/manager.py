"""Runs the passes in PIPELINE order through MLIR's pass manager.

Importing the pass modules registers them (`@register` in each); this module imports all of them,
so REGISTRY is complete once it is loaded.
"""

from __future__ import annotations

from typing import Callable

from mlir import ir, passmanager

from ..diagnostics import CompileError
from . import (  # noqa: F401 - importing a pass module registers its pass
    PIPELINE,
    REGISTRY,
    PassContext,
    buffer_allocation,
    chunk_pipeline,
    derive_combine,
    engine_selection,
    instantiate,
    kernel_formation,
    overlap_schedule,
    route_analysis,
    sync_insertion,
    verify_delivery,
)


def run_pipeline(module: ir.Module, ctx: PassContext, *, until: str | None = None,
                 after_each: Callable[[str, ir.Module], None] | None = None, start: int = 0) -> None:
    """Run the passes PIPELINE[start:] in order through MLIR's pass manager, stopping after `until`.

    A pass reports user errors into `ctx.diags` (with source spans); the pipeline stops after
    the first pass that reported any and raises CompileError.
    """
    for name in PIPELINE[start:]:
        p = REGISTRY[name]()
        failure: list[BaseException] = []

        def body(op, mlir_pass, _p=p):
            try:
                _p.run(op, ctx)
            except CompileError as e:  # from ctx.diags.raise_if_errors() (already there) or raised directly
                ctx.diags.items.extend(d for d in e.diagnostics if not any(d is x for x in ctx.diags.items))
                mlir_pass.signal_pass_failure()
            except BaseException as e:  # keep the Python error; MLIR only sees a failure
                failure.append(e)
                mlir_pass.signal_pass_failure()
            if ctx.diags.has_errors:
                mlir_pass.signal_pass_failure()

        pm = passmanager.PassManager("builtin.module", context=module.context)
        pm.add(body, name=p.name, argument=f"epcc-{p.name}", description=p.description)
        try:
            # Passes build attributes and ops: they need the module's context (and a default
            # location for the few builders that take none) in scope.
            with module.context, ir.Location.unknown():
                pm.run(module.operation)
        except ir.MLIRError:
            if failure:
                raise failure[0]
            ctx.diags.raise_if_errors()
            raise
        ctx.diags.raise_if_errors()
        if after_each is not None:
            after_each(name, module)
        if name == until:
            return
