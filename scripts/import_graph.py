"""The module import graph of epcc, its layer rules, and the package-level picture of it.

    .venv/bin/python scripts/import_graph.py            # the layer table and the package graph (Markdown, mermaid)
    .venv/bin/python scripts/import_graph.py --check    # every layer violation and cycle; exit 1 if any
    .venv/bin/python scripts/import_graph.py --local    # the function-local imports and their reasons

Modules are found the way setup.py packages them (pyproject.toml's package-dir: compiler/ is
`epcc`, backends/ `epcc.backends`, ...).  Every `import` and `from ... import` statement counts,
at the top of a module, inside a function or under `if TYPE_CHECKING:` alike: an import inside a
function is still a dependency, only a later one.  An import names the module it loads (`from
epcc.plan import rdma` loads `epcc.plan.rdma`; `from epcc.plan import Plan` loads `epcc.plan`).
Importing `a.b.c` also runs `a/__init__.py` and `a/b/__init__.py`; those implicit edges are not
counted (a package's `__init__` that imports its own submodules would otherwise always be a
cycle), so a package `__init__` must not be imported back by what it imports.

LAYERS (below) is the one table of the rules: every module belongs to the layer of its longest
matching prefix, and may import modules of its own layer and of the layers listed for it.
docs/architecture.md shows the graph this script prints; tests/test_layers.py checks that the
tree keeps the rules, that there is no cycle, and that the picture in the doc is current.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------- rules

#: The compiler core, lowest first: each may import the ones before it.
CORE = ("base", "plan", "costmodel", "frontend", "sema", "ir", "analysis", "passes", "pipeline")
#: The runtime's parts that a tool above it may use.
RUNTIME = ("rt.base", "rt.layout", "rt.engines", "rt.buffer", "rt.testing")

#: layer -> (module patterns, the layers it may import besides itself, what it is).  A pattern `x`
#: matches module x and every module below it, `=x` module x alone; the longest match decides.
LAYERS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    # the compiler core: frontend -> sema -> ir/analysis/passes -> pipeline, over the plan and cost model
    "base": (("=epcc", "epcc.diagnostics", "epcc.files", "epcc.limits", "epcc.textsafe", "epcc.vendors"), (),
             "the package, its diagnostics, bounded input files, value limits, escaping of user text, the vendors"),
    "plan": (("epcc.plan",), CORE[:1], "the plan (data), its RDMA and direct-kernel shapes, the bundle loader"),
    "costmodel": (("epcc.costmodel",), CORE[:2], "rate and work terms the passes and the simulator share"),
    "frontend": (("epcc.frontend",), CORE[:3], "the .sched grammar and its AST"),
    "sema": (("epcc.sema",), CORE[:4], "the checked schedule model"),
    "ir": (("epcc.ir", "epcc.dialect"), CORE[:5], "the epcc MLIR dialect and its emission"),
    "analysis": (("epcc.analysis",), CORE[:6], "stream and routing analyses"),
    "analysis.io": (("epcc.analysis.topk_file",), ("base",), "the routing-file reader, shared with the runtime"),
    "passes": (("epcc.passes",), CORE[:7], "the passes, and the manager that runs them"),
    "pipeline": (("epcc.pipeline",), CORE[:8], "the stages of a compilation"),
    # code generation: Python that writes text, templates, static sources; runs nothing
    "backends": (("epcc.backends",), CORE, "code generators: CUDA, LLVM IR, the C proxy loop"),
    "backends.static": (("epcc.backends.cuda.abi", "epcc.backends.cuda.placement", "epcc.backends.cuda.meta_program",
                         "epcc.backends.rdma.abi", "epcc.backends.rdma.sources"), ("base", "plan"),
                        "what a runtime may read of a backend: table layouts, where static sources lie"),
    "backends.host-emit": (("epcc.backends.cpu.codegen", "epcc.backends.rdma.emit"), CORE + ("backends.static",),
                           "the emitters the CPU engines run when they load a plan"),
    # the simulator reads plans and the cost model; build.py runs the pipeline to get a plan
    "palette": (("epcc.palette",), (), "the link-kind colours of every picture"),
    "sim": (("epcc.sim",), ("base", "plan", "costmodel", "palette"), "the simulator over a plan (no MLIR)"),
    "sim.build": (("epcc.sim.build",), CORE + ("sim",), "a plan from a .sched file, for the simulator"),
    # what loads, compiles, launches and checks a bundle
    "rt.base": (("=epcc.runtime", "epcc.runtime.bf16", "epcc.runtime.routing", "epcc.runtime.shm",
                 "epcc.runtime.build_cache", "epcc.runtime.native"), ("base", "plan"),
                "bf16, top-k arrays, peer memory, the build cache"),
    "rt.layout": (("epcc.runtime.layout",), ("base", "plan", "rt.base"), "the token-level layout of a plan"),
    "rt.engines": (("epcc.runtime.engines",), ("base", "plan", "rt.base", "rt.layout", "backends.static",
                                               "backends.host-emit"), "what runs each shape of plan"),
    "rt.buffer": (("epcc.runtime.buffer",), ("base", "plan", "rt.base", "rt.layout", "rt.engines"),
                  "the Buffer facade"),
    "rt.testing": (("epcc.runtime.testing",), ("base", "plan", "analysis.io", "backends.static", "rt.base",
                                               "rt.layout", "rt.engines"), "inputs, the oracle, NumPy executors"),
    "rt.tools": (("epcc.runtime.tune", "epcc.runtime.prebuild"), ("base", "plan", "rt.base", "rt.engines",
                                                                  "rt.buffer", "rt.testing"),
                 "epcc tune's worker, the libraries' prebuild"),
    "deep_ep": (("epcc.deep_ep",), ("base", "plan", "rt.base", "rt.engines", "rt.buffer"),
                "DeepEP's intranode Python API over token-major bundles (the compiler only as a subprocess)"),
    # on top
    "viz": (("epcc.viz",), CORE + ("palette", "sim", "sim.build"), "epcc viz"),
    "cli": (("epcc.cli",), CORE + ("palette", "sim", "sim.build", "viz", "backends") + RUNTIME, "the epcc command"),
}

#: A layer that may import "analysis" or "backends" may import their runtime-facing parts too.
_WIDER = {"analysis": ("analysis.io",), "backends": ("backends.static", "backends.host-emit")}


def allowed(layer: str) -> set[str]:
    """The layers `layer` may import: its own, the listed ones, and the parts of each listed one."""
    out = {layer, *LAYERS[layer][1]}
    for name in list(out):
        out.update(_WIDER.get(name, ()))
    return out


# ---------------------------------------------------------------------------------------------- graph


@dataclass(frozen=True)
class Import:
    src: str  # importing module
    dst: str  # imported module (an epcc module)
    line: int
    local: bool  # inside a function (or a class body's method)
    reason: str  # the comment on the import's line, for a local import


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every epcc module -> its file, as pyproject.toml's package-dir maps the directories."""
    with open(root / "pyproject.toml", "rb") as fh:
        package_dir = tomllib.load(fh)["tool"]["setuptools"]["package-dir"]
    out: dict[str, Path] = {}
    for package, directory in package_dir.items():
        base = root / directory
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            parts = list(rel.parts[:-1]) + ([] if rel.name == "__init__" else [rel.name])
            out[".".join([package, *parts])] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _owner(name: str, known: dict[str, Path]) -> str | None:
    """The epcc module `name` denotes: itself, or the module that defines it (an attribute)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(known: dict[str, Path] | None = None) -> list[Import]:
    """Every import of an epcc module by an epcc module."""
    known = known if known is not None else modules()
    out: list[Import] = []
    for module, path in known.items():
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        tree = ast.parse(text, filename=str(path))
        local: set[int] = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                local.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, path.name == "__init__.py", node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            else:
                continue
            comment = lines[node.lineno - 1].partition("#")[2].strip()
            for t in targets:
                dst = _owner(t, known)
                if dst is not None and dst != module:
                    out.append(Import(module, dst, node.lineno, id(node) in local, comment))
    return sorted(set(out), key=lambda i: (i.src, i.line, i.dst))


def local_imports(known: dict[str, Path] | None = None) -> list[tuple[str, int, str]]:
    """Every function-local import statement of an epcc module, of anything: (module, line, the
    comment on its line).  The rule: only a heavy optional dependency justifies one, and its
    comment says which."""
    known = known if known is not None else modules()
    out = []
    for module, path in known.items():
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                for n in ast.walk(fn):
                    if isinstance(n, (ast.Import, ast.ImportFrom)):
                        out.append((module, n.lineno, lines[n.lineno - 1].partition("#")[2].strip()))
    return sorted(set(out))


def layer_of(module: str) -> str | None:
    best, best_len = None, -1
    for name, (patterns, _, _) in LAYERS.items():
        for p in patterns:
            exact = p.startswith("=")
            p = p.lstrip("=")
            if (module == p or (not exact and module.startswith(p + "."))) and len(p) > best_len:
                best, best_len = name, len(p)
    return best


def violations(edges: list[Import], known: dict[str, Path]) -> list[str]:
    """One line per module outside every layer and per import its layer does not allow."""
    out = [f"{m}: in no layer of scripts/import_graph.py LAYERS" for m in known if layer_of(m) is None]
    for e in edges:
        a, b = layer_of(e.src), layer_of(e.dst)
        if a is not None and b is not None and b not in allowed(a):
            out.append(f"{e.src} ({a}) imports {e.dst} ({b}), line {e.line}{' (function-local)' if e.local else ''}: "
                       f"{a} may import {', '.join(sorted(allowed(a) - {a})) or 'nothing else'}")
    return out


def cycles(nodes, edges: list[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (or a self-loop), each sorted."""
    succ: dict[str, set[str]] = {n: set() for n in nodes}
    for a, b in edges:
        succ.setdefault(a, set()).add(b)
        succ.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan, iteratively deep enough for this graph
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in succ[v]:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(succ) + 100))
    for v in sorted(succ):
        if v not in index:
            visit(v)
    return sorted(out)


# ---------------------------------------------------------------------------------------------- picture


def package_of(module: str) -> str:
    """The node a module is drawn as: its package at most two levels below its root package
    (epcc.sim, epcc.backends.cuda, epcc.runtime.engines), a top-level module as itself."""
    parts = module.split(".")
    depth = 3 if parts[:2] in (["epcc", "backends"], ["epcc", "runtime"]) else 2
    return ".".join(parts[:depth])


def package_edges(edges: list[Import]) -> list[tuple[str, str]]:
    return sorted({(package_of(e.src), package_of(e.dst)) for e in edges} - {(p, p) for p in
                                                                             {package_of(e.src) for e in edges}})


def mermaid(edges: list[Import], known: dict[str, Path]) -> str:
    """The package-level graph as a mermaid flowchart in a Markdown code block, one subgraph per
    top-level package, arrows from importer to imported."""
    nodes = sorted({package_of(m) for m in known})
    pedges = package_edges(edges)
    ident = {n: n.replace(".", "_") for n in nodes}
    groups: dict[str, list[str]] = {}
    for n in nodes:
        top = n.split(".")[1] if n.count(".") >= 1 and n.split(".")[1] in ("backends", "runtime") else "compiler"
        groups.setdefault(top, []).append(n)
    out = ["```mermaid", "flowchart TD"]
    for g in ("compiler", "backends", "runtime"):
        out.append(f"  subgraph {g}")
        out += [f"    {ident[n]}[\"{n}\"]" for n in groups.get(g, [])]
        out.append("  end")
    out += [f"  {ident[a]} --> {ident[b]}" for a, b in pedges]
    out.append("```")
    return "\n".join(out) + "\n"


def layer_table() -> str:
    """LAYERS as a Markdown table (the order of the table above).  A module name stands for the
    module and every module below it, unless marked (alone)."""
    out = ["| layer | modules | may import | what |", "| --- | --- | --- | --- |"]
    for name, (patterns, _, what) in LAYERS.items():
        may = ", ".join(sorted(allowed(name) - {name})) or "nothing"
        mods = ", ".join(f"`{p[1:]}` (alone)" if p.startswith("=") else f"`{p}`" for p in patterns)
        out.append(f"| {name} | {mods} | {may} | {what} |")
    return "\n".join(out) + "\n"


def document(edges: list[Import], known: dict[str, Path]) -> str:
    """What docs/architecture.md shows between its generated markers: the layers, then the graph."""
    return layer_table() + "\n" + mermaid(edges, known)


DOC = ROOT / "docs" / "architecture.md"
DOC_BEGIN, DOC_END = "<!-- import_graph.py: begin -->", "<!-- import_graph.py: end -->"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="import_graph.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="report layer violations and cycles; exit 1 if any")
    ap.add_argument("--local", action="store_true", help="list the function-local imports with their reasons")
    ap.add_argument("--update-doc", action="store_true", help="rewrite the generated block of docs/architecture.md")
    args = ap.parse_args(argv)
    known = modules()
    edges = imports(known)
    if args.local:
        for module, line, reason in local_imports(known):
            print(f"{module}:{line}  # {reason or '(no reason given)'}")
        return 0
    if args.check:
        problems = violations(edges, known)
        problems += [f"cycle: {' <-> '.join(c)}" for c in cycles(known, [(e.src, e.dst) for e in edges])]
        problems += [f"package cycle: {' <-> '.join(c)}" for c in cycles({package_of(m) for m in known},
                                                                           package_edges(edges))]
        print("\n".join(problems) if problems else f"{len(known)} modules, {len(edges)} imports: no violation, no cycle")
        return 1 if problems else 0
    if args.update_doc:
        text = DOC.read_text(encoding="utf-8")
        head, rest = text.split(DOC_BEGIN, 1)
        _, tail = rest.split(DOC_END, 1)
        DOC.write_text(head + DOC_BEGIN + "\n" + document(edges, known).strip("\n") + "\n" + DOC_END + tail,
                       encoding="utf-8")
        return 0
    sys.stdout.write(document(edges, known))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
