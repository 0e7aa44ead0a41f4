"""The CPU backend: a plan's kernels as LLVM IR, JIT-compiled, every rank's roles as threads.

    from epcc.backends import cpu
    out = cpu.run_dispatch(plan, layout, x_rows)     # x_rows[r]: uint8 [T, row_bytes]
    res = cpu.run_combine(plan, layout, y)           # y[r]: bf16 (uint16) [n_d, hidden]
    text = cpu.llvm_ir(plan)                         # the module, verified

What it does (codegen.py, jit.py, host.py): the final plan (after kernel formation) becomes one
LLVM module with a driver per (program, role) of `Plan.kernels` (kernels, proxy loops and DMA
queues alike), plus the flag primitives of runtime/native/epcc_sync.c (acquire/release
counters, bounded waits on CLOCK_MONOTONIC) and the row operations (row copy, weighted bf16
-> fp32 accumulate, fp32 accumulate, the accumulates atomic).  The host lays out every rank's
buffers and counters as NumPy arrays, hands each driver a table of its rank's copies
(runtime/layout.py's `Copy` list: row addresses, chunk boundaries, the counter to bump and
per chunk the counters to wait for) and runs one thread per (rank, role).  A stuck wait raises
`CpuBackendTimeout` naming the rank, step and flag instead of hanging.

As separate processes (procs.py, `epcc run --transport libfabric-tcp`): one forked process per
rank over shared-memory buffers, a gloo group for rendezvous, and the plan's RDMA steps through
the emitted proxy loop over libfabric's tcp provider (backends/rdma, docs/rdma.md).

What it does not model:

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

from .codegen import DriverInfo, drivers, llvm_ir
from .host import CpuBackendTimeout, HostMemory, execute, run_combine, run_dispatch, timeout_message
from .jit import compile_plan

__all__ = ["CpuBackendTimeout", "DriverInfo", "HostMemory", "compile_plan", "drivers", "execute", "llvm_ir",
           "run_combine", "run_dispatch", "timeout_message"]
