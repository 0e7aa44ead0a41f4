"""The argument checks every Buffer engine makes on its torch tensors, with one wording."""

from __future__ import annotations

import numpy as np
import torch

FP8_GROUP = 128  # channels per fp32 scale of an fp8 row

WEIGHTS_DIFFER = ("combine: topk_weights differ from the weights dispatch was given (combine applies dispatch's; "
                  "dispatch again to change them)")


class _DevicePtr:
    """A device pointer as a __cuda_array_interface__ object (uint8), for torch.as_tensor."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def device_view(ptr: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A tensor of `dtype` and `shape` over `nbytes` of device memory at `ptr` (no copy)."""
    t = torch.as_tensor(_DevicePtr(ptr, nbytes), device=device) if nbytes else torch.empty(0, dtype=torch.uint8,
                                                                                             device=device)
    return t.view(dtype).view(shape)


def check_token_count(tokens: int, max_tokens: int) -> None:
    """A rank dispatches at most the bundle's tokens per rank (workload `tokens`): what its
    buffers and the schedule's capacities were planned for."""
    if tokens > max_tokens:
        raise ValueError(f"dispatch: x has {tokens} tokens, but the bundle was compiled for at most "
                         f"{max_tokens} per rank (workload `tokens`)")


def check_tensor(fn: str, arg: str, t, shape: tuple, dtypes: tuple, device: torch.device | None = None) -> None:
    """A tensor, on the engine's device (None: the cpu engine's rule), of one of `dtypes`, of
    `shape` (None: any size); on a device, contiguous."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {arg} must be a torch.Tensor, not {type(t).__name__}")
    if device is None and t.device.type != "cpu":
        raise ValueError(f"{fn}: {arg} is on {t.device}; the cpu backend needs CPU tensors")
    if device is not None and t.device != device:
        raise ValueError(f"{fn}: {arg} is on {t.device}; this Buffer runs on {device}")
    check_dtype_shape(fn, arg, t, shape, dtypes)
    if device is not None and not t.is_contiguous():
        raise ValueError(f"{fn}: {arg} must be contiguous")


def check_dtype_shape(fn: str, arg: str, t: torch.Tensor, shape: tuple, dtypes: tuple) -> None:
    """A tensor's dtype one of `dtypes` (TypeError) and its shape `shape`, None: any size (ValueError)."""
    if t.dtype not in dtypes:
        raise TypeError(f"{fn}: {arg} must be {' or '.join(str(d) for d in dtypes)}, not {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and a != s for a, s in zip(t.shape, shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{fn}: {arg} must have shape {want}, got {list(t.shape)}")


def check_topk_idx(fn: str, topk_idx, topk: int, experts: int, backend: str, tokens: int | None = None) -> np.ndarray:
    """Host top-k indices [tokens, topk] in -1..experts-1, no expert twice in a row, as int64."""
    if not isinstance(topk_idx, torch.Tensor):
        raise TypeError(f"{fn}: topk_idx must be a torch.Tensor, not {type(topk_idx).__name__}")
    if topk_idx.device.type != "cpu":
        raise ValueError(f"{fn}: topk_idx is on {topk_idx.device}, but this Buffer runs the "
                         f"'{backend}' backend on the CPU")
    if topk_idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{fn}: topk_idx must be int64 or int32, not {topk_idx.dtype}")
    if topk_idx.dim() != 2 or topk_idx.shape[1] != topk or (tokens is not None and topk_idx.shape[0] != tokens):
        want = f"[{tokens if tokens is not None else 'tokens'}, {topk}]"
        raise ValueError(f"{fn}: topk_idx must have shape {want}, got {list(topk_idx.shape)}")
    idx = topk_idx.numpy().astype(np.int64)
    if idx.size and (idx.min() < -1 or idx.max() >= experts):
        raise ValueError(f"{fn}: topk_idx values must lie in [-1, {experts - 1}] (-1: no expert)")
    for row in np.nonzero([len(set(r[r >= 0])) != int((r >= 0).sum()) for r in idx])[0][:1]:
        raise ValueError(f"{fn}: topk_idx row {int(row)} names the same expert twice: {idx[row].tolist()}")
    return idx
