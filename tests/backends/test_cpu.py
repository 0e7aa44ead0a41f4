"""The CPU backend (backends/cpu) on plans and layouts built by hand: row copies, chunk-level
waits, atomic fp32 accumulation, bounded waits that name where they are stuck, the emitted IR,
and threads that really run concurrently."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from llvmlite import binding as llvm

from cpu_layouts import LayoutBuilder, kernel, plan_of, step
from epcc.backends.cpu import codegen
from epcc.runtime.bf16 import bf16_to_f32, f32_to_bf16
from epcc.runtime.engines.cpu import jit, threads

RNG = np.random.default_rng(7)


# --------------------------------------------------------------------------------------------
# 2 ranks, one hop: push (2 chunks) to the peer's output, keep (1 chunk) into the own output.


def push_case(row_bytes: int = 24):
    plan = plan_of("push2", 2, [step("dispatch", "push", line=11), step("dispatch", "keep", verb="permute", line=12)],
                   [kernel("dispatch_kernel", "kernel", "dispatch", "push", "keep")])
    T = 4
    b = LayoutBuilder(2, T, row_bytes=row_bytes)
    peer_order = [3, 1, 0, 2]
    for d in range(2):
        b.buffer("output", d, 6)
    for s in range(2):
        d = 1 - s
        b.copy("dispatch", "push", rank=s, src=s, dst=d, src_buffer="input", src_slots=peer_order,
               dst_buffer="output", dst_slots=[2, 3, 4, 5], chunk_starts=[0, 2, 4], flow=s)
        b.copy("dispatch", "keep", rank=s, src=s, dst=s, src_buffer="input", src_slots=[2, 0],
               dst_buffer="output", dst_slots=[1, 0], flow=s, step_index=1)
    x = [RNG.integers(0, 256, size=(T, row_bytes), dtype=np.uint8) for _ in range(2)]
    want = []
    for d in range(2):
        o = np.zeros((6, row_bytes), np.uint8)
        o[[1, 0]] = x[d][[2, 0]]
        o[2:6] = x[1 - d][peer_order]
        want.append(o)
    return plan, b.layout(), x, want


def test_one_hop_push_two_chunks():
    plan, layout, x, want = push_case()
    out = threads.run_dispatch(plan, layout, x)
    assert len(out) == 2
    for o, w in zip(out, want):
        assert o.dtype == np.uint8 and o.shape == w.shape
        np.testing.assert_array_equal(o, w)


def test_counters_reach_their_chunk_counts():
    plan, layout, x, want = push_case()
    mem = threads.HostMemory(layout, "dispatch")
    for r in range(2):
        mem.set_buffer("input", r, x[r])
    threads.execute(plan, layout, "dispatch", mem)
    for f in layout.flags:
        assert mem.flags(f.rank)[f.flag_id] == f.chunks, f.name()
    # Counters of the other rank are untouched: each flag lives on the rank its copy writes.
    for f in layout.flags:
        assert mem.flags(1 - f.rank)[f.flag_id] == 0


def test_execute_only_the_given_ranks():
    plan, layout, x, want = push_case()
    mem = threads.HostMemory(layout, "dispatch")
    for r in range(2):
        mem.set_buffer("input", r, x[r])
    threads.execute(plan, layout, "dispatch", mem, ranks=[0])
    # Rank 0 ran push (into rank 1) and keep (into rank 0); rank 1's copies did not run.
    np.testing.assert_array_equal(mem.buffer("dispatch", "output", 1)[2:6], want[1][2:6])
    np.testing.assert_array_equal(mem.buffer("dispatch", "output", 0)[0:2], want[0][0:2])
    assert not mem.buffer("dispatch", "output", 0)[2:6].any()
    assert not mem.buffer("dispatch", "output", 1)[0:2].any()


# --------------------------------------------------------------------------------------------
# 3 ranks, a relay: hop1 (a proxy loop, rank 0 -> rank 1's relay buffer, 2 chunks), then hop2
# (a kernel role on rank 1, relay -> rank 2's output, 3 chunks, each waiting for the hop1 chunks
# that wrote the rows it reads).


def relay_case(T: int = 6, row_bytes: int = 4096, gate: bool = False):
    plan = plan_of("relay3", 3, [step("dispatch", "hop1", dst="relay", line=20),
                                 step("dispatch", "hop2", deps=("hop1",), src=("relay",), line=21)],
                   [kernel("dispatch_proxy", "proxy", "dispatch", "hop1", role="rdma_poster"),
                    kernel("dispatch_kernel", "kernel", "dispatch", "hop2")])
    b = LayoutBuilder(3, T, row_bytes=row_bytes)
    b.buffer("relay", 1, T)
    b.buffer("output", 2, T)
    g = b.gate("dispatch", "gate", 0, 0) if gate else None
    half = T // 2
    hop1_waits = [[(g, 1)], []] if gate else None
    h1 = b.copy("dispatch", "hop1", rank=0, src=0, dst=1, src_buffer="input", src_slots=np.arange(T),
                dst_buffer="relay", dst_slots=np.arange(T), chunk_starts=[0, half, T], waits=hop1_waits)
    # hop2 reads the relay backwards: its first chunk needs hop1's second chunk.
    rd = np.arange(T)[::-1]
    cs = [0, 2, 4, T]
    waits = []
    for c in range(3):
        rows = rd[cs[c]:cs[c + 1]]
        waits.append([(h1.flag_id, int(max(1 if r < half else 2 for r in rows)))])
    b.copy("dispatch", "hop2", rank=1, src=1, dst=2, src_buffer="relay", src_slots=rd, dst_buffer="output",
           dst_slots=np.arange(T), chunk_starts=cs, waits=waits, step_index=1)
    x = [RNG.integers(0, 256, size=(T, row_bytes), dtype=np.uint8) for _ in range(3)]
    return plan, b.layout(), x, g


def test_relay_waits_for_producer_chunks():
    plan, layout, x, _ = relay_case()
    for _ in range(20):  # the consumer races the producer: repeat
        out = threads.run_dispatch(plan, layout, x)
        np.testing.assert_array_equal(out[2], x[0][::-1])
        assert out[0].shape == (0, 4096) and out[1].shape == (0, 4096)


def test_relay_consumer_blocks_until_a_held_producer_goes():
    """hop1 is held by a gate the test opens after 0.3 s; hop2 must wait for it, not copy zeros."""
    plan, layout, x, g = relay_case(gate=True)
    mem = threads.HostMemory(layout, "dispatch")
    for r in range(3):
        mem.set_buffer("input", r, x[r])
    jp = jit.compile_plan(plan)
    gate_rank = layout.flags[g].rank
    addr = mem.flags(gate_rank).ctypes.data + 8 * g

    def open_gate():
        time.sleep(0.3)
        jp.signal_add(addr, 1)

    opener = threading.Thread(target=open_gate)
    t0 = time.monotonic()
    opener.start()
    threads.execute(plan, layout, "dispatch", mem, timeout_s=10.0)
    elapsed = time.monotonic() - t0
    opener.join()
    assert elapsed >= 0.3
    np.testing.assert_array_equal(mem.buffer("dispatch", "output", 2), x[0][::-1])


# --------------------------------------------------------------------------------------------
# Combine: two weighted steps (keep_far on rank 0, fwd pulled by rank 0 from rank 1) accumulate
# into the same partial rows of rank 0's rdma_recv; rdma returns those partials (unweighted) into
# rank 1's result once both are done; keep adds rank 1's own expert outputs.


def combine_case(hidden: int = 40):
    plan = plan_of("combine2", 2, [
        step("combine", "keep_far", verb="reduce", src=("output",), dst="rdma_recv", weighted=True, line=30),
        step("combine", "fwd", verb="pull", src=("output",), dst="rdma_recv", weighted=True, line=31),
        step("combine", "rdma", verb="pull", deps=("keep_far", "fwd"), src=("rdma_recv",), dst="result", line=32),
        step("combine", "keep", verb="reduce", src=("output",), dst="result", weighted=True, line=33)],
        [kernel("combine_kernel", "kernel", "combine", "keep_far", "fwd", "keep", role="reducer"),
         kernel("combine_proxy", "proxy", "combine", "rdma", role="rdma_poster")])
    T = 3
    b = LayoutBuilder(2, T, hidden=hidden)
    b.buffer("rdma_recv", 0, 3)
    b.buffer("output", 0, 4)
    b.buffer("output", 1, 5)
    y = [f32_to_bf16(RNG.standard_normal((4, hidden), dtype=np.float32)),
         f32_to_bf16(RNG.standard_normal((5, hidden), dtype=np.float32))]
    w_kf = np.array([0.5, 0.25, 1.5, -2.0], np.float32)
    w_fwd = np.array([0.125, 0.75, 3.0], np.float32)
    w_keep = np.array([1.0, 0.5], np.float32)
    kf = b.copy("combine", "keep_far", rank=0, src=0, dst=0, src_buffer="output", src_slots=[0, 1, 2, 3],
                dst_buffer="rdma_recv", dst_slots=[0, 1, 1, 2], weights=w_kf, chunk_starts=[0, 2, 4])
    fw = b.copy("combine", "fwd", rank=0, src=1, dst=0, src_buffer="output", src_slots=[0, 1, 2],
                dst_buffer="rdma_recv", dst_slots=[2, 0, 1], weights=w_fwd, chunk_starts=[0, 1, 3], step_index=1)
    b.copy("combine", "rdma", rank=1, src=0, dst=1, src_buffer="rdma_recv", src_slots=[0, 1, 2],
           dst_buffer="result", dst_slots=[2, 0, 1], waits=[[(kf.flag_id, 2), (fw.flag_id, 2)]], step_index=2)
    b.copy("combine", "keep", rank=1, src=1, dst=1, src_buffer="output", src_slots=[3, 4], dst_buffer="result",
           dst_slots=[0, 0], weights=w_keep, step_index=3)
    f = [bf16_to_f32(v) for v in y]
    part = np.zeros((3, hidden), np.float32)
    for s, d, w in zip([0, 1, 2, 3], [0, 1, 1, 2], w_kf):
        part[d] += w * f[0][s]
    for s, d, w in zip([0, 1, 2], [2, 0, 1], w_fwd):
        part[d] += w * f[1][s]
    res1 = np.zeros((T, hidden), np.float32)
    res1[[2, 0, 1]] += part[[0, 1, 2]]
    res1[0] += w_keep[0] * f[1][3] + w_keep[1] * f[1][4]
    return plan, b.layout(), y, [np.zeros((T, hidden), np.float32), res1]


def test_combine_accumulates_two_steps_into_one_partial():
    plan, layout, y, want = combine_case()
    for _ in range(10):
        res = threads.run_combine(plan, layout, y)
        assert [r.dtype for r in res] == [np.float32, np.float32]
        for r, w in zip(res, want):
            np.testing.assert_allclose(r, w, rtol=1e-6, atol=1e-6)


def test_bf16_widening_is_exact():
    """The weighted accumulate reads bf16 as the high half of an fp32 (1 * x is exact)."""
    jp = jit.compile_plan(combine_case()[0])
    vals = np.array([0.0, -0.0, 1.0, -2.5, 3.140625, 1e-30, 6.5e4, np.inf, -np.inf], np.float32)
    h = f32_to_bf16(vals)
    dst = np.zeros(len(vals), np.float32)
    w = np.ones(1, np.float32)
    jp.row_ops["acc_bf16"](dst.ctypes.data, h.ctypes.data, w.ctypes.data, len(vals))
    np.testing.assert_array_equal(dst, bf16_to_f32(h))


def test_concurrent_accumulates_are_atomic():
    """Two roles on two threads, released together by a gate, add +1 into the same 1024 floats
    20000 times each: no update is lost."""
    hidden, n = 1024, 20000
    plan = plan_of("atomic", 2, [step("combine", "a", verb="reduce", src=("output",), dst="result", weighted=True),
                                 step("combine", "b", verb="pull", src=("output",), dst="result", weighted=True)],
                   [kernel("combine_kernel", "kernel", "combine", "a", "b", role="reducer")])
    b = LayoutBuilder(2, 1, hidden=hidden)
    for r in range(2):
        b.buffer("output", r, 1)
    g = b.gate("combine", "gate", 0, 0)
    cs = np.arange(0, n + 1, 1000)
    waits = [[(g, 1)]] + [[] for _ in range(len(cs) - 2)]
    b.copy("combine", "a", rank=0, src=0, dst=0, src_buffer="output", src_slots=np.zeros(n), dst_buffer="result",
           dst_slots=np.zeros(n), weights=np.ones(n), chunk_starts=cs, waits=waits)
    b.copy("combine", "b", rank=1, src=1, dst=0, src_buffer="output", src_slots=np.zeros(n), dst_buffer="result",
           dst_slots=np.zeros(n), weights=np.ones(n), chunk_starts=cs, waits=waits, step_index=1)
    layout = b.layout()
    mem = threads.HostMemory(layout, "combine")
    for r in range(2):
        mem.set_buffer("output", r, f32_to_bf16(np.ones((1, hidden), np.float32)))
    jp = jit.compile_plan(plan)
    opener = threading.Timer(0.1, lambda: jp.signal_add(mem.flags(0).ctypes.data + 8 * g, 1))
    opener.start()
    threads.execute(plan, layout, "combine", mem)
    opener.join()
    np.testing.assert_array_equal(mem.buffer("combine", "result", 0), np.full((1, hidden), 2 * n, np.float32))


# --------------------------------------------------------------------------------------------
# Bounded waits.


def stuck_case():
    """Rank 1's 'fwd' waits for 'dispatch.push[flow 2].ready', which no copy bumps."""
    plan = plan_of("stuck", 4, [step("dispatch", "push"), step("dispatch", "fwd", deps=("push",), src=("relay",))],
                   [kernel("dispatch_kernel", "kernel", "dispatch", "push", "fwd")])
    b = LayoutBuilder(4, 2, row_bytes=16)
    b.buffer("relay", 1, 2)
    b.buffer("output", 3, 2)
    g = b.gate("dispatch", "push", 2, 1)
    b.copy("dispatch", "fwd", rank=1, src=1, dst=3, src_buffer="relay", src_slots=[0, 1], dst_buffer="output",
           dst_slots=[0, 1], waits=[[(g, 1)]])
    return plan, b.layout()


def test_timeout_names_rank_step_and_flag():
    plan, layout = stuck_case()
    x = [np.zeros((2, 16), np.uint8) for _ in range(4)]
    t0 = time.monotonic()
    with pytest.raises(threads.CpuBackendTimeout) as ei:
        threads.run_dispatch(plan, layout, x, timeout_s=0.2)
    elapsed = time.monotonic() - t0
    assert str(ei.value) == ("epcc: wait timed out after 0.200 s: rank 1 (node 0, gpu 1) step 'fwd' "
                             "flag 'dispatch.push[flow 2].ready' (value 0, waiting for >= 1)")
    e = ei.value
    assert (e.rank, e.program, e.step, e.chunk, e.value, e.expected) == (1, "dispatch", "fwd", 0, 0, 1)
    assert 0.2 <= elapsed < 5.0


def test_timeout_message_matches_epcc_sync_c_format():
    assert threads.timeout_message(1_000_000_000, "rank 3 (node 0, gpu 3)", "fwd", "dispatch.push[flow 2].ready", 5, 7) \
        == ("epcc: wait timed out after 1.000 s: rank 3 (node 0, gpu 3) step 'fwd' "
            "flag 'dispatch.push[flow 2].ready' (value 5, waiting for >= 7)")
    assert threads.timeout_message(12_345_678_901, "rank 0", "s", "f", 0, 1).startswith(
        "epcc: wait timed out after 12.345 s: rank 0 step 's'")


def test_timeout_reports_the_root_of_a_chain_of_stuck_waits():
    """hop1's second chunk waits on a gate nobody opens; hop2 waits on hop1 (stuck at 1 of 2).
    The report names hop1's wait, the cause, and lists both."""
    plan, layout, x, g = relay_case(gate=True)
    # Make the gate hold hop1's *second* chunk: its first goes, so hop1's counter stops at 1.
    hop1 = next(c for c in layout.copies if c.step == "hop1")
    hop1.waits = [[], [(g, 1)]]
    with pytest.raises(threads.CpuBackendTimeout) as ei:
        threads.run_dispatch(plan, layout, x, timeout_s=0.2)
    assert str(ei.value) == ("epcc: wait timed out after 0.200 s: rank 0 (node 0, gpu 0) step 'hop1' "
                             "flag 'dispatch.gate[flow 0].ready' (value 0, waiting for >= 1)")
    assert ei.value.chunk == 1
    stuck = "\n".join(ei.value.stuck)
    assert "rank 1 (node 0, gpu 1) step 'hop2' chunk 0" in stuck
    assert "'dispatch.hop1[flow 0].ready' (value 1, waiting for >= 2)" in stuck


def test_first_timeout_stops_the_other_waits():
    """Role a waits on a gate opened at 0.25 s, then (chunk 1) on one never opened: alone it would
    time out at ~0.55 s.  Role b times out at 0.3 s first, and a gives up then (abort word)."""
    plan = plan_of("abort", 2, [step("dispatch", "a"), step("dispatch", "b")],
                   [kernel("dispatch_kernel", "kernel", "dispatch", "a", "b")])
    b = LayoutBuilder(2, 2, row_bytes=8)
    for r in range(2):
        b.buffer("output", r, 2)
    g1, g2, g3 = (b.gate("dispatch", f"gate{i}", 0, 0) for i in (1, 2, 3))
    b.copy("dispatch", "a", rank=0, src=0, dst=0, src_buffer="input", src_slots=[0, 1], dst_buffer="output",
           dst_slots=[0, 1], chunk_starts=[0, 1, 2], waits=[[(g1, 1)], [(g2, 1)]])
    b.copy("dispatch", "b", rank=1, src=1, dst=1, src_buffer="input", src_slots=[0, 1], dst_buffer="output",
           dst_slots=[0, 1], waits=[[(g3, 1)]])
    layout = b.layout()
    mem = threads.HostMemory(layout, "dispatch")
    jp = jit.compile_plan(plan)
    addr = mem.flags(0).ctypes.data + 8 * g1
    opener = threading.Timer(0.25, lambda: jp.signal_add(addr, 1))
    opener.start()
    t0 = time.monotonic()
    with pytest.raises(threads.CpuBackendTimeout) as ei:
        threads.execute(plan, layout, "dispatch", mem, timeout_s=0.3)
    elapsed = time.monotonic() - t0
    opener.join()
    assert ei.value.step == "b" and ei.value.flag == "dispatch.gate3[flow 0].ready"
    assert any("step 'a' chunk 1: gave up on 'dispatch.gate2[flow 0].ready'" in s for s in ei.value.stuck)
    assert elapsed < 0.5


def test_wait_primitive_directly():
    jp = jit.compile_plan(push_case()[0])
    flag, abort, obs = np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)
    f, a, o = flag.ctypes.data, abort.ctypes.data, obs.ctypes.data
    assert jp.wait(f, 0, 0, a, o) == 0  # already there: no clock read
    t0 = time.monotonic()
    assert jp.wait(f, 1, 50_000_000, a, o) == codegen.STATUS_TIMEOUT
    assert time.monotonic() - t0 >= 0.05
    jp.signal_add(f, 3)
    assert jp.wait(f, 3, 0, a, o) == 0 and obs[0] == 3
    abort[0] = 1
    assert jp.wait(f, 4, 10_000_000_000, a, o) == codegen.STATUS_ABORTED and obs[0] == 3
    # An absolute deadline in the past: one more look, then time out.
    abort[0] = 0
    assert jp.wait_ge(f, 4, 0, a, o) == codegen.STATUS_TIMEOUT
    now = jp.now_ns()
    assert abs(now - time.monotonic_ns()) < 50_000_000  # CLOCK_MONOTONIC, as Python's


# --------------------------------------------------------------------------------------------
# Concurrency is real.


def test_wait_in_a_thread_sees_a_signal_from_another():
    """ctypes drops the GIL in the JIT'd wait, so the main thread can signal meanwhile."""
    jp = jit.compile_plan(push_case()[0])
    flag, abort, obs = np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)
    st = []
    t = threading.Thread(target=lambda: st.append(jp.wait(flag.ctypes.data, 1, 5_000_000_000, abort.ctypes.data,
                                                          obs.ctypes.data)))
    t0 = time.monotonic()
    t.start()
    time.sleep(0.05)
    jp.signal_add(flag.ctypes.data, 1)
    t.join()
    assert st == [0] and obs[0] == 1
    assert time.monotonic() - t0 < 4.0


def test_two_roles_ping_pong_chunk_by_chunk():
    """ping (rank 0) moves row c of its input into rank 1's inbox; pong (rank 1) returns it to
    rank 0's output once ping's chunk c is there, and ping's chunk c+1 waits for pong's chunk c:
    300 round trips, so both threads must make progress together."""
    n = 300
    plan = plan_of("pingpong", 2, [step("dispatch", "ping", dst="inbox"),
                                   step("dispatch", "pong", deps=("ping",), src=("inbox",))],
                   # pong's thread starts first: without its waits it would return zeros
                   [kernel("dispatch_kernel", "kernel", "dispatch", "pong", "ping")])
    b = LayoutBuilder(2, n, row_bytes=8)
    b.buffer("inbox", 1, n)
    b.buffer("output", 0, n)
    ping_flag, pong_flag = 0, 1  # the ids the two copies below get
    b.copy("dispatch", "ping", rank=0, src=0, dst=1, src_buffer="input", src_slots=np.arange(n), dst_buffer="inbox",
           dst_slots=np.arange(n), chunk_starts=np.arange(n + 1), waits=[[(pong_flag, c)] for c in range(n)])
    b.copy("dispatch", "pong", rank=1, src=1, dst=0, src_buffer="inbox", src_slots=np.arange(n), dst_buffer="output",
           dst_slots=np.arange(n), chunk_starts=np.arange(n + 1), waits=[[(ping_flag, c + 1)] for c in range(n)])
    layout = b.layout()
    assert [f.step for f in layout.flags] == ["ping", "pong"]
    x = [RNG.integers(1, 256, size=(n, 8), dtype=np.uint8) for _ in range(2)]
    out = threads.run_dispatch(plan, layout, x, timeout_s=10.0)
    np.testing.assert_array_equal(out[0], x[0])


# --------------------------------------------------------------------------------------------
# The IR.


def test_ir_verifies_and_has_one_driver_per_role():
    plan = combine_case()[0]
    plan.steps += push_case()[0].steps
    plan.kernels += push_case()[0].kernels
    text = codegen.llvm_ir(plan)
    llvm.parse_assembly(text).verify()
    roles = [(k.name, r.step) for k in plan.kernels for r in k.roles]
    defined = [ln.split('@"')[1].split('"')[0] for ln in text.splitlines()
               if ln.startswith("define i32 @\"epcc_") and "__" in ln]
    assert defined == [f"epcc_{k}__{s}" for k, s in roles]
    assert "epcc_dispatch_kernel__push" in defined and "epcc_combine_proxy__rdma" in defined
    # The step's DSL line, kernel and role ride along, as a comment and as metadata.
    assert "; dispatch_kernel (kernel) role sender on sm: step 'push' of dispatch, DSL line 11" in text
    assert '!"epcc_combine_proxy__rdma", !"combine", !"combine_proxy", !"proxy", !"rdma", !"rdma_poster", ' \
           '!"nic", i64 32, !"acc_f32"' in text
    # The flag protocol: acquire loads, release adds, atomic fp32 adds, libc's clock and yield.
    assert 'load atomic i64, ptr %"flag" acquire' in text
    assert 'atomicrmw add ptr %"flag", i64 %"delta" release' in text
    assert text.count("atomicrmw fadd ptr") == 2
    assert 'call i32 @"clock_gettime"(i32 1,' in text and 'call i32 @"sched_yield"()' in text
    assert 'call i32 @"nanosleep"(ptr %"sleep", ptr null)' in text
    assert "@\"llvm.memcpy.p0.p0.i64\"" in text
    # Drivers are specialised by step: a weighted combine step accumulates bf16 rows.
    body = text.split('define i32 @"epcc_combine_kernel__fwd"')[1].split("\n}\n")[0]
    assert 'call void @"epcc_acc_row_bf16"' in body


def test_step_names_become_symbols():
    plan = plan_of("dots", 2, [step("combine", "final.sendbuf", verb="reduce", src=("output",), dst="sendbuf",
                                    weighted=True)],
                   [kernel("combine_kernel", "kernel", "combine", "final.sendbuf")])
    ds = codegen.drivers(plan)
    assert [d.name for d in ds] == ["epcc_combine_kernel__final_sendbuf"]
    llvm.parse_assembly(codegen.llvm_ir(plan)).verify()


def test_jit_is_cached_by_plan():
    plan = push_case()[0]
    a = jit.compile_plan(plan)
    b = jit.compile_plan(push_case()[0])  # an equal plan, another object
    assert a is b
    other = relay_case()[0]
    assert jit.compile_plan(other) is not a
    assert a.key == jit.plan_key(plan)


def test_concurrent_compilations():
    """Ranks running in threads compile the same and different plans at once (LLVM itself is
    not thread-safe: compile_plan serialises it)."""
    plans = [plan_of(f"p{i % 3}", 2, [step("dispatch", "push", line=i % 3)],
                     [kernel("dispatch_kernel", "kernel", "dispatch", "push")]) for i in range(6)]
    got, errors = [None] * len(plans), []

    def build(i):
        try:
            got[i] = jit.compile_plan(plans[i])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=build, args=(i,)) for i in range(len(plans))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert got[0] is got[3] and got[1] is got[4] and len({id(g) for g in got}) == 3


# --------------------------------------------------------------------------------------------
# Bad layouts are refused before any thread runs.


def test_slot_out_of_range_is_refused():
    plan, layout, x, _ = push_case()
    layout.copies[0].dst_slots = np.array([2, 3, 4, 6])
    with pytest.raises(ValueError, match="slot 6 is outside the buffer's 6 rows"):
        threads.run_dispatch(plan, layout, x)


def test_copy_of_a_step_without_a_role_is_refused():
    plan, layout, x, _ = push_case()
    plan.kernels[0].roles = plan.kernels[0].roles[:1]  # no role for keep
    with pytest.raises(ValueError, match="step 'keep' of dispatch, which is no role"):
        threads.run_dispatch(plan, layout, x)


def test_wrong_input_shape_is_refused():
    plan, layout, x, _ = push_case()
    with pytest.raises(ValueError, match=r"'input' of rank 0 must be uint8 \[4, 24\]"):
        threads.run_dispatch(plan, layout, [x[0][:, :8], x[1]])


def test_weighted_copy_without_weights_is_refused():
    plan, layout, y, _ = combine_case()
    next(c for c in layout.copies if c.step == "fwd").weights = None
    with pytest.raises(ValueError, match="needs weights"):
        threads.run_combine(plan, layout, y)
