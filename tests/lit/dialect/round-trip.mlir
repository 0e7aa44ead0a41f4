// The epcc dialect is plain IRDL: MLIR's own mlir-opt, given dialect/epcc.irdl.mlir, parses,
// verifies and prints hand-written epcc IR (generic form, as epcc prints it).
//
// RUN: %mlir-opt %s | %FileCheck %s

// CHECK-LABEL: module
module {
  // CHECK-NEXT: %0 = "epcc.buffer"() {capacity_bytes = 0 : i64, capacity_tokens = 0 : i64, role = "source", sym_name = "input"} : () -> !epcc.buf
  %input = "epcc.buffer"() {capacity_bytes = 0 : i64, capacity_tokens = 0 : i64, role = "source", sym_name = "input"} : () -> !epcc.buf
  // CHECK-NEXT: %1 = "epcc.buffer"() {{{.*}}role = "sink", sym_name = "output"} : () -> !epcc.buf
  %output = "epcc.buffer"() {capacity_bytes = 0 : i64, capacity_tokens = 0 : i64, role = "sink", sym_name = "output"} : () -> !epcc.buf
  // CHECK-NEXT: %2 = "epcc.select"() {mode = "for", ranks = "peer"} : () -> !epcc.sel
  %sel = "epcc.select"() {mode = "for", ranks = "peer"} : () -> !epcc.sel
  // CHECK-NEXT: %3 = "epcc.transfer"(%0, %1, %2) {{{.*}}} : (!epcc.buf, !epcc.buf, !epcc.sel) -> !epcc.event
  %push = "epcc.transfer"(%input, %output, %sel) {after = [], chunk_bytes = 0 : i64, chunk_tokens = 128 : i64, dedup = "rank", depth = 4 : i64, direction = "push", engine = "sm", link = "nvlink", link_kind = "p2p", operandSegmentSizes = array<i32: 1, 1, 1, 0>, order = "", parallel = [], relation = "peer", sms = 24 : i64, src_relations = [""], step = "push", title = ""} : (!epcc.buf, !epcc.buf, !epcc.sel) -> !epcc.event
  // The permute waits for the push: its event is an operand.
  // CHECK-NEXT: %4 = "epcc.permute"(%0, %1, %3) {{{.*}}operandSegmentSizes = array<i32: 1, 1, 1>{{.*}}} : (!epcc.buf, !epcc.buf, !epcc.event) -> !epcc.event
  %keep = "epcc.permute"(%input, %output, %push) {after = [], chunk_bytes = 0 : i64, chunk_tokens = 128 : i64, depth = 4 : i64, engine = "sm", link = "hbm", operandSegmentSizes = array<i32: 1, 1, 1>, order = "", parallel = [], sms = 0 : i64, step = "keep", title = ""} : (!epcc.buf, !epcc.buf, !epcc.event) -> !epcc.event
  // CHECK-NEXT: "epcc.link"() {bandwidth_Bps = 1.500000e+11 : f64, {{.*}}kind = "p2p", {{.*}}pairs = array<i64: 0, 1, 1, 0>,
  "epcc.link"() {bandwidth_Bps = 1.5e11 : f64, connects = "peer", efficiency = 1.0 : f64, engine = "sm", kind = "p2p", lanes = 1 : i64, latency_s = 3.0e-06 : f64, pairs = array<i64: 0, 1, 1, 0>, shared_per = "", sym_name = "nvlink"} : () -> ()
}
