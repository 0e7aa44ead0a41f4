"""The epcc pass pipeline: Python-defined MLIR passes over the `epcc` dialect.

One module per pass; each defines a :class:`Pass` subclass registered under its own name
(`REGISTRY[name]`; a test checks that every key equals the pass's `name`).  `PIPELINE` is the
order they run in.  Every pass runs through an MLIR :class:`~mlir.passmanager.PassManager` as a
Python-defined pass anchored on the top-level module, and can be printed with
`epcc compile FILE --emit <pass>` or `--print-ir-after-all`.

Passes read the checked schedule model (routes and rank sets are evaluated there, with source
spans for diagnostics) and record what they decide twice: as `epcc.*` attributes and ops in the
IR, so each stage can be read, and in the :class:`~epcc.plan.Plan` that the simulator and the
backends consume without MLIR.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar

from mlir import ir, passmanager

from ..diagnostics import CompileError, DiagnosticBag
from ..sema import model


@dataclass
class PassOptions:
    routing: str = "uniform"  # uniform | zipf:S | FILE.npy
    tokens: int | None = None  # override the workload's tokens per rank
    hidden: int | None = None  # override the workload's hidden size (epcc run --hidden)
    dtype: str | None = None  # override the workload's dispatch dtype (bf16 | fp8)


@dataclass
class PassContext:
    """What passes share: the schedule, options, diagnostics and analysis results."""

    schedule: model.Schedule
    options: PassOptions = field(default_factory=PassOptions)
    diags: DiagnosticBag = field(default_factory=DiagnosticBag)
    results: dict[str, object] = field(default_factory=dict)  # analysis name -> result

    def get(self, key: str):
        if key not in self.results:
            raise KeyError(f"analysis '{key}' has not run; the pass order in PIPELINE is wrong")
        return self.results[key]


class Pass(ABC):
    name: ClassVar[str]
    description: ClassVar[str]

    @abstractmethod
    def run(self, module: ir.Operation, ctx: PassContext) -> None:
        """Transform or annotate `module` (the top-level builtin.module op)."""


REGISTRY: dict[str, type[Pass]] = {}


def register(cls: type[Pass]) -> type[Pass]:
    if cls.name in REGISTRY:
        raise ValueError(f"pass '{cls.name}' registered twice")
    REGISTRY[cls.name] = cls
    return cls


PIPELINE = (
    "instantiate",
    "route-analysis",
    "verify-delivery",
    "derive-combine",
    "chunk-pipeline",
    "overlap-schedule",
    "buffer-allocation",
    "sync-insertion",
    "kernel-formation",
)


def _load_all() -> None:
    # Importing the modules registers the passes.
    from . import (  # noqa: F401
        buffer_allocation,
        chunk_pipeline,
        derive_combine,
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
    _load_all()
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
