"""`epcc tune BUNDLE`: sweep a CUDA bundle's SMs and warps on the GPUs (torchrun starts
epcc.runtime.tune on every rank); the fastest configuration goes to BUNDLE/cuda/tuned.json."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from ..limits import MAX_RANKS
from ..plan import bundle as bundle_io
from .common import say, user_error


def add_parser(sub) -> None:
    c = sub.add_parser("tune", help="sweep a CUDA bundle's SMs and warps on the GPUs (torchrun); keep the best",
                       description="Start `torchrun --nproc-per-node N -m epcc.runtime.tune BUNDLE ...`: every "
                                   "configuration is checked against the first (bit-identical results) and timed; "
                                   "the fastest is written to BUNDLE/cuda/tuned.json, which the runtime reads.")
    c.add_argument("bundle", metavar="BUNDLE", help="a bundle written by `epcc compile FILE --target cuda -o BUNDLE`")
    c.add_argument("--nproc", type=int, help="GPUs (default: the plan's ranks)")
    c.add_argument("--sms", default="8,16,24,32,48", help="total SMs per kernel to try")
    c.add_argument("--warps", default="8,16", help="warps per dispatch block to try")
    c.add_argument("--iters", default="10", help="timed calls per configuration")
    c.set_defaults(func=cmd_tune)


def cmd_tune(args) -> int:
    bundle = Path(args.bundle)
    try:
        manifest = bundle_io.cuda_manifest(bundle)
    except bundle_io.BundleError as e:
        raise user_error(str(e)) from None
    if "direct" not in manifest:
        why = manifest.get("direct_not_used")
        raise user_error(f"{bundle}: nothing to tune: the plan is not one-hop "
                         f"({why if isinstance(why, str) else '?'})")
    nproc = manifest["num_ranks"] if args.nproc is None else args.nproc
    if nproc < 1:
        raise user_error(f"--nproc {nproc}: expected a number of GPUs, at least 1")
    if nproc > MAX_RANKS:
        raise user_error(f"--nproc {nproc}: more GPUs than epcc supports ranks ({MAX_RANKS})")
    try:
        import torch  # torch is the runtime extra: only `epcc tune` needs it here
    except ImportError as e:
        raise user_error(f"epcc tune: torch is not importable ({e}); run this on the GPU machine, where torch is "
                         f"installed") from None
    # GPUs before torchrun: on a machine without them, that is the one thing to say
    if torch.cuda.device_count() < nproc:
        raise user_error(f"epcc tune: {nproc} GPUs needed, this machine has {torch.cuda.device_count()}")
    # torchrun comes with torch: beside this interpreter when the venv is not activated
    beside = Path(sys.executable).parent / "torchrun"
    torchrun = shutil.which("torchrun") or (str(beside) if beside.is_file() else None)
    if torchrun is None:
        raise user_error("epcc tune: torchrun not found (it comes with torch); run this on the GPU machine")
    cmd = [torchrun, "--nproc-per-node", str(nproc), "-m", "epcc.runtime.tune", str(bundle),
           "--sms", args.sms, "--warps", args.warps, "--iters", str(args.iters)]
    say(" ".join(cmd))
    sys.stdout.flush()
    return subprocess.call(cmd)
