"""The dialect loader and the op builders that IR emission does not exercise yet.

The lowering ops (signal, wait, chunk_loop) and the kernel/proxy containers are built by later
passes; these tests pin down that the builders produce IR the dialect accepts, in Python and in
mlir-opt, and that loading the dialect is idempotent (a second IRDL load into one context would
abort the process).  Every test builds its own MLIR context.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import mlir
import pytest
from mlir import ir
from mlir.dialects import irdl

from epcc import dialect
from epcc.dialect import DIALECT_PATH, load, new_context
from epcc.ir import ops
from epcc.ir.emit import print_module

MLIR_OPT = Path(mlir.__path__[0]) / "bin" / "mlir-opt"
LOC = ("lowered.sched", 7, 3, 7, 40)


def test_dialect_file_is_packaged():
    assert DIALECT_PATH.is_file() and DIALECT_PATH.name == "epcc.irdl.mlir"
    assert "irdl.dialect @epcc" in DIALECT_PATH.read_text(encoding="utf-8")


def test_load_is_idempotent():
    ctx = ir.Context()
    assert not ctx.is_registered_operation(ops.TRANSFER)
    assert load(ctx) is ctx
    assert load(ctx) is ctx  # would abort the interpreter if it registered the dialect again
    assert ctx.is_registered_operation(ops.TRANSFER)


def test_load_respects_a_dialect_loaded_elsewhere():
    """A context that got the IRDL file from someone else is recognised, not loaded twice."""
    ctx = ir.Context()
    irdl.load_dialects(ir.Module.parse(DIALECT_PATH.read_text(encoding="utf-8"), context=ctx))
    assert load(ctx) is ctx
    with ctx:
        assert str(ops.buf_type()) == ops.BUF_TYPE


def test_new_contexts_are_independent():
    a, b = new_context(), new_context()
    assert a is not b
    assert a.is_registered_operation(ops.SIGNAL) and b.is_registered_operation(ops.SIGNAL)
    assert dialect.DIALECT_NAME == ops.DIALECT


def _lowered_module() -> ir.Module:
    """A program as a later pass might leave it: a step split into chunks and flag handshakes."""
    with ir.Location.file(*LOC) as loc:
        module = ops.schedule_module("lowered", None, "lowered.sched", 2, loc=loc)
        with ir.InsertionPoint(module.body):
            prog = ops.program_module("dispatch", loc=loc)
            with ir.InsertionPoint(prog.body):
                src = ops.buffer("input", "source", capacity_tokens=None, capacity_bytes=None,
                                 loc=ir.Location.name("input", loc))
                dst = ops.buffer("output", "sink", capacity_tokens=None, capacity_bytes=None,
                                 loc=ir.Location.name("output", loc))
                sel = ops.select("for", "peer", loc=ir.Location.name("push.sel", loc))
                info = ops.StepInfo("push", chunk_tokens=128, depth=4)
                done = ops.transfer([src], dst, sel, [], info, direction="push", relation="peer",
                                    src_relations=[None], link="nvlink", link_kind="p2p", engine="sm",
                                    dedup="rank", loc=ir.Location.name("push", loc))
                ops.chunk_loop(step="push", chunks=32, chunk_tokens=128, depth=4, loc=loc)
                sig = ops.signal([done], step="push", flag="tail", value=1, relation="peer",
                                 loc=ir.Location.name("push.signal", loc))
                ops.wait([sig], step="push", flag="tail", value=32, timeout_ns=10**9,
                         loc=ir.Location.name("push.wait", loc))
            for kind in ops.CODE_KINDS:
                ops.code_module(f"dispatch_{kind}", kind, loc=loc)
    return module


def test_lowering_ops_verify_and_round_trip():
    with new_context():
        module = _lowered_module()
        module.operation.verify()
        text = print_module(module)
    for name in (ops.CHUNK_LOOP, ops.SIGNAL, ops.WAIT):
        assert f'"{name}"' in text
    assert 'epcc.kind = "kernel"' in text and 'epcc.kind = "proxy"' in text
    with new_context():
        assert print_module(ir.Module.parse(text)) == text


def test_mlir_opt_accepts_lowering_ops(tmp_path):
    with new_context():
        text = print_module(_lowered_module())
    path = tmp_path / "lowered.mlir"
    path.write_text(text, encoding="utf-8")
    res = subprocess.run([str(MLIR_OPT), f"--irdl-file={DIALECT_PATH}", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("old,new,message", [
    ('mode = "add"', 'mode = "xor"', "'\"xor\"' does not satisfy the constraint"),
    ("timeout_ns = 1000000000 : i64", 'timeout_ns = "1s"',
     "expected base attribute 'builtin.integer' but got 'builtin.string'"),
    ("chunks = 32 : i64, ", "", "'epcc.chunk_loop' op attribute \"chunks\" is expected but not provided"),
])
def test_lowering_ops_reject_bad_attributes(old, new, message):
    with new_context():
        text = print_module(_lowered_module())
    assert text.count(old) == 1
    with new_context():
        with pytest.raises(ir.MLIRError) as err:
            ir.Module.parse(text.replace(old, new))
    assert any(message in d.message for d in err.value.error_diagnostics), str(err.value)


def test_code_module_kinds():
    with new_context(), ir.Location.file(*LOC) as loc:
        module = ir.Module.create(loc=loc)
        with ir.InsertionPoint(module.body):
            with pytest.raises(ValueError, match="kernel"):
                ops.code_module("k", "device", loc=loc)


def test_relation_and_link_decoders():
    targets = ((1, 2), (0,), ())
    pairs = frozenset({(0, 1), (1, 0), (0, 2), (2, 0)})
    with new_context(), ir.Location.file(*LOC) as loc:
        module = ir.Module.create(loc=loc)
        with ir.InsertionPoint(module.body):
            rel = ops.relation("peer", "x", targets, loc=loc)
            lk = ops.link("nv", "p2p", bandwidth_Bps=1e9, latency_s=1e-6, engine="sm", lanes=2,
                          efficiency=0.9, connects="peer", pairs=pairs, loc=loc)
        module.operation.verify()
        assert ops.relation_targets(rel) == targets
        assert ops.link_pairs(lk) == pairs
        with pytest.raises(ValueError, match="epcc.relation"):
            ops.relation_targets(lk)
