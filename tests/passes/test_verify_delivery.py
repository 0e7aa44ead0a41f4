"""verify-delivery: every (token, destination) pair exactly once, for every destination set.

The shipped schedules must verify; small broken schedules (written here into tmp_path) must fail
with located errors whose text is pinned exactly.  The exactly-once engine is also tested on its
own: realizability of destination sets (topk, experts per rank) decides what counts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from epcc import pipeline
from epcc.analysis.exactly_once import ExactlyOnce
from epcc.diagnostics import CompileError
from epcc.ir import query
from epcc.passes.verify_delivery import ranks_text

REPO = Path(__file__).resolve().parents[2]
SCHEDULES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "schedules").glob("*.sched"))


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch):
    monkeypatch.chdir(REPO)


def compile_to(path, until: str = "verify-delivery"):
    """The pipeline up to `until` (each pass's IR verified); returns (compilation, pass context)."""
    c = pipeline.run(str(path), until)
    return c, c.passes


def errors_of(path, until: str = "verify-delivery"):
    with pytest.raises(CompileError) as e:
        compile_to(path, until)
    return [d for d in e.value.diagnostics if d.severity == "error"]


def flat(d):
    """(line, col, message, [(note line or None, note message)])."""
    return (d.span.line, d.span.col, d.message, [(n.span.line if n.span else None, n.message) for n in d.notes])


def write(tmp_path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


# ---------------------------------------------------------------------------- shipped schedules

EXPECTED_RANKS = {"dgx_h800_2node": 16, "h200x2_2vnode": 2, "h200x2_2vnode_relay": 2, "h200x2_2vnode_mixed": 2, "h200x4": 4, "h200x4_2vnode": 4, "h200x4_ubb2x2": 4, "nvl8_hybrid": 8,
                  "ocs_ep16": 16, "ubbv2_card": 2, "ubbv2_ep16": 16, "ubbv2_ep32": 32, "ubbv2_ep32_port10": 32}


def test_every_shipped_schedule_is_listed():
    assert sorted(Path(s).stem for s in SCHEDULES) == sorted(EXPECTED_RANKS)


@pytest.mark.parametrize("rel", SCHEDULES)
def test_shipped_schedule_verifies(rel):
    c, ctx = compile_to(rel)
    n = EXPECTED_RANKS[Path(rel).stem]
    v = ctx.results["verification"]
    assert v["dispatch_ok"] and v["pairs"] == n * n and v["skipped"] == 0
    # Every pair of a shipped plan has a single unconditional route: one pattern per pair.
    assert v["patterns"] == n * n
    disp = query.program_module(c.module.operation, "dispatch")
    assert disp.attributes["epcc.verified"].value == (
        f"exactly-once: {n} homes x {n} destinations, {n * n} destination patterns checked")
    assert not ctx.diags.has_errors


# ---------------------------------------------------------------------------- broken dispatch

UBB_HEAD = """\
schedule ubb "UBBv2-like EP16"

topology ubbv2 {
  levels node 1, card 8, die 2
  rank die
  group vnode = 4 card
  relation peer = same vnode, other card
  relation mate = card -> card ^ 5
  relation twin = other die
  link blink p2p { connects peer or mate  bandwidth 20 GB/s  latency 2 us }
  link d2d d2d { connects twin  bandwidth 256 GB/s  latency 1 us }
  link hbm local { bandwidth 200 GB/s }
}

workload { tokens 4096 per rank  hidden 7168  dtype bf16  topk 8  experts 256 blocked }
"""

UBB_OK = UBB_HEAD + """
dispatch {
  buffer sendbuf
  buffer from_mate
  buffer from_peer
  buffer relay
  buffer from_twin
  step reorder: copy tokens from input into sendbuf
  step fwd1: send tokens for mate.vnode from sendbuf to mate.from_mate over blink
  step fwd2: send tokens for peer.card from sendbuf to peer.from_peer over blink
  step fwd3: send tokens for peer.card from from_mate to peer.relay over blink
  step d2d_near: send tokens for twin from sendbuf, from_peer to twin.from_twin
  step d2d_far: send tokens for twin from from_mate, relay to twin.from_twin
  step final: permute sendbuf, from_peer, from_mate, relay, from_twin into output
}

combine reverse of dispatch
"""

# fwd3 (the relay of mate traffic to the mate's peers) removed.
UBB_DROPPED_FORWARD = UBB_HEAD + """
dispatch {
  buffer sendbuf
  buffer from_mate
  buffer from_peer
  buffer from_twin
  step reorder: copy tokens from input into sendbuf
  step fwd1: send tokens for mate.vnode from sendbuf to mate.from_mate over blink
  step fwd2: send tokens for peer.card from sendbuf to peer.from_peer over blink
  step d2d_near: send tokens for twin from sendbuf, from_peer to twin.from_twin
  step d2d_far: send tokens for twin from from_mate to twin.from_twin
  step final: permute sendbuf, from_peer, from_mate, from_twin into output
}

combine reverse of dispatch
"""

# The final permute forgets from_twin.
UBB_PERMUTE_MISSING_SOURCE = UBB_OK.replace("permute sendbuf, from_peer, from_mate, relay, from_twin",
                                            "permute sendbuf, from_peer, from_mate, relay")

RELAY_DUP = """\
schedule relay "4 GPUs: a direct push plus a relay that delivers again"

topology quad {
  levels node 1, gpu 4
  rank gpu
  relation peer = other gpu
  relation nxt = gpu -> (gpu + 1) % 4
  link nvlink p2p { connects peer  bandwidth 450 GB/s  latency 3 us }
  link hbm local { bandwidth 3000 GB/s }
}

workload { tokens 4096 per rank  hidden 7168  dtype bf16  topk 8  experts 256 blocked }

dispatch {
  buffer stage
  step push: send tokens for peer from input to peer.output over nvlink
  step keep: permute input into output
  step relay: send tokens for nxt from input to nxt.stage over nvlink
  step fwd: send tokens for nxt from stage to nxt.output over nvlink
}

combine reverse of dispatch
"""

UNFILLED = """\
schedule unfilled "2 nodes x 2 GPUs: the cable only on GPU 0"

topology t {
  levels node 2, gpu 2
  rank gpu
  relation nvl = other gpu
  relation p10 = other node, same gpu, gpu -> 0
  link nv p2p { connects nvl  bandwidth 450 GB/s  latency 3 us }
  link cable p2p { connects p10  bandwidth 29 GB/s  latency 2 us }
  link hbm local { bandwidth 3000 GB/s }
}

workload { tokens 4096 per rank  hidden 7168  dtype bf16  topk 8  experts 256 blocked }

dispatch {
  buffer from_far
  step x: send tokens for p10.node from input to p10.from_far over cable
  step intra: send tokens for nvl from input to nvl.output over nv
  step keep: permute input into output
  step fwd: send tokens for nvl from from_far to nvl.output over nv
  step keep_far: permute from_far into output
}

combine reverse of dispatch
"""


def test_ubb_like_reference_verifies(tmp_path):
    _, ctx = compile_to(write(tmp_path, "ubb.sched", UBB_OK))
    assert ctx.results["verification"]["dispatch_ok"]


def test_dropped_forward(tmp_path):
    (e,) = errors_of(write(tmp_path, "ubb.sched", UBB_DROPPED_FORWARD))
    assert flat(e) == (
        23, 3, "a token of rank 0 (node 0, card 0, die 0) routed to ranks {8} never reaches rank 8",
        [(None, "no route of the dispatch program ends in 'output' of rank 8 for tokens of rank 0"),
         (23, "it gets as far as 'from_mate' on rank 10 (node 0, card 5, die 0) (rank 0 -reorder-> 0 -fwd1-> 10); "
              "the steps that read 'from_mate' later (d2d_far, final) do not move it toward rank 8"),
         (None, "95 more (token home, destination) pairs fail the same way")])


def test_duplicated_path(tmp_path):
    (e,) = errors_of(write(tmp_path, "relay.sched", RELAY_DUP))
    # Only tokens routed to BOTH the relay rank and the destination are duplicated: the engine
    # has to find a destination set of two ranks.
    assert flat(e) == (
        19, 3, "a token of rank 0 (node 0, gpu 0) routed to ranks {1, 2} is delivered to rank 2 twice: "
               "rank 0 -push-> 2 and rank 0 -relay-> 1 -fwd-> 2",
        [(16, "step 'push' delivers another copy"),
         (None, "3 more (token home, destination) pairs fail the same way")])


def test_permute_missing_a_source_buffer(tmp_path):
    errs = errors_of(write(tmp_path, "ubb.sched", UBB_PERMUTE_MISSING_SOURCE))
    assert [flat(e) for e in errs] == [
        (27, 3, "a token of rank 0 (node 0, card 0, die 0) routed to ranks {1} never reaches rank 1",
         [(None, "no route of the dispatch program ends in 'output' of rank 1 for tokens of rank 0"),
          (27, "it gets as far as 'from_twin' on rank 1 (node 0, card 0, die 1) "
               "(rank 0 -reorder-> 0 -d2d_near-> 1); no later step reads 'from_twin'"),
          (None, "63 more (token home, destination) pairs fail the same way")]),
        (28, 3, "a token of rank 0 (node 0, card 0, die 0) routed to ranks {9} never reaches rank 9",
         [(None, "no route of the dispatch program ends in 'output' of rank 9 for tokens of rank 0"),
          (28, "it gets as far as 'from_twin' on rank 9 (node 0, card 4, die 1) "
               "(rank 0 -reorder-> 0 -fwd1-> 10 -fwd3-> 8 -d2d_far-> 9); no later step reads 'from_twin'"),
          (None, "63 more (token home, destination) pairs fail the same way")]),
    ]


def test_staging_buffer_read_on_a_rank_nobody_fills(tmp_path):
    errs = errors_of(write(tmp_path, "unfilled.sched", UNFILLED))
    note = (17, "step 'x' fills 'from_far' only on ranks {0, 2}")
    assert [flat(e) for e in errs] == [
        (20, 38, "step 'fwd' on rank 1 (node 0, gpu 1) reads 'from_far', which no earlier step fills on that rank",
         [note]),
        (21, 26, "step 'keep_far' on rank 1 (node 0, gpu 1) reads 'from_far', which no earlier step fills on "
                 "that rank", [note]),
    ]


def test_errors_name_the_file(tmp_path):
    (e,) = errors_of(write(tmp_path, "relay.sched", RELAY_DUP))
    assert e.span.path == str(tmp_path / "relay.sched")


# ---------------------------------------------------------------------------- written-out combine

QUAD = """\
schedule quadc "4 GPUs, combine written out"

topology quad {
  levels node 1, gpu 4
  rank gpu
  relation peer = other gpu
  link nvlink p2p { connects peer  bandwidth 450 GB/s  latency 3 us }
  link hbm local { bandwidth 3000 GB/s }
}

workload { tokens 4096 per rank  hidden 7168  dtype bf16  topk 8  experts 256 blocked }

dispatch {
  step push: send tokens for peer from input to peer.output over nvlink
  step keep: permute input into output
}
"""

COMBINE_OK = QUAD + """
combine {
  buffer partial
  step red "weighted sum of my experts' outputs per token": reduce output into partial
  step back "partial sums home": send tokens of peer from partial to peer.result over nvlink
  step own: copy tokens of me from partial into result
}
"""

# The home pulls its peers' rows AND the peers send their reduced partials: double count.
COMBINE_DOUBLE = QUAD + """
combine {
  buffer partial
  step fetch "pull the peers' rows of my tokens": pull tokens of me from peer.output into partial over nvlink
  step red: reduce output into partial
  step back: send tokens of peer from partial to peer.result over nvlink
  step own: reduce partial into result
}
"""

# Nothing brings a rank's own contribution home.
COMBINE_DROP = QUAD + """
combine {
  buffer partial
  step red: reduce output into partial
  step back: send tokens of peer from partial to peer.result over nvlink
}
"""

COMBINE_UNWEIGHTED = QUAD + """
combine {
  step back: send tokens of peer from output to peer.result over nvlink
  step own: reduce output into result
}
"""


def test_written_combine_verifies(tmp_path):
    c, ctx = compile_to(write(tmp_path, "c.sched", COMBINE_OK))
    v = ctx.results["verification"]
    assert v["dispatch_ok"] and v["combine"] == "written" and v["combine_ok"]
    comb = query.program_module(c.module.operation, "combine")
    assert comb.attributes["epcc.verified"].value == (
        "exactly-once: 4 homes x 4 contributing ranks, every contribution weighted once")


def test_written_combine_double_count(tmp_path):
    (e,) = errors_of(write(tmp_path, "c.sched", COMBINE_DOUBLE))
    assert flat(e) == (
        23, 3, "a token of rank 0 (node 0, gpu 0) would count rank 1's expert outputs twice in 'result' of rank 0: "
               "rank 1 -red-> 1 -back-> 0 and rank 1 -fetch-> 0 -own-> 0",
        [(None, "11 more (token home, contributing rank) pairs fail the same way")])


def test_written_combine_drops_a_contributor(tmp_path):
    (e,) = errors_of(write(tmp_path, "c.sched", COMBINE_DROP))
    assert flat(e) == (
        20, 3, "a token of rank 0 (node 0, gpu 0) never receives rank 0's expert outputs in 'result'",
        [(20, "they get as far as 'partial' on rank 0 (node 0, gpu 0) (rank 0 -red-> 0); the step that reads "
              "'partial' later (back) does not move them toward 'result' of rank 0"),
         (None, "3 more (token home, contributing rank) pairs fail the same way")])


def test_written_combine_without_weights(tmp_path):
    (e,) = errors_of(write(tmp_path, "c.sched", COMBINE_UNWEIGHTED))
    assert flat(e) == (
        19, 3, "rank 1's expert outputs for a token of rank 0 (node 0, gpu 0) reach 'result' without a weighted "
               "reduce: rank 1 -back-> 0",
        [(None, "reduce them ('reduce BUF into BUF') on the way: only a reduce applies the routing weights"),
         (None, "11 more (token home, contributing rank) pairs fail the same way")])


# ---------------------------------------------------------------------------- the engine


def fs(*rs):
    return frozenset(rs)


def test_engine_single_unconditional_route():
    eng = ExactlyOnce(16, 8, 16)
    assert eng.check(3, [(fs(3),)]) is None
    assert eng.check(3, [(fs(3), fs(2, 3))]) is None  # sets containing d always hold


def test_engine_no_route_is_a_drop_for_the_smallest_set():
    f = ExactlyOnce(16, 8, 16).check(5, [])
    assert f.dest_set == (5,) and f.fired == ()


def test_engine_two_unconditional_routes():
    f = ExactlyOnce(16, 8, 16).check(5, [(fs(5),), (fs(5),)])
    assert f.dest_set == (5,) and f.fired == (0, 1)


def test_engine_conditional_routes():
    # Route 0 needs D to hit {1}, route 1 needs {2}: D = {0} gets none (reported first: fewest
    # hits), {0, 1} one, {0, 1, 2} two.
    eng = ExactlyOnce(16, 8, 16)
    f = eng.check(0, [(fs(0), fs(1)), (fs(0), fs(2))])
    assert f.dest_set == (0,) and f.fired == () and f.missed == ((0, fs(1)), (1, fs(2)))
    # Conditions can only require hits, never misses: a conditional route next to an
    # unconditional one doubles for the D that satisfies it, and two conditional routes miss
    # D = {0} and double for D hitting both.
    f = eng.check(0, [(fs(0), fs(1)), (fs(0),)])
    assert f.dest_set == (0, 1) and f.fired == (0, 1)
    f = eng.check(0, [(fs(0), fs(1, 2)), (fs(0), fs(3))])
    assert f.dest_set == (0,) and f.fired == ()


def test_engine_topk_bounds_the_destination_set():
    # An extra route needing D to hit {1}, {2} and {3} besides d = 0 needs 4 ranks.
    routes = [(fs(0),), (fs(0), fs(1), fs(2), fs(3))]
    assert ExactlyOnce(16, 3, 16).check(0, routes) is None  # top-3: at most 3 ranks
    f = ExactlyOnce(16, 4, 16).check(0, routes)
    assert f.dest_set == (0, 1, 2, 3) and f.fired == (0, 1)


def test_engine_experts_per_rank_bound_the_destination_set_from_below():
    # 4 ranks with one expert each and top-4: every token hits all 4 ranks, so a route that
    # needs D to hit {1} always fires.  With 4 experts per rank, D = {0} exists and drops it.
    assert ExactlyOnce(4, 4, 1).check(0, [(fs(0), fs(1))]) is None
    f = ExactlyOnce(4, 4, 4).check(0, [(fs(0), fs(1))])
    assert f.dest_set == (0,) and f.fired == ()
    # Padding: with 2 experts per rank and top-4, D has at least 2 ranks; a double delivery is
    # shown with the smallest such D.
    f = ExactlyOnce(4, 4, 2).check(2, [(fs(2),), (fs(2),)])
    assert f.dest_set == (0, 2)


def test_engine_small_machines_force_hits():
    # Route 1 needs D to hit {1, 2, 3}.  With 2 experts per rank and top-4, D has 2 ranks at
    # least, so a D containing 0 always hits {1, 2, 3}: no pattern avoids it.
    f = ExactlyOnce(4, 4, 2).check(0, [(fs(0),), (fs(0), fs(1, 2, 3))])
    assert f.fired == (0, 1) and f.dest_set == (0, 1)
    assert ExactlyOnce(4, 4, 2).check(0, [(fs(0), fs(1, 2, 3))]) is None
    # With 4 experts per rank, D = {0} avoids it.
    assert ExactlyOnce(4, 4, 4).check(0, [(fs(0), fs(1, 2, 3))]).dest_set == (0,)


def test_engine_counts_patterns_and_caches():
    eng = ExactlyOnce(16, 8, 16)
    routes = [(fs(0), fs(1)), (fs(0), fs(8, 9))]
    eng.check(0, routes)
    first = eng.patterns
    eng.check(0, routes)
    assert eng.patterns == 2 * first and len(eng._cache) == 1


def test_ranks_text():
    assert ranks_text([0, 1, 2, 3, 8, 10, 11]) == "{0-3, 8, 10, 11}"
