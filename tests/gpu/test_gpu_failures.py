"""Every rank fails together on the GPUs (runtime/engines/agree.py through the cuda engines): two
ranks, one per GPU, on each engine of `Buffer(backend="cuda")`:

* direct: the direct kernels of the one-hop h200x2_t128 bundle;
* table: the table-driven kernels of h200x2_2vnode_50, whose tables the metadata kernels write
  on the GPU (the routing exchanged over peer memory, a bounded wait that writes an error word
  and traps when a peer does not come);
* proxy: h200x2_2vnode_50_proxy, host-built tables and the RDMA step through the GPU proxy path
  (a proxy thread per program and rank, its wait watched: gpu_proxy/watch.py);
* collective: h200x2_2vnode_50_collective, the table kernel's routing all-gathered by the process
  group (in the exchange's own group; the host's wait watches the marks around each exchange and
  aborts it at the timeout: cuda_table/exchange.py).

Rank 1 fails on purpose in its second dispatch (tests/gpu/fail_worker.py says how: an argument it
refuses, a bad top-k row, a stall or a killed process before the call or at its launch, a proxy
that stops or stalls, a low-latency dispatch it skips) and every surviving rank must raise the
same GroupError, naming rank 1 and why, within the timeout plus SLACK_S, never hang.  Skipped
without 2 GPUs (test_gpu.py's conditions: nvcc, the bundles (tests/gpu/bundles.py), torch).

The ranks are started as torchrun would start them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT; an NCCL group over a TCPStore on 127.0.0.1 that rank 0 hosts), but by this test, so
that a killed rank does not make a launcher end its peer.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from epcc.plan.bundle import load
from epcc.runtime.engines import agree
from epcc.runtime.engines.gpu_proxy.watch import STALL_FRACTION

from test_gpu import BUNDLES, ROOT, _why_not, first_two_gpus

WORKER = Path(__file__).resolve().parent / "fail_worker.py"
ENGINES = {  # engine -> (bundle, the engine class Buffer picks, the first round of a dispatch)
    "direct": ("h200x2_t128", "CudaDirectEngine", "the dispatch's arguments"),
    "table": ("h200x2_2vnode_50", "CudaTableEngine", "the dispatch's arguments"),
    "proxy": ("h200x2_2vnode_50_proxy", "CudaTableEngine", "the routings"),
    "collective": ("h200x2_2vnode_50_collective", "CudaTableEngine", "the dispatch's arguments"),
}
TIMEOUT_S = 5.0
SLACK_S = 5.0  # beyond the timeout: a kernel's trap, the grace a failing rank waits, the ranks' polling
LATE_S = TIMEOUT_S + agree.GRACE_S + 3  # a stalling rank stays away past its peer's timeout and grace
LOST_AT_ONCE = f"no answer within {agree.GRACE_S:g} s of its peers' failure (stalled, or its process died)"
# where the peer waited in the collective metadata exchange: the agreement says so (exchange.py)
LOST_AT_EXCHANGE = (f"no answer within {agree.GRACE_S:g} s of its peers' failure (it did not come to the metadata "
                    f"exchange of bundle 'h200x2_2vnode_50_collective', the process group's all-gather of every "
                    f"rank's routing: it skipped the dispatch, stalled, or its process died)")

pytestmark = pytest.mark.gpu


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(engine: str, case: str, tmp_path: Path) -> list[dict | None]:
    bundle, cls, _ = ENGINES[engine]
    why = _why_not(2, [bundle])
    if why:
        pytest.skip(why)
    out = tmp_path / case
    out.mkdir()
    port = _port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES=first_two_gpus(), NCCL_NVLS_ENABLE="0",
                   TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(BUNDLES / bundle), case, str(out),
                                       str(TIMEOUT_S), str(LATE_S)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
    res = [json.loads(f.read_text()) if (f := out / f"rank{r}.json").exists() else None for r in range(2)]
    for r in range(2):
        if res[r] is not None and res[r].get("status") != "ok":
            pytest.fail(f"rank {r}: {res[r]['status']}\n{logs[r][-6000:]}")
    if res[0] is None:
        pytest.fail(f"rank 0 wrote no result\n{logs[0][-6000:]}")
    assert res[0]["engine"] == cls, res[0]["engine"]
    print("\n".join(f"rank {r}: {res[r] and res[r].get('failed')}" for r in range(2)))
    for r in range(2):  # not bounded here: what the report no longer waits for (exchange.py Exchange.abort)
        if res[r] is not None and res[r].get("exchange_abort") is not None:
            print(f"rank {r}: the exchange's abort took {res[r]['exchange_abort']}")
    return res


def _same(res, ranks, message: str, cls: str, rebuild: bool) -> None:
    for r in ranks:
        got = res[r]["failed"]
        assert (got["message"], got["type"], got["rebuild"]) == (message, cls, rebuild), (r, got)


def _failed_for_good(res, ranks) -> None:
    """The Buffer says so at its next call, naming the first failure."""
    for r in ranks:
        after = res[r]["after"]
        assert not after["ok"] and after["message"].startswith("this Buffer failed in dispatch #2 on rank 1: "), after
        assert after["message"].endswith("; make a new Buffer"), after


@pytest.mark.parametrize("engine", ENGINES)
def test_a_rank_that_refuses_an_argument_is_named_at_once_and_the_buffer_stays_usable(engine, tmp_path):
    """Every rank meets the verdict in the call's first round, before any launch."""
    res = _run(engine, "refuse-host", tmp_path)
    wl = load(BUNDLES / ENGINES[engine][0]).plan.workload
    T, K = wl.tokens, wl.topk
    msg = f"dispatch #2 failed on rank 1: dispatch: topk_idx must have shape [{T}, {K}], got [{T}, {K - 1}]"
    _same(res, (0, 1), msg, "GroupValueError", False)
    for r in (0, 1):
        assert res[r]["failed"]["elapsed"] < agree.GRACE_S and res[r]["failed"]["state"] == "ready", res[r]
        assert res[r]["again"] and res[r]["after"]["ok"], res[r]  # usable again


@pytest.mark.parametrize("engine", ENGINES)
def test_a_bad_topk_row_reaches_every_rank(engine, tmp_path):
    """A repeated expert in rank 1's row 3: the kernels skip it and every rank hears it in the
    verdict round after the read-back (direct, table), or the host refuses it before its routing
    is exchanged (proxy: host-built tables); either way the Buffer stays usable."""
    res = _run(engine, "refuse-device", tmp_path)
    E = load(BUNDLES / ENGINES[engine][0]).plan.workload.experts
    msg = res[1]["failed"]["message"]
    assert msg.startswith(f"dispatch #2 failed on rank 1: dispatch: topk_idx row 3 names an expert outside "
                          f"[-1, {E - 1}] or the same expert twice"), msg
    _same(res, (0, 1), msg, "GroupValueError", False)
    assert all(res[r]["failed"]["elapsed"] < SLACK_S and res[r]["again"] for r in (0, 1)), res


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", ["stall", "killed"])
def test_a_rank_that_does_not_come_is_named_by_its_peer(engine, case, tmp_path):
    """Rank 1 is not there for the call's first round: its peer names it after the timeout (no
    launch); a late rank hears the same verdict at once when it comes."""
    res = _run(engine, case, tmp_path)
    phase = ENGINES[engine][2]
    msg = f"dispatch #2 failed on rank 1: no answer within {TIMEOUT_S:g} s at {phase} (stalled, or its process died)"
    _same(res, (0,) if case == "killed" else (0, 1), msg, "GroupTimeout", True)
    assert TIMEOUT_S <= res[0]["failed"]["elapsed"] < TIMEOUT_S + SLACK_S, res[0]
    if case == "stall":
        assert res[1]["failed"]["elapsed"] < 1.0, res[1]  # the late rank hears the verdict before it launches
        _failed_for_good(res, (0, 1))
    else:
        assert res[1] is None
        _failed_for_good(res, (0,))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", ["stall-mid", "killed-mid"])
def test_a_rank_that_stops_at_its_launch_is_named_by_its_peer(engine, case, tmp_path):
    """Rank 1 passed the call's first round, then stalls or dies where its GPU work would start:
    its peer's kernels (or metadata exchange) wait for it, give up after the timeout and trap (the
    collective exchange: the host's watch aborts it), and the peer names rank 1 once the grace for
    its answer has passed.  A stalled rank that comes back raises the same error."""
    res = _run(engine, case, tmp_path)
    msg = f"dispatch #2 failed on rank 1: {LOST_AT_EXCHANGE if engine == 'collective' else LOST_AT_ONCE}"
    _same(res, (0,) if case == "killed-mid" else (0, 1), msg, "GroupTimeout", True)
    took = res[0]["failed"]["elapsed"]
    assert took < TIMEOUT_S + SLACK_S, res[0]
    if case == "stall-mid":
        assert took >= TIMEOUT_S, res[0]  # it waited for its kernels' bound
        assert res[1]["failed"]["elapsed"] < LATE_S + TIMEOUT_S + SLACK_S, res[1]
        _failed_for_good(res, (0, 1))
    else:
        assert res[1] is None
        _failed_for_good(res, (0,))


def test_a_proxy_that_stops_on_one_rank_fails_every_rank_at_once(tmp_path):
    """Rank 1's dispatch proxy ends (status 2) while the kernels need it: rank 1's watched wait
    posts it, rank 0's hears the alarm; both name rank 1 long before a kernel's timeout."""
    res = _run("proxy", "proxy-fails", tmp_path)
    msg = ("dispatch #2 failed on rank 1: the GPU proxy of the dispatch program stopped: epcc rdma: the GPU proxy "
           "failed (status 2)")
    _same(res, (0, 1), msg, "GroupTimeout", True)
    assert all(res[r]["failed"]["elapsed"] < TIMEOUT_S for r in (0, 1)), res
    _failed_for_good(res, (0, 1))


def test_a_proxy_that_stalls_on_one_rank_is_named_by_every_rank(tmp_path):
    """Rank 1's dispatch proxy takes none of the entries its kernels publish: after half the
    timeout rank 1 names its own proxy and rank 0 gives up with that error, before either rank's
    kernels time out (which would name rank 0, the lowest rank)."""
    res = _run("proxy", "proxy-stalls", tmp_path)
    stall = TIMEOUT_S * STALL_FRACTION
    msg = res[1]["failed"]["message"]
    assert re.fullmatch(rf"dispatch #2 failed on rank 1: the GPU proxy of the dispatch program has not taken entry "
                        rf"\d+ of FIFO \d+ in {stall:g} s \(stalled\)", msg), msg
    _same(res, (0, 1), msg, "GroupTimeout", True)
    assert all(stall <= res[r]["failed"]["elapsed"] < TIMEOUT_S + SLACK_S for r in (0, 1)), res
    _failed_for_good(res, (0, 1))


def test_a_rank_that_skips_a_low_latency_dispatch_is_named_at_the_collective_exchange(tmp_path):
    """Rank 1 skips a low-latency dispatch (no host round meets it): rank 0's group all-gather
    waits for it until rank 0's Buffer.synchronize() gives up at the timeout, aborts the exchange
    and names rank 1, the bundle and the step (not torch's NCCL watchdog after 10 minutes); rank
    1, back with a normal-mode dispatch, hears the same error at once."""
    res = _run("collective", "skip-ll", tmp_path)
    _same(res, (0, 1), f"dispatch #2 failed on rank 1: {LOST_AT_EXCHANGE}", "GroupTimeout", True)
    assert TIMEOUT_S <= res[0]["failed"]["elapsed"] < TIMEOUT_S + SLACK_S, res[0]
    assert res[1]["failed"]["elapsed"] < 1.0, res[1]
    _failed_for_good(res, (0, 1))
