"""RDMA lowering and transports: a plan's RDMA steps as a proxy post loop (docs/rdma.md).

    from epcc.backends import rdma
    paths = rdma.emit(plan, out_dir)        # [] when the plan has no RDMA step
    lib = rdma.build(plan, "libfabric")     # the emitted loop + transport, compiled (CPU path)

* lower.py decides: which steps are RDMA (roles of `proxy` kernels), the receiver's row
  operation, chunk size and queue depth (the plan's, or EPCC_RDMA_CHUNK_TOKENS / EPCC_RDMA_DEPTH),
  symbols, and the descriptor tables shared with the host;
* templates/epcc_proxy.c.j2 lays out the loop: producers push chunk triggers into a FIFO, one
  proxy thread posts one write-with-immediate per chunk and polls completions, one receiver
  thread applies landed chunks in order, bumps the per-chunk flags and returns credits;
* native/: epcc_transport.h (the transport interface), epcc_proxy.h (FIFO, tracker, waits) and
  the transports: libfabric (runs here over tcp), ibverbs (RC, write-with-imm), emulated (CUDA
  copy engine, paced), nvshmem (put-with-signal; built only where nvshmem.h exists);
* engine.py runs the loop on the CPU backend, one process per rank (backends/cpu/procs.py).
"""

from __future__ import annotations

from pathlib import Path

from epcc.textsafe import c_template_value, for_c_templates

from .build import NATIVE_DIR, BuildError, build, compile_command, transport_sources
from .lower import RdmaConfigError, RdmaStep, rdma_bytes_per_token, rdma_steps, with_overrides

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
STATIC_SOURCES = ("epcc_transport.h", "epcc_transport_impl.h", "epcc_transport.c", "epcc_proxy.h",
                  "epcc_proxy_prim.c", "transport_libfabric.c", "transport_ibverbs.c", "transport_emulated.cu",
                  "transport_nvshmem.cu")


def proxy_source(plan) -> str:
    """The emitted proxy loop of `plan` (C), or '' when it has no RDMA step."""
    import jinja2

    from .lower import TABLES

    steps = rdma_steps(plan)
    if not steps:
        return ""
    env = for_c_templates(jinja2.Environment(  # user text only through c_comment / c_string
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), trim_blocks=True, lstrip_blocks=True,
        keep_trailing_newline=True, undefined=jinja2.StrictUndefined, finalize=c_template_value))
    return env.get_template("epcc_proxy.c.j2").render(
        file_name=proxy_file_name(plan), schedule=plan.schedule, num_ranks=plan.num_ranks, steps=steps,
        tables=TABLES)


def proxy_file_name(plan) -> str:
    import re

    return f"{re.sub(r'[^A-Za-z0-9_]', '_', plan.schedule)}_proxy.c"


def emit(plan, out_dir) -> list[Path]:
    """Write the proxy sources of `plan` into `out_dir`: the emitted loop and the static
    runtime and transport sources it compiles with.  Returns the paths written, [] when the
    plan has no RDMA step (nothing is written then)."""
    text = proxy_source(plan)
    if not text:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / proxy_file_name(plan)]
    paths[0].write_text(text, encoding="utf-8")
    for name in STATIC_SOURCES:
        p = out / name
        p.write_text((NATIVE_DIR / name).read_text(encoding="utf-8"), encoding="utf-8")
        paths.append(p)
    return paths


__all__ = ["BuildError", "RdmaConfigError", "RdmaStep", "build", "compile_command", "emit", "proxy_file_name",
           "proxy_source", "rdma_bytes_per_token", "rdma_steps", "transport_sources", "with_overrides"]
