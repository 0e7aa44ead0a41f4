"""runtime/engines/ipc_domain.py on the CPU: each process's CUDA IPC domain, and what a
table-driven bundle maps (or why it is refused) when its ranks span several domains."""

from __future__ import annotations

from pathlib import Path

import pytest

from epcc import pipeline
from epcc.backends.cuda import codegen
from epcc.runtime.engines.base import EngineError
from epcc.runtime.engines.cuda_direct import engine as direct
from epcc.runtime.engines.cuda_table.engine import CudaTableEngine
from epcc.runtime.engines.ipc_domain import ENV, host_domain, ipc_peers, local_domain, one_domain

REPO = Path(__file__).resolve().parents[2]
_PLANS: dict = {}


def _plan(name: str):
    if name not in _PLANS:
        _PLANS[name] = pipeline.run(str(REPO / "schedules" / f"{name}.sched")).passes.get("plan")
    return _PLANS[name]


def _manifest(name: str, **opts) -> dict:
    return codegen.generate(_plan(name), f"schedules/{name}.sched", codegen.CudaOptions(**opts)).manifest


BOXES2 = ["box0", "box1"]  # one rank per box
VNODES4 = ["a", "a", "b", "b"]  # h200x4_2vnode: vnode 0 = ranks 0, 1; vnode 1 = ranks 2, 3


# -------------------------------------------------------------------- the domain of a process
def test_the_default_is_the_host_with_its_boot_id():
    assert local_domain(0, {}) == host_domain()
    assert local_domain(5, {ENV: "  "}) == host_domain()
    boot = Path("/proc/sys/kernel/random/boot_id")
    if boot.is_file():
        assert host_domain().endswith("/" + boot.read_text().strip())


def test_the_variable_names_it_with_placeholders_expanded_per_process():
    assert local_domain(3, {ENV: "box{rank}"}) == "box3"
    assert local_domain(3, {ENV: "node-a/{local_rank}", "LOCAL_RANK": "1"}) == "node-a/1"
    assert local_domain(0, {ENV: "{host}:c1"}) == host_domain() + ":c1"
    assert local_domain(0, {ENV: "plain {{braces}}"}) == "plain {braces}"


@pytest.mark.parametrize("text, why", [
    ("box{node}", "unknown placeholder {node} (one of {rank}, {local_rank}, {host})"),
    ("box{rank:>3}", "a placeholder takes no conversion or format (write {rank})"),
    ("box{host!r}", "a placeholder takes no conversion or format (write {host})"),
    ("box{", "Single '{' encountered in format string (write {{ and }} for literal braces)"),
    ("box{local_rank}", "{local_rank} needs LOCAL_RANK in the environment (torchrun sets it)"),
])
def test_a_malformed_variable_is_refused_naming_it(text, why):
    with pytest.raises(EngineError) as e:
        local_domain(0, {ENV: text})
    assert str(e.value) == f"{ENV}={text!r}: {why}"


# -------------------------------------------------------------------- what a bundle maps
def test_one_domain_maps_every_peer_as_always():
    plan = _plan("h200x2_2vnode")
    for m in (_manifest("h200x2_2vnode"), _manifest("h200x2_2vnode", rdma="proxy")):
        for transport in ("emulated", "nvshmem"):
            assert [ipc_peers(plan, m, transport, ["h", "h"], r) for r in range(2)] == [{1}, {0}]


def test_the_proxy_collective_bundle_runs_with_every_rank_its_own_box():
    plan = _plan("h200x2_2vnode")
    m = _manifest("h200x2_2vnode", rdma="proxy", metadata_exchange="collective")
    assert [ipc_peers(plan, m, "nvshmem", BOXES2, r) for r in range(2)] == [frozenset(), frozenset()]


def test_two_vnodes_of_two_gpus_map_their_vnode_only():
    plan = _plan("h200x4_2vnode")
    m = _manifest("h200x4_2vnode", rdma="proxy", metadata_exchange="collective")
    assert [ipc_peers(plan, m, "nvshmem", VNODES4, r) for r in range(4)] == [{1}, {0}, {3}, {2}]
    # host tables (`--proxy-tables host`): the routing goes round the host, no metadata exchange to refuse
    m = _manifest("h200x4_2vnode", rdma="proxy", proxy_device_tables=False)
    assert m["metadata"]["lowering"] == "host"
    assert [ipc_peers(plan, m, "nvshmem", VNODES4, r) for r in range(4)] == [{1}, {0}, {3}, {2}]


def _refusal(name: str, transport: str, domains: list[str], rank: int, **opts) -> str:
    with pytest.raises(EngineError) as e:
        ipc_peers(_plan(name), _manifest(name, **opts), transport, domains, rank)
    return str(e.value)


def test_the_metadata_exchange_over_ipc_across_domains_is_refused():
    assert _refusal("h200x2_2vnode", "nvshmem", BOXES2, 0, rdma="proxy", metadata_exchange="ipc") == (
        "the bundle's metadata kernels exchange the routing over CUDA IPC (metadata exchange 'ipc': every rank "
        "writes into every peer's gather area), but rank 0 (CUDA IPC domain 'box0') and rank 1 ('box1') are in "
        "different CUDA IPC domains: recompile schedules/h200x2_2vnode.sched with `--metadata-exchange collective` "
        "(the process group's all-gather carries the routing)")


def test_an_rdma_step_emulated_by_peer_copies_across_domains_is_refused_with_its_line():
    step = next(s for s in _plan("h200x2_2vnode").steps if s.program == "dispatch" and s.link_kind == "rdma")
    got = _refusal("h200x2_2vnode", "emulated", BOXES2, 1, rdma="emulate", metadata_exchange="collective")
    assert got == (
        f"dispatch step '{step.name}' (schedules/h200x2_2vnode.sched:{step.line}) moves rows between rank 0 (CUDA "
        f"IPC domain 'box0') and rank 1 ('box1') over peer memory, but they are in different CUDA IPC domains: "
        f"compile it with `--rdma proxy` (the GPU proxy path carries RDMA steps: run it with the nvshmem transport)")


def test_an_nvlink_step_across_domains_is_refused():
    # the two GPUs of vnode 0 in different boxes: the first step joining them is named
    plan = _plan("h200x4_2vnode")
    got = _refusal("h200x4_2vnode", "nvshmem", ["a", "c", "b", "b"], 2, rdma="proxy", metadata_exchange="collective")
    step = got.split("step '")[1].split("'")[0]
    s = plan.step(step, "dispatch")
    assert s.link_kind != "rdma"
    assert got == (
        f"dispatch step '{step}' (schedules/h200x4_2vnode.sched:{s.line}) moves rows between rank 0 (CUDA IPC "
        f"domain 'a') and rank 1 ('c') over peer memory, but they are in different CUDA IPC domains: run the ranks "
        f"that step connects in one domain, or carry the step over an RDMA link compiled with `--rdma proxy`")


def test_the_emulated_transport_across_domains_is_refused():
    step = next(s for s in _plan("h200x4_2vnode").steps if s.program == "dispatch" and s.link_kind == "rdma")
    got = _refusal("h200x4_2vnode", "emulated", VNODES4, 0, rdma="proxy", metadata_exchange="collective")
    assert got == (
        f"dispatch step '{step.name}' (schedules/h200x4_2vnode.sched:{step.line}) goes from rank 0 to rank 2 over "
        f"the GPU proxy path, whose 'emulated' transport copies peer to peer over CUDA IPC, but rank 0 (CUDA IPC "
        f"domain 'a') and rank 2 ('b') are in different CUDA IPC domains: use the transport nvshmem (Buffer config "
        f"rdma_transport='nvshmem')")


def test_a_group_of_another_size_is_refused():
    with pytest.raises(EngineError) as e:
        ipc_peers(_plan("h200x2_2vnode"), _manifest("h200x2_2vnode"), "nvshmem", ["a", "a", "a"], 0)
    assert str(e.value) == "3 ranks in the group, the bundle's plan has 2"


def test_the_direct_kernels_need_one_domain():
    one_domain(["h", "h", "h"], "the direct kernels")
    with pytest.raises(EngineError) as e:
        one_domain(["h", "h", "g"], "the direct kernels")
    assert str(e.value) == (
        "the direct kernels map every peer's memory over CUDA IPC, so every rank must be in one CUDA IPC domain, "
        "but rank 0 (CUDA IPC domain 'h') and rank 2 ('g') are not: run on one host (or one IPC namespace), or "
        "compile a plan that is not one-hop (the table-driven kernels run across domains: docs/cuda.md); "
        f"{ENV} names a process's domain")


def test_the_emulated_transport_maps_every_rank_so_any_split_is_refused():
    """The RDMA peers (ranks 0 and 2, 1 and 3) share a domain, the vnodes do not: the emulated
    transport still maps every rank's landing slots (transport_emulated.cu emu_connect)."""
    plan = _plan("h200x4_2vnode")
    m = _manifest("h200x4_2vnode", rdma="proxy", metadata_exchange="collective")
    rdma = next(s for s in plan.steps if s.link_kind == "rdma")
    assert {(f.src, f.dst) for f in rdma.flows if f.src != f.dst} <= {(0, 2), (2, 0), (1, 3), (3, 1)}
    with pytest.raises(EngineError) as e:
        ipc_peers(plan, m, "emulated", ["a", "b", "a", "b"], 0)
    assert str(e.value) == (
        "the GPU proxy path's 'emulated' transport maps every rank's landing slots over CUDA IPC, but rank 0 (CUDA "
        "IPC domain 'a') and rank 1 ('b') are in different CUDA IPC domains: use the transport nvshmem (Buffer "
        "config rdma_transport='nvshmem')")


# -------------------------------------------------------------------- the engines ask before they build
class _Agree:
    """An agreement whose gather hands back the given domains (every rank's, as the round would)."""

    def __init__(self, domains):
        self.domains, self.phases = domains, []

    def gather(self, phase, obj):
        self.phases.append(phase)
        return list(self.domains)

    def barrier(self, phase, **_):
        raise AssertionError(f"reached '{phase}': the domains should have been refused before the build")


def test_the_table_engine_refuses_before_it_builds(monkeypatch, tmp_path):
    m = _manifest("h200x2_2vnode", rdma="proxy", metadata_exchange="collective")
    eng = CudaTableEngine.__new__(CudaTableEngine)
    eng.rank, eng.R, eng.agree = 1, 2, _Agree(BOXES2)
    monkeypatch.setattr(CudaTableEngine, "_manifest", lambda self, bundle: m)
    bundle = type("B", (), {"plan": _plan("h200x2_2vnode"), "path": tmp_path, "cuda_dir": tmp_path})()
    with pytest.raises(EngineError, match="'emulated' transport"):
        eng._make(bundle, 1.0, None)  # the default transport
    assert eng.agree.phases == ["the ranks' CUDA IPC domains"]


def test_the_direct_engine_refuses_ranks_in_two_domains_before_it_builds(monkeypatch, tmp_path):
    m = _manifest("h200x4")
    assert "direct" in m
    monkeypatch.setattr(direct, "cuda_manifest", lambda path: m)
    eng = direct.CudaDirectEngine.__new__(direct.CudaDirectEngine)
    eng.rank, eng.R, eng.agree = 0, 4, _Agree(["a", "a", "b", "b"])
    bundle = type("B", (), {"plan": _plan("h200x4"), "path": tmp_path, "cuda_dir": tmp_path})()
    with pytest.raises(EngineError) as e:
        eng._make(bundle, 1.0, None)
    assert "the direct kernels (a one-hop plan) map every peer's memory" in str(e.value)
    assert "rank 0 (CUDA IPC domain 'a') and rank 2 ('b')" in str(e.value)
