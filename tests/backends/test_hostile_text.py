"""User text in generated code: escaped, never injected (epcc.textsafe).

A file name, schedule title and step titles carrying a newline followed by `#error INJECTED`,
`*/` and `/*`, quotes, `#`, a trigraph `??/`, a trailing backslash, ANSI escape sequences,
bidirectional overrides (U+202E, U+2066) and, where a plan carries them, NUL, go through every
writer: the CUDA target (direct and table-driven kernels, launcher), the RDMA proxy loop (C), the
CPU backend's LLVM IR, `--emit mlir`, `epcc viz` (DOT and SVG) and `epcc simulate --gantt`.  Each
result is then compiled or parsed by the tool that reads it -- nvcc (`-arch=sm_90a -c`), the C
compiler with the RDMA build's warnings as errors, LLVM, the MLIR bindings, graphviz's `dot`, an
XML parser -- and no raw injected line or hidden character may survive.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from mlir import ir

from epcc import pipeline
from epcc.backends.cuda import codegen as cuda_codegen
from epcc.backends.cpu import codegen as cpu_codegen
from epcc.backends.rdma import emit as rdma_emit
from epcc.backends.rdma.sources import NATIVE_DIR
from epcc.cli import main
from epcc.dialect import new_context
from epcc.runtime.build_cache import CFLAGS, find_nvcc
from epcc.textsafe import (UnsafeText, c_comment, c_string, c_template_value, dot_text, llvm_comment, mlir_text,
                           svg_text, terminal)

REPO = Path(__file__).resolve().parents[2]
INJECT = "#error INJECTED"
# What a title may hold (a .sched string: no quote, no newline, no NUL) ...
TITLE = f"*/ {INJECT} /* \x1b[2J\x1b[31mred \u202eevil\u2066 ??/ #x 'q' \\"
# ... what a file name may hold besides (no '/', no NUL) ...
FILE_NAME = f"s\n{INJECT}\n*_ \"q\" 's' # \x1b[31mRED \u202eevil ??_ \\.sched"
# ... and what a plan.json may hold: anything.
ANY = f"x\n{INJECT}\r\n*/ /* \"q\" 's' #\x00nul \x1b[31mRED\x1b[0m \u202eevil\u2066 ??/ \ud800 \\"
HIDDEN = ("\x00", "\x1b", "\r", "\u202e", "\u2066", "\ud800")


def assert_clean(text: str, what: str) -> None:
    """No line of `text` starts with the injected directive; no hidden character is in it."""
    for n, line in enumerate(text.split("\n"), 1):
        assert not line.lstrip().startswith(INJECT), f"{what}:{n}: {line!r}"
    for ch in HIDDEN:
        assert ch not in text, f"{what}: raw {ch!r}"


# --------------------------------------------------------------------------- the escaping functions


def test_each_language_escapes_the_hostile_text_exactly():
    assert c_comment(ANY) == ("x\\n#error INJECTED\\r\\n*\\/ /\\* \"q\" 's' #\\x00nul \\x1b[31mRED\\x1b[0m "
                              "\\u202eevil\\u2066 ?\\?/ \\ud800 \\x5c")
    assert c_string(ANY) == ('"x\\012#error INJECTED\\015\\012*/ /* \\"q\\" \'s\' #\\000nul \\033[31mRED\\033[0m '
                             '\\342\\200\\256evil\\342\\201\\246 \\?\\?/ \\355\\240\\200 \\\\"')
    assert llvm_comment(ANY) == ("x\\n#error INJECTED\\r\\n*/ /* \"q\" 's' #\\x00nul \\x1b[31mRED\\x1b[0m "
                                 "\\u202eevil\\u2066 ??/ \\ud800 \\\\")
    assert mlir_text(ANY) == ("x\\n#error INJECTED\\r\\n*/ /* \"q\" 's' #\\x00nul \\x1b[31mRED\\x1b[0m "
                              "\\u202eevil\\u2066 ??/ \\ud800 \\")
    assert dot_text(ANY) == ("x\\\\n#error INJECTED\\\\r\\\\n*/ /* \\\"q\\\" 's' #\\\\x00nul \\\\x1b[31mRED\\\\x1b[0m "
                             "\\\\u202eevil\\\\u2066 ??/ \\\\ud800 \\\\")
    assert svg_text(ANY) == ("x\\n#error INJECTED\\r\\n*/ /* &quot;q&quot; &apos;s&apos; #\\x00nul "
                             "\\x1b[31mRED\\x1b[0m \\u202eevil\\u2066 ??/ \\ud800 \\")
    assert terminal(ANY) == ("x\\n#error INJECTED\\r\\n*/ /* \"q\" 's' #\\x00nul \\x1b[31mRED\\x1b[0m "
                             "\\u202eevil\\u2066 ??/ \\ud800 \\")
    # printable Unicode stays where a reader sees it; C sources and LLVM IR stay ASCII
    assert terminal("日本 é") == dot_text("日本 é") == svg_text("日本 é") == "日本 é"
    assert c_comment("日本") == "\\u65e5\\u672c" and llvm_comment("é") == "\\xe9"
    assert c_comment("a??????/") == "a?\\?\\?\\?\\?\\?/"  # no two question marks in a row


def test_a_template_that_forgets_to_escape_is_refused():
    for bad in ("a\nb", "*/", "/* x", 'say "hi"', "a\\", "??/", "\x1b[2J", "\u202e"):
        with pytest.raises(UnsafeText):
            c_template_value(bad)
    for ok in ("h200x4", "epcc_h200x4_dispatch_kernel", "step 'push' (p2p): 1.5 GB/s", 42, 1.5, None):
        assert c_template_value(ok) == ok
    assert c_template_value(c_string('say "hi"')) == '"say \\"hi\\""'  # escaped text passes


# --------------------------------------------------------------------------- the CLI end to end


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> Path:
    """h200x4.sched with a hostile title on the schedule and on every step, under a hostile name."""
    d = tmp_path_factory.mktemp("hostile")
    text = (REPO / "schedules" / "h200x4.sched").read_text(encoding="utf-8")
    text = re.sub(r'^(\s*step \w+) "[^"]*"', lambda m: f'{m.group(1)} "{TITLE}"', text, flags=re.M)
    text = re.sub(r"^schedule (\w+).*$", lambda m: f'schedule {m.group(1)} "{TITLE}"', text, count=1, flags=re.M)
    assert text.count(TITLE) >= 3
    path = d / FILE_NAME
    path.write_text(text, encoding="utf-8")
    return path


def _epcc(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    assert_clean(out, "stdout")
    assert_clean(err, "stderr")
    return rc, out, err


@pytest.fixture(scope="module")
def cuda_bundle(hostile, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle")
    assert main(["compile", str(hostile), "--target", "cuda", "-o", str(out)]) == 0
    return out / "cuda"


def test_cuda_sources_carry_the_hostile_text_escaped(cuda_bundle, hostile):
    files = sorted(p for p in cuda_bundle.iterdir() if p.suffix in (".cu", ".cuh"))
    assert {p.name for p in files} >= {"h200x4_direct.cu", "h200x4_launcher.cu", "h200x4_dispatch.cu",
                                      "h200x4_combine.cu", "epcc_cuda_device.cuh"}
    for p in files:
        text = p.read_text(encoding="ascii")  # C sources stay ASCII
        assert_clean(text, p.name)
    direct = (cuda_bundle / "h200x4_direct.cu").read_text(encoding="ascii")
    assert f"({c_comment(str(hostile))})," in direct.split("\n")[0]
    assert c_comment(TITLE) in direct


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc is not installed")
def test_nvcc_compiles_the_cuda_sources_of_the_hostile_schedule(cuda_bundle, tmp_path):
    sources = sorted(p for p in cuda_bundle.iterdir() if p.suffix == ".cu")

    def nvcc(src: Path) -> subprocess.CompletedProcess:
        return subprocess.run([find_nvcc(), "-arch=sm_90a", "-std=c++17", "-c", src.name, "-o",
                               str(tmp_path / (src.name + ".o"))], cwd=cuda_bundle, capture_output=True, text=True)

    with ThreadPoolExecutor(2) as pool:
        for src, r in zip(sources, pool.map(nvcc, sources)):
            assert r.returncode == 0, f"{src.name}:\n{r.stderr[-3000:]}"
            assert "INJECTED" not in r.stderr


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_rdma_proxy_loop_of_a_hostile_schedule_compiles(tmp_path, capsys):
    text = (REPO / "schedules" / "h200x4_2vnode.sched").read_text(encoding="utf-8")
    text = re.sub(r'^(\s*step \w+) "[^"]*"', lambda m: f'{m.group(1)} "{TITLE}"', text, flags=re.M)
    src = tmp_path / FILE_NAME
    src.write_text(text, encoding="utf-8")
    rc, _out, err = _epcc(["compile", str(src), "--target", "cuda", "--rdma", "proxy", "-o", str(tmp_path / "b")],
                          capsys)
    assert rc == 0, err
    loops = sorted((tmp_path / "b" / "cuda" / "rdma").glob("*_proxy.c"))
    assert len(loops) == 1
    loop = loops[0].read_text(encoding="ascii")
    assert_clean(loop, loops[0].name)
    assert c_comment(TITLE) in loop
    r = subprocess.run(["cc", *CFLAGS, f"-I{NATIVE_DIR}", "-fsyntax-only", str(loops[0])], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def test_emit_mlir_of_a_hostile_schedule_parses_back(hostile, capsys):
    rc, out, err = _epcc(["compile", str(hostile), "--emit", "mlir"], capsys)
    assert rc == 0, err
    module = ir.Module.parse(out, context=new_context())
    attrs = module.operation.attributes
    assert ir.StringAttr(attrs["epcc.title"]).value == mlir_text(TITLE)
    assert ir.StringAttr(attrs["epcc.source"]).value == mlir_text(str(hostile))


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' is not installed")
def test_viz_of_a_hostile_schedule_draws_dot_and_svg(hostile, tmp_path, capsys):
    for scheduled in ([], ["--scheduled"]):
        dot_file, svg_file = tmp_path / "g.dot", tmp_path / "g.svg"
        for f in (dot_file, svg_file):
            rc, out, err = _epcc(["viz", str(hostile), "-o", str(f), *scheduled], capsys)
            assert rc == 0 and " error: " not in err, err  # the titles' bidi controls draw warnings
            assert out.startswith(terminal(str(hostile)) + ": ")
        dot = dot_file.read_text(encoding="utf-8")
        assert_clean(dot, "viz dot")
        r = subprocess.run(["dot", "-Tsvg", str(dot_file)], capture_output=True, text=True)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        for svg in (r.stdout, svg_file.read_text(encoding="utf-8")):
            assert_clean(svg, "viz svg")
            ET.fromstring(svg.encode())
        if not scheduled:
            assert dot_text(TITLE) in dot


def test_gantt_of_a_hostile_schedule_is_valid_svg(hostile, tmp_path, capsys):
    gantt = tmp_path / "g.svg"
    rc, out, err = _epcc(["simulate", str(hostile), "--gantt", str(gantt)], capsys)
    assert rc == 0, err
    svg = gantt.read_text(encoding="utf-8")
    assert_clean(svg, "gantt")
    ET.fromstring(svg.encode())


# --------------------------------------------------------------------------- plans that carry anything


@pytest.fixture(scope="module")
def hostile_plan():
    """A compiled h200x4 plan whose schedule name, step titles and source carry ANY (a plan.json
    may hold what no .sched file can: NUL, newlines, quotes)."""
    plan = copy.deepcopy(pipeline.run(str(REPO / "schedules" / "h200x4.sched")).passes.get("plan"))
    plan.schedule = ANY
    for s in plan.steps:
        s.title = ANY
    return plan


def test_llvm_ir_of_a_hostile_plan_verifies(hostile_plan):
    text = cpu_codegen.llvm_ir(hostile_plan)  # parsed and verified by LLVM
    assert_clean(text, "LLVM IR")
    assert text.startswith(f"; epcc CPU backend: schedule '{llvm_comment(ANY)}', ")


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_rdma_proxy_source_of_a_hostile_plan_compiles(tmp_path):
    plan = copy.deepcopy(pipeline.run(str(REPO / "schedules" / "h200x4_2vnode.sched")).passes.get("plan"))
    plan.schedule = ANY
    for s in plan.steps:
        s.title = ANY
    text = rdma_emit.proxy_source(plan)
    assert_clean(text, "proxy loop")
    src = tmp_path / "loop.c"
    src.write_text(text, encoding="ascii")
    r = subprocess.run(["cc", *CFLAGS, f"-I{NATIVE_DIR}", "-fsyntax-only", str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc is not installed")
def test_cuda_sources_of_a_hostile_plan_compile(hostile_plan, tmp_path):
    bundle = cuda_codegen.generate(hostile_plan, source=ANY)
    sources = []
    for i, (name, text) in enumerate(bundle.files.items()):
        assert_clean(text, repr(name))
        if name == cuda_codegen.HEADER_FILE:
            (tmp_path / name).write_text(text, encoding="ascii")
        elif name.endswith(".cu"):  # the schedule's name names the files: here they get names of our own
            sources.append(f"f{i}.cu")
            (tmp_path / sources[-1]).write_text(text, encoding="ascii")
    assert len(sources) == 5  # dispatch, combine, launcher, the metadata kernels (table path), direct
    for name, path in bundle.static.items():  # the direct kernels' static headers, then their config
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(path.read_bytes())
    (tmp_path / "epcc_direct_config.cuh").write_text(bundle.files["epcc_direct_config.cuh"], encoding="ascii")

    def nvcc(src: str) -> subprocess.CompletedProcess:
        return subprocess.run([find_nvcc(), "-arch=sm_90a", "-std=c++17", "-c", src, "-o", src + ".o"],
                              cwd=tmp_path, capture_output=True, text=True)

    with ThreadPoolExecutor(2) as pool:
        for src, r in zip(sources, pool.map(nvcc, sources)):
            assert r.returncode == 0, f"{src}:\n{r.stderr[-3000:]}"
