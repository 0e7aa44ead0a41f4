"""A plan's RDMA steps as the proxy post loop runs them (docs/rdma.md): the decisions.

An RDMA step is a role of a kernel of kind `proxy` (kernel-formation puts every step over a link
of kind rdma there).  For each one this module decides the receiver's row operation (dispatch:
copy the payload row; combine: accumulate the partial, which travels as bf16 like on the GPU path,
or the weighted bf16 expert output), the chunk size and queue depth (the plan's chunk-pipeline
pass, from the cost model, unless overridden) and the C symbol of its apply function.  The
emitted loop (backends/rdma) and the host engines (runtime/engines) read these decisions; the
descriptor tables they share are backends/rdma/abi.py.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from ..limits import MAX_DEPTH
from .model import Plan

OP_COPY, OP_ACC_BF16, OP_ACC_F32_BF16 = "copy", "acc_bf16", "acc_f32_bf16"
_OP_TEXT = {
    OP_COPY: "copy each landed row to its destination row (memcpy)",
    OP_ACC_F32_BF16: "accumulate each landed partial into its destination (atomic float add); the fp32 partial "
                     "travels as bf16 (rounded to nearest even by the sender), half the bytes, as on the GPU path",
    OP_ACC_BF16: "accumulate w * bf16 expert output into its destination (atomic float add)",
}
#: log2 of (source row bytes / wire row bytes) per operation: partials are packed fp32 -> bf16
WIRE_SHIFT = {OP_COPY: 0, OP_ACC_BF16: 0, OP_ACC_F32_BF16: 1}

#: Environment overrides of the plan's choices (docs/rdma.md).
ENV_CHUNK_TOKENS = "EPCC_RDMA_CHUNK_TOKENS"
ENV_DEPTH = "EPCC_RDMA_DEPTH"


class RdmaConfigError(ValueError):
    """A bad override (names the variable or argument)."""


@dataclass(frozen=True)
class RdmaStep:
    index: int
    program: str
    step: str
    line: int
    title: str
    kernel: str
    role: str
    link: str
    link_kind: str
    bandwidth: float  # bytes/s of the link's ports (0: unknown)
    latency_s: float
    chunk_bytes: int  # 0: one chunk per copy
    depth: int
    op: str
    apply_symbol: str

    @property
    def wire_shift(self) -> int:
        return WIRE_SHIFT[self.op]

    @property
    def bandwidth_text(self) -> str:
        return f"{self.bandwidth / 1e9:g} GB/s" if self.bandwidth else "bandwidth unknown"

    @property
    def latency_text(self) -> str:
        return f"{self.latency_s * 1e6:g} us"

    @property
    def chunk_text(self) -> str:
        return f"{self.chunk_bytes} bytes" if self.chunk_bytes else "one chunk per copy"

    @property
    def op_text(self) -> str:
        return _OP_TEXT[self.op]


def _symbol(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", text)


def _op(plan: Plan, program: str, step: str) -> str:
    if program == "dispatch":
        return OP_COPY
    return OP_ACC_BF16 if plan.step(step, program).weighted else OP_ACC_F32_BF16


def rdma_steps(plan: Plan) -> list[RdmaStep]:
    """The RDMA steps of the plan, in kernel and role order (empty when it has none)."""
    out: list[RdmaStep] = []
    for k in plan.kernels:
        if k.kind != "proxy":
            continue
        for r in k.roles:
            ps = plan.step(r.step, k.program)
            bw = max((plan.resources.get(res, 0.0) for f in ps.flows for res in f.resources
                      if res.startswith("link:")), default=0.0)
            lat = max((f.latency_s for f in ps.flows), default=0.0)
            out.append(RdmaStep(
                index=len(out), program=k.program, step=r.step, line=ps.line, title=ps.title or "",
                kernel=k.name, role=r.role, link=ps.link or "?", link_kind=ps.link_kind or "?",
                bandwidth=bw, latency_s=lat, chunk_bytes=int(ps.chunk_bytes or 0), depth=max(1, int(ps.depth or 1)),
                op=_op(plan, k.program, r.step),
                apply_symbol=f"epcc_rdma_apply_{_symbol(k.program)}__{_symbol(r.step)}"))
    return out


def positive_setting(name: str, value: str | None, limit: int | None = None) -> int | None:
    """`value` of the setting `name` (a variable, or an argument) as a whole number in 1..limit;
    None when empty.  RdmaConfigError names the setting and the value."""
    if value is None or value == "":
        return None
    try:
        v = int(value)
    except ValueError:
        raise RdmaConfigError(f"{name}={value!r}: expected a positive whole number") from None
    if v < 1 or (limit is not None and v > limit):
        raise RdmaConfigError(f"{name}={value}: must be between 1 and {limit}" if limit else
                              f"{name}={value}: must be >= 1")
    return v


def bf16_partials(plan: Plan) -> bool:
    """Whether combine partials cross an RDMA step of the plan (they travel as bf16: rounded once
    to bf16's unit roundoff on the way, which a check of the combine must admit)."""
    return any(s.program == "combine" and s.op == OP_ACC_F32_BF16 for s in rdma_steps(plan))


def rdma_bytes_per_token(plan: Plan, program: str) -> int:
    """Bytes one token takes in a chunk of an RDMA step: the dispatch payload row, or in combine
    the partial as it travels (bf16, 2 bytes per channel)."""
    return plan.bytes_per_token if program == "dispatch" else 2 * (plan.workload.hidden if plan.workload else 0)


def with_overrides(plan: Plan, *, chunk_tokens: int | None = None, depth: int | None = None,
                   env: dict | None = None) -> Plan:
    """The plan with its RDMA steps' chunk size (tokens per post) and queue depth replaced:
    arguments first, then EPCC_RDMA_CHUNK_TOKENS / EPCC_RDMA_DEPTH.  Chunking changes the
    layout's chunks (and so every wait), so override the plan before computing the layout."""
    env = os.environ if env is None else env
    if chunk_tokens is None:
        chunk_tokens = positive_setting(ENV_CHUNK_TOKENS, env.get(ENV_CHUNK_TOKENS))
    elif chunk_tokens < 1:
        raise RdmaConfigError(f"chunk_tokens={chunk_tokens}: must be >= 1")
    if depth is None:
        depth = positive_setting(ENV_DEPTH, env.get(ENV_DEPTH), MAX_DEPTH)
    elif not 1 <= depth <= MAX_DEPTH:
        raise RdmaConfigError(f"depth={depth}: must be between 1 and {MAX_DEPTH}")
    if chunk_tokens is None and depth is None:
        return plan
    names = {(s.program, s.step) for s in rdma_steps(plan)}
    steps = []
    for s in plan.steps:
        if (s.program, s.name) in names:
            per_token = rdma_bytes_per_token(plan, s.program)
            s = s.chunked(float(chunk_tokens * per_token) if chunk_tokens else s.chunk_bytes, depth or s.depth)
        steps.append(s)
    return replace(plan, steps=steps)
