"""The descriptor tables the emitted proxy loop (templates/epcc_proxy.c.j2) and the host engines
share: the C structs are generated from these definitions, the host (runtime/engines) fills
rows of 64-bit words in the same order, so the two sides cannot drift.  Every field is 8 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass


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
