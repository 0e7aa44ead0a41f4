"""The CUDA backend: a plan's kernels as CUDA sources for Hopper (sm_90a), and their manifest.

    epcc compile schedules/h200x4.sched --target cuda -o build/h200x4

writes `build/h200x4/cuda/`: `epcc_cuda_device.cuh` (table structs, waits, row operations),
`<schedule>_dispatch.cu` and `<schedule>_combine.cu` (one persistent kernel per program, plus
the combine's count kernel, or its bf16 conversion kernel: manifest `combine_output`), `<schedule>_launcher.cu` (the host API, extern "C") and
`manifest.json` (kernels, grid and block sizes, blocks per role, buffers, the table layout
version, the nvcc command); for a one-hop plan also the direct kernels the Buffer API runs
(direct.py): `<schedule>_direct.cu` and `epcc_direct_config.cuh` (generated) and the static
headers `epcc/direct/*.cuh` (include/, copied); with RDMA steps the proxy loop's sources in `rdma/`.

* codegen.py decides everything of the table-driven kernels (roles, block ranges, access
  widths, what is not lowered); templates/ lay out text;
* abi.py: the descriptor tables' binary layout, which the device header declares and the
  runtime's blobs follow;
* direct.py: the direct kernels of a one-hop plan (plan/direct.py decides which plans): the
  config header it generates and the static device headers in include/epcc/direct/.

Nothing here runs a kernel: runtime/engines/cuda_table builds, loads and launches the table
kernels (and says how, step by step), runtime/engines/cuda_direct the direct ones.

Design
------
* Dispatch kernel and combine kernel: one cooperative launch each, `grid` blocks (one per SM of
  the plan's role ranges, plus `dma_blocks` per DMA role and, with rdma="emulate",
  `proxy_blocks` per RDMA role; with rdma="proxy" the plan's `pack_sms` and `unpack_sms` per
  RDMA step, sized for the link by kernel-formation), `8 * 32` threads.  `blockIdx.x` selects the role; a role's
  work items (one chunk of one copy, ordered chunk-major across the copies) go round-robin to
  its blocks; a block's warps split the chunk's rows (one row per warp, 16-byte accesses, 8
  loads in flight per lane).  Per chunk: bounded waits on the producers' counters (acquire,
  system scope, %globaltimer deadline, __nanosleep backoff; on timeout the host-mapped error
  record is written, "epcc: wait timed out after ..." printed and the kernel traps), the rows,
  then one thread: wait until the copy's earlier chunks are published, __threadfence_system(),
  release add on the copy's counter.
* Combine: weighted steps add `w * bf16 -> fp32` into the fp32 partials, the others partial into
  partial, with `red.add.v4.f32` (system scope); the host clears this rank's partial buffers
  before each launch (cudaMemsetAsync on the stream); the warp adding a row's last contributions
  writes its bf16 token (a count kernel counts each row's contributions first), or, where a proxy
  outside the kernels or another GPU writes `result` (manifest `combine_output`), a finish kernel
  converts `result` to bf16 after the kernel.
* Every launch starts with an entry barrier (each rank bumps every rank's barrier counter once;
  all wait for `num_ranks x (epoch + 1)`) and ends with a drain (block 0 waits until every
  counter on its rank is final: the rank's buffers are complete when the kernel is).  Counters
  live in two banks used by alternate launches, cleared by their owner before it signals the
  barrier.
* Not lowered in this version: the copy engine (DMA steps run as SM roles).  The metadata
  exchange runs in the metadata kernels (epcc_table_meta), or on the host where the manifest's
  `metadata` says why.  RDMA steps run as paced SM roles over peer memory
  (rdma="emulate"), through pack and unpack roles and the host proxy loop (rdma="proxy",
  runtime/engines/gpu_proxy), or are left to the caller's proxy (rdma="external").
"""
