"""The one build cache: every library the runtime compiles (nvcc, cc) on the machine that runs it.

The direct kernels (engines/cuda_direct), the table-driven kernels' launcher (engines/cuda_table)
and the proxy loops and transports (engines/rdma_host.py, engines/gpu_proxy/build.py) are compiled on first use and kept
by content: an entry's key hashes everything that goes into the library (source texts, the
command, the compiler's version), so a changed source builds again and an unchanged one never
does.  Entries live in $EPCC_CACHE/<kind>/<key>/ (default ~/.cache/epcc); a library is written
under a name private to its builder and renamed into place, so concurrent ranks never load a
half-written file, and the threads of one process build one at a time.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Callable

_lock = threading.Lock()

#: the flags of every C part of a runtime library (the proxy loops, the transports)
CFLAGS = ("-std=c11", "-O2", "-fPIC", "-Wall", "-Wextra", "-Werror", "-pthread")


class BuildError(RuntimeError):
    """A library could not be compiled (the message names the command and its output)."""


def cache_root() -> Path:
    return Path(os.environ.get("EPCC_CACHE") or Path.home() / ".cache" / "epcc")


def find_nvcc(nvcc: str | None = None) -> str | None:
    """nvcc: the argument, $NVCC, PATH, then /usr/local/cuda*/bin."""
    for cand in (nvcc, os.environ.get("NVCC"), shutil.which("nvcc")):
        if cand and Path(cand).is_file():
            return str(cand)
    for d in sorted(Path("/usr/local").glob("cuda*/bin/nvcc"), reverse=True):
        if d.is_file():
            return str(d)
    return None


def c_compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise BuildError("no C compiler: install gcc (Debian: apt-get install gcc) or set CC")
    return cc


@functools.lru_cache(maxsize=None)
def compiler_version(exe: str) -> str:
    """What `exe --version` prints (part of every cache key: another compiler builds again)."""
    return subprocess.run([exe, "--version"], capture_output=True, text=True).stdout


def run(cmd: list[str], what: str, *, cwd: str | Path | None = None, log: list[str] | None = None) -> None:
    """Run a compiler or linker; its output is appended to `log`; a failure is a BuildError naming
    `what`, the command and the output."""
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if log is not None:
        log.append(r.stdout + r.stderr)
    if r.returncode != 0:
        raise BuildError(f"{what} failed ({' '.join(map(str, cmd))}):\n{(r.stdout + r.stderr).strip()}")


def sources(src_dir: Path, suffixes: tuple[str, ...]) -> list[bytes]:
    """The names and bytes of the sources in `src_dir` with these suffixes, for a cache key."""
    return [p.name.encode() + b"\0" + p.read_bytes() for p in sorted(src_dir.iterdir()) if p.suffix in suffixes]


def key(*parts: str | bytes) -> str:
    """A cache key from everything that goes into a library."""
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()[:24]


def cached(kind: str, entry_key: str, name: str, build: Callable[[Path, Path], None], *, fresh: bool = False) -> Path:
    """The library `name` of the entry `entry_key` under `kind`: from the cache, or built by
    `build(out, workdir)`, which writes the library to `out` (a name private to this builder, in
    the entry's directory) and may keep what else it writes in `workdir` (its own, removed after).
    `fresh`: build again even where the entry has the library."""
    d = cache_root() / kind / entry_key
    lib = d / name
    with _lock:
        if lib.is_file() and not fresh:
            return lib
        d.mkdir(parents=True, exist_ok=True)
        work = d / f".work-{os.getpid()}"
        work.mkdir(exist_ok=True)
        tmp = d / f".{name}.{os.getpid()}.tmp"
        try:
            build(tmp, work)
            os.replace(tmp, lib)
        finally:
            tmp.unlink(missing_ok=True)
            shutil.rmtree(work, ignore_errors=True)
        return lib
