// epcc.irdl.mlir — the `epcc` dialect, defined in IRDL and loaded at run time
// (Python: epcc.dialect.load(ctx); mlir-opt: --irdl-file=dialect/epcc.irdl.mlir).
//
// The dialect describes an MoE expert-parallel communication schedule as epcc
// compiles it: the machine (topology), the workload, and the dispatch/combine
// programs as a dataflow graph of steps.  Every op is printed in MLIR's generic
// form ("epcc.transfer"(...) {...}), because IRDL ops have no custom syntax.
//
// ----------------------------------------------------------------------------
// Design rules (each forced by what IRDL in LLVM 22 can and cannot express)
// ----------------------------------------------------------------------------
//
// * No epcc op has a region.  IRDL cannot declare traits, so a dynamic op with
//   a region would need a terminator IRDL cannot provide.  Containers are
//   nested `builtin.module` ops, which need no terminator:
//
//     module @h200x4 attributes {epcc.schedule, epcc.title, epcc.source,
//                                epcc.num_ranks} {
//       module @topology attributes {epcc.topology = "<name>"} {
//         epcc.level / epcc.group / epcc.relation ...
//         module @links { epcc.link ... }
//       }
//       epcc.workload
//       module @dispatch attributes {epcc.program = "dispatch"} {
//         epcc.buffer ... ; one op per step, in program order
//       }
//       module @combine attributes {epcc.program = "combine"} { ... }
//     }
//
//   `combine reverse of dispatch` is emitted as an empty
//   `module @combine attributes {epcc.program = "combine",
//   epcc.derived_from = "dispatch"}` that a later pass fills in.
//   Later passes put generated code in `builtin.module` ops marked
//   `epcc.kind = "kernel"` (device code, e.g. func.func + scf loops) or
//   `epcc.kind = "proxy"` (the host/NIC proxy loop); upstream dialects
//   (func, scf, arith) are used inside those.
//
// * Names are symbols.  Topology objects and buffers carry `sym_name`, so the
//   enclosing builtin.module (a symbol table) rejects duplicates and passes can
//   look them up with SymbolTable.  Links have their own namespace in the
//   .sched language (a link may share a level's name), so they live in a nested
//   `module @links`.  Steps are named by a plain `step` attribute instead: a
//   step and a buffer may share a name, and steps are referred to through
//   their !epcc.event results anyway.
//
// * Optional values are encoded as the zero value: "" for strings, 0 for
//   integers, [] for arrays.  IRDL attributes are always required, and the
//   obvious alternative, an `irdl.any_of` mixing `irdl.base` with `irdl.is
//   unit`, aborts the IRDL loader in this LLVM version ("unknown IRDL
//   constraint").  Zero is never a legal given value: sema requires chunks,
//   capacities, depth, sms and node_limit to be at least 1.
//
// * Every attribute gets its own constraint op.  IRDL unifies constraint
//   variables: one `%s = irdl.base "#builtin.string"` used for two
//   attributes would force the two to be EQUAL.  (Types are parameterless,
//   so sharing a type constraint between operands is harmless.)
//
// * Enumerations (link kind, engine, role, direction, ...) are
//   `irdl.any_of` over `irdl.is "<value>"`, so a wrong value is rejected by
//   the verifier ('"pcie"' does not satisfy the constraint).
//
// * Several variable-length operand groups: the data-moving ops take their
//   sources as one variadic group and their dependencies as another, e.g.
//     epcc.transfer(srcs: variadic buf, dst: buf, sel: sel, deps: variadic event)
//   IRDL handles this with MLIR's standard `operandSegmentSizes` attribute
//   (a dense i32 array, one count per group; single groups count 1), which
//   the IRDL verifier checks: a missing selection operand is reported as
//   "element 2 in 'operandSegmentSizes' attribute must be equal to 1".
//   Builders (compiler/ir/ops.py) compute it; nobody writes it by hand.
//
// * Dependencies are SSA edges: each step op returns an !epcc.event, and a
//   step's `deps` operands are the events of the steps it waits for (the
//   steps whose writes it reads, then its explicit `after` steps).  Which of
//   them were explicit is kept in `after`; `parallel` is a scheduling hint,
//   not an edge, so it is an array of step names.
//
// * Units: bandwidth in bytes/s, latency in seconds (f64), sizes in tokens or
//   bytes (i64), as in the resolved schedule model (epcc.sema.model).
//   Locations carry the .sched source span of every op.

irdl.dialect @epcc {

  // ==========================================================================
  // Types
  // ==========================================================================

  // A buffer of the executing rank (every rank runs every step, SPMD).  Which
  // rank's copy a step touches is given by the step's relation attributes.
  irdl.type @buf

  // The completion of a step (or of a sync op); consumed as a dependency.
  irdl.type @event

  // A token selection: which of a buffer's tokens a step moves.
  irdl.type @sel

  // ==========================================================================
  // Topology: inside `module @topology`
  // ==========================================================================

  // One level of the machine hierarchy (`levels node 1, gpu 4`): `count`
  // instances per instance of the enclosing level; `depth` 0 is outermost.
  // Ranks are the instances of the innermost level, numbered row-major.
  irdl.operation @level {
    %sym_name = irdl.base "#builtin.string"
    %count = irdl.base "#builtin.integer"
    %depth = irdl.base "#builtin.integer"
    irdl.attributes { "sym_name" = %sym_name, "count" = %count, "depth" = %depth }
  }

  // A group (`group vnode = 4 card`): consecutive blocks of `size` instances
  // of `level` within their parent.
  irdl.operation @group {
    %sym_name = irdl.base "#builtin.string"
    %level = irdl.base "#builtin.string"
    %size = irdl.base "#builtin.integer"
    irdl.attributes { "sym_name" = %sym_name, "level" = %level, "size" = %size }
  }

  // A relation (`relation peer = other gpu`), evaluated: `targets` has one
  // entry per rank r, `array<i64: ...>` of the ranks r is related to, in the
  // order sema computed them.  `text` is the defining expression, for
  // messages.
  irdl.operation @relation {
    %sym_name = irdl.base "#builtin.string"
    %text = irdl.base "#builtin.string"
    %targets = irdl.base "#builtin.array"
    irdl.attributes { "sym_name" = %sym_name, "text" = %text, "targets" = %targets }
  }

  // A link (inside `module @links`).  `bandwidth_Bps` is bytes/s per lane in
  // one direction, `latency_s` seconds; the usable rate is bandwidth * lanes *
  // efficiency.  `pairs` is every (a, b) rank pair the link joins, flattened
  // as a0, b0, a1, b1, ... in ascending order (symmetric; empty for local
  // links); `connects` is the relation expression it was declared with.
  // `shared_per` names the level or group with one port per instance ("" =
  // a port per rank): e.g. "card" for a NIC serving both dies of a card, "gpu"
  // for an NVSwitch port that all of a GPU's peers share.
  irdl.operation @link {
    %sym_name = irdl.base "#builtin.string"
    %k_p2p = irdl.is "p2p"
    %k_d2d = irdl.is "d2d"
    %k_rdma = irdl.is "rdma"
    %k_local = irdl.is "local"
    %kind = irdl.any_of(%k_p2p, %k_d2d, %k_rdma, %k_local)
    %bandwidth = irdl.base "#builtin.float"
    %latency = irdl.base "#builtin.float"
    %e_sm = irdl.is "sm"
    %e_spc = irdl.is "spc"
    %e_tma = irdl.is "tma"
    %e_ce = irdl.is "ce"
    %e_dma = irdl.is "dma"
    %e_nic = irdl.is "nic"
    %e_proxy = irdl.is "proxy"
    %engine = irdl.any_of(%e_sm, %e_spc, %e_tma, %e_ce, %e_dma, %e_nic, %e_proxy)
    %lanes = irdl.base "#builtin.integer"
    %efficiency = irdl.base "#builtin.float"
    %connects = irdl.base "#builtin.string"
    %pairs = irdl.base "#builtin.dense_array"
    %shared_per = irdl.base "#builtin.string"
    irdl.attributes {
      "sym_name" = %sym_name, "kind" = %kind, "bandwidth_Bps" = %bandwidth,
      "latency_s" = %latency, "engine" = %engine, "lanes" = %lanes,
      "efficiency" = %efficiency, "connects" = %connects, "pairs" = %pairs,
      "shared_per" = %shared_per
    }
  }

  // ==========================================================================
  // Workload: one op in the top-level module
  // ==========================================================================

  // `tokens` per rank, `hidden` channels of `dtype`, top-`topk` routing over
  // `experts` experts placed `placement` over the ranks.  `node_limit` (0:
  // none) caps the instances of `node_limit_scope` ("": none) a token's
  // experts may span.  `weights_travel`: routing weights and expert indices
  // ride with each token.  `bytes_per_token` is the dispatch wire size of a
  // token (payload plus metadata); `combine_bytes_per_token` that of a combine
  // partial sum (BF16).
  irdl.operation @workload {
    %tokens = irdl.base "#builtin.integer"
    %hidden = irdl.base "#builtin.integer"
    %dt_bf16 = irdl.is "bf16"
    %dt_fp8 = irdl.is "fp8"
    %dtype = irdl.any_of(%dt_bf16, %dt_fp8)
    %topk = irdl.base "#builtin.integer"
    %experts = irdl.base "#builtin.integer"
    %pl_blocked = irdl.is "blocked"
    %pl_strided = irdl.is "strided"
    %placement = irdl.any_of(%pl_blocked, %pl_strided)
    %node_limit = irdl.base "#builtin.integer"
    %node_limit_scope = irdl.base "#builtin.string"
    %wt_true = irdl.is true
    %wt_false = irdl.is false
    %weights_travel = irdl.any_of(%wt_true, %wt_false)
    %bytes_per_token = irdl.base "#builtin.integer"
    %combine_bytes_per_token = irdl.base "#builtin.integer"
    irdl.attributes {
      "tokens" = %tokens, "hidden" = %hidden, "dtype" = %dtype, "topk" = %topk,
      "experts" = %experts, "placement" = %placement, "node_limit" = %node_limit,
      "node_limit_scope" = %node_limit_scope, "weights_travel" = %weights_travel,
      "bytes_per_token" = %bytes_per_token,
      "combine_bytes_per_token" = %combine_bytes_per_token
    }
  }

  // ==========================================================================
  // Programs: inside `module @dispatch` / `module @combine`
  // ==========================================================================

  // A buffer.  `role`: "source" (the program's input: dispatch `input`,
  // combine `output`), "sink" (what it delivers: dispatch `output`, combine
  // `result`) or "staging" (declared with `buffer`).  A declared capacity is
  // in tokens or in bytes; 0 means not given.
  irdl.operation @buffer {
    %sym_name = irdl.base "#builtin.string"
    %r_source = irdl.is "source"
    %r_sink = irdl.is "sink"
    %r_staging = irdl.is "staging"
    %role = irdl.any_of(%r_source, %r_sink, %r_staging)
    %capacity_tokens = irdl.base "#builtin.integer"
    %capacity_bytes = irdl.base "#builtin.integer"
    %buf = irdl.base @epcc::@buf
    irdl.attributes {
      "sym_name" = %sym_name, "role" = %role,
      "capacity_tokens" = %capacity_tokens, "capacity_bytes" = %capacity_bytes
    }
    irdl.results(buffer: %buf)
  }

  // A token selection: "all" (every token of the source), "for" (tokens with
  // an expert on a rank of `ranks`: dispatch) or "of" (tokens whose home rank
  // is in `ranks`: combine).  `ranks` is the rank-set expression ("" for
  // "all"); it is evaluated per (executing rank, far rank) by later passes.
  irdl.operation @select {
    %m_all = irdl.is "all"
    %m_for = irdl.is "for"
    %m_of = irdl.is "of"
    %mode = irdl.any_of(%m_all, %m_for, %m_of)
    %ranks = irdl.base "#builtin.string"
    %sel = irdl.base @epcc::@sel
    irdl.attributes { "mode" = %mode, "ranks" = %ranks }
    irdl.results(selection: %sel)
  }

  // A step that moves tokens between ranks over a link (`send` / `pull`).
  //   direction "push" (send): reads the executing rank's `srcs` and writes
  //     `dst` on each rank `relation` relates it to;
  //   direction "pull": writes the executing rank's `dst` and reads `srcs` on
  //     the related ranks.
  // `src_relations` has one entry per source: the relation whose ranks own
  // that source, "" for the executing rank's own buffer.
  // `link` names the link in @topology::@links, `link_kind`/`engine` copy
  // its kind and engine.  Step options: `chunk_tokens` / `chunk_bytes`
  // (pipelining granularity, at most one non-zero), `depth` (chunks in
  // flight), `sms` (SMs to use), `order` ("first"/"last" among the steps
  // using the same link; "" none), `dedup` ("rank": one copy per token and
  // receiving rank; "none": one per expert), `after` (which deps were
  // explicit), `parallel` (steps it should overlap with).
  // Operand groups (operandSegmentSizes): [#srcs, 1, 1, #deps].
  irdl.operation @transfer {
    %step = irdl.base "#builtin.string"
    %title = irdl.base "#builtin.string"
    %d_push = irdl.is "push"
    %d_pull = irdl.is "pull"
    %direction = irdl.any_of(%d_push, %d_pull)
    %relation = irdl.base "#builtin.string"
    %src_relations = irdl.base "#builtin.array"
    %link = irdl.base "#builtin.string"
    %k_p2p = irdl.is "p2p"
    %k_d2d = irdl.is "d2d"
    %k_rdma = irdl.is "rdma"
    %link_kind = irdl.any_of(%k_p2p, %k_d2d, %k_rdma)
    %e_sm = irdl.is "sm"
    %e_spc = irdl.is "spc"
    %e_tma = irdl.is "tma"
    %e_ce = irdl.is "ce"
    %e_dma = irdl.is "dma"
    %e_nic = irdl.is "nic"
    %e_proxy = irdl.is "proxy"
    %engine = irdl.any_of(%e_sm, %e_spc, %e_tma, %e_ce, %e_dma, %e_nic, %e_proxy)
    %chunk_tokens = irdl.base "#builtin.integer"
    %chunk_bytes = irdl.base "#builtin.integer"
    %depth = irdl.base "#builtin.integer"
    %sms = irdl.base "#builtin.integer"
    %o_none = irdl.is ""
    %o_first = irdl.is "first"
    %o_last = irdl.is "last"
    %order = irdl.any_of(%o_none, %o_first, %o_last)
    %dd_rank = irdl.is "rank"
    %dd_none = irdl.is "none"
    %dedup = irdl.any_of(%dd_rank, %dd_none)
    %after = irdl.base "#builtin.array"
    %parallel = irdl.base "#builtin.array"
    %buf = irdl.base @epcc::@buf
    %sel = irdl.base @epcc::@sel
    %event = irdl.base @epcc::@event
    irdl.attributes {
      "step" = %step, "title" = %title, "direction" = %direction,
      "relation" = %relation, "src_relations" = %src_relations, "link" = %link,
      "link_kind" = %link_kind, "engine" = %engine,
      "chunk_tokens" = %chunk_tokens, "chunk_bytes" = %chunk_bytes,
      "depth" = %depth, "sms" = %sms, "order" = %order, "dedup" = %dedup,
      "after" = %after, "parallel" = %parallel
    }
    irdl.operands(srcs: variadic %buf, dst: %buf, sel: %sel, deps: variadic %event)
    irdl.results(done: %event)
  }

  // A step that moves the selected tokens between the executing rank's own
  // buffers (`copy`), over a local link (`link`, "" when the topology declares
  // none; `engine` is then the default engine for local moves).  Options as
  // for epcc.transfer.  Operand groups: [#srcs, 1, 1, #deps].
  irdl.operation @copy {
    %step = irdl.base "#builtin.string"
    %title = irdl.base "#builtin.string"
    %link = irdl.base "#builtin.string"
    %e_sm = irdl.is "sm"
    %e_spc = irdl.is "spc"
    %e_tma = irdl.is "tma"
    %e_ce = irdl.is "ce"
    %e_dma = irdl.is "dma"
    %e_nic = irdl.is "nic"
    %e_proxy = irdl.is "proxy"
    %engine = irdl.any_of(%e_sm, %e_spc, %e_tma, %e_ce, %e_dma, %e_nic, %e_proxy)
    %chunk_tokens = irdl.base "#builtin.integer"
    %chunk_bytes = irdl.base "#builtin.integer"
    %depth = irdl.base "#builtin.integer"
    %sms = irdl.base "#builtin.integer"
    %o_none = irdl.is ""
    %o_first = irdl.is "first"
    %o_last = irdl.is "last"
    %order = irdl.any_of(%o_none, %o_first, %o_last)
    %dd_rank = irdl.is "rank"
    %dd_none = irdl.is "none"
    %dedup = irdl.any_of(%dd_rank, %dd_none)
    %after = irdl.base "#builtin.array"
    %parallel = irdl.base "#builtin.array"
    %buf = irdl.base @epcc::@buf
    %sel = irdl.base @epcc::@sel
    %event = irdl.base @epcc::@event
    irdl.attributes {
      "step" = %step, "title" = %title, "link" = %link, "engine" = %engine,
      "chunk_tokens" = %chunk_tokens, "chunk_bytes" = %chunk_bytes,
      "depth" = %depth, "sms" = %sms, "order" = %order, "dedup" = %dedup,
      "after" = %after, "parallel" = %parallel
    }
    irdl.operands(srcs: variadic %buf, dst: %buf, sel: %sel, deps: variadic %event)
    irdl.results(done: %event)
  }

  // Dispatch's last local step (`permute`): place every token of `srcs` that
  // is routed to the executing rank into `dst` in expert-major order (one
  // copy per top-k slot that hits a local expert).  No selection operand: the
  // selection is implicitly "the executing rank's tokens".  Local link and
  // options as for epcc.copy (no dedup: permute fans out per expert).
  // Operand groups: [#srcs, 1, #deps].
  irdl.operation @permute {
    %step = irdl.base "#builtin.string"
    %title = irdl.base "#builtin.string"
    %link = irdl.base "#builtin.string"
    %e_sm = irdl.is "sm"
    %e_spc = irdl.is "spc"
    %e_tma = irdl.is "tma"
    %e_ce = irdl.is "ce"
    %e_dma = irdl.is "dma"
    %e_nic = irdl.is "nic"
    %e_proxy = irdl.is "proxy"
    %engine = irdl.any_of(%e_sm, %e_spc, %e_tma, %e_ce, %e_dma, %e_nic, %e_proxy)
    %chunk_tokens = irdl.base "#builtin.integer"
    %chunk_bytes = irdl.base "#builtin.integer"
    %depth = irdl.base "#builtin.integer"
    %sms = irdl.base "#builtin.integer"
    %o_none = irdl.is ""
    %o_first = irdl.is "first"
    %o_last = irdl.is "last"
    %order = irdl.any_of(%o_none, %o_first, %o_last)
    %after = irdl.base "#builtin.array"
    %parallel = irdl.base "#builtin.array"
    %buf = irdl.base @epcc::@buf
    %event = irdl.base @epcc::@event
    irdl.attributes {
      "step" = %step, "title" = %title, "link" = %link, "engine" = %engine,
      "chunk_tokens" = %chunk_tokens, "chunk_bytes" = %chunk_bytes,
      "depth" = %depth, "sms" = %sms, "order" = %order,
      "after" = %after, "parallel" = %parallel
    }
    irdl.operands(srcs: variadic %buf, dst: %buf, deps: variadic %event)
    irdl.results(done: %event)
  }

  // Combine's local step (`reduce`): sum the weighted expert outputs in `src`
  // per home token into `dst`.  Exactly one source (the grammar allows one),
  // so only the deps are variadic and no operandSegmentSizes is needed.
  // Local link and options as for epcc.permute.
  irdl.operation @reduce {
    %step = irdl.base "#builtin.string"
    %title = irdl.base "#builtin.string"
    %link = irdl.base "#builtin.string"
    %e_sm = irdl.is "sm"
    %e_spc = irdl.is "spc"
    %e_tma = irdl.is "tma"
    %e_ce = irdl.is "ce"
    %e_dma = irdl.is "dma"
    %e_nic = irdl.is "nic"
    %e_proxy = irdl.is "proxy"
    %engine = irdl.any_of(%e_sm, %e_spc, %e_tma, %e_ce, %e_dma, %e_nic, %e_proxy)
    %chunk_tokens = irdl.base "#builtin.integer"
    %chunk_bytes = irdl.base "#builtin.integer"
    %depth = irdl.base "#builtin.integer"
    %sms = irdl.base "#builtin.integer"
    %o_none = irdl.is ""
    %o_first = irdl.is "first"
    %o_last = irdl.is "last"
    %order = irdl.any_of(%o_none, %o_first, %o_last)
    %after = irdl.base "#builtin.array"
    %parallel = irdl.base "#builtin.array"
    %buf = irdl.base @epcc::@buf
    %event = irdl.base @epcc::@event
    irdl.attributes {
      "step" = %step, "title" = %title, "link" = %link, "engine" = %engine,
      "chunk_tokens" = %chunk_tokens, "chunk_bytes" = %chunk_bytes,
      "depth" = %depth, "sms" = %sms, "order" = %order,
      "after" = %after, "parallel" = %parallel
    }
    irdl.operands(src: %buf, dst: %buf, deps: variadic %event)
    irdl.results(done: %event)
  }

  // A metadata exchange (`exchange counts with all`): every rank sends
  // `what` ("counts", "routing" or "layout") to the ranks of `peers` (a
  // rank-set expression) and receives theirs.  `link` is "" when the
  // compiler routes the metadata over whatever links reach the peers.
  irdl.operation @exchange {
    %step = irdl.base "#builtin.string"
    %title = irdl.base "#builtin.string"
    %w_counts = irdl.is "counts"
    %w_routing = irdl.is "routing"
    %w_layout = irdl.is "layout"
    %what = irdl.any_of(%w_counts, %w_routing, %w_layout)
    %peers = irdl.base "#builtin.string"
    %link = irdl.base "#builtin.string"
    %o_none = irdl.is ""
    %o_first = irdl.is "first"
    %o_last = irdl.is "last"
    %order = irdl.any_of(%o_none, %o_first, %o_last)
    %after = irdl.base "#builtin.array"
    %parallel = irdl.base "#builtin.array"
    %event = irdl.base @epcc::@event
    irdl.attributes {
      "step" = %step, "title" = %title, "what" = %what, "peers" = %peers,
      "link" = %link, "order" = %order, "after" = %after, "parallel" = %parallel
    }
    irdl.operands(deps: variadic %event)
    irdl.results(done: %event)
  }

  // ==========================================================================
  // Lowering ops: introduced by later passes, not by IR emission
  // ==========================================================================

  // Publish: after `deps`, update the 64-bit completion flag `flag` ("add":
  // += value, "set": = value, with release ordering) on the executing rank
  // (`relation` "") or on each rank `relation` relates it to.  `step` names
  // the step it belongs to (for runtime messages).  Runtime:
  // epcc_signal_add_u64 / epcc_signal_set_u64.
  irdl.operation @signal {
    %step = irdl.base "#builtin.string"
    %flag = irdl.base "#builtin.string"
    %relation = irdl.base "#builtin.string"
    %m_add = irdl.is "add"
    %m_set = irdl.is "set"
    %mode = irdl.any_of(%m_add, %m_set)
    %value = irdl.base "#builtin.integer"
    %event = irdl.base @epcc::@event
    irdl.attributes {
      "step" = %step, "flag" = %flag, "relation" = %relation, "mode" = %mode,
      "value" = %value
    }
    irdl.operands(deps: variadic %event)
    irdl.results(done: %event)
  }

  // Acquire: after `deps`, wait until the executing rank's flag `flag` is >=
  // `value`, giving up after `timeout_ns` nanoseconds (0: check once) with a
  // message naming the step and flag.  Runtime: epcc_wait_ge_u64.
  irdl.operation @wait {
    %step = irdl.base "#builtin.string"
    %flag = irdl.base "#builtin.string"
    %value = irdl.base "#builtin.integer"
    %timeout_ns = irdl.base "#builtin.integer"
    %event = irdl.base @epcc::@event
    irdl.attributes {
      "step" = %step, "flag" = %flag, "value" = %value, "timeout_ns" = %timeout_ns
    }
    irdl.operands(deps: variadic %event)
    irdl.results(done: %event)
  }

  // A marker (no region, see above) placed next to the step op it describes:
  // step `step` runs as `chunks` chunks of `chunk_tokens` tokens with up to
  // `depth` chunks in flight.  The pipelining pass resolves byte-sized chunks
  // to tokens and writes one of these per pipelined step.
  irdl.operation @chunk_loop {
    %step = irdl.base "#builtin.string"
    %chunks = irdl.base "#builtin.integer"
    %chunk_tokens = irdl.base "#builtin.integer"
    %depth = irdl.base "#builtin.integer"
    irdl.attributes {
      "step" = %step, "chunks" = %chunks, "chunk_tokens" = %chunk_tokens,
      "depth" = %depth
    }
  }

  // One role of a fused kernel or proxy loop (kernel formation puts these in
  // the `builtin.module` containers marked epcc.kind = "kernel" | "proxy" |
  // "dma"): the threads that run step `step` as a `role` (sender, puller,
  // forwarder, permuter, reducer, copier, metadata, rdma_poster), on SMs
  // [sm_begin, sm_end) of the kernel's persistent grid with `warps` warps per
  // SM, driven by `engine`.  Proxy and DMA roles use no SMs (0, 0).
  irdl.operation @role {
    %step = irdl.base "#builtin.string"
    %r_send = irdl.is "sender"
    %r_pull = irdl.is "puller"
    %r_fwd = irdl.is "forwarder"
    %r_perm = irdl.is "permuter"
    %r_red = irdl.is "reducer"
    %r_copy = irdl.is "copier"
    %r_meta = irdl.is "metadata"
    %r_rdma = irdl.is "rdma_poster"
    %role = irdl.any_of(%r_send, %r_pull, %r_fwd, %r_perm, %r_red, %r_copy, %r_meta, %r_rdma)
    %sm_begin = irdl.base "#builtin.integer"
    %sm_end = irdl.base "#builtin.integer"
    %warps = irdl.base "#builtin.integer"
    %engine = irdl.base "#builtin.string"
    irdl.attributes {
      "step" = %step, "role" = %role, "sm_begin" = %sm_begin, "sm_end" = %sm_end,
      "warps" = %warps, "engine" = %engine
    }
  }
}
