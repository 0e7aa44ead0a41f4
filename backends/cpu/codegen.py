"""Lower a plan's kernels and roles to one LLVM module (text built with llvmlite.ir).  One module of
~470 lines on purpose: the primitives, row operations and drivers are built into one llvmlite
module and share its types, symbols and the table field orders below.

The module holds

* the flag primitives, mirroring runtime/native/epcc_sync.c:
  `epcc_now_ns()` (CLOCK_MONOTONIC through libc's `clock_gettime`),
  `epcc_wait_ge(flag, value, deadline_ns, abort, observed) -> i32`: acquire loads in a spin loop
  with a CPU pause and exponential backoff, then `sched_yield` between polls, then (unlike
  epcc_sync.c, which has a core per waiter) `nanosleep` with exponential backoff; it gives up
  at `deadline_ns` (1) or when another role of the run has timed out and set `*abort` (2),
  storing the last value it saw in `*observed`; 0 once `*flag >= value` (unsigned compare),
  `epcc_wait(flag, value, timeout_ns, abort, observed) -> i32`: one acquire load first (the
  fast path reads no clock), then `epcc_wait_ge` with a deadline `timeout_ns` from now,
  `epcc_signal_add(flag, v)`: `atomicrmw add ... release`;
* the row operations: `epcc_copy_row` (`llvm.memcpy`), `epcc_acc_row_bf16` (combine's weighted
  reduce: `dst[j] += w * float(bf16 src[j])`, bf16 widened by shifting it into the high half of
  an i32, the add an `atomicrmw fadd ... monotonic` because several steps accumulate into the
  same partial rows concurrently) and `epcc_acc_row_f32` (partial-to-partial returns, same
  atomic add);
* one *driver* per (program, role) of `Plan.kernels`, named `epcc_<kernel>__<step>`, e.g.
  `epcc_dispatch_kernel__push`.  The step's DSL line, kernel, kind, role and engine are kept in
  a comment above the function and in its `!epcc.step` metadata (`!epcc.drivers` lists all).

A driver takes one pointer, to the role table of its executing rank (built by the host, see
runtime/engines/cpu/threads.py; field orders below), and runs its copies chunk-major: for chunk round r, for every copy
that has a chunk r: wait (bounded) for every (flag, value) of the chunk's wait list, apply the
row op to each row of the chunk, then bump the copy's flag by 1 (release).  On a failed wait it
fills its error record and returns the status (1 timed out, 2 aborted); 0 when done.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llvmlite import binding as llvm
from llvmlite import ir

from epcc.plan import Plan
from epcc.textsafe import llvm_comment

# ---------------------------------------------------------------------------------------------
# The descriptor tables shared with the host.  Every field is 8 bytes (an i64 or a pointer), so
# the host fills them as int64 NumPy arrays.

#: struct epcc.role: what one driver call executes (one rank, one role).
ROLE_FIELDS = ("n_copies", "row_len", "timeout_ns", "max_chunks", "copies", "err", "abort")
#: struct epcc.copy: one Copy of the layout.  Pointers are to arrays:
#: chunk_starts i64[n_chunks+1], src_rows/dst_rows: the address of every row (u64[n]),
#: weights f32[n] (weighted combine only, else null), flag: the i64 counter bumped per chunk,
#: wait_starts i64[n_chunks+1] (chunk c's waits are [wait_starts[c], wait_starts[c+1])),
#: wait_flags: flag addresses u64[n_waits], wait_values i64[n_waits].
COPY_FIELDS = ("n_chunks", "chunk_starts", "src_rows", "dst_rows", "weights", "flag",
               "wait_starts", "wait_flags", "wait_values")
#: struct epcc.err: written by a driver whose wait failed.
ERR_FIELDS = ("status", "copy", "chunk", "wait", "observed", "expected", "time_ns")

STATUS_OK, STATUS_TIMEOUT, STATUS_ABORTED = 0, 1, 2

# Row operations a driver is specialised for.
OP_COPY = "copy"  # dispatch: memcpy row_len bytes
OP_ACC_BF16 = "acc_bf16"  # weighted combine: f32 dst += w * bf16 src, row_len elements
OP_ACC_F32 = "acc_f32"  # unweighted combine: f32 dst += f32 src, row_len elements
ROW_OP_SYMBOLS = {OP_COPY: "epcc_copy_row", OP_ACC_BF16: "epcc_acc_row_bf16", OP_ACC_F32: "epcc_acc_row_f32"}

# Wait loop tuning.  epcc_sync.c spins 2048 polls, then yields.  The CPU backend runs many more
# threads than there are cores (one per rank and role: 800 for a 32-rank combine), and a thread
# that only yields still takes its share of the cores from the threads doing the work, so after
# a short spin and a few yields a wait sleeps, with exponential backoff.
SPIN_POLLS = 128  # polls with a CPU pause, the pauses doubling up to MAX_PAUSES per poll
MAX_PAUSES = 64
YIELD_POLLS = 64  # then polls after a sched_yield
MIN_SLEEP_NS = 20_000  # then polls after a nanosleep, doubling up to MAX_SLEEP_NS
MAX_SLEEP_NS = 4_000_000
CLOCK_EVERY = 64  # read the clock (and the abort word) every this many polls, and while sleeping
CLOCK_MONOTONIC = 1
LIBC_SYMBOLS = ("clock_gettime", "sched_yield", "nanosleep")  # what the module calls outside itself

I1, I16, I32, I64 = ir.IntType(1), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F32 = ir.FloatType()
PTR = ir.PointerType()
VOID = ir.VoidType()


@dataclass(frozen=True)
class DriverInfo:
    """One driver function: a role of a kernel of the plan."""

    name: str  # LLVM symbol
    program: str
    kernel: str
    kind: str  # kernel | proxy | dma
    step: str
    role: str
    engine: str
    line: int  # DSL line of the step
    op: str  # OP_COPY | OP_ACC_BF16 | OP_ACC_F32

    def describe(self) -> str:
        return (f"{self.kernel} ({self.kind}) role {self.role} on {self.engine}: step '{self.step}' "
                f"of {self.program}, DSL line {self.line}, rows: {_OP_WORDS[self.op]}")


_OP_WORDS = {
    OP_COPY: "dst = src (row_len bytes, llvm.memcpy)",
    OP_ACC_BF16: "dst[j] += w * float(bf16 src[j]) (atomicrmw fadd)",
    OP_ACC_F32: "dst[j] += src[j] (atomicrmw fadd)",
}


def op_of_step(plan: Plan, program: str, step: str) -> str:
    if program == "dispatch":
        return OP_COPY
    ps = plan.step(step, program)
    return OP_ACC_BF16 if ps.weighted else OP_ACC_F32


def _symbol(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", text)


def drivers(plan: Plan) -> list[DriverInfo]:
    """The driver of every (program, role) of plan.kernels, in kernel and role order."""
    out: list[DriverInfo] = []
    used: set[str] = set()
    for k in plan.kernels:
        for r in k.roles:
            base = f"epcc_{_symbol(k.name)}__{_symbol(r.step)}"
            name, n = base, 1
            while name in used:
                n += 1
                name = f"{base}_{n}"
            used.add(name)
            try:
                line = plan.step(r.step, k.program).line
            except KeyError:
                line = 0
            out.append(DriverInfo(name, k.program, k.name, k.kind, r.step, r.role, r.engine, line,
                                  op_of_step(plan, k.program, r.step)))
    return out


# ---------------------------------------------------------------------------------------------


class _Gen:
    def __init__(self, triple: str, arch: str):
        self.m = ir.Module(name="epcc_cpu", context=ir.Context())
        self.m.triple = triple
        self.arch = arch
        self.role_t = self.m.context.get_identified_type("epcc.role")
        self.role_t.set_body(*[I64 if f in ("n_copies", "row_len", "timeout_ns", "max_chunks") else PTR
                               for f in ROLE_FIELDS])
        self.copy_t = self.m.context.get_identified_type("epcc.copy")
        self.copy_t.set_body(*[I64 if f == "n_chunks" else PTR for f in COPY_FIELDS])
        self.err_t = self.m.context.get_identified_type("epcc.err")
        self.err_t.set_body(*[I64] * len(ERR_FIELDS))
        self.timespec_t = ir.LiteralStructType([I64, I64])
        self.clock_gettime = ir.Function(self.m, ir.FunctionType(I32, [I32, PTR]), "clock_gettime")
        self.sched_yield = ir.Function(self.m, ir.FunctionType(I32, []), "sched_yield")
        self.nanosleep = ir.Function(self.m, ir.FunctionType(I32, [PTR, PTR]), "nanosleep")
        self.memcpy = ir.Function(self.m, ir.FunctionType(VOID, [PTR, PTR, I64, I1]), "llvm.memcpy.p0.p0.i64")
        self.now_ns = self._now_ns()
        self.wait_ge = self._wait_ge()
        self.wait = self._wait()
        self.signal_add = self._signal_add()
        self.row_ops = {OP_COPY: self._copy_row(), OP_ACC_BF16: self._acc_row_bf16(),
                        OP_ACC_F32: self._acc_row_f32()}

    # -- helpers ------------------------------------------------------------------------------
    @staticmethod
    def _for(b: ir.IRBuilder, lo, hi, body, name: str) -> None:
        """for (i = lo; i < hi; i++) body(i), with a phi; body leaves b in a live block."""
        pre = b.block
        head = b.append_basic_block(f"{name}.head")
        loop = b.append_basic_block(f"{name}.body")
        done = b.append_basic_block(f"{name}.done")
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(I64, name=name)
        i.add_incoming(lo, pre)
        b.cbranch(b.icmp_signed("<", i, hi), loop, done)
        b.position_at_end(loop)
        body(i)
        nxt = b.add(i, I64(1), name=f"{name}.next")
        i.add_incoming(nxt, b.block)
        b.branch(head)
        b.position_at_end(done)

    @staticmethod
    def _alloca(b: ir.IRBuilder, typ, name: str):
        """An alloca whose uses print as an opaque `ptr` (llvmlite types allocas as `T*`)."""
        a = b.alloca(typ, name=name)
        a.type = PTR
        return a

    def _field(self, b, struct_t, ptr, fields, name, typ):
        idx = fields.index(name)
        p = b.gep(ptr, [I32(0), I32(idx)], inbounds=True, source_etype=struct_t, name=f"{name}.p")
        return b.load(p, name=name, typ=typ, align=8)

    def _pause(self, b):
        if self.arch in ("x86_64", "i386", "i686"):
            b.asm(ir.FunctionType(VOID, []), "pause", "~{memory}", [], side_effect=True)
        elif self.arch in ("aarch64", "arm64"):
            b.asm(ir.FunctionType(VOID, []), "yield", "~{memory}", [], side_effect=True)
        else:  # no pause instruction known: a compiler barrier
            b.fence("seq_cst", targetscope="singlethread")

    # -- flag primitives ----------------------------------------------------------------------
    def _now_ns(self) -> ir.Function:
        f = ir.Function(self.m, ir.FunctionType(I64, []), "epcc_now_ns")
        b = ir.IRBuilder(f.append_basic_block("entry"))
        ts = self._alloca(b, self.timespec_t, "ts")
        b.call(self.clock_gettime, [I32(CLOCK_MONOTONIC), ts])
        sec = b.load(b.gep(ts, [I32(0), I32(0)], source_etype=self.timespec_t), typ=I64, name="sec")
        nsec = b.load(b.gep(ts, [I32(0), I32(1)], source_etype=self.timespec_t), typ=I64, name="nsec")
        b.ret(b.add(b.mul(sec, I64(1_000_000_000)), nsec))
        return f

    def _wait_ge(self) -> ir.Function:
        """i32 epcc_wait_ge(ptr flag, i64 value, i64 deadline_ns, ptr abort, ptr observed)."""
        f = ir.Function(self.m, ir.FunctionType(I32, [PTR, I64, I64, PTR, PTR]), "epcc_wait_ge")
        flag, value, deadline, abort, observed = f.args
        for a, n in zip(f.args, ("flag", "value", "deadline_ns", "abort", "observed")):
            a.name = n
        b = ir.IRBuilder(f.append_basic_block("entry"))
        polls = self._alloca(b, I32, "polls")
        pauses = self._alloca(b, I32, "pauses")
        sleep = self._alloca(b, self.timespec_t, "sleep")
        sleep_ns = b.gep(sleep, [I32(0), I32(1)], inbounds=True, source_etype=self.timespec_t, name="sleep_ns")
        b.store(I32(0), polls)
        b.store(I32(1), pauses)
        b.store(I64(0), b.gep(sleep, [I32(0), I32(0)], inbounds=True, source_etype=self.timespec_t))
        b.store(I64(MIN_SLEEP_NS), sleep_ns)
        v0 = b.load_atomic(flag, "acquire", 8, name="v0", typ=I64)
        b.store(v0, observed)
        loop = f.append_basic_block("poll")
        ok = f.append_basic_block("ok")
        with b.if_then(b.icmp_unsigned(">=", v0, value)):
            b.ret(I32(0))
        b.branch(loop)

        b.position_at_end(loop)
        n = b.load(polls, name="n", typ=I32)
        spin = b.icmp_unsigned("<", n, I32(SPIN_POLLS))
        with b.if_else(spin) as (then, otherwise):
            with then:
                k = b.load(pauses, name="k", typ=I32)
                self._for(b, I64(0), b.zext(k, I64), lambda _i: self._pause(b), "pause")
                doubled = b.shl(k, I32(1))
                b.store(b.select(b.icmp_unsigned("<", k, I32(MAX_PAUSES)), doubled, k), pauses)
            with otherwise:
                with b.if_else(b.icmp_unsigned("<", n, I32(SPIN_POLLS + YIELD_POLLS))) as (yld, slp):
                    with yld:
                        b.call(self.sched_yield, [])
                    with slp:
                        b.call(self.nanosleep, [sleep, ir.Constant(PTR, None)])
                        t = b.load(sleep_ns, name="t", typ=I64)
                        t2 = b.shl(t, I64(1))
                        b.store(b.select(b.icmp_unsigned("<", t2, I64(MAX_SLEEP_NS)), t2, I64(MAX_SLEEP_NS)),
                                sleep_ns)
        n1 = b.add(n, I32(1), name="n1")
        b.store(n1, polls)
        v = b.load_atomic(flag, "acquire", 8, name="v", typ=I64)
        b.store(v, observed)
        check = f.append_basic_block("check_time")
        b.cbranch(b.icmp_unsigned(">=", v, value), ok, check)

        b.position_at_end(check)
        periodic = b.or_(b.icmp_unsigned("==", b.urem(n1, I32(CLOCK_EVERY)), I32(0)),
                         b.icmp_unsigned(">", n1, I32(SPIN_POLLS + YIELD_POLLS)))
        slow = f.append_basic_block("slow")
        b.cbranch(periodic, slow, loop)
        b.position_at_end(slow)
        ab = b.load_atomic(abort, "monotonic", 8, name="aborted", typ=I64)
        with b.if_then(b.icmp_unsigned("!=", ab, I64(0))):
            b.ret(I32(STATUS_ABORTED))
        late = b.icmp_unsigned(">=", b.call(self.now_ns, [], name="now"), deadline)
        with b.if_then(late):
            # One last look: we may have been descheduled past the deadline while it was set.
            vl = b.load_atomic(flag, "acquire", 8, name="vlast", typ=I64)
            b.store(vl, observed)
            b.ret(b.select(b.icmp_unsigned(">=", vl, value), I32(0), I32(STATUS_TIMEOUT)))
        b.branch(loop)

        b.position_at_end(ok)
        b.ret(I32(0))
        return f

    def _wait(self) -> ir.Function:
        """i32 epcc_wait(ptr flag, i64 value, i64 timeout_ns, ptr abort, ptr observed)."""
        f = ir.Function(self.m, ir.FunctionType(I32, [PTR, I64, I64, PTR, PTR]), "epcc_wait")
        flag, value, timeout, abort, observed = f.args
        for a, n in zip(f.args, ("flag", "value", "timeout_ns", "abort", "observed")):
            a.name = n
        b = ir.IRBuilder(f.append_basic_block("entry"))
        v = b.load_atomic(flag, "acquire", 8, name="v", typ=I64)
        b.store(v, observed)
        with b.if_then(b.icmp_unsigned(">=", v, value), likely=True):
            b.ret(I32(0))
        deadline = b.add(b.call(self.now_ns, [], name="now"), timeout, name="deadline")
        # A timeout past the end of the clock waits forever (EPCC_WAIT_FOREVER).
        deadline = b.select(b.icmp_unsigned("<", deadline, timeout), I64(-1), deadline)
        b.ret(b.call(self.wait_ge, [flag, value, deadline, abort, observed], name="st"))
        return f

    def _signal_add(self) -> ir.Function:
        f = ir.Function(self.m, ir.FunctionType(VOID, [PTR, I64]), "epcc_signal_add")
        f.args[0].name, f.args[1].name = "flag", "delta"
        b = ir.IRBuilder(f.append_basic_block("entry"))
        b.atomic_rmw("add", f.args[0], f.args[1], "release")
        b.ret_void()
        return f

    # -- row operations -----------------------------------------------------------------------
    def _copy_row(self) -> ir.Function:
        f = ir.Function(self.m, ir.FunctionType(VOID, [PTR, PTR, PTR, I64]), ROW_OP_SYMBOLS[OP_COPY])
        dst, src, _w, n = f.args
        for a, nm in zip(f.args, ("dst", "src", "weight", "bytes")):
            a.name = nm
        b = ir.IRBuilder(f.append_basic_block("entry"))
        b.call(self.memcpy, [dst, src, n, I1(0)])
        b.ret_void()
        return f

    def _acc_row_bf16(self) -> ir.Function:
        """dst f32[n] += *weight * bf16 src[n] (weight: ptr to the row's f32 weight)."""
        f = ir.Function(self.m, ir.FunctionType(VOID, [PTR, PTR, PTR, I64]), ROW_OP_SYMBOLS[OP_ACC_BF16])
        dst, src, wp, n = f.args
        for a, nm in zip(f.args, ("dst", "src", "weight", "n")):
            a.name = nm
        b = ir.IRBuilder(f.append_basic_block("entry"))
        w = b.load(wp, name="w", typ=F32)

        def body(j):
            h = b.load(b.gep(src, [j], inbounds=True, source_etype=I16), name="h", typ=I16)
            x = b.bitcast(b.shl(b.zext(h, I32), I32(16)), F32, name="x")
            b.atomic_rmw("fadd", b.gep(dst, [j], inbounds=True, source_etype=F32), b.fmul(w, x, name="wx"),
                         "monotonic")

        self._for(b, I64(0), n, body, "j")
        b.ret_void()
        return f

    def _acc_row_f32(self) -> ir.Function:
        f = ir.Function(self.m, ir.FunctionType(VOID, [PTR, PTR, PTR, I64]), ROW_OP_SYMBOLS[OP_ACC_F32])
        dst, src, _w, n = f.args
        for a, nm in zip(f.args, ("dst", "src", "weight", "n")):
            a.name = nm
        b = ir.IRBuilder(f.append_basic_block("entry"))

        def body(j):
            x = b.load(b.gep(src, [j], inbounds=True, source_etype=F32), name="x", typ=F32)
            b.atomic_rmw("fadd", b.gep(dst, [j], inbounds=True, source_etype=F32), x, "monotonic")

        self._for(b, I64(0), n, body, "j")
        b.ret_void()
        return f

    # -- drivers --------------------------------------------------------------------------------
    def driver(self, d: DriverInfo) -> ir.Function:
        f = ir.Function(self.m, ir.FunctionType(I32, [PTR]), d.name)
        tab = f.args[0]
        tab.name = "role"
        b = ir.IRBuilder(f.append_basic_block("entry"))
        observed = self._alloca(b, I64, "observed")
        rf = lambda name, typ: self._field(b, self.role_t, tab, ROLE_FIELDS, name, typ)  # noqa: E731
        n_copies = rf("n_copies", I64)
        row_len = rf("row_len", I64)
        timeout = rf("timeout_ns", I64)
        max_chunks = rf("max_chunks", I64)
        copies = rf("copies", PTR)
        err = rf("err", PTR)
        abort = rf("abort", PTR)
        row_op = self.row_ops[d.op]

        def at(base, idx, typ, name):
            return b.load(b.gep(base, [idx], inbounds=True, source_etype=typ), name=name, typ=typ)

        def per_copy(r, i):
            cd = b.gep(copies, [i], inbounds=True, source_etype=self.copy_t, name="cd")
            cf = lambda name, typ: self._field(b, self.copy_t, cd, COPY_FIELDS, name, typ)  # noqa: E731
            n_chunks = cf("n_chunks", I64)
            with b.if_then(b.icmp_signed("<", r, n_chunks)):
                wait_starts = cf("wait_starts", PTR)
                wait_flags = cf("wait_flags", PTR)
                wait_values = cf("wait_values", PTR)
                w_lo = at(wait_starts, r, I64, "w_lo")
                w_hi = at(wait_starts, b.add(r, I64(1)), I64, "w_hi")

                def per_wait(w):
                    fp = at(wait_flags, w, PTR, "wflag")
                    val = at(wait_values, w, I64, "wvalue")
                    st = b.call(self.wait, [fp, val, timeout, abort, observed], name="st")
                    with b.if_then(b.icmp_unsigned("!=", st, I32(0)), likely=False):
                        for name, v in (("status", b.zext(st, I64)), ("copy", i), ("chunk", r),
                                        ("wait", b.sub(w, w_lo)), ("observed", b.load(observed, typ=I64)),
                                        ("expected", val), ("time_ns", b.call(self.now_ns, []))):
                            p = b.gep(err, [I32(0), I32(ERR_FIELDS.index(name))], inbounds=True,
                                      source_etype=self.err_t)
                            b.store(v, p)
                        with b.if_then(b.icmp_unsigned("==", st, I32(STATUS_TIMEOUT))):
                            # Tell the other roles of the run to stop waiting.
                            b.atomic_rmw("xchg", abort, I64(1), "release")
                        b.ret(st)

                self._for(b, w_lo, w_hi, per_wait, "w")
                chunk_starts = cf("chunk_starts", PTR)
                src_rows = cf("src_rows", PTR)
                dst_rows = cf("dst_rows", PTR)
                weights = cf("weights", PTR)
                lo = at(chunk_starts, r, I64, "row_lo")
                hi = at(chunk_starts, b.add(r, I64(1)), I64, "row_hi")

                def per_row(k):
                    s = at(src_rows, k, PTR, "src")
                    dd = at(dst_rows, k, PTR, "dst")
                    wp = b.gep(weights, [k], inbounds=False, source_etype=F32, name="wptr")
                    b.call(row_op, [dd, s, wp, row_len])

                self._for(b, lo, hi, per_row, "row")
                b.call(self.signal_add, [cf("flag", PTR), I64(1)])

        self._for(b, I64(0), max_chunks,
                  lambda r: self._for(b, I64(0), n_copies, lambda i: per_copy(r, i), "copy"), "chunk")
        b.ret(I32(STATUS_OK))

        md = self.m.add_metadata([ir.MetaDataString(self.m, d.name), ir.MetaDataString(self.m, d.program),
                                  ir.MetaDataString(self.m, d.kernel), ir.MetaDataString(self.m, d.kind),
                                  ir.MetaDataString(self.m, d.step), ir.MetaDataString(self.m, d.role),
                                  ir.MetaDataString(self.m, d.engine), I64(d.line),
                                  ir.MetaDataString(self.m, d.op)])
        f.set_metadata("epcc.step", md)
        self.m.add_named_metadata("epcc.drivers", md)
        return f


def _native_triple() -> str:
    return llvm.get_process_triple()


def build_module(plan: Plan) -> tuple[str, list[DriverInfo]]:
    """The LLVM IR text of the plan's CPU module (unverified) and its drivers."""
    triple = _native_triple()
    g = _Gen(triple, triple.split("-")[0])
    infos = drivers(plan)
    for d in infos:
        g.driver(d)
    text = str(g.m)
    # Keep each step's description (its DSL line, kernel, role) next to its code.
    for d in infos:
        text = text.replace(f'define i32 @"{d.name}"(', f"; {llvm_comment(d.describe())}\ndefine i32 @\"{d.name}\"(", 1)
    header = (f"; epcc CPU backend: schedule '{llvm_comment(plan.schedule)}', {plan.num_ranks} ranks, "
              f"{len(infos)} drivers (one per role of the plan's kernels)\n")
    return header + text, infos


def verify(text: str) -> llvm.ModuleRef:
    mod = llvm.parse_assembly(text)
    mod.verify()
    return mod


def llvm_ir(plan: Plan) -> str:
    """The plan's CPU module as LLVM IR text; verified by LLVM before it is returned."""
    text, _ = build_module(plan)
    verify(text)
    return text
