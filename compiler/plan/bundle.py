"""The one writer and the one loader of a compiled bundle: the directory `epcc compile -o DIR` writes.

    DIR/NAME.mlir              the final IR
    DIR/plan.json              the plan (model.py), all a runtime reads of the compiler
    DIR/cuda/...               with --target cuda: the generated kernels and their manifest.json
    DIR/supa/...               with --target supa: the same kernels as SUPA sources, their manifest.json
    DIR/manifest.json          what was compiled from which source, and the sha256 of every file above

`write_bundle` (`epcc compile`) writes the files, then manifest.json.  Each JSON file carries its
format and version (plan/schema.py).  `load(DIR)` reads manifest.json, checks that every file it
lists is there with the content it records (the sha256), then checks plan.json field by field
(plan/check.py) and against the invariants the compiler proved (plan/invariants.py);
`cuda_manifest(DIR)` does the same for cuda/manifest.json (plan/cuda_manifest.py), `supa_manifest(DIR)`
for supa/manifest.json.  Every problem
is a BundleError whose message names the file, and the field, and says what to do.  Used by
epcc.runtime.Buffer, `epcc tune`, `epcc run FILE.json` (read_plan: a plan file named by itself is
checked field by field, without a manifest), bench/ep_bench.py and the tests.

The hashes catch a bundle changed after it was compiled (an edit, a partial copy, a file left
from another compilation); they are not a signature: whoever may write the directory may
rewrite manifest.json too, which is why the contents are checked as well.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .. import __version__
from ..files import JSON_MAX_BYTES, ContentError, FileError, read_bytes, read_json
from ..limits import MAX_RANKS
from .check import PlanJsonError, check_plan_json
from .cuda_manifest import check_cuda_manifest, check_supa_manifest
from .model import Plan
from .schema import (BUNDLE_FORMAT, CUDA_FORMAT, PLAN_FORMAT, SUPA_FORMAT, FormatVersionError, Hex64, Int, List, Map, Name, Obj,
                     RelPath, Str, check_format)

PLAN_FILE = "plan.json"
MANIFEST_FILE = "manifest.json"
CUDA_DIR = "cuda"
CUDA_MANIFEST = f"{CUDA_DIR}/{MANIFEST_FILE}"
SUPA_DIR = "supa"
SUPA_MANIFEST = f"{SUPA_DIR}/{MANIFEST_FILE}"
MAX_FILES = 4096  # files one bundle lists

# manifest.json: what a loader reads of it (fields it does not name are ignored).
MANIFEST_SCHEMA = Obj({
    "epcc_version": Str(), "schedule": Str(), "source": Str(), "source_sha256": Hex64,
    "num_ranks": Int(1, MAX_RANKS), "routing": Str(), "stages": List(Str()),
    "files": Obj({"ir": Name, "plan": Str(choices=(PLAN_FILE,))}),
    "sha256": Map(Hex64, key=RelPath, hi=MAX_FILES),
    "backend": Str(choices=("cpu", "cuda")),
}, optional=frozenset({"backend"}))


class BundleError(ValueError):
    """The bundle cannot be used (missing, unreadable, changed, or compiled for something else)."""


@dataclass(frozen=True)
class Bundle:
    path: Path
    plan: Plan
    manifest: dict  # DIR/manifest.json

    @property
    def cuda_dir(self) -> Path:
        return self.path / CUDA_DIR

    @property
    def supa_dir(self) -> Path:
        return self.path / SUPA_DIR


def _exists(p: Path) -> bool:
    return os.path.lexists(p)  # a FIFO or a dangling link is there, and refused by the reader


# --------------------------------------------------------------------------- write


def plan_text(plan: Plan) -> str:
    """plan.json's text: the plan's fields with its format and version."""
    d = {**plan.to_dict(), "format": PLAN_FORMAT.name, "version": PLAN_FORMAT.version}
    return json.dumps(d, indent=1, sort_keys=True) + "\n"


def write_bundle(out: str | Path, plan: Plan, *, ir_name: str, ir_text: str, source: str, source_bytes: bytes,
                 stages: list[str], backends: dict[str, Callable[[Path], list[Path]]] | None = None
                 ) -> dict[str, list[Path]]:
    """Write the bundle of `plan` into directory `out`: the final IR (`ir_name`), plan.json, each
    backend's files (`backends`: subdirectory -> a writer of that directory, returning the paths it
    wrote), then manifest.json: what was compiled from which source (`source`, whose bytes are
    `source_bytes`) through which `stages`, and the sha256 of every file written.  Returns the
    paths each backend wrote."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / ir_name).write_text(ir_text, encoding="utf-8")
    (out / PLAN_FILE).write_text(plan_text(plan), encoding="utf-8")
    written = {sub: write(out / sub) for sub, write in (backends or {}).items()}
    files = [out / ir_name, out / PLAN_FILE] + [p for paths in written.values() for p in paths]
    manifest = {
        "format": BUNDLE_FORMAT.name,
        "version": BUNDLE_FORMAT.version,
        "epcc_version": __version__,
        "schedule": plan.schedule,
        "source": source,
        "source_sha256": hashlib.sha256(source_bytes).hexdigest(),
        "num_ranks": plan.num_ranks,
        "routing": plan.routing,
        "stages": list(stages),
        "files": {"ir": ir_name, "plan": PLAN_FILE},
        "sha256": {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(files)},
    }
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return written


# --------------------------------------------------------------------------- read


def read_plan(path: str | Path) -> Plan:
    """The plan in the file `path` (a bundle's plan.json), with its workload: read as every input
    is (a regular file of bounded size, JSON of bounded depth), its format version checked, and
    checked field by field before it is built (plan/check.py); a BundleError naming the file and
    the field otherwise."""
    path = Path(path)
    try:
        d = read_json(path, "a plan.json", JSON_MAX_BYTES)
    except ContentError as e:
        raise BundleError(f"{path}: not a plan written by 'epcc compile': {e.reason}") from None
    except FileError as e:
        raise BundleError(str(e)) from None
    try:
        d = check_plan_json(d)
    except FormatVersionError as e:
        raise BundleError(f"{path}: {e}") from None
    except PlanJsonError as e:
        raise BundleError(f"{path}: not a plan written by 'epcc compile': {e}") from None
    plan = Plan.from_dict(d)
    if plan.workload is None:
        raise BundleError(f"{path}: the plan has no workload (written by an older epcc? recompile the schedule)")
    return plan


def read_manifest(path: str | Path, what: str = "a bundle manifest") -> dict:
    """The JSON object in the manifest file `path` (read as every input is); ValueError saying
    why when it is not one (FileError where the file cannot be read)."""
    try:
        d = read_json(path, what, JSON_MAX_BYTES)
    except ContentError as e:
        raise ValueError(e.reason) from None
    if not isinstance(d, dict):
        raise ValueError("the top level is not a JSON object")
    return d


def _read_checked(path: Path, what: str, fmt, check: Callable[[dict], Any]) -> dict:
    """A bundle's JSON file: read, its format version checked, then its fields (`check`)."""
    try:
        d = read_manifest(path, what)
        check_format(d, fmt)
        check(d)
    except FileError as e:
        raise BundleError(str(e)) from None
    except FormatVersionError as e:
        raise BundleError(f"{path}: {e}") from None
    except ValueError as e:  # SchemaError, or not a JSON object
        raise BundleError(f"{path}: not a manifest written by epcc ({e}); recompile the bundle") from None
    return d


def _verified_manifest(path: Path) -> dict:
    """manifest.json of the bundle in `path`, after checking that every file it lists holds what
    it records (and that plan.json is among them)."""
    mf = path / MANIFEST_FILE
    if not _exists(mf):
        raise BundleError(f"{path}: not an epcc bundle (no {MANIFEST_FILE}); write one with "
                          f"`epcc compile FILE -o {path}`")
    manifest = _read_checked(mf, "a bundle manifest", BUNDLE_FORMAT, lambda d: MANIFEST_SCHEMA.check(d, ""))
    hashes = manifest["sha256"]
    if PLAN_FILE not in hashes:
        raise BundleError(f"{mf}: not a manifest written by epcc (sha256: no entry for {PLAN_FILE}); recompile the "
                          f"bundle")
    for rel, want in sorted(hashes.items()):
        f = path / rel
        if not _exists(f):
            raise BundleError(f"{path}: {rel} is missing (manifest.json lists it); recompile the bundle")
        what = {PLAN_FILE: "a plan.json", CUDA_MANIFEST: "a CUDA bundle manifest"}.get(rel, "a file of an epcc bundle")
        try:
            got = hashlib.sha256(read_bytes(f, what, JSON_MAX_BYTES)).hexdigest()
        except FileError as e:
            raise BundleError(str(e)) from None
        if got != want:
            raise BundleError(f"{path}: {rel} is not the file 'epcc compile' wrote (its sha256 differs from the one "
                              f"manifest.json records): the bundle was changed after it was compiled; recompile it")
    return manifest


def load(path: str | Path) -> Bundle:
    """The bundle in directory `path`: its files verified against manifest.json, its plan checked."""
    path = Path(path)
    if not _exists(path / PLAN_FILE):
        raise BundleError(f"{path}: not an epcc bundle (no {PLAN_FILE}); write one with `epcc compile FILE -o {path}`")
    manifest = _verified_manifest(path)
    plan = read_plan(path / PLAN_FILE)
    for field, got in (("num_ranks", plan.num_ranks), ("schedule", plan.schedule)):
        if manifest[field] != got:
            raise BundleError(f"{path}: {PLAN_FILE} says {field} {got!r}, {MANIFEST_FILE} {manifest[field]!r}: "
                              f"files of different compilations; recompile the bundle")
    return Bundle(path, plan, manifest)


def cuda_manifest(path: str | Path, *, required: bool = True) -> dict:
    """The CUDA manifest of the bundle in directory `path` ({} where there is none and it is not
    `required`), after the bundle's files are verified against its manifest.json."""
    return _target_manifest(path, CUDA_DIR, "CUDA", CUDA_FORMAT, check_cuda_manifest, required)


def supa_manifest(path: str | Path, *, required: bool = True) -> dict:
    """The SUPA manifest (supa/manifest.json) of the bundle in directory `path`, as cuda_manifest."""
    return _target_manifest(path, SUPA_DIR, "SUPA", SUPA_FORMAT, check_supa_manifest, required)


def _target_manifest(path: str | Path, sub: str, what: str, fmt, check: Callable[[dict], Any],
                     required: bool) -> dict:
    path = Path(path)
    rel = f"{sub}/{MANIFEST_FILE}"
    mf = path / rel
    if not _exists(mf):
        if not required:
            return {}
        raise BundleError(f"{path}: no {rel}; write the bundle with "
                          f"`epcc compile FILE --target {sub} -o {path}`")
    manifest = _verified_manifest(path)
    if rel not in manifest["sha256"]:
        raise BundleError(f"{path}: {rel} is not part of the bundle (manifest.json has no sha256 of it: "
                          f"left from an earlier compilation?); recompile with `epcc compile FILE --target {sub} "
                          f"-o {path}`")
    d = _read_checked(mf, f"a {what} bundle manifest", fmt, check)
    for field in ("num_ranks", "schedule"):
        if d[field] != manifest[field]:
            raise BundleError(f"{path}: {rel} says {field} {d[field]!r}, {MANIFEST_FILE} "
                              f"{manifest[field]!r}: files of different compilations; recompile the bundle")
    return d


__all__ = ["Bundle", "BundleError", "CUDA_DIR", "MANIFEST_FILE", "PLAN_FILE", "SUPA_DIR", "cuda_manifest", "load",
           "plan_text", "read_manifest", "read_plan", "supa_manifest", "write_bundle"]
