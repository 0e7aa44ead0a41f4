"""bench/meta_time.py's parts that run without a GPU: the table --timeline prints per rank, and
its argument."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from epcc.runtime.engines.cuda_table.meta import timeline_medians, timeline_summary

ROOT = Path(__file__).resolve().parents[2]

# two blocks' stamps, ns after the first entry (meta.py STAGES' order); block 1 has no count work
NS = [[0, 2000, 3000, 10000, 12000, 13000, 15000, 16000, 20000, 21000, 23500],
      [400, 2500, 2500, 11000, 11000, 13200, 13200, 16100, 19000, 21100, 21100]]


@pytest.fixture(scope="module")
def meta_time(bench_script):
    return bench_script("meta_time")


def test_the_timeline_table_of_a_rank(meta_time):
    stamps = 10**18 + np.array(NS, dtype=np.int64)
    busy = {"count": (0, 1), "scan": (0, 2), "rows": (0, 2), "items": (0, 1)}
    summary = timeline_medians([timeline_summary(stamps, busy), timeline_summary(stamps, {**busy, "items": (0, 0)})])
    assert meta_time.timeline_lines(summary, 1) == [
        "rank 1: meta_fused timeline, 2 blocks, medians over 2 dispatches (us after the first block's entry)",
        "  stage      blocks   median      max   step             us",
        "  entry           2      0.2      0.4   start           0.4",
        "  sent            2      2.2      2.5   send            2.1",
        "  prepared        1      3.0      3.0   prepare         0.5",
        "  peers           2     10.5     11.0   wait            8.0",
        "  count           1     12.0     12.0   count           1.0",
        "  barrier 1       2     13.1     13.2   barrier 1       1.2",
        "  scan            2     14.1     15.0   scan            1.8",
        "  barrier 2       2     16.1     16.1   barrier 2       1.1",
        "  rows            2     19.5     20.0   rows            3.9",
        "  rows seen       2     21.1     21.1   rows wait       1.1",
        "  items           1     23.5     23.5   items           2.4",  # the launch with items: the other has none
        "  total                                                23.5",
        "  own                                                  15.5   (the total less the wait for the blocks' arrivals and "
        "the peers' routing)",
    ]


def test_the_timelines_dispatches_are_a_positive_number(meta_time, capsys):
    with pytest.raises(SystemExit) as e:
        meta_time.main(["bundle", "--timeline", "0"])
    assert e.value.code == 2
    assert "argument --timeline: a number of dispatches, at least 1, not 0" in capsys.readouterr().err


def test_raw_stamps_need_the_timeline(meta_time, capsys):
    with pytest.raises(SystemExit) as e:
        meta_time.main(["bundle", "--raw", "stamps"])
    assert e.value.code == 2
    assert "error: --raw: the stamps are --timeline's\n" in capsys.readouterr().err


def test_without_a_gpu_it_says_so(meta_time, capsys, monkeypatch):
    import torch  # meta_time's own import: there, without it the fixture skips

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert meta_time.main(["bundle"]) == 1
    assert capsys.readouterr().err == "meta_time: no CUDA device visible (run it under torchrun on the GPU machine)\n"
