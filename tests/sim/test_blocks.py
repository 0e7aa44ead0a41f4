"""The table-driven kernels' blocks in the simulator (sim/blocks.py): a role's chunks dealt to its
blocks as the kernels deal them (round-robin, each block publishing in chunk order before its next
item) or to the block free first; the engine's holds; `epcc simulate --dealing`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from epcc.cli import main
from epcc.plan import Flow, PlanStep
from epcc.runtime.layout.types import Copy
from epcc.sim import SimOptions
from epcc.sim.blocks import schedule_roles
from epcc.sim.engine import _Engine, simulate_steps

REPO = Path(__file__).resolve().parents[2]
UBB = str(REPO / "schedules" / "h200x4_ubb2x2.sched")


@dataclass
class _Run:
    """A fluid run's stand-in: the producer's flow 0 has moved everything at `late` s, the role's
    own flow (1) is never the bound."""

    late: float
    start_s: float = 0.0
    flow_at: dict = field(default_factory=lambda: {(0, 0): 0, (1, 0): 1})
    ready_t: tuple = (0.0, 0.0)
    end_t: tuple = (0.0, 0.0)

    def flow_crossing(self, f: int, frac: float) -> float:
        return self.late if f == 0 and frac > 0 else 0.0


def _steps(read: bool = True) -> list[PlanStep]:
    """The producer p, the role r that follows it and, where `read`, a step that reads what r writes
    (so r publishes its chunks in order)."""
    flow = Flow(rank=0, src=0, dst=0, bytes=4.0, resources=("hbm:0",))
    producer = PlanStep(name="p", program="dispatch", verb="copy", link="hbm", link_kind="local", deps=(), flows=[flow])
    role = PlanStep(name="r", program="dispatch", verb="copy", link="hbm", link_kind="local", deps=("p",),
                    pipelined_deps=("p",), flows=[flow])
    reader = PlanStep(name="c", program="dispatch", verb="copy", link="hbm", link_kind="local", deps=("r",),
                      flows=[])
    return [producer, role] + ([reader] if read else [])



def _copy(step: str, flag_id: int, chunk_starts: np.ndarray, waits=None) -> Copy:
    """A dispatch copy of rank 0's flow 0 with the chunks and waits given (the rows are not read)."""
    rows = np.zeros(int(chunk_starts[-1]), dtype=np.int64)
    return Copy("dispatch", step, 0, 0, 0, 0, 0, [], rows, "out", rows, chunk_starts=chunk_starts,
                waits=waits or [], flag_id=flag_id)


def _copies() -> list[Copy]:
    """The role's one copy: 4 chunks of one row each (1 byte of its flow's 4, 1 s on one block);
    chunk 0 waits for the producer's only chunk (published at 10 s), the others for nothing."""
    return [_copy("p", 0, np.array([0, 4])), _copy("r", 1, np.arange(5), [[(0, 1)], [], [], []])]


def test_round_robin_blocks_wait_for_the_chunks_dealt_to_them_and_publish_in_order():
    """2 blocks, round-robin: block 0 takes chunks 0 and 2, block 1 chunks 1 and 3.  Chunk 0 is
    copied at 10..11; block 1 copies chunk 1 at 0..1 but publishes it only after chunk 0 (11), then
    copies chunk 3 at 11..12; block 0 copies chunk 2 at 11..12."""
    holds, roles = schedule_roles(_steps(), _Run(late=10.0), _copies(), {("dispatch", "r"): (2, 1.0)}, "round-robin")
    rb = roles[("r", 0)]
    assert rb.published[1] == [11.0, 11.0, 12.0, 12.0]
    assert rb.end == 12.0 and holds == {(1, 0): 12.0}


def test_a_role_no_step_reads_publishes_each_chunk_once_written():
    """The same role, round-robin, where no step reads what it writes (the kernels' `ordered` false):
    block 1 copies chunk 1 at 0..1 and publishes it at once, then chunk 3 at 1..2; block 0 copies
    chunk 0 at 10..11 and chunk 2 at 11..12."""
    holds, roles = schedule_roles(_steps(read=False), _Run(late=10.0), _copies(), {("dispatch", "r"): (2, 1.0)},
                                  "round-robin")
    assert roles[("r", 0)].published[1] == [11.0, 1.0, 12.0, 2.0]
    assert roles[("r", 0)].end == 12.0 and holds == {(1, 0): 12.0}  # the flow ends with its last chunk published


def test_free_blocks_take_the_next_chunk_without_waiting_to_publish():
    """The same items dealt to the block free first: block 1 copies chunks 1, 2 and 3 (0..3) while
    block 0 waits for chunk 0's producer; each is published once chunk 0 is (11)."""
    _, roles = schedule_roles(_steps(), _Run(late=10.0), _copies(), {("dispatch", "r"): (2, 1.0)}, "free")
    assert roles[("r", 0)].published[1] == [11.0, 11.0, 11.0, 11.0]


def test_a_chunk_is_published_no_sooner_than_the_fluid_model_moved_it():
    run = _Run(late=0.0)
    run.flow_crossing = lambda f, frac: 20.0 * frac if f == 1 else 0.0  # the role's own flow: 5 s per chunk
    _, roles = schedule_roles(_steps(), run, _copies(), {("dispatch", "r"): (2, 1.0)}, "round-robin")
    assert roles[("r", 0)].published[1] == [5.0, 10.0, 15.0, 20.0]


def test_an_unknown_dealing_is_refused():
    with pytest.raises(ValueError, match="dealing: expected one of round-robin, free"):
        schedule_roles(_steps(), _Run(late=0.0), _copies(), {}, "greedy")


def test_a_held_flow_ends_at_its_hold_and_holds_back_what_waits_for_it():
    a = PlanStep(name="a", program="dispatch", verb="copy", link="x", link_kind="local", deps=(),
                 flows=[Flow(rank=0, src=0, dst=0, bytes=1e9, resources=("r",))])
    b = PlanStep(name="b", program="dispatch", verb="copy", link="x", link_kind="local", deps=("a",),
                 flows=[Flow(rank=0, src=0, dst=0, bytes=1e9, resources=("r",))])
    free = simulate_steps([a, b], {"r": 1e9})
    assert free.end_t.tolist() == pytest.approx([1.0, 2.0])
    held = _Engine([a, b], {"r": 1e9}, SimOptions(), holds={(0, 0): 1.5}).run()
    assert held.end_t.tolist() == pytest.approx([1.5, 2.5])


def _json(argv, capsys) -> dict:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_simulate_deals_the_roles_chunks_as_the_kernels_do_and_shows_free_blocks(capsys):
    """h200x4_ubb2x2 (RDMA emulated): the final permute's blocks hold the dispatch ~0.27 ms past the
    fluid model's end; dealt to free blocks, ~0.19 ms of it goes."""
    kernels = _json(["simulate", UBB, "--rdma", "emulate", "--json"], capsys)
    free = _json(["simulate", UBB, "--rdma", "emulate", "--json", "--dealing", "free"], capsys)
    assert kernels["model"]["sm"]["dealing"] == "round-robin" and free["model"]["sm"]["dealing"] == "free"
    assert "dealt round-robin to its blocks" in kernels["model"]["sm"]["text"]
    gain = kernels["programs"]["dispatch"]["total_ms"] - free["programs"]["dispatch"]["total_ms"]
    assert 0.15 < gain < 0.25, gain


def test_dealing_is_refused_with_the_direct_kernels(capsys, tmp_path):
    h200x4 = str(REPO / "schedules" / "h200x4.sched")
    code = main(["simulate", h200x4, "--dealing", "free"])
    _, err = capsys.readouterr()
    assert (code, err) == (1, f"epcc: error: --dealing free: the table-driven kernels' blocks; {h200x4} runs as "
                              f"direct kernels (use --kernels table)\n")
    code = main(["viz", UBB, "-o", str(tmp_path / "x.svg"), "--dealing", "free"])
    _, err = capsys.readouterr()
    assert (code, err) == (1, "epcc: error: --dealing applies only with --scheduled: the DAG without it is not "
                              "simulated\n")
