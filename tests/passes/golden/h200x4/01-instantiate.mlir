module @h200x4 attributes {epcc.num_ranks = 4 : i64, epcc.rank_classes = [array<i64: 0, 1, 2, 3>], epcc.schedule = "h200x4", epcc.source = "schedules/h200x4.sched", epcc.title = "4x H200, all pairs NVLink4, one-hop dispatch with fused permute"} {
  module @topology attributes {epcc.sm_launch_s = 9.000000e-06 : f64, epcc.sm_meta_s = 7.9999999999999996E-6 : f64, epcc.sm_rates_Bps = {copy = 6.000000e+10 : f64, read = 1.720000e+11 : f64, reduce = 1.400000e+11 : f64}, epcc.topology = "h200x4"} {
    "epcc.level"() {count = 1 : i64, depth = 0 : i64, sym_name = "node"} : () -> () loc("schedules/h200x4.sched":10:10 to :16)
    "epcc.level"() {count = 4 : i64, depth = 1 : i64, sym_name = "gpu"} : () -> () loc("schedules/h200x4.sched":10:18 to :23)
    "epcc.relation"() {sym_name = "peer", targets = [array<i64: 1, 2, 3>, array<i64: 0, 2, 3>, array<i64: 0, 1, 3>, array<i64: 0, 1, 2>], text = "other gpu"} : () -> () loc("schedules/h200x4.sched":13:3 to :28)
    module @links {
      "epcc.link"() {bandwidth_Bps = 4.500000e+11 : f64, connects = "peer", efficiency = 6.200000e-01 : f64, engine = "sm", kind = "p2p", lanes = 1 : i64, latency_s = 3.000000e-06 : f64, pairs = array<i64: 0, 1, 0, 2, 0, 3, 1, 0, 1, 2, 1, 3, 2, 0, 2, 1, 2, 3, 3, 0, 3, 1, 3, 2>, shared_per = "gpu", sym_name = "nvlink"} : () -> () loc("schedules/h200x4.sched":20:3 to 28:4)
      "epcc.link"() {bandwidth_Bps = 4.800000e+12 : f64, connects = "", efficiency = 4.000000e-01 : f64, engine = "sm", kind = "local", lanes = 1 : i64, latency_s = 9.9999999999999995E-7 : f64, pairs = array<i64>, shared_per = "", sym_name = "hbm"} : () -> () loc("schedules/h200x4.sched":30:3 to 34:4)
    } loc("schedules/h200x4.sched":9:1 to 35:2)
  } loc("schedules/h200x4.sched":9:1 to 35:2)
  "epcc.workload"() {bytes_per_token = 14400 : i64, combine_bytes_per_token = 14336 : i64, dtype = "bf16", experts = 256 : i64, hidden = 7168 : i64, node_limit = 0 : i64, node_limit_scope = "", placement = "blocked", tokens = 4096 : i64, topk = 8 : i64, weights_travel = true} : () -> () loc("schedules/h200x4.sched":37:1 to 44:2)
  module @dispatch attributes {epcc.program = "dispatch"} {
    %input = "epcc.buffer"() {capacity_bytes = 0 : i64, capacity_tokens = 0 : i64, role = "source", sym_name = "input"} : () -> !epcc.buf loc("input"("schedules/h200x4.sched":46:1 to :9))
    %output = "epcc.buffer"() {capacity_bytes = 0 : i64, capacity_tokens = 0 : i64, role = "sink", sym_name = "output"} : () -> !epcc.buf loc("output"("schedules/h200x4.sched":46:1 to :9))
    %meta = "epcc.exchange"() {after = [], epcc.per_class = [{class = 0 : i64, fanout = 3 : i64, far = array<i64: 1, 2, 3>, representative = 0 : i64}], link = "", order = "", parallel = [], peers = "all", step = "meta", title = "counts per rank and expert", what = "counts"} : () -> !epcc.event loc("meta"("schedules/h200x4.sched":49:3 to :67))
    %push.sel = "epcc.select"() {mode = "for", ranks = "peer"} : () -> !epcc.sel loc("push.sel"("schedules/h200x4.sched":51:12 to :27))
    %push = "epcc.transfer"(%input, %output, %push.sel, %meta) {after = [], chunk_bytes = 0 : i64, chunk_tokens = 128 : i64, dedup = "rank", depth = 4 : i64, direction = "push", engine = "sm", epcc.per_class = [{class = 0 : i64, fanout = 3 : i64, far = array<i64: 1, 2, 3>, representative = 0 : i64}], link = "nvlink", link_kind = "p2p", operandSegmentSizes = array<i32: 1, 1, 1, 1>, order = "", parallel = [], relation = "peer", sms = 24 : i64, src_relations = [""], step = "push", title = "send each token once to every peer that needs it"} : (!epcc.buf, !epcc.buf, !epcc.sel, !epcc.event) -> !epcc.event loc("push"("schedules/h200x4.sched":50:3 to 51:72))
    %keep = "epcc.permute"(%input, %output, %meta) {after = [], chunk_bytes = 0 : i64, chunk_tokens = 128 : i64, depth = 4 : i64, engine = "sm", epcc.per_class = [{class = 0 : i64, fanout = 0 : i64, far = array<i64>, representative = 0 : i64}], link = "hbm", operandSegmentSizes = array<i32: 1, 1, 1>, order = "", parallel = [], sms = 0 : i64, step = "keep", title = "own tokens to local experts"} : (!epcc.buf, !epcc.buf, !epcc.event) -> !epcc.event loc("keep"("schedules/h200x4.sched":52:3 to :69))
  } loc("schedules/h200x4.sched":46:1 to 53:2)
  module @combine attributes {epcc.derived_from = "dispatch", epcc.program = "combine"} {
  } loc("schedules/h200x4.sched":55:1 to :28)
} loc("schedules/h200x4.sched":1:1)
