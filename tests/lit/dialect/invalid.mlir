// The dialect's constraints, checked by MLIR's own verifier: each piece below breaks one, and
// mlir-opt must report exactly the error written above the line (-verify-diagnostics fails
// the run otherwise).  tests/ir/test_emit.py checks the same through the Python bindings.
//
// RUN: %mlir-opt %s --split-input-file --verify-diagnostics

%input = "epcc.buffer"() {capacity_bytes = 0 : i64, capacity_tokens = 0 : i64, role = "source", sym_name = "input"} : () -> !epcc.buf
%output = "epcc.buffer"() {capacity_bytes = 0 : i64, capacity_tokens = 0 : i64, role = "sink", sym_name = "output"} : () -> !epcc.buf
%sel = "epcc.select"() {mode = "for", ranks = "peer"} : () -> !epcc.sel
// expected-error @+1 {{expected base attribute 'builtin.integer' but got 'builtin.string'}}
%push = "epcc.transfer"(%input, %output, %sel) {after = [], chunk_bytes = 0 : i64, chunk_tokens = "128", dedup = "rank", depth = 4 : i64, direction = "push", engine = "sm", link = "nvlink", link_kind = "p2p", operandSegmentSizes = array<i32: 1, 1, 1, 0>, order = "", parallel = [], relation = "peer", sms = 24 : i64, src_relations = [""], step = "push", title = ""} : (!epcc.buf, !epcc.buf, !epcc.sel) -> !epcc.event

// -----

// A transfer's third operand is its selection, not a buffer.
%input = "epcc.buffer"() {capacity_bytes = 0 : i64, capacity_tokens = 0 : i64, role = "source", sym_name = "input"} : () -> !epcc.buf
%output = "epcc.buffer"() {capacity_bytes = 0 : i64, capacity_tokens = 0 : i64, role = "sink", sym_name = "output"} : () -> !epcc.buf
// expected-error @+1 {{expected base type 'epcc.sel' but got 'epcc.buf'}}
%push = "epcc.transfer"(%input, %output, %output) {after = [], chunk_bytes = 0 : i64, chunk_tokens = 128 : i64, dedup = "rank", depth = 4 : i64, direction = "push", engine = "sm", link = "nvlink", link_kind = "p2p", operandSegmentSizes = array<i32: 1, 1, 1, 0>, order = "", parallel = [], relation = "peer", sms = 24 : i64, src_relations = [""], step = "push", title = ""} : (!epcc.buf, !epcc.buf, !epcc.buf) -> !epcc.event

// -----

// A link's kind is one of p2p, d2d, rdma, local.
// expected-error @+1 {{'"pcie"' does not satisfy the constraint}}
"epcc.link"() {bandwidth_Bps = 1.5e11 : f64, connects = "peer", efficiency = 1.0 : f64, engine = "sm", kind = "pcie", lanes = 1 : i64, latency_s = 3.0e-06 : f64, pairs = array<i64: 0, 1, 1, 0>, shared_per = "", sym_name = "nvlink"} : () -> ()

// -----

// An engine is one of sm, spc, tma, ce, dma, nic, proxy.
// expected-error @+1 {{'"gpu"' does not satisfy the constraint}}
"epcc.link"() {bandwidth_Bps = 1.5e11 : f64, connects = "peer", efficiency = 1.0 : f64, engine = "gpu", kind = "p2p", lanes = 1 : i64, latency_s = 3.0e-06 : f64, pairs = array<i64: 0, 1, 1, 0>, shared_per = "", sym_name = "nvlink"} : () -> ()
