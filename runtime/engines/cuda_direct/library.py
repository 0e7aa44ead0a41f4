"""Host side of the direct kernels (backends/cuda/direct.py, include/epcc/direct/): build, load, launch.

No torch and no MLIR here (numpy only): device pointers are ints, streams are `cudaStream_t` values
as ints.  The torch-facing API is `epcc.runtime.Buffer(..., backend="cuda")` (engine.py).

Libraries are compiled with nvcc on the GPU machine, through the build cache
(runtime/build_cache.py: by the source text, the nvcc command and nvcc's version), so concurrent
ranks never load a half-written file and a bundle compiles once per machine.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from ...build_cache import cached, compiler_version, find_nvcc, key, run
from ..base import EngineError

IPC_HANDLE_BYTES = 64


class DirectRuntimeError(EngineError):
    pass


def build(cuda_dir: str | Path, manifest: dict, nvcc: str | None = None, extra_flags: tuple[str, ...] = (),
          log: list[str] | None = None) -> Path:
    """The direct library of a bundle's cuda/ directory, from the build cache or freshly compiled."""
    entry = manifest.get("direct")
    if not entry:
        raise DirectRuntimeError(f"{cuda_dir}: this bundle has no direct lowering "
                                 f"({manifest.get('direct_not_used', 'not a one-hop plan')})")
    exe = find_nvcc(nvcc)
    if exe is None:
        raise DirectRuntimeError("nvcc not found (set $NVCC or put it on PATH); the direct kernels are compiled "
                                 "on the GPU machine")
    names = [entry["source"], *entry.get("headers", [])]  # the source, then the headers it includes
    bad = [n for n in names if not isinstance(n, str) or Path(n).is_absolute() or ".." in Path(n).parts]
    if bad:
        raise DirectRuntimeError(f"{cuda_dir}: the manifest names files outside the bundle: {bad}")
    texts = {n: (Path(cuda_dir) / n).read_bytes() for n in names}
    cmd = [exe, *entry["command"][1:]]
    cmd[1:1] = list(extra_flags)

    def compile_into(out: Path, work: Path) -> None:
        for n, data in texts.items():
            (work / n).parent.mkdir(parents=True, exist_ok=True)
            (work / n).write_bytes(data)
        full = list(cmd)
        full[full.index("-o") + 1] = str(out)
        full[-1] = str(work / entry["source"])
        run(full, "nvcc", cwd=work, log=log)

    parts = [n.encode() + b"\0" + data for n, data in texts.items()]
    return cached("cuda", key(*parts, "\0".join(cmd[1:]), compiler_version(exe)), entry["library"], compile_into)


def args_struct(num_ranks: int) -> type[ctypes.Structure]:
    """The kernels' `Args` (all 64-bit fields, no padding), for `num_ranks` ranks."""
    u, i = ctypes.c_uint64, ctypes.c_int64

    class Args(ctypes.Structure):
        _fields_ = [("base", u * num_ranks), ("me", i), ("T", i), ("C", i), ("NR", i), ("W", i), ("align", i),
                    ("timeout_ns", u), ("err", u), ("x", u), ("scales", u), ("topk_idx", u), ("topk_w", u),
                    ("idx_int32", i), ("has_weights", i), ("y", u), ("out", u), ("NS", i), ("ND", i),
                    ("timeline", u), ("NSB", i), ("cached", i)]

    return Args


def timeline_summary(raw, cfg, blocks: int, words: int) -> dict:
    """The direct kernels' role timeline from their %globaltimer stamps (`raw`: the flat
    [2][blocks][words] u64 buffer after one stamped dispatch + combine; `cfg`: the DirectConfig
    they ran with), in role_timeline's shape: per kernel and role, ms from the kernel's first block
    start to the role's first block start, its median and its last warp end.  A warp's end is
    the end of all its work (a sender's includes the replication it did after sending).  Roles
    with no blocks (no dedicated replicators or home reducers: the default) are left out.  Stamps
    that are 0 were never written (a block or warp that did not run)."""
    st = np.asarray(raw, dtype=np.int64).reshape(2, blocks, words)
    roles = {"dispatch": (("send+replicate", cfg.send_blocks), ("replicate", cfg.recv_blocks), cfg.warps),
             "combine": (("partial+sum", cfg.combine_send_blocks), ("sum", cfg.combine_reduce_blocks), words - 1)}
    out = {}
    for k, (prog, (first, second, nwarps)) in enumerate(roles.items()):
        starts = st[k, :, 0]
        t0 = int(starts[starts > 0].min()) if (starts > 0).any() else 0
        rows, b0 = [], 0
        for name, nb in (first, second):
            if nb == 0:
                continue
            blk = st[k, b0:min(b0 + nb, blocks)]
            b0 += nb
            s0 = blk[:, 0][blk[:, 0] > 0]
            ends = np.sort(blk[:, 1:1 + nwarps][blk[:, 1:1 + nwarps] > 0])
            rows.append({"step": name, "start_ms": (int(s0.min()) - t0) / 1e6 if s0.size else None,
                         "median_end_ms": (int(ends[ends.size // 2]) - t0) / 1e6 if ends.size else None,
                         "end_ms": (int(ends[-1]) - t0) / 1e6 if ends.size else None})
        out[prog] = {"roles": rows, "end_ms": max((r["end_ms"] for r in rows if r["end_ms"] is not None), default=0.0)}
    return out


class ErrorRecord(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int32), ("rank", ctypes.c_int32), ("where", ctypes.c_int32),
                ("a", ctypes.c_int32), ("b", ctypes.c_int32), ("pad", ctypes.c_int32),
                ("value", ctypes.c_uint64), ("target", ctypes.c_uint64), ("waited_ns", ctypes.c_uint64)]


class DirectLibrary:
    """ctypes view of one compiled direct library."""

    def __init__(self, path: str | Path, manifest: dict):
        self.path = Path(path)
        self.entry = manifest["direct"]
        self.const = self.entry["constants"]
        self.lib = ctypes.CDLL(str(self.path))
        L = self.lib
        u64p = ctypes.POINTER(ctypes.c_uint64)
        for name, argtypes, restype in [
            ("epcc_direct_last_error", [], ctypes.c_char_p),
            ("epcc_direct_abi", [], ctypes.c_int),
            ("epcc_direct_region_bytes", [], ctypes.c_uint64),
            ("epcc_direct_args_bytes", [], ctypes.c_int),
            ("epcc_direct_state_layout", [ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
            ("epcc_direct_malloc", [ctypes.c_uint64, u64p], ctypes.c_int),
            ("epcc_direct_free", [ctypes.c_uint64], ctypes.c_int),
            ("epcc_direct_ipc_handle", [ctypes.c_uint64, ctypes.c_void_p], ctypes.c_int),
            ("epcc_direct_ipc_open", [ctypes.c_void_p, u64p], ctypes.c_int),
            ("epcc_direct_ipc_close", [ctypes.c_uint64], ctypes.c_int),
            ("epcc_direct_host_error_record", [u64p, u64p], ctypes.c_int),
            ("epcc_direct_free_host", [ctypes.c_uint64], ctypes.c_int),
            ("epcc_direct_init", [ctypes.c_int], ctypes.c_int),
            ("epcc_direct_prepare", [], ctypes.c_int),
            ("epcc_direct_dispatch", [ctypes.c_void_p, ctypes.c_uint64], ctypes.c_int),
            ("epcc_direct_combine", [ctypes.c_void_p, ctypes.c_uint64], ctypes.c_int),
        ]:
            fn = getattr(L, name)
            fn.argtypes, fn.restype = argtypes, restype
        if L.epcc_direct_abi() != self.entry["abi"]:
            raise DirectRuntimeError(f"{self.path}: ABI {L.epcc_direct_abi()}, the manifest wants {self.entry['abi']}")
        self.Args = args_struct(self.const["num_ranks"])
        if L.epcc_direct_args_bytes() != ctypes.sizeof(self.Args):
            raise DirectRuntimeError(f"{self.path}: Args is {L.epcc_direct_args_bytes()} bytes, "
                                     f"ctypes has {ctypes.sizeof(self.Args)}")
        lay = (ctypes.c_int * 8)()
        L.epcc_direct_state_layout(lay)
        self.state_offsets = {"disp_epoch": lay[0], "comb_epoch": lay[1], "bad_token": lay[2],
                              "recv_count": lay[3], "recv_offset": lay[4], "last_T": lay[6], "src_offset": lay[7]}
        self.region_bytes = int(L.epcc_direct_region_bytes())
        if self.region_bytes != self.const["region_bytes"]:
            raise DirectRuntimeError(f"{self.path}: region of {self.region_bytes} bytes, manifest "
                                     f"{self.const['region_bytes']}")

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise DirectRuntimeError(f"{what}: {self.lib.epcc_direct_last_error().decode(errors='replace')}")

    def malloc(self, nbytes: int) -> int:
        out = ctypes.c_uint64()
        self.check(self.lib.epcc_direct_malloc(nbytes, ctypes.byref(out)), f"allocating {nbytes} bytes")
        return out.value

    def free(self, ptr: int) -> None:
        self.check(self.lib.epcc_direct_free(ptr), "free")

    def ipc_handle(self, ptr: int) -> bytes:
        buf = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
        self.check(self.lib.epcc_direct_ipc_handle(ptr, buf), "IPC handle")
        return buf.raw

    def ipc_open(self, handle: bytes) -> int:
        out = ctypes.c_uint64()
        buf = ctypes.create_string_buffer(handle, IPC_HANDLE_BYTES)
        self.check(self.lib.epcc_direct_ipc_open(buf, ctypes.byref(out)), "opening a peer's IPC handle")
        return out.value

    def ipc_close(self, ptr: int) -> None:
        self.check(self.lib.epcc_direct_ipc_close(ptr), "closing a peer mapping")

    def error_record(self) -> tuple[int, int]:
        host, dev = ctypes.c_uint64(), ctypes.c_uint64()
        self.check(self.lib.epcc_direct_host_error_record(ctypes.byref(host), ctypes.byref(dev)), "error record")
        return host.value, dev.value

    def free_host(self, ptr: int) -> None:
        self.check(self.lib.epcc_direct_free_host(ptr), "freeing the error record")

    def init(self, warps: int) -> None:
        self.check(self.lib.epcc_direct_init(warps), "init")

    def prepare(self) -> None:
        """On the device the kernels run on, before the first launch (the combine's shared memory)."""
        self.check(self.lib.epcc_direct_prepare(), "prepare")

    def dispatch(self, args, stream: int) -> None:
        self.check(self.lib.epcc_direct_dispatch(ctypes.byref(args), stream), "dispatch")

    def combine(self, args, stream: int) -> None:
        self.check(self.lib.epcc_direct_combine(ctypes.byref(args), stream), "combine")

    def read_error(self, host_ptr: int, rank_names: list[str] | None = None) -> str | None:
        """The kernel's timeout report in words, or None when no kernel gave up."""
        rec = ErrorRecord.from_address(host_ptr)
        if rec.code == 0:
            return None
        waits = self.entry["waits"]
        what = waits[rec.where - 1] if 1 <= rec.where <= len(waits) else f"wait {rec.where}"
        who = rank_names[rec.rank] if rank_names and 0 <= rec.rank < len(rank_names) else f"rank {rec.rank}"
        what = what.replace("rank a", f"rank {rec.a}").replace("channel b", f"channel {rec.b}") \
                   .replace("channel a", f"channel {rec.a}").replace("queue a", f"queue {rec.a}")
        return (f"epcc: wait timed out after {rec.waited_ns * 1e-9:.3f} s: {who}: {what} "
                f"(value 0x{rec.value:x}, waiting for >= 0x{rec.target:x})")
