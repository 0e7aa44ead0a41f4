"""The table-driven CUDA kernels on the GPU machine: build the launcher library, load it, feed it.

* launcher.py: the generated host launcher (`<schedule>_launcher.cu`) through ctypes: build it
  (runtime/build_cache.py), load it, contexts, IPC, launches, the role timeline;
* tables.py: the descriptor blobs of one rank and program, built from a layout (the binary
  layout is backends/cuda/abi.py's).

Call sequence on the GPU machine (one process per rank; `exchange` is any all-gather, e.g.
torch.distributed.all_gather_object; bench/ep_bench.py does exactly this)
--------------------------------------------------------------------------------------------

    from epcc.plan import bundle as bundle_io
    from epcc.runtime.engines.cuda_table import tables
    from epcc.runtime.engines.cuda_table.launcher import Library, build_library
    from epcc.runtime.layout import compute_layout

    plan = bundle_io.load("build/h200x4").plan
    manifest = bundle_io.cuda_manifest("build/h200x4")
    lib = Library(build_library("build/h200x4/cuda"))          # nvcc, cached; or a prebuilt .so
    dev = local_rank                                           # one GPU per rank

    # 1. context and flag areas (once).  flag_capacity >= 1 + 2 x len(layout.flags) of the
    #    largest layout you will upload.
    ctx = lib.create(dev, rank, flag_capacity=1 + 2 * max_flags, timeout_s=30.0)
    handles = exchange(lib.ipc_handle(ctx.flag_area))
    ctx.set_flag_areas([ctx.flag_area if r == rank else lib.ipc_open(dev, h)
                        for r, h in enumerate(handles)])
    # (across CUDA IPC domains: 0 for every rank outside ipc_domain.ipc_peers(plan, manifest,
    #  transport, domains, rank), here and in the buffer pointers below; the engine does so)

    # 2. per layout (each routing): buffers of every program, then the tables.  Buffer ids are
    #    the positions in manifest["buffers"][program] (dispatch: input 0, output 1, staging
    #    buffers; combine: output 0 (bf16 expert outputs), result 1 (fp32), partials).
    layout = compute_layout(plan, topk_idx_all_ranks, weights_all_ranks)   # same on every rank
    ptrs = {}
    for program in ("dispatch", "combine"):
        own = [lib.malloc(dev, n) for n in tables.buffer_sizes(manifest, layout, program, rank)]
        peers = exchange([lib.ipc_handle(p) for p in own])      # peers[r][b]
        ptrs[program] = [[own[b] if r == rank else lib.ipc_open(dev, peers[r][b]) for r in range(R)]
                         for b in range(len(own))]              # [buffer id][rank]
        ctx.set_buffers(program, ptrs[program], stream)        # stream-ordered: earlier launches
        ctx.upload_tables(program, tables.build_tables(manifest, layout, program, rank), stream)
    barrier()   # every rank's flag area and buffers exist (and are zero) before any launch

    # 3. dispatch: this rank's token rows (uint8 [T, row_bytes]: bf16, or fp8 + fp32 scales)
    #    into its `input`, then launch.  Once the stream passes the kernel, `output` holds this
    #    rank's rows in layout.entries[("output", rank)] order (expert-major).
    lib.copy_to_device(ptrs["dispatch"][0][rank], x_rows)      # or cudaMemcpyAsync / a torch copy
    ctx.launch_dispatch(stream)
    #    Where manifest["dispatch_input"]["caller_rows"] (no copy reads another rank's `input`),
    #    the kernel may read the rows where they lie instead (16-byte aligned), their address a
    #    launch argument (no copy): ctx.launch_dispatch(stream, rows=x_rows_ptr)
    # 4. combine: the expert outputs (bf16 [rows of output, hidden], same row order) into the
    #    combine `output`, then launch with a bf16 [tokens, hidden] destination (device pointer,
    #    16-byte aligned).  Where manifest["combine_output"]["convert"] is "in-kernel" the kernel
    #    writes it (each row's contributions counted from the tables first, here or ahead with
    #    ctx.combine_prepare(stream) after the previous combine), and `result` then lacks each
    #    row's last contributions; else a finish kernel converts `result` after the kernel.
    lib.copy_to_device(ptrs["combine"][0][rank], y_bf16)
    ctx.launch_combine(out_ptr, stream)
    #    Where manifest["combine_input"]["caller_rows"] (no copy reads another rank's `output`),
    #    the kernel may read y where it lies instead, its address a launch argument (no copy):
    #    ctx.launch_combine_tokens(out_ptr, tokens, stream, rows=y_ptr); y must stay unchanged
    #    until the stream passes the kernel.
    ctx.synchronize(stream)     # raises KernelTimeout with the kernel's message if a wait gave up

Rules the host keeps: launch dispatch and combine alternately (the entry barrier of the next
program is what tells a rank that its peers stopped reading its `input` / `output` buffers:
rewrite `input` only after the previous combine was launched, the combine `output` only after
the dispatch); every rank launches the same sequence; a context whose kernel trapped is dead
(CUDA context lost): read the message with `ctx.read_error()` and restart the process.
"""