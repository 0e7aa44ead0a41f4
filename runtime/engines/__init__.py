"""The engines: what runs each shape of compiled plan (base.py defines how they are driven).

* cpu/: the plan's roles as LLVM-JIT-compiled drivers (backends/cpu writes the IR), one thread per
  (rank, role) over NumPy buffers (threads.py), and the Buffer engine over peer memory (engine.py);
* cpu_procs.py: the same drivers in one process per rank, RDMA steps over a real transport;
* rdma_host.py: the emitted proxy loop on the CPU path, its library built through
  runtime/build_cache.py (transport.py: the transport library, for both proxy paths);
* cuda_direct/: the direct one-hop kernels (library.py: build, load, launch; engine.py: Buffer's);
* cuda_table/: the table-driven kernels (launcher.py: the host launcher; tables.py: the blobs);
* gpu_proxy/: the GPU proxy path's RDMA engine (channels.py decides, engine.py allocates and runs,
  build.py builds its library from the bundle's sources).

An engine module imports only the compiler's plan, the backends' static descriptions (abi.py,
sources.py) and, for the CPU engines that generate code at load time, backends/cpu/codegen.py and
backends/rdma/emit.py; never the CUDA code generator (a GPU machine has neither jinja2 nor MLIR:
it reads the bundle).
"""
