"""The README and the docs stay true: the README's example schedule checks and compiles, its
commands table names every subcommand, the Markdown docs' links resolve, and no Markdown file
dates a fact by work session, tracker issue or rented machine instead of date and hardware."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

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


def _subcommands(capsys) -> list[str]:
    """The subcommands `epcc --help` lists (its positional-arguments section)."""
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    section = out[out.index("positional arguments"):out.index("options")]
    return re.findall(r"^ {4}([a-z]+) +\S", section, re.M)


def test_readme_commands_table_names_every_subcommand(capsys):
    commands = _subcommands(capsys)
    assert len(commands) >= 6, commands
    table = README.read_text(encoding="utf-8").split("## Commands", 1)[1].split("\n## ", 1)[0]
    missing = [c for c in commands if f"`epcc {c} " not in table]
    assert not missing, f"README's commands table lacks {missing}"


ROOT = README.parent
DOCS = [README, ROOT / "bench" / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / "results").glob("*.md"))]


def test_markdown_links_point_at_files():
    broken = []
    for md in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", md.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (md.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


# The docs speak of the product: measurements carry their date and hardware ("2 x H200,
# 2026-11-23"), not the work session, tracker issue or rented machine that produced them.
HISTORY = re.compile(r"session [0-9]|issue [0-9]|nvidia-h[0-9]", re.I)


def _tracked_markdown() -> list[Path]:
    """The Markdown files of the tree (git's list where this is a checkout: not what a local run
    left in ignored folders), else every one outside the usual build and tool folders."""
    r = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"], cwd=ROOT,
                       capture_output=True, text=True)
    if r.returncode == 0:
        return sorted(ROOT / f for f in r.stdout.splitlines() if f)
    skip = {".git", ".venv", "build", "node_modules"}
    return sorted(md for md in ROOT.rglob("*.md") if not skip & set(md.relative_to(ROOT).parts))


def test_markdown_has_no_history_markers():
    found = []
    for md in _tracked_markdown():
        for n, line in enumerate(md.read_text(encoding="utf-8").splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{md.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not found, "\n".join(found)
