"""The metadata kernels' routing exchange across CUDA IPC domains (runtime/engines/cuda_table/
exchange.py): the process group's in-place all-gather of each rank-major region of a gather area.
Driven here with gloo and CPU tensors, one process per rank (the collective is the group's: NCCL
on the GPU machine runs the same calls): after every rank wrote only its own slot, every rank's
three regions hold every rank's slot, with uneven token counts, a rank with none, and the bytes
outside the regions (the flags, the padding) untouched."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from epcc.runtime.engines.cuda_table.exchange import all_gather_slots, area_regions

T, K, E = 24, 4, 32
GARBAGE = 0x5A  # what the other ranks' slots and the bytes outside the regions start as


def area_offsets(num_ranks: int) -> tuple[int, int, int, int]:
    """(bytes, tokens, top-k, weights offsets) of a gather area: epcc_table_meta_area's layout
    (templates/table_meta.cu.j2: flags [R] u64, counts [R] int padded to 16 bytes, then the top-k
    and the weights)."""
    tokens = 8 * num_ranks
    topk = tokens + (4 * num_ranks + 15) // 16 * 16
    weights = topk + 4 * num_ranks * T * K
    return weights + 4 * num_ranks * T * K, tokens, topk, weights


def routing(rank: int, num_ranks: int) -> tuple[int, np.ndarray, np.ndarray]:
    """A rank's slot as gather_copy writes it: its token count (uneven, rank 1 none) and its top-k
    experts and weights padded to T with -1 and 0."""
    n = 0 if rank == 1 else T - 5 * rank
    rng = np.random.default_rng(100 + rank)
    idx = np.full((T, K), -1, dtype=np.int32)
    w = np.zeros((T, K), dtype=np.float32)
    for t in range(n):
        idx[t] = rng.choice(E, size=K, replace=False)
        idx[t, rng.integers(K)] = -1  # a masked slot
        w[t] = rng.random(K, dtype=np.float32)
    return n, idx, w


def _worker(rank: int, num_ranks: int, store: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=num_ranks)
    try:
        size, off_tokens, off_topk, off_weights = area_offsets(num_ranks)
        area = torch.full((size,), GARBAGE, dtype=torch.uint8)
        regions = area_regions(area, num_ranks, T, K, off_tokens, off_topk, off_weights)
        n, idx, w = routing(rank, num_ranks)
        regions[0][rank] = n
        regions[1][rank] = torch.from_numpy(idx)
        regions[2][rank] = torch.from_numpy(w)
        outside = area.clone()
        all_gather_slots(regions, rank, dist.group.WORLD)
        want = [routing(r, num_ranks) for r in range(num_ranks)]
        assert regions[0].tolist() == [x[0] for x in want]
        assert np.array_equal(regions[1].numpy(), np.stack([x[1] for x in want]))
        assert np.array_equal(regions[2].numpy(), np.stack([x[2] for x in want]))
        # the same bytes through the area itself, and nothing outside the three regions written
        ends = [(off_tokens, off_tokens + 4 * num_ranks), (off_topk, off_weights), (off_weights, size)]
        mask = torch.ones(size, dtype=torch.bool)
        for a, b in ends:
            mask[a:b] = False
        assert torch.equal(area[mask], outside[mask])
        assert np.array_equal(area[off_topk:off_weights].numpy().view(np.int32).reshape(num_ranks, T, K),
                              regions[1].numpy())
        # a second exchange with other routings overwrites every slot (a fresh routing per dispatch)
        regions[0][rank] = T - rank
        regions[1][rank] = torch.from_numpy(np.roll(idx, 1, axis=0))
        all_gather_slots(regions, rank, dist.group.WORLD)
        assert regions[0].tolist() == [T - r for r in range(num_ranks)]
        assert np.array_equal(regions[1].numpy(),
                              np.stack([np.roll(routing(r, num_ranks)[1], 1, axis=0) for r in range(num_ranks)]))
        Path(results, f"ok-{rank}").write_text("ok", encoding="utf-8")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_every_rank_gets_every_slot_in_place(tmp_path, num_ranks):
    results = tmp_path / "results"
    results.mkdir()
    mp.spawn(_worker, args=(num_ranks, str(tmp_path / "store"), str(results)), nprocs=num_ranks, join=True)
    assert sorted(p.name for p in results.iterdir()) == [f"ok-{r}" for r in range(num_ranks)]


def test_the_regions_are_views_of_the_area():
    """What the collective writes is the area the metadata kernels read: the regions share its
    storage at the offsets epcc_table_meta_area gives, rank-major."""
    size, off_tokens, off_topk, off_weights = area_offsets(3)
    area = torch.zeros(size, dtype=torch.uint8)
    counts, topk, weights = area_regions(area, 3, T, K, off_tokens, off_topk, off_weights)
    assert (counts.shape, topk.shape, weights.shape) == ((3,), (3, T, K), (3, T, K))
    topk[2, 1, 3] = -7
    weights[1, 0, 0] = 0.5
    counts[2] = 9
    assert area[off_topk:off_weights].numpy().view(np.int32)[(2 * T + 1) * K + 3] == -7
    assert area[off_weights:].numpy().view(np.float32)[T * K] == 0.5
    assert area[off_tokens:off_topk].numpy().view(np.int32)[2] == 9
