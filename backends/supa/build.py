"""How a SUPA bundle is built: the brcc command lines (never run by epcc: no Biren machine) and the
shim's nvcc command (what the tests and the runtime's shim engine run), and the static files.

brcc, from docs/supa.md: `.su` files are SUPA sources; `--supa-gpu-arch=<arch>`; the SDK 1.x
build compiles each source (`-c`) and links with `--supa-link -shared` against `supa-runtime`
[S]; torch_supa's build adds `-use-mira=true` (the MIRA device path: %globaltimer and
supa::atomic_ref) and links `supart` [T].  The architecture of BR166 has no public name; `br100`
is what a BR106 (the die of a BR166M) was built with [S] (UNVERIFIED for BR166).
"""

from __future__ import annotations

from pathlib import Path

INCLUDE_DIR = Path(__file__).resolve().parent / "include"
PRELUDE = "epcc/prelude/supa.suh"
API_HEADER = "epcc_supa_api.h"
SHIM_HEADER = "epcc_supa_shim.cuh"
#: the static headers every SUPA bundle carries (relative to INCLUDE_DIR and to the bundle's supa/)
HEADERS = (PRELUDE, API_HEADER, SHIM_HEADER)

ARCH = "br100"  # --supa-gpu-arch (UNVERIFIED for BR166, see the module docstring)
BRCC_FLAGS = ["-std=c++17", "-O2", "-fPIC", f"--supa-gpu-arch={ARCH}", "-I."]
#: the two runtime generations: the macro epcc_supa_api.h selects by, the brcc flags, the runtime library
GENERATIONS = {
    "su": {"about": "BIRENSUPA SDK 1.x runtime (su*), clock64() timer at EPCC_SUPA_CLOCK_KHZ",
           "defines": ["-DEPCC_SUPA_API_V1", "-DEPCC_SUPA_CLOCK_KHZ=<the device's clock rate, kHz>"],
           "compile": [], "link": ["-lsupa-runtime"]},
    "supa": {"about": "the torch_supa-era runtime (supa*), brcc's MIRA device path",
             "defines": [], "compile": ["-use-mira=true"], "link": ["-lsupart"]},
}
#: the shim: every .su compiled by nvcc as CUDA, SUPA names mapped onto CUDA (EPCC_SUPA_SHIM)
SHIM_FLAGS = ["-x", "cu", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC",
              "-I.", "-DEPCC_SUPA_SHIM"]
SHIM_API_FLAGS = {"su": ["-DEPCC_SUPA_API_V1"], "supa": []}


def shim_library(library: str) -> str:
    return library[:-3] + "_shim.so" if library.endswith(".so") else library + "_shim"


def build_section(library: str, sources: list[str], headers: list[str], api: str = "supa") -> dict:
    """The manifest's "build": brcc steps per runtime generation (compile each source, then link),
    and the shim's one nvcc command (runtime API generation `api` under the shim)."""
    brcc = {}
    for gen, g in GENERATIONS.items():
        objs = [Path(s).stem + ".o" for s in sources]
        steps = [["brcc", *BRCC_FLAGS, *g["compile"], *g["defines"], "-c", s, "-o", o] for s, o in zip(sources, objs)]
        steps.append(["brcc", "--supa-link", "-shared", "-fPIC", f"--supa-gpu-arch={ARCH}", *g["compile"], "-o",
                      library, *objs, *g["link"]])
        brcc[gen] = {"about": g["about"], "steps": steps}
    shim = shim_library(library)
    return {
        "library": library, "sources": list(sources), "headers": list(headers), "arch": ARCH,
        "brcc": brcc,
        "shim": {"library": shim, "api": api,
                 "command": ["nvcc", *SHIM_FLAGS, *SHIM_API_FLAGS[api], "-shared", "-o", shim, *sources]},
    }


__all__ = ["API_HEADER", "ARCH", "GENERATIONS", "HEADERS", "INCLUDE_DIR", "PRELUDE", "SHIM_HEADER", "build_section",
           "shim_library"]
