"""engine-selection (SPC or DMA per step from the link's `engines`), what the simulator makes of
the choice, and the duplicate-mode launch kernel-formation records (plan/launch.py).  The lit test
tests/lit/engine-selection/choose.sched pins the printed reasons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from epcc.plan import Plan
from epcc.plan.check import PlanJsonError, check_plan_json
from epcc.sim import simulate
from epcc.sim.build import build_plan

REPO = Path(__file__).resolve().parents[2]

TEXT = """
topology duo {
  vendor biren arch br166
  levels card 2, die 2
  rank die
  relation far = other card, any die
  relation twin = other die
  SM
  link blink p2p { connects far  bandwidth BW  ENGINES }
  link d2d d2d { connects twin  bandwidth 200 GB/s  engine spc }
  link hbm local { bandwidth 1000 GB/s }
}
workload { tokens 4096 per rank  hidden 1024  dtype bf16  topk 1  experts 4 blocked }
dispatch {
  step cross: send tokens for far from input to far.output over blink OPTS
  step hand: send tokens for twin from input to twin.output over d2d
  step keep: permute input into output
}
combine reverse of dispatch
"""


def plan_of(tmp_path: Path, bw="20 GB/s", engines="engines spc 27.9 GB/s, dma 15 GB/s", opts="", sm="") -> Plan:
    p = tmp_path / "duo.sched"
    p.write_text(TEXT.replace("BW", bw).replace("ENGINES", engines).replace("OPTS", opts).replace("SM", sm),
                 encoding="utf-8")
    return build_plan(str(p)).plan


def cross(plan: Plan, program: str = "dispatch"):
    return plan.step("cross", program)


def test_the_faster_engine_wins_and_only_a_binding_engine_becomes_a_resource(tmp_path):
    plan = plan_of(tmp_path)
    s = cross(plan)
    assert s.engine == "spc" and s.engine_why.endswith("; fastest: spc")
    assert not any(r.startswith("engine:") for f in s.flows for r in f.resources)  # 27.9 GB/s > the link's 20
    assert plan.step("hand").engine == "spc" and plan.step("hand").engine_why is None  # one engine: no choice
    d = plan_of(tmp_path, engines="engines spc 10 GB/s, dma 15 GB/s")
    s = cross(d)
    assert s.engine == "dma" and s.engine_why == ("spc 10 GB/s: 209.715 us; dma 15 GB/s: 139.810 us; fastest: dma")
    assert {r for f in s.flows for r in f.resources if r.startswith("engine:")} == {
        f"engine:blink.dma:{f.src}>{f.dst}" for f in s.flows}
    assert all(d.resources[f"engine:blink.dma:{f.src}>{f.dst}"] == 15e9 for f in s.flows)


def test_a_tie_keeps_the_links_engine(tmp_path):
    """Both engines faster than a 10 GB/s link: the same time, the link's engine (first of `engines`,
    or the one it names)."""
    s = cross(plan_of(tmp_path, bw="10 GB/s", engines="engines spc 20 GB/s, dma 30 GB/s"))
    assert s.engine == "spc" and s.engine_why.endswith("; tie: spc, the link's engine")
    s = cross(plan_of(tmp_path, bw="10 GB/s", engines="engines spc 20 GB/s, dma 30 GB/s engine dma"))
    assert s.engine == "dma" and s.engine_why.endswith("; tie: dma, the link's engine")


def test_few_spcs_lose_to_the_dma_engine(tmp_path):
    """A thread engine of a step that names its SMs moves at most sms x the `sm` line's rate, for
    all of a die's flows together: 4 SPCs of 5 GB/s copy 20 GB/s per die, 10 to each of its 2
    far ranks, below DMA's 15 GB/s per pair; 8 SPCs keep up with the link (20 GB/s per pair)."""
    s = cross(plan_of(tmp_path, opts="sms 4", sm="sm copy 5 GB/s"))
    assert s.engine == "dma" and s.engine_why.endswith("; fastest: dma")
    s = cross(plan_of(tmp_path, opts="sms 8", sm="sm copy 5 GB/s"))
    assert s.engine == "spc" and s.engine_why.startswith(
        "spc 27.9 GB/s (link 20 GB/s binds) (at most 8 x 5 GB/s per rank): 104.858 us; dma 15 GB/s: 139.810 us")


def test_the_step_option_wins_for_the_step_and_its_reverse(tmp_path):
    plan = plan_of(tmp_path, opts="engine dma")
    for program in ("dispatch", "combine"):
        s = cross(plan, program)
        assert s.engine == "dma" and s.engine_why.startswith("engine dma (step option, line 15); cost model: spc")
    roles = {(k.program, r.step): (k.kind, r.engine) for k in plan.kernels for r in k.roles}
    assert roles[("dispatch", "cross")] == roles[("combine", "cross")] == ("dma", "dma")
    assert roles[("dispatch", "hand")] == ("kernel", "spc")


def test_simulate_charges_the_chosen_engine(tmp_path):
    """What kernel-formation runs is what `epcc simulate` times: DMA at 15 GB/s takes 4/3 of the
    link-bound SPC time for cross's 2.1 MB per port."""
    spc = simulate(plan_of(tmp_path)).programs["dispatch"]
    dma = simulate(plan_of(tmp_path, opts="engine dma")).programs["dispatch"]
    t_spc = next(s for s in spc.steps if s.name == "cross").alone_s
    t_dma = next(s for s in dma.steps if s.name == "cross").alone_s
    assert t_spc == pytest.approx(2 ** 21 / 20e9, rel=1e-6) and t_dma == pytest.approx(2 ** 21 / 15e9, rel=1e-6)
    assert next(s for s in dma.steps if s.name == "cross").engine == "dma"
    assert "blink dma" in {c.name for c in dma.link_classes.values()}


def test_duplicate_launch(tmp_path):
    card = build_plan(str(REPO / "schedules" / "ubbv2_card.sched")).plan
    assert card.launch.duplicate == [[0, 1]]
    ep32 = build_plan(str(REPO / "schedules" / "ubbv2_ep32.sched")).plan
    assert ep32.launch.duplicate == [[r, r + 1] for r in range(0, 32, 2)]
    port10 = build_plan(str(REPO / "schedules" / "ubbv2_ep32_port10.sched")).plan
    assert port10.launch.duplicate == []
    assert port10.launch.why.startswith("not symmetric across the dies: dispatch step 'x_p10' (line ")
    assert build_plan(str(REPO / "schedules" / "ocs_ep16.sched")).plan.launch.why.startswith(
        "the ranks are cards, 8 per instance of the level above, not the 2 dies of a br166 card")
    assert build_plan(str(REPO / "schedules" / "h200x4.sched")).plan.launch.why == (
        "nvidia hopper: one die per card, nothing to duplicate")


def test_plan_json_carries_engines_and_launch(tmp_path):
    plan = plan_of(tmp_path, opts="engine dma")
    d = json.loads(plan.to_json())
    back = Plan.from_dict(check_plan_json({"format": "epcc-plan", "version": 1, **json.loads(json.dumps(d))}))
    assert cross(back).engine == "dma" and cross(back).engine_why == cross(plan).engine_why
    assert back.launch == plan.launch and back.launch.duplicate == [[0, 1], [2, 3]]
    i = next(i for i, s in enumerate(d["steps"]) if s["name"] == "cross")
    for edit, text in ((lambda x: x["steps"][i].update(engine="gpu"),
                        f"steps[{i}].engine: 'gpu' is not one of sm, spc, tma, ce, dma, nic, proxy"),
                       (lambda x: x["launch"].update(duplicate=[[0, 1], [1, 2]]),
                        "launch.duplicate[1][0]: rank 1 appears twice"),
                       (lambda x: x["launch"].update(duplicate=[[0, 4]]),
                        "launch.duplicate[0][1]: 4 is out of range (a rank 0..3)"),
                       (lambda x: x["launch"].update(duplicate=[[0]]),
                        "launch.duplicate[0]: 1 ranks (expected the 2 dies of a card)")):
        bad = {"format": "epcc-plan", "version": 1, **json.loads(json.dumps(d))}
        edit(bad)
        with pytest.raises(PlanJsonError) as e:
            check_plan_json(bad)
        assert str(e.value) == text
