"""The CUDA backend: a plan's kernels as table-driven persistent kernels for Hopper (sm_90a).

    epcc compile schedules/h200x4.sched --target cuda -o build/h200x4

writes `build/h200x4/cuda/`: `epcc_cuda_device.cuh` (table structs, waits, row operations),
`<schedule>_dispatch.cu` and `<schedule>_combine.cu` (one persistent kernel per program, plus
the combine's bf16 conversion kernel), `<schedule>_launcher.cu` (the host API, extern "C") and
`manifest.json` (kernels, grid and block sizes, blocks per role, buffers, the table layout
version, the nvcc command).  codegen.py decides everything (roles, block ranges, access widths,
what is not lowered); tables.py defines the descriptor tables the host builds from a Layout;
launcher.py loads the library with ctypes; emulate.py runs the same tables in NumPy (no GPU);
smoke.py is the end-to-end check to run on a GPU machine.

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
  before each launch (cudaMemsetAsync on the stream), a finish kernel converts `result` to bf16.
* Every launch starts with an entry barrier (each rank bumps every rank's barrier counter once;
  all wait for `num_ranks x (epoch + 1)`) and ends with a drain (block 0 waits until every
  counter on its rank is final: the rank's buffers are complete when the kernel is).  Counters
  live in two banks used by alternate launches, cleared by their owner before it signals the
  barrier.
* Not lowered in this version: the metadata exchange (the host computes the layout), the copy
  engine (DMA steps run as SM roles) and RDMA (emulated by paced SM roles over peer memory, or
  with rdma="external" left to a host proxy that does not exist yet).

Call sequence on the GPU machine (one process per rank; `exchange` is any all-gather, e.g.
torch.distributed.all_gather_object; smoke.py does exactly this with multiprocessing)
--------------------------------------------------------------------------------------------

    from epcc.backends import cuda
    from epcc.plan import Plan
    from epcc.runtime.layout import compute_layout

    bundle = Path("build/h200x4")
    plan = Plan.from_json((bundle / "plan.json").read_text())
    manifest = cuda.load_manifest(bundle / "cuda")
    lib = cuda.Library(cuda.build_library(bundle / "cuda"))   # nvcc; or a prebuilt .so
    dev = local_rank                                           # one GPU per rank

    # 1. context and flag areas (once).  flag_capacity >= 1 + 2 x len(layout.flags) of the
    #    largest layout you will upload.
    ctx = lib.create(dev, rank, flag_capacity=1 + 2 * max_flags, timeout_s=30.0)
    handles = exchange(lib.ipc_handle(ctx.flag_area))
    ctx.set_flag_areas([ctx.flag_area if r == rank else lib.ipc_open(dev, h)
                        for r, h in enumerate(handles)])

    # 2. per layout (each routing): buffers of every program, then the tables.  Buffer ids are
    #    the positions in manifest["buffers"][program] (dispatch: input 0, output 1, staging
    #    buffers; combine: output 0 (bf16 expert outputs), result 1 (fp32), partials).
    layout = compute_layout(plan, topk_idx_all_ranks, weights_all_ranks)   # same on every rank
    ptrs = {}
    for program in ("dispatch", "combine"):
        own = [lib.malloc(dev, n) for n in cuda.buffer_sizes(manifest, layout, program, rank)]
        peers = exchange([lib.ipc_handle(p) for p in own])      # peers[r][b]
        ptrs[program] = [[own[b] if r == rank else lib.ipc_open(dev, peers[r][b]) for r in range(R)]
                         for b in range(len(own))]              # [buffer id][rank]
        ctx.set_buffers(program, ptrs[program], stream)        # stream-ordered: earlier launches
        ctx.upload_tables(program, cuda.build_tables(manifest, layout, program, rank), stream)
    barrier()   # every rank's flag area and buffers exist (and are zero) before any launch

    # 3. dispatch: this rank's token rows (uint8 [T, row_bytes]: bf16, or fp8 + fp32 scales)
    #    into its `input`, then launch.  Once the stream passes the kernel, `output` holds this
    #    rank's rows in layout.entries[("output", rank)] order (expert-major).
    lib.copy_to_device(ptrs["dispatch"][0][rank], x_rows)      # or cudaMemcpyAsync / a torch copy
    ctx.launch_dispatch(stream)
    # 4. combine: the expert outputs (bf16 [rows of output, hidden], same row order) into the
    #    combine `output`, then launch with a bf16 [tokens, hidden] destination (device pointer).
    lib.copy_to_device(ptrs["combine"][0][rank], y_bf16)
    ctx.launch_combine(out_ptr, stream)
    ctx.synchronize(stream)     # raises KernelTimeout with the kernel's message if a wait gave up

Rules the host keeps: launch dispatch and combine alternately (the entry barrier of the next
program is what tells a rank that its peers stopped reading its `input` / `output` buffers:
rewrite `input` only after the previous combine was launched, the combine `output` only after
the dispatch); every rank launches the same sequence; a context whose kernel trapped is dead
(CUDA context lost): read the message with `ctx.read_error()` and restart the process.
"""

from .launcher import (Context, CudaError, KernelTimeout, Library, build_library, find_nvcc,
                       load_manifest, median_timeline, role_timeline)
from .tables import (TABLE_VERSION, TableError, Tables, buffer_sizes, build_tables, parse_tables, partial_rounding)

__all__ = ["Context", "CudaBundle", "CudaCodegenError", "CudaError", "CudaOptions", "KernelSpec", "KernelTimeout",
           "Library", "RoleSpec", "TABLE_VERSION", "TableError", "Tables", "buffer_sizes", "build_library",
           "build_tables", "emit", "find_nvcc", "generate", "load_manifest", "median_timeline", "parse_tables",
           "partial_rounding", "role_timeline"]

_CODEGEN = ("CudaBundle", "CudaCodegenError", "CudaOptions", "KernelSpec", "RoleSpec", "emit", "generate")


def __getattr__(name: str):
    # The code generator (jinja2) loads on first use: the runtime on a GPU machine imports this
    # package for the launcher and the direct runtime only, without the compiler's dependencies.
    if name in _CODEGEN:
        from . import codegen

        return getattr(codegen, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
