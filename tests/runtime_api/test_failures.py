"""Every rank fails together, promptly (runtime/engines/agree.py), on the CPU engines.

One rank of a group fails on purpose: (a) it refuses an argument, (b) it stalls (comes to a call
late, or its drivers stall inside one), (c) its process is killed.  Every other rank must raise
the same GroupError, naming the failing rank and why, within the timeout plus a few seconds; then
the Buffer is usable again (a refused argument) or says it must be rebuilt, and a new one works.

Buffer(backend="cpu"): ranks spawned as in test_buffer.py, joined by a gloo group over a TCPStore
on 127.0.0.1 (torchrun's env:// rendezvous); each rank writes what it saw to a JSON file.  The
one-process-per-rank runner (cpu_procs.ProcessBackend) forks its ranks from this process, so a
patched `execute` makes its rank 1 fail.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from epcc.plan.bundle import load  # noqa: E402
from epcc.runtime.buffer import Buffer, GroupError  # noqa: E402
from epcc.runtime.engines import agree, cpu_procs  # noqa: E402
from epcc.runtime.engines.cpu import engine as cpu_engine  # noqa: E402
from epcc.runtime.testing.ranks import spawn_ranks  # noqa: E402
from epcc.runtime.layout import compute_layout  # noqa: E402

from test_buffer import ONE_HOP, compile_bundle  # noqa: E402

TIMEOUT_S = 2.0
SLACK_S = 4.0  # "promptly": beyond the timeout, the grace a failing rank waits for its peers, polling, a busy CI
LATE_S = TIMEOUT_S + agree.GRACE_S + 1.5  # a stalled rank comes back after its peers gave up on it
T, H, K, E = 8, 256, 4, 8

# Two hops on two ranks: rank r's `land` waits for its peer's `push` into r's staging buffer, so a
# stalled peer makes a driver's bounded wait time out (the one-hop plan's drivers wait for nothing).
TWO_HOP = f"""\
topology t {{
  levels node 1, gpu 2
  rank gpu
  relation peer = other gpu
  link nv p2p {{ connects peer  bandwidth 450 GB/s  shared per gpu  latency 3 us }}
  link hbm local {{ bandwidth 3000 GB/s }}
}}
workload {{ tokens {T}  hidden {H}  dtype bf16  topk {K}  experts {E} blocked  weights travel }}
dispatch {{
  buffer recv
  defaults chunk 4 tokens depth 2
  step meta: exchange counts with all
  step push: send tokens for peer from input to peer.recv over nv
  step keep: permute input into output
  step land: permute recv into output
}}
combine reverse of dispatch
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(rank: int):
    g = np.random.default_rng(rank)
    idx = np.stack([g.choice(E, size=K, replace=False) for _ in range(T)]).astype(np.int64)
    x = torch.from_numpy(g.standard_normal((T, H)).astype(np.float32)).to(torch.bfloat16)
    return x, torch.from_numpy(idx), torch.from_numpy(g.random((T, K)).astype(np.float32))


def _call(buf: Buffer, what: str, *args) -> dict:
    """One call, timed: what it returned (`value`) or the GroupError it raised."""
    t0 = time.monotonic()
    try:
        value = buf.dispatch(*args) if what == "dispatch" else buf.combine(*args)
        return {"ok": True, "elapsed": time.monotonic() - t0, "value": value}
    except GroupError as e:
        return {"ok": False, "elapsed": round(time.monotonic() - t0, 3), "type": type(e).__name__,
                "message": str(e), "rank": e.rank, "rebuild": e.rebuild, "state": buf.state,
                "value_error": isinstance(e, ValueError)}


def _seen(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "value"}


def _worker(rank: int, ranks: int, port: int, bundle: str, case: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    res: dict = {}
    buffers: list[Buffer] = []
    try:
        dist.init_process_group("gloo", rank=rank, world_size=ranks)
        x, idx, w = _inputs(rank)
        buf = Buffer(None, bundle, timeout_s=TIMEOUT_S)
        buffers.append(buf)
        assert _call(buf, "dispatch", x, idx, w)["ok"]  # a good call first: the failure is not a start-up one
        if case == "error-then-late":
            # (a) rank 1's top-k names expert 99: every rank refuses dispatch #2, the Buffer stays usable
            bad = idx.clone()
            if rank == 1:
                bad[3, 1] = 99
            res["refused"] = _seen(_call(buf, "dispatch", x, bad, w))
            again = _call(buf, "dispatch", x, idx, w)
            res["again"] = again["ok"] and _call(buf, "combine", again["value"][0], again["value"][4])["ok"]
            # (b) rank 1 comes to dispatch #4 late: its peer gives up on it, it hears the verdict at once
            if rank == 1:
                time.sleep(LATE_S)
            res["late"] = _seen(_call(buf, "dispatch", x, idx, w))
            res["after"] = _seen(_call(buf, "dispatch", x, idx, w))  # a failed Buffer refuses at once
            dist.barrier()  # (the test's own collective, every rank alive) then a new Buffer works
            buffers.append(Buffer(None, bundle, timeout_s=TIMEOUT_S))
            res["new_buffer"] = _call(buffers[-1], "dispatch", x, idx, w)["ok"]
        elif case == "stall-in-run":  # (b) rank 1's drivers start late: its peer's wait for them times out
            if rank == 1:
                run = cpu_engine.execute
                cpu_engine.execute = lambda *a, **k: (time.sleep(LATE_S), run(*a, **k))[1]
            res["late"] = _seen(_call(buf, "dispatch", x, idx, w))
        elif case == "killed":  # (c) rank 1's process is killed before dispatch #2
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            res["late"] = _seen(_call(buf, "dispatch", x, idx, w))
            res["after"] = _seen(_call(buf, "dispatch", x, idx, w))
        res["status"] = "ok"
    except BaseException:  # noqa: BLE001 - reported to the test
        res["status"] = traceback.format_exc()
    for b in buffers:
        b.close()  # this rank's shared memory (not a collective)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(res))
    if rank == 0:  # it hosts the TCPStore: the others' verdicts need it until they are done
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all((Path(out_dir) / f"rank{r}.json").exists()
                                                       for r in range(1, ranks) if (case, r) != ("killed", 1)):
            time.sleep(0.05)
    os._exit(0)  # no teardown of a group that lost a member


def _spawn(tmp_path: Path, case: str, sched: str, ranks: int = 2) -> list[dict | None]:
    bundle = compile_bundle(tmp_path, sched)
    out = tmp_path / "results"
    out.mkdir()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    port = _free_port()
    spawn_ranks(_worker, lambda r: (r, ranks, port, str(bundle), case, str(out)), ranks, timeout_s=120, daemon=True)
    return [json.loads(f.read_text()) if (f := out / f"rank{r}.json").exists() else None for r in range(ranks)]


def _ok(res: list[dict | None], ranks) -> None:
    for r in ranks:
        assert res[r] is not None and res[r]["status"] == "ok", f"rank {r}: {res[r] and res[r]['status']}"


def test_a_refused_argument_then_a_late_rank(tmp_path):
    res = _spawn(tmp_path, "error-then-late", ONE_HOP.format(r=2, t=T, h=H, dtype="bf16", k=K, e=E))
    _ok(res, (0, 1))
    print("\n".join(f"rank {r}: refused after {res[r]['refused']['elapsed']} s, late after "
                    f"{res[r]['late']['elapsed']} s" for r in (0, 1)))
    refused = "dispatch #2 failed on rank 1: dispatch: topk_idx values must lie in [-1, 7] (-1: no expert)"
    late = "dispatch #4 failed on rank 1: no answer within 2 s at the routing exchange (stalled, or its process died)"
    for r in (0, 1):
        got = res[r]["refused"]
        assert (got["message"], got["type"], got["value_error"], got["rank"]) == \
               (refused, "GroupValueError", True, 1), got
        assert not got["rebuild"] and got["state"] == "ready" and got["elapsed"] < SLACK_S, got
        assert res[r]["again"], "the Buffer did not work again after a refused argument"
        got = res[r]["late"]
        assert (got["message"], got["type"], got["rank"], got["rebuild"], got["state"]) == \
               (late, "GroupTimeout", 1, True, "failed"), got
        assert res[r]["after"]["message"] == ("this Buffer failed in dispatch #4 on rank 1: no answer within 2 s at "
                                              "the routing exchange (stalled, or its process died); make a new Buffer")
        assert res[r]["after"]["elapsed"] < 0.5, res[r]["after"]
        assert res[r]["new_buffer"]
    assert TIMEOUT_S <= res[0]["late"]["elapsed"] < TIMEOUT_S + SLACK_S, res[0]["late"]
    assert res[1]["late"]["elapsed"] < SLACK_S, res[1]["late"]  # the late rank hears the verdict on arrival


def test_a_stall_inside_the_run(tmp_path):
    res = _spawn(tmp_path, "stall-in-run", TWO_HOP)
    _ok(res, (0, 1))
    print("\n".join(f"rank {r}: failed after {res[r]['late']['elapsed']} s" for r in (0, 1)))
    want = "dispatch #2 failed on rank 1: no answer within 2 s of its peers' failure (stalled, or its process died)"
    for r in (0, 1):
        got = res[r]["late"]
        assert (got["message"], got["type"], got["rebuild"]) == (want, "GroupTimeout", True), got
    # rank 0's drivers wait the timeout for rank 1's rows, then the grace for rank 1's answer
    assert TIMEOUT_S <= res[0]["late"]["elapsed"] < TIMEOUT_S + SLACK_S, res[0]["late"]
    assert res[1]["late"]["elapsed"] < LATE_S + SLACK_S, res[1]["late"]


def test_a_killed_rank(tmp_path):
    res = _spawn(tmp_path, "killed", ONE_HOP.format(r=2, t=T, h=H, dtype="bf16", k=K, e=E))
    _ok(res, (0,))
    assert res[1] is None  # killed: no report
    print(f"rank 0: failed after {res[0]['late']['elapsed']} s")
    got = res[0]["late"]
    assert (got["message"], got["type"], got["rank"], got["state"]) == \
           ("dispatch #2 failed on rank 1: no answer within 2 s at the routing exchange (stalled, or its process "
            "died)", "GroupTimeout", 1, "failed"), got
    assert TIMEOUT_S <= got["elapsed"] < TIMEOUT_S + SLACK_S, got
    assert res[0]["after"]["message"].startswith("this Buffer failed in dispatch #2 on rank 1: ")


# ------------------------------------------------------------------ the runner: a process per rank


def _failing(case: str):
    real = cpu_procs.execute

    def execute(plan, layout, program, mem, *, ranks, **kw):
        if ranks == [1]:
            if case == "error":
                raise ValueError("an error of rank 1's own")
            if case == "stall":
                time.sleep(LATE_S)
            if case == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
        return real(plan, layout, program, mem, ranks=ranks, **kw)

    return execute


@pytest.mark.parametrize("case, message", [
    ("error", "dispatch #1 failed on rank 1: an error of rank 1's own"),
    ("stall", "dispatch #1 failed on rank 1: no answer within 2 s at the end of the run (stalled, or its process "
              "died)"),
    ("killed", "dispatch #1 failed on rank 1: no answer within 2 s at the end of the run (stalled, or its process "
               "died)"),
])
def test_runner_ranks_fail_together(tmp_path, monkeypatch, case, message):
    bundle = compile_bundle(tmp_path, ONE_HOP.format(r=2, t=T, h=H, dtype="bf16", k=K, e=E))
    plan = load(bundle).plan
    ins = [_inputs(r) for r in range(2)]
    layout = compute_layout(plan, np.stack([i[1].numpy() for i in ins]), np.stack([i[2].numpy() for i in ins]))
    rows = [i[0].view(torch.uint8).numpy() for i in ins]
    backend = cpu_procs.ProcessBackend("libfabric-tcp", timeout_s=TIMEOUT_S)  # one hop: no RDMA step, no transport
    assert len(backend.run_dispatch(plan, layout, rows)) == 2
    monkeypatch.setattr(cpu_procs, "execute", _failing(case))  # the forked ranks inherit it
    t0 = time.monotonic()
    with pytest.raises(cpu_procs.RankFailed) as e:
        backend.run_dispatch(plan, layout, rows)
    elapsed = time.monotonic() - t0
    print(f"{case}: failed after {elapsed:.2f} s; every rank: {e.value.per_rank}")
    assert str(e.value) == message
    alive = (0,) if case == "killed" else (0, 1)
    assert {r: m for r, m in e.value.per_rank.items() if r in alive} == {r: message for r in alive}
    assert elapsed < (LATE_S if case == "stall" else TIMEOUT_S) + SLACK_S
