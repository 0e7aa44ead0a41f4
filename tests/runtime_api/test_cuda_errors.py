"""What a machine without a GPU says about the CUDA runtime, and argument errors of the cpu
backend that only the cuda backend accepts.  Every error is one clear exception or one line on
stderr with exit status 1, never a traceback from deep inside (ctypes, nvcc, torch.cuda).

* `Buffer(group, bundle, backend="cuda")` on a one-rank gloo group (FileStore in a tmp dir, in
  this process): "no CUDA device", before the group size or nvcc is looked at;
* `Buffer(..., backend="cpu", config=...)`: ValueError;
* cpu backend `dispatch(..., sync=False | expert_alignment=4 | handle=...)`: ValueError naming
  the argument (two ranks, spawned, as in test_buffer.py);

(Errors of the Buffer's calls are GroupErrors, which every rank of the group raises: "making the
Buffer failed on rank 0: <reason>"; `reason` is the check's own text.)
* `epcc tune` on a missing bundle, a bundle that is not one-hop, a machine without GPUs.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from epcc.cli import main as epcc_main  # noqa: E402
from epcc.runtime.buffer import Buffer, GroupError, GroupValueError
from epcc.runtime.engines.cuda_direct.engine import CudaDirectEngine
import subprocess
import sys

ROOT = Path(__file__).resolve().parents[2]
NO_GPU = not torch.cuda.is_available()

TWO_RANKS = """\
topology t {
  levels node 1, gpu 2
  rank gpu
  relation peer = other gpu
  link nv p2p { connects peer  bandwidth 450 GB/s  shared per gpu  latency 3 us }
  link hbm local { bandwidth 3000 GB/s }
}
workload { tokens 8  hidden 256  dtype bf16  topk 4  experts 8 blocked  weights travel }
dispatch {
  defaults chunk 16 tokens depth 2
  step meta: exchange counts with all
  step push: send tokens for peer from input to peer.output over nv
  step keep: permute input into output
}
combine reverse of dispatch
"""


def _compile(tmp_path: Path, src: str, name: str, *extra: str) -> Path:
    out = tmp_path / name
    assert epcc_main(["compile", src, "-o", str(out), *extra]) == 0
    return out


@pytest.fixture()
def one_rank_group(tmp_path):
    """A gloo group of one rank in this process (FileStore in tmp_path); destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU: the no-device error cannot happen")
def test_cuda_buffer_without_a_gpu_says_so(tmp_path, one_rank_group, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    bundle = _compile(tmp_path, "schedules/h200x4.sched", "h200x4", "--target", "cuda")
    capsys.readouterr()
    monkeypatch.setenv("EPCC_CACHE", str(tmp_path / "cache"))  # nvcc must not even start
    with pytest.raises(GroupError, match=r"^making the Buffer failed on rank 0: Buffer\(backend='cuda'\): no CUDA "
                                         r"device is available") as e:
        Buffer(one_rank_group, bundle, backend="cuda")
    assert type(e.value.__cause__) is RuntimeError  # not a DirectRuntimeError from the build, nor a BundleError
    assert not (tmp_path / "cache").exists()
    # a bundle without CUDA sources, or with the wrong group size: still the missing device first
    plain = _compile(tmp_path, "schedules/h200x4.sched", "plain")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        Buffer(one_rank_group, plain, backend="cuda", config={"warps": 4})


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
def test_cuda_engine_itself_checks_for_a_device(tmp_path, monkeypatch):
    """The engine (runtime/engines/cuda_direct/engine.py) guards itself too, for callers that bypass
    Buffer: before it reads its group or its bundle."""
    monkeypatch.chdir(ROOT)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        CudaDirectEngine(None, None, timeout_s=1.0)


def test_cpu_buffer_refuses_a_config(tmp_path, one_rank_group):
    src = tmp_path / "two.sched"
    src.write_text(TWO_RANKS)
    bundle = _compile(tmp_path, str(src), "two")
    with pytest.raises(GroupValueError, match=r"^making the Buffer failed on rank 0: Buffer: config \(SMs, warps\) "
                                              r"applies to the cuda backend only$"):
        Buffer(one_rank_group, bundle, backend="cpu", config={"warps": 4})
    with pytest.raises(ValueError, match="config"):
        Buffer(one_rank_group, bundle, config={"send_blocks": 8})  # the default backend is cpu
    # an empty configuration asks for nothing, so every backend takes it (a worker passing {} where
    # it has no setting to give ran the cuda bundles and failed on every other backend's): the
    # Buffer gets past the config to the next check, this 2-rank bundle in a group of 1
    with pytest.raises(ValueError, match=r"was compiled for 2 ranks \(t\), but the group has 1"):
        Buffer(one_rank_group, bundle, backend="cpu", config={})


def _cuda_only_args_worker(rank: int, bundle: str, store: str, result_dir: str) -> None:
    out = []
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        buf = Buffer(None, bundle, backend="cpu")
        x = torch.zeros(8, 256, dtype=torch.bfloat16)
        idx = torch.arange(4).repeat(8, 1)
        cases = [
            (lambda: buf.dispatch(x, idx, sync=False), "sync=False"),
            (lambda: buf.dispatch(x, idx, expert_alignment=4), "expert_alignment"),
            (lambda: buf.dispatch(x, handle=object()), "handle"),
        ]
        for fn, arg in cases:
            try:
                fn()
                out.append(f"no error for {arg}")
            except GroupValueError as e:  # both ranks refused: both raise it, naming them
                if not e.reason.startswith(f"dispatch: {arg}") or "cuda backend" not in e.reason \
                        or not str(e).endswith(f"failed on ranks 0, 1: {e.reason}") or e.rebuild:
                    out.append(f"{arg}: {e!r} should name the argument and the cuda backend")
            except Exception as e:  # noqa: BLE001 - the wrong kind of error is what we report
                out.append(f"{arg}: {type(e).__name__}: {e} (expected a ValueError)")
        # the Buffer still works after refusing them (no collective was entered).  Every token
        # picks experts 0-3, all on rank 0: rank 1 receives nothing, which must be an empty
        # [0, hidden] tensor (and combine of nothing gives zeros), not a failed torch view.
        recv_x, _, _, counts, handle, _ = buf.dispatch(x, idx)
        want = [2 * 8 * 4, 0][rank]
        if list(recv_x.shape) != [want, 256] or recv_x.dtype != torch.bfloat16 or sum(counts) != want:
            out.append(f"dispatch after the errors returned {recv_x.dtype} {list(recv_x.shape)}, counts {counts}")
        got = buf.combine(recv_x, handle)
        if list(got.shape) != [8, 256]:
            out.append(f"combine returned {list(got.shape)}")
        buf.close()
        dist.destroy_process_group()
        (Path(result_dir) / f"rank{rank}.txt").write_text("\n".join(out) or "ok")
    except BaseException:
        (Path(result_dir) / f"rank{rank}.txt").write_text(traceback.format_exc())


def test_cpu_backend_refuses_cuda_only_arguments_by_name(tmp_path):
    src = tmp_path / "two.sched"
    src.write_text(TWO_RANKS)
    bundle = _compile(tmp_path, str(src), "two")
    results = tmp_path / "results"
    results.mkdir()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_cuda_only_args_worker, args=(str(bundle), str(tmp_path / "store"), str(results)), nprocs=2, join=True)
    for r in range(2):
        text = (results / f"rank{r}.txt").read_text()
        assert text == "ok", f"rank {r}:\n{text}"


# --------------------------------------------------------------------------------------------
# epcc tune


def _one_line_error(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("epcc: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_tune_without_a_bundle(tmp_path, capsys):
    assert epcc_main(["tune", str(tmp_path / "nowhere")]) == 1
    line = _one_line_error(capsys)
    assert f"{tmp_path / 'nowhere'}: no cuda/manifest.json" in line and "--target cuda" in line


def test_tune_on_a_bundle_without_cuda_sources(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    b = _compile(tmp_path, "schedules/h200x4.sched", "plain")
    capsys.readouterr()
    assert epcc_main(["tune", str(b)]) == 1
    assert "no cuda/manifest.json" in _one_line_error(capsys)


def test_tune_on_a_bundle_that_is_not_one_hop(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    b = _compile(tmp_path, "schedules/h200x4_2vnode.sched", "vnode", "--target", "cuda")
    capsys.readouterr()
    assert epcc_main(["tune", str(b)]) == 1
    line = _one_line_error(capsys)
    assert "nothing to tune: the plan is not one-hop" in line and "step 'rdma' (line " in line


def test_tune_on_a_broken_manifest(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    b = _compile(tmp_path, "schedules/h200x4.sched", "h200x4", "--target", "cuda")
    capsys.readouterr()
    (b / "cuda" / "manifest.json").write_text("{not json")
    assert epcc_main(["tune", str(b)]) == 1
    assert "cuda/manifest.json is not the file 'epcc compile' wrote" in _one_line_error(capsys)
    (b / "cuda").rename(tmp_path / "elsewhere")
    (b / "cuda").mkdir()
    (b / "cuda" / "manifest.json").write_text("{not json")
    (b / "manifest.json").unlink()
    assert epcc_main(["tune", str(b)]) == 1
    assert "not an epcc bundle (no manifest.json)" in _one_line_error(capsys)


@pytest.mark.skipif(torch.cuda.device_count() >= 4, reason="this machine has the GPUs")
def test_tune_without_gpus(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    b = _compile(tmp_path, "schedules/h200x4.sched", "h200x4", "--target", "cuda")
    capsys.readouterr()
    # with or without torchrun on PATH: the missing GPUs are what is said
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert epcc_main(["tune", str(b)]) == 1
    assert _one_line_error(capsys) == f"epcc: error: epcc tune: 4 GPUs needed, this machine has " \
                                      f"{torch.cuda.device_count()}"
    assert epcc_main(["tune", str(b), "--nproc", "0"]) == 1
    assert "--nproc 0: expected a number of GPUs, at least 1" in _one_line_error(capsys)


def test_tune_by_subprocess_exits_1_with_one_line(tmp_path):
    """The installed `epcc` script, as a user runs it (no activated venv)."""
    epcc = Path(sys.executable).parent / "epcc"
    if not epcc.is_file():
        pytest.skip("the epcc script is not installed beside this interpreter")
    r = subprocess.run([str(epcc), "tune", str(tmp_path / "missing")], capture_output=True, text=True,
                       env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
