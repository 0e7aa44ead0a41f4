"""Exact texts of the cuda backend's argument errors (runtime/engines/cuda_direct/engine.py), on a CPU machine.

The checks run before anything touches the GPU, so an engine without a library or region (made
with __new__, its device the CPU) reaches every one of them; a test that got past the checks
would fail on the missing library instead of passing.  A refused argument is a GroupError (the
engine's agreement is over a one-rank store here) that is also the TypeError or ValueError of the
check: "dispatch #1 failed on rank 0: <the check's text>", the Buffer usable again."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from epcc.runtime.engines.agree import Agreement
from epcc.runtime.engines.base import GroupError
from epcc.runtime.engines.cuda_direct.engine import CudaDirectEngine, CudaHandle

H, K, T, E = 256, 4, 8, 16


def engine(dtype: str = "bf16") -> CudaDirectEngine:
    eng = CudaDirectEngine.__new__(CudaDirectEngine)
    eng.c = {"hidden": H, "topk": K, "dtype": dtype, "max_tokens": T, "align_max": 128, "experts": E}
    eng.device = torch.device("cpu")
    eng.dispatches = 0
    eng.agree = Agreement(dist.HashStore(), 0, 1, 1.0)
    return eng


def refused(exc, text: str):
    """pytest.raises for a refused argument: `exc` and a GroupError, the check's exact text."""
    return pytest.raises(exc, match=r"^(dispatch|combine) #\d+ failed on rank 0: " + re.escape(text) + "$")


def x_bf16(t: int = T, h: int = H) -> torch.Tensor:
    return torch.zeros((t, h), dtype=torch.bfloat16)


def idx(t: int = T, k: int = K, dtype=torch.int64) -> torch.Tensor:
    return torch.zeros((t, k), dtype=dtype)


def w(t: int = T, k: int = K, dtype=torch.float32) -> torch.Tensor:
    return torch.ones((t, k), dtype=dtype)


@pytest.mark.parametrize("call, exc, text", [
    (lambda e: e.dispatch(x_bf16(), idx().double(), w()), TypeError,
     "dispatch: topk_idx must be torch.int64 or torch.int32, not torch.float64"),
    (lambda e: e.dispatch(x_bf16(), idx(k=2), w()), ValueError,
     "dispatch: topk_idx must have shape [8, 4], got [8, 2]"),
    (lambda e: e.dispatch(x_bf16(), idx(), w(dtype=torch.float64)), TypeError,
     "dispatch: topk_weights must be torch.float32, not torch.float64"),
    (lambda e: e.dispatch(x_bf16(h=128), idx(), w()), ValueError,
     "dispatch: x must have shape [*, 256], got [8, 128]"),
    (lambda e: e.dispatch(x_bf16().float(), idx(), w()), TypeError,
     "dispatch: x must be torch.bfloat16, not torch.float32"),
    (lambda e: e.dispatch(x_bf16(h=2 * H)[:, ::2], idx(), w()), ValueError, "dispatch: x must be contiguous"),
    (lambda e: e.dispatch([1, 2], idx(), w()), TypeError, "dispatch: x must be a torch.Tensor, not list"),
    (lambda e: e.dispatch((x_bf16(), x_bf16()), idx(), w()), TypeError,
     "dispatch: this bundle dispatches bf16: pass x as one [tokens, hidden] bfloat16 tensor"),
    (lambda e: e.dispatch(x_bf16(t=T + 1), idx(t=T + 1), w(t=T + 1)), ValueError,
     "dispatch: x has 9 tokens, but the bundle was compiled for at most 8 per rank (workload `tokens`)"),
    (lambda e: e.dispatch(x_bf16(), idx(), w(), expert_alignment=0), ValueError,
     "dispatch: expert_alignment must be an integer in [1, 128], got 0"),
    (lambda e: e.dispatch(x_bf16(), idx(), w(), expert_alignment=129), ValueError,
     "dispatch: expert_alignment must be an integer in [1, 128], got 129"),
    (lambda e: e.dispatch(x_bf16(), idx(), w(), expert_alignment=True), ValueError,
     "dispatch: expert_alignment must be an integer in [1, 128], got True"),
    (lambda e: e.dispatch(x_bf16()), TypeError,
     "dispatch: topk_idx is required (or a handle from an earlier dispatch)"),
    (lambda e: e.dispatch(x_bf16(), handle="h"), TypeError,
     "dispatch: handle must be a handle an earlier dispatch of this Buffer returned"),
    (lambda e: e.dispatch(x_bf16(), idx(), handle=CudaHandle(0, T, 0, idx(), None)), ValueError,
     "dispatch: give topk_idx or handle, not both"),
    (lambda e: e.combine(x_bf16(), "h"), TypeError,
     "combine: handle must be the handle dispatch returned, not str"),
    (lambda e: e.combine(x_bf16(), CudaHandle(3, T, T)), ValueError,
     "combine: handle is from dispatch #3, but this Buffer has run dispatch #0 since; "
     "its routing and receive buffer are gone"),
    (lambda e: e.combine(x_bf16(t=5), CudaHandle(0, T, T)), ValueError,
     "combine: x must have shape [8, 256], got [5, 256]"),
    (lambda e: e.combine(x_bf16(), CudaHandle(0, T, T), out=x_bf16(t=3)), ValueError,
     "combine: out must have shape [8, 256], got [3, 256]"),
])
def test_bf16_argument_errors(call, exc, text):
    eng = engine()
    with refused(exc, text) as e:
        call(eng)
    assert isinstance(e.value, GroupError) and e.value.reason == text and e.value.ranks == (0,)
    assert not e.value.rebuild and eng.agree.state == "ready"  # refused before the launch: usable again


def test_fp8_argument_errors():
    e = engine("fp8")
    x8 = torch.zeros((T, H), dtype=torch.float8_e4m3fn)
    sc = torch.ones((T, H // 128), dtype=torch.float32)
    with refused(TypeError, "dispatch: this bundle dispatches fp8: pass x as (x_fp8, scales)"):
        e.dispatch(x_bf16(), idx(), w())
    with refused(ValueError, "dispatch: scales must have shape [8, 2], got [8, 1]"):
        e.dispatch((x8, sc[:, :1].contiguous()), idx(), w())
    with refused(TypeError, "dispatch: x_fp8 must be torch.float8_e4m3fn, not torch.uint8"):
        e.dispatch((x8.view(torch.uint8), sc), idx(), w())


def test_a_tensor_on_another_device_is_named():
    e = engine()
    e.device = torch.device("cuda", 0)  # the engine's device; the tensors stay on the CPU
    with refused(ValueError, "dispatch: x is on cpu; this Buffer runs on cuda:0"):
        e.dispatch(x_bf16(), idx(), w())


def test_read_timeline_before_enable_timeline_is_refused():
    with pytest.raises(RuntimeError, match=r"^read_timeline: call enable_timeline\(\) before the stamped dispatch "
                                           r"and combine$"):
        CudaDirectEngine.read_timeline(SimpleNamespace(_timeline=None))


@pytest.mark.parametrize("argv, text", [
    (["--warps", "17"], "epcc tune: --warps 17: at most 16 warps per block"),
    (["--warps", "8,x"], "epcc tune: --warps 8,x: expected comma-separated whole numbers, e.g. 8,16,24"),
    (["--sms", "1,8"], "epcc tune: --sms 1,8: every value must be at least 2"),
    (["--iters", "0"], "epcc tune: --iters 0: at least 1 timed call (the median of none is no time)"),
])
def test_tune_option_errors_are_named_before_any_gpu_work(argv, text):
    from epcc.runtime import tune  # importing tune sets NCCL's environment: only these tests load it

    with pytest.raises(SystemExit) as e:
        tune.main(["some/bundle", *argv])
    assert str(e.value) == text


def test_tune_splits_cover_every_sm_with_at_least_one_sender():
    from epcc.runtime import tune  # importing tune sets NCCL's environment: only these tests load it

    assert tune.SPLITS[0] == (1, 0)  # the default shape first: every block sends, none only replicates
    for sms in range(2, 133):
        got = [tune.split(sms, r) for r in tune.SPLITS]
        assert got[0] == (sms, 0)
        for s, r in got[1:]:
            assert s + r == sms and s >= 1 and r >= 1, (sms, s, r)
    assert [tune.split(24, r) for r in tune.SPLITS] == [(24, 0), (18, 6), (16, 8), (14, 10), (12, 12)]
