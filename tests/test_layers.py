"""The layers run one way (scripts/import_graph.py holds the rules, docs/architecture.md shows them):
no module imports a layer its layer may not, no module is in no layer, no import cycle (top-level
and function-local imports alike, at module and at package level), every function-local import of
the product says why, the runtime's GPU side loads without the compiler's dependencies, and the
picture in the doc is the script's."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
ig = importlib.util.module_from_spec(_spec)
sys.modules["import_graph"] = ig  # its dataclasses look their module up while it loads
_spec.loader.exec_module(ig)

DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- import_graph.py: begin -->", "<!-- import_graph.py: end -->"


@pytest.fixture(scope="module")
def graph():
    known = ig.modules()
    return known, ig.imports(known)


def test_every_module_is_in_a_layer_and_keeps_its_rules(graph):
    known, edges = graph
    assert len(known) > 80 and len(edges) > 200  # the whole tree was read
    assert ig.violations(edges, known) == []


def test_no_module_cycle_and_no_package_cycle(graph):
    known, edges = graph
    assert ig.cycles(known, [(e.src, e.dst) for e in edges]) == []
    assert ig.cycles({ig.package_of(m) for m in known}, ig.package_edges(edges)) == []


def test_function_local_imports_of_the_product_say_why(graph):
    """Only a heavy optional dependency justifies one; its line says which (a `# reason` comment)."""
    known, _ = graph
    bare = [f"{m}:{line}" for m, line, reason in ig.local_imports(known) if not reason]
    assert bare == []


def test_the_doc_shows_the_current_graph(graph):
    known, edges = graph
    text = DOC.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, f"{DOC} has no generated block between {BEGIN} and {END}"
    shown = text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"
    assert shown == ig.document(edges, known), \
        "docs/architecture.md is out of date: run `.venv/bin/python scripts/import_graph.py --update-doc`"


def test_the_gpu_side_loads_without_the_compilers_dependencies():
    """A GPU machine has no MLIR, lark, jinja2 (nor llvmlite, graphviz): what it runs must not load them."""
    gpu_side = ["epcc.runtime.buffer", "epcc.runtime.engines.cuda_direct.engine", "epcc.runtime.engines.cuda_table.launcher",
                "epcc.runtime.engines.gpu_proxy.engine", "epcc.runtime.engines.gpu_proxy.build", "epcc.runtime.tune",
                "epcc.runtime.testing.emulate", "epcc.plan.bundle", "epcc.deep_ep", "epcc.sim.simulate", "epcc.sim.report"]
    code = ("import importlib, sys\n"
            f"for m in {gpu_side!r}: importlib.import_module(m)\n"
            "print(sorted({n.split('.')[0] for n in sys.modules} & {'mlir', 'lark', 'jinja2', 'llvmlite', 'graphviz'}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# ------------------------------------------------------------------------- the checks themselves


def test_a_layer_violation_is_caught():
    """A backend importing the runtime, a runtime engine importing the CUDA code generator, a
    module outside every layer: each is reported."""
    known = {"epcc.backends.cuda.codegen": Path("a"), "epcc.runtime.layout": Path("b"),
             "epcc.runtime.engines.cuda_direct.engine": Path("c"), "epcc.nowhere_x": Path("d")}
    edges = [ig.Import("epcc.backends.cuda.codegen", "epcc.runtime.layout", 3, False, ""),
             ig.Import("epcc.runtime.engines.cuda_direct.engine", "epcc.backends.cuda.codegen", 7, True, "x")]
    found = ig.violations(edges, known)
    assert any(v.startswith("epcc.backends.cuda.codegen (backends) imports epcc.runtime.layout (rt.layout)")
               for v in found)
    assert any(v.startswith("epcc.runtime.engines.cuda_direct.engine (rt.engines) imports epcc.backends.cuda.codegen "
                            "(backends), line 7 (function-local)") for v in found)
    assert "epcc.nowhere_x: in no layer of scripts/import_graph.py LAYERS" in found
    assert len(found) == 3


def test_a_cycle_is_caught_through_a_function_local_import():
    edges = [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("e", "e")]
    assert ig.cycles(["a", "b", "c", "d", "e"], edges) == [["a", "b", "c"], ["e"]]
    assert ig.cycles(["a", "b"], [("a", "b")]) == []


def test_imports_are_resolved_as_python_loads_them(tmp_path):
    """Relative imports, `from pkg import submodule` (the submodule), `from pkg import name` (the
    package), and imports inside functions (marked local, with their comment)."""
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("X = 1\n")
    (tmp_path / "pkg" / "sub" / "leaf.py").write_text("from .. import other\nfrom . import X\n")
    (tmp_path / "pkg" / "other.py").write_text("def f():\n    from .sub import leaf  # why not\n    import json\n")
    known = {"epcc": tmp_path / "pkg" / "__init__.py", "epcc.sub": tmp_path / "pkg" / "sub" / "__init__.py",
             "epcc.sub.leaf": tmp_path / "pkg" / "sub" / "leaf.py", "epcc.other": tmp_path / "pkg" / "other.py"}
    got = {(e.src, e.dst, e.local, e.reason) for e in ig.imports(known)}
    assert got == {("epcc.sub.leaf", "epcc.other", False, ""), ("epcc.sub.leaf", "epcc.sub", False, ""),
                   ("epcc.other", "epcc.sub.leaf", True, "why not")}
    assert ig.cycles(known, [(e.src, e.dst) for e in ig.imports(known)]) == [["epcc.other", "epcc.sub.leaf"]]
