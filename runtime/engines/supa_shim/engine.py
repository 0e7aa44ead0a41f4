"""`Buffer(backend="supa")` with EPCC_SUPA_SHIM=1: a bundle's SUPA sources (supa/, backends/supa)
built by nvcc through the SUPA-on-CUDA shim (the manifest's build.shim command) and run on this
rank's NVIDIA GPU by the table engine (cuda_table/engine.py), which this class only points at the
SUPA bundle: its manifest, its sources, its library's C prefix (`epcc_supa_`), and the metadata
exchange's error words in device memory (SUPA kernels may not write host memory).

What this runs is the SUPA code path itself: the kernels' prelude names (supa.suh), the launcher
through epcc_supa_api.h (the supa* runtime names, or su* for a manifest whose shim api is "su"),
the error record read back from device memory, the plain launch with the grid checked against the
device's compute units.  It verifies the generated SUPA sources' logic on NVIDIA hardware; brcc and
Biren hardware are not involved (docs/supa.md).
"""

from __future__ import annotations

from ....plan.bundle import Bundle, supa_manifest
from ..cuda_table.engine import CudaTableEngine
from ..cuda_table.launcher import build_shim_library


class SupaShimEngine(CudaTableEngine):
    BACKEND = "supa"
    ABI_PREFIX = "epcc_supa"
    ERROR_ON_DEVICE = True

    def _manifest(self, bundle: Bundle) -> dict:
        return supa_manifest(bundle.path)

    def _sources(self, bundle: Bundle):
        return bundle.supa_dir

    def _build_library(self, src_dir, manifest: dict):
        return build_shim_library(src_dir, manifest)


__all__ = ["SupaShimEngine"]
