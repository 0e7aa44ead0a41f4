"""epcc: a compiler for the communication schedules of Mixture-of-Experts expert parallelism.

A `.sched` file describes a topology (levels, relations, links), a workload, and the per-step
transfers of dispatch and combine.  epcc checks it (frontend, sema), lowers it to the `epcc`
MLIR dialect (ir), runs its passes, and emits kernels and RDMA post loops (backends).
"""

__version__ = "0.1.0"
