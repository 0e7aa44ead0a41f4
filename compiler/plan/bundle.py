"""The one loader of a compiled bundle: the directory `epcc compile -o DIR` writes.

    DIR/plan.json              the plan (model.py), all a runtime reads of the compiler
    DIR/manifest.json          what was compiled from which source (optional for a runtime)
    DIR/cuda/manifest.json     with --target cuda: the generated kernels, launch shapes, buffers

`load(DIR)` checks the plan and the top-level manifest, `cuda_manifest(DIR)` the CUDA one; every
problem is a BundleError whose message names the file and says what to do.  Used by
epcc.runtime.Buffer, `epcc tune`, `epcc run FILE.json`, bench/ep_bench.py and the tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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
    """The plan in the file `path` (a bundle's plan.json), with its workload."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BundleError(f"{path}: no such file") from None
    except OSError as e:
        raise BundleError(f"{path}: cannot read it: {e.strerror or e}") from None
    try:
        plan = Plan.from_json(text)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise BundleError(f"{path}: not a plan written by 'epcc compile' ({type(e).__name__}: {e})") from None
    if plan.workload is None:
        raise BundleError(f"{path}: the plan has no workload (written by an older epcc? recompile the schedule)")
    return plan


def read_manifest(path: str | Path) -> dict:
    """The JSON object in the manifest file `path`; ValueError (its reason) when it is not one."""
    d = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(d, dict):
        raise ValueError("a JSON object expected")
    return d


def load(path: str | Path) -> Bundle:
    """The bundle in directory `path`: its plan and its top-level manifest."""
    path = Path(path)
    if not (path / PLAN_FILE).is_file():
        raise BundleError(f"{path}: not an epcc bundle (no {PLAN_FILE}); write one with `epcc compile FILE -o {path}`")
    plan = read_plan(path / PLAN_FILE)
    mf = path / MANIFEST_FILE
    try:
        manifest = read_manifest(mf) if mf.is_file() else {}
    except (ValueError, UnicodeDecodeError) as e:
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
        return read_manifest(mf)
    except (ValueError, UnicodeDecodeError) as e:
        raise BundleError(f"{mf}: not a manifest written by epcc ({e}); recompile the bundle") from None
