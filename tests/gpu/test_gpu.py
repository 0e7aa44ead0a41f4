"""The GPU checks (tests/gpu/ep_worker.py under torchrun) as a pytest; skipped on CPU machines.

How to run them: compile the bundles on a machine with MLIR (this repository's venv), carry the
directory to the GPU machine, run pytest there:

    .venv/bin/python tests/gpu/bundles.py .gpu/bundles          # CPU machine, MLIR installed
    python -m pytest -q tests/gpu/test_gpu.py                    # GPU machine (>= 2 GPUs, nvcc, torch)

$EPCC_GPU_BUNDLES overrides the bundle directory (default .gpu/bundles at the repository root);
$EPCC_GPU_TIMEOUT the seconds one torchrun may take (default 1200).  The EP8 cases need 8 GPUs
(h200x8*, nvl8_hybrid, the 8-GPU vnode plans h200x8_2vnode_50 and h200x8_ubb4x2_50 and their
proxy bundles; uneven token counts; the proxy path); the EP4 case needs 4 GPUs
(h200x4, h200x4_fp8, h200x4_t128 and their token-major twins h200x4_tok...); the EP2 case runs on
GPUs 0 and 1 (h200x2, h200x2_fp8, h200x2_t128, h200x2_tok...).  With 2 or 3 GPUs the EP4 bundles run instead as 4 ranks on GPUs 0 and 1, two
per GPU, time-sliced (test_ep_worker_ep4_shared_gpus; ep_worker.py: the same checks, no timing).  Each must exit 0 and
print "ALL OK"; on failure the test shows the output tail.  test_uneven_tokens_per_rank runs
uneven_worker.py on the 128-token and the 4096-token bundles of the same size: ranks that
dispatch different numbers of tokens (127 / 120 / 0 / 128 rotated over the ranks) and ask for
different expert alignments, in every mode; its kernels give up waiting after 5 s, so a
deadlock fails fast (`python -m pytest -q tests/gpu/test_gpu.py -k uneven` on 2 GPUs runs ep2).  Likewise the 4-rank proxy bundles
(two virtual nodes of two GPUs) run as 4 ranks on 2 GPUs where 4 are missing
(test_gpu_proxy_path_ep4_shared_gpus: every result checked, no timing).  The same proxy bundles
run through `Buffer` with their tables written on the GPU (proxy_worker.py,
test_proxy_bundles_through_buffer_*): normal and low-latency mode, fresh routing on every call,
uneven token counts, CUDA graphs, over each transport.  Across CUDA IPC domains:
h200x2_2vnode_50_proxy_collective (the proxy path, tables from the GPU, the routing all-gathered
by NCCL) runs through proxy_worker.py over NVSHMEM with EPCC_CUDA_IPC_DOMAIN=box{rank}, every rank
a box of its own, and must open no CUDA IPC mapping at all
(test_a_proxy_collective_bundle_runs_with_every_rank_in_its_own_ipc_domain); so placed, the same
bundle over the emulated transport, an RDMA step emulated by peer copies and the direct kernels
are refused on every rank when the Buffer is made, and every rank then exits with status 1, not by
a signal (test_what_cannot_cross_ipc_domains_is_refused_on_every_rank: the ranks started as
torchrun starts them but each one's own exit status kept, runtime/testing/ranks.py).

The GPU proxy path runs through bench/ep_bench.py --strict on the 2-vnode plan of two
GPUs (h200x2_2vnode_50_proxy; h200x2_2vnode_relay_50_proxy: two RDMA steps per program, so two
pack roles and two FIFOs per rank and program; h200x2_2vnode_mixed_50_proxy: the same two steps
over links of 50 and 25 GB/s, each paced on its own link), once per transport: `emulated` (the
copy engine paced to each step's link) and `nvshmem` (put with signal over NVLink; skipped where
NVSHMEM's wheel is not installed).  The bench checks every result against the oracle (dispatch
bit-exact, combine within bf16-wire rounding) and --strict makes a failed check or a timeout exit
1.  With `emulated`, the 2-GPU bundles' median dispatch and combine (the cached-handle row, the
kernels without the host layout) must be within 15 % of `epcc simulate` (the bundle's simulate.json), and on the mixed plan the step over the fast link
must have landed (rank 0's role timeline, the median of 5 stamped rounds) by FAST_BY of the time
the step over the slow link landed: simulated 0.51; measured on 2 H200s 0.49-0.54 in single
rounds and once 0.61, and 0.55-0.58 as medians of 5 (2026-11-23: one proxy thread posts both
steps' chunks, ~80 % busy while both run, so the host's scheduling moves the fast step by
~10 %); both steps on one queue, or both paced at one link's speed, give 0.9 or more
(h200x2_2vnode_relay, one link: 0.93).  (A bound of 0.6, set from two rounds at 0.49-0.50,
failed a later run's 0.61.  On 2 x H100, 2026-11-27, one run passed and a later one measured 0.71
against 0.52 simulated: the proxy thread's scheduling, not yet understood, and still a failure.)

The SUPA target's kernels (`--target supa` bundles: supa_*) run through `Buffer(backend="supa")`
with EPCC_SUPA_SHIM=1, built by nvcc through the SUPA-on-CUDA shim: ep_worker.py's checks
(EPCC_GPU_BACKEND=supa) on 4 ranks (a GPU each where 4 are present, and 4 ranks on 2 GPUs
time-sliced on any machine) and on 2 ranks, among them one BR166 card (supa_ubbv2_card) and the
same card with its D2D hand-over on the DMA engine's lane (supa_ubbv2_card_dma)
(test_supa_shim_ep_worker, test_supa_shim_ep4_shared_gpus).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from epcc.runtime.build_cache import find_nvcc
from epcc.runtime.build_cache import BuildError
from epcc.runtime.engines.gpu_proxy.build import nvshmem_home
from epcc.runtime.testing.ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "ep_worker.py"
UNEVEN_WORKER = Path(__file__).resolve().parent / "uneven_worker.py"
BENCH = ROOT / "bench" / "ep_bench.py"
PROXY_BUNDLES = {  # GPUs -> the proxy-path bundles run on that many GPUs (tests/gpu/bundles.py writes them)
    8: ["h200x8_2vnode_50_proxy", "h200x8_ubb4x2_50_proxy"],
    4: ["h200x4_2vnode_50_proxy", "h200x4_ubb2x2_50_proxy"],
    2: ["h200x2_2vnode_50_proxy", "h200x2_2vnode_relay_50_proxy", "h200x2_2vnode_mixed_50_proxy"],
}
SIM_TOLERANCE = 0.15  # emulated: measured median against `epcc simulate`, these bundles
SIM_CHECKED = {"h200x2_2vnode_50_proxy", "h200x2_2vnode_relay_50_proxy", "h200x2_2vnode_mixed_50_proxy"}
# the mixed plan (links of 50 and 25 GB/s): (program, the step over the fast link, the step over the
# slow one); the fast one's landing role must end on rank 0 by FAST_BY of the slow one's end
FAST_STEP = {"h200x2_2vnode_mixed_50_proxy": ("dispatch", "there", "relay")}
FAST_BY = 0.7
BUNDLES = Path(os.environ.get("EPCC_GPU_BUNDLES") or ROOT / ".gpu" / "bundles")
HOW = ("to run: `.venv/bin/python tests/gpu/bundles.py .gpu/bundles` on a CPU machine with MLIR, carry .gpu "
       "to the GPU machine (or set EPCC_GPU_BUNDLES), run `python -m pytest tests/gpu/test_gpu.py` there")
CASES = {  # GPUs -> bundles (tests/gpu/bundles.py writes them): one-hop (the direct kernels), then
    # multi-hop plans (the table-driven kernels; `_proxy`: RDMA steps through the GPU proxy path)
    8: ["h200x8", "h200x8_fp8", "h200x8_t128", "h200x8_tok", "h200x8_tok_fp8", "h200x8_tok_t128", "nvl8_hybrid",
        "h200x8_2vnode_50", "h200x8_ubb4x2_50", "h200x8_2vnode_50_proxy", "h200x8_ubb4x2_50_proxy"],
    4: ["h200x4", "h200x4_fp8", "h200x4_t128", "h200x4_tok", "h200x4_tok_fp8", "h200x4_tok_t128", "h200x4_2vnode_50",
        "h200x4_ubb2x2_50", "h200x4_2vnode_50_proxy", "h200x4_ubb2x2_50_proxy"],
    2: ["h200x2", "h200x2_fp8", "h200x2_t128", "h200x2_tok", "h200x2_tok_fp8", "h200x2_tok_t128", "h200x2_2vnode_50",
        "h200x2_2vnode_50_proxy", "h200x2_2vnode_relay_50_proxy", "h200x2_2vnode_mixed_50_proxy"],
}
# the metadata kernels' routing all-gathered by the process group (`--metadata-exchange collective`,
# the exchange of plans beyond one box) on one box of 2 GPUs (tests/gpu/bundles.py COLLECTIVE_VARIANTS)
COLLECTIVE = ["h200x2_2vnode_50_collective"]
SHARED = (4, 2)  # the EP4 bundles' 4 ranks on 2 GPUs (the CUDA ones where fewer than 4 are present; the SUPA ones always)
UNEVEN = {  # GPUs -> bundles whose ranks dispatch different numbers of tokens (uneven_worker.py)
    8: ["h200x8_t128", "h200x8"],
    4: ["h200x4_t128", "h200x4"],
    2: ["h200x2_t128", "h200x2"],
}
UNEVEN_TIMEOUT_S = 600  # the whole torchrun: its kernels give up after seconds (EPCC_GPU_KERNEL_TIMEOUT)
PROXY_WORKER = Path(__file__).resolve().parent / "proxy_worker.py"

pytestmark = pytest.mark.gpu


def _gpus() -> tuple[int, str]:
    try:
        import torch  # the runtime extra: without it this machine runs no GPU test
    except ImportError:
        return 0, "torch is not installed"
    n = torch.cuda.device_count()
    return n, f"{n} CUDA device(s) visible"


SUPA_CASES = {  # ranks -> SUPA bundles (tests/gpu/bundles.py SUPA_VARIANTS)
    4: ["supa_h200x4", "supa_h200x4_2vnode_50", "supa_h200x4_ubb2x2_50"],
    2: ["supa_h200x2", "supa_h200x2_2vnode_50", "supa_ubbv2_card", "supa_ubbv2_card_dma"],
}
SUPA_ENV = {"EPCC_GPU_BACKEND": "supa", "EPCC_SUPA_SHIM": "1"}


def _why_not(gpus: int, bundles: list[str], target: str = "cuda") -> str | None:
    """None when the case can run on `gpus` GPUs with `bundles`, else the skip reason (with how to run it)."""
    have, what = _gpus()
    if have < 2:
        return f"needs >= 2 GPUs ({what}); {HOW}"
    if have < gpus:
        return f"the EP{gpus} case needs {gpus} GPUs ({what})"
    if find_nvcc() is None:
        return f"nvcc not found (PATH, $NVCC, /usr/local/cuda*/bin): the direct kernels are built on this machine; {HOW}"
    if not BUNDLES.is_dir():
        return f"no bundle directory {BUNDLES}; {HOW}"
    missing = [b for b in bundles if not (BUNDLES / b / target / "manifest.json").is_file()]
    if missing:
        return f"bundles missing under {BUNDLES}: {', '.join(missing)}; {HOW}"
    if _torchrun_path() is None:
        return "torchrun not found (it comes with torch)"
    return None


def first_two_gpus() -> str:
    """CUDA_VISIBLE_DEVICES for a 2-GPU case: the first two GPUs this process sees (the first two
    entries of its own CUDA_VISIBLE_DEVICES where set, so two runs can take disjoint pairs)."""
    seen = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return ",".join(seen[:2]) if len(seen) >= 2 else "0,1"


def _torchrun_path() -> str | None:
    beside = Path(sys.executable).parent / "torchrun"
    return str(beside) if beside.is_file() else shutil.which("torchrun")


def _gpu_env(gpus: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for ranks on `gpus` GPUs (the first two visible for 2), NVLink
    multicast off, `env` over it."""
    full = dict(os.environ)
    full.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1", **(env or {}))
    if gpus == 2:
        full["CUDA_VISIBLE_DEVICES"] = first_two_gpus()
    return full


def _torchrun(gpus: int, script: Path, args: list[str], env: dict[str, str] | None = None, ranks: int | None = None,
              timeout: float | None = None):
    """Run `script` as `ranks` processes (default one per GPU) on `gpus` GPUs (the first two visible for 2)
    under torchrun, NVLink multicast off; (command, result), or the test fails after `timeout`
    (default $EPCC_GPU_TIMEOUT) s with the output so far."""
    full = _gpu_env(gpus, env)
    cmd = [_torchrun_path(), "--standalone", "--nproc-per-node", str(ranks or gpus), str(script), *args]
    timeout = timeout or float(os.environ.get("EPCC_GPU_TIMEOUT", "1200"))
    try:
        return cmd, subprocess.run(cmd, cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        tail = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{' '.join(cmd)}: no result after {timeout:.0f} s (a hung kernel wait?)\n{tail[-6000:]}")


@pytest.mark.parametrize("gpus, bundle", [(g, b) for g in sorted(CASES, reverse=True) for b in CASES[g]],
                         ids=lambda v: f"ep{v}" if isinstance(v, int) else v)
def test_ep_worker_all_ok(gpus, bundle):
    """One bundle's checks (ep_worker.py) on a GPU each: a case per bundle, so that a run cut short
    by its bound (device time is scarce) still reports the bundles that finished, and `-k` picks
    bundles."""
    why = _why_not(gpus, [bundle])
    if why:
        pytest.skip(why)
    cmd, r = _torchrun(gpus, WORKER, [str(BUNDLES / bundle)])
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "ALL OK" in r.stdout, \
        f"{' '.join(cmd)} exited {r.returncode}:\n{out[-12000:]}"
    # the worker's summary (shown by `pytest -rA`): what ran where
    print("\n".join(line for line in r.stdout.splitlines() if "GPU checks" in line or line.startswith("bundle")))


def test_collective_metadata_exchange():
    """A 2-rank plan whose metadata kernels get every rank's routing from the process group's
    all-gather (NCCL) instead of CUDA IPC, through Buffer against the oracle (ep_worker.py): fresh
    routings on every call, uneven token counts with a rank of none, the low-latency mode and a
    CUDA graph of it (the all-gathers captured), and the GPU's tables byte for byte the host's."""
    why = _why_not(2, COLLECTIVE)
    if why:
        pytest.skip(why)
    for b in COLLECTIVE:  # the bundle runs the collective, not the exchange over CUDA IPC
        m = json.loads((BUNDLES / b / "cuda" / "manifest.json").read_text(encoding="utf-8"))
        assert (m["metadata"]["lowering"], m["metadata"]["exchange"]) == ("device", "collective"), b
    cmd, r = _torchrun(2, WORKER, [str(BUNDLES / b) for b in COLLECTIVE])
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "ALL OK" in r.stdout, f"{' '.join(cmd)} exited {r.returncode}:\n{out[-12000:]}"
    print("\n".join(line for line in r.stdout.splitlines() if "GPU checks" in line or line.startswith("bundle")))


@pytest.mark.parametrize("gpus", sorted(UNEVEN, reverse=True), ids=lambda n: f"ep{n}")
def test_uneven_tokens_per_rank(gpus):
    """Ranks that dispatch different numbers of tokens (127 / 120 / 0 / 128 rotated, and more) and
    ask for different expert alignments, every mode, against the oracle; a wait nobody serves
    fails within seconds as a kernel timeout (uneven_worker.py)."""
    why = _why_not(gpus, UNEVEN[gpus])
    if why:
        pytest.skip(why)
    cmd, r = _torchrun(gpus, UNEVEN_WORKER, [str(BUNDLES / b) for b in UNEVEN[gpus]], timeout=UNEVEN_TIMEOUT_S)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "ALL OK" in r.stdout, f"{' '.join(cmd)} exited {r.returncode}:\n{out[-12000:]}"
    print("\n".join(line for line in r.stdout.splitlines() if "GPU checks" in line))


@pytest.mark.parametrize("ranks", sorted(SUPA_CASES, reverse=True), ids=lambda n: f"ep{n}")
def test_supa_shim_ep_worker(ranks):
    """The SUPA bundles' kernels (the .su sources through the shim) against the oracle: every
    routing, uneven token counts, low latency, graphs where their tables are written on the GPU."""
    why = _why_not(ranks, SUPA_CASES[ranks], "supa")
    if why:
        pytest.skip(why)
    cmd, r = _torchrun(ranks, WORKER, [str(BUNDLES / b) for b in SUPA_CASES[ranks]], env=SUPA_ENV)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "ALL OK" in r.stdout, f"{' '.join(cmd)} exited {r.returncode}:\n{out[-12000:]}"
    print("\n".join(line for line in r.stdout.splitlines() if "GPU checks" in line or line.startswith("supa_")))


def test_supa_shim_ep4_shared_gpus():
    """The 4-rank SUPA bundles as 4 ranks on 2 GPUs, time-sliced (two processes per GPU, as two dies
    of a card share one), on any machine of 2 or more GPUs: where 4 are present
    test_supa_shim_ep_worker[ep4] runs them on a GPU each as well."""
    ranks, gpus = SHARED
    why = _why_not(gpus, SUPA_CASES[ranks], "supa")
    if why:
        pytest.skip(why)
    cmd, r = _torchrun(gpus, WORKER, [str(BUNDLES / b) for b in SUPA_CASES[ranks]], env=SUPA_ENV, ranks=ranks)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "ALL OK" in r.stdout and f"{ranks} ranks, {gpus} x " in r.stdout, \
        f"{' '.join(cmd)} exited {r.returncode}:\n{out[-12000:]}"


def test_ep_worker_ep4_shared_gpus():
    """The EP4 bundles where fewer than 4 GPUs are present: 4 ranks on 2 GPUs, checked like ep4
    (a 4-GPU machine runs test_ep_worker_all_ok[ep4-*] instead)."""
    ranks, gpus = SHARED
    have, what = _gpus()
    if have >= ranks:
        pytest.skip(f"{what}: the ep4 case runs the EP4 bundles on a GPU each")
    why = _why_not(gpus, CASES[ranks])
    if why:
        pytest.skip(why)
    cmd, r = _torchrun(gpus, WORKER, [str(BUNDLES / b) for b in CASES[ranks]], ranks=ranks)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "ALL OK" in r.stdout and f"{ranks} ranks, {gpus} x " in r.stdout, \
        f"{' '.join(cmd)} exited {r.returncode}:\n{out[-12000:]}"
    print("\n".join(line for line in r.stdout.splitlines() if "GPU checks" in line or "time-sliced" in line))


def _proxy_bench(gpus: int, bundles: list[str], transport: str, tmp_path: Path, bench_args: list[str],
                 ranks: int | None = None) -> tuple[str, list[str]]:
    """bench/ep_bench.py --strict on `bundles` over `transport` (the test skips where the case or
    NVSHMEM is missing); every bundle must come back `epcc ok` over that transport.  (stdout, the
    transport lines `rdma PROGRAM: ... over TRANSPORT (...)`)."""
    why = _why_not(gpus, bundles)
    if not why and transport == "nvshmem":
        try:
            nvshmem_home()
        except BuildError as e:
            why = str(e)
    if why:
        pytest.skip(why)
    cmd, r = _torchrun(gpus, BENCH, [
        "--methods", "epcc", "--strict", *bench_args, "--rdma-transport", transport, "--out", str(tmp_path),
        "--bundles", *[str(BUNDLES / b) for b in bundles]], ranks=ranks,
        # one host: NVLink only, no NIC probing
        env={"NVSHMEM_REMOTE_TRANSPORT": os.environ.get("NVSHMEM_REMOTE_TRANSPORT", "none")})
    out = r.stdout + r.stderr
    ok = all(f"{b}: epcc ok" in r.stdout for b in bundles)
    assert r.returncode == 0 and ok, f"{' '.join(cmd)} exited {r.returncode}:\n{out[-12000:]}"
    used = [line.strip() for line in r.stdout.splitlines()
            if line.strip().startswith("rdma ") and " proxy: " not in line]
    assert used and all(f"over {transport}" in line for line in used), used
    return r.stdout, used


@pytest.mark.parametrize("transport", ["emulated", "nvshmem"])
@pytest.mark.parametrize("gpus", sorted(PROXY_BUNDLES, reverse=True), ids=lambda n: f"ep{n}")
def test_gpu_proxy_path(gpus, transport, tmp_path):
    """The RDMA step through the host proxy loop and a real transport, results checked by the bench."""
    stdout, used = _proxy_bench(gpus, PROXY_BUNDLES[gpus], transport, tmp_path,
                                ["--iters", "3", "--warmup", "1", "--kernel-timeout", "10"])
    print("\n".join(line for line in stdout.splitlines() if "epcc ok" in line or line.strip().startswith("rdma ")
                    or "measured" in line or "timeline" in line))
    if transport == "emulated":
        assert not [m for m in sim_mismatches(tmp_path / "ep_bench.json") if m.split(":")[0] in PROXY_BUNDLES[gpus]], \
            sim_mismatches(tmp_path / "ep_bench.json")
        if "h200x2_2vnode_mixed_50_proxy" in PROXY_BUNDLES[gpus]:  # each step on its own paced link
            assert any("2 links paced to" in line and "25 GB/s 5 us" in line and "50 GB/s 5 us" in line
                       for line in used), used


@pytest.mark.parametrize("transport", ["emulated", "nvshmem"])
def test_gpu_proxy_path_ep4_shared_gpus(transport, tmp_path):
    """The 4-rank proxy bundles (2 virtual nodes x 2 GPUs: NVLink forwards inside a vnode, the
    RDMA step through the proxy and the transport between them) where fewer than 4 GPUs are
    present: 4 ranks on GPUs 0 and 1, two per GPU, time-sliced (NVSHMEM runs two PEs per GPU);
    every result checked by the bench, no timing (a 4-GPU machine runs test_gpu_proxy_path[ep4-*]
    instead)."""
    ranks, gpus = SHARED
    have, what = _gpus()
    if have >= ranks:
        pytest.skip(f"{what}: test_gpu_proxy_path[ep4-*] runs the 4-rank proxy bundles on a GPU each")
    stdout, _ = _proxy_bench(gpus, PROXY_BUNDLES[ranks], transport, tmp_path,
                             ["--iters", "2", "--warmup", "1", "--kernel-timeout", "60", "--child-timeout", "600"],
                             ranks=ranks)
    assert f"{ranks} ranks on {gpus} GPU(s)" in stdout, stdout[-6000:]
    print("\n".join(line for line in stdout.splitlines() if "epcc ok" in line or line.strip().startswith("rdma ")
                    or "time-sliced" in line))


def _nvshmem_missing(transport: str) -> str | None:
    if transport != "nvshmem":
        return None
    try:
        nvshmem_home()
    except BuildError as e:
        return str(e)
    return None


def _proxy_worker(gpus: int, bundles: list[str], transport: str, ranks: int | None = None,
                  env: dict[str, str] | None = None) -> str:
    """proxy_worker.py over `transport` on `bundles` (skipped where the case or NVSHMEM is missing):
    it must exit 0 with ALL OK; its stdout."""
    why = _why_not(gpus, bundles) or _nvshmem_missing(transport)
    if why:
        pytest.skip(why)
    host = [b for b in bundles
            if json.loads((BUNDLES / b / "cuda" / "manifest.json").read_text())["metadata"]["lowering"] != "device"]
    assert not host, f"{', '.join(host)}: compiled without --proxy-tables device (tests/gpu/bundles.py)"
    cmd, r = _torchrun(gpus, PROXY_WORKER, [transport, *[str(BUNDLES / b) for b in bundles]], ranks=ranks,
                       env={"NVSHMEM_REMOTE_TRANSPORT": os.environ.get("NVSHMEM_REMOTE_TRANSPORT", "none"),
                            **(env or {})})
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "ALL OK" in r.stdout, f"{' '.join(cmd)} exited {r.returncode}:\n{out[-12000:]}"
    print("\n".join(line for line in r.stdout.splitlines() if "GPU checks" in line or "time-sliced" in line))
    return r.stdout


PROXY_DEVICE_BUNDLES = {2: ["h200x2_2vnode_50_proxy_dev"], 4: ["h200x4_2vnode_50_proxy_dev"],
                        8: ["h200x8_2vnode_50_proxy_dev"]}


@pytest.mark.parametrize("transport", ["emulated", "nvshmem"])
@pytest.mark.parametrize("gpus", sorted(PROXY_DEVICE_BUNDLES, reverse=True), ids=lambda n: f"ep{n}")
def test_proxy_bundles_through_buffer_with_tables_from_the_gpu(gpus, transport):
    """The GPU proxy path's bundles through Buffer with their tables written on the GPU
    (proxy_worker.py): the proxy set up once, fresh routing on every call in normal and
    low-latency mode, uneven token counts with a rank of none, CUDA graph replays, all against the
    oracle, over each transport."""
    _proxy_worker(gpus, PROXY_DEVICE_BUNDLES[gpus], transport)


# what runs across CUDA IPC domains (boxes): the proxy path (tables from the GPU) with the routing
# all-gathered by the process group (tests/gpu/bundles.py PROXY_COLLECTIVE_VARIANTS)
ACROSS_BOXES = ["h200x2_2vnode_50_proxy_collective"]


def test_a_proxy_collective_bundle_runs_with_every_rank_in_its_own_ipc_domain():
    """Two ranks, each its own CUDA IPC domain (EPCC_CUDA_IPC_DOMAIN=box{rank}: two boxes on one
    machine), the RDMA step over NVSHMEM, the routing over NCCL: proxy_worker.py's checks all
    pass and no rank opened a CUDA IPC mapping (the plan's two vnodes share no NVLink step)."""
    for b in ACROSS_BOXES:
        if (BUNDLES / b / "cuda" / "manifest.json").is_file():
            m = json.loads((BUNDLES / b / "cuda" / "manifest.json").read_text(encoding="utf-8"))
            assert (m["options"]["rdma"], m["metadata"]["lowering"], m["metadata"]["exchange"]) == \
                ("proxy", "device", "collective"), b
    out = _proxy_worker(2, ACROSS_BOXES, "nvshmem", env={"EPCC_CUDA_IPC_DOMAIN": "box{rank}"})
    assert "CUDA IPC: 0 mappings opened on all ranks, 2 domain(s)" in out, out[-6000:]


@pytest.mark.parametrize("worker, args, refusal", [
    (PROXY_WORKER, ["emulated", "h200x2_2vnode_50_proxy_collective"], "'emulated' transport"),
    (WORKER, ["h200x2_2vnode_50_collective"], "over peer memory, but they are in different CUDA IPC domains"),
    (WORKER, ["h200x2"], "the direct kernels (a one-hop plan) map every peer's memory"),
], ids=["emulated-transport", "rdma-step-as-peer-copies", "direct-kernels"])
def test_what_cannot_cross_ipc_domains_is_refused_on_every_rank(worker, args, refusal):
    """Each rank its own CUDA IPC domain: a bundle that would map a peer across domains is refused
    when the Buffer is made, on every rank, with the reason (not a failed cudaIpcOpenMemHandle), and
    every rank then exits with status 1 (the worker's verdict), not by a signal: the ranks run as
    torchrun runs them, but each one's own exit status is kept (torchrun's is 1 either way, and it
    signals a rank that is slower to exit than its peer)."""
    bundles = [a for a in args if a not in ("emulated", "nvshmem")]
    why = _why_not(2, bundles)
    if why:
        pytest.skip(why)
    cmd = [sys.executable, str(worker), *[a if a in ("emulated", "nvshmem") else str(BUNDLES / a) for a in args]]
    # a rank that crashes prints its Python stack (faulthandler)
    env = _gpu_env(2, {"EPCC_CUDA_IPC_DOMAIN": "box{rank}", "PYTHONFAULTHANDLER": "1"})
    results = run_ranks(cmd, 2, env=env, cwd=ROOT, timeout_s=600)
    out = "\n".join(f"--- rank {r.rank} ({r.ended()}):\n{r.output[-6000:]}" for r in results)
    assert [r.returncode for r in results] == [1, 1], f"{' '.join(cmd)}:\n{out}"
    assert out.count(refusal) >= 2, out
    assert "cudaIpcOpenMemHandle" not in out, out


@pytest.mark.parametrize("transport", ["emulated", "nvshmem"])
def test_proxy_bundles_through_buffer_ep4_shared_gpus(transport):
    """The 4-rank proxy bundles through proxy_worker.py as 4 ranks on GPUs 0 and 1 where fewer
    than 4 are present (a 4-GPU machine runs the ep4 case of the test above instead)."""
    ranks, gpus = SHARED
    have, what = _gpus()
    if have >= ranks:
        pytest.skip(f"{what}: test_proxy_bundles_through_buffer_with_tables_from_the_gpu[ep4-*] runs them")
    out = _proxy_worker(gpus, PROXY_DEVICE_BUNDLES[ranks], transport, ranks=ranks)
    assert f"{ranks} ranks, {gpus} x " in out, out[-6000:]


def _host_tables(name: str) -> bool:
    """Whether bundle `name` was compiled `--proxy-tables host` (its manifest's options)."""
    m = BUNDLES / name / "cuda" / "manifest.json"
    return m.is_file() and json.loads(m.read_text(encoding="utf-8"))["options"].get("proxy_device_tables") is False


def sim_mismatches(report_path: Path) -> list[str]:
    """What of bench/ep_bench.py's report (ep_bench.json) is off: the median dispatch and combine of
    the SIM_CHECKED bundles off `epcc simulate` by more than SIM_TOLERANCE, and a FAST_STEP that
    did not land by FAST_BY of its slow step's landing; one line per miss, starting with the
    bundle's name."""
    out = []
    for b in json.loads(report_path.read_text(encoding="utf-8"))["bundles"]:
        name, sim = b["name"], b.get("simulate")
        if name not in SIM_CHECKED:
            continue
        methods = b.get("methods", {})  # the kernels alone: the cached-handle row where the bundle has one
        r = methods["epcc_cached"] if "summary" in methods.get("epcc_cached", {}) else methods.get("epcc", {})
        if not sim or "summary" not in r:
            out.append(f"{name}: no simulate.json or no epcc result to compare")
            continue
        for p in ("dispatch", "combine"):
            m, s, what = r["summary"][p]["median_ms"], sim[p]["total_ms"], "measured"
            if p == "dispatch" and _host_tables(name):
                # host-built tables: the Buffer's normal mode, whose cached call also builds the outputs'
                # expert ids and weights on the host (bench/sim_check.py KERNEL_ONLY): the kernel's end
                ends = [float(t["timeline"][p]["end_ms"]) for t in r.get("per_rank") or []
                        if (t.get("timeline") or {}).get(p)]
                if not ends:
                    out.append(f"{name}: {p} is compared by its kernel (host-built tables), but no role timeline")
                    continue
                m, s, what = max(ends), s - float(sim[p].get("launch_ms", 0.0)), "kernel end"
            if abs(m / s - 1) > SIM_TOLERANCE:
                out.append(f"{name}: {p} {what} {m:.3f} ms, simulated {s:.3f} ms ({(m / s - 1) * 100:+.0f} %)")
        if name in FAST_STEP:
            p, fast, slow = FAST_STEP[name]
            tl = (r.get("per_rank") or [{}])[0].get("timeline") or {}
            end = {x["step"]: x["end_ms"] for x in tl.get(p, {}).get("roles", [])}
            got = [end.get(f"{s} (unpack)") for s in (fast, slow)]
            if None in got:
                out.append(f"{name}: no {p} timeline of '{fast} (unpack)' and '{slow} (unpack)' on rank 0")
            elif got[0] > FAST_BY * got[1]:
                sim_end = [sim[p]["steps"].get(s, [0, float("nan")])[1] for s in (fast, slow)]
                out.append(f"{name}: {p} '{fast}' (fast link) landed by {got[0]:.3f} ms on rank 0, "
                           f"{got[0] / got[1]:.2f} of '{slow}' (slow link, {got[1]:.3f} ms); at most {FAST_BY:g} "
                           f"(simulated {sim_end[0]:.3f} / {sim_end[1]:.3f} ms = {sim_end[0] / sim_end[1]:.2f})")
    return out
