"""Golden tests of `epcc check` diagnostics.

Every `cases/NAME.sched` is a small schedule with exactly one thing broken (a few cases break
several on purpose).  `cases/NAME.expected` holds the EXACT stderr of

    epcc check tests/sema/cases/NAME.sched

run from the repository root, so locations read `tests/sema/cases/NAME.sched:L:C`.  After an
intended change to a message, regenerate with `.venv/bin/python tests/sema/regen_expected.py`
and review the diff by eye.

Cases named `warn_*` only draw warnings: they exit 0 and print the ok line on stdout.  Cases
named `regress_*` reproduced compiler bugs (crashes, cascading "unknown" errors, misleading
messages) that are fixed now: besides their golden text, `REGRESSIONS` checks the behaviour
that fixed them, so a careless regen cannot bring a bug back.

Inputs that cannot live in the repository as a case (binary, non-UTF-8, missing file, a
directory) are written by the tests themselves into tmp_path.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import pytest

from epcc.cli import main

REPO = Path(__file__).resolve().parents[2]
CASES = Path(__file__).resolve().parent / "cases"
CASES_REL = CASES.relative_to(REPO).as_posix()

HEADER = re.compile(r"^(?P<loc>\S+:\d+:\d+|epcc): (?P<sev>error|warning): (?P<msg>.*)$")


def run_check(rel_path: str, capsys) -> tuple[int, str, str]:
    """`epcc check REL_PATH` in-process (the caller is at the repo root)."""
    capsys.readouterr()
    rc = main(["check", rel_path])
    out, err = capsys.readouterr()
    return rc, out, err


def headers(err: str) -> list[str]:
    return [line for line in err.splitlines() if HEADER.match(line)]


def assert_no_crash(err: str) -> None:
    assert "Traceback" not in err
    assert "internal compiler error" not in err


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch):
    monkeypatch.chdir(REPO)


# --------------------------------------------------------------------------- known bugs


def _loc(name: str, needle: str, nth: int = 0) -> str:
    """`path:L:C` of the nth occurrence of NEEDLE in case NAME (1-based line and column)."""
    text = (CASES / f"{name}.sched").read_text(encoding="utf-8")
    pos = -1
    for _ in range(nth + 1):
        pos = text.index(needle, pos + 1)
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return f"{CASES_REL}/{name}.sched:{line}:{col}"


def _reports(name: str, needle: str, message: str, nth: int = 0) -> Callable[[int, str], None]:
    """The fix reports MESSAGE at NEEDLE, exits 1 and does not crash."""

    def check(rc: int, err: str) -> None:
        assert_no_crash(err)
        assert rc == 1
        assert f"{_loc(name, needle, nth)}: error: {message}" in err.splitlines()

    return check


def _reported_once(message_part: str) -> Callable[[int, str], None]:
    def check(rc: int, err: str) -> None:
        assert rc == 1
        hits = [h for h in headers(err) if message_part in h]
        assert len(hits) == 1, hits
        assert len(headers(err)) == len(set(headers(err))), "a diagnostic is printed twice"

    return check


def _not_called_unknown(present: str, absent: str) -> Callable[[int, str], None]:
    """The real error is reported, and the declared-but-broken name is not called unknown."""

    def check(rc: int, err: str) -> None:
        assert rc == 1
        assert any(present in h for h in headers(err)), err
        assert absent not in err, err

    return check


def _expected_list_is_precise(rc: int, err: str) -> None:
    first = err.splitlines()[0]
    assert rc == 1
    assert "unexpected character ';'" in first
    # In a link block after 'bandwidth 100 GB/s' only link properties or '}' may follow.
    assert "'after'" not in first and "'defaults'" not in first, first
    assert "'}'" in first and "'latency'" in first, first


def _rejected_at_line(name: str, line: int, mentions: str = "") -> Callable[[int, str], None]:
    def check(rc: int, err: str) -> None:
        assert_no_crash(err)
        assert rc == 1
        assert any(h.startswith(f"{CASES_REL}/{name}.sched:{line}:") and mentions in h for h in headers(err)), err

    return check


ICE = "internal compiler error (AttributeError on st.relation = None): sema/program.py runs the link check " \
      "of a send/pull step after _transfer() failed"

OVERFLOW = "internal compiler error (OverflowError: cannot convert float infinity to integer): the AST keeps " \
           "numbers as float, so a number of more than 308 digits becomes inf"

# name -> (what was wrong, what the compiler must do)
REGRESSIONS: dict[str, tuple[str, Callable[[int, str], None]]] = {
    "regress_send_unknown_buffer": (
        ICE, _reports("regress_send_unknown_buffer", "inptu", "unknown buffer 'inptu'")),
    "regress_send_unknown_relation": (
        ICE, _reports("regress_send_unknown_relation", "pear.output", "unknown relation 'pear'")),
    "regress_send_from_remote_buffer": (
        ICE, _reports("regress_send_from_remote_buffer", "peer.input",
                      "a send reads the executing rank's own buffer")),
    "regress_pull_into_remote_buffer": (
        ICE, _reports("regress_pull_into_remote_buffer", "peer.output",
                      "a pull writes the executing rank's own buffer")),
    "regress_pull_from_local_buffer": (
        ICE, _reports("regress_pull_from_local_buffer", "input into output over nv",
                      "a pull reads another rank's buffer: write '<relation>.input'")),
    "regress_pull_from_two_relations": (
        ICE, _reports("regress_pull_from_two_relations", "pull tokens for me",
                      "a pull reads from one relation at a time, not from next, peer")),
    "regress_send_to_local_buffer": (
        ICE, _reports("regress_send_to_local_buffer", "stage over nv",
                      "a send writes another rank's buffer: write '<relation>.stage'")),
    "regress_relation_error_reported_twice": (
        "a broken relation that a link (or another relation) refers to is evaluated, and its error "
        "reported, once per reference", _reported_once("unknown level or group 'gup'")),
    "regress_broken_relation_called_unknown": (
        "a relation that is declared but has an error is later called \"unknown rank set 'bad'\"",
        _not_called_unknown("maps rank 3 (node 0, gpu 3) to gpu 4", "unknown rank set 'bad'")),
    "regress_broken_link_called_unknown": (
        "a link that is declared but has an error is later called \"unknown link 'nv'\" at every 'over nv'",
        _not_called_unknown("a link needs at least 1 lane, not 0", "unknown link 'nv'")),
    "regress_unexpected_character_expected_list": (
        "for an unexpected character the 'expected' list comes from the LALR-merged lexer state: "
        "inside a link block it offers step options ('after', 'chunk', 'defaults', ...) and cuts off "
        "the link properties and '}'", _expected_list_is_precise),
    "regress_infinite_bandwidth": (
        "a bandwidth too large for a float becomes inf and is accepted ('inf GB/s' in --emit model)",
        _rejected_at_line("regress_infinite_bandwidth", 7)),
    "regress_huge_chunk_in_tokens": (
        OVERFLOW + " (parse_size: int(q.value))", _rejected_at_line("regress_huge_chunk_in_tokens", 24)),
    "regress_huge_chunk_in_bytes": (
        OVERFLOW + " (parse_size: int(b))", _rejected_at_line("regress_huge_chunk_in_bytes", 24)),
    "regress_huge_efficiency": (
        OVERFLOW + " (topology._num() in the efficiency range error)", _rejected_at_line("regress_huge_efficiency", 13)),
    "regress_broken_buffer_called_unknown": (
        "a buffer that is declared but has an error (capacity 0) is later called \"unknown buffer 'stage'\" "
        "with the note \"declare it: 'buffer stage'\"",
        _not_called_unknown("a buffer capacity must be at least 1 token", "unknown buffer 'stage'")),
    "regress_decimal_where_integer_expected": (
        "'topk 2.5' is reported as \"unexpected '.'; expected one of 'dtype', ...\" at the '.': the contextual "
        "lexer splits 2.5 into 2 and '.', so the message never mentions the number the user wrote",
        _rejected_at_line("regress_decimal_where_integer_expected", 19, "2.5")),
    "regress_exponent_where_integer_expected": (
        "'topk 1e1' was reported as \"unexpected name 'e1'\": the lexer split 1e1 into 1 and a name",
        _rejected_at_line("regress_exponent_where_integer_expected", 19, "1e1")),
}


# --------------------------------------------------------------------------- golden cases

ALL_CASES = sorted(p.stem for p in CASES.glob("*.sched"))
GOLDEN_CASES = ALL_CASES


def expected_text(name: str) -> str:
    return (CASES / f"{name}.expected").read_text(encoding="utf-8")


def test_case_files_are_consistent():
    assert len(GOLDEN_CASES) >= 35
    expected = {p.stem for p in CASES.glob("*.expected")}
    missing = sorted(set(GOLDEN_CASES) - expected)
    assert not missing, f"cases without .expected (run tests/sema/regen_expected.py): {missing}"
    orphans = sorted(expected - set(GOLDEN_CASES))
    assert not orphans, f".expected files without a case: {orphans}"
    assert sorted(REGRESSIONS) == sorted(n for n in ALL_CASES if n.startswith("regress_"))


@pytest.mark.parametrize("name", GOLDEN_CASES)
def test_golden(name, capsys):
    rel = f"{CASES_REL}/{name}.sched"
    rc, out, err = run_check(rel, capsys)
    assert_no_crash(err)
    if name.startswith("warn_"):
        assert rc == 0
        assert out.startswith(f"{rel}: ok: ")
        assert " error: " not in err and ": warning: " in err
    else:
        assert rc == 1
        assert out == ""
    hs = headers(err)
    assert hs, "no located diagnostic"
    assert len(hs) == len(set(hs)), "a diagnostic is printed twice"
    assert err == expected_text(name)


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_regression(name, capsys):
    rc, _out, err = run_check(f"{CASES_REL}/{name}.sched", capsys)
    REGRESSIONS[name][1](rc, err)


# Spot checks on the golden files themselves, so that a careless regen cannot pin nonsense
# for the central diagnostics.  Each names the exact header line that must stay.
PINNED = {
    "syntax_unexpected_token": "2:14: error: unexpected ','; expected an integer",
    "syntax_misspelled_keyword": "24:14: error: unexpected name 'sned'; expected one of 'copy', 'exchange', "
                                 "'permute', 'pull', 'reduce' or 'send'",
    "syntax_unexpected_character": "1:12: error: unexpected character '@'; expected '{'",
    "unknown_link": "24:66: error: unknown link 'nvl'",
    "duplicate_step": "26:8: error: duplicate step 'push'",
    "step_link_does_not_connect": "32:67: error: link 'nv' does not connect rank 0 (node 0, card 0) to "
                                  "rank 4 (node 1, card 0) ('hop' sends to its 'far')",
    "dependency_cycle": "32:70: error: dependency cycle: hop -> keep -> hop",
    "level_count_zero": "2:15: error: level 'node' has count 0; it must be at least 1",
    "unknown_layout": "19:10: error: unknown output layout 'tokens'",
    "duplicate_layout": "20:3: error: 'layout' is given twice in the workload",
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_pinned_headers(name):
    assert f"{CASES_REL}/{name}.sched:{PINNED[name]}" in expected_text(name).splitlines()


DID_YOU_MEAN = {
    "syntax_misspelled_keyword": "send", "syntax_misspelled_toplevel": "workload",
    "unknown_relation_in_link": "peer", "unknown_relation_in_step": "peer", "unknown_level_rank": "gpu",
    "unknown_level_in_rule": "gpu", "unknown_group_in_rule": "pair", "unknown_buffer": "input",
    "unknown_link": "nv", "unknown_step_in_after": "push", "unknown_step_in_parallel": "push",
    "unknown_table": "mate", "unknown_table_column": "mate", "unknown_rank_set": "peer",
    "unknown_rank_set_member": "gpu", "unknown_name_in_index_map": "gpu", "unsupported_dtype": "bf16",
    "unknown_layout": "token",
}


@pytest.mark.parametrize("name", sorted(DID_YOU_MEAN))
def test_did_you_mean(name):
    assert f"note: did you mean '{DID_YOU_MEAN[name]}'?" in expected_text(name).splitlines()


FIRST_DEFINED = ["duplicate_level", "duplicate_relation", "duplicate_link", "duplicate_buffer", "duplicate_step",
                 "duplicate_program", "duplicate_topology"]


@pytest.mark.parametrize("name", FIRST_DEFINED)
def test_duplicates_point_at_first_definition(name):
    lines = expected_text(name).splitlines()
    err = next(i for i, l in enumerate(lines) if " error: duplicate" in l)
    note = next(i for i, l in enumerate(lines) if l.endswith(": note: first defined here"))
    err_at = tuple(int(x) for x in lines[err].split(":")[1:3])
    note_at = tuple(int(x) for x in lines[note].split(":")[1:3])
    assert note > err and note_at < err_at


def test_several_errors_are_all_reported():
    text = expected_text("several_errors_across_phases")
    assert len([h for h in headers(text) if " error: " in h]) == 3
    assert text.endswith("\n3 errors generated.\n")


# --------------------------------------------------------------------------- file-level errors


def test_binary_file(tmp_path, capsys):
    p = tmp_path / "blob.sched"
    p.write_bytes(b"topology t {\x00\x01\x02}\n")
    rc, out, err = run_check(str(p), capsys)
    assert (rc, out) == (1, "")
    assert err == f"{p}:1:13: error: NUL byte: a binary file? expected .sched text\n"  # where the first NUL is


def test_non_utf8_file_at_start(tmp_path, capsys):
    p = tmp_path / "latin.sched"
    p.write_bytes(b"\xff\xfetopology t {}\n")
    rc, out, err = run_check(str(p), capsys)
    assert (rc, out) == (1, "")
    assert err == f"{p}:1:1: error: file is not valid UTF-8 (byte 0xff)\n"


def test_non_utf8_byte_is_located(tmp_path, capsys):
    p = tmp_path / "latin1.sched"
    p.write_bytes("# ok\n\n  relation pe".encode() + b"\xe9" + b"r = other gpu\n")
    rc, out, err = run_check(str(p), capsys)
    assert (rc, out) == (1, "")
    assert err == f"{p}:3:14: error: file is not valid UTF-8 (byte 0xe9)\n"


def test_utf8_bom_is_accepted(tmp_path, capsys):
    p = tmp_path / "bom.sched"
    p.write_bytes(b"\xef\xbb\xbf" + (REPO / "schedules" / "h200x4.sched").read_bytes())
    rc, out, err = run_check(str(p), capsys)
    assert (rc, err) == (0, "")
    assert out.startswith(f"{p}: ok: 4 ranks")


def test_missing_file(tmp_path, capsys):
    p = tmp_path / "nope.sched"
    rc, out, err = run_check(str(p), capsys)
    assert (rc, out) == (1, "")
    assert err == f"epcc: error: {p}: no such file\n"


def test_directory_as_file(tmp_path, capsys):
    d = tmp_path / "dir.sched"
    d.mkdir()
    rc, out, err = run_check(str(d), capsys)
    assert (rc, out) == (1, "")
    assert err == f"epcc: error: {d}: is a directory, not a .sched file\n"
