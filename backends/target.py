"""What the table-driven kernels assume about the machine, per target: one description each.

The generator (cuda/codegen.py) is written once; every place where CUDA and SUPA differ is a field
here, read in Python (block sizes, what may be lowered, which files and commands a bundle has) or
handed to the templates (names of the host runtime, which code path a kernel takes).  Names of the
device language that differ (thread indices, system-scope atomics, the timer, bf16 conversions,
read-only loads) live in the target's device prelude (`prelude`, a static header the generated
device header includes first); the kernels use only the prelude's names there.

Facts about SUPA and their sources: docs/supa.md (a name marked UNVERIFIED there is one no public
source shows; the fields below that rest on one say so).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

_HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Target:
    name: str  # cuda | supa: the bundle's subdirectory and `epcc compile --target`
    vendor: str
    language: str  # how comments name the sources
    # ---- files
    source_suffix: str  # kernels and host launcher
    device_header: str  # the generated device header every source includes
    prelude: str  # the static prelude (relative to include_dir and to the bundle's directory)
    include_dir: Path  # where the target's static headers lie
    abi_prefix: str  # the launcher's exported C functions: <abi_prefix>_create, ...
    # ---- the machine
    warp_size: int  # lanes of a warp: kernels are generated for this width (the SUPA launcher checks the device's)
    max_block_threads: int
    shared_bytes_per_block: int  # static shared memory one block may use
    blocks_per_cu: int  # blocks of a persistent kernel resident on one compute unit (SM / CU)
    vector_bytes: int  # the widest access the row operations use
    residency: str  # cooperative: the runtime guarantees every block resident; assumed: grid <= CUs x blocks_per_cu
    atomics: str  # how waits and counters are ordered (text for the manifest)
    fences: tuple[str, ...]  # fence built-ins, narrowest first (same spelling in both languages)
    timer: str  # what bounds a wait
    backoff: str  # how a poll loop waits between reads
    warp_shuffle: bool  # a lane-0 broadcast is a shuffle (else shared memory and __syncwarp)
    kernel_writes_host_memory: bool  # kernels may write host-mapped memory (error record, proxy FIFOs)
    peer_memory: str  # how a rank maps a peer's buffers
    copy_engines: tuple[str, ...]  # what moves bytes: the kernels' SMs / SPCs, the DMA engine
    # ---- the host runtime as the launcher and the metadata driver call it (templates/*.j2)
    rt: dict = field(default_factory=dict)

    @property
    def prelude_path(self) -> Path:
        return self.include_dir / self.prelude


#: Host runtime names of CUDA: the launcher calls CUDA directly.
_CUDA_RT = {
    "status": "cudaError_t", "ok": "cudaSuccess", "stream": "cudaStream_t", "error_string": "cudaGetErrorString",
    "last_error": "cudaGetLastError", "set_device": "cudaSetDevice", "malloc": "cudaMalloc", "free": "cudaFree",
    "memset": "cudaMemset", "memset_async": "cudaMemsetAsync", "memcpy": "cudaMemcpy",
    "memcpy_async": "cudaMemcpyAsync", "stream_synchronize": "cudaStreamSynchronize",
    "h2d": "cudaMemcpyHostToDevice", "d2h": "cudaMemcpyDeviceToHost", "d2d": "cudaMemcpyDeviceToDevice",
    "ipc_handle": "cudaIpcMemHandle_t", "ipc_get": "cudaIpcGetMemHandle", "ipc_close": "cudaIpcCloseMemHandle",
}

#: Host runtime names of SUPA: epcc_supa_api.h's wrappers, which map onto either runtime
#: generation (su* of SDK 1.x, supa* of the torch_supa stack) or, under EPCC_SUPA_SHIM, onto CUDA.
_SUPA_RT = {
    "status": "epcc_rt_status_t", "ok": "EPCC_RT_OK", "stream": "epcc_rt_stream_t",
    "error_string": "epcc_rt_error_string", "last_error": "epcc_rt_last_error", "set_device": "epcc_rt_set_device",
    "malloc": "epcc_rt_malloc", "free": "epcc_rt_free", "memset": "epcc_rt_memset",
    "memset_async": "epcc_rt_memset_async", "memcpy": "epcc_rt_memcpy", "memcpy_async": "epcc_rt_memcpy_async",
    "stream_synchronize": "epcc_rt_stream_synchronize", "h2d": "EPCC_RT_H2D", "d2h": "EPCC_RT_D2H",
    "d2d": "EPCC_RT_D2D", "ipc_handle": "epcc_rt_ipc_handle_t", "ipc_get": "epcc_rt_ipc_get_handle",
    "ipc_close": "epcc_rt_ipc_close_handle",
}

CUDA = Target(
    name="cuda", vendor="nvidia", language="CUDA", source_suffix=".cu", device_header="epcc_cuda_device.cuh",
    prelude="epcc/prelude/cuda.cuh", include_dir=_HERE / "cuda" / "include", abi_prefix="epcc_cuda",
    warp_size=32, max_block_threads=1024, shared_bytes_per_block=48 * 1024, blocks_per_cu=1, vector_bytes=16,
    residency="cooperative",
    atomics="PTX ld.acquire / st.release / red.release at system scope; fp32 red.add.v4 (relaxed, system)",
    fences=("__threadfence_block", "__threadfence", "__threadfence_system"),
    timer="%globaltimer (ns)", backoff="__nanosleep, doubling to 1 us", warp_shuffle=True,
    kernel_writes_host_memory=True, peer_memory="CUDA IPC (cudaIpcGetMemHandle / cudaIpcOpenMemHandle)",
    copy_engines=("sm",), rt=_CUDA_RT,
)

# SUPA (Biren BR1xx), docs/supa.md: warp 32 lanes (G: "一个线程束由 32 个线程组成"; H: warpSize 32 on a
# 106M), 1024 threads and 32 KB of shared memory per block (G's table), weak memory order with
# __threadfence_system (G), system-scope atomic_ref under brcc's MIRA path (T; load / store /
# fetch_add UNVERIFIED), no public sleep (spin), kernels may only read pinned host memory on
# hardware 1.x (G: the error record stays in device memory), IPC through su/supaIpc*Handle,
# no cooperative launch in any public source (one block per CU, grid <= CUs, residency assumed).
SUPA = Target(
    name="supa", vendor="biren", language="SUPA", source_suffix=".su", device_header="epcc_supa_device.suh",
    prelude="epcc/prelude/supa.suh", include_dir=_HERE / "supa" / "include", abi_prefix="epcc_supa",
    warp_size=32, max_block_threads=1024, shared_bytes_per_block=32 * 1024, blocks_per_cu=1, vector_bytes=16,
    residency="assumed",
    atomics="supa::atomic_ref<T, thread_scope_system> (brcc MIRA path) or clang __atomic builtins; fp32 atomicAdd",
    fences=("__threadfence_block", "__threadfence", "__threadfence_system"),
    timer="%globaltimer (ns) on the MIRA path, else clock64() at EPCC_SUPA_CLOCK_KHZ", backoff="spin",
    warp_shuffle=False, kernel_writes_host_memory=False,
    peer_memory="SUPA IPC (suIpcGetMemHandle / supaIpcGetMemHandle, opened with LazyEnablePeerAccess)",
    copy_engines=("spc", "dma"), rt=_SUPA_RT,
)

TARGETS = {t.name: t for t in (CUDA, SUPA)}


def target(name: str) -> Target:
    """The target of a name (ValueError naming the known ones)."""
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r} (known: {', '.join(TARGETS)})")
    return TARGETS[name]


__all__ = ["CUDA", "SUPA", "TARGETS", "Target", "target"]
