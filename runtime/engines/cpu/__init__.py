"""The cpu engine: the plan's roles, JIT-compiled from backends/cpu's LLVM IR, as CPU threads.

* jit.py: the module compiled with LLVM's MCJIT, cached by the plan's JSON;
* threads.py: one thread per (rank, role) over NumPy buffers (`epcc run --backend cpu`, the
  Runner protocol), or over a rank's peer memory (`execute`);
* engine.py: `Buffer(..., backend="cpu")`: one process per rank, buffers in named shared memory
  (runtime/shm.py), the routing all-gathered over torch.distributed.
"""
