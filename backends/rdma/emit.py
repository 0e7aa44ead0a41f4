"""The proxy post loop of a plan's RDMA steps as C source (templates/epcc_proxy.c.j2).

    from epcc.backends.rdma import emit
    paths = emit.emit(plan, out_dir)        # [] when the plan has no RDMA step

The decisions (which steps, their row operation, chunk size and depth) are plan/rdma.py's; the
descriptor tables shared with the host are abi.py's; the template lays out text.
"""

from __future__ import annotations

import re
from pathlib import Path

import jinja2

from epcc.plan import Plan
from epcc.textsafe import c_template_value, for_c_templates
from epcc.plan.rdma import rdma_steps
from epcc.textsafe import c_template_value, for_c_templates

from .abi import TABLES
from .sources import NATIVE_DIR, STATIC_SOURCES, TEMPLATE_DIR

_ENV = for_c_templates(jinja2.Environment(  # user text only through c_comment / c_string
    loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), trim_blocks=True, lstrip_blocks=True,
    keep_trailing_newline=True, undefined=jinja2.StrictUndefined, finalize=c_template_value))


def proxy_source(plan: Plan) -> str:
    """The emitted proxy loop of `plan` (C), or '' when it has no RDMA step."""
    steps = rdma_steps(plan)
    if not steps:
        return ""
    return _ENV.get_template("epcc_proxy.c.j2").render(
        file_name=proxy_file_name(plan), schedule=plan.schedule, num_ranks=plan.num_ranks, steps=steps,
        tables=TABLES)


def proxy_file_name(plan: Plan) -> str:
    return f"{re.sub(r'[^A-Za-z0-9_]', '_', plan.schedule)}_proxy.c"


def emit(plan: Plan, out_dir) -> list[Path]:
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
