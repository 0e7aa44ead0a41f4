"""Which epcc bundle serves a DeepEP call, and where bundles come from.

A call asks for a `Shape`: the group's size, the hidden size, bf16 or fp8, top-k, experts, and
the most tokens any rank dispatches.  A bundle serves it when its plan is token-major (workload
`layout token`), places experts blocked (DeepEP's: expert e on rank e // (experts / ranks)), has
the same ranks, hidden, dtype, top-k and experts, was compiled for at least that many tokens per
rank, and (for the cuda backend) carries CUDA kernels.  Of those, the one compiled for the fewest
tokens is taken (then the first by path): every rank scans the same directories and decides from
the same gathered shape, so every rank takes the same bundle.

Bundle directories come from Buffer's `bundles` argument or from $EPCC_DEEP_EP_BUNDLES (paths
separated by os.pathsep); each is a bundle (`epcc compile -o DIR`) or holds bundles one level
down.  Where none serves, Buffer may compile one (opt-in: `compile_missing=True` or
$EPCC_DEEP_EP_COMPILE=1): a one-hop NVLink schedule for the shape, written by `one_hop_schedule`,
compiled by `epcc compile` in a subprocess (`compile_for`, bounded by COMPILE_S) into a temporary
directory.  Rank 0 of the group compiles, where the compiler can run (MLIR importable), and the
other ranks load what it wrote (intranode: they share its node); buffer.py makes that one compile.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..plan import bundle as bundle_io
from ..plan.bundle import BundleError

BUNDLES_ENV = "EPCC_DEEP_EP_BUNDLES"
COMPILE_ENV = "EPCC_DEEP_EP_COMPILE"
#: The longest a compile of a missing bundle may take (the other ranks wait this long for it, and then
#: the Buffer's timeout).
COMPILE_S = 600.0


class NoBundle(BundleError):
    """No bundle serves the call: the message names what was asked and what exists."""


@dataclass(frozen=True)
class Shape:
    ranks: int
    hidden: int
    dtype: str  # bf16 | fp8
    topk: int | None  # None: any (a dispatch without topk_idx routes by is_token_in_rank)
    experts: int
    tokens: int  # the most tokens any rank dispatches

    def describe(self) -> str:
        k = "any top-k" if self.topk is None else f"top-{self.topk}"
        return (f"{self.ranks} ranks, hidden {self.hidden}, {self.dtype}, {k} of {self.experts} experts, "
                f"{self.tokens} tokens per rank")


@dataclass(frozen=True)
class Candidate:
    path: Path
    ranks: int
    hidden: int
    dtype: str
    topk: int
    experts: int
    tokens: int
    layout: str
    placement: str
    cuda: bool  # carries CUDA kernels

    def misses(self, shape: Shape, backend: str) -> list[str]:
        """Why this bundle does not serve `shape` on `backend` (empty: it does)."""
        out = [f"{name} {got}" for name, got, want in
               (("layout", self.layout, "token"), ("placement", self.placement, "blocked"),
                ("ranks", self.ranks, shape.ranks), ("hidden", self.hidden, shape.hidden),
                ("dtype", self.dtype, shape.dtype), ("topk", self.topk, shape.topk),
                ("experts", self.experts, shape.experts)) if want is not None and got != want]
        if self.tokens < shape.tokens:
            out.append(f"at most {self.tokens} tokens")
        if backend == "cuda" and not self.cuda:
            out.append("no CUDA kernels")
        return out

    def describe(self) -> str:
        return (f"{self.path} ({self.layout}-major, {self.placement}, {self.ranks} ranks, hidden {self.hidden}, "
                f"{self.dtype}, top-{self.topk} of {self.experts}, {self.tokens} tokens"
                f"{', cuda' if self.cuda else ''})")


def bundle_dirs(arg: str | Path | list | tuple | None) -> list[Path]:
    """The directories to search: `arg` (a path or a list of them), else $EPCC_DEEP_EP_BUNDLES."""
    if arg is None:
        env = os.environ.get(BUNDLES_ENV, "")
        return [Path(p) for p in env.split(os.pathsep) if p]
    items = [arg] if isinstance(arg, (str, Path)) else list(arg)
    for item in items:
        if not isinstance(item, (str, Path)):
            raise TypeError(f"Buffer: bundles must be a path or a list of paths, not {type(item).__name__}")
    return [Path(p) for p in items]


def candidate(path: Path) -> Candidate:
    """The bundle in `path`, as selection sees it (BundleError where it cannot be loaded)."""
    loaded = bundle_io.load(path)
    wl = loaded.plan.workload
    if wl is None:
        raise BundleError(f"{path}: the plan has no workload")
    return Candidate(path=path, ranks=loaded.plan.num_ranks, hidden=wl.hidden, dtype=wl.dtype, topk=wl.topk,
                     experts=wl.experts, tokens=wl.tokens, layout=wl.layout, placement=wl.placement,
                     cuda=bool(bundle_io.cuda_manifest(path, required=False)))


def scan(dirs: list[Path]) -> tuple[list[Candidate], list[str]]:
    """Every bundle in `dirs` (a bundle, or bundles one level down), and what could not be read."""
    found: list[Candidate] = []
    unreadable: list[str] = []
    for d in dirs:
        if (d / bundle_io.PLAN_FILE).is_file():
            paths = [d]
        elif d.is_dir():
            paths = sorted(p for p in d.iterdir() if (p / bundle_io.PLAN_FILE).is_file())
        else:
            unreadable.append(f"{d}: no such directory")
            continue
        for p in paths:
            try:
                found.append(candidate(p))
            except (BundleError, OSError, ValueError) as e:
                unreadable.append(f"{p}: {e}")
    return found, unreadable


def choose(found: list[Candidate], unreadable: list[str], dirs: list[Path], shape: Shape, backend: str) -> Candidate:
    """The bundle that serves `shape` (the fewest tokens, then the first path), else NoBundle."""
    fits = [c for c in found if not c.misses(shape, backend)]
    if fits:
        return min(fits, key=lambda c: (c.tokens, str(c.path)))
    where = ", ".join(str(d) for d in dirs) or f"(none: pass bundles=DIR to Buffer or set ${BUNDLES_ENV})"
    lines = [f"epcc.deep_ep: no bundle serves {shape.describe()} on the {backend} backend; searched {where}"]
    lines += [f"  {c.describe()}: {', '.join(c.misses(shape, backend))}" for c in found]
    lines += [f"  unreadable: {u}" for u in unreadable]
    if not found and not unreadable:
        lines.append("  (no bundles there)")
    dtype = " --dtype fp8" if shape.dtype == "fp8" else ""
    target = "cuda" if backend == "cuda" else "none"
    k = "any top-k" if shape.topk is None else f"top-{shape.topk}"
    lines.append(f"compile one with a {shape.ranks}-GPU schedule of hidden {shape.hidden}, {k} of "
                 f"{shape.experts} experts (blocked): `epcc compile SCHED --layout token --target {target} "
                 f"--tokens {shape.tokens}{dtype} -o DIR`, or let Buffer compile one (compile_missing=True or "
                 f"${COMPILE_ENV}=1, where MLIR is importable)")
    raise NoBundle("\n".join(lines))


def can_compile() -> bool:
    """Whether the compiler can run in this Python (its MLIR bindings are importable)."""
    return importlib.util.find_spec("mlir") is not None


def one_hop_schedule(shape: Shape, sms: int) -> str:
    """A one-hop NVLink schedule for `shape`, token-major: each GPU sends every token once to each
    GPU that holds one of its experts, over `sms` SMs, and keeps its own tokens locally (any top-k:
    top-ranks, enough to route a token to every rank)."""
    return f"""\
# written by epcc.deep_ep for a call no bundle served: {shape.describe()}
schedule deep_ep_{shape.ranks}x "one-hop NVLink dispatch, token-major, for epcc.deep_ep"

topology gpus {{
  vendor nvidia arch hopper
  levels node 1, gpu {shape.ranks}
  rank gpu
  relation peer = other gpu
  link nvlink p2p {{ connects peer  bandwidth 450 GB/s  efficiency 62 %  latency 3 us  engine sm  shared per gpu }}
  link hbm local {{ bandwidth 3000 GB/s  latency 1 us }}
}}

workload {{
  tokens {shape.tokens} per rank
  hidden {shape.hidden}
  dtype {shape.dtype}
  topk {shape.topk or shape.ranks}
  experts {shape.experts} blocked
  weights travel
  layout token
}}

dispatch {{
  defaults chunk 128 tokens depth 4
  step meta: exchange counts with all
  step push: send tokens for peer from input to peer.output over nvlink sms {sms}
  step keep: permute input into output
}}

combine reverse of dispatch
"""


def compile_for(shape: Shape, sms: int, backend: str, timeout_s: float = COMPILE_S) -> Path:
    """A bundle for `shape` compiled now into a temporary directory (`epcc compile` in a subprocess,
    given up after `timeout_s`); NoBundle with the compiler's message where it fails."""
    if not can_compile():
        raise NoBundle("epcc.deep_ep: cannot compile a bundle here: the compiler's MLIR bindings are not importable "
                       "(compile bundles where they are and pass their directory)")
    work = Path(tempfile.mkdtemp(prefix="epcc_deep_ep_"))
    src = work / "deep_ep.sched"
    src.write_text(one_hop_schedule(shape, sms), encoding="utf-8")
    out = work / "bundle"
    cmd = [sys.executable, "-m", "epcc.cli", "compile", str(src), "--target", "cuda" if backend == "cuda" else "none",
           "-o", str(out)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise NoBundle(f"epcc.deep_ep: compiling a bundle for {shape.describe()} did not finish within "
                       f"{timeout_s:g} s") from None
    if res.returncode != 0:
        raise NoBundle(f"epcc.deep_ep: compiling a bundle for {shape.describe()} failed:\n{res.stdout}{res.stderr}")
    return out
