"""`Buffer(group, bundle, backend="supa")` where no SUPA device is: what it says, and that the shim
runs only when EPCC_SUPA_SHIM=1 asks for it (runtime/buffer.py supa_shim).  One-rank gloo group in
this process; the GPU run of the shimmed kernels is tests/gpu/test_gpu.py's.

* no EPCC_SUPA_SHIM, no torch_supa: "no SUPA device is present", an EngineError, before nvcc;
* torch_supa importable (a stand-in package on sys.path): running on it is not implemented, said so;
* EPCC_SUPA_SHIM=1 without a CUDA device: "no CUDA device is available";
* EPCC_SUPA_SHIM=yes: refused, naming the variable;
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from epcc.cli import main as epcc_main  # noqa: E402
from epcc.runtime.buffer import Buffer, EngineError, GroupError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NO_GPU = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def supa_bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("supa") / "b"
    assert epcc_main(["compile", str(ROOT / "schedules" / "h200x4_2vnode.sched"), "--target", "supa", "-o",
                      str(out)]) == 0
    return out


@pytest.fixture()
def one_rank_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_no_supa_device_is_said_before_anything_else(supa_bundle, one_rank_group, monkeypatch, tmp_path):
    monkeypatch.delenv("EPCC_SUPA_SHIM", raising=False)
    monkeypatch.setenv("EPCC_CACHE", str(tmp_path / "cache"))  # nvcc must not start
    with pytest.raises(GroupError, match=r"^making the Buffer failed on rank 0: Buffer\(backend='supa'\): no SUPA "
                                         r"device is present \(torch_supa is not importable\); .* \$EPCC_SUPA_SHIM=1") as e:
        Buffer(one_rank_group, supa_bundle, backend="supa")
    assert type(e.value.__cause__) is EngineError
    assert not (tmp_path / "cache").exists()
    monkeypatch.setenv("EPCC_SUPA_SHIM", "0")
    with pytest.raises(GroupError, match="no SUPA device is present"):
        Buffer(one_rank_group, supa_bundle, backend="supa")


def test_a_supa_stack_without_the_shim_is_not_run_silently(supa_bundle, one_rank_group, monkeypatch, tmp_path):
    fake = tmp_path / "site"
    (fake / "torch_supa").mkdir(parents=True)
    (fake / "torch_supa" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(fake))
    monkeypatch.delenv("EPCC_SUPA_SHIM", raising=False)
    with pytest.raises(GroupError, match=r"torch_supa is importable, but this runtime runs SUPA bundles only through "
                                         r"the SUPA-on-CUDA shim"):
        Buffer(one_rank_group, supa_bundle, backend="supa")


def test_the_shim_variable_is_one_or_nothing(supa_bundle, one_rank_group, monkeypatch):
    monkeypatch.setenv("EPCC_SUPA_SHIM", "yes")
    with pytest.raises(GroupError, match=r"\$EPCC_SUPA_SHIM is 'yes'; set it to 1") as e:
        Buffer(one_rank_group, supa_bundle, backend="supa")
    assert type(e.value.__cause__) is ValueError


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU: the shim would run")
def test_the_shim_without_a_cuda_device_says_so(supa_bundle, one_rank_group, monkeypatch, tmp_path):
    monkeypatch.setenv("EPCC_SUPA_SHIM", "1")
    monkeypatch.setenv("EPCC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(GroupError, match=r"EPCC_SUPA_SHIM=1 runs the SUPA kernels on NVIDIA GPUs through the "
                                         r"SUPA-on-CUDA shim, and no CUDA device is available"):
        Buffer(one_rank_group, supa_bundle, backend="supa")
    assert not (tmp_path / "cache").exists()
