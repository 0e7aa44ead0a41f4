"""Compile every library a bundle's engines build on first use, ahead of the job, in parallel.

    python -m epcc.runtime.prebuild BUNDLE [BUNDLE...] [--jobs N] [--transports emulated,nvshmem]

A `Buffer` compiles its bundle's libraries with nvcc the first time it meets them (rank 0 builds,
the other ranks wait; runtime/build_cache.py keeps them by content).  With many bundles that first
use costs minutes of nvcc, one library at a time, inside whatever bound the job set for its
first call.  This fills the same cache beforehand, one process per library: the table-driven
library (its launcher, kernels and metadata kernels), the direct kernels where the bundle has
them, the GPU proxy path's library per transport for `--rdma proxy` bundles, and the SUPA-on-CUDA
shim's library for `--target supa` bundles.  A later `Buffer` of the same bundle, nvcc and
machine finds them built.  Needs nvcc, not torch and not a GPU.

Exit status: 0 when every library built (or was in the cache), 1 otherwise, each failure named
with its bundle and nvcc's message.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from ..plan.bundle import MANIFEST_FILE, read_manifest, supa_manifest
from .engines.cuda_direct.library import build as build_direct
from .engines.cuda_table.launcher import build_library, build_shim_library
from .engines.gpu_proxy.build import build_gpu

TRANSPORTS = ("emulated", "nvshmem")


def tasks(bundle: Path, transports: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(kind, source folder, transport) of every library `bundle`'s engines build; ValueError
    saying why when it has neither a cuda/ nor a supa/ manifest or its manifest is not one."""
    out = []
    cuda, supa = bundle / "cuda", bundle / "supa"
    if (cuda / MANIFEST_FILE).is_file():
        manifest = read_manifest(cuda / MANIFEST_FILE)
        if manifest.get("build"):
            out.append(("table", str(cuda), ""))
        if manifest.get("direct"):
            out.append(("direct", str(cuda), ""))
        options = manifest.get("options")
        if isinstance(options, dict) and options.get("rdma") == "proxy":
            out += [("proxy", str(cuda / "rdma"), t) for t in transports]
    if (supa / MANIFEST_FILE).is_file():
        out.append(("supa-shim", str(supa), ""))
    if not out:
        raise ValueError(f"no cuda/{MANIFEST_FILE} or supa/{MANIFEST_FILE} (not a bundle of "
                         f"`epcc compile --target cuda|supa`)")
    return out


def build_one(kind: str, src: str, transport: str) -> float:
    """Build one library (in a worker process); its seconds."""
    t0 = time.monotonic()
    if kind == "table":
        build_library(src)
    elif kind == "direct":
        build_direct(src, read_manifest(Path(src) / MANIFEST_FILE))
    elif kind == "proxy":
        build_gpu(src, transport)
    else:
        build_shim_library(src, supa_manifest(Path(src).parent))
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m epcc.runtime.prebuild", description=__doc__.split("\n\n")[0])
    ap.add_argument("bundles", nargs="+", type=Path, help="bundle directories (epcc compile -o)")
    ap.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 1, help="libraries built at once")
    ap.add_argument("--transports", default="emulated",
                    help=f"the GPU proxy path's transports to build for --rdma proxy bundles ({','.join(TRANSPORTS)})")
    args = ap.parse_args(argv)
    transports = tuple(t.strip() for t in args.transports.split(",") if t.strip())
    bad = [t for t in transports if t not in TRANSPORTS]
    if bad or not transports:
        what = (f"unknown transport{'s' if len(bad) > 1 else ''} {', '.join(repr(t) for t in bad)}" if bad
                else "no transport given")
        print(f"prebuild: error: --transports: {what} (choose from {', '.join(TRANSPORTS)})", file=sys.stderr)
        return 1
    if args.jobs < 1:
        print(f"prebuild: error: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 1
    todo = []
    for b in args.bundles:
        try:
            todo += [(b, t) for t in tasks(b, transports)]
        except (ValueError, OSError) as e:  # a manifest that is no JSON object: a ValueError
            print(f"prebuild: error: {b}: {e}", file=sys.stderr)
            return 1
    failed = 0
    t0 = time.monotonic()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        running = {pool.submit(build_one, *t): (b, t) for b, t in todo}
        for f in as_completed(running):
            b, (kind, _, transport) = running[f]
            what = f"{b.name}: {kind}{' ' + transport if transport else ''}"
            try:
                print(f"prebuild: {what}: {f.result():.1f} s", flush=True)
            except Exception as e:  # noqa: BLE001 -- every failure is reported, the others still build
                failed += 1
                print(f"prebuild: {what}: FAILED: {e}", file=sys.stderr, flush=True)
    print(f"prebuild: {len(todo) - failed} of {len(todo)} libraries built or found in the cache "
          f"in {time.monotonic() - t0:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
