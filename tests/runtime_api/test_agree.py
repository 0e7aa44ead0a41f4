"""The rounds every engine fails through (runtime/engines/agree.py), ranks as threads over one
in-memory store (torch's HashStore): no process, no group, a second or two in all.

Each case runs a function per rank and looks at what every rank returned or raised: the same
GroupError on every rank, naming the rank that failed and why, at once for a refused argument
and within the timeout for a rank that stalls; the Buffer's state after it."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from epcc.runtime.engines import agree as ag  # noqa: E402
from epcc.runtime.engines.base import GroupError, KernelTimeout  # noqa: E402
from epcc.runtime.engines.cpu.threads import CpuBackendTimeout  # noqa: E402

TIMEOUT_S = 0.5


def run(size: int, body, store=None) -> list:
    """body(agreement, rank) on `size` threads; per rank what it returned, or (the GroupError,
    seconds it took, the agreement's state)."""
    store = store or dist.HashStore()
    out: list = [None] * size

    def one(r: int) -> None:
        a = ag.Agreement(store, r, size, TIMEOUT_S)
        t0 = time.monotonic()
        try:
            out[r] = body(a, r)
        except GroupError as e:
            out[r] = (e, time.monotonic() - t0, a.state)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def same_error(out: list, message: str, cls=GroupError, rebuild: bool = True, ranks=None) -> list[float]:
    """Every rank in `ranks` (default all) raised `cls` with `message`; their times."""
    times = []
    for r in (range(len(out)) if ranks is None else ranks):
        e, took, state = out[r]
        assert type(e) is cls and str(e) == message and e.rebuild is rebuild, (r, type(e), str(e), e.rebuild)
        assert state == ("failed" if rebuild else "ready"), (r, state)
        times.append(took)
    return times


def test_rounds_give_every_rank_every_payload_in_rank_order():
    def body(a, r):
        with a.call("dispatch"):
            first = a.gather("routing", r * 10)
            a.barrier("written")
        with a.call("dispatch"):
            return first, a.exchange("routing", bytes([r]))

    store = dist.HashStore()
    out = run(3, body, store)
    assert out == [([0, 10, 20], [b"\0", b"\1", b"\2"])] * 3
    assert store.num_keys() <= 3 + 3 + 2  # the counters and the last round's keys: earlier rounds deleted


def test_a_refused_argument_reaches_every_rank_and_the_buffer_stays_usable():
    def body(a, r):
        try:
            with a.call("dispatch"):
                if r == 1:
                    raise ValueError("dispatch: topk_idx must be int64")
                a.gather("routing", r)
        except GroupError as e:
            seen = (type(e).__name__, isinstance(e, ValueError), str(e), e.rank, e.rebuild, a.state)
        with a.call("dispatch"):
            return seen, a.gather("routing", r)

    out = run(3, body)
    want = ("GroupValueError", True, "dispatch #1 failed on rank 1: dispatch: topk_idx must be int64", 1, False,
            "ready")
    assert out == [(want, [0, 1, 2])] * 3


def test_ranks_refusing_for_one_reason_are_named_together():
    def body(a, r):
        with a.call("combine"):
            if r != 1:
                raise TypeError("combine: x must be a torch.Tensor, not list")
            a.barrier("arguments")

    out = run(3, body)
    same_error(out, "combine #1 failed on ranks 0, 2: combine: x must be a torch.Tensor, not list", ag.GroupTypeError,
               rebuild=False)


def test_a_failure_after_data_moved_fails_the_buffer_for_good():
    def body(a, r):
        with a.call("dispatch"):
            a.barrier("routing")
            if r == 2:
                raise RuntimeError("out of peer memory")
            a.barrier("written")

    out = run(3, body)
    times = same_error(out, "dispatch #1 failed on rank 2: out of peer memory")
    assert max(times) < 0.3

    def again(a, r):
        try:
            with a.call("dispatch"):
                a.barrier("routing")
                raise RuntimeError("boom")
        except GroupError:
            pass
        with a.call("combine"):
            pass

    out = run(2, again)
    for e, _, state in out:
        assert str(e) == "this Buffer failed in dispatch #1 on ranks 0, 1: boom; make a new Buffer"
        assert state == "failed"


def test_a_stalled_rank_is_named_within_the_timeout_and_hears_the_verdict_when_it_comes():
    def body(a, r):
        with a.call("dispatch"):
            a.barrier("routing")
        if r == 2:
            time.sleep(TIMEOUT_S + 0.3)
        with a.call("dispatch"):
            a.barrier("the routing exchange")

    out = run(3, body)
    times = same_error(out, "dispatch #2 failed on rank 2: no answer within 0.5 s at the routing exchange (stalled, "
                            "or its process died)", ag.GroupTimeout)
    assert TIMEOUT_S <= times[0] < TIMEOUT_S + 0.3 and TIMEOUT_S <= times[1] < TIMEOUT_S + 0.3
    assert times[2] < TIMEOUT_S + 0.3 + 0.2  # the sleep, then the verdict at once


def test_a_kernel_s_refusal_and_its_peers_timeouts_name_the_refusing_rank():
    """The CUDA engine's way: a rank refuses before its launch and raises at once (wait_s=0); its
    peers' kernels give up later (a KernelTimeout, posted with fail()), and name it too."""
    def body(a, r):
        with a.call("dispatch"):
            if r == 1:
                a.fail(ValueError("dispatch: x must be contiguous"), wait_s=0, fatal=True)
            time.sleep(0.2)  # the kernel's bounded wait for rank 1
            a.fail(KernelTimeout(f"epcc: wait timed out after 0.200 s: rank {r}: meta flag of rank 1"))

    out = run(3, body)
    times = same_error(out, "dispatch #1 failed on rank 1: dispatch: x must be contiguous", ag.GroupValueError)
    assert times[1] < 0.05 and all(0.2 <= t < 0.3 for t in (times[0], times[2]))
    assert out[0][0].failures[2].startswith("epcc: wait timed out")  # the others' reports are kept, not said


@pytest.mark.parametrize("late_s, root", [
    (0.1, "rank 0: epcc: wait timed out after 0.500 s: rank 0: tokens of rank 1"),  # within rank 0's grace
    (0.4, "rank 1: no answer within 0.2 s of its peers' failure (stalled, or its process died)"),  # after it
])
def test_a_late_rank_heeds_an_alarm_before_it_launches(monkeypatch, late_s, root):
    monkeypatch.setattr(ag, "GRACE_S", 0.2)

    def body(a, r):
        with a.call("dispatch"):
            if r == 0:
                a.fail(KernelTimeout("epcc: wait timed out after 0.500 s: rank 0: tokens of rank 1"))
            time.sleep(late_s)
            a.heed()  # rank 1: before its launch
            return "launched"

    out = run(2, body)
    times = same_error(out, f"dispatch #1 failed on {root}", ag.GroupTimeout)
    assert times[1] < late_s + 0.05


def test_watch_calls_back_when_a_peer_fails():
    seen = []

    def body(a, r):
        with a.call("dispatch"):
            if r == 0:
                time.sleep(0.1)
                raise RuntimeError("driver table broken")
            with a.watch(lambda: seen.append(time.monotonic())):
                t0 = time.monotonic()
                while not seen and time.monotonic() < t0 + 2:
                    time.sleep(0.005)  # a local wait that gives up when told
            raise CpuBackendTimeout("epcc: wait timed out after 2.000 s: rank 1", rank=1, program="dispatch",
                                    step="land", chunk=0, flag_id=0, flag="f", value=0, expected=1, timeout_s=2.0,
                                    stuck=["rank 1 step 'land' chunk 0: gave up on 'f' (value 0, waiting for >= 1)"])

    out = run(2, body)
    times = same_error(out, "dispatch #1 failed on rank 0: driver table broken")
    assert seen and times[1] < 0.5  # told by the alarm, not after its own 2 s
    assert out[0][0].failures[1].startswith("epcc: wait timed out")


def test_ranks_at_different_calls_are_told_apart():
    def body(a, r):
        with a.call("dispatch" if r == 0 else "combine"):
            a.barrier("arguments")

    out = run(2, body)
    for e, _, state in out:
        assert "(every rank must make the same calls in the same order)" in str(e) and state == "failed", str(e)
    for e, _, _ in out:
        assert str(e) == ("dispatch #1 failed on rank 1: it was at combine #1: arguments, rank 0 at dispatch #1: "
                          "arguments (every rank must make the same calls in the same order)")


def test_an_unreachable_store_is_said_at_once():
    class Gone:
        def __getattr__(self, name):
            def op(*a, **k):
                raise RuntimeError("Connection reset by peer")
            return op

    def body(a, r):
        with a.call("dispatch"):
            a.barrier("routing")

    out = run(1, body, Gone())
    e, took, state = out[0]
    assert type(e) is ag.GroupTimeout and took < 0.1 and state == "failed"
    assert str(e) == ("dispatch #1 failed: the group's store is unreachable (Connection reset by peer); the rank that "
                      "hosts it (rank 0 of the world under torchrun) may have died")


@pytest.mark.parametrize("error, kind", [
    (TypeError("x"), "type"), (ValueError("x"), "value"), (RuntimeError("x"), "error"), (KeyError("x"), "error"),
    (KernelTimeout("x"), "timeout"), (ag.GaveUp("x"), "aborted"),
])
def test_kinds_of_errors(error, kind):
    assert ag.describe(error)[0] == kind


def test_a_python_error_is_named_by_its_type():
    assert ag.describe(KeyError("plan"))[1] == "KeyError: 'plan'"
    assert ag.describe(MemoryError())[1] == "MemoryError"
    assert ag.describe(ValueError("dispatch: bad"))[1] == "dispatch: bad"


def test_the_root_cause_comes_first():
    failures = {0: ("timeout", "waited for rank 2", "dispatch #3"), 1: ("aborted", "gave up", "dispatch #3"),
                2: ("lost", "no answer", "dispatch #3"), 3: ("timeout", "waited for rank 2", "dispatch #3")}
    assert str(ag.compose(failures, rebuild=True)) == "dispatch #3 failed on rank 2: no answer"
    failures[3] = ("value", "dispatch: bad topk", "dispatch #3")
    e = ag.compose(failures, rebuild=True)
    assert (type(e), str(e), e.rank) == (ag.GroupValueError, "dispatch #3 failed on rank 3: dispatch: bad topk", 3)


def test_verdicts_after_consistent_work_keep_the_buffer_usable():
    """A refusal every rank learns only after its work (a bad routing row the kernels ignored,
    read back once they finished), in the call's second round: every rank raises the same error,
    naming the rank, and the Buffer stays usable; a round where none refuses passes."""
    def body(a, r):
        with a.call("dispatch"):
            a.barrier("the dispatch's arguments")
            a.verdicts("the dispatch's read-back", None)
        try:
            with a.call("dispatch"):
                a.barrier("the dispatch's arguments")
                a.verdicts("the dispatch's read-back", ValueError("dispatch: topk_idx row 3 names ...") if r == 2
                           else None)
        except GroupError as e:
            seen = (type(e).__name__, str(e), e.rebuild, a.state)
        with a.call("dispatch"):
            return seen, a.gather("routing", r)

    out = run(3, body)
    want = ("GroupValueError", "dispatch #2 failed on rank 2: dispatch: topk_idx row 3 names ...", False, "ready")
    assert out == [(want, [0, 1, 2])] * 3
