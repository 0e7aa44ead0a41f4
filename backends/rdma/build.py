"""Compile the emitted proxy loop with a transport into a shared library (the CPU path).

Libraries are cached under build/rdma/<sha256 of sources and flags>/ (or $EPCC_RDMA_BUILD_DIR),
so a plan is compiled once.  The C compiler is $CC or cc.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

from .emit import proxy_file_name, proxy_source
from .sources import NATIVE_DIR

REPO_ROOT = Path(__file__).resolve().parents[2]

#: transport -> (sources, macro, link flags)
TRANSPORTS = {
    "libfabric": (("transport_libfabric.c",), "EPCC_TP_HAVE_LIBFABRIC", ("-lfabric",)),
    "ibverbs": (("transport_ibverbs.c",), "EPCC_TP_HAVE_IBVERBS", ("-libverbs",)),
}
CFLAGS = ("-std=c11", "-O2", "-fPIC", "-Wall", "-Wextra", "-Werror", "-pthread")

_lock = threading.Lock()


class BuildError(RuntimeError):
    """The proxy library could not be compiled (the message names the command and its output)."""


def _run(cmd: list[str], what: str) -> None:
    """Run a compiler or linker; a failure is a BuildError naming `what`, the command and its output."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"{what} failed ({' '.join(cmd)}):\n{r.stderr.strip()}")


def transport_sources(transport: str) -> tuple[list[Path], str, list[str]]:
    if transport not in TRANSPORTS:
        raise BuildError(f"transport '{transport}' is not one of {', '.join(sorted(TRANSPORTS))} (compiled by cc; "
                         f"'emulated' and 'nvshmem' are CUDA sources, built with nvcc)")
    srcs, macro, libs = TRANSPORTS[transport]
    return [NATIVE_DIR / s for s in srcs], macro, list(libs)


def build_dir() -> Path:
    return Path(os.environ.get("EPCC_RDMA_BUILD_DIR") or (REPO_ROOT / "build" / "rdma"))


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise BuildError("no C compiler: install gcc (Debian: apt-get install gcc) or set CC")
    return cc


def compile_command(sources: list[Path], out: Path, transport: str) -> list[str]:
    tsrcs, macro, libs = transport_sources(transport)
    return [compiler(), *CFLAGS, f"-D{macro}", f"-I{NATIVE_DIR}", "-shared", "-o", str(out), *map(str, sources),
            str(NATIVE_DIR / "epcc_transport.c"), str(NATIVE_DIR / "epcc_proxy_prim.c"), *map(str, tsrcs), *libs]


def _sources_key(src_dir: Path, suffixes: tuple[str, ...], transport: str, extra: bytes = b"") -> str:
    """Cache key of a build: `extra` (an emitted source), the sources of `src_dir` with these
    suffixes (names and bytes), the transport and the flags."""
    h = hashlib.sha256(extra)
    for p in sorted(src_dir.iterdir()):
        if p.suffix in suffixes:
            h.update(p.name.encode() + p.read_bytes())
    h.update(transport.encode() + " ".join(CFLAGS).encode())
    return h.hexdigest()[:16]


def build(plan, transport: str = "libfabric") -> Path:
    """The shared library of `plan`'s proxy loop linked with `transport`; compiled if needed."""
    text = proxy_source(plan)
    if not text:
        raise BuildError(f"schedule '{plan.schedule}' has no RDMA step: there is no proxy loop to build")
    tsrcs, _, _ = transport_sources(transport)
    d = build_dir() / _sources_key(NATIVE_DIR, (".c", ".h"), transport, text.encode())
    lib = d / f"libepcc_proxy_{transport}.so"
    with _lock:
        if lib.is_file():
            return lib
        d.mkdir(parents=True, exist_ok=True)
        src = d / proxy_file_name(plan)
        src.write_text(text, encoding="utf-8")
        tmp = d / f".{lib.name}.{os.getpid()}.tmp"
        cmd = compile_command([src], tmp, transport)
        _run(cmd, "compiling the proxy library")
        os.replace(tmp, lib)
        return lib


def build_transport(transport: str) -> Path:
    """A library of the transport alone (epcc_transport.h's functions), for probing."""
    tsrcs, _, _ = transport_sources(transport)
    d = build_dir() / f"transport-{_sources_key(NATIVE_DIR, ('.c', '.h'), transport)}"
    lib = d / f"libepcc_transport_{transport}.so"
    with _lock:
        if lib.is_file():
            return lib
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{lib.name}.{os.getpid()}.tmp"
        cmd = compile_command([], tmp, transport)
        _run(cmd, "compiling the transport library")
        os.replace(tmp, lib)
        return lib


#: CUDA transports of the GPU path: source, macro (built with nvcc, linked with the CUDA runtime)
GPU_TRANSPORTS = {"emulated": ("transport_emulated.cu", "EPCC_TP_HAVE_EMULATED"),
                  "nvshmem": ("transport_nvshmem.cu", "EPCC_TP_HAVE_NVSHMEM")}


def nvshmem_home() -> tuple[Path, Path]:
    """(include dir, host library) of NVSHMEM: $NVSHMEM_HOME, else the pip wheel nvidia-nvshmem-cu13
    (or -cu12) of this Python.  The GPU path uses NVSHMEM's host API only: no device library."""
    import importlib.util

    cands = []
    if os.environ.get("NVSHMEM_HOME"):
        cands.append(Path(os.environ["NVSHMEM_HOME"]))
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        cands += [Path(p) for p in (spec.submodule_search_locations or [])]
    for home in cands:
        libs = sorted((home / "lib").glob("libnvshmem_host.so*"))
        if (home / "include" / "nvshmem.h").is_file() and libs:
            return home / "include", libs[0]
    where = ", ".join(str(c) for c in cands) or "no NVSHMEM_HOME, no nvidia.nvshmem package"
    raise BuildError(f"NVSHMEM not found ({where}): pip install nvidia-nvshmem-cu13, or set NVSHMEM_HOME to a "
                     f"directory with include/nvshmem.h and lib/libnvshmem_host.so")


def build_gpu(rdma_dir: str | Path, transport: str = "emulated", nvcc: str | None = None) -> Path:
    """The GPU path's proxy library from a bundle's `cuda/rdma/` sources (the emitted loop and the
    static runtime, as `rdma.emit` wrote them; no compiler Python needed): C parts with cc, the
    transport with nvcc, linked by nvcc.  Cached in the build directory by the sources' hash.
    `nvshmem` links NVSHMEM's host library (nvshmem_home) and exports the epcc_nvshmem_*
    bootstrap beside the transport."""
    if transport not in GPU_TRANSPORTS:
        raise BuildError(f"transport '{transport}' is not one of the GPU path's: {', '.join(sorted(GPU_TRANSPORTS))}")
    d_src = Path(rdma_dir)
    loops = sorted(p for p in d_src.glob("*_proxy.c"))
    if len(loops) != 1:
        raise BuildError(f"{d_src}: expected one emitted '*_proxy.c', found {[p.name for p in loops]}")
    nvcc = nvcc or shutil.which("nvcc")
    if not nvcc:
        raise BuildError(f"nvcc is not on PATH: the GPU proxy ({transport} transport) is CUDA code")
    tsrc, macro = GPU_TRANSPORTS[transport]
    inc, link = [], []
    if transport == "nvshmem":
        include, host_lib = nvshmem_home()
        inc = [f"-I{include}"]
        link = [f"-L{host_lib.parent}", f"-l:{host_lib.name}", "-Xlinker", f"-rpath,{host_lib.parent}"]
    c_sources = [loops[0], d_src / "epcc_transport.c", d_src / "epcc_proxy_prim.c"]
    key = _sources_key(d_src, (".c", ".h", ".cu"), " ".join([transport, *inc, *link]))
    d = build_dir() / f"gpu-{key}"
    lib = d / f"libepcc_proxy_gpu_{transport}.so"
    with _lock:
        if lib.is_file():
            return lib
        d.mkdir(parents=True, exist_ok=True)
        objs = []
        od = d / f"obj-{os.getpid()}"  # ranks may build at once: own objects, one atomic rename
        od.mkdir(exist_ok=True)
        for src in c_sources:
            obj = od / (src.stem + ".o")
            cmd = [compiler(), *CFLAGS, f"-D{macro}", f"-I{d_src}", "-c", "-o", str(obj), str(src)]
            _run(cmd, f"compiling {src.name}")
            objs.append(obj)
        obj = od / "transport.o"
        cmd = [nvcc, "-O2", "-std=c++17", "-Xcompiler", "-fPIC", f"-D{macro}", f"-I{d_src}", *inc, "-c", "-o",
               str(obj), str(d_src / tsrc)]
        _run(cmd, f"compiling {tsrc}")
        objs.append(obj)
        tmp = d / f".{lib.name}.{os.getpid()}.tmp"
        # -z defs: a symbol the libraries named do not define fails here, not at load time on a GPU machine
        cmd = [nvcc, "-shared", "-o", str(tmp), *map(str, objs), *link, "-lcudart", "-Xlinker", "-z,defs"]
        _run(cmd, "linking the GPU proxy library")
        os.replace(tmp, lib)
        shutil.rmtree(od, ignore_errors=True)
        return lib
