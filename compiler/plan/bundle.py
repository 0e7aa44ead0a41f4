"""The one loader of a compiled bundle: the directory `epcc compile -o DIR` writes.

    DIR/plan.json              the plan (model.py), all a runtime reads of the compiler
    DIR/manifest.json          what was compiled from which source (optional for a runtime)
    DIR/cuda/manifest.json     with --target cuda: the generated kernels, launch shapes, buffers

`load(DIR)` checks the plan and the top-level manifest, `cuda_manifest(DIR)` the CUDA one; every
problem is a BundleError whose message names the file and says what to do.  Used by
epcc.runtime.Buffer, `epcc tune`, `epcc run FILE.json`, bench/ep_bench.py and the tests.
`write_bundle` is the one writer of a bundle (`epcc compile`): the final IR, plan.json, what the
backends generate, and manifest.json.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import __version__
from ..files import JSON_MAX_BYTES, ContentError, FileError, read_json
from ..limits import MAX_RANKS
from .check import PlanJsonError, check_plan_json
from .model import Plan

PLAN_FILE = "plan.json"
MANIFEST_FILE = "manifest.json"
CUDA_DIR = "cuda"


class BundleError(ValueError):
    """The bundle cannot be used (missing, unreadable, or compiled for something else)."""


@dataclass(frozen=True)
class Bundle:
    path: Path
    plan: Plan
    manifest: dict  # DIR/manifest.json, {} where the bundle has none

    @property
    def cuda_dir(self) -> Path:
        return self.path / CUDA_DIR


def read_plan(path: str | Path) -> Plan:
    """The plan in the file `path` (a bundle's plan.json), with its workload: read as every input
    is (a regular file of bounded size, JSON of bounded depth) and checked field by field before
    it is built (plan/check.py); a BundleError naming the file and the field otherwise."""
    path = Path(path)
    try:
        d = read_json(path, "a plan.json", JSON_MAX_BYTES)
    except ContentError as e:
        raise BundleError(f"{path}: not a plan written by 'epcc compile': {e.reason}") from None
    except FileError as e:
        raise BundleError(str(e)) from None
    try:
        check_plan_json(d)
    except PlanJsonError as e:
        raise BundleError(f"{path}: not a plan written by 'epcc compile': {e}") from None
    plan = Plan.from_dict(d)
    if plan.workload is None:
        raise BundleError(f"{path}: the plan has no workload (written by an older epcc? recompile the schedule)")
    return plan


def read_manifest(path: str | Path) -> dict:
    """The JSON object in the manifest file `path` (read as every input is); ValueError saying
    why when it is not one."""
    try:
        d = read_json(path, "a bundle manifest", JSON_MAX_BYTES)
    except ContentError as e:
        raise ValueError(e.reason) from None
    if not isinstance(d, dict):
        raise ValueError("the top level is not a JSON object")
    return d


def check_cuda_manifest(d: dict) -> None:
    """The fields of a CUDA manifest every reader relies on; ValueError naming the field."""
    ranks = d.get("num_ranks")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
        raise ValueError(f"num_ranks: expected a whole number of ranks in 1..{MAX_RANKS}, got {ranks!r}"[:240])
    if "direct" in d and not isinstance(d["direct"], dict):
        raise ValueError("direct: expected a JSON object")


def load(path: str | Path) -> Bundle:
    """The bundle in directory `path`: its plan and its top-level manifest."""
    path = Path(path)
    if not (path / PLAN_FILE).is_file():
        raise BundleError(f"{path}: not an epcc bundle (no {PLAN_FILE}); write one with `epcc compile FILE -o {path}`")
    plan = read_plan(path / PLAN_FILE)
    mf = path / MANIFEST_FILE
    try:
        manifest = read_manifest(mf) if mf.is_file() else {}
    except FileError as e:
        raise BundleError(str(e)) from None
    except ValueError as e:
        raise BundleError(f"{mf}: unreadable manifest ({e})") from None
    return Bundle(path, plan, manifest)


def cuda_manifest(path: str | Path, *, required: bool = True) -> dict:
    """The CUDA manifest of the bundle in directory `path` ({} where there is none and it is not
    `required`)."""
    path = Path(path)
    mf = path / CUDA_DIR / MANIFEST_FILE
    if not mf.is_file():
        if not required:
            return {}
        raise BundleError(f"{path}: no {CUDA_DIR}/{MANIFEST_FILE}; write the bundle with "
                          f"`epcc compile FILE --target cuda -o {path}`")
    try:
        d = read_manifest(mf)
        check_cuda_manifest(d)
    except FileError as e:
        raise BundleError(str(e)) from None
    except ValueError as e:
        raise BundleError(f"{mf}: not a manifest written by epcc ({e}); recompile the bundle") from None
    return d


def write_bundle(out: str | Path, plan: Plan, *, ir_name: str, ir_text: str, source: str, source_bytes: bytes,
                 stages: list[str], backends: dict[str, Callable[[Path], list[Path]]] | None = None
                 ) -> dict[str, list[Path]]:
    """Write the bundle of `plan` into directory `out`: the final IR (`ir_name`), plan.json, each
    backend's files (`backends`: subdirectory -> a writer of that directory, returning the paths it
    wrote), then manifest.json, which says what was compiled from which source (`source`, whose
    bytes are `source_bytes`) through which `stages`.  Returns the paths each backend wrote."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / ir_name).write_text(ir_text, encoding="utf-8")
    (out / PLAN_FILE).write_text(plan.to_json() + "\n", encoding="utf-8")
    manifest = {
        "epcc_version": __version__,
        "schedule": plan.schedule,
        "source": source,
        "source_sha256": hashlib.sha256(source_bytes).hexdigest(),
        "num_ranks": plan.num_ranks,
        "routing": plan.routing,
        "stages": list(stages),
        "files": {"ir": ir_name, "plan": PLAN_FILE},
    }
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return {sub: write(out / sub) for sub, write in (backends or {}).items()}
