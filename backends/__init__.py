"""epcc's code generators: a final plan as text (CUDA sources, LLVM IR, C), never run here.

* cuda/: table-driven persistent kernels and the direct one-hop kernels for sm_90a, with their
  host launcher and launch manifest (`epcc compile --target cuda`);
* cpu/: the plan's roles as LLVM IR, which the cpu engine JIT-compiles;
* rdma/: a plan's RDMA steps as a C proxy post loop, with the static transport sources.

A backend reads the plan (epcc.plan) and the compiler core, and writes files or strings; building,
loading and running what it wrote is the runtime's (runtime/engines, runtime/build_cache.py).
The runtime reads only a backend's static descriptions (cuda/abi.py, rdma/abi.py, rdma/sources.py)
and, for the CPU engines that generate code when they load a plan, cpu/codegen.py and rdma/emit.py.
"""
