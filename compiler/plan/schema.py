"""The versioned formats of a bundle's JSON files, and a small checker of JSON values against a schema.

Every JSON file epcc writes into a bundle opens with its format and version:

    plan.json            {"format": "epcc-plan", "version": 1, ...}           (plan/check.py checks the rest)
    manifest.json        {"format": "epcc-bundle", "version": 1, ...}         (plan/bundle.py)
    cuda/manifest.json   {"format": "epcc-cuda-manifest", "version": 1, ...}  (plan/cuda_manifest.py)
    supa/manifest.json   {"format": "epcc-supa-manifest", "version": 1, ...}  (plan/cuda_manifest.py, SUPA_SCHEMA)

A reader checks the format and version first (:func:`check_format`): a file of a newer or older
version is refused as such (FormatVersionError: recompile), before any field is read.  A version
changes whenever a reader of the old version would misread the new files.

The schema of a file is built from the specs below (Int, Num, Str, Name, RelPath, Bool, List,
Obj, Map, Nullable, OneOf); `spec.check(value, path)` raises SchemaError naming the field
(`kernels[0].roles[3].blocks[1]: expected ..., got ...`).  Objects ignore fields their schema does
not name (a reader reads only what it names); plan.json is stricter (plan/check.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

MAX_INT = 1 << 53  # what a double holds exactly: every count and size epcc writes
MAX_FLOAT = 1e30  # bytes, bytes/s and seconds beyond this are not a machine's
MAX_TEXT = 4096  # characters in one string
MAX_ITEMS = 1 << 20  # entries of one list or object, unless its spec says fewer


@dataclass(frozen=True)
class Format:
    name: str
    version: int
    file: str  # how messages name the file


PLAN_FORMAT = Format("epcc-plan", 1, "plan.json")
BUNDLE_FORMAT = Format("epcc-bundle", 1, "manifest.json")
CUDA_FORMAT = Format("epcc-cuda-manifest", 1, "cuda/manifest.json")
SUPA_FORMAT = Format("epcc-supa-manifest", 1, "supa/manifest.json")


class SchemaError(ValueError):
    """A JSON value does not have the shape epcc writes; the message names the field."""


class FormatVersionError(SchemaError):
    """A file of another version of its format: written by a newer or an older epcc."""


def show(v: Any) -> str:
    """A value as a message shows it: short, and never the whole of a long string or number."""
    if isinstance(v, str):
        return "a string" if len(v) > 40 else f"the string {v!r}"
    if isinstance(v, bool):
        return f"{str(v).lower()}"
    if isinstance(v, (int, float)):
        text = repr(v)
        return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} digits)"
    if v is None:
        return "null"
    return "a list" if isinstance(v, list) else "an object" if isinstance(v, dict) else type(v).__name__


def fail(path: str, what: str, v: Any) -> SchemaError:
    return SchemaError(f"{path or 'the top level'}: expected {what}, got {show(v)}")


def check_format(d: Any, fmt: Format) -> None:
    """`d` (a parsed JSON file) is an object of format `fmt` at its version; SchemaError (not
    such a file) or FormatVersionError (another version) otherwise."""
    if not isinstance(d, dict):
        raise fail("", "an object", d)
    if "format" not in d:
        raise SchemaError(f"format: missing (a {fmt.file} of an older epcc has none: recompile)")
    if d["format"] != fmt.name:
        raise fail("format", repr(fmt.name), d["format"])
    if "version" not in d:
        raise SchemaError(f"version: missing (a {fmt.file} of an older epcc has none: recompile)")
    v = d["version"]
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_INT:
        raise fail("version", "a whole number", v)
    if v != fmt.version:
        which = "a newer" if v > fmt.version else "an older"
        raise FormatVersionError(f"compiled by {which} epcc ({fmt.file} version {v}, this epcc reads version "
                                 f"{fmt.version}): recompile it with this epcc")


class Spec:
    def check(self, v: Any, path: str) -> None:  # pragma: no cover - every spec overrides it
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Spec):
    lo: int = -MAX_INT
    hi: int = MAX_INT

    def check(self, v, path):
        if isinstance(v, bool) or not isinstance(v, int):
            raise fail(path, "a whole number", v)
        if not self.lo <= v <= self.hi:
            raise SchemaError(f"{path}: {show(v)} is out of range (expected {self.lo}..{self.hi})")


@dataclass(frozen=True)
class Num(Spec):
    lo: float = -MAX_FLOAT
    hi: float = MAX_FLOAT

    def check(self, v, path):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise fail(path, "a number", v)
        if not (math.isfinite(v) and self.lo <= v <= self.hi):
            raise SchemaError(f"{path}: {show(v)} is out of range (expected {self.lo:g}..{self.hi:g})")


@dataclass(frozen=True)
class Str(Spec):
    choices: tuple[str, ...] = ()
    pattern: str = ""  # a regular expression the whole string matches
    what: str = "a string"

    def check(self, v, path):
        if not isinstance(v, str):
            raise fail(path, self.what, v)
        if len(v) > MAX_TEXT:
            raise SchemaError(f"{path}: a string of {len(v)} characters (at most {MAX_TEXT})")
        if self.choices and v not in self.choices:
            raise SchemaError(f"{path}: {show(v)} is not one of {', '.join(self.choices)}")
        if self.pattern and not re.fullmatch(self.pattern, v):
            raise fail(path, self.what, v)


_NAME = r"(?!\.\.?(?:/|$))[A-Za-z0-9_.+-]{1,255}"
#: A file name inside a bundle directory: no separator, not `.` or `..`.
Name = Str(pattern=_NAME, what="a file name (letters, digits, _ . + -)")
#: A path relative to a bundle directory: file names joined by `/`.
RelPath = Str(pattern=f"{_NAME}(/{_NAME}){{0,7}}", what="a relative path inside the bundle")
Hex64 = Str(pattern="[0-9a-f]{64}", what="64 hexadecimal digits (a sha256)")


@dataclass(frozen=True)
class Bool(Spec):
    def check(self, v, path):
        if not isinstance(v, bool):
            raise fail(path, "true or false", v)


@dataclass(frozen=True)
class Nullable(Spec):
    inner: Spec

    def check(self, v, path):
        if v is not None:
            self.inner.check(v, path)


@dataclass(frozen=True)
class OneOf(Spec):
    """The first of `specs` whose type fits `v` decides (Int and Str, say)."""
    specs: tuple[Spec, ...]
    what: str

    def check(self, v, path):
        last = None
        try:
            for s in self.specs:
                try:
                    s.check(v, path)
                    return
                except SchemaError as e:
                    last = e
                    if not str(e).startswith(f"{path}: expected"):
                        raise  # the type fitted, the value did not
            raise fail(path, self.what, v) from last
        finally:  # an error kept in this frame, whose traceback holds the frame, is a reference cycle
            del last  # that keeps the callers' frames (a Buffer being made, say) until the collector runs


@dataclass(frozen=True)
class List(Spec):
    item: Spec
    lo: int = 0
    hi: int = MAX_ITEMS

    def check(self, v, path):
        if not isinstance(v, list):
            raise fail(path, "a list", v)
        if not self.lo <= len(v) <= self.hi:
            raise SchemaError(f"{path}: {len(v)} entries (expected {self.lo}..{self.hi})")
        for i, x in enumerate(v):
            self.item.check(x, f"{path}[{i}]")


@dataclass(frozen=True)
class Map(Spec):
    """An object with any keys (matching `key`) and values of one spec."""
    value: Spec
    key: Str = Str()
    hi: int = MAX_ITEMS

    def check(self, v, path):
        if not isinstance(v, dict):
            raise fail(path, "an object", v)
        if len(v) > self.hi:
            raise SchemaError(f"{path}: {len(v)} entries (at most {self.hi})")
        for k, x in v.items():
            self.key.check(k, f"{path} key")
            self.value.check(x, f"{path}.{k}")


@dataclass(frozen=True)
class Obj(Spec):
    """An object with these fields (each required unless listed in `optional`)."""
    fields: dict
    optional: frozenset = frozenset()

    def check(self, v, path):
        if not isinstance(v, dict):
            raise fail(path, "an object", v)
        for name, spec in self.fields.items():
            sub = f"{path}.{name}" if path else name
            if name not in v:
                if name in self.optional:
                    continue
                raise SchemaError(f"{sub}: missing")
            spec.check(v[name], sub)


__all__ = ["BUNDLE_FORMAT", "Bool", "CUDA_FORMAT", "Format", "FormatVersionError", "Hex64", "Int", "List", "Map",
           "Name", "Nullable", "Num", "Obj", "OneOf", "PLAN_FORMAT", "RelPath", "SchemaError", "Str", "check_format",
           "fail", "show"]
