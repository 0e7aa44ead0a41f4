"""The README's example schedule is real: it checks and compiles."""

from __future__ import annotations

import re
from pathlib import Path

from epcc.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_compiles(tmp_path, capsys):
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## The .sched language"):]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    assert "topology" in block and "dispatch" in block
    p = tmp_path / "readme.sched"
    p.write_text(block, encoding="utf-8")
    assert main(["check", str(p)]) == 0
    assert main(["compile", str(p), "-o", str(tmp_path / "bundle")]) == 0
    assert (tmp_path / "bundle" / "plan.json").exists()
    capsys.readouterr()


def test_readme_gives_the_two_commands_and_ci_runs_the_test_one():
    text = README.read_text(encoding="utf-8")
    assert "```sh\nmake demo\n```" in text and "```sh\nmake test\n```" in text
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^make test$", ci, re.M)
