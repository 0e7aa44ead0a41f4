"""Python side of the generated host launcher (`<schedule>_launcher.cu`): build it, load it
with ctypes, call it.  No torch needed; device pointers are plain ints (a torch tensor's
`data_ptr()` works too), streams are `cudaStream_t` values as ints (0: the default stream,
`torch.cuda.current_stream().cuda_stream` under torch).

The SUPA target's launcher (`<schedule>_launcher.su`, backends/supa) has the same C ABI under the
prefix `epcc_supa_`: `Library(path, prefix="epcc_supa")` calls it through the same methods, and
`build_shim_library` builds a SUPA bundle with nvcc through the SUPA-on-CUDA shim.
"""

from __future__ import annotations

import ctypes
import statistics
from pathlib import Path

import numpy as np

from epcc.limits import timeout_seconds

from ....plan.bundle import MANIFEST_FILE, read_manifest
from ...build_cache import cached, compiler_version, find_nvcc, key, run
from ..base import EngineError, KernelTimeout
from .tables import PROGRAMS, Tables

RC_OK, RC_CUDA, RC_USAGE, RC_TABLES, RC_KERNEL = 0, 1, 2, 3, 4
IPC_HANDLE_BYTES = 64
ERROR_MESSAGE_BYTES = 512


TIMELINE_WORDS = 4  # epcc::kTimelineWords: entry barrier passed, first item started, role done, drain done


# A proxy-path step's two roles in a timeline: its step's name with the side (the manifest role's
# `lowered`) after it; role_step gives the step back.
ROLE_SIDES = {"rdma-pack": " (pack)", "rdma-unpack": " (unpack)"}


def role_step(name: str) -> str:
    """The plan step of a timeline role's name (role_timeline's `step`): the name less its side."""
    for side in ROLE_SIDES.values():
        if name.endswith(side):
            return name[:-len(side)]
    return name


def role_timeline(manifest: dict, program: str, stamps: np.ndarray) -> dict:
    """Per role of `program`'s kernel, from one launch's stamps (Context.read_timeline): when its
    first block started moving rows and when its last block finished, in ms after the entry
    barrier (the earliest block past it); plus the kernel's end on this rank (drain done)."""
    kernel = next(k for k in manifest["kernels"] if k["program"] == program and k["kind"] == "main")
    stamps = np.asarray(stamps, dtype=np.uint64)
    if stamps.shape != (kernel["grid"], TIMELINE_WORDS):
        raise ValueError(f"{program} timeline: shape {stamps.shape}, the kernel has {kernel['grid']} blocks "
                         f"x {TIMELINE_WORDS} stamps")
    t0 = int(stamps[:, 0].min())
    ms = lambda v: (int(v) - t0) / 1e6  # noqa: E731
    roles = []
    for r in kernel["roles"]:
        b0, b1 = r["blocks"]
        started = [v for v in stamps[b0:b1, 1] if v]
        roles.append({"step": r["step"] + ROLE_SIDES.get(r.get("lowered"), ""), "blocks": b1 - b0,
                      "start_ms": ms(min(started)) if started else None,
                      "end_ms": ms(stamps[b0:b1, 2].max()) if started else None})
    return {"roles": roles, "end_ms": ms(stamps[0, 3])}


def median_timeline(rounds: list[dict]) -> dict:
    """Several launches' role_timeline as one: each role's start and end, and the kernel's end,
    the median over the launches (a single launch's proxy-path roles vary by ~10 % with the host
    threads' scheduling)."""
    if not rounds:
        raise ValueError("median_timeline: no launches")

    def med(vals: list) -> float | None:
        vals = sorted(v for v in vals if v is not None)
        return statistics.median(vals) if vals else None

    roles = []
    for i, r in enumerate(rounds[0]["roles"]):
        roles.append({**r, "start_ms": med([x["roles"][i]["start_ms"] for x in rounds]),
                      "end_ms": med([x["roles"][i]["end_ms"] for x in rounds])})
    return {"roles": roles, "end_ms": med([x["end_ms"] for x in rounds]), "launches": len(rounds)}


class CudaError(EngineError):
    """A launcher call failed; `rc` is its EPCC_RC_* code, the message the launcher's.  A kernel
    that gave up waiting (or found bad tables) raises KernelTimeout (base.py) instead."""

    def __init__(self, rc: int, message: str):
        super().__init__(message)
        self.rc = rc


def load_manifest(cuda_dir: str | Path) -> dict:
    """The CUDA manifest of a bundle's cuda/ directory."""
    return read_manifest(Path(cuda_dir) / MANIFEST_FILE)


def build_library(cuda_dir: str | Path, nvcc: str | None = None, extra_flags: tuple[str, ...] = (),
                  log: list[str] | None = None, fresh: bool = False) -> Path:
    """The shared library the manifest names, compiled from the bundle's sources with the
    manifest's nvcc command (plus `extra_flags`, e.g. ("-Xptxas", "-v")) into the build cache
    (runtime/build_cache.py: compiled again only when a source, the command or nvcc changes, or
    when `fresh`).  nvcc's output is appended to `log`."""
    cuda_dir = Path(cuda_dir).resolve()
    build = load_manifest(cuda_dir)["build"]
    return _build(cuda_dir, build, build["command"], build["library"], "cuda", nvcc, extra_flags, log, fresh)


def build_shim_library(supa_dir: str | Path, manifest: dict, nvcc: str | None = None,
                       extra_flags: tuple[str, ...] = (), log: list[str] | None = None, fresh: bool = False) -> Path:
    """A SUPA bundle's library built by nvcc through the SUPA-on-CUDA shim: the command of its
    manifest's build.shim (`manifest`: the bundle's checked supa/manifest.json), cached as
    build_library's."""
    build = manifest["build"]
    return _build(Path(supa_dir).resolve(), build, build["shim"]["command"], build["shim"]["library"], "supa-shim",
                  nvcc, extra_flags, log, fresh)


def _build(src_dir: Path, build: dict, command: list[str], library: str, kind: str, nvcc: str | None,
           extra_flags: tuple[str, ...], log: list[str] | None, fresh: bool) -> Path:
    exe = find_nvcc(nvcc)
    if exe is None:
        raise FileNotFoundError("nvcc not found (set $NVCC or put it on PATH)")
    cmd = list(command)
    cmd[0] = exe
    cmd[1:1] = list(extra_flags)
    sources = [(src_dir / s).read_bytes() for s in [*build["sources"], *build.get("headers", [])]]

    def compile_into(out: Path, work: Path) -> None:
        full = list(cmd)
        full[full.index("-o") + 1] = str(out)
        run(full, "nvcc", cwd=src_dir, log=log)

    entry = key(*sources, "\0".join(cmd[1:]), compiler_version(exe))
    return cached(kind, entry, library, compile_into, fresh=fresh)


def _program(program: str | int) -> int:
    if isinstance(program, int):
        return program
    return PROGRAMS.index(program)


class _Abi:
    """A launcher library's functions under the CUDA launcher's names: `epcc_cuda_X` is the
    library's `<prefix>_X` (the SUPA launcher exports the same C ABI as `epcc_supa_X`); every
    other name (the metadata driver's epcc_table_meta*) is the library's own."""

    def __init__(self, lib: ctypes.CDLL, prefix: str):
        self._lib, self._prefix = lib, prefix

    def __getattr__(self, name: str):  # once per name: the function is kept as an attribute
        own = self._prefix + name[len(ABI_PREFIX):] if name.startswith(ABI_PREFIX + "_") else name
        f = getattr(self._lib, own)
        setattr(self, name, f)
        return f


ABI_PREFIX = "epcc_cuda"


class Library:
    """The loaded launcher library of one bundle (`prefix`: its exported functions' prefix,
    backends/target.py abi_prefix)."""

    def __init__(self, path: str | Path, prefix: str = ABI_PREFIX):
        self.path = Path(path)
        self.prefix = prefix
        self.lib = lib = _Abi(ctypes.CDLL(str(self.path)), prefix)
        u64, i32, u32, vp, p64 = ctypes.c_uint64, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(
            ctypes.c_uint64)
        sigs = {
            "epcc_cuda_abi_version": ([], i32),
            "epcc_cuda_schedule": ([], ctypes.c_char_p),
            "epcc_cuda_num_ranks": ([], i32),
            "epcc_cuda_num_buffers": ([i32], i32),
            "epcc_cuda_has_program": ([i32], i32),
            "epcc_cuda_grid": ([i32], i32),
            "epcc_cuda_enable_timeline": ([vp, i32], i32),
            "epcc_cuda_read_timeline": ([vp, i32, p64, u64], i32),
            "epcc_cuda_last_error": ([vp], ctypes.c_char_p),
            "epcc_cuda_malloc": ([i32, u64, p64], i32),
            "epcc_cuda_free": ([u64], i32),
            "epcc_cuda_ipc_handle": ([u64, vp], i32),
            "epcc_cuda_ipc_open": ([i32, vp, p64], i32),
            "epcc_cuda_ipc_close": ([u64], i32),
            "epcc_cuda_copy_to_device": ([u64, vp, u64], i32),
            "epcc_cuda_copy_to_host": ([vp, u64, u64], i32),
            "epcc_cuda_create": ([i32, i32, u32, ctypes.c_double, ctypes.POINTER(vp)], i32),
            "epcc_cuda_destroy": ([vp], None),
            "epcc_cuda_flag_area": ([vp], u64),
            "epcc_cuda_flag_capacity": ([vp], u32),
            "epcc_cuda_set_flag_areas": ([vp, p64], i32),
            "epcc_cuda_set_buffers": ([vp, i32, p64, u32, u64], i32),
            "epcc_cuda_set_rdma": ([vp, i32, u64, u64], i32),
            "epcc_cuda_upload_tables": ([vp, i32, vp, u64, u64], i32),
            "epcc_cuda_launch_dispatch": ([vp, u64], i32),
            "epcc_cuda_launch_combine": ([vp, u64, u64], i32),
            "epcc_cuda_launch_combine_tokens": ([vp, u64, u64, u64], i32),
            "epcc_cuda_use_tables": ([vp, i32, u64, ctypes.c_char_p, u64], i32),
            "epcc_cuda_epoch": ([vp, i32], u64),
            "epcc_cuda_synchronize": ([vp, u64], i32),
            "epcc_cuda_read_error": ([vp, ctypes.c_char_p, u64], i32),
        }
        for name, (args, res) in sigs.items():
            f = getattr(lib, name)
            f.argtypes = args
            f.restype = res
        # each program reading the caller's rows (a library of an older epcc has no such entry):
        # per program, whether it has the entry point
        self.has_caller_rows: dict[str, bool] = {}
        for program, name, args in (("dispatch", "epcc_cuda_launch_dispatch_rows", [vp, u64, u64]),
                                    ("combine", "epcc_cuda_launch_combine_rows", [vp, u64, u64, u64, u64])):
            f = getattr(lib, name, None)
            if f is not None:
                f.argtypes, f.restype = args, i32
            self.has_caller_rows[program] = f is not None
        # the combine kernel converting its rows itself (manifest combine_output "in-kernel") counts
        # each row's contributions first; a library of another target or an older epcc has no entry
        f = getattr(lib, "epcc_cuda_combine_prepare", None)
        if f is not None:
            f.argtypes, f.restype = [vp, u64], i32
        self.has_combine_prepare = f is not None

    # ------------------------------------------------------------------ about the build
    @property
    def abi_version(self) -> int:
        return self.lib.epcc_cuda_abi_version()

    @property
    def schedule(self) -> str:
        return self.lib.epcc_cuda_schedule().decode()

    @property
    def num_ranks(self) -> int:
        return self.lib.epcc_cuda_num_ranks()

    def num_buffers(self, program: str | int) -> int:
        return self.lib.epcc_cuda_num_buffers(_program(program))

    def has_program(self, program: str | int) -> bool:
        return bool(self.lib.epcc_cuda_has_program(_program(program)))

    def _check(self, rc: int, ctx=None) -> None:
        if rc != RC_OK:
            msg = (self.lib.epcc_cuda_last_error(ctx) or b"").decode(errors="replace")
            raise KernelTimeout(msg, rc) if rc == RC_KERNEL else CudaError(rc, msg)

    # ------------------------------------------------------------------ memory and IPC
    def malloc(self, device: int, nbytes: int) -> int:
        out = ctypes.c_uint64()
        self._check(self.lib.epcc_cuda_malloc(device, nbytes, ctypes.byref(out)))
        return out.value

    def free(self, ptr: int) -> None:
        self._check(self.lib.epcc_cuda_free(ptr))

    def ipc_handle(self, ptr: int) -> bytes:
        buf = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
        self._check(self.lib.epcc_cuda_ipc_handle(ptr, buf))
        return buf.raw

    def ipc_open(self, device: int, handle: bytes) -> int:
        if len(handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"an IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        out = ctypes.c_uint64()
        self._check(self.lib.epcc_cuda_ipc_open(device, ctypes.create_string_buffer(handle, IPC_HANDLE_BYTES),
                                                ctypes.byref(out)))
        return out.value

    def ipc_close(self, ptr: int) -> None:
        self._check(self.lib.epcc_cuda_ipc_close(ptr))

    def copy_to_device(self, dst: int, src: np.ndarray) -> None:
        a = np.ascontiguousarray(src)
        self._check(self.lib.epcc_cuda_copy_to_device(dst, a.ctypes.data, a.nbytes))

    def copy_to_host(self, dst: np.ndarray, src: int) -> np.ndarray:
        if not dst.flags.c_contiguous:
            raise ValueError("copy_to_host: dst must be C-contiguous")
        self._check(self.lib.epcc_cuda_copy_to_host(dst.ctypes.data, src, dst.nbytes))
        return dst

    # ------------------------------------------------------------------ contexts
    def create(self, device: int, rank: int, flag_capacity: int, timeout_s: float = 30.0) -> "Context":
        """A context for this rank on `device`; flag_capacity >= 1 + 2 x the flags of the largest
        layout (per program region: the barrier word, then two banks)."""
        timeout_s = timeout_seconds(timeout_s, "create")
        p = ctypes.c_void_p()
        rc = self.lib.epcc_cuda_create(device, rank, flag_capacity, timeout_s, ctypes.byref(p))
        if rc != RC_OK:
            msg = (self.lib.epcc_cuda_last_error(p if p.value else None) or b"").decode(errors="replace")
            if p.value:
                self.lib.epcc_cuda_destroy(p)
            raise CudaError(rc, msg)
        return Context(self, p)


class Context:
    """One rank's state: flag area, tables and buffer pointers per program, epochs, error record."""

    def __init__(self, library: Library, handle: ctypes.c_void_p):
        self.library = library
        self.lib = library.lib
        self.handle = handle

    def _check(self, rc: int) -> None:
        self.library._check(rc, self.handle)

    @property
    def flag_area(self) -> int:
        return int(self.lib.epcc_cuda_flag_area(self.handle))

    @property
    def flag_capacity(self) -> int:
        return int(self.lib.epcc_cuda_flag_capacity(self.handle))

    def set_flag_areas(self, areas: list[int]) -> None:
        a = (ctypes.c_uint64 * len(areas))(*areas)
        self._check(self.lib.epcc_cuda_set_flag_areas(self.handle, a))

    def set_buffers(self, program: str | int, ptrs, stream: int = 0) -> None:
        """ptrs[b][r]: buffer b (manifest order) of rank r, as mapped in this process (0: unused).
        Ordered on `stream` after the launches before it there."""
        a = np.ascontiguousarray(np.asarray(ptrs, dtype=np.uint64).reshape(-1))
        self._check(self.lib.epcc_cuda_set_buffers(self.handle, _program(program),
                                                   a.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64)), a.size,
                                                   stream))

    def set_rdma(self, program: str | int, chans: int, seq: int) -> None:
        """GPU proxy path (rdma="proxy"): device pointers of the RdmaChan descriptors (one per copy of
        the uploaded tables) and of the items' sequence numbers; runtime/engines/gpu_proxy builds them."""
        self._check(self.lib.epcc_cuda_set_rdma(self.handle, _program(program), chans, seq))

    def upload_tables(self, program: str | int, tables: Tables | np.ndarray, stream: int = 0) -> None:
        """A blob from build_tables (checked against the compiled kernels), ordered on `stream`."""
        blob = np.ascontiguousarray(tables.blob if isinstance(tables, Tables) else tables, dtype=np.uint8)
        self._check(self.lib.epcc_cuda_upload_tables(self.handle, _program(program), blob.ctypes.data, blob.nbytes,
                                                     stream))

    def launch_dispatch(self, stream: int = 0, rows: int = 0) -> None:
        """The dispatch kernel on `stream`; `rows`: the caller's tokens, which the kernel reads in place
        of the dispatch's input buffer (0: that buffer; only where the manifest's dispatch_input
        allows it: Library.has_caller_rows)."""
        if rows:
            self._check(self.lib.epcc_cuda_launch_dispatch_rows(self.handle, rows, stream))
        else:
            self._check(self.lib.epcc_cuda_launch_dispatch(self.handle, stream))

    def use_tables(self, program: str | int, tables: int, header: bytes, nbytes: int) -> None:
        """Tables the GPU writes itself at device address `tables` (runtime/engines/cuda_table/meta.py),
        `header` their static header: every later launch of `program` reads them there."""
        self._check(self.lib.epcc_cuda_use_tables(self.handle, _program(program), tables, header, nbytes))

    def launch_combine_tokens(self, out: int, tokens: int, stream: int = 0, rows: int = 0) -> None:
        """launch_combine, into the first `tokens` rows of `out` (tables the GPU wrote); `rows`: the
        caller's expert rows, which the kernel reads in place of the combine's input buffer (0: that
        buffer; only where the manifest's combine_input allows it: Library.has_caller_rows)."""
        if rows:
            self._check(self.lib.epcc_cuda_launch_combine_rows(self.handle, out, tokens, rows, stream))
        else:
            self._check(self.lib.epcc_cuda_launch_combine_tokens(self.handle, out, tokens, stream))

    def combine_prepare(self, stream: int = 0) -> None:
        """What the next combine launch needs from the tables as they are when `stream` gets here,
        counted ahead of it (beside a dispatch kernel; stream order must bring the combine after
        it): each row's contributions, where the combine kernel converts its rows itself.  Nothing
        elsewhere.  A combine launch with nothing prepared since the last one counts them itself."""
        if self.library.has_combine_prepare:
            self._check(self.lib.epcc_cuda_combine_prepare(self.handle, stream))

    def launch_combine(self, out: int = 0, stream: int = 0) -> None:
        self._check(self.lib.epcc_cuda_launch_combine(self.handle, out, stream))

    def epoch(self, program: str | int) -> int:
        return int(self.lib.epcc_cuda_epoch(self.handle, _program(program)))

    def synchronize(self, stream: int = 0) -> None:
        self._check(self.lib.epcc_cuda_synchronize(self.handle, stream))

    def enable_timeline(self, program: str | int) -> None:
        """Every later launch of `program` stamps %globaltimer per block (read_timeline)."""
        self._check(self.lib.epcc_cuda_enable_timeline(self.handle, _program(program)))

    def read_timeline(self, program: str | int) -> np.ndarray:
        """The stamps of the last launch (synchronize first): uint64 [grid, TIMELINE_WORDS], ns."""
        grid = int(self.lib.epcc_cuda_grid(_program(program)))
        out = np.zeros((max(grid, 0), TIMELINE_WORDS), dtype=np.uint64)
        ptr = out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64))
        self._check(self.lib.epcc_cuda_read_timeline(self.handle, _program(program), ptr, out.size))
        return out

    def read_error(self) -> tuple[int, str]:
        buf = ctypes.create_string_buffer(ERROR_MESSAGE_BYTES)
        code = self.lib.epcc_cuda_read_error(self.handle, buf, ERROR_MESSAGE_BYTES)
        return code, buf.value.decode(errors="replace")

    def close(self) -> None:
        if self.handle is not None and self.handle.value:
            self.lib.epcc_cuda_destroy(self.handle)
        self.handle = None

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
