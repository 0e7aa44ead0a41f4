"""Lower a plan's RDMA steps to the proxy post loop (the decisions; the template lays out text).

An RDMA step is a role of a kernel of kind `proxy` (kernel-formation puts every step over a link
of kind rdma there).  For each one this module decides the receiver's row operation (dispatch:
copy the payload row; combine: accumulate the partial, which travels as bf16 like on the GPU path,
or the weighted bf16 expert output),
the chunk size and queue depth (the plan's chunk-pipeline pass, from the cost model, unless
overridden), the C symbols, and the descriptor tables shared with the host (every field 64-bit).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from epcc.plan import Plan

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
MAX_DEPTH = 1 << 16


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


# ---------------------------------------------------------------------------------------------
# Descriptor tables shared by the host (engine.py) and the emitted C.  Every field is 8 bytes.

@dataclass(frozen=True)
class Field:
    name: str
    ctype: str
    doc: str = ""


@dataclass(frozen=True)
class Table:
    name: str
    doc: str
    fields: tuple[Field, ...]

    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)


U64 = "uint64_t"
SEND_COPY = Table("epcc_rdma_send_copy", "one Copy of an RDMA step this rank sends (it holds the source rows)", (
    Field("n_chunks", U64),
    Field("chunk_starts", U64, "int64 [n_chunks + 1]: the chunk's rows"),
    Field("src_rows", U64, "u64 [rows]: the address of every source row"),
    Field("wait_starts", U64, "int64 [n_chunks + 1]: chunk c waits for [wait_starts[c], wait_starts[c + 1])"),
    Field("wait_flags", U64, "u64 [waits]: flag addresses"),
    Field("wait_values", U64, "int64 [waits]"),
    Field("wait_names", U64, "const char * [waits]: flag names for the messages"),
    Field("chan", U64, "index into the engine's send channels"),
    Field("chunk_seq", U64, "int64 [n_chunks]: each chunk's sequence number on its channel"),
))
SEND_ROLE = Table("epcc_rdma_send_role", "one RDMA role this rank runs as sender: a FIFO and its send slots", (
    Field("step", U64, "index into epcc_rdma_steps"),
    Field("n_copies", U64),
    Field("copies", U64, "epcc_rdma_send_copy [n_copies]"),
    Field("max_chunks", U64),
    Field("depth", U64, "FIFO entries = send slots"),
    Field("slot_bytes", U64),
    Field("src_row_bytes", U64),
    Field("send_buf", U64, "depth x slot_bytes, registered"),
    Field("mr", U64, "epcc_tp_mr of send_buf"),
))
SEND_CHAN = Table("epcc_rdma_send_chan", "a (step, this rank -> peer) channel: the peer's landing ring", (
    Field("peer", U64),
    Field("remote_addr", U64, "landing ring base, as the peer's registration gave it"),
    Field("remote_key", U64),
    Field("slot_bytes", U64, "landing slot size"),
    Field("depth", U64, "landing slots"),
    Field("n_chunks", U64),
    Field("imm_chan", U64, "the channel's index at the receiver, carried in the immediate"),
    Field("credit", U64, "u64 the receiver writes: chunks it consumed (registered, remote-writable)"),
    Field("credit_name", U64, "const char *, for the messages"),
    Field("signal_addr", U64, "GPU path: the receiver's landing signal words (one per slot), as registered"),
    Field("signal_key", U64),
    Field("link", U64, "the transport link its chunks are posted on (the link class of its step; 0: one link)"),
))
RECV_CHAN = Table("epcc_rdma_recv_chan", "a (step, peer -> this rank) channel: the landing ring and what each chunk does", (
    Field("peer", U64),
    Field("step", U64, "index into epcc_rdma_steps"),
    Field("n_chunks", U64),
    Field("landing", U64, "depth x slot_bytes, registered remote-writable"),
    Field("slot_bytes", U64),
    Field("depth", U64),
    Field("row_len", U64, "bytes (copy) or elements (accumulate) of a destination row"),
    Field("src_row_bytes", U64, "bytes of a landed row"),
    Field("chunk_rows", U64, "int64 [n_chunks + 1]: rows of chunk q (in sequence order)"),
    Field("dst_rows", U64, "u64 [rows]: destination row addresses"),
    Field("weights", U64, "float [rows] (weighted combine) or null"),
    Field("chunk_flags", U64, "u64 [n_chunks]: the flag each chunk bumps"),
    Field("credit_raddr", U64, "the sender's credit word"),
    Field("credit_rkey", U64),
    Field("credit_src", U64, "u64 this rank writes the credit from (registered)"),
    Field("credit_mr", U64),
    Field("name", U64, "const char *, for the messages"),
    Field("consumed", U64, "GPU path: u64 the receiving kernel writes (launch << 32 | chunks consumed), host-mapped"),
    Field("link", U64, "the transport link its credits go back on (the link class of its step; 0: one link)"),
))
ENGINE = Table("epcc_rdma_engine", "one process's proxy engine", (
    Field("tp", U64, "epcc_tp *"),
    Field("rank_desc", U64, "const char *, e.g. \"rank 2 (vnode 1, gpu 0)\""),
    Field("timeout_ns", U64),
    Field("abort", U64, "u64 shared with the kernels' roles: set on a timeout"),
    Field("stop", U64, "u64 the host sets once every rank is done"),
    Field("n_roles", U64),
    Field("roles", U64),
    Field("n_send_chans", U64),
    Field("send_chans", U64),
    Field("n_recv_chans", U64),
    Field("recv_chans", U64),
    Field("err", U64, "char [errlen]: the first failure"),
    Field("errlen", U64),
    Field("status", U64),
    Field("state", U64, "epcc_rdma_state *, set by epcc_rdma_engine_init"),
    Field("gpu_fifos", U64, "GPU path: epcc_rdma_fifo [n_roles] in host-pinned memory, pushed by kernels; 0: CPU path"),
))
TABLES = (SEND_COPY, SEND_ROLE, SEND_CHAN, RECV_CHAN, ENGINE)
