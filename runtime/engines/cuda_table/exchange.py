"""The metadata kernels' routing exchange by the process group's collective (the manifest's
metadata "exchange": "collective"): what carries every rank's routing where the ranks span several
CUDA IPC domains, so no rank can map another's gather area.

A gather area (epcc_table_meta.cu) holds three rank-major regions, each rank's slot contiguous:
token counts [R] int32, top-k experts [R][T][K] int32 and weights [R][T][K] fp32.  Once this rank
wrote its own slot of each (gather_copy, collective mode), one in-place
`all_gather_into_tensor` per region (the output the region, the input this rank's slot of it)
fills every other rank's slot.  The collective runs on the current stream of the calling
context (NCCL: stream-ordered, no host sync, CUDA-graph capturable; NVLink inside a box, the NIC
between boxes; BCCL on Biren), with whatever backend the group has: gloo on the CPU in the tests.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def area_regions(area: torch.Tensor, num_ranks: int, tokens: int, topk: int, off_tokens: int, off_topk: int,
                 off_weights: int) -> list[torch.Tensor]:
    """The three regions of a gather area (a uint8 tensor; offsets from epcc_table_meta_area) as
    rank-major views: counts [R] int32, experts [R, T, K] int32, weights [R, T, K] fp32."""
    n = num_ranks * tokens * topk
    return [area[off_tokens:off_tokens + 4 * num_ranks].view(torch.int32),
            area[off_topk:off_topk + 4 * n].view(torch.int32).view(num_ranks, tokens, topk),
            area[off_weights:off_weights + 4 * n].view(torch.float32).view(num_ranks, tokens, topk)]


def all_gather_slots(regions: list[torch.Tensor], rank: int, group) -> None:
    """Every rank's slot of each rank-major region, in place: slot `rank` is this rank's input."""
    for region in regions:
        dist.all_gather_into_tensor(region, region[rank:rank + 1], group=group)


__all__ = ["all_gather_slots", "area_regions"]
