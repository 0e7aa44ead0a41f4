"""plan/peers.py against what the table-driven kernels really reach over peer memory.

For every shipped schedule (and the GPU tests' derived 8-GPU plans), compiled with RDMA steps
emulated by peer copies and, where the plan has RDMA steps, with `--rdma proxy`: every rank's
tables of both programs for a few routings, decoded, and every rank a kernel of that rank
dereferences (device.cu.j2: an SM or DMA role's copy reads its `src_rank`'s buffers, writes its
`dst_rank`'s, bumps its counter at `flag_rank` and waits on its items' WaitDesc ranks; a pack role
reads its `src_rank`'s buffers and waits; an unpack role writes its `dst_rank`'s buffer and bumps
its counter) must be in the rank's peer set, and over the routings the sets are exactly what the
kernels reach (symmetric: the entry barrier meets whoever maps whom).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from test_cuda_codegen import ALL, small_case

from epcc import pipeline
from epcc.backends.cuda import codegen
from epcc.backends.cuda.abi import NO_FLAG
from epcc.plan.peers import peer_sets, step_peers
from epcc.runtime import layout as layout_mod
from epcc.runtime.engines.cuda_table.tables import build_tables, parse_tables
from epcc.runtime.engines.ipc_domain import off_peer_memory, proxied_steps
from epcc.runtime.testing import inputs

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "gpu"))
import bundles  # noqa: E402 - the GPU tests' bundle list, beside them

# tokens per rank and chunk tokens small enough for every rank of the 32-rank plans
SIZES = {"ubbv2_ep32": (4, 1), "ubbv2_ep32_port10": (4, 1), "ubbv2_ep16": (8, 2), "ocs_ep16": (8, 2),
         "dgx_h800_2node": (8, 2)}
ROUTINGS = [("uniform", 0), ("uniform", 1), ("zipf:1.2", 2)]


def reached(manifest: dict, blob: np.ndarray, program: str) -> set[int]:
    """The ranks whose buffers or flag areas the kernel reading `blob` dereferences: through
    every copy of each role (the role's RoleDesc.num_copies, in role order: a copy with no rows
    this time counts too) and every wait of its items."""
    t = parse_tables(blob)
    kernel = next(k for k in manifest["kernels"] if k["program"] == program and k["kind"] == "main")
    assert len(t["roles"]) == len(kernel["roles"])
    out: set[int] = set()
    first = 0
    for rd, role in zip(t["roles"], kernel["roles"]):
        side = role.get("lowered")
        for c in t["copies"][first: first + int(rd["num_copies"])]:
            flag = [int(c["flag_rank"])] if int(c["flag_id"]) != NO_FLAG else []
            if side == "rdma-pack":  # reads its own rows; the proxy carries them
                out |= {int(c["src_rank"]), *flag}
            elif side == "rdma-unpack":  # writes the landed rows into its own buffer
                out |= {int(c["dst_rank"]), *flag}
            else:
                out |= {int(c["src_rank"]), int(c["dst_rank"]), *flag}
        first += int(rd["num_copies"])
        begin = int(rd["item_begin"])
        for it in t["items"][begin: begin + int(rd["item_count"])]:
            if side != "rdma-unpack":  # an unpack role waits for the landing signal only
                w0 = int(it["wait_begin"])
                out |= {int(w["flag_rank"]) for w in t["waits"][w0: w0 + int(it["wait_count"])]}
    assert first == len(t["copies"])
    return out


def _manifests(plan, source: str) -> list[tuple[str, dict]]:
    out = [("emulate", codegen.generate(plan, source).manifest)]
    if any(k.kind == "proxy" for k in plan.kernels):
        out.append(("proxy", codegen.generate(plan, source, codegen.CudaOptions(rdma="proxy")).manifest))
    return out


def _check(plan, manifests, routings) -> None:
    R = plan.num_ranks
    wl = plan.workload
    tokens = int(wl.tokens)
    for how, m in manifests:
        assert bool(proxied_steps(m)) == (how == "proxy")
        sets = peer_sets(plan, off_peer_memory(m))
        seen = [set() for _ in range(R)]
        for spec, seed in routings:
            idx = inputs.make_topk(spec, R, tokens, wl.topk, wl.experts, wl.placement, seed=seed).topk_idx
            w = inputs.make_weights(idx, seed=seed + 1)
            lay = layout_mod.compute_layout(plan, idx, w)
            for rank in range(R):
                for p in ("dispatch", "combine"):
                    if not any(k["program"] == p and k["kind"] == "main" for k in m["kernels"]):
                        continue
                    got = reached(m, build_tables(m, lay, p, rank).blob, p) - {rank}
                    assert got <= sets[rank], (how, spec, rank, p, sorted(got - sets[rank]))
                    seen[rank] |= got
        for a in range(R):  # the relation is symmetric and nothing beyond what some kernel reaches
            for b in seen[a]:
                seen[b].add(a)
        assert [frozenset(s) for s in seen] == sets, how


def _vnode(plan, rank: int) -> str:
    """The first level of a rank's name ('rank 3 (vnode 1, gpu 1)' -> 'vnode 1')."""
    m = re.search(r"\((\w+ \d+)", plan.rank_names[rank])
    assert m, plan.rank_names[rank]
    return m.group(1)


@pytest.mark.parametrize("name", ALL)
def test_every_shipped_plans_kernels_reach_only_their_peer_set(name):
    tokens, chunk = SIZES.get(name, (24, 3))
    plan, *_ = small_case(name, tokens, chunk)
    plan.workload.tokens = tokens
    _check(plan, _manifests(plan, f"schedules/{name}.sched"), ROUTINGS if plan.num_ranks <= 8 else ROUTINGS[:1])


@pytest.mark.parametrize("name", sorted(bundles.DERIVED_SCHEDULES))
def test_the_gpu_tests_8_gpu_plans_too(name, tmp_path):
    _, text, _ = bundles.schedule_text(name)
    path = tmp_path / f"{name}.sched"
    path.write_text(text, encoding="utf-8")
    plan = pipeline.run(str(path)).passes.get("plan")
    plan.workload.tokens = 16
    _check(plan, _manifests(plan, str(path)), ROUTINGS[:2])


@pytest.mark.parametrize("name", ["h200x2_2vnode", "h200x4_2vnode", "h200x4_ubb2x2", "h200x2_2vnode_relay"])
def test_a_proxy_bundle_maps_only_its_own_vnode(name):
    """With the RDMA steps on the GPU proxy path, a rank's kernels reach only GPUs of its own
    (v)node; with them emulated by peer copies, the other vnode's too."""
    plan, *_ = small_case(name, 8, 2)
    for how, m in _manifests(plan, f"schedules/{name}.sched"):
        sets = peer_sets(plan, off_peer_memory(m))
        for r, s in enumerate(sets):
            same = {x for x in range(plan.num_ranks) if x != r and _vnode(plan, x) == _vnode(plan, r)}
            if how == "proxy":
                assert s <= same, (r, sorted(s))
            else:
                assert s - same, (r, sorted(s))  # the emulated RDMA step crosses the vnodes


def test_the_2_gpu_2_vnode_proxy_plan_maps_nobody():
    plan, *_ = small_case("h200x2_2vnode", 8, 2)
    _, m = _manifests(plan, "schedules/h200x2_2vnode.sched")[1]
    assert peer_sets(plan, off_peer_memory(m)) == [frozenset(), frozenset()]
    assert step_peers(plan, off_peer_memory(m)) == {}
    assert set(step_peers(plan, set())) == {(0, 1)}  # the RDMA step, emulated over peer memory


def test_one_box_plans_reach_every_rank():
    """A one-box plan (every GPU reaches every other over NVLink) maps everyone, as always."""
    plan, *_ = small_case("h200x4", 8, 2)
    assert peer_sets(plan, set()) == [frozenset(set(range(4)) - {r}) for r in range(4)]
