"""The GPU proxy path's proxy library, built from the sources a bundle carries in cuda/rdma/ (the
emitted loop and the static runtime and transports, as backends/rdma/emit.py wrote them): no
compiler Python needed on the GPU machine.  C parts with cc, the transport (emulated, nvshmem) with
nvcc, linked by nvcc, through the build cache (runtime/build_cache.py).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ...build_cache import CFLAGS, BuildError, c_compiler, cached, compiler_version, find_nvcc, key, run, sources

#: CUDA transports of the GPU path: source, macro (built with nvcc, linked with the CUDA runtime)
GPU_TRANSPORTS = {"emulated": ("transport_emulated.cu", "EPCC_TP_HAVE_EMULATED"),
                  "nvshmem": ("transport_nvshmem.cu", "EPCC_TP_HAVE_NVSHMEM")}


def nvshmem_home() -> tuple[Path, Path]:
    """(include dir, host library) of NVSHMEM: $NVSHMEM_HOME, else the pip wheel nvidia-nvshmem-cu13
    (or -cu12) of this Python.  The GPU path uses NVSHMEM's host API only: no device library."""
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
    """The GPU path's proxy library from a bundle's `cuda/rdma/` sources: C parts with cc, the
    transport with nvcc, linked by nvcc.  `nvshmem` links NVSHMEM's host library (nvshmem_home) and exports the
    epcc_nvshmem_* bootstrap beside the transport."""
    if transport not in GPU_TRANSPORTS:
        raise BuildError(f"transport '{transport}' is not one of the GPU path's: {', '.join(sorted(GPU_TRANSPORTS))}")
    d_src = Path(rdma_dir)
    loops = sorted(p for p in d_src.glob("*_proxy.c"))
    if len(loops) != 1:
        raise BuildError(f"{d_src}: expected one emitted '*_proxy.c', found {[p.name for p in loops]}")
    nvcc = find_nvcc(nvcc)
    if not nvcc:
        raise BuildError(f"nvcc is not on PATH: the GPU proxy ({transport} transport) is CUDA code")
    tsrc, macro = GPU_TRANSPORTS[transport]
    inc, link = [], []
    if transport == "nvshmem":
        include, host_lib = nvshmem_home()
        inc = [f"-I{include}"]
        link = [f"-L{host_lib.parent}", f"-l:{host_lib.name}", "-Xlinker", f"-rpath,{host_lib.parent}"]
    c_sources = [loops[0], d_src / "epcc_transport.c", d_src / "epcc_proxy_prim.c"]
    cc = c_compiler()

    def build(out: Path, work: Path) -> None:
        objs = []
        for src in c_sources:
            obj = work / (src.stem + ".o")
            run([cc, *CFLAGS, f"-D{macro}", f"-I{d_src}", "-c", "-o", str(obj), str(src)], f"compiling {src.name}")
            objs.append(obj)
        obj = work / "transport.o"
        run([nvcc, "-O2", "-std=c++17", "-Xcompiler", "-fPIC", f"-D{macro}", f"-I{d_src}", *inc, "-c", "-o", str(obj),
             str(d_src / tsrc)], f"compiling {tsrc}")
        objs.append(obj)
        # -z defs: a symbol the libraries named do not define fails here, not at load time on a GPU machine
        run([nvcc, "-shared", "-o", str(out), *map(str, objs), *link, "-lcudart", "-Xlinker", "-z,defs"],
            "linking the GPU proxy library")

    entry = key(*sources(d_src, (".c", ".h", ".cu")), transport, *inc, *link, " ".join(CFLAGS),
                compiler_version(cc), compiler_version(nvcc))
    return cached("rdma", f"gpu-{entry}", f"libepcc_proxy_gpu_{transport}.so", build)
