"""EP dispatch/combine benchmark: epcc's CUDA bundles against two torch+NCCL baselines.

    torchrun --nproc-per-node 4 bench/ep_bench.py --bundles DIR [DIR ...] --out OUT_DIR
    torchrun --nproc-per-node 2 bench/ep_bench.py --bundles DIR --out OUT_DIR --dry-run --tokens 32

One process per GPU (rank r on cuda:LOCAL_RANK).  For every bundle (written by `epcc compile FILE
--target cuda -o DIR`; its plan.json gives ranks, tokens, hidden, dtype, topk, experts), on ONE
uniform top-k routing (runtime/testing/inputs.py, fixed seed; every rank generates its own token rows with
its own seeded torch generator, never zeros):

* epcc: the bundle's launcher library (built once per bundle by rank 0 with nvcc, or reused when
  it is newer than the sources), the layout computed once for the routing, the tables uploaded,
  then dispatch and combine timed separately.  It runs in a child process per rank and bundle
  (its own CUDA context and NCCL/gloo groups): a kernel that gives up waiting traps and loses the
  CUDA context, and a child takes that loss with it while the baselines and the next bundles go on.
* torch_megatron (baseline A): a Megatron-style all-to-all token dispatcher in torch + NCCL, timed
  whole: counts per destination (per-rank dedup) -> all_to_all of the counts + host sync ->
  index_select into the send buffer -> all_to_all_single (payload, and the tokens' top-k ids and
  weights) -> expert-major permute at the receiver.  Combine: rows regrouped by home rank ->
  all_to_all_single back (one bf16 row per (token, expert)) -> weighted sum at home (fp32).
* nccl_a2a (baseline B): only the all_to_all_single of the pre-permuted per-rank-dedup payload
  (splits known, buffers built beforehand); "combine" is the reverse all_to_all_single of one bf16
  row per (token, destination rank).

Timing: CUDA events; before every iteration all ranks synchronise
their device, meet at a gloo barrier (which also carries every rank's ok/failed status), the L2 is
flushed (a 256 MB memset), a short device sleep lets the host run ahead, and a one-element NCCL
all_reduce lines the GPUs up; then start event, the operation, end event.  Warm-up iterations,
one checked iteration (dispatch rows exact against runtime/testing/oracle.py's order; combine with
oracle.compare_combine), timed iterations alternating two input sets.  An iteration's time is the
maximum over ranks; the table gives the median and minimum over iterations.  A method whose check
fails reports no numbers.  Rank 0 prints the table last and writes OUT_DIR/ep_bench.json.

--rdma-chunks TxD[,TxD...]: a bundle compiled with --rdma proxy runs once per RDMA chunking (T
tokens per chunk, D in flight), its plan re-chunked here (plan/rdma.py with_overrides:
the layout, tables, rings and FIFOs follow, the kernels do not change), reported as
BUNDLE@TxD beside `epcc simulate` of the re-chunked plan, simulated here (the simulator reads
only the plan); the baselines run once per bundle.

More ranks than GPUs (4 ranks on a 2-GPU machine): rank r runs on GPU r mod #GPUs, the groups are
gloo (NCCL wants a GPU per rank), only epcc runs, and the driver time-slices the kernels of one
GPU's ranks, so a wait on the other rank of one's own GPU lasts until the next slice: a
correctness run of the plan's kernels and proxy path (every result checked as above), whose
times are not the plan's and are compared with nothing (tests/gpu/test_gpu.py runs the 4-rank
proxy bundles so where 4 GPUs are missing).

--dry-run: no CUDA, no NCCL: gloo on CPU tensors (all_to_all_single emulated with all_gather),
wall-clock timing; the epcc child does the host part (layout, tables) and checks the tables with
the NumPy emulator of the kernels (runtime/testing/emulate.py) instead of launching them.
"""

from __future__ import annotations

import os

# NVLink multicast must stay off on the shared GPU hosts (KINDS.md): forced, not defaulted.
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
_OVERRIDDEN = {k: os.environ[k] for k, v in _NO_MULTICAST.items() if os.environ.get(k, v) != v}
os.environ.update(_NO_MULTICAST)

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PG_TIMEOUT = datetime.timedelta(seconds=300)  # NCCL groups (a hang ends in the watchdog's abort)
GLOO_TIMEOUT = datetime.timedelta(seconds=600)  # host agreement; rank 0 may be running nvcc meanwhile
L2_FLUSH_BYTES = 256 << 20
SLEEP_CYCLES = 4_000_000  # about 2 ms at 2 GHz: the host enqueues the timed work meanwhile (GPU time is
# measured, not the host's launch cost, which a training step hides by running ahead)
CHECK_CHUNK = 1024  # tokens per compare_combine call (bounds its float64 temporaries)
TIMELINE_ROUNDS = 5  # stamped rounds after the timed ones; the role timeline is their median


def import_epcc() -> None:
    """`import epcc` as installed (pip install -e .), or else alias the repository's folders as the
    package, as pyproject.toml's package-dir maps them (the GPU machine has no install)."""
    try:
        import epcc.plan  # noqa: F401 - the probe: is epcc installed (else its folders are aliased below)?
        return
    except ImportError:
        pass
    for name in [n for n in list(sys.modules) if n == "epcc" or n.startswith("epcc.")]:
        del sys.modules[name]
    for name, folder in (("epcc", "compiler"), ("epcc.runtime", "runtime"), ("epcc.backends", "backends")):
        spec = importlib.util.spec_from_file_location(name, ROOT / folder / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / folder)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        if "." in name:
            setattr(sys.modules["epcc"], name.split(".", 1)[1], mod)


import_epcc()
from epcc.plan import Plan  # noqa: E402
from epcc.plan import bundle as bundle_io  # noqa: E402
from epcc.plan.rdma import (ENV_CHUNK_TOKENS, ENV_DEPTH, MAX_DEPTH, positive_setting,  # noqa: E402
                            rdma_bytes_per_token, with_overrides)
from epcc.runtime.buffer import Buffer  # noqa: E402
from epcc.runtime.engines.base import KernelTimeout  # noqa: E402
from epcc.runtime.engines.cuda_table.launcher import (CudaError, Library, build_library,  # noqa: E402
                                                      median_timeline, role_timeline)
from epcc.runtime.engines.cuda_table.tables import buffer_sizes, build_tables, partial_rounding  # noqa: E402
from epcc.runtime.engines.gpu_proxy.build import build_gpu  # noqa: E402
from epcc.runtime.engines.gpu_proxy.engine import GpuRdma  # noqa: E402
from epcc.runtime.engines.transport import cost_phrase  # noqa: E402
from epcc.runtime.layout import compute_layout  # noqa: E402
from epcc.runtime.testing import inputs, oracle  # noqa: E402
from epcc.runtime.testing.emulate import emulate  # noqa: E402
from epcc.sim.report import to_dict  # noqa: E402
from epcc.sim.simulate import SimOptions, simulate  # noqa: E402

METHODS = ("epcc", "torch_megatron", "nccl_a2a")


class PeerFailed(RuntimeError):
    """Another rank reported a failure at the per-iteration barrier."""


class CheckFailed(RuntimeError):
    """This method's output differs from the oracle: no numbers are reported."""


class KernelFailed(RuntimeError):
    """An epcc launcher call failed; the message is the kernel's error record (e.g. a wait that
    timed out: rank, step, chunk, flag) or the launcher's."""


# =========================================================================== workload


def load_bundle(path: str | Path) -> tuple[Plan, dict]:
    """The bundle's plan and its CUDA manifest ({} where it has none)."""
    return bundle_io.load(path).plan, bundle_io.cuda_manifest(path, required=False)


def bench_routing(plan: Plan, tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Uniform top-k [R, T, k] and softmax weights [R, T, k], the same on every rank."""
    wl = plan.workload
    idx = inputs.make_topk("uniform", plan.num_ranks, tokens, wl.topk, wl.experts, wl.placement,
                              seed=seed).topk_idx
    return idx, inputs.make_weights(idx, seed=seed + 1)


def _generator(dev: torch.device, seed: int, rank: int, stream: int) -> torch.Generator:
    g = torch.Generator(device=dev)
    g.manual_seed((seed * 1_000_003 + rank * 7_919 + stream * 104_729) % (2 ** 63))
    return g


def gen_rows(tokens: int, hidden: int, dtype: str, seed: int, rank: int, stream: int,
             dev: torch.device) -> torch.Tensor:
    """This rank's token rows, uint8 [T, row_bytes]: bf16 N(0,1) values (zero replaced), or fp8
    e4m3 bytes (no NaN encoding) followed by one fp32 scale per 128 channels (runtime/testing/inputs.py's
    wire format)."""
    g = _generator(dev, seed, rank, stream)
    if dtype == "bf16":
        v = torch.randn(tokens, hidden, generator=g, device=dev).to(torch.bfloat16)
        v = torch.where(v == 0, torch.full_like(v, 0.5), v)
        return v.view(torch.uint8).reshape(tokens, 2 * hidden)
    q = torch.randint(0, 254, (tokens, hidden), generator=g, device=dev, dtype=torch.int32)
    q = torch.where(q >= 0x7F, q + 1, q).to(torch.uint8)  # skip 0x7f (NaN); 0xff never drawn
    groups = hidden // inputs.FP8_GROUP
    sc = (torch.rand(tokens, groups, generator=g, device=dev) * 1.5 + 0.5) / 448.0
    return torch.cat([q, sc.contiguous().view(torch.uint8).reshape(tokens, 4 * groups)], dim=1).contiguous()


def gen_features(x_rows: torch.Tensor, hidden: int, dtype: str, seed: int, rank: int,
                 dev: torch.device) -> torch.Tensor:
    """bf16 [T, hidden] per-token features the expert outputs are made from (bf16: the token itself)."""
    if dtype == "bf16":
        return x_rows.view(torch.bfloat16).reshape(x_rows.shape[0], hidden)
    return gen_rows(x_rows.shape[0], hidden, "bf16", seed, rank, 9, dev).view(torch.bfloat16).reshape(-1, hidden)


def expert_scale(experts: int, dev: torch.device) -> torch.Tensor:
    """The per-expert factor of the synthetic expert outputs (exact in fp32)."""
    return (0.5 + (torch.arange(experts, dtype=torch.float32) % 64) / 64.0).to(dev)


def expert_outputs(F_all: torch.Tensor, src: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 [n, hidden] expert outputs for rows src [n, 3] (home, token, expert):
    bf16(F[home, token] * scale[expert]), a function of the row any rank can evaluate."""
    h, t, e = src[:, 0], src[:, 1], src[:, 2]
    return (F_all[h, t].float() * scale[e][:, None]).to(torch.bfloat16)


def combine_reference(F_mine: torch.Tensor, idx_mine: torch.Tensor, w_mine: torch.Tensor,
                      scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """oracle.combine_oracle for this rank's tokens alone: out[t] = sum_j w[t, j] * y(t, e_j) in
    fp32, with the same expert outputs as expert_outputs(); and sum |w y| (the tolerance scale)."""
    T, k = idx_mine.shape
    ref = torch.zeros(T, F_mine.shape[1], dtype=torch.float32, device=F_mine.device)
    mag = torch.zeros_like(ref)
    Ff = F_mine.float()
    for j in range(k):
        e = idx_mine[:, j]
        valid = (e >= 0).float()[:, None]
        y = (Ff * scale[e.clamp_min(0)][:, None]).to(torch.bfloat16).float()
        c = w_mine[:, j, None] * y * valid
        ref += c
        mag += c.abs()
    return ref, mag


def check_rows(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if tuple(got.shape) != tuple(want.shape):
        raise CheckFailed(f"{what}: {list(got.shape)} rows, expected {list(want.shape)}")
    bad = torch.nonzero(~(got == want).all(dim=1)).flatten()
    if bad.numel():
        raise CheckFailed(f"{what}: {bad.numel()} of {want.shape[0]} rows differ (first {bad[:5].tolist()})")


def check_combine(got_bf16: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, topk: int, what: str,
                  rounding: float = 0.0) -> dict:
    """oracle.compare_combine, token chunk by token chunk; CheckFailed if any value is off.
    rounding: the unit roundoff of partials the method rounds on the way (compare_combine's
    partial_rounding): bf16 partials across RDMA-class links in the table-driven kernels
    (tables.partial_rounding); 0 otherwise."""
    worst_ulp, worst_rel = 0, 0.0
    for lo in range(0, ref.shape[0], CHECK_CHUNK):
        hi = min(ref.shape[0], lo + CHECK_CHUNK)
        g = got_bf16[lo:hi].float().cpu().numpy()[None]
        chk = oracle.compare_combine(g, ref[lo:hi].cpu().numpy()[None], mag[lo:hi].cpu().numpy()[None], topk,
                                     partial_rounding=rounding)
        worst_ulp, worst_rel = max(worst_ulp, chk.max_ulp), max(worst_rel, chk.max_rel)
        if not chk.ok:
            _, t, c = chk.first_bad
            raise CheckFailed(f"{what}: token {lo + t} channel {c}: got {chk.got:g}, want {chk.want:g} "
                              f"(max {chk.max_ulp} ulp)")
    return {"max_ulp": int(worst_ulp), "max_rel": float(worst_rel)}


def recv_src(idx: np.ndarray, experts: int, placement: str, rank: int) -> np.ndarray:
    """(home, token, expert) [n, 3] of the rows `rank` receives, in the oracle's order (local
    expert, home, token): the expert-major output of dispatch."""
    return oracle.recv_order(idx, experts, placement)[rank][0]


def dedup_src(idx: np.ndarray, experts: int, placement: str, rank: int) -> np.ndarray:
    """(home, token) [n, 2] of the tokens `rank` receives once each (per-rank dedup), source-major."""
    rank_of, _ = oracle.expert_rank(experts, idx.shape[0], placement)
    hit = ((rank_of[np.maximum(idx, 0)] == rank) & (idx >= 0)).any(axis=2)  # [R, T]
    h, t = np.nonzero(hit)
    return np.stack([h, t], axis=1).astype(np.int64).reshape(-1, 2)


def traffic(idx: np.ndarray, experts: int, placement: str, hidden: int, row_bytes: int, dtype: str) -> dict:
    """Bytes per rank (lists indexed by rank) under the conventions of ../shared/ANCHORS.md.

    dispatch (received by the expert rank d), combine (received by the home rank h):
      remote_dedup: a token crosses once to each OTHER rank holding one of its experts
                    (dispatch: row_bytes per token; combine: one bf16 row of hidden per (token, rank));
      remote_rows:  one row per (token, expert on another rank) (expert-major fused permute);
      deepep:       DeepEP's test: every received token incl. self x hidden x 2 (dispatch FP8 scaled
                    by (1 + 4/128) / 2; combine reuses dispatch's bf16 count)."""
    R = idx.shape[0]
    rank_of, _ = oracle.expert_rank(experts, R, placement)
    dest = np.where(idx >= 0, rank_of[np.maximum(idx, 0)], -1)  # [R, T, k]
    tok = np.stack([(dest == d).any(axis=2).sum(axis=1) for d in range(R)], axis=1)  # [home, dest]
    rows = np.stack([(dest == d).sum(axis=(1, 2)) for d in range(R)], axis=1)  # [home, dest]
    off = ~np.eye(R, dtype=bool)
    fp8 = (1 + 4 / 128) / 2 if dtype == "fp8" else 1.0
    bf16_row = 2 * hidden
    return {
        "dispatch": {
            "remote_dedup": [int((tok[:, d] * off[:, d]).sum() * row_bytes) for d in range(R)],
            "remote_rows": [int((rows[:, d] * off[:, d]).sum() * row_bytes) for d in range(R)],
            "deepep": [float(tok[:, d].sum() * bf16_row * fp8) for d in range(R)],
            "recv_tokens_dedup": [int(tok[:, d].sum()) for d in range(R)],
            "recv_rows": [int(rows[:, d].sum()) for d in range(R)],
        },
        "combine": {
            "remote_dedup": [int((tok[h] * off[h]).sum() * bf16_row) for h in range(R)],
            "remote_rows": [int((rows[h] * off[h]).sum() * bf16_row) for h in range(R)],
            "deepep": [float(tok[:, d].sum() * bf16_row) for d in range(R)],
        },
    }


# =========================================================================== communication + timing


class Comm:
    """The collectives one process needs: the default group (NCCL; gloo in a dry run, and where
    ranks share GPUs) and a gloo group for host-side agreement.  `shared`: more ranks than GPUs,
    rank r on GPU r mod #GPUs (NCCL wants a GPU per rank), so device tensors cross gloo through
    the host."""

    def __init__(self, dry: bool, dev: torch.device, cpu_group, shared: bool = False):
        self.dry, self.dev, self.cpu, self.shared = dry, dev, cpu_group, shared
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def all_gather_object(self, obj):
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.cpu)
        return out

    def barrier(self):
        dist.barrier(group=self.cpu)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[world, *t.shape] (every rank's t)."""
        out = torch.empty((self.world,) + tuple(t.shape), dtype=t.dtype, device=t.device)
        if self.dry or self.shared:
            parts = self.all_gather_object(t.detach().cpu().contiguous())
            for r, p in enumerate(parts):
                out[r].copy_(p)
        else:
            dist.all_gather_into_tensor(out.view(-1), t.contiguous().view(-1))
        return out

    def a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None) -> None:
        """all_to_all_single; in a dry run emulated over gloo with all_gather (gloo has no all_to_all)."""
        if not self.dry:
            dist.all_to_all_single(out, inp, out_splits, in_splits)
            return
        W = self.world
        ins = list(in_splits) if in_splits is not None else [inp.shape[0] // W] * W
        parts = self.all_gather_object((inp.contiguous(), ins))
        chunks = []
        for src_inp, src_splits in parts:
            lo = sum(src_splits[:self.rank])
            chunks.append(src_inp[lo:lo + src_splits[self.rank]])
        got = torch.cat(chunks) if chunks else inp[:0]
        if got.shape != out.shape:
            raise RuntimeError(f"a2a emulation: got {list(got.shape)}, out is {list(out.shape)}")
        out.copy_(got)


class Timer:
    """Per-iteration alignment and event timing (wall clock in a dry run)."""

    def __init__(self, comm: Comm, flush: bool):
        self.comm, self.dry = comm, comm.dry
        if not self.dry:
            self.l2 = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=comm.dev) if flush else None
            self.tick = torch.zeros(1, dtype=torch.float32, device=comm.dev)

    def align(self, ok: bool = True, why: str = "") -> None:
        """Every rank: device idle, then a gloo barrier that carries each rank's status (PeerFailed
        if another rank failed), then (GPU) L2 flush, device sleep, and an NCCL all_reduce that
        lines the GPUs up (not where ranks share GPUs: no NCCL group there); the host
        meanwhile enqueues the timed work."""
        if not self.dry:
            torch.cuda.synchronize()
        st = self.comm.all_gather_object((ok, why))
        bad = [(r, w) for r, (o, w) in enumerate(st) if not o]
        if bad:
            raise PeerFailed("; ".join(f"rank {r}: {w}" for r, w in bad))
        if self.dry:
            return
        if self.l2 is not None:
            self.l2.zero_()
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(SLEEP_CYCLES)
        if not self.comm.shared:
            dist.all_reduce(self.tick)

    def time(self, fn, after=None) -> tuple[float, object]:
        """Milliseconds of fn() on this rank (events around it on the current stream), its result."""
        self.align()
        if self.dry:
            t0 = time.perf_counter()
            res = fn()
            if after:
                after()
            return (time.perf_counter() - t0) * 1e3, res
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        res = fn()
        e.record()
        if after:
            after()
        e.synchronize()
        return s.elapsed_time(e), res


def run_iterations(timer: Timer, warmup: int, iters: int, step, check) -> dict:
    """warm-up, one checked iteration (set 0; CheckFailed raised by `check` is shared with every
    rank before anyone goes on), then the timed ones alternating the input sets.  step(set, phase)
    -> (dispatch ms, combine ms, outputs)."""
    for i in range(warmup):
        step(i % 2, "warmup")
    _, _, outs = step(0, "check")
    try:
        info = check(outs)
        ok, why = True, ""
    except Exception as e:  # noqa: BLE001 - CheckFailed, or a bug in the check: either way no numbers
        info, ok, why = None, False, f"check failed: {e}"
    del outs
    try:
        timer.align(ok, why)
    except PeerFailed as e:
        raise CheckFailed(str(e)) from None
    disp, comb = [], []
    for i in range(iters):
        d, c, _ = step(1 - i % 2, "timed")
        disp.append(d)
        comb.append(c)
    return {"dispatch_ms": disp, "combine_ms": comb, "check": info}


# =========================================================================== baselines


class Megatron:
    """Baseline A: a Megatron-style all-to-all token dispatcher (per-rank dedup dispatch)."""

    def __init__(self, comm: Comm, R: int, experts: int, placement: str, hidden: int):
        self.comm, self.R, self.E, self.H = comm, R, experts, hidden
        dev = comm.dev
        rank_of, local_of = oracle.expert_rank(experts, R, placement)
        self.rank_of = torch.from_numpy(rank_of).to(dev)
        self.local_of = torch.from_numpy(local_of).to(dev)
        self.epr = experts // R
        self._static = None

    def _nonzero(self, m: torch.Tensor, n: int) -> torch.Tensor:
        """nonzero with a host-known count: no second host sync where nonzero_static runs."""
        if self._static is not False:
            try:
                out = torch.nonzero_static(m, size=n)
                self._static = True
                return out
            except (AttributeError, RuntimeError, NotImplementedError):
                self._static = False
        return torch.nonzero(m)

    def dispatch(self, x: torch.Tensor, topk: torch.Tensor, w: torch.Tensor):
        """x uint8 [T, row_bytes], topk int64 [T, k], w fp32 [T, k] -> expert-major rows (oracle
        order: local expert, home, token), their weights, rows per local expert (host), handle."""
        R, epr, me = self.R, self.epr, self.comm.rank
        dev = x.device
        T, k = topk.shape
        valid = topk >= 0
        dest = torch.where(valid, self.rank_of[topk.clamp_min(0)], R)  # R: empty slot
        local = self.local_of[topk.clamp_min(0)]
        in_rank = torch.zeros(T, R + 1, dtype=torch.bool, device=dev).scatter_(1, dest, True)[:, :R]
        rows_per = torch.zeros((R + 1) * epr, dtype=torch.int64, device=dev)
        rows_per.scatter_add_(0, (dest * epr + local).flatten(), torch.ones(T * k, dtype=torch.int64, device=dev))
        counts = torch.cat([in_rank.sum(0, dtype=torch.int64)[:, None], rows_per[:R * epr].view(R, epr)], dim=1)
        recv_counts = torch.empty_like(counts)
        self.comm.a2a(recv_counts, counts)
        host = torch.cat([counts, recv_counts]).cpu()  # the host sync: splits and expert sizes
        send_tok_n = host[:R, 0].tolist()
        recv_tok_n = host[R:, 0].tolist()
        rows_back_n = host[:R, 1:].sum(1).tolist()  # rows of my tokens held by each rank
        rows_from_n = host[R:, 1:].sum(1).tolist()  # rows I hold per home rank
        tokens_per_expert = host[R:, 1:].sum(0).tolist()
        n_send, n_recv, n_rows = sum(send_tok_n), sum(recv_tok_n), sum(rows_from_n)
        # send buffer: token copies destination-major (token order inside)
        send_tok = self._nonzero(in_rank.t(), n_send)[:, 1]
        send_x = x.index_select(0, send_tok)
        meta = torch.cat([topk.index_select(0, send_tok).to(torch.int32),
                          w.index_select(0, send_tok).contiguous().view(torch.int32)], dim=1)
        recv_x = torch.empty(n_recv, x.shape[1], dtype=x.dtype, device=dev)
        recv_meta = torch.empty(n_recv, 2 * k, dtype=torch.int32, device=dev)
        self.comm.a2a(recv_x, send_x, recv_tok_n, send_tok_n)
        self.comm.a2a(recv_meta, meta, recv_tok_n, send_tok_n)
        # expert-major permute at the receiver: rows (token, local expert), stable by local expert
        r_idx = recv_meta[:, :k].long()
        r_w = recv_meta[:, k:].contiguous().view(torch.float32)
        mine = (r_idx >= 0) & (self.rank_of[r_idx.clamp_min(0)] == me)
        ij = self._nonzero(mine, n_rows)
        loc = self.local_of[r_idx[ij[:, 0], ij[:, 1]]]
        order = torch.sort(loc, stable=True).indices
        i_sorted, j_sorted = ij[order, 0], ij[order, 1]
        out_x = recv_x.index_select(0, i_sorted)
        out_w = r_w[i_sorted, j_sorted]
        # for combine: the rows regrouped by home rank (expert-major inside), and at home the
        # (token, slot) each returning row belongs to: by (holder rank, local expert, token)
        bounds = torch.cumsum(recv_counts[:, 0], 0)
        home_of_row = torch.searchsorted(bounds, i_sorted, right=True)
        back = torch.sort(home_of_row, stable=True).indices
        key = torch.where(valid, dest * (epr * T) + local * T + torch.arange(T, device=dev)[:, None],
                          torch.full_like(dest, R * epr * T)).flatten()
        perm = torch.sort(key).indices[:sum(rows_back_n)]
        handle = {"back": back, "rows_from_n": rows_from_n, "rows_back_n": rows_back_n,
                  "tok_back": perm // k, "w_back": w.flatten()[perm], "tokens": T}
        return out_x, out_w, tokens_per_expert, handle

    def combine(self, y: torch.Tensor, handle: dict) -> torch.Tensor:
        """y bf16 [rows, hidden] in dispatch's output order -> bf16 [T, hidden] at home."""
        send = y.index_select(0, handle["back"])
        recv = torch.empty(sum(handle["rows_back_n"]), y.shape[1], dtype=y.dtype, device=y.device)
        self.comm.a2a(recv, send, handle["rows_back_n"], handle["rows_from_n"])
        out = torch.zeros(handle["tokens"], y.shape[1], dtype=torch.float32, device=y.device)
        out.index_add_(0, handle["tok_back"], recv.float() * handle["w_back"][:, None])
        return out.to(torch.bfloat16)


def bench_baselines(comm: Comm, timer: Timer, args, plan: Plan, T: int, idx: np.ndarray, w: np.ndarray,
                    methods: list[str]) -> dict:
    wl, R, me, dev = plan.workload, plan.num_ranks, comm.rank, comm.dev
    H, rb = wl.hidden, inputs.row_bytes(wl.hidden, wl.dtype)
    results: dict[str, dict] = {}
    x_sets = [gen_rows(T, H, wl.dtype, args.seed, me, s, dev) for s in (0, 1)]
    F_mine = gen_features(x_sets[0], H, wl.dtype, args.seed, me, dev)
    x_all = comm.all_gather(x_sets[0])  # [R, T, rb]: the expected rows
    F_all = comm.all_gather(F_mine)
    scale = expert_scale(wl.experts, dev)
    topk = torch.from_numpy(idx[me]).to(dev)
    wt = torch.from_numpy(w[me]).to(dev)
    src = torch.from_numpy(recv_src(idx, wl.experts, wl.placement, me)).to(dev)
    y0 = expert_outputs(F_all, src, scale)
    y_sets = [y0, (y0.float() * -0.5).to(torch.bfloat16)]
    ref, mag = combine_reference(F_mine, topk, wt, scale)
    want_rows = x_all[src[:, 0], src[:, 1]]

    if "torch_megatron" in methods:
        mg = Megatron(comm, R, wl.experts, wl.placement, H)

        def step_a(s, phase):
            td, (rows, _, _, handle) = timer.time(lambda: mg.dispatch(x_sets[s], topk, wt))
            tc, out = timer.time(lambda: mg.combine(y_sets[s], handle))
            return td, tc, (rows, out)

        def check_a(outs):
            check_rows(outs[0], want_rows, "torch_megatron dispatch")
            return check_combine(outs[1], ref, mag, wl.topk, "torch_megatron combine")

        results["torch_megatron"] = _guard(comm, lambda: run_iterations(timer, args.warmup, args.iters,
                                                                           step_a, check_a))
        results["torch_megatron"]["sms"] = "torch + NCCL"

    if "nccl_a2a" in methods:
        def run_b():
            # pre-permuted per-rank-dedup payload and known splits, built outside the timing
            rank_of = torch.from_numpy(oracle.expert_rank(wl.experts, R, wl.placement)[0]).to(dev)
            dest = torch.where(topk >= 0, rank_of[topk.clamp_min(0)], R)
            in_rank = torch.zeros(T, R + 1, dtype=torch.bool, device=dev).scatter_(1, dest, True)[:, :R]
            send_tok_n = in_rank.sum(0).tolist()
            send_tok = torch.nonzero(in_rank.t())[:, 1]
            dsrc = torch.from_numpy(dedup_src(idx, wl.experts, wl.placement, me)).to(dev)
            recv_tok_n = torch.bincount(dsrc[:, 0], minlength=R).tolist()
            send_sets = [xs.index_select(0, send_tok) for xs in x_sets]
            back_sets = [F_all[dsrc[:, 0], dsrc[:, 1]], (F_all[dsrc[:, 0], dsrc[:, 1]].float() * 2).to(torch.bfloat16)]
            recv_x = torch.empty(sum(recv_tok_n), rb, dtype=torch.uint8, device=dev)
            recv_b = torch.empty(sum(send_tok_n), H, dtype=torch.bfloat16, device=dev)
            want_x = x_all[dsrc[:, 0], dsrc[:, 1]]
            want_b = F_mine.index_select(0, send_tok)

            def step_b(s, phase):
                td, _ = timer.time(lambda: comm.a2a(recv_x, send_sets[s], recv_tok_n, send_tok_n))
                got_x = recv_x.clone() if phase == "check" else None
                tc, _ = timer.time(lambda: comm.a2a(recv_b, back_sets[s], send_tok_n, recv_tok_n))
                return td, tc, (got_x, recv_b.clone() if phase == "check" else None)

            def check_b(outs):
                check_rows(outs[0], want_x, "nccl_a2a dispatch")
                check_rows(outs[1].view(torch.int16), want_b.view(torch.int16), "nccl_a2a combine")
                return {"exact": True}

            return run_iterations(timer, args.warmup, args.iters, step_b, check_b)

        results["nccl_a2a"] = _guard(comm, run_b)
        results["nccl_a2a"]["sms"] = "NCCL"
    return results


def _guard(comm: Comm, fn) -> dict:
    """Run one method; a failure becomes {"error": ...} (check failures and peers' too)."""
    try:
        return fn()
    except CheckFailed as e:
        return {"error": f"WRONG: {e}"}
    except PeerFailed as e:
        return {"error": f"a peer failed: {e}"}
    except Exception as e:  # noqa: BLE001 - report, and tell the peers waiting at the next align()
        msg = f"{type(e).__name__}: {e}"
        sys.stderr.write(f"[rank {comm.rank}] {msg}\n{traceback.format_exc()}")
        notify_failure(comm, msg)
        return {"error": msg}


def notify_failure(comm: Comm, msg: str) -> None:
    """Meet the peers' next Timer.align() (a gloo all_gather of statuses) with a failure, so
    that they stop too.  Host-side only: works with a dead CUDA context."""
    try:
        comm.all_gather_object((False, msg))
    except Exception:  # noqa: BLE001
        pass


# =========================================================================== epcc (child process per rank)


def epcc_child(cfg: dict, conn) -> None:
    """One rank's epcc run, in its own process (CUDA context, NCCL + gloo groups over a fresh TCP
    store).  Sends one dict back through `conn`; exits hard after a failure (a trapped kernel leaves
    a dead CUDA context that must not be torn down politely)."""
    res: dict = {"rank": cfg["rank"]}
    failed = False
    try:
        res.update(_epcc_child(cfg))
    except Exception as e:  # noqa: BLE001
        failed = True
        msg = str(e) if isinstance(e, (CheckFailed, PeerFailed, KernelFailed)) else f"{type(e).__name__}: {e}"
        if isinstance(e, CheckFailed):
            msg = f"WRONG: {msg}"
        elif isinstance(e, PeerFailed):
            msg = f"a peer failed: {msg}"
        res["error"] = msg
        res["traceback"] = traceback.format_exc()
    try:
        conn.send(res)
        conn.close()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if failed:
            os._exit(1)
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _epcc_child(cfg: dict) -> dict:
    os.environ.update(_NO_MULTICAST)
    dry, rank, world = cfg["dry_run"], cfg["rank"], cfg["world"]
    # Our own store, served by rank 0's child (an init_method URL would, under torchrun's
    # TORCHELASTIC_USE_AGENT_STORE, expect the agent to serve it, and wait forever).
    store = dist.TCPStore(cfg["addr"], cfg["port"], world, is_master=rank == 0, timeout=PG_TIMEOUT)
    if dry:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=PG_TIMEOUT)
        cpu_group = dist.group.WORLD
    else:
        dev = torch.device("cuda", cfg["local_rank"])
        torch.cuda.set_device(dev)
        if cfg["shared"]:  # ranks share GPUs: no NCCL (one GPU per rank); the bundle's own paths need none
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=PG_TIMEOUT)
            cpu_group = dist.group.WORLD
        else:
            dist.init_process_group("nccl", store=store, rank=rank, world_size=world, timeout=PG_TIMEOUT,
                                    device_id=dev)
            cpu_group = dist.new_group(backend="gloo", timeout=PG_TIMEOUT)
    comm = Comm(dry, dev, cpu_group, cfg["shared"])
    timer = Timer(comm, cfg["flush"])
    plan, manifest = load_bundle(cfg["bundle"])
    if cfg.get("rdma_chunking"):
        plan = rechunk(plan, cfg["rdma_chunking"])
    wl, R, T = plan.workload, plan.num_ranks, cfg["tokens"]
    H = wl.hidden
    idx, w = bench_routing(plan, T, cfg["seed"])
    out: dict = {}

    # ---- host part: layout once for the routing, this rank's tables
    t0 = time.perf_counter()
    layout = compute_layout(plan, idx, w)
    t1 = time.perf_counter()
    programs = [p for p in ("dispatch", "combine")
                if any(k["program"] == p and k["kind"] == "main" for k in manifest["kernels"])]
    tables = {p: build_tables(manifest, layout, p, rank) for p in programs}
    t2 = time.perf_counter()
    out["host_ms"] = {"layout": (t1 - t0) * 1e3, "tables": (t2 - t1) * 1e3}
    out["wire_bytes"] = epcc_wire_bytes(layout)
    rdma = {(st.program, st.name) for st in plan.steps if st.link_kind == "rdma"}
    out["rdma_chunk_rows"] = {  # the largest chunk of each RDMA step this rank sends, in rows
        f"{p}.{n}": max((int(np.diff(c.chunk_starts).max(initial=0)) for c in layout.copies
                         if (c.program, c.step) == (p, n) and c.rank == rank), default=0) for p, n in sorted(rdma)}
    out["sms"] = kernel_sms(manifest)

    # ---- data (the same generator as the baselines: same rows)
    x_sets = [gen_rows(T, H, wl.dtype, cfg["seed"], rank, s, dev) for s in (0, 1)]
    F_mine = gen_features(x_sets[0], H, wl.dtype, cfg["seed"], rank, dev)
    x_all = comm.all_gather(x_sets[0])
    F_all = comm.all_gather(F_mine)
    scale = expert_scale(wl.experts, dev)
    src = torch.from_numpy(recv_src(idx, wl.experts, wl.placement, rank)).to(dev)
    if not np.array_equal(layout.entries[("output", rank)], src.cpu().numpy()):
        raise CheckFailed("the layout's output order is not the oracle's (local expert, home, token)")
    y0 = expert_outputs(F_all, src, scale)
    y_sets = [y0, (y0.float() * -0.5).to(torch.bfloat16)]
    ref, mag = combine_reference(F_mine, torch.from_numpy(idx[rank]).to(dev), torch.from_numpy(w[rank]).to(dev),
                                 scale)
    want_rows = x_all[src[:, 0], src[:, 1]]

    direct = "direct" in manifest and not cfg.get("tables")
    rounding = 0.0 if direct else partial_rounding(manifest)

    def check(outs):
        got_rows, got_comb = outs
        check_rows(got_rows, want_rows, "epcc dispatch")
        return check_combine(got_comb, ref, mag, wl.topk, "epcc combine", rounding)

    if dry:
        return _epcc_dry(cfg, comm, manifest, layout, x_all, F_all, scale, check, out)
    if direct:
        return _epcc_direct(cfg, comm, timer, plan, dev, idx, w, x_sets, y_sets, check, out)

    lib = Library(cfg["lib"])
    stream = torch.cuda.current_stream().cuda_stream
    ctx = lib.create(dev.index, rank, 1 + 2 * max(len(layout.flags), 1), cfg["kernel_timeout"])
    handles = comm.all_gather_object(lib.ipc_handle(ctx.flag_area))
    opened = []

    def peer(h, r, own):
        if r == rank:
            return own
        p = lib.ipc_open(dev.index, h)
        opened.append(p)
        return p

    ctx.set_flag_areas([peer(h, r, ctx.flag_area) for r, h in enumerate(handles)])
    own, ptrs = {}, {}
    for p in programs:
        own[p] = [lib.malloc(dev.index, n) for n in buffer_sizes(manifest, layout, p, rank)]
        peers = comm.all_gather_object([lib.ipc_handle(q) for q in own[p]])
        ptrs[p] = [[peer(peers[r][b], r, own[p][b]) for r in range(R)] for b in range(len(own[p]))]
    t3 = time.perf_counter()
    for p in programs:
        ctx.set_buffers(p, ptrs[p], stream)
        ctx.upload_tables(p, tables[p], stream)
    ctx.synchronize(stream)
    rdma_engines = []
    if manifest.get("options", {}).get("rdma") == "proxy":  # the GPU proxy path: transport, rings, proxy thread
        plib = build_gpu(Path(cfg["bundle"]) / "cuda" / "rdma", cfg["rdma_transport"])
        for p in programs:
            eng = GpuRdma(proxy_lib=str(plib), cuda_lib=lib, ctx=ctx, plan=plan, manifest=manifest,
                          blob=tables[p].blob, program=p, rank=rank, device=dev.index, exchange=comm.all_gather_object,
                          timeout_s=cfg["kernel_timeout"], transport=cfg["rdma_transport"])
            eng.start()
            rdma_engines.append(eng)
        out["rdma"] = [e.summary for e in rdma_engines]
    out["host_ms"]["upload"] = (time.perf_counter() - t3) * 1e3
    out["host_ms"]["layout_upload"] = out["host_ms"]["layout"] + out["host_ms"]["tables"] + out["host_ms"]["upload"]
    names = {p: [b["name"] for b in manifest["buffers"][p]] for p in programs}
    in_ptr = own["dispatch"][names["dispatch"].index("input")]
    disp_out = own["dispatch"][names["dispatch"].index("output")]
    y_ptr = own["combine"][names["combine"].index("output")]
    out_ptr = lib.malloc(dev.index, T * H * 2)
    n_rows = layout.buffer_rows("output", rank)
    x_host = [xs.cpu().pin_memory().numpy() for xs in x_sets]
    y_host = [ys.view(torch.int16).cpu().pin_memory().numpy() for ys in y_sets]
    comm.barrier()  # every flag area and buffer exists before any launch

    def step(s, phase):
        lib.copy_to_device(in_ptr, x_host[s])  # rewritten after the previous combine finished
        td, _ = timer.time(lambda: ctx.launch_dispatch(stream), after=lambda: ctx.synchronize(stream))
        rows = None
        if phase == "check":
            got = np.empty((n_rows, layout.row_bytes), dtype=np.uint8)
            lib.copy_to_host(got, disp_out)
            rows = torch.from_numpy(got).to(dev)
        lib.copy_to_device(y_ptr, y_host[s])  # rewritten after the dispatch finished
        tc, _ = timer.time(lambda: ctx.launch_combine(out_ptr, stream), after=lambda: ctx.synchronize(stream))
        comb = None
        if phase == "check":
            c = np.empty((T, H), dtype=np.int16)
            lib.copy_to_host(c, out_ptr)
            comb = torch.from_numpy(c).to(dev).view(torch.bfloat16)
        return td, tc, (rows, comb)

    try:
        out.update(run_iterations(timer, cfg["warmup"], cfg["iters"], step, check))
        # TIMELINE_ROUNDS more (untimed) rounds with the kernels' per-block stamps: when each role
        # ran, the median over the rounds
        for p in programs:
            ctx.enable_timeline(p)
        rounds: dict[str, list] = {p: [] for p in programs}
        for i in range(TIMELINE_ROUNDS):
            comm.barrier()
            step(i % 2, "timeline")
            for p in programs:
                rounds[p].append(role_timeline(manifest, p, ctx.read_timeline(p)))
        out["timeline"] = {p: median_timeline(rounds[p]) for p in programs}
    except (CheckFailed, PeerFailed):
        raise  # already agreed with every rank
    except Exception as e:  # noqa: BLE001
        detail = f"{type(e).__name__}: {e}"
        if isinstance(e, (CudaError, KernelTimeout)):  # a kernel that gave up waiting wrote the error record
            _, msg = ctx.read_error()
            detail = msg or str(e)
        for eng in rdma_engines:  # a proxy that stopped on a failure says why, and what it did
            if eng.failure():
                detail += "; " + eng.failure()
            detail += "; " + eng.state()
        notify_failure(comm, detail)
        raise KernelFailed(detail) from None
    comm.barrier()
    for p, eng in zip(programs, rdma_engines):
        out.setdefault("rdma_stats", {})[p] = eng.stats()
        eng.close()
    comm.barrier()  # no peer's proxy writes into this rank's rings any more
    for p in opened:
        lib.ipc_close(p)
    ctx.close()
    return out


def _epcc_direct(cfg, comm, timer, plan, dev, idx, w, x_sets, y_sets, check, out) -> dict:
    """The direct lowering through the public API, `Buffer(group, bundle, backend="cuda")`:
    dispatch in the no-host-sync mode (sync=False: device-side metadata, whole receive buffer;
    what a training step or a CUDA graph runs), combine of the expert outputs."""
    rank, wl, T = cfg["rank"], plan.workload, cfg["tokens"]
    H = wl.hidden
    buf = Buffer(dist.group.WORLD, cfg["bundle"], backend="cuda", timeout_s=cfg["kernel_timeout"],
                 config=cfg.get("config"))
    eng = buf.engine
    out["lowering"] = "direct"
    out["config"] = dict(vars(eng.config))
    out["sms"] = {"dispatch": eng.config.dispatch_sms, "combine": eng.config.combine_sms}
    out.pop("host_ms", None)  # no host layout: the metadata kernel is inside the timed dispatch
    tr = traffic(idx, wl.experts, wl.placement, H, inputs.row_bytes(H, wl.dtype), wl.dtype)
    out["wire_bytes"] = {op: tr[op]["remote_dedup"] for op in ("dispatch", "combine")}  # one row per (token, GPU)

    def xin(rows):
        if wl.dtype == "fp8":
            return (rows[:, :H].contiguous().view(torch.float8_e4m3fn), rows[:, H:].contiguous().view(torch.float32))
        return rows.view(torch.bfloat16).reshape(T, H)

    xs = [xin(r) for r in x_sets]
    idx_t = torch.from_numpy(idx[rank]).to(dev)
    w_t = torch.from_numpy(w[rank]).to(dev)
    cap = eng.c["capacity"]
    n = y_sets[0].shape[0]
    ys = []
    for y in y_sets:
        full = torch.zeros((cap, H), dtype=torch.bfloat16, device=dev)
        full[:n] = y
        ys.append(full)
    comm.barrier()

    def step(s, phase):
        td, res = timer.time(lambda: buf.dispatch(xs[s], idx_t, w_t, sync=False))
        rx, _, _, _, h, _ = res
        rows = None
        if phase == "check":
            rows = (torch.cat([rx[0][:n].view(torch.uint8), rx[1][:n].contiguous().view(torch.uint8)], 1)
                    if wl.dtype == "fp8" else rx[:n].view(torch.uint8))
        tc, comb = timer.time(lambda: buf.combine(ys[s], h))
        return td, tc, (rows, comb if phase == "check" else None)

    try:
        out.update(run_iterations(timer, cfg["warmup"], cfg["iters"], step, check))
        # one more (untimed) round with the kernels' per-block / per-warp stamps: when each role ran
        eng.enable_timeline()
        comm.barrier()
        step(0, "timeline")
        out["timeline"] = eng.read_timeline()
        eng.enable_timeline(False)
    except (CheckFailed, PeerFailed):
        raise
    except Exception as e:  # noqa: BLE001
        detail = f"{type(e).__name__}: {e}"
        msg = eng.lib.read_error(eng.err_host, plan.rank_names or None)
        notify_failure(comm, msg or detail)
        raise KernelFailed(msg or detail) from None
    comm.barrier()
    buf.close()
    return out


def _epcc_dry(cfg, comm, manifest, layout, x_all, F_all, scale, check, out) -> dict:
    """Dry run: no kernels.  The NumPy emulator runs this rank's tables (and every other rank's)
    over the same inputs, and the result goes through the same checks as the GPU's output."""
    rank, R = cfg["rank"], layout.num_ranks
    out["host_ms"]["layout_upload"] = out["host_ms"]["layout"] + out["host_ms"]["tables"]
    if R * layout.tokens > cfg["emulate_max_tokens"]:
        out["skipped"] = (f"dry run: no CUDA; layout + tables built ({out['host_ms']['layout_upload']:.1f} ms), "
                          f"emulator skipped ({R * layout.tokens} tokens > {cfg['emulate_max_tokens']})")
        return out
    xs = [x_all[r].numpy() for r in range(R)]
    d = emulate(manifest, layout, "dispatch", xs)
    ys = []
    for r in range(R):
        s = torch.from_numpy(layout.entries[("output", r)])
        ys.append(expert_outputs(F_all, s, scale).view(torch.int16).numpy().view(np.uint16))
    c = emulate(manifest, layout, "combine", ys)
    got_rows = torch.from_numpy(d[("output", rank)])
    got_comb = torch.from_numpy(oracle.f32_to_bf16(c[("result", rank)]).view(np.int16)).view(torch.bfloat16)
    info = check((got_rows, got_comb))
    comm.barrier()
    out["skipped"] = (f"dry run: no CUDA; layout + tables built ({out['host_ms']['layout_upload']:.1f} ms) "
                      f"and checked with the NumPy emulator (combine max {info['max_ulp']} ulp)")
    out["check"] = info
    return out


def kernel_sms(manifest: dict) -> dict:
    """SMs of each program's persistent kernel: the sum of its roles' block ranges (one block per
    SM; = the cooperative grid).  Combine's short bf16 conversion kernel (grid 2 x SMs) is extra."""
    out = {}
    for k in manifest.get("kernels", []):
        if k.get("kind") == "main":
            roles = k.get("roles") or []
            out[k["program"]] = sum(r["blocks"][1] - r["blocks"][0] for r in roles) if roles else k["grid"]
    return out


def epcc_wire_bytes(layout) -> dict:
    """Bytes each rank receives from other ranks as the tables move them: dispatch row_bytes per
    (token, expert) row copied across; combine's weighted adds land as fp32 (4 x hidden per row)
    when the expert rank pushes them, bf16 rows (2 x hidden) when the home rank pulls."""
    R = layout.num_ranks
    out = {"dispatch": [0] * R, "combine": [0] * R}
    for c in layout.copies:
        if c.src == c.dst:
            continue
        n = len(c.dst_slots)
        if c.program == "dispatch":
            out["dispatch"][c.dst] += n * layout.row_bytes
        else:
            out["combine"][c.dst] += n * layout.hidden * (4 if c.rank != c.dst else 2)
    return out


def free_port() -> int:
    s = socket.socket()
    s.bind(("", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def run_epcc(comm: Comm, args, bundle: str, lib: str | None, lib_error: str | None, T: int,
             chunking: tuple | None = None) -> dict:
    """Start this rank's child for `bundle` (its RDMA steps re-chunked to `chunking`, (tokens,
    depth), where given), wait for its answer (bounded), collect every rank's."""
    if lib_error:
        return {"error": lib_error}
    port = comm.all_gather_object(free_port() if comm.rank == 0 else None)[0]
    cfg = {"bundle": bundle, "lib": lib, "rank": comm.rank, "world": comm.world, "rdma_chunking": chunking,
           "local_rank": comm.dev.index if comm.dev.type == "cuda" else 0,
           "addr": os.environ.get("MASTER_ADDR", "127.0.0.1"), "port": port, "seed": args.seed, "tokens": T,
           "warmup": args.warmup, "iters": args.iters, "kernel_timeout": args.kernel_timeout,
           "dry_run": args.dry_run, "shared": comm.shared, "flush": not args.no_flush,
           "emulate_max_tokens": args.emulate_max_tokens,
           "rdma_transport": args.rdma_transport}
    ctx = mp.get_context("spawn")
    rd, wr = ctx.Pipe(duplex=False)
    p = ctx.Process(target=epcc_child, args=(cfg, wr), daemon=True)
    p.start()
    wr.close()
    res, deadline = None, time.monotonic() + args.child_timeout
    while time.monotonic() < deadline:
        if rd.poll(0.5):
            try:
                res = rd.recv()
            except EOFError:
                res = None
            break
        if not p.is_alive():
            if rd.poll(0.5):
                res = rd.recv()
            break
    if res is None:
        if p.is_alive():
            p.kill()  # our own child, by its handle
            res = {"error": f"no answer from the epcc process within {args.child_timeout:.0f} s (killed)"}
        else:
            res = {"error": f"the epcc process exited with code {p.exitcode} without an answer"}
    p.join(10)
    if p.is_alive():
        p.kill()
        p.join(5)
    rd.close()
    if "traceback" in res and not res.get("error", "").startswith("a peer failed"):
        sys.stderr.write(f"[rank {comm.rank}] epcc: {res['error']}\n{res['traceback']}")
    return res


def build_libs(bundles: list[str], rebuild: bool) -> list[tuple[str | None, str | None]]:
    """Rank 0: the launcher library of every bundle (nvcc in parallel, through the build cache:
    compiled again only when the sources change, or with `rebuild`).  [(path, error)]."""

    def one(b: str):
        cuda = Path(b) / "cuda"
        try:
            man = bundle_io.cuda_manifest(b)
            if "direct" in man:  # the direct lowering: Buffer builds (and caches) its own library
                return None, None
            not_lowered = [n["step"] for n in man.get("not_lowered", []) if n.get("kind") == "rdma"]
            if not_lowered:
                return None, f"steps {sorted(set(not_lowered))} need a host RDMA proxy (not in this version)"
            return str(build_library(cuda, fresh=rebuild)), None
        except Exception as e:  # noqa: BLE001
            return None, f"build: {type(e).__name__}: {str(e)[-1500:]}"

    with ThreadPoolExecutor(max_workers=max(1, len(bundles))) as ex:
        return list(ex.map(one, bundles))


# =========================================================================== report


def summarize(per_rank: list[dict], traffic_b: dict, wire: dict | None) -> dict:
    """Per-iteration max over ranks -> median, min; GB/s from the mean bytes per rank."""
    out = {}
    for op in ("dispatch", "combine"):
        series = [r[f"{op}_ms"] for r in per_rank]
        n = min(len(s) for s in series)
        it = [max(s[i] for s in series) for i in range(n)]
        med, mn = statistics.median(it), min(it)
        tb = traffic_b[op]
        mean = lambda v: float(np.mean(v))  # noqa: E731
        o = {"median_ms": med, "min_ms": mn, "iter_max_over_ranks_ms": it,
             "per_rank_median_ms": [statistics.median(s) for s in series],
             "gbps_remote_dedup": mean(tb["remote_dedup"]) / med / 1e6,
             "gbps_remote_rows": mean(tb["remote_rows"]) / med / 1e6,
             "gbps_deepep": mean(tb["deepep"]) / med / 1e6}
        if wire is not None:
            o["wire_bytes_per_rank"] = wire[op]
            o["gbps_remote_wire"] = mean(wire[op]) / med / 1e6
        out[op] = o
    return out


def wire_for(method: str, tr: dict, rb: int, topk: int, epcc_wire: dict | None) -> dict | None:
    if method == "epcc":
        return epcc_wire
    if method == "torch_megatron":  # payload + 2k x 4 B of top-k ids and weights per token; rows back
        meta = 2 * topk * 4
        return {"dispatch": [b + b // rb * meta for b in tr["dispatch"]["remote_dedup"]],
                "combine": tr["combine"]["remote_rows"]}
    return {"dispatch": tr["dispatch"]["remote_dedup"], "combine": tr["combine"]["remote_dedup"]}


def format_table(report: dict) -> str:
    hdr = ["bundle", "method", "dispatch ms med (min)", "disp GB/s dedup|wire|DeepEP", "combine ms med (min)",
           "comb GB/s dedup|wire|DeepEP", "SMs d/c", "layout+upload host ms"]
    rows, notes = [], []  # notes: (bundle, method, message) printed across the columns
    for b in report["bundles"]:
        if "error" in b:
            notes.append((len(rows), b["name"], "-", f"bundle: {b['error']}"))
            continue
        for m, r in b["methods"].items():
            if "summary" not in r:
                msg = f"{m.split('_')[0]}: failed: {r['error']}" if "error" in r else r.get("skipped", "no result")
                if _host(r):
                    msg += f" (layout+upload host {_host(r)} ms)"
                notes.append((len(rows), b["name"], m, msg))
                continue
            d, c = r["summary"]["dispatch"], r["summary"]["combine"]
            rows.append([b["name"], m, f"{d['median_ms']:.3f} ({d['min_ms']:.3f})", _gb(d),
                         f"{c['median_ms']:.3f} ({c['min_ms']:.3f})", _gb(c), _sms(r), _host(r) or "-"])
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(hdr)]
    widths[0] = max([widths[0]] + [len(n[1]) for n in notes])
    widths[1] = max([widths[1]] + [len(n[2]) for n in notes])

    def line(cells):
        return "  ".join(c.ljust(wd) for c, wd in zip(cells, widths)).rstrip()

    out = [line(hdr), line(["-" * wd for wd in widths])]
    lines = [line(r) for r in rows]
    for pos, bname, m, msg in reversed(notes):  # keep report order
        lines.insert(pos, "  ".join([bname.ljust(widths[0]), m.ljust(widths[1]), msg]))
    return "\n".join(out + lines)


def rechunk(plan: Plan, chunking: tuple[int | None, int | None]) -> Plan:
    """The plan with its RDMA steps re-chunked: `chunking` = (tokens per chunk, depth), None keeps
    the plan's (plan/rdma.py with_overrides; the environment is not read again)."""
    return with_overrides(plan, chunk_tokens=chunking[0], depth=chunking[1], env={})


def rdma_chunking_of(plan: Plan) -> dict:
    """{program.step: {chunk_tokens, depth, chunks}} of the plan's RDMA steps."""
    out = {}
    for s in plan.steps:
        if s.link_kind == "rdma" and s.chunk_bytes:
            bpt = rdma_bytes_per_token(plan, s.program)
            out[f"{s.program}.{s.name}"] = {"chunk_tokens": round(s.chunk_bytes / bpt), "depth": s.depth,
                                            "chunks": s.num_chunks}
    return out


def predict(plan: Plan, T: int) -> dict | None:
    """`epcc simulate --rdma proxy` of a re-chunked plan, run here: the simulator reads only the
    plan (no MLIR), so the GPU machine can run it.  None where it cannot (said on stderr)."""
    try:
        return _prediction(to_dict(simulate(plan, SimOptions(rdma_proxy=True)), tokens=T))
    except Exception as e:  # noqa: BLE001
        sys.stderr.write(f"ep_bench: cannot simulate the re-chunked plan: {type(e).__name__}: {e}\n")
        return None


def load_prediction(bundle: str | Path) -> dict | None:
    """`epcc simulate --json` of the bundle's schedule, where tests/gpu/bundles.py stored it
    (simulate.json: the simulator needs the compiler, which the GPU machine does not have)."""
    path = Path(bundle) / "simulate.json"
    if not path.is_file():
        return None
    return _prediction(json.loads(path.read_text(encoding="utf-8")))


def _prediction(d: dict) -> dict:
    steps = {p: {s["name"]: [s["start_ms"], s["end_ms"]] for s in d.get("steps", []) if s.get("program") == p}
             for p in ("dispatch", "combine")}
    sms = ((d.get("model") or {}).get("sm") or {}).get("sms")  # the direct kernels' SMs it assumed
    return {"tokens": d.get("tokens"), "sms": sms if isinstance(sms, dict) else None,
            **{p: {"total_ms": d["programs"][p]["total_ms"], "serial_ms": d["programs"][p]["serial_ms"],
                   "bottleneck": d["programs"][p]["bottleneck"]["link_class"], "steps": steps[p]}
               for p in ("dispatch", "combine")}}


def format_predictions(report: dict) -> list[str]:
    """Measured epcc medians against `epcc simulate` (with overlap, and its serial sum), per bundle;
    none where ranks shared GPUs (time-sliced kernels: not the plan's times)."""
    if report.get("shared_gpus") and any(b.get("simulate") for b in report["bundles"]):
        return [f"against epcc simulate: not compared ({report['shared_gpus']}: the times are not the plan's)"]
    out = []
    for b in report["bundles"]:
        sim, r = b.get("simulate"), b.get("methods", {}).get("epcc", {})
        if not sim or "summary" not in r:
            continue
        if sim.get("tokens") not in (None, b.get("workload", {}).get("tokens")):
            out.append(f"{b['name']}: simulate.json is for {sim['tokens']} tokens, the run for "
                       f"{b['workload']['tokens']}: not compared")
            continue
        run_sms, sim_sms = r.get("sms"), sim.get("sms")
        if isinstance(run_sms, dict) and sim_sms and any(run_sms.get(p) != n for p, n in sim_sms.items()):
            # a tuned configuration: the prediction was made for the plan's SMs
            out.append(f"{b['name']}: simulate.json is for {_sms({'sms': sim_sms})} SMs, the run used "
                       f"{_sms(r)}: not compared (`epcc simulate --sms N` predicts other SM counts)")
            out += format_timeline(b, r, None)
            continue
        cells = []
        for p in ("dispatch", "combine"):
            m, s = r["summary"][p]["median_ms"], sim[p]
            cells.append(f"{p} measured {m:.3f} ms, simulate {s['total_ms']:.3f} ms ({(m / s['total_ms'] - 1) * 100:+.0f} %; "
                         f"serial sum {s['serial_ms']:.3f}, bottleneck {s['bottleneck']})")
        out.append(f"{b['name']}: " + "; ".join(cells))
        out += format_timeline(b, r, sim)
    if out:
        out.insert(0, "against epcc simulate (the bundle's simulate.json; a re-chunked plan (name@TxD) simulated here):")
    return out


def format_timeline(b: dict, r: dict, sim: dict | None) -> list[str]:
    """Rank 0's role timeline, the median of the untimed stamped rounds (ms after the entry
    barrier: first block moving rows .. last block done), beside the simulator's step start .. end."""
    tl = (r.get("per_rank") or [{}])[0].get("timeline")
    if not tl:
        return []
    out = []
    for p in ("dispatch", "combine"):
        steps = (sim or {}).get(p, {}).get("steps", {})
        cells = []
        for role in tl[p]["roles"]:
            got = (f"{role['start_ms']:.3f}-{role['end_ms']:.3f}" if role["start_ms"] is not None else "no rows")
            if role.get("median_end_ms") is not None:
                got += f" (median warp end {role['median_end_ms']:.3f})"
            s = steps.get(role["step"])
            cells.append(f"{role['step']} {got}" + (f" (sim {s[0]:.3f}-{s[1]:.3f})" if s else ""))
        out.append(f"  {p} rank 0 timeline, ms: " + ", ".join(cells) + f"; kernel end {tl[p]['end_ms']:.3f}")
    return out


def _num(v: float) -> str:
    return f"{v:.0f}" if v >= 99.5 else f"{v:.1f}" if v >= 9.95 else f"{v:.2f}"


def _gb(o: dict) -> str:
    wire = _num(o["gbps_remote_wire"]) if "gbps_remote_wire" in o else "-"
    return f"{_num(o['gbps_remote_dedup'])} | {wire} | {_num(o['gbps_deepep'])}"


def _sms(r: dict) -> str:
    s = r.get("sms")
    if isinstance(s, dict):
        return f"{s.get('dispatch', '-')}/{s.get('combine', '-')}"
    return str(s or "-")


def _host(r: dict) -> str:
    h = r.get("host_ms_max")
    return f"{h:.1f}" if h is not None else ""


def jsonable(o):
    if isinstance(o, dict):
        return {str(k): jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [jsonable(v) for v in o]
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, float) and not np.isfinite(o):
        return None
    return o


# =========================================================================== main


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundles", nargs="+", required=True, help="bundle directories (epcc compile --target cuda -o)")
    ap.add_argument("--out", required=True, help="where rank 0 writes ep_bench.json")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    ap.add_argument("--tokens", type=int, help="tokens per rank (default: each bundle's plan)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernel-timeout", type=float, default=10.0, help="epcc: bound of every in-kernel wait, s")
    ap.add_argument("--child-timeout", type=float, default=150.0, help="epcc: bound of a bundle's whole run, s")
    ap.add_argument("--rebuild", action="store_true", help="run nvcc even where the build cache has the library")
    ap.add_argument("--no-flush", action="store_true", help="no L2 flush before each timed iteration")
    ap.add_argument("--strict", action="store_true",
                    help="exit 1 when any bundle or method failed (a check, a timeout, a build): for tests")
    ap.add_argument("--dry-run", action="store_true", help="CPU + gloo, no CUDA: exercise everything but the kernels")
    ap.add_argument("--rdma-transport", choices=("emulated", "nvshmem"),
                    default=os.environ.get("EPCC_RDMA_TRANSPORT", "emulated"),
                    help="epcc, bundles compiled with --rdma proxy: the transport of their RDMA steps (emulated: "
                         "the copy engine paced to the plan's link; nvshmem: put with signal at what NVSHMEM "
                         "reaches); default $EPCC_RDMA_TRANSPORT or emulated")
    ap.add_argument("--rdma-chunks", default=None, metavar="TxD[,TxD...]",
                    help="epcc, bundles compiled with --rdma proxy: run each once per RDMA chunking, T tokens per "
                         "chunk x D chunks in flight per channel (e.g. 32x16,64x8; T or D alone keeps the plan's "
                         "other one: 64x, x8), re-chunking the plan at run time (the layout, tables, rings and the "
                         "prediction follow; the kernels do not change); default: $EPCC_RDMA_CHUNK_TOKENS x "
                         "$EPCC_RDMA_DEPTH where set, else the plan's")
    ap.add_argument("--emulate-max-tokens", type=int, default=1024,
                    help="dry run: emulate the kernels only when ranks x tokens is at most this")
    args = ap.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        ap.error(f"--methods: unknown {bad}; choose from {list(METHODS)}")
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")
    try:
        args.rdma_chunks = rdma_chunkings(args.rdma_chunks, os.environ)
    except ValueError as e:  # bad input: the setting and its value, exit status 1
        print(f"ep_bench: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    return args


def rdma_chunkings(text: str | None, env) -> list[tuple[int | None, int | None]]:
    """--rdma-chunks (or $EPCC_RDMA_CHUNK_TOKENS / $EPCC_RDMA_DEPTH) as [(tokens, depth)], None
    where the plan's value stays; [] when neither is given (the plan's chunking only).  A bad
    value is a ValueError naming it."""
    if text is None:
        c, d = env.get(ENV_CHUNK_TOKENS, ""), env.get(ENV_DEPTH, "")
        if not c and not d:
            return []
        return [(positive_setting(ENV_CHUNK_TOKENS, c), positive_setting(ENV_DEPTH, d, MAX_DEPTH))]
    out = []
    for item in (t.strip() for t in text.split(",")):
        if item.count("x") != 1:
            raise ValueError(f"--rdma-chunks: {item!r} is not TOKENSxDEPTH (e.g. 64x8, 64x or x8)")
        c, d = item.split("x")
        one = (positive_setting(f"--rdma-chunks {item}: tokens", c),
               positive_setting(f"--rdma-chunks {item}: depth", d, MAX_DEPTH))
        if one == (None, None):
            raise ValueError(f"--rdma-chunks: {item!r} gives neither tokens nor depth")
        if one not in out:
            out.append(one)
    return out


def chunking_label(c: tuple[int | None, int | None]) -> str:
    return f"{c[0] or ''}x{c[1] or ''}"


def main(argv=None) -> int:
    args = parse(argv)
    t_start = time.perf_counter()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    shared, gpus = False, 0
    if args.dry_run:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=GLOO_TIMEOUT)
        cpu_group = dist.group.WORLD
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --dry-run", file=sys.stderr)
            return 2
        gpus = torch.cuda.device_count()
        # more ranks on this host than GPUs: rank r on GPU r mod #GPUs, kernels time-sliced (on
        # several hosts, torchrun's LOCAL_WORLD_SIZE is this host's ranks, not WORLD_SIZE)
        shared = int(os.environ.get("LOCAL_WORLD_SIZE", str(world))) > gpus
        dev = torch.device("cuda", local % gpus)
        torch.cuda.set_device(dev)
        if shared:
            dist.init_process_group("gloo", timeout=GLOO_TIMEOUT)
            cpu_group = dist.group.WORLD
        else:
            dist.init_process_group("nccl", timeout=PG_TIMEOUT, device_id=dev)
            cpu_group = dist.new_group(backend="gloo", timeout=GLOO_TIMEOUT)
    comm = Comm(args.dry_run, dev, cpu_group, shared)
    timer = Timer(comm, not args.no_flush)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    if _OVERRIDDEN:
        say(f"note: forced {_NO_MULTICAST} (the environment had {_OVERRIDDEN})")
    say(f"ep_bench: {world} ranks, {'dry run (CPU, gloo)' if args.dry_run else torch.cuda.get_device_name(dev)}, "
        f"torch {torch.__version__}, methods {args.methods}")
    if shared:
        dropped = [m for m in args.methods if m != "epcc"]
        args.methods = [m for m in args.methods if m == "epcc"]
        say(f"note: {world} ranks on {gpus} GPU(s): rank r on GPU r mod {gpus}, the kernels of one GPU's ranks "
            f"time-sliced by the driver: a correctness run (every result checked), its times are not the "
            f"plan's" + (f"; {', '.join(dropped)} not run (NCCL wants a GPU per rank)" if dropped else ""))

    libs: list = [(None, None)] * len(args.bundles)
    if "epcc" in args.methods:
        if args.dry_run:
            libs = [(None, None)] * len(args.bundles)
        else:
            t = time.perf_counter()
            libs = build_libs(args.bundles, args.rebuild) if rank == 0 else None
            libs = comm.all_gather_object(libs)[0]
            say(f"libraries ready in {time.perf_counter() - t:.1f} s: "
                + "; ".join(f"{Path(b).name}: {e or l}" for b, (l, e) in zip(args.bundles, libs)))

    report = {"args": vars(args), "world": world, "env": {k: os.environ.get(k) for k in _NO_MULTICAST},
              "device": None if args.dry_run else torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "shared_gpus": f"{world} ranks on {gpus} GPUs, time-sliced" if shared else None,
              "timing": "CUDA events per rank; iteration time = max over ranks; median and min over timed "
                        "iterations; GB/s = mean bytes per rank / median time" if not args.dry_run else
                        "dry run: wall clock on CPU (meaningless as performance)",
              "bundles": []}
    runs: list[tuple[int, str, tuple | None, object]] = []  # (bundle index, bundle, RDMA chunking, its load)
    for bi, bundle in enumerate(args.bundles):
        try:
            loaded: object = load_bundle(bundle)
        except Exception as e:  # noqa: BLE001
            loaded = f"cannot load: {type(e).__name__}: {e}"
        proxy = not isinstance(loaded, str) and loaded[1].get("options", {}).get("rdma") == "proxy"
        if args.rdma_chunks and not proxy and not isinstance(loaded, str):
            say(f"note: {Path(bundle).name} was not compiled with --rdma proxy: it runs once, at its own chunking")
        for c in (args.rdma_chunks if proxy and args.rdma_chunks else [None]):
            runs.append((bi, bundle, c, loaded))
    for ri, (bi, bundle, chunking, loaded) in enumerate(runs):
        first_of_bundle = ri == 0 or runs[ri - 1][0] != bi
        name = Path(bundle).name + (f"@{chunking_label(chunking)}" if chunking else "")
        entry: dict = {"name": name, "path": str(bundle), "methods": {}}
        report["bundles"].append(entry)
        if isinstance(loaded, str):
            entry["error"] = loaded
            say(f"{name}: {entry['error']}")
            continue
        plan, manifest = loaded
        if chunking:
            plan = rechunk(plan, chunking)  # checked by --rdma-chunks' parsing: cannot fail here
            entry["rdma_chunking"] = rdma_chunking_of(plan)
        sim = predict(plan, T=args.tokens or plan.workload.tokens) if chunking else load_prediction(bundle)
        if sim:
            entry["simulate"] = sim
        wl, R = plan.workload, plan.num_ranks
        T = args.tokens or wl.tokens
        entry["workload"] = {"ranks": R, "tokens": T, "hidden": wl.hidden, "dtype": wl.dtype, "topk": wl.topk,
                             "experts": wl.experts, "placement": wl.placement, "schedule": plan.schedule}
        if R != world:
            entry["error"] = f"the plan has {R} ranks, this run {world} processes"
            say(f"{name}: {entry['error']}")
            continue
        rb = inputs.row_bytes(wl.hidden, wl.dtype)
        idx, w = bench_routing(plan, T, args.seed)
        tr = traffic(idx, wl.experts, wl.placement, wl.hidden, rb, wl.dtype)
        entry["traffic_bytes"] = tr
        entry["row_bytes"] = rb
        say(f"[{time.perf_counter() - t_start:6.1f} s] {name}: {R} ranks x {T} tokens, hidden {wl.hidden} "
            f"{wl.dtype}, top-{wl.topk} of {wl.experts}")
        per_method: dict[str, list[dict]] = {}
        if "epcc" in args.methods:
            lib, err = libs[bi]
            res = run_epcc(comm, args, bundle, lib, err, T, chunking)
            per_method["epcc"] = comm.all_gather_object(res)
            say(f"[{time.perf_counter() - t_start:6.1f} s] {name}: epcc "
                + _status(per_method["epcc"]))
            for line in res.get("rdma", []):  # the GPU proxy path: which transport, what rings
                say(f"    rdma {line}")
            for p, st in (res.get("rdma_stats") or {}).items():  # and what the proxy thread cost
                say(f"    rdma {p} proxy: {proxy_cost(st)}")
        base = [m for m in args.methods if m != "epcc"] if first_of_bundle else []  # once per bundle
        if base:
            res = bench_baselines(comm, timer, args, plan, T, idx, w, base)
            for m in base:
                per_method[m] = comm.all_gather_object(res[m])
                say(f"[{time.perf_counter() - t_start:6.1f} s] {name}: {m} " + _status(per_method[m]))
            if not args.dry_run:
                torch.cuda.empty_cache()
        for m, per_rank in per_method.items():
            errs = [(r, x["error"]) for r, x in enumerate(per_rank) if x.get("error")]
            rec: dict = {"per_rank": per_rank}
            first = per_rank[0]
            if "sms" in first:
                rec["sms"] = first["sms"]
            hosts = [x.get("host_ms", {}).get("layout_upload") for x in per_rank]
            if all(h is not None for h in hosts):
                rec["host_ms_max"] = max(hosts)
            if errs:
                # the first rank's own message; "a peer failed" ones only if nothing better
                rec["error"] = _first_error(errs)
            elif any("skipped" in x for x in per_rank):
                rec["skipped"] = first.get("skipped", "skipped")
            else:
                wire = wire_for(m, tr, rb, wl.topk, first.get("wire_bytes"))
                rec["summary"] = summarize(per_rank, tr, wire)
                rec["check"] = [x.get("check") for x in per_rank]
            entry["methods"][m] = rec

    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report["wall_s"] = time.perf_counter() - t_start
        (out / "ep_bench.json").write_text(json.dumps(jsonable(report), indent=1), encoding="utf-8")
        print(f"\nwrote {out / 'ep_bench.json'} ({report['wall_s']:.0f} s)")
        print("GB/s per GPU: dedup = remote bytes, a token once per other rank holding one of its experts "
              "(the minimum any method moves); wire = remote bytes the method actually moves; DeepEP = "
              "recv tokens incl. self x hidden x 2 (fp8 x (1+4/128)/2)")
        if report.get("shared_gpus"):
            print(f"{report['shared_gpus']}: the times below are a correctness run's, not the plan's")
        print(format_table(report))
        for line in format_predictions(report):
            print(line)
    comm.barrier()
    failed = [f"{b['name']}: {b['error']}" for b in report["bundles"] if "error" in b]
    failed += [f"{b['name']} {m}: {r['error']}" for b in report["bundles"] for m, r in b.get("methods", {}).items()
               if "error" in r]
    status = 1 if args.strict and failed else 0
    if status:
        say(f"--strict: {len(failed)} failed: " + "; ".join(failed))
    if args.dry_run:
        dist.destroy_process_group()
        return status
    sys.stdout.flush()
    os._exit(status)  # skip NCCL teardown: nothing left to do, and it can hang after a peer's failure


def proxy_cost(st: dict) -> str:
    """This rank's proxy thread over the whole run (warm-up, timed and stamped rounds): writes
    posted, host time per post call, and chunks found waiting per FIFO pass (above 1: the kernels
    pushed chunks faster than the thread posted them, so the proxy set the pace)."""
    cost = cost_phrase(st)
    return f"{st.get('writes_posted', 0)} writes" + (f", {cost}" if cost else "")


def _first_error(errs: list[tuple[int, str]]) -> str:
    """The most telling of the ranks' messages: a rank's own failure before 'a peer failed'; a
    check failure already names its rank."""
    r, msg = ([e for e in errs if not e[1].startswith("a peer failed")] or errs)[0]
    return msg if msg.startswith("WRONG") else f"rank {r}: {msg}"


def _status(per_rank: list[dict]) -> str:
    errs = [(r, x["error"]) for r, x in enumerate(per_rank) if x.get("error")]
    if errs:
        return f"failed: {_first_error(errs)}"
    if any("skipped" in x for x in per_rank):
        return per_rank[0].get("skipped", "skipped")
    d = statistics.median(max(v) for v in zip(*[x["dispatch_ms"] for x in per_rank]))
    c = statistics.median(max(v) for v in zip(*[x["combine_ms"] for x in per_rank]))
    return f"ok: dispatch {d:.3f} ms, combine {c:.3f} ms (median)"


if __name__ == "__main__":
    sys.exit(main())
