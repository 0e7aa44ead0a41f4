"""The epcc pass pipeline: Python-defined MLIR passes over the `epcc` dialect.

One module per pass; each defines a :class:`Pass` subclass registered under its own name
(`REGISTRY[name]`; a test checks that every key equals the pass's `name`).  `PIPELINE` is the
order they run in.  Every pass runs through an MLIR :class:`~mlir.passmanager.PassManager` as a
Python-defined pass anchored on the top-level module, and can be printed with
`epcc compile FILE --emit <pass>` or `--print-ir-after-all`.  manager.py imports every pass module
(which registers it) and runs them in order (`run_pipeline`).

Passes read the checked schedule model (routes and rank sets are evaluated there, with source
spans for diagnostics) and record what they decide twice: as `epcc.*` attributes and ops in the
IR, so each stage can be read, and in the :class:`~epcc.plan.Plan` that the simulator and the
backends consume without MLIR.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from mlir import ir

from ..diagnostics import DiagnosticBag
from ..sema import model


@dataclass
class PassOptions:
    routing: str = "uniform"  # uniform | zipf:S | FILE.npy
    tokens: int | None = None  # override the workload's tokens per rank
    hidden: int | None = None  # override the workload's hidden size (epcc run --hidden)
    dtype: str | None = None  # override the workload's dispatch dtype (bf16 | fp8)
    layout: str | None = None  # override the workload's output layout (expert | token)


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
    "engine-selection",
    "chunk-pipeline",
    "overlap-schedule",
    "buffer-allocation",
    "sync-insertion",
    "kernel-formation",
)
