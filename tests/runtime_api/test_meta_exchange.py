"""The metadata kernels' routing exchange across CUDA IPC domains (runtime/engines/cuda_table/
exchange.py): the process group's in-place all-gather of each rank-major region of a gather area.
Driven here with gloo and CPU tensors, one process per rank (the collective is the group's: NCCL
on the GPU machine runs the same calls): after every rank wrote only its own slot, every rank's
two regions (token counts, slot words) hold every rank's slot, with uneven token counts, a rank
with none, and the bytes outside the regions (the padding) untouched.

A rank that does not come to an exchange: its peers give up at the Buffer's timeout, not torch's,
and every rank names it, the bundle and the step (gloo: the exchange's own group's timeout; the
GPU's watch of the marks around each exchange, with a watched wait and the agreement, as the
engine drives them)."""

from __future__ import annotations

import json
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from epcc.runtime.engines import agree
from epcc.runtime.engines.base import GroupError
from epcc.runtime.engines.cuda_table.exchange import (READ_S, Exchange, ExchangeTimeout, ExchangeWatch,
                                                      all_gather_slots, area_regions)
from epcc.runtime.engines.gpu_proxy.watch import Watches, WatchFailed, wait_watched
from epcc.runtime.testing.ranks import spawn_ranks

T, K, E = 24, 4, 32
GARBAGE = 0x5A  # what the other ranks' slots and the bytes outside the regions start as


def area_offsets(num_ranks: int) -> tuple[int, int, int]:
    """(bytes, tokens, slot words offsets) of a gather area: epcc_table_meta_area's layout
    (templates/table_meta.cu.j2: counts [R] int padded to 16 bytes, then the slot words [R][T][K]
    u64)."""
    routing = (4 * num_ranks + 15) // 16 * 16
    return routing + 8 * num_ranks * T * K, 0, routing


def slot_words(n: int, idx: np.ndarray, w: np.ndarray, tag: int) -> np.ndarray:
    """What gather_copy writes of a routing (epcc/table/meta.cuh slot_word): per slot the expert's
    code (0xffff none, 0xfffe past the rank's tokens), the tag, the weight's bits."""
    code = np.where(idx < 0, 0xFFFF, idx).astype(np.uint64)
    code[n:] = 0xFFFE
    bits = w.view(np.uint32).astype(np.uint64)
    bits[n:] = 0
    return ((bits << np.uint64(32)) | np.uint64(tag << 16) | code).view(np.int64)


def routing(rank: int, num_ranks: int) -> tuple[int, np.ndarray, np.ndarray]:
    """A rank's slot as gather_copy writes it: its token count (uneven, rank 1 none) and its slot
    words (its top-k experts and weights, padded to T with absent tokens), of tag 1."""
    n = 0 if rank == 1 else T - 5 * rank
    rng = np.random.default_rng(100 + rank)
    idx = np.full((T, K), -1, dtype=np.int32)
    w = np.zeros((T, K), dtype=np.float32)
    for t in range(n):
        idx[t] = rng.choice(E, size=K, replace=False)
        idx[t, rng.integers(K)] = -1  # a masked slot
        w[t] = rng.random(K, dtype=np.float32)
    return n, slot_words(n, idx, w, 1)


def _worker(rank: int, num_ranks: int, store: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=num_ranks)
    try:
        size, off_tokens, off_routing = area_offsets(num_ranks)
        area = torch.full((size,), GARBAGE, dtype=torch.uint8)
        regions = area_regions(area, num_ranks, T, K, off_tokens, off_routing)
        n, words = routing(rank, num_ranks)
        regions[0][rank] = n
        regions[1][rank] = torch.from_numpy(words)
        outside = area.clone()
        all_gather_slots(regions, rank, dist.group.WORLD)
        want = [routing(r, num_ranks) for r in range(num_ranks)]
        assert regions[0].tolist() == [x[0] for x in want]
        assert np.array_equal(regions[1].numpy(), np.stack([x[1] for x in want]))
        # the same bytes through the area itself, and nothing outside the two regions written
        ends = [(off_tokens, off_tokens + 4 * num_ranks), (off_routing, size)]
        mask = torch.ones(size, dtype=torch.bool)
        for a, b in ends:
            mask[a:b] = False
        assert torch.equal(area[mask], outside[mask])
        assert np.array_equal(area[off_routing:].numpy().view(np.int64).reshape(num_ranks, T, K),
                              regions[1].numpy())
        # a second exchange with other routings overwrites every slot (a fresh routing per dispatch)
        regions[0][rank] = T - rank
        regions[1][rank] = torch.from_numpy(np.roll(words, 1, axis=0))
        all_gather_slots(regions, rank, dist.group.WORLD)
        assert regions[0].tolist() == [T - r for r in range(num_ranks)]
        assert np.array_equal(regions[1].numpy(),
                              np.stack([np.roll(routing(r, num_ranks)[1], 1, axis=0) for r in range(num_ranks)]))
        Path(results, f"ok-{rank}").write_text("ok", encoding="utf-8")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_every_rank_gets_every_slot_in_place(tmp_path, num_ranks):
    results = tmp_path / "results"
    results.mkdir()
    mp.spawn(_worker, args=(num_ranks, str(tmp_path / "store"), str(results)), nprocs=num_ranks, join=True)
    assert sorted(p.name for p in results.iterdir()) == [f"ok-{r}" for r in range(num_ranks)]


def test_the_regions_are_views_of_the_area():
    """What the collective writes is the area the metadata kernels read: the regions share its
    storage at the offsets epcc_table_meta_area gives, rank-major."""
    size, off_tokens, off_routing = area_offsets(3)
    area = torch.zeros(size, dtype=torch.uint8)
    counts, words = area_regions(area, 3, T, K, off_tokens, off_routing)
    assert (counts.shape, words.shape) == ((3,), (3, T, K))
    words[2, 1, 3] = -7
    words[1, 0, 0] = 1 << 40
    counts[2] = 9
    assert area[off_routing:].numpy().view(np.int64)[(2 * T + 1) * K + 3] == -7
    assert area[off_routing:].numpy().view(np.int64)[T * K] == 1 << 40
    assert area[off_tokens:off_routing].numpy().view(np.int32)[2] == 9


# ---------------------------------------------------------------- a rank that does not come

BOUND_S = 1.0  # the Buffer's timeout in these tests
SLACK_S = 1.5  # beyond a bound: process start-up, gloo's and the store's polling
BUNDLE = "h200x2_2vnode_50_collective"
LOST = (f"no answer within {agree.GRACE_S:g} s of its peers' failure (it did not come to the metadata exchange of "
        f"bundle '{BUNDLE}', the process group's all-gather of every rank's routing: it skipped the dispatch, "
        f"stalled, or its process died)")


def _skipper(rank: int, num_ranks: int, members: list[int], store: str, results: str) -> None:
    """One rank of a group (`members` of the world) whose group rank 1 skips the second exchange
    (the first: the Buffer's own, every rank); what each raised, and when, as JSON."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=num_ranks)
    out: dict = {}
    try:
        group = dist.group.WORLD if len(members) == num_ranks else dist.new_group(members)  # every rank makes it
        if rank not in members:
            out["status"] = "not a member"
            return
        me = dist.get_rank(group)
        a = agree.Agreement.for_group(group, BOUND_S)
        x = Exchange(group, BOUND_S, BUNDLE, torch.device("cpu"))
        size, off_tokens, off_routing = area_offsets(len(members))
        regions = area_regions(torch.zeros(size, dtype=torch.uint8), len(members), T, K, off_tokens, off_routing)
        regions[0][me] = me + 1
        x.all_gather(regions)
        out["first"] = regions[0].tolist()
        t0 = time.monotonic()
        try:
            with a.call("dispatch"):
                if me == 1:  # skips the exchange: late for everything after it
                    time.sleep(BOUND_S + agree.GRACE_S + SLACK_S)
                    t0 = time.monotonic()
                    a.barrier("the dispatch's arguments")
                else:
                    try:
                        x.all_gather(regions)
                    except ExchangeTimeout as e:
                        out["exchange"] = {"elapsed": time.monotonic() - t0, "message": str(e)}
                        x.abort()
                        raise
            out["failed"] = {"ok": True}
        except GroupError as e:
            out["failed"] = {"elapsed": time.monotonic() - t0, "type": type(e).__name__, "message": str(e),
                             "rank": e.rank, "failures": {str(r): m for r, m in e.failures.items()}}
        out["status"] = "ok"
    except BaseException:  # noqa: BLE001 - reported to the test
        out["status"] = traceback.format_exc()
    finally:
        Path(results, f"rank{rank}.json").write_text(json.dumps(out), encoding="utf-8")
        time.sleep(agree.GRACE_S + SLACK_S)  # the store (a file) outlives every rank's last round
        dist.destroy_process_group()


@pytest.mark.parametrize("num_ranks, members", [(2, [0, 1]), (3, [0, 2])], ids=["world", "subgroup"])
def test_a_rank_that_skips_the_exchange_is_named_within_the_bound(tmp_path, num_ranks, members):
    """Group rank 1 does not come to an exchange: its peer's gloo all-gather (in the exchange's own
    group, torch's timeout the Buffer's) ends at the bound, and the agreement names rank 1, the
    bundle and the step on both ranks; never torch's 30-minute gloo timeout.  With a subgroup, the
    rank outside it takes no part in making the exchange's group."""
    hung = spawn_ranks(_skipper, lambda r: (r, num_ranks, members, str(tmp_path / "store"), str(tmp_path)),
                       num_ranks, timeout_s=120)
    assert not hung, f"ranks {hung} still waiting after 120 s"
    res = {r: json.loads((tmp_path / f"rank{r}.json").read_text(encoding="utf-8")) for r in range(num_ranks)}
    assert all(res[r]["status"] == "ok" for r in members), res
    first, second = (res[r] for r in members)
    assert first["first"] == second["first"] == [1, 2]  # the Buffer's own exchange, every rank there
    ex = first["exchange"]
    assert BOUND_S <= ex["elapsed"] < BOUND_S + SLACK_S, ex
    assert ex["message"].startswith(f"the metadata exchange of bundle '{BUNDLE}' (the process group's all-gather of "
                                    f"every rank's routing) did not complete ("), ex
    assert ex["message"].endswith(") on rank 0: a rank of the group did not come to it (it skipped the dispatch, "
                                  "stalled, or its process died)"), ex
    for got in (first["failed"], second["failed"]):
        assert (got["type"], got["message"], got["rank"]) == ("GroupTimeout", f"dispatch #1 failed on rank 1: {LOST}",
                                                             1), got
    assert first["failed"]["failures"] == {"0": ex["message"], "1": LOST}, first["failed"]
    assert BOUND_S + agree.GRACE_S <= first["failed"]["elapsed"] < BOUND_S + agree.GRACE_S + SLACK_S, first
    assert second["failed"]["elapsed"] < SLACK_S, second  # the late rank hears the verdict at once


def _one_after_another(rank: int, num_ranks: int, store: str, results: str) -> None:
    """Three Buffers' exchanges in turn: the first closed, the second aborted after rank 1 skipped
    it, the third must meet its own peers (not a retired group's rendezvous in the store)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=num_ranks)
    seen = []
    try:
        for i in range(3):
            x = Exchange(dist.group.WORLD, BOUND_S, BUNDLE, torch.device("cpu"))
            slots = torch.zeros(num_ranks, 2, dtype=torch.int32)
            slots[rank] = 10 * i + rank
            x.all_gather([slots])
            seen.append(slots[:, 0].tolist())
            if i == 1:
                try:
                    if rank == 0:
                        x.all_gather([slots])  # rank 1 does not come
                except ExchangeTimeout:
                    seen.append("timed out")
                x.abort()
                assert x.join(60) and x.abort_error is None, x.abort_error  # its own thread's
            else:
                x.close()
            dist.barrier()  # the test's own: every rank at the next Buffer
        Path(results, f"rank{rank}.json").write_text(json.dumps(seen), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def test_an_exchange_made_after_others_were_closed_or_aborted_meets_its_own_peers(tmp_path):
    mp.spawn(_one_after_another, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text(encoding="utf-8")) for r in range(2)]
    assert got[0] == [[0, 1], [10, 11], "timed out", [20, 21]], got
    assert got[1] == [[0, 1], [10, 11], [20, 21]], got


def test_the_watch_names_an_exchange_that_entered_and_did_not_leave_in_the_bound():
    """On the GPU the stream bumps [entered, left] around every exchange; a wait's watch reads
    them every READ_S (not at its first look: a healthy launch is done by then) and counts the
    bound from the first read that saw one in flight, anew when they move."""
    marks: list = [None]
    reads: list[float] = []

    def read():
        reads.append(now)
        return marks[0]

    w = ExchangeWatch(read, 2.5, BUNDLE, 3)
    for now, m in [(10.0, (1, 0)), (10.0 + READ_S / 2, (1, 0))]:
        marks[0] = m
        w.check(now)
    assert reads == []  # not before READ_S
    steps = [(10.01, None), (10.02, (1, 1)),  # none landed yet, then none in flight
             (11.0, (2, 1)), (13.49, (2, 1)),  # in flight since 11.0: not yet 2.5 s
             (13.5, (3, 2)), (15.99, (3, 2)),  # it moved: counted anew from 13.5
             (16.0, (3, 3)), (20.0, (4, 3))]  # it left; the next one entered, seen at 20.0
    for now, m in steps:
        marks[0] = m
        w.check(now)
        w.check(now + READ_S / 2)  # between two reads: no read
    assert reads == [t for t, _ in steps]
    now = 22.5
    with pytest.raises(ExchangeTimeout) as e:
        w.check(now)
    assert str(e.value) == (f"the metadata exchange of bundle '{BUNDLE}' (the process group's all-gather of every "
                            f"rank's routing) did not complete within 2.5 s on rank 3: a rank of the group did not "
                            f"come to it (it skipped the dispatch, stalled, or its process died)")
    assert isinstance(e.value, WatchFailed) and f"({e.value.lost_why})" in LOST


class _SlowAbort:
    """The exchange's group as NCCL's aborts on the GPU: its abort returns `cost_s` after the call
    (torch's abort of an NCCL group waits for the device, so for the rest of the rank's stream: the
    kernels after the all-gather, which wait for the missing rank up to the Buffer's timeout)."""

    def __init__(self, group, cost_s: float):
        self.group, self.cost_s = group, cost_s
        self.calls: list[tuple[float, float]] = []  # (began, ended), monotonic

    def abort(self) -> None:
        began = time.monotonic()
        time.sleep(self.cost_s)
        self.group.abort()
        self.calls.append((began, time.monotonic()))


@pytest.fixture
def world_of_one():
    """A gloo world of this process alone: the group an Exchange is made from."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


#: When the late rank comes back: after its peer's bound and grace.
LATE_S = BOUND_S + agree.GRACE_S + SLACK_S
#: A slow abort of its peer's group (begun at the bound) returns half a bound after that, while
#: the late rank's round still waits: a report that waited for it would be late and name rank 0.
ABORT_S = LATE_S - BOUND_S / 2


@pytest.mark.parametrize("abort_s", [0.0, ABORT_S], ids=["quick-abort", "abort-outlasts-the-late-rank"])
def test_a_watched_wait_aborts_the_exchange_and_names_the_rank_that_did_not_come(world_of_one, abort_s):
    """The GPU's path on the CPU: rank 0 waits for a launch behind an exchange that entered and
    never left (rank 1 never came); its watched wait gives up at the bound, aborts the exchange
    (on_fail: Exchange.abort, as the engine's) and posts; rank 1, late, hears the same error at its
    next round.  The report does not wait for the group's abort, however long that takes: where it
    did, rank 0 posted after rank 1 had come back and named itself, late (2 x H200, 2026-11-27)."""
    store = dist.HashStore()
    x = Exchange(world_of_one, BOUND_S, BUNDLE, torch.device("cpu"))
    slow = x.group = _SlowAbort(x.group, abort_s)
    out: dict = {}

    def rank0() -> None:
        a = agree.Agreement(store, 0, 2, BOUND_S)
        t0 = time.monotonic()
        out["t0"] = t0
        try:
            with a.call("dispatch"):
                wait_watched(lambda: False, Watches([ExchangeWatch(lambda: (2, 1), BOUND_S, BUNDLE, 0)]), a,
                             on_fail=x.abort)
        except GroupError as e:
            out[0] = (e, time.monotonic() - t0)

    def rank1() -> None:
        a = agree.Agreement(store, 1, 2, BOUND_S)
        time.sleep(LATE_S)
        t0 = time.monotonic()
        try:
            with a.call("dispatch"):
                a.barrier("the dispatch's arguments")
        except GroupError as e:
            out[1] = (e, time.monotonic() - t0)

    threads = [threading.Thread(target=f) for f in (rank0, rank1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(k for k in out if k != "t0") == [0, 1], out
    for r in (0, 1):
        e, _ = out[r]
        want = ("GroupTimeout", f"dispatch #1 failed on rank 1: {LOST}", 1, True)
        assert (type(e).__name__, str(e), e.rank, e.rebuild) == want, (r, str(e))
    assert BOUND_S + agree.GRACE_S <= out[0][1] < BOUND_S + agree.GRACE_S + SLACK_S, out[0]
    assert out[1][1] < SLACK_S, out[1]
    x.join(60)
    assert len(slow.calls) == 1, slow.calls
    began, ended = (t - out["t0"] for t in slow.calls[0])
    assert BOUND_S <= began < BOUND_S + SLACK_S, slow.calls
    assert ended >= began + abort_s, slow.calls
    x.abort()  # once
    x.join(60)
    assert len(slow.calls) == 1, slow.calls
