"""Editing a compiled bundle in tests: a JSON file changed in place, and the sha256 in the bundle's
manifest.json recomputed as `epcc compile` would (so that the loader gets past the hashes to the
checks of the contents)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def rehash(bundle: Path) -> None:
    mf = bundle / "manifest.json"
    m = json.loads(mf.read_text(encoding="utf-8"))
    m["sha256"] = {rel: hashlib.sha256((bundle / rel).read_bytes()).hexdigest() for rel in m["sha256"]
                   if (bundle / rel).is_file()}
    mf.write_text(json.dumps(m, indent=2) + "\n", encoding="utf-8")


def edit_json(path: Path, edit, *, bundle: Path | None = None) -> None:
    """Apply `edit` (a function of the parsed JSON, returning the new value) to the file `path`;
    with `bundle`, rehash that bundle afterwards."""
    path.write_text(json.dumps(edit(json.loads(path.read_text(encoding="utf-8")))), encoding="utf-8")
    if bundle is not None:
        rehash(bundle)
