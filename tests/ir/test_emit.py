"""IR emission: every schedule lowers to epcc IR that verifies, round-trips, carries source
locations, is accepted by mlir-opt with the same IRDL file, and matches its golden text.

Schedules are compiled by their path relative to the repository root (the tests chdir there), so
the locations in the IR, and therefore the goldens, do not depend on where the checkout lives.
Every test builds its own MLIR context.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import mlir
import pytest
from mlir import ir

from epcc.dialect import DIALECT_PATH, new_context
from epcc.ir import ops
from epcc.ir.emit import InternalError, emit_module, print_module, verify
from epcc.sema.check import check_file

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"
SCHEDULES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "schedules").glob("*.sched"))
GOLDENS = sorted(p.stem for p in GOLDEN.glob("*.mlir"))
MLIR_OPT = Path(mlir.__path__[0]) / "bin" / "mlir-opt"  # `mlir` is a namespace package: no __file__


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch):
    monkeypatch.chdir(REPO)


def _emit(rel: str) -> tuple[object, ir.Module]:
    schedule, _warnings = check_file(rel)
    return schedule, emit_module(schedule, new_context())


def _walk(op: ir.Operation):
    """`op` and every op nested in it, in program order."""
    yield op
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield from _walk(child.operation)


def _file_loc(loc: ir.Location) -> ir.Location | None:
    """The file location a (possibly named) location wraps, or None."""
    while loc.is_a_name():
        loc = loc.child_loc
    return loc if loc.is_a_file() else None


def _mlir_opt(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(MLIR_OPT), f"--irdl-file={DIALECT_PATH}", str(path)],
                          capture_output=True, text=True, timeout=120)


def test_there_are_schedules():
    assert SCHEDULES, "no schedules/*.sched found"


@pytest.mark.parametrize("rel", SCHEDULES)
def test_round_trip(rel):
    _, module = _emit(rel)
    module.operation.verify()
    first = print_module(module)
    with new_context():
        again = ir.Module.parse(first)
        again.operation.verify()
        assert print_module(again) == first


@pytest.mark.parametrize("rel", SCHEDULES)
def test_every_op_points_into_the_schedule(rel):
    _, module = _emit(rel)
    text = print_module(module)
    assert "loc(unknown)" not in text and '"-":' not in text
    n_lines = len((REPO / rel).read_text(encoding="utf-8").splitlines())
    with new_context():
        parsed = ir.Module.parse(text)
        seen = 0
        for op in _walk(parsed.operation):
            floc = _file_loc(op.location)
            assert floc is not None, f"{op.name} has no file location: {op.location}"
            assert floc.filename == rel, f"{op.name} points at {floc.filename}"
            assert 1 <= floc.start_line <= n_lines, f"{op.name}: line {floc.start_line} is not in {rel}"
            seen += 1
    # The loc( of each op is printed on its line (ops) or after its closing brace (modules).
    assert text.count(" loc(") == seen


@pytest.mark.parametrize("rel", SCHEDULES)
def test_mlir_opt_accepts(rel, tmp_path):
    _, module = _emit(rel)
    path = tmp_path / (Path(rel).stem + ".mlir")
    path.write_text(print_module(module), encoding="utf-8")
    res = _mlir_opt(path)
    assert res.returncode == 0, res.stderr
    assert '"epcc.workload"' in res.stdout


@pytest.mark.parametrize("rel", SCHEDULES)
def test_structure_mirrors_the_schedule(rel):
    """Topology values decode exactly; each step is one op, fed by its dependencies' events."""
    schedule, module = _emit(rel)
    table = ir.SymbolTable(module.operation)
    topo = table["topology"].operation
    assert topo.attributes[ops.TOPOLOGY_ATTR].value == schedule.topology.name
    # Direct children only: links live in the nested @links module, their own namespace (a link
    # may share a relation's name, e.g. relation nic / link nic).
    topo_ops = {o.attributes["sym_name"].value: o.operation
                for o in topo.regions[0].blocks[0].operations if o.name.startswith("epcc.")}
    for name, rel_info in schedule.topology.relations.items():
        assert ops.relation_targets(topo_ops[name]) == rel_info.targets
    link_ops = {o.attributes["sym_name"].value: o
                for o in _walk(ir.SymbolTable(topo)["links"].operation) if o.name == ops.LINK}
    assert set(link_ops) == set(schedule.topology.links)
    for name, link in schedule.topology.links.items():
        assert ops.link_pairs(link_ops[name]) == link.pairs
        assert link_ops[name].attributes["kind"].value == link.kind

    for program in schedule.programs:
        body = table[program.kind].operation
        step_ops = [o for o in _walk(body) if o.name in ops.STEP_OPS]
        assert [o.attributes["step"].value for o in step_ops] == [s.name for s in program.steps]
        event_of = {o.results[0]: o.attributes["step"].value for o in step_ops}
        for op, step in zip(step_ops, program.steps):
            deps = [event_of[v] for v in op.operands if v in event_of]
            assert deps == list(step.deps), step.name
            assert [a.value for a in op.attributes["after"]] == list(step.after)
    if schedule.combine is None:
        combine = table["combine"].operation
        assert combine.attributes[ops.DERIVED_FROM_ATTR].value == "dispatch"
        assert len(combine.regions[0].blocks[0].operations) == 0


@pytest.mark.parametrize("name", GOLDENS)
def test_golden(name):
    rel = f"schedules/{name}.sched"
    assert (REPO / rel).exists(), f"golden {name}.mlir has no schedule {rel}"
    _, module = _emit(rel)
    want = (GOLDEN / f"{name}.mlir").read_text(encoding="utf-8")
    assert print_module(module) == want, (
        f"the IR of {rel} differs from tests/ir/golden/{name}.mlir; if the change is intended, "
        f"run: .venv/bin/python tests/ir/regen_golden.py {name}")


def test_goldens_present():
    # One whole-IR golden of a real plan; what emission writes for each construct is pinned by
    # the lit tests (tests/lit/mlir/).
    assert "ubbv2_ep16" in GOLDENS


# ---------------------------------------------------------------------------- negative tests
#
# Hand-written IR that is valid, then broken one way at a time: each break must be rejected with
# the same message by the Python verifier and by mlir-opt reading the same IRDL file.

VALID = """\
module {
  %input = "epcc.buffer"() {capacity_bytes = 0 : i64, capacity_tokens = 0 : i64, role = "source", sym_name = "input"} : () -> !epcc.buf
  %output = "epcc.buffer"() {capacity_bytes = 0 : i64, capacity_tokens = 0 : i64, role = "sink", sym_name = "output"} : () -> !epcc.buf
  %sel = "epcc.select"() {mode = "for", ranks = "peer"} : () -> !epcc.sel
  %push = "epcc.transfer"(%input, %output, %sel) {after = [], chunk_bytes = 0 : i64, chunk_tokens = 128 : i64, dedup = "rank", depth = 4 : i64, direction = "push", engine = "sm", link = "nvlink", link_kind = "p2p", operandSegmentSizes = array<i32: 1, 1, 1, 0>, order = "", parallel = [], relation = "peer", sms = 24 : i64, src_relations = [""], step = "push", title = ""} : (!epcc.buf, !epcc.buf, !epcc.sel) -> !epcc.event
  %keep = "epcc.permute"(%input, %output, %push) {after = [], chunk_bytes = 0 : i64, chunk_tokens = 128 : i64, depth = 4 : i64, engine = "sm", link = "hbm", operandSegmentSizes = array<i32: 1, 1, 1>, order = "", parallel = [], sms = 0 : i64, step = "keep", title = ""} : (!epcc.buf, !epcc.buf, !epcc.event) -> !epcc.event
  "epcc.link"() {bandwidth_Bps = 1.5e11 : f64, connects = "peer", efficiency = 1.0 : f64, engine = "sm", kind = "p2p", lanes = 1 : i64, latency_s = 3.0e-06 : f64, pairs = array<i64: 0, 1, 1, 0>, shared_per = "", sym_name = "nvlink"} : () -> ()
}
"""

BROKEN = {
    "string_chunk_tokens": (
        [("chunk_tokens = 128 : i64, dedup", 'chunk_tokens = "128", dedup')],
        "expected base attribute 'builtin.integer' but got 'builtin.string'"),
    "transfer_without_selection": (
        [("(%input, %output, %sel) {", "(%input, %output) {"),
         ("array<i32: 1, 1, 1, 0>", "array<i32: 1, 1, 0, 0>"),
         ("(!epcc.buf, !epcc.buf, !epcc.sel) -> !epcc.event", "(!epcc.buf, !epcc.buf) -> !epcc.event")],
        "element 2 in 'operandSegmentSizes' attribute must be equal to 1"),
    "buffer_as_selection": (
        [("(%input, %output, %sel) {", "(%input, %output, %output) {"),
         ("(!epcc.buf, !epcc.buf, !epcc.sel) -> !epcc.event", "(!epcc.buf, !epcc.buf, !epcc.buf) -> !epcc.event")],
        "expected base type 'epcc.sel' but got 'epcc.buf'"),
    "transfer_without_segment_sizes": (
        [("operandSegmentSizes = array<i32: 1, 1, 1, 0>, ", "")],
        "'operandSegmentSizes' attribute is expected but not provided"),
    "transfer_without_link": (
        [('link = "nvlink", ', "")],
        "'epcc.transfer' op attribute \"link\" is expected but not provided"),
    "pcie_link": (
        [('engine = "sm", kind = "p2p"', 'engine = "sm", kind = "pcie"')],
        "'\"pcie\"' does not satisfy the constraint"),
    "unknown_engine": (
        [('engine = "sm", kind = "p2p"', 'engine = "gpu", kind = "p2p"')],
        "'\"gpu\"' does not satisfy the constraint"),
    "local_transfer": (
        [('link_kind = "p2p"', 'link_kind = "local"')],
        "'\"local\"' does not satisfy the constraint"),
    "float_lanes": (
        [("lanes = 1 : i64", "lanes = 1.0 : f64")],
        "expected base attribute 'builtin.integer' but got 'builtin.float'"),
    "event_as_buffer": (
        [('"epcc.permute"(%input, %output, %push)', '"epcc.permute"(%push, %output, %push)'),
         ("(!epcc.buf, !epcc.buf, !epcc.event) -> !epcc.event", "(!epcc.event, !epcc.buf, !epcc.event) -> !epcc.event")],
        "expected base type 'epcc.buf' but got 'epcc.event'"),
}


def _break(edits) -> str:
    text = VALID
    for old, new in edits:
        assert text.count(old) == 1, f"edit target {old!r} must occur exactly once"
        text = text.replace(old, new)
    return text


def test_valid_ir_is_accepted(tmp_path):
    with new_context():
        ir.Module.parse(VALID).operation.verify()
    path = tmp_path / "valid.mlir"
    path.write_text(VALID)
    res = _mlir_opt(path)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_python_verifier_rejects(case):
    edits, message = BROKEN[case]
    with new_context():
        with pytest.raises(ir.MLIRError) as err:
            ir.Module.parse(_break(edits)).operation.verify()
    assert any(message in d.message for d in err.value.error_diagnostics), str(err.value)


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_mlir_opt_rejects(case, tmp_path):
    edits, message = BROKEN[case]
    path = tmp_path / f"{case}.mlir"
    path.write_text(_break(edits))
    res = _mlir_opt(path)
    assert res.returncode != 0
    assert re.search(rf"{re.escape(path.name)}:\d+:\d+: error: {re.escape(message)}", res.stderr), res.stderr


def test_verify_failure_is_an_internal_error():
    """IR the dialect rejects, reaching emit's verifier, is reported as a compiler bug with its IR."""
    with new_context():
        module = ir.Module.parse("module {}")
        with ir.InsertionPoint(module.body), ir.Location.file("x.sched", 3, 1):
            ops.level("gpu", 4, 0, loc=ir.Location.file("x.sched", 3, 1))
            ops.level("gpu", 2, 1, loc=ir.Location.file("x.sched", 4, 1))  # a duplicate symbol
        with pytest.raises(InternalError) as err:
            verify(module, what="a test module")
    text = str(err.value)
    assert "internal compiler error: a test module does not verify" in text
    assert "redefinition of symbol named 'gpu'" in text
    assert '"epcc.level"' in text


# ---------------------------------------------------------------------------- written-out combine
#
# The example schedules all declare `combine reverse of dispatch`; this one writes combine out,
# so the combine program, pulls, reduce, capacities, `after`, `parallel`, `first` and node_limit
# reach the IR too.

COMBINE = """\
schedule two "two GPUs, combine written out"

topology two {
  levels node 1, gpu 2
  rank gpu
  relation peer = other gpu
  link nvlink p2p {
    connects peer
    bandwidth 150 GB/s
    latency 3 us
  }
  link hbm local {
    bandwidth 3000 GB/s
  }
}

workload {
  tokens 1024 per rank
  hidden 4096
  dtype fp8
  topk 2
  experts 8 strided
  node_limit 1 over node
}

dispatch {
  step push: send tokens for peer from input to peer.output over nvlink
  step keep: permute input into output
}

combine {
  buffer partial capacity 1024 tokens
  buffer pulled capacity 64 MiB
  step back "partial sums home": send tokens of peer from output to peer.partial over nvlink chunk 1 MiB
  step fetch: pull tokens of me from peer.output into pulled first dedup none parallel with back
  step own: reduce output into result depth 2 sms 8
  step sum: reduce partial into result after own
  step late: reduce pulled into result after sum
}
"""


def test_written_out_combine(tmp_path):
    src = tmp_path / "two.sched"
    src.write_text(COMBINE, encoding="utf-8")
    schedule, module = _emit(str(src))
    text = print_module(module)
    with new_context():
        again = ir.Module.parse(text)
        assert print_module(again) == text
        table = ir.SymbolTable(again.operation)
        combine = table["combine"].operation
        assert combine.attributes[ops.PROGRAM_ATTR].value == "combine"
        assert ops.DERIVED_FROM_ATTR not in combine.attributes
        by_step = {o.attributes["step"].value: o for o in _walk(combine) if o.name in ops.STEP_OPS}
        assert [by_step[s].name for s in ("back", "fetch", "own", "sum", "late")] == [
            ops.TRANSFER, ops.TRANSFER, ops.REDUCE, ops.REDUCE, ops.REDUCE]
        fetch = by_step["fetch"]
        assert fetch.attributes["direction"].value == "pull"
        assert [a.value for a in fetch.attributes["src_relations"]] == ["peer"]
        assert fetch.attributes["order"].value == "first"
        assert [a.value for a in fetch.attributes["parallel"]] == ["back"]
        assert by_step["back"].attributes["chunk_bytes"].value == 2**20
        assert by_step["back"].attributes["chunk_tokens"].value == 0  # not given
        workload = next(o for o in _walk(again.operation) if o.name == ops.WORKLOAD)
        assert workload.attributes["node_limit"].value == 1
        assert workload.attributes["node_limit_scope"].value == "node"
        assert workload.attributes["weights_travel"].value is False
    assert '"epcc.reduce"(%partial, %result, %back, %own)' in text
    assert "capacity_tokens = 1024 : i64" in text and "capacity_bytes = 67108864 : i64" in text
    path = tmp_path / "two.mlir"
    path.write_text(text, encoding="utf-8")
    res = _mlir_opt(path)
    assert res.returncode == 0, res.stderr
