"""The RDMA backend: a plan's RDMA steps as a proxy post loop in C (docs/rdma.md).

* emit.py writes the loop (templates/epcc_proxy.c.j2) and copies the static sources beside it;
  the decisions it lays out (which steps, row operations, chunk size and depth) are
  epcc/plan/rdma.py's;
* abi.py: the descriptor tables the loop and the host engines share;
* native/ (sources.py says where): epcc_transport.h (the transport interface), epcc_proxy.h
  (FIFO, tracker, waits) and the transports: libfabric (runs here over tcp), ibverbs (RC,
  write-with-imm), emulated (CUDA copy engine, paced), nvshmem (put-with-signal).

Compiling and running the loop is the runtime's (runtime/engines/rdma_host.py on the CPU path,
runtime/engines/gpu_proxy on the GPU path, runtime/build_cache.py for the libraries).
"""
