"""The table engine's dispatch and combine inputs on the CPU, its launcher and metadata faked:
where the bundle's manifest allows it (dispatch_input / combine_input caller_rows) the kernel gets
the caller's rows (the tokens, the expert rows) as a launch argument and nothing is copied;
elsewhere (or with a library of an older epcc, a bundle without the field, or rows the kernel
cannot read in place: strided, or not 16-byte aligned) the rows are copied into the program's
input buffer first, as before."""

from __future__ import annotations

import contextlib

import pytest
import torch

from epcc.runtime.engines.cuda_table import engine as table_engine
from epcc.runtime.engines.cuda_table.engine import ROW_ALIGN, CudaTableEngine, TableHandle, reads_caller_rows

HIDDEN, ROWS, TOKENS = 8, 6, 3
ALLOWED = {"combine_input": {"buffer": "output", "caller_rows": True, "why": "every combine copy reads output on "
                                                                          "its own rank"}}
REFUSED = {"combine_input": {"buffer": "output", "caller_rows": False, "why": "combine step 'fwd' reads output of "
                                                                           "rank 1 on rank 0"}}
BOTH = {**ALLOWED, "dispatch_input": {"buffer": "input", "caller_rows": True, "why": "every dispatch copy reads input "
                                                                                    "on its own rank"}}
PROGRAMS = ("dispatch", "combine")


class _Agree:
    def call(self, name, **_):
        return contextlib.nullcontext(name)

    def fail(self, e, **_):
        raise e


class _Meta:
    def __init__(self):
        self.calls = []

    def copy_rows(self, dst, src, row_bytes, stream):
        self.calls.append(("copy_rows", dst, src, row_bytes))

    def zero_partials(self, ptr, stream):
        self.calls.append(("zero_partials",))


class _Ctx:
    def __init__(self, log: list):
        self.launches, self.log = [], log

    def launch_combine_tokens(self, out, tokens, stream=0, rows=0):
        self.launches.append((tokens, rows))

    def combine_prepare(self, stream=0):  # each row's contributions counted (a combine converting in the kernel)
        self.log.append(("combine_prepare", stream))


def _engine(manifest: dict, library_can: bool = True, row_bytes: int = 2 * HIDDEN) -> CudaTableEngine:
    eng = CudaTableEngine.__new__(CudaTableEngine)
    eng.agree, eng.meta, eng.rdma = _Agree(), _Meta(), []
    eng.ctx = _Ctx(eng.meta.calls)  # one log: the clearing, then the count ahead of the combine
    eng.device, eng.hidden, eng.dispatches, eng.programs = torch.device("cpu"), HIDDEN, 1, ["dispatch", "combine"]
    eng.y_ptr = 0x1000  # the combine's input buffer (never dereferenced: the copy is the fake's)
    eng.recv_view = torch.zeros((ROWS, 2 * HIDDEN), dtype=torch.uint8)  # the receive buffer's rows
    eng.own_combine = torch.zeros(2, dtype=torch.int64)
    eng.partials_clean = False  # no dispatch cleared the partials beside its kernel
    eng.own, eng.own_bytes = {}, {}  # this rank's buffers: none of the callers' tensors lies in them
    eng.caller_rows = reads_caller_rows(manifest, dict.fromkeys(PROGRAMS, library_can), PROGRAMS)
    eng.input_view = torch.zeros((TOKENS + 1, row_bytes), dtype=torch.uint8)  # the dispatch's input buffer
    eng._stream = lambda: 0
    return eng


def _low_latency_handle() -> TableHandle:
    return TableHandle(1, None, TOKENS, ROWS, torch.zeros((TOKENS, 2), dtype=torch.int64), None, None, sync=False)


def test_allowed_the_kernel_reads_the_callers_rows_and_nothing_is_copied():
    eng = _engine(ALLOWED)
    y = torch.ones((ROWS, HIDDEN), dtype=torch.bfloat16)
    out = eng.combine(y, _low_latency_handle())
    assert out.shape == (TOKENS, HIDDEN)
    assert eng.ctx.launches == [(TOKENS, y.data_ptr())]
    assert eng.meta.calls == [("zero_partials",)]


@pytest.mark.parametrize("manifest,library_can", [(REFUSED, True), ({}, True), (ALLOWED, False)])
def test_elsewhere_the_rows_are_copied_first(manifest, library_can):
    eng = _engine(manifest, library_can)
    y = torch.ones((ROWS, HIDDEN), dtype=torch.bfloat16)
    eng.combine(y, _low_latency_handle())
    assert eng.ctx.launches == [(TOKENS, 0)]
    assert eng.meta.calls == [("copy_rows", eng.y_ptr, y.data_ptr(), 2 * HIDDEN), ("zero_partials",)]


def test_rows_the_kernel_cannot_read_in_place_are_copied():
    """combine's argument checks already refuse these; _combine_input keeps its own rule."""
    eng = _engine(ALLOWED)
    h = _low_latency_handle()
    strided = torch.ones((HIDDEN, ROWS), dtype=torch.bfloat16).t()
    assert not strided.is_contiguous()
    assert eng._combine_input(strided, h, 0) == 0
    assert eng.meta.calls[-1][0] == "copy_rows"
    assert eng._combine_input(torch.ones((ROWS, HIDDEN), dtype=torch.float32), h, 0) == 0
    y = torch.ones((ROWS, HIDDEN), dtype=torch.bfloat16)
    assert eng._combine_input(y, h, 0) == y.data_ptr()
    assert eng._combine_input(torch.ones((0, HIDDEN), dtype=torch.bfloat16), h, 0) == 0  # no rows: nothing to read


def test_partials_a_dispatch_cleared_are_not_cleared_again(monkeypatch):
    """After a dispatch cleared the combine's partials beside its kernel (_zero_beside) the combine
    clears nothing; the one after it, with no dispatch between, clears them itself; a combine
    captured into a CUDA graph always records its own clearing (its replays need not follow a
    dispatch that cleared)."""
    eng = _engine(ALLOWED)
    y = torch.ones((ROWS, HIDDEN), dtype=torch.bfloat16)
    eng.partials_clean = True
    eng.combine(y, _low_latency_handle())
    assert eng.meta.calls == [] and eng.partials_clean is False
    eng.combine(y, _low_latency_handle())
    assert eng.meta.calls == [("zero_partials",)] and eng.partials_clean is False
    monkeypatch.setattr(table_engine, "capturing", lambda: True)
    eng.partials_clean = True
    eng.meta.calls.clear()
    eng.combine(y, _low_latency_handle())
    assert eng.meta.calls == [("zero_partials",)]


class _Stream:
    """A CUDA stream's stand-in: what is enqueued on it, in order, into a shared log."""

    def __init__(self, name: str, log: list):
        self.name, self.log, self.cuda_stream = name, log, name

    def wait_event(self, ev):
        self.log.append((self.name, "wait_event", ev))

    def wait_stream(self, other):
        self.log.append((self.name, "wait_stream", other.name))


@pytest.mark.parametrize("graph", [False, True])
def test_the_partials_are_cleared_beside_the_dispatch_after_its_tables_then_joined(monkeypatch, graph):
    """_zero_beside: the zero stream waits for the tables' event, clears with zero_blocks blocks,
    counts each row's contributions for the combine (combine_prepare, on the zero stream too), and
    the caller's stream joins it; the flag says so only outside a graph's capture."""
    log: list = []
    eng = _engine(ALLOWED)
    eng.zero_stream, eng.zero_blocks = _Stream("zero", log), 24
    eng.meta.zero_partials = lambda ptr, stream, blocks: log.append(("zero", "zero_partials", stream, blocks))
    eng.ctx.log = log
    monkeypatch.setattr(table_engine, "capturing", lambda: graph)
    eng._zero_beside("tables", _Stream("caller", log))
    assert log == [("zero", "wait_event", "tables"), ("zero", "zero_partials", "zero", 24), ("combine_prepare", "zero"),
                   ("caller", "wait_stream", "zero")]
    assert eng.partials_clean is (not graph)


def test_rows_in_the_buffers_own_memory_are_copied():
    """A low-latency recv_x passed back as x (or y in a combine buffer): the kernels write there, so
    the rows are copied before the launch, not read in place."""
    eng = _engine(BOTH)
    own = torch.zeros((TOKENS + 4, 2 * HIDDEN), dtype=torch.uint8)
    eng.own = {p: [own.data_ptr()] for p in PROGRAMS}
    eng.own_bytes = {p: [own.numel()] for p in PROGRAMS}
    assert eng._dispatch_input(own[1:TOKENS + 1], TOKENS) == 0
    ys = own.view(torch.bfloat16)[:ROWS]
    assert eng._combine_input(ys, _low_latency_handle(), 0) == 0
    elsewhere = torch.zeros((TOKENS, 2 * HIDDEN), dtype=torch.uint8)
    assert eng._dispatch_input(elsewhere, TOKENS) == elsewhere.data_ptr()


def test_a_manifest_naming_another_buffer_is_not_used():
    can = dict.fromkeys(PROGRAMS, True)
    other = {"combine_input": dict(ALLOWED["combine_input"], buffer="result")}
    assert not reads_caller_rows(other, can, PROGRAMS)["combine"]
    assert not reads_caller_rows(ALLOWED, can, ("dispatch",))["combine"]  # no combine program
    assert reads_caller_rows(ALLOWED, can, PROGRAMS) == {"dispatch": False, "combine": True}
    assert reads_caller_rows(BOTH, can, PROGRAMS) == {"dispatch": True, "combine": True}
    assert reads_caller_rows(BOTH, {"combine": True}, PROGRAMS)["dispatch"] is False  # no entry point


def _misaligned(rows: int, cols: int, dtype) -> torch.Tensor:
    """A contiguous [rows, cols] tensor whose address is not a multiple of ROW_ALIGN."""
    size = torch.empty((), dtype=dtype).element_size()
    flat = torch.zeros(rows * cols + ROW_ALIGN, dtype=dtype)
    skip = next(k for k in range(1, ROW_ALIGN) if (flat.data_ptr() + k * size) % ROW_ALIGN)
    t = flat[skip: skip + rows * cols].view(rows, cols)
    assert t.is_contiguous() and t.data_ptr() % ROW_ALIGN
    return t


def test_misaligned_expert_rows_are_copied():
    eng = _engine(ALLOWED)
    y = _misaligned(ROWS, HIDDEN, torch.bfloat16)
    assert eng._combine_input(y, _low_latency_handle(), 0) == 0
    assert eng.meta.calls[-1] == ("copy_rows", eng.y_ptr, y.data_ptr(), 2 * HIDDEN)


def test_allowed_the_dispatch_kernel_reads_the_callers_tokens():
    eng = _engine(BOTH)
    rows = torch.arange(TOKENS * 2 * HIDDEN, dtype=torch.uint8).view(TOKENS, 2 * HIDDEN)
    assert eng._dispatch_input(rows, TOKENS) == rows.data_ptr()
    assert not eng.input_view.any()  # nothing copied
    assert eng._dispatch_input(rows[:0], 0) == 0  # no tokens: nothing to read


@pytest.mark.parametrize("manifest,library_can", [(ALLOWED, True), ({}, True), (BOTH, False)])
def test_elsewhere_the_tokens_are_copied_first(manifest, library_can):
    eng = _engine(manifest, library_can)
    rows = torch.arange(1, TOKENS * 2 * HIDDEN + 1, dtype=torch.uint8).view(TOKENS, 2 * HIDDEN)
    assert eng._dispatch_input(rows, TOKENS) == 0
    assert torch.equal(eng.input_view[:TOKENS], rows) and not eng.input_view[TOKENS:].any()


def test_tokens_the_kernel_cannot_read_in_place_are_copied():
    eng = _engine(BOTH)
    rows = _misaligned(TOKENS, 2 * HIDDEN, torch.uint8)
    rows.copy_(torch.arange(1, TOKENS * 2 * HIDDEN + 1, dtype=torch.uint8).view(TOKENS, 2 * HIDDEN))
    assert eng._dispatch_input(rows, TOKENS) == 0
    assert torch.equal(eng.input_view[:TOKENS], rows)
    strided = torch.ones((2 * HIDDEN, TOKENS), dtype=torch.uint8).t()
    assert eng._dispatch_input(strided, TOKENS) == 0
