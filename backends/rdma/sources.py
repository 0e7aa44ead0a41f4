"""Where the RDMA backend's static sources lie, and which of them a bundle carries.

native/ holds the transport interface and its implementations (C and CUDA), the proxy loop's
primitives, compiled as they are (CMakeLists.txt, the runtime's build cache); templates/ the
proxy loop that emit.py fills in per plan.
"""

from __future__ import annotations

from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parent / "native"
TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
#: the static sources the emitted loop compiles with, copied beside it into a bundle
STATIC_SOURCES = ("epcc_transport.h", "epcc_transport_impl.h", "epcc_transport.c", "epcc_proxy.h",
                  "epcc_proxy_prim.c", "transport_libfabric.c", "transport_ibverbs.c", "transport_emulated.cu",
                  "transport_nvshmem.cu")
