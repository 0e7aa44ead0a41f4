"""DeepEP's own intranode test, unedited, against epcc.deep_ep on 2 GPUs.

DeepEP v1.2.1's tests/test_intranode.py imports `deep_ep` (and its utils.py and test_low_latency.py);
here `deep_ep` is epcc.deep_ep through the documented one-line shim (docs/runtime.md), and the
bundles are tests/gpu/bundles.py's token-major EP2 ones (4096 tokens x 7168, top-8 of 256, bf16
and fp8), which the test's shapes need.  Set $EPCC_DEEPEP_TESTS to DeepEP's tests folder (from its
source release); the test runs where 2 GPUs, nvcc and the bundles are present, and skips elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from epcc.runtime.build_cache import find_nvcc

from test_gpu import first_two_gpus

ROOT = Path(__file__).resolve().parents[2]
BUNDLES = Path(os.environ.get("EPCC_GPU_BUNDLES") or ROOT / ".gpu" / "bundles")
NEEDED = ["h200x2_tok", "h200x2_tok_fp8"]  # tests/gpu/bundles.py VARIANTS (token-major)
CASES = 24  # DeepEP's test: {previous, async} x {rand bf16, bf16, fp8} x {with, without top-k}

pytestmark = pytest.mark.gpu


def _why_not() -> str | None:
    try:
        import torch  # the runtime extra: without it this machine runs no GPU test
    except ImportError:
        return "torch is not installed"
    if torch.cuda.device_count() < 2:
        return f"needs 2 GPUs ({torch.cuda.device_count()} visible)"
    if find_nvcc() is None:
        return "nvcc not found: the direct kernels are built on this machine"
    tests = os.environ.get("EPCC_DEEPEP_TESTS")
    if not tests or not (Path(tests) / "test_intranode.py").is_file():
        return "set $EPCC_DEEPEP_TESTS to DeepEP's tests folder (holding test_intranode.py)"
    missing = [b for b in NEEDED if not (BUNDLES / b / "cuda" / "manifest.json").is_file()]
    if missing:
        return f"bundles missing under {BUNDLES}: {', '.join(missing)} (tests/gpu/bundles.py writes them)"
    return None


def test_deepeps_intranode_test_passes_against_epcc_deep_ep(tmp_path):
    why = _why_not()
    if why:
        pytest.skip(why)
    (tmp_path / "deep_ep.py").write_text("from epcc.deep_ep import *\n", encoding="utf-8")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               CUDA_VISIBLE_DEVICES=first_two_gpus(), EPCC_DEEP_EP_BUNDLES=str(BUNDLES),
               PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    tests = Path(os.environ["EPCC_DEEPEP_TESTS"])
    r = subprocess.run([sys.executable, "test_intranode.py", "--num-processes", "2"], cwd=tests, env=env,
                       capture_output=True, text=True, timeout=float(os.environ.get("EPCC_GPU_TIMEOUT", "1200")))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert out.count(" passed") == CASES, out[-6000:]
    assert "[tuning] Best combine" in out, out[-6000:]
