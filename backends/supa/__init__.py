"""The SUPA target (Biren BR1xx): the table-driven kernels as `.su` sources for brcc, from the same
generator as CUDA (cuda/codegen.py with target.SUPA), and what only SUPA needs.

    epcc compile schedules/ubbv2_ep32.sched --target supa -o build/ubbv2_ep32

writes `build/ubbv2_ep32/supa/`: `epcc_supa_device.suh` (the generated device header),
`<schedule>_dispatch.su`, `<schedule>_combine.su` (the persistent kernels and the combine's bf16
conversion), `<schedule>_launcher.su` (the host API, the same C ABI as CUDA's under the prefix
`epcc_supa_`), `epcc_table_meta.su` (the metadata kernels' driver, where they cover the plan),
the static headers (include/: the device prelude `epcc/prelude/supa.suh`, the runtime API header
`epcc_supa_api.h`, the SUPA-on-CUDA shim `epcc_supa_shim.cuh`, `epcc/table/meta.cuh`),
manifest.json (format epcc-supa-manifest: the CUDA manifest's fields, the brcc commands of both
runtime generations, the shim's nvcc command) and, with RDMA steps, the proxy loop in `rdma/`.

* build.py: the brcc and nvcc command lines, the static files a bundle carries;
* names.py: the check that emitted SUPA code names the runtime and the device only through
  epcc's headers (no CUDA name in a `.su`), and that every SUPA name the headers use is one
  docs/supa.md surveys.

Nothing here has been compiled by brcc or run on Biren hardware: the shim (include/
epcc_supa_shim.cuh) maps SUPA's built-ins and both runtime generations onto CUDA, so nvcc compiles
every emitted file and the runtime runs them on NVIDIA GPUs (EPCC_SUPA_SHIM=1,
runtime/engines/supa_shim).  docs/supa.md says what is verified and what is not.
"""
