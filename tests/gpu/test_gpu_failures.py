"""Every rank fails together on the GPUs (runtime/engines/agree.py through the cuda engine): two
ranks, one per GPU, on the direct kernels of the h200x2_t128 bundle; rank 1 fails on purpose in
its second dispatch (tests/gpu/fail_worker.py says how) and rank 0 must raise the same GroupError,
naming rank 1, within the timeout plus a few seconds.  Skipped without 2 GPUs (test_gpu.py's
conditions: nvcc, the bundles, torch).

The ranks are started as torchrun would start them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT; an NCCL group over a TCPStore on 127.0.0.1 that rank 0 hosts), but by this test, so
that a killed rank does not make a launcher end its peer.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from epcc.plan.bundle import load
from epcc.runtime.engines import agree

from test_gpu import BUNDLES, ROOT, _why_not

WORKER = Path(__file__).resolve().parent / "fail_worker.py"
BUNDLE = "h200x2_t128"
TIMEOUT_S = 5.0
SLACK_S = 5.0  # beyond the timeout: a kernel's trap, the grace a failing rank waits, the ranks' polling

pytestmark = pytest.mark.gpu


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(case: str, tmp_path: Path) -> list[dict | None]:
    why = _why_not(2, [BUNDLE])
    if why:
        pytest.skip(why)
    out = tmp_path / case
    out.mkdir()
    port = _port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="0,1", NCCL_NVLS_ENABLE="0")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(BUNDLES / BUNDLE), case, str(out),
                                       str(TIMEOUT_S)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
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
    print("\n".join(f"rank {r}: {res[r] and res[r].get('failed')}" for r in range(2)))
    return res


def _same(res, ranks, message: str, cls: str, rebuild: bool) -> None:
    for r in ranks:
        got = res[r]["failed"]
        assert (got["message"], got["type"], got["rebuild"]) == (message, cls, rebuild), (r, got)


def test_a_bad_topk_row_found_by_the_kernels_reaches_every_rank(tmp_path):
    res = _run("refuse-device", tmp_path)
    msg = res[1]["failed"]["message"]
    assert msg.startswith("dispatch #2 failed on rank 1: dispatch: topk_idx row 3 names an expert outside "), msg
    _same(res, (0, 1), msg, "GroupValueError", False)
    assert all(res[r]["failed"]["elapsed"] < SLACK_S and res[r]["again"] for r in (0, 1))  # at once; usable again


def test_a_rank_that_refuses_before_its_launch_is_named_by_its_peer(tmp_path):
    res = _run("refuse-host", tmp_path)
    K = load(BUNDLES / BUNDLE).plan.workload.topk
    T = load(BUNDLES / BUNDLE).plan.workload.tokens
    msg = f"dispatch #2 failed on rank 1: dispatch: topk_idx must have shape [{T}, {K}], got [{T}, {K - 1}]"
    _same(res, (0, 1), msg, "GroupValueError", True)
    assert res[1]["failed"]["elapsed"] < 1.0  # the refusing rank: at once
    assert TIMEOUT_S <= res[0]["failed"]["elapsed"] < TIMEOUT_S + SLACK_S  # its peer: when its kernel gives up
    assert res[0]["after"]["message"].startswith("this Buffer failed in dispatch #2 on rank 1: ")


@pytest.mark.parametrize("case", ["stall", "killed"])
def test_a_rank_that_does_not_come_is_named_by_its_peer(tmp_path, case):
    res = _run(case, tmp_path)
    msg = (f"dispatch #2 failed on rank 1: no answer within {agree.GRACE_S:g} s of its peers' failure (stalled, or "
           f"its process died)")
    _same(res, (0,) if case == "killed" else (0, 1), msg, "GroupTimeout", True)
    assert TIMEOUT_S <= res[0]["failed"]["elapsed"] < TIMEOUT_S + SLACK_S
    if case == "stall":
        assert res[1]["failed"]["elapsed"] < 1.0  # the late rank hears the verdict before it launches
    else:
        assert res[1] is None
