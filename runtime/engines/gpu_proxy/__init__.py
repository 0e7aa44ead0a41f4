"""The GPU proxy path (`epcc compile --target cuda --rdma proxy`): the RDMA engine of one rank
and program beside the table-driven kernels.

* channels.py: what the two sides share, decided from the rank's uploaded tables before anything
  is allocated: channels, sequence numbers, landing and signal offsets, the FIFOs' layout, the
  kernels' RdmaChan descriptors;
* engine.py: GpuRdma: the memory (device, host-pinned, or NVSHMEM's symmetric heap), the
  transport, the proxy loop's tables and its thread.

The proxy library is built from the bundle's cuda/rdma/ sources (build.py).
"""
