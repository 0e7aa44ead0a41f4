"""bench/acceptance.sh on the CPU: its argument errors, and its dry run (DRY=1: the commands
printed, not run) for every phase and GPU count, checked for the bundles each command names
(those tests/gpu/bundles.py writes), the tests phases' selections (collected by pytest: together
exactly test_gpu.py's cases of that many ranks) and bounds that keep every phase within 10
minutes."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "acceptance.sh"
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import bundles  # noqa: E402  (what the bundle directory holds)
import test_gpu  # noqa: E402  (the GPU tests' bundle lists)

PHASES = ("tests", "tests-proxy", "bench", "tuned", "tokens", "multihop")
LIMIT_S = 600  # one device call
MULTIHOP = {2: ["h200x2_2vnode_50"], 4: ["h200x4_2vnode_50", "h200x4_ubb2x2_50"],
            8: ["h200x8_2vnode_50", "h200x8_ubb4x2_50"]}


def written() -> set[str]:
    """Every bundle tests/gpu/bundles.py writes."""
    names = set(bundles.VARIANTS) | set(bundles.SCHEDULE_VARIANTS) | set(bundles.RDMA_VARIANTS)
    names |= {f"{n}_proxy" for n in bundles.RDMA_VARIANTS} | {f"{n}_proxy_dev" for n in bundles.PROXY_DEVICE_VARIANTS}
    names |= {f"{n}_collective" for n in bundles.COLLECTIVE_VARIANTS} | set(bundles.SUPA_VARIANTS)
    return names | set(bundles.SUPA_SCHEDULES)


@pytest.fixture(scope="module")
def fake_bundles(tmp_path_factory) -> Path:
    """A bundle directory with a manifest for every bundle (the dry run only looks for them)."""
    d = tmp_path_factory.mktemp("bundles")
    for n in written():
        (d / n / "cuda").mkdir(parents=True)
        (d / n / "cuda" / "manifest.json").write_text("{}", encoding="utf-8")
    return d


def dry(gpus: int, b: Path, phase: str, out: Path, **env: str) -> list[list[str]]:
    """The dry run's commands, each as its words (redirections and `&` kept as words)."""
    full = {"PATH": "/usr/bin:/bin", "DRY": "1", **env}
    r = subprocess.run(["bash", str(SCRIPT), str(gpus), str(b), str(out), phase], capture_output=True, text=True,
                       env=full, cwd=out.parent)
    assert r.returncode == 0, r.stderr
    assert not out.exists()  # a dry run writes nothing
    return [shlex.split(line[2:], comments=True) if line.startswith("+ ") else [line]
            for line in r.stdout.splitlines()]


def named_bundles(cmd: list[str], b: Path) -> list[str]:
    return [Path(w).name for w in cmd if w.startswith(f"{b}/")]


def prebuilds(cmd: list[str]) -> bool:
    return "epcc.runtime.prebuild" in cmd


def ep_bench(cmds: list[list[str]]) -> list[str]:
    (cmd,) = [c for c in cmds if "bench/ep_bench.py" in c]
    return cmd


def bound(cmd: list[str]) -> int:
    """The seconds `timeout` gives the command, plus the grace of -k."""
    assert cmd[0] == "timeout", cmd
    if cmd[1] == "-k":
        return int(cmd[2]) + int(cmd[3])
    return int(cmd[1])


def worst_case(cmds: list[list[str]]) -> int:
    """The phase's longest run: every bounded command one after another, a background one (`&`)
    overlapping what runs until the `wait` for it."""
    total, bg, since = 0, None, 0
    for c in cmds:
        if c[0] == "wait":
            total += max(0, bg - since) if bg is not None else 0
            bg = None
        elif c[0] == "timeout" and c[-1] == "&":
            bg, since = bound(c), 0
        elif c[0] == "timeout":
            total += bound(c)
            since += bound(c)
    return total + (bg or 0)


@pytest.mark.parametrize("gpus", [2, 4, 8])
@pytest.mark.parametrize("phase", PHASES)
def test_dry_run_names_the_right_bundles_within_ten_minutes(fake_bundles, tmp_path, gpus, phase):
    cmds = dry(gpus, fake_bundles, phase, tmp_path / "OUT", DEEPEP_SRC=str(tmp_path / "baselines"))
    assert worst_case(cmds) <= LIMIT_S - 20, cmds  # and the install, the start
    run = [c for c in cmds if c[0] == "timeout" and not prebuilds(c)]
    assert run, cmds
    # every library built at once first, for the bundles the phase runs (tests: every bundle)
    (pre,) = [i for i, c in enumerate(cmds) if prebuilds(c)]
    assert pre < min(i for i, c in enumerate(cmds) if "torchrun" in c or "pytest" in c), cmds
    names = named_bundles(cmds[pre], fake_bundles)
    used = {n for c in cmds if not prebuilds(c) for n in named_bundles(c, fake_bundles)}
    assert set(names) == (written() if phase.startswith("tests") else used), (names, used)
    for c in run:  # every bundle a command names is one tests/gpu/bundles.py writes, of this many ranks
        for n in named_bundles(c, fake_bundles):
            assert n in written(), (n, c)
    for c in cmds:
        if "torchrun" in c:
            assert c[c.index("--nproc-per-node") + 1] == str(gpus), c
    g = gpus
    if phase in ("bench", "tuned", "tokens"):
        want = {"bench": [f"h200x{g}", f"h200x{g}_fp8", f"h200x{g}_t128"],
                "tokens": [f"h200x{g}_tok", f"h200x{g}_tok_fp8", f"h200x{g}_tok_t128"]}.get(phase)
        cmd = ep_bench(cmds)
        got = [Path(w).name for w in cmd[cmd.index("--bundles") + 1: cmd.index(">")]]
        assert got == (want or [f"h200x{g}", f"h200x{g}_fp8", f"h200x{g}_t128"]), cmd
        assert "--methods" not in cmd  # every method: epcc, NCCL, torch and DeepEP where built
        assert cmd[cmd.index("--out") + 1] == str(tmp_path / "OUT" / {"bench": "default"}.get(phase, phase))
        # DeepEP built in the background from DEEPEP_SRC, waited for before ep_bench
        build = [i for i, c in enumerate(cmds) if c[-1] == "&"]
        wait = [i for i, c in enumerate(cmds) if c[0] == "wait"]
        assert len(build) == 1 and len(wait) == 1 and build[0] < wait[0] < cmds.index(cmd), cmds
        assert "deepep-intranode-build.patch" in " ".join(cmds[build[0]])
        assert cmds[build[0]][-4:-2] == [">", str(tmp_path / "OUT" / "deepep_build.log")]
        if phase == "tuned":  # the tuning runs while DeepEP builds; targets.py at the end
            tunes = [c for c in run if "epcc.runtime.tune" in c]
            assert [Path(c[c.index("--iters") + 2]).name for c in tunes] == [f"h200x{g}", f"h200x{g}_t128"]
            assert build[0] < cmds.index(tunes[0]) < wait[0]
            assert "bench/targets.py" in cmds[-1]
        else:
            assert cmd[:4] == ["timeout", "-k", "20", "330"], cmd
            assert cmds[-1][-2:] == ["bench/sim_check.py", str(tmp_path / "OUT" / phase.replace("bench", "default")
                                                                    / "ep_bench.json")]
        if phase == "tokens":
            assert cmd[cmd.index("--epcc-sms") + 1] == cmd[cmd.index("--deepep-sms") + 1] == "24,48"
    elif phase == "multihop":
        workers = [c for c in run if "tests/gpu/ep_worker.py" in c]
        assert [named_bundles(c, fake_bundles) for c in workers] == [[m] for m in MULTIHOP[g]]
        for c in workers:  # one bounded run per plan, fresh routings
            assert c[:4] == ["timeout", "-k", "20", "70"] and "EPCC_GPU_ROUTINGS=uniform,zipf:1.2,all-to-one" in c
        cmd = ep_bench(cmds)
        assert cmd[cmd.index("--methods") + 1] == "epcc"
        assert named_bundles(cmd, fake_bundles) == [x for m in MULTIHOP[g] for x in (m, f"{m}_proxy_dev", f"{m}_proxy")]
        assert "bench/sim_check.py" in cmds[-1]
    else:
        (cmd,) = run
        assert cmd[:4] == ["timeout", "-k", "20", "450"] and f"EPCC_GPU_BUNDLES={fake_bundles}" in cmd
        assert cmd[cmd.index("-k", 4) - 1] == "tests/gpu/test_gpu.py"


def _collect(selection: str) -> set[str]:
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "tests/gpu/test_gpu.py", "-k", selection], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode in (0, 5), r.stdout + r.stderr  # 5: nothing selected
    return {line.split("::", 1)[1] for line in r.stdout.splitlines() if "::" in line}


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_tests_phases_select_every_case_of_that_many_ranks_once(fake_bundles, tmp_path, gpus):
    """tests and tests-proxy together select test_gpu.py's cases of GPUS ranks, each once: the
    ep{GPUS} ones (and with 2, the 4-rank bundles time-sliced on 2 GPUs) and the collective-metadata
    bundle; the proxy and SUPA-shim cases in tests-proxy."""
    sel = {}
    for phase in ("tests", "tests-proxy"):
        (cmd,) = [c for c in dry(gpus, fake_bundles, phase, tmp_path / "OUT") if c[0] == "timeout" and not prebuilds(c)]
        sel[phase] = _collect(cmd[cmd.index("-k", 4) + 1])
    every = _collect("")
    if gpus == 2:  # everything a 2-GPU machine runs: all but the ep4 and ep8 cases on a GPU each
        want = {t for t in every if not re.search(r"ep[48]\b", t) or "shared" in t}
    else:
        want = {t for t in every if re.search(rf"\bep{gpus}\b", t) or "collective" in t}
    assert want and sel["tests"] | sel["tests-proxy"] == want
    assert not sel["tests"] & sel["tests-proxy"]
    assert all("proxy" in t or "supa" in t for t in sel["tests-proxy"])
    # a case per bundle: the proxy-path bundles' cases go with the proxy phase
    worker = {b: f"test_ep_worker_all_ok[ep{gpus}-{b}]" for b in test_gpu.CASES[gpus]}
    assert {t for t in sel["tests"] if "ep_worker_all_ok" in t} == {t for b, t in worker.items() if "proxy" not in b}
    assert {t for t in sel["tests-proxy"] if "ep_worker_all_ok" in t} == {t for b, t in worker.items() if "proxy" in b}
    assert "test_collective_metadata_exchange" in sel["tests"]
    assert f"test_gpu_proxy_path[ep{gpus}-emulated]" in sel["tests-proxy"]


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_every_case_of_test_gpu_has_its_bundles(gpus):
    """The GPU tests' bundle lists of GPUS ranks are all written by tests/gpu/bundles.py (else the
    tests phase would skip them)."""
    lists = [test_gpu.CASES, test_gpu.UNEVEN, test_gpu.PROXY_BUNDLES, test_gpu.PROXY_DEVICE_BUNDLES,
             test_gpu.SUPA_CASES]
    names = [n for d in lists for n in d.get(gpus, [])] + (test_gpu.COLLECTIVE if gpus == 2 else [])
    assert names and set(names) <= written()


def test_without_deepep_src_the_bench_says_so(fake_bundles, tmp_path):
    cmds = dry(4, fake_bundles, "bench", tmp_path / "OUT")
    assert ["DeepEP: DEEPEP_SRC not set: ep_bench runs without DeepEP"] in cmds
    assert not [c for c in cmds if c[-1] == "&" or c[0] == "wait"]


@pytest.mark.parametrize("args, code, message", [
    (["3", "B", "OUT", "bench"], 2, "bench/acceptance.sh: GPUS must be 2, 4 or 8, got '3'"),
    (["2", "B", "OUT"], 2, "usage: bench/acceptance.sh GPUS BUNDLES OUT tests|tests-proxy|bench|tuned|tokens|multihop"),
    (["4", "B", "OUT", "bake"], 2,
     "usage: bench/acceptance.sh GPUS BUNDLES OUT tests|tests-proxy|bench|tuned|tokens|multihop"),
    (["2", "{tmp}/none", "OUT", "bench"], 1,
     "bench/acceptance.sh: no bundle {tmp}/none/h200x2 (run tests/gpu/bundles.py {tmp}/none on a CPU machine)"),
    (["8", "{tmp}/none", "OUT", "multihop"], 1,
     "bench/acceptance.sh: no bundle {tmp}/none/h200x8_2vnode_50 (run tests/gpu/bundles.py {tmp}/none on a CPU machine)"),
    (["4", "{tmp}/none", "OUT", "tokens"], 1,
     "bench/acceptance.sh: no bundle {tmp}/none/h200x4_tok (run tests/gpu/bundles.py {tmp}/none on a CPU machine)"),
])
def test_acceptance_script_refuses_bad_arguments(tmp_path, args, code, message):
    args = [a.format(tmp=tmp_path) for a in args]
    r = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == code
    assert r.stderr.strip() == message.format(tmp=tmp_path)
    assert not (tmp_path / "OUT").exists()  # nothing made before the arguments are checked
