"""JIT the plan's CPU module (backends/cpu/codegen.py) with LLVM's MCJIT; one compiled module per plan.

Compiled modules are cached by the SHA-256 of the plan's JSON, so running a plan again (or on
new top-k indices: the module does not depend on the layout) costs no compilation.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
from dataclasses import dataclass

from llvmlite import binding as llvm

from epcc.backends.cpu.codegen import LIBC_SYMBOLS, ROW_OP_SYMBOLS, DriverInfo, build_module, verify
from epcc.plan import Plan

DRIVER_T = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p)
# i32 epcc_wait(ptr flag, i64 value, i64 timeout_ns, ptr abort, ptr observed)
WAIT_T = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p,
                          ctypes.c_void_p)
# i32 epcc_wait_ge(ptr flag, i64 value, i64 deadline_ns, ptr abort, ptr observed)
WAIT_GE_T = WAIT_T
SIGNAL_ADD_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64)
NOW_NS_T = ctypes.CFUNCTYPE(ctypes.c_uint64)
# void row op(ptr dst, ptr src, ptr weight, i64 n)
ROW_OP_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)

_init_lock = threading.Lock()
_compile_lock = threading.Lock()
_target_machine: llvm.TargetMachine | None = None
_cache: dict[str, "JitPlan"] = {}
OPT_LEVEL = 2


def _tm() -> llvm.TargetMachine:
    global _target_machine
    with _init_lock:
        if _target_machine is None:
            llvm.initialize_native_target()
            llvm.initialize_native_asmprinter()
            llvm.initialize_native_asmparser()  # the pause instruction is inline asm
            # libc (clock_gettime, sched_yield, nanosleep) is already in the process: hand the
            # JIT's resolver their addresses.
            libc = ctypes.CDLL(None)
            for name in LIBC_SYMBOLS:
                llvm.add_symbol(name, ctypes.cast(getattr(libc, name), ctypes.c_void_p).value)
            target = llvm.Target.from_triple(llvm.get_process_triple())
            _target_machine = target.create_target_machine(
                cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(),
                opt=OPT_LEVEL, jit=True)
        return _target_machine


@dataclass
class JitPlan:
    """A plan's module, compiled: its drivers and primitives as ctypes functions."""

    key: str
    ir: str
    drivers: dict[tuple[str, str], tuple[DriverInfo, ctypes._CFuncPtr]]  # (program, step) ->
    engine: llvm.ExecutionEngine
    now_ns: ctypes._CFuncPtr
    wait: ctypes._CFuncPtr
    wait_ge: ctypes._CFuncPtr
    signal_add: ctypes._CFuncPtr
    row_ops: dict[str, ctypes._CFuncPtr]

    def driver(self, program: str, step: str) -> tuple[DriverInfo, ctypes._CFuncPtr]:
        try:
            return self.drivers[(program, step)]
        except KeyError:
            raise KeyError(f"the plan has no role for step '{step}' of {program} (Plan.kernels)") from None


def plan_key(plan: Plan) -> str:
    return hashlib.sha256(plan.to_json().encode()).hexdigest()


def _compile(plan: Plan, key: str) -> JitPlan:
    tm = _tm()
    text, infos = build_module(plan)
    mod = verify(text)
    mod.triple = tm.triple
    mod.data_layout = str(tm.target_data)
    pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=OPT_LEVEL))
    pb.getModulePassManager().run(mod, pb)
    mod.verify()
    engine = llvm.create_mcjit_compiler(mod, tm)
    engine.finalize_object()

    def fn(name: str, proto):
        addr = engine.get_function_address(name)
        if not addr:
            raise RuntimeError(f"epcc cpu backend: JIT lost function '{name}'")
        return proto(addr)

    drivers: dict[tuple[str, str], tuple[DriverInfo, ctypes._CFuncPtr]] = {}
    for d in infos:
        if (d.program, d.step) in drivers:
            raise ValueError(f"step '{d.step}' of {d.program} has two roles in the plan's kernels")
        drivers[(d.program, d.step)] = (d, fn(d.name, DRIVER_T))
    return JitPlan(key, text, drivers, engine, fn("epcc_now_ns", NOW_NS_T), fn("epcc_wait", WAIT_T),
                   fn("epcc_wait_ge", WAIT_GE_T), fn("epcc_signal_add", SIGNAL_ADD_T),
                   {op: fn(sym, ROW_OP_T) for op, sym in ROW_OP_SYMBOLS.items()})


def compile_plan(plan: Plan) -> JitPlan:
    """The plan's JIT-compiled CPU module (cached by the plan's JSON).  Thread-safe: LLVM's
    parser, optimiser and MCJIT are not, so compilations run one at a time."""
    key = plan_key(plan)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    with _compile_lock:
        hit = _cache.get(key)
        if hit is None:
            hit = _cache[key] = _compile(plan, key)
        return hit

