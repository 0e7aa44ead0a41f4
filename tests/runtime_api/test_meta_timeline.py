"""meta_fused's timeline on the host side (runtime/engines/cuda_table/meta.py): the summary of one
launch's per-block stamps and of several launches, by their exact numbers, and DeviceMeta's switch
and read-back (CPU tensors in place of the device's)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from epcc.backends.cuda.meta_program import MetaProgram
from epcc.runtime.engines.base import EngineError
from epcc.runtime.engines.cuda_table.meta import (STAGES, STEPS, TIMELINE_WORDS, DeviceMeta, timeline_medians,
                                                  timeline_summary)

BASE = 1_700_000_000_000_000_000  # %globaltimer is ns since an epoch: the summary counts from the first entry

# three blocks' stamps in ns after BASE, STAGES' order; block 2 prepares nothing (count has 2
# blocks), block 0 alone scans, no block has items (its stamp: right after the barrier)
NS = [[0, 2000, 3000, 10000, 12000, 13000, 15000, 16000, 20000, 21000, 21000],
      [500, 2500, 4000, 11000, 11500, 13200, 13200, 16100, 19000, 21100, 21100],
      [1000, 2200, 2200, 10500, 10500, 13100, 13100, 16050, 18000, 21050, 21050]]
BUSY = {"count": (0, 2), "scan": (0, 1), "rows": (0, 3), "items": (0, 0)}


def _stamps(ns=NS) -> np.ndarray:
    return BASE + np.array(ns, dtype=np.int64)


def test_the_stages_are_the_kernels_words():
    assert TIMELINE_WORDS == 11 == len(STEPS)
    assert STAGES == ("entry", "sent", "prepared", "peers", "count", "barrier 1", "scan", "barrier 2", "rows",
                      "rows seen", "items")


def test_each_stage_over_its_blocks_with_work_and_the_steps_of_the_last_block():
    s = timeline_summary(_stamps(), BUSY)
    assert [(x["stage"], x["blocks"]) for x in s["stages"]] == list(zip(STAGES, [3, 3, 2, 3, 2, 3, 1, 3, 3, 3, 0]))
    got = [v for x in s["stages"][:10] for v in (x["min_us"], x["median_us"], x["max_us"])]
    assert got == pytest.approx([0.0, 0.5, 1.0, 2.0, 2.2, 2.5, 3.0, 3.5, 4.0, 10.0, 10.5, 11.0, 11.5, 11.75, 12.0,
                                 13.0, 13.1, 13.2, 15.0, 15.0, 15.0, 16.0, 16.05, 16.1, 18.0, 19.0, 20.0,
                                 21.0, 21.05, 21.1])
    items = s["stages"][10]
    assert (items["min_us"], items["median_us"], items["max_us"]) == (None, None, None)  # no block had items
    steps = dict(s["steps"])
    assert list(steps) == list(STEPS)
    assert [steps[k] for k in STEPS] == pytest.approx([1.0, 1.5, 1.5, 7.0, 1.0, 1.2, 1.8, 1.1, 3.9, 1.1, 0.0])
    assert s["total_us"] == pytest.approx(21.1) and sum(steps.values()) == pytest.approx(s["total_us"])
    assert s["own_us"] == pytest.approx(21.1 - 7.0)  # the total less the wait for the peers
    assert s["blocks"] == 3


def test_without_busy_every_block_counts_and_the_steps_are_the_same():
    s = timeline_summary(_stamps())
    count = s["stages"][STAGES.index("count")]
    assert (count["blocks"], count["min_us"], count["median_us"], count["max_us"]) == (3, 10.5, 11.5, 12.0)
    assert s["stages"][STAGES.index("items")]["blocks"] == 3
    assert s["steps"] == timeline_summary(_stamps(), BUSY)["steps"]


def test_busy_beyond_the_grid_is_the_grid():
    s = timeline_summary(_stamps(), {"count": (0, 300), "scan": (0, 300), "rows": (0, 300), "items": (0, 300)})
    assert [x["blocks"] for x in s["stages"]] == [3] * TIMELINE_WORDS


def test_the_collective_launch_has_no_send_and_no_wait():
    # without the exchange the kernel copies entry's stamp into sent and prepared's into peers
    ns = [[0, 0, 700, 700, 2000, 3000, 4000, 5000, 6000, 7000, 8000],
          [300, 300, 900, 900, 1800, 3100, 3900, 5100, 5900, 7100, 7900]]
    steps = dict(timeline_summary(_stamps(ns))["steps"])
    assert (steps["send"], steps["wait"]) == (0.0, 0.0)
    assert steps["start"] == pytest.approx(0.3) and steps["prepare"] == pytest.approx(0.6)


def _unstamped(stamps: np.ndarray) -> np.ndarray:
    stamps[1] = 0  # block 1 never ran with the timeline
    return stamps


def _backwards(stamps: np.ndarray) -> np.ndarray:
    stamps[1, STAGES.index("barrier 1")] = stamps[1, STAGES.index("count")] - 1
    return stamps


@pytest.mark.parametrize("make, message", [
    (lambda: _stamps()[:, :10], r"shape \(3, 10\), not \[blocks\]\[11\]"),
    (lambda: np.zeros(0, dtype=np.int64), r"shape \(0,\), not \[blocks\]\[11\]"),
    (lambda: _stamps()[:0], r"shape \(0, 11\), not \[blocks\]\[11\]"),
    (lambda: _unstamped(_stamps()), r"block 1 has no stamp \(a launch without the timeline, or of fewer blocks\)"),
    (lambda: _backwards(_stamps()), r"block 1 stamped barrier 1 before count"),
])
def test_stamps_that_are_not_one_launchs_are_refused(make, message):
    with pytest.raises(ValueError, match=f"^meta_fused timeline: {message}$"):
        timeline_summary(make())


def test_several_launches_are_their_medians():
    a = timeline_summary(_stamps(), BUSY)
    b = timeline_summary(_stamps(np.array(NS) * 2), BUSY)
    c = timeline_summary(_stamps(np.array(NS) * 4), BUSY)
    m = timeline_medians([a, c, b])
    assert m["launches"] == 3 and m["blocks"] == 3
    rows = m["stages"][STAGES.index("rows")]
    assert (rows["median_us"], rows["max_us"]) == pytest.approx((38.0, 40.0))  # b's: 2 x (19, 20)
    assert m["stages"][STAGES.index("items")]["median_us"] is None
    assert dict(m["steps"])["wait"] == pytest.approx(14.0) and m["total_us"] == pytest.approx(42.2)
    assert m["own_us"] == pytest.approx(42.2 - 14.0)  # b's: each launch's own time, then their median
    with pytest.raises(ValueError, match="^timeline_medians: no launches$"):
        timeline_medians([])


def _meta(fused_grid: int = 4, grid: int = 3):
    return SimpleNamespace(fused_grid=fused_grid, grid=grid, device="cpu", stamps=None, stamping=False, areas=[1],
                           args=SimpleNamespace(timeline=0))


def test_the_timeline_is_switched_in_the_launch_arguments_and_read_back_per_block():
    meta = _meta()
    with pytest.raises(EngineError, match=r"^read_timeline: call timeline\(True\) before the stamped dispatch$"):
        DeviceMeta.read_timeline(meta)
    DeviceMeta.timeline(meta, True)
    assert meta.stamping and meta.stamps.numel() == 4 * TIMELINE_WORDS
    assert meta.args.timeline == meta.stamps.data_ptr() != 0
    meta.stamps.copy_(torch.arange(4 * TIMELINE_WORDS))
    got = DeviceMeta.read_timeline(meta)
    assert got.shape == (3, TIMELINE_WORDS) and got[2, 0] == 2 * TIMELINE_WORDS  # the launch's 3 blocks
    kept = meta.stamps
    DeviceMeta.timeline(meta, False)
    assert not meta.stamping and meta.args.timeline == 0 and meta.stamps is kept  # a launch may still write it
    meta.grid = 0
    with pytest.raises(EngineError, match=r"^read_timeline: meta_fused's grid is 0 \(set_grid\): the steps ran as "
                                          r"launches of their own, which stamp nothing$"):
        DeviceMeta.read_timeline(meta)


def test_no_timeline_without_a_cooperative_launch():
    meta = _meta(fused_grid=0, grid=0)
    with pytest.raises(EngineError, match="^the timeline is meta_fused's: this device or target has no cooperative "
                                          "launch, the metadata's steps run as launches of their own$"):
        DeviceMeta.timeline(meta, True)
    assert meta.args.timeline == 0 and meta.stamps is None


def test_the_blocks_with_work_per_phase_are_the_kernels():
    mp = SimpleNamespace(grids=lambda: {"count": 64, "scan": 12, "rows": 192, "items": 6})
    mp.phase_blocks = lambda: MetaProgram.phase_blocks(mp)  # the rows phase: count's blocks again
    mp.busy_blocks = lambda grid: MetaProgram.busy_blocks(mp, grid)
    # the scan's blocks start after the count blocks where the grid has room beyond them (meta.cuh phase_first)
    assert DeviceMeta.busy_blocks(SimpleNamespace(mp=mp, grid=256, fused_grid=256)) == {
        "count": (0, 64), "scan": (64, 12), "rows": (0, 256), "items": (0, 6)}
    assert DeviceMeta.busy_blocks(SimpleNamespace(mp=mp, grid=64, fused_grid=256)) == {
        "count": (0, 64), "scan": (0, 12), "rows": (0, 256), "items": (0, 6)}


def test_a_phase_whose_blocks_start_past_the_first_is_summed_over_those():
    """timeline_summary takes a phase's statistics over its busy blocks, (first, n) modulo the grid."""
    G = 8
    t = np.tile(np.arange(1, TIMELINE_WORDS + 1, dtype=np.int64) * 1000, (G, 1))
    scan = STAGES.index("scan")
    t[5:, scan:] += 4000  # blocks 5..7, the scan's three (from block 5), finish it 4 us later
    s = timeline_summary(t, {"count": (0, 2), "scan": (5, 3), "rows": (0, 8), "items": (0, 1)})
    row = s["stages"][scan]
    assert row["blocks"] == 3 and row["min_us"] == row["max_us"] == (scan * 1000 + 4000) / 1e3
    assert timeline_summary(t, {"count": (0, 2), "scan": (0, 3), "rows": (0, 8), "items": (0, 1)})["stages"][scan][
        "max_us"] == scan
