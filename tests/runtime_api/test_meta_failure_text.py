"""The messages of what the table-driven metadata kernels report (DeviceMeta.failure: the error
word they write before they give up) and of a refused meta_fused grid, by their exact text."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from epcc.runtime.engines.base import EngineError
from epcc.runtime.engines.cuda_table.meta import DeviceMeta


def _failure(code: int, what: int, rank: int = 3) -> str | None:
    return DeviceMeta.failure(SimpleNamespace(error=torch.tensor([code, what], dtype=torch.int32), rank=rank))


@pytest.mark.parametrize("code, what, text", [
    (0, 0, None),
    (1, 5, "the metadata exchange timed out: rank 3 received no routing from rank 5 (it did not dispatch, or it "
           "failed)"),
    (2, 0, "the metadata kernels' grid barrier after count timed out on rank 3"),
    (2, 1, "the metadata kernels' grid barrier after scan timed out on rank 3"),
    # the half-barrier before count's adds: every block's share of the scratch cleared
    (2, 2, "the metadata kernels' grid barrier after the routing copy timed out on rank 3"),
    (2, 3, "the metadata kernels' grid barrier after phase 3 timed out on rank 3"),  # none after rows
    (3, 4, "the metadata kernels' items of table copy 4 timed out on rank 3 waiting for that copy's rows"),
    (4, 0, "the metadata kernels' rows timed out on rank 3 waiting for count's token records (a count block did "
           "not finish)"),
    (2, 7, "the metadata kernels' grid barrier after phase 7 timed out on rank 3"),
    (9, 1, None),
])
def test_what_the_kernels_wrote_before_they_gave_up_is_said(code, what, text):
    assert _failure(code, what) == text


@pytest.mark.parametrize("blocks", [-1, 133])
def test_a_meta_fused_grid_beyond_what_the_device_holds_is_refused(blocks):
    meta = SimpleNamespace(fused_grid=132, sync=torch.zeros(1), areas=[], args=SimpleNamespace(grid_fused=0), grid=0)
    with pytest.raises(EngineError) as e:
        DeviceMeta.set_grid(meta, blocks)
    assert str(e.value) == f"meta_fused's grid must be 0 to 132 blocks, not {blocks}"
    assert meta.grid == 0
