"""Robustness of the front end and the checker against broken and random input.

(a) Mutation fuzzing: every shipped schedule in schedules/ is broken in random ways (tokens and
    lines deleted, duplicated, swapped; numbers and names replaced; punctuation inserted; the
    file truncated; a byte of its UTF-8 encoding flipped) and fed to `epcc check` and
    `epcc compile --emit model`.  Whatever the input, the CLI must answer 0 or 1, never raise,
    and never print a traceback or an "internal compiler error".
(b) Grammar fuzzing: hypothesis.extra.lark.from_lark generates texts from the project's own
    grammar (every token followed by a space, names from a small vocabulary, small integers).
    Every text must check OK or fail with a CompileError, never another exception, and parsing
    must be deterministic.

Bounded for a 2-core machine (the whole file runs in well under a minute); set
EPCC_FUZZ_SCALE=10 (or more) for a longer local run.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from math import prod
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.lark import from_lark

from epcc.cli import main
from epcc.diagnostics import CompileError
from epcc.frontend import ast
from epcc.frontend.grammar import lark_parser as _parser
from epcc.frontend.parser import parse_text
from epcc.pipeline import describe_schedule
from epcc.sema.check import analyze

REPO = Path(__file__).resolve().parents[2]
SCHEDULES = {p.name: p.read_text(encoding="utf-8") for p in sorted((REPO / "schedules").glob("*.sched"))}
SCALE = max(1, int(os.environ.get("EPCC_FUZZ_SCALE", "1")))


def _settings(n: int):
    return settings(max_examples=n * SCALE, deadline=None, derandomize=SCALE == 1,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])




def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)  # must not raise: main() turns every error into an exit status
    return rc, out.getvalue(), err.getvalue()


def assert_clean(rc: int, err: str, source: bytes) -> None:
    shown = source.decode("utf-8", "replace")
    assert "Traceback" not in err, shown
    assert "internal compiler error" not in err, f"{err}\n--- input ---\n{shown}"
    assert rc in (0, 1), f"exit {rc}\n{err}\n--- input ---\n{shown}"
    if rc == 1:
        assert err.strip(), "exit 1 without a diagnostic"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


# --------------------------------------------------------------------------- (a) mutations

TOKEN = re.compile(r'"[^"\n]*"|#[^\n]*|[A-Za-z_][A-Za-z0-9_]*|\d+\.\d+|\d+|->|\S')
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])")
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Replacement numbers: zero, negative, huge (past every limit, so no slow topology; 400 digits is
# past float range), decimal.
NUMBERS = ["0", "-1", "1000000000000", "99999999999999999999999999", "9" * 400, "1.5", "0.0", "3", "7"]
PUNCT = list(",.;:{}()[]<>=+-*/%^&|!@$?\"'#\\\t\n") + ["->", "é", "\u00a0", "\x7f"]


def _cut(draw, n: int) -> int:
    return draw(st.integers(0, n - 1))


def _delete_token(draw, text: str) -> str:
    toks = [m for m in TOKEN.finditer(text) if not m.group().startswith("#")]
    if not toks:
        return text
    m = toks[_cut(draw, len(toks))]
    return text[: m.start()] + text[m.end():]


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def _delete_line(draw, text: str) -> str:
    ls = _lines(text)
    if not ls:
        return text
    del ls[_cut(draw, len(ls))]
    return "".join(ls)


def _duplicate_line(draw, text: str) -> str:
    ls = _lines(text)
    if not ls:
        return text
    i = _cut(draw, len(ls))
    ls.insert(i, ls[i])
    return "".join(ls)


def _swap_lines(draw, text: str) -> str:
    ls = _lines(text)
    if not ls:
        return text
    i, j = _cut(draw, len(ls)), _cut(draw, len(ls))
    ls[i], ls[j] = ls[j], ls[i]
    return "".join(ls)


def _replace_number(draw, text: str) -> str:
    nums = list(NUMBER.finditer(text))
    if not nums:
        return text
    m = nums[_cut(draw, len(nums))]
    return text[: m.start()] + draw(st.sampled_from(NUMBERS)) + text[m.end():]


def _replace_name(draw, text: str) -> str:
    names = [m for m in IDENT.finditer(text)]
    if not names:
        return text
    m = names[_cut(draw, len(names))]
    other = draw(st.one_of(st.sampled_from(sorted({n.group() for n in names})),
                           st.from_regex(r"[a-z_][a-z0-9_]{0,7}", fullmatch=True)))
    return text[: m.start()] + other + text[m.end():]


def _insert_punct(draw, text: str) -> str:
    i = draw(st.integers(0, len(text)))
    return text[:i] + draw(st.sampled_from(PUNCT)) + text[i:]


def _truncate(draw, text: str) -> str:
    # Mostly past the leading comment block: a file of comments only is one case, not many.
    body = re.search(r"^[^#\s]", text, re.M)
    lo = body.start() if body and draw(st.integers(0, 9)) else 0
    return text[: draw(st.integers(lo, len(text)))]


MUTATIONS = [_delete_token, _delete_line, _duplicate_line, _swap_lines, _replace_number, _replace_name,
             _insert_punct, _truncate]


@st.composite
def mutants(draw) -> tuple[str, bytes]:
    name = draw(st.sampled_from(sorted(SCHEDULES)))
    text = SCHEDULES[name]
    for _ in range(draw(st.integers(1, 3))):
        if not text:
            break
        text = draw(st.sampled_from(MUTATIONS))(draw, text)
    data = text.encode("utf-8")
    if data and draw(st.booleans()) and draw(st.booleans()):  # flip a byte, 1 in 4
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]
    return name, data


def test_shipped_schedules_are_the_fuzz_seeds():
    assert SCHEDULES, "no schedules/*.sched to mutate"
    for name in SCHEDULES:
        rc, out, err = run_cli(["check", str(REPO / "schedules" / name)])
        assert rc == 0 and " error: " not in err, err
        assert ": ok: " in out


@_settings(150)
@given(mutants())
def test_mutated_schedules_never_crash(workdir, case):
    name, data = case
    path = workdir / f"mutant_{name}"
    path.write_bytes(data)
    rc, out, err = run_cli(["check", str(path)])
    assert_clean(rc, err, data)
    rc2, out2, err2 = run_cli(["compile", str(path), "--emit", "model"])
    assert_clean(rc2, err2, data)
    if rc == 3 or rc2 == 3:
        return  # a known internal error (assert_clean let it through)
    # Both commands run the same front end and checker: they agree on whether the file is good.
    assert rc == rc2
    if rc == 0:
        assert out.endswith("\n") and ": ok: " in out
        assert out2.startswith("schedule ")
    else:
        assert out == out2 == ""
        assert err == err2  # the same diagnostics, in the same order


# --------------------------------------------------------------------------- (b) grammar

VOCAB = [
    # levels, groups, relations, links, buffers and steps of the shipped schedules
    "node", "card", "die", "gpu", "vnode", "peer", "mate", "twin", "far", "nvlink", "blink", "nic", "hbm", "d2d",
    "input", "output", "result", "sendbuf", "stage", "push", "keep", "meta", "final",
    # words the checker gives a meaning to
    "me", "all", "rank", "p2p", "local", "rdma", "sm", "spc", "dma", "bf16", "fp8", "blocked", "strided",
    "travel", "stay", "counts", "routing", "layout", "none", "dispatch",
    # units
    "GB", "s", "us", "ns", "tokens", "token", "MiB", "B", "KB",
]


def _grammar_strategy(start: str | None = None):
    g = _parser()
    terminals, rules, ignore = g.grammar.compile([start or "start"], ())
    used = {t.name for t in terminals} | set(ignore)
    used |= {s.name for r in rules for s in r.expansion if s.is_term}
    explicit = {}
    for t in g.terminals:
        if t.pattern.type == "str":
            explicit[t.name] = st.just(t.pattern.value + " ")  # every token ends with a space
    explicit.update(
        NAME=st.one_of(st.sampled_from(VOCAB), st.from_regex(r"[a-z][a-z0-9_]{0,4}", fullmatch=True)).map(
            lambda s: s + " "),
        # Small integers: `levels a 9, b 9, c 9` with `any` relations would be slow, not wrong.
        INT=st.sampled_from(["0", "1", "2", "2", "3", "4", "8"]).map(lambda s: s + " "),
        DECIMAL=st.sampled_from(["0.5", "1.5", "2.0"]).map(lambda s: s + " "),
        STRING=st.just('"t" '),
        ALL_TOKENS=st.just("all tokens "),
        COMMENT=st.just("# c\n"),
        WS=st.sampled_from([" ", "\n"]),
    )
    return from_lark(g, start=start, explicit={k: v for k, v in explicit.items() if k in used})


def _small(f: ast.File) -> bool:
    """Topologies small enough to evaluate quickly (relations are evaluated rank by rank)."""
    return all(prod(max(lv.count, 1) for lv in t.levels) <= 256 for t in f.topologies)


def _check_text(text: str) -> None:
    try:
        f = parse_text(text, "gen.sched")
    except CompileError as e:
        assert e.diagnostics and all(d.message for d in e.diagnostics)
        return
    # Parsing is a function of the text: a second parse gives the same AST.
    assert ast.dump(parse_text(text, "gen.sched")) == ast.dump(f)
    assume(_small(f))
    try:
        sched, warnings = analyze(f)
    except CompileError as e:
        assert e.diagnostics
        assert all(d.severity in ("error", "warning") and d.message for d in e.diagnostics)
        return
    assert describe_schedule(sched).startswith("schedule ")


@_settings(120)
@given(_grammar_strategy())
def test_generated_files_check_or_fail_cleanly(text):
    _check_text(text)


@_settings(40)
@given(_grammar_strategy())
def test_parsing_is_deterministic(text):
    try:
        t1 = _parser().parse(text)
    except Exception as e:  # noqa: BLE001 - a lark error must be the same error again
        with pytest.raises(type(e)):
            _parser().parse(text)
        return
    assert _parser().parse(text) == t1


# Generated pieces spliced into a valid schedule reach deeper into the checker than whole
# generated files (which mostly stop at the first missing declaration).  A piece goes just before
# the closing brace of its block, in any shipped schedule.
SPLICE_BLOCK = {"topo_item": "topology", "wl_item": "workload", "prog_item": "dispatch", "step": "dispatch"}


def _block_end(text: str, head: str) -> int | None:
    m = re.search(rf"^{head}\b", text, re.M)
    if m is None:
        return None
    end = re.compile(r"^}", re.M).search(text, m.end())
    return end.start() if end else None


@_settings(100)
@given(st.sampled_from(sorted(SCHEDULES)),
       st.sampled_from(sorted(SPLICE_BLOCK)).flatmap(lambda k: st.tuples(st.just(k), _grammar_strategy(k))))
def test_generated_pieces_in_a_valid_schedule(name, piece):
    kind, snippet = piece
    base = SCHEDULES[name]
    i = _block_end(base, SPLICE_BLOCK[kind])
    assume(i is not None)
    text = base[:i] + "  " + snippet + "\n" + base[i:]
    try:
        f = parse_text(text, "gen.sched")
    except CompileError:
        return
    assume(_small(f))
    try:
        sched, _warnings = analyze(f)
    except CompileError as e:
        assert e.diagnostics
    else:
        assert describe_schedule(sched).startswith("schedule ")


# --------------------------------------------------------------------------- former crashes

# Mutations that once crashed the compiler (a send whose buffer does not resolve reached the link
# check without its relation; 400-digit numbers overflowed floats): now plain user errors.
FORMER_CRASHES = {
    "unresolved send buffer": ("from input to peer.output over nvlink", "from inptu to peer.output over nvlink"),
    "400-digit chunk": ("chunk 128 tokens", "chunk " + "9" * 400 + " tokens"),
}


@pytest.mark.parametrize("what", sorted(FORMER_CRASHES))
def test_former_internal_errors_are_user_errors(workdir, what):
    old, new = FORMER_CRASHES[what]
    base = SCHEDULES["h200x4.sched"]
    assert base.count(old) == 1
    path = workdir / "former_ice.sched"
    path.write_text(base.replace(old, new), encoding="utf-8")
    rc, _out, err = run_cli(["check", str(path)])
    assert "internal compiler error" not in err and "Traceback" not in err
    assert rc == 1 and f"{path}:" in err
