"""The CPU backend: a plan's kernels as LLVM IR (codegen.py), every role one driver function.

    from epcc.backends.cpu import codegen
    text = codegen.llvm_ir(plan)                         # the module, verified

The final plan (after kernel formation) becomes one LLVM module with a driver per (program,
role) of `Plan.kernels` (kernels, proxy loops and DMA queues alike), plus the flag primitives of
runtime/native/epcc_sync.c (acquire/release counters, bounded waits on CLOCK_MONOTONIC) and the
row operations (row copy, weighted bf16 -> fp32 accumulate, fp32 accumulate, the accumulates
atomic).  Running it is the runtime's: runtime/engines/cpu (JIT-compiled, one thread per
(rank, role) over NumPy buffers; `epcc run --backend cpu`) and runtime/engines/cpu_procs.py (one
process per rank, the RDMA steps through the emitted proxy loop over libfabric's tcp provider).

What the CPU engine does not model:

* time: no link bandwidth, latency or contention; copies run at memory speed, so it checks
  what moves where and in which order it may move, not how fast a schedule is (that is
  `epcc simulate`);
* SMs and warps: a role is one thread, not `sm_end - sm_begin` blocks; the flows of a step on
  one rank run one after the other (chunk-major), not on separate SMs;
* engines: kernel roles, proxy loops (RDMA) and DMA queues are all plain CPU threads doing
  memcpy; no NIC, no copy engine, no GPU memory;
* the metadata exchange: counts are not exchanged at run time, the layout already holds them
  (a metadata role runs whatever copies the layout gives it: usually none);
* ring buffers: credits (`<step>.credit`) are not waited for; every staging slot is written once;
* fp8 payloads are opaque bytes (dispatch copies rows; combine reads bf16 expert outputs).
"""
