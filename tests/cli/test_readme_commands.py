"""Every ``pdx ...`` command line shown in README.md and docs/*.md still parses: its command
exists, every option it names exists, and every value converts (typer's own parser, nothing
run). Synopsis lines (``[--json]``, ``FILE``) are not examples and are left out."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from typer._click.core import Context

from pdx.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"^(?:\$ )?(?:sudo )?(?:\.venv/bin/)?pdx (.*)$")
SYNOPSIS = re.compile(r"\[--|\[[A-Z]| — |\b[A-Z]{3,}\b(?![=_])")


def readme_commands(page: Path) -> list[tuple[int, str]]:
    """(line number, the command's arguments) of each ``pdx`` line in README's code blocks,
    continuation lines joined, comments and anything after a pipe or redirect cut."""
    found: list[tuple[int, str]] = []
    in_code, pending, start = False, "", 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if not in_code:
            continue
        if pending:
            pending += " " + line.strip()
        else:
            match = COMMAND.match(line.strip())
            if not match:
                continue
            pending, start = match.group(1), number
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        text = re.split(r"\s(?:#|\||>|2>|&&)\s|;", " " + pending + " ", maxsplit=1)[0].strip()
        if not SYNOPSIS.search(text):
            found.append((start, text))
        pending = ""
    return found


COMMANDS = [(page, n, text) for page in PAGES for n, text in readme_commands(page)]


def parse(args: list[str]) -> str:
    """Resolve the command chain and parse its options; returns the command path."""
    cmd = typer.main.get_command(app)
    ctx: Context = cmd.make_context("pdx", args)
    while hasattr(cmd, "resolve_command"):
        rest = [*ctx._protected_args, *ctx.args]  # the subcommand's name, then its arguments
        name, sub, rest = cmd.resolve_command(ctx, rest)
        assert sub is not None, f"no command {name}"
        ctx = sub.make_context(name or "", rest, parent=ctx)
        cmd = sub
    return ctx.command_path


def test_readme_shows_commands() -> None:
    assert sum(page.name == "README.md" for page, _, _ in COMMANDS) >= 15


@pytest.mark.parametrize(
    ("page", "line", "text"), COMMANDS, ids=[f"{p.name}:{n}" for p, n, _ in COMMANDS]
)
def test_shown_command_parses(page: Path, line: int, text: str, tmp_path: Path) -> None:
    # placeholders (<run A>) stand for paths the reader supplies
    text = re.sub(r"<[^>]+>", str(tmp_path), text)
    assert parse(shlex.split(text)).startswith("pdx")
