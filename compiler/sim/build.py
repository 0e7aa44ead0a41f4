"""Getting a Plan to simulate: the whole pass pipeline, as `epcc compile` runs it."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import pipeline
from ..diagnostics import SourceMap
from ..passes import PIPELINE, PassOptions
from ..plan import Plan
from ..sema import model


@dataclass
class BuiltPlan:
    plan: Plan
    schedule: model.Schedule
    compilation: pipeline.Compilation
    passes_run: list[str] = field(default_factory=lambda: list(PIPELINE))
    warnings: list = field(default_factory=list)


def build_plan(path: str, options: PassOptions | None = None, sources: SourceMap | None = None) -> BuiltPlan:
    """The plan of `path` after every pass (CompileError on a bad file or option)."""
    c = pipeline.run(path, pipeline.STAGES[-1].name, sources, options or PassOptions())
    return BuiltPlan(c.passes.get("plan"), c.schedule, c, list(PIPELINE), c.warnings)
