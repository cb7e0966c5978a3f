"""Every command's help, and every command's answer to a value of the wrong type.

Walks the whole command tree: each option has help text, each help text appears whole in the
rendered ``--help`` (nothing eaten as markup or cut), flags show no type, and a bad number on
the command line is one ``error:`` line naming the option and the value, exit 2.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import typer
from typer.testing import CliRunner

from pdx.cli.main import app

WIDE = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}


def _commands() -> Iterator[tuple[list[str], typer.core.TyperCommand]]:
    """(path, click command) for every command and group under ``pdx``."""
    root = typer.main.get_command(app)
    stack: list[tuple[list[str], typer.core.TyperCommand]] = [([], root)]
    while stack:
        path, cmd = stack.pop()
        yield path, cmd
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):
            if not getattr(sub, "hidden", False):
                stack.append(([*path, name], sub))


COMMANDS = list(_commands())
NUMERIC = [
    (path, param)
    for path, cmd in COMMANDS
    for param in cmd.params
    if isinstance(param, typer.core.TyperOption)
    and not param.is_flag
    and param.bare_type() in {"int", "float"}
]


def _words(text: str) -> list[str]:
    return re.sub(r"[│╭╮╰╯─┃━]", " ", text).split()


def _in_order(needle: list[str], hay: list[str]) -> bool:
    it = iter(hay)
    return all(any(word == h for h in it) for word in needle)


@pytest.mark.parametrize(("path", "cmd"), COMMANDS, ids=[" ".join(p) or "pdx" for p, _ in COMMANDS])
def test_help_shows_every_option_whole(path: list[str], cmd: typer.core.TyperCommand) -> None:
    result = CliRunner().invoke(app, [*path, "--help"], env=WIDE, prog_name="pdx")
    assert result.exit_code == 0, result.output
    shown = _words(result.output)
    assert "<bool>" not in result.output, "a flag takes no value: its help shows no type"
    for param in cmd.params:
        if getattr(param, "hidden", False) or param.name in {"help"}:
            continue
        text = (getattr(param, "help", None) or "").strip()
        if isinstance(param, typer.core.TyperOption):
            assert text, f"pdx {' '.join(path)} {param.opts[0]}: no help text"
        if text:
            # every word, in order: nothing taken as markup ("[last GO, ...]") or cut off
            assert _in_order(_words(text), shown), f"{param.name}: {text!r} not shown whole"
            assert not re.search(r"\(\s*\)|\(\s|\s\)", text), f"{param.name}: {text!r}"


@pytest.mark.parametrize(
    ("path", "param"),
    NUMERIC,
    ids=[f"{' '.join(p)} {max(o.opts, key=len)}" for p, o in NUMERIC],
)
def test_a_bad_number_is_one_line_naming_the_option(
    path: list[str], param: typer.core.TyperOption
) -> None:
    name = max(param.opts, key=len)
    result = CliRunner().invoke(app, [*path, name, "many"], env=WIDE, prog_name="pdx")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {name}: got 'many'"), lines[0]


def test_usage_errors_are_one_line() -> None:
    runner = CliRunner()
    unknown = runner.invoke(app, ["probe-link", "--kv-gbp", "3"], prog_name="pdx")
    assert unknown.exit_code == 2
    assert unknown.stderr.strip() == (
        "error: --kv-gbp: no such option (did you mean --kv-gbps, --kv-op, --kv-target?)"
        " (see 'pdx probe-link --help')"
    )
    flag_value = runner.invoke(app, ["measure-kv", "--json", "true"])
    assert flag_value.exit_code == 2 and len(flag_value.stderr.strip().splitlines()) == 1
    missing = runner.invoke(app, ["accept"], prog_name="pdx")
    assert missing.exit_code == 2
    assert missing.stderr.strip() == "error: Missing argument 'playbook'. (see 'pdx accept --help')"
    assert runner.invoke(app, ["--version"]).exit_code == 0


def test_netns_timeline_check_counts_what_the_run_runs(tmp_path) -> None:
    plan = tmp_path / "wan.yaml"
    plan.write_text(
        "events:\n  - {at_s: 0, set: {delay_ms: 10}}\n  - {at_s: 1, cut: {duration_s: 1}}\n"
        "  - {at_s: 3, reset: true}\n"
    )
    result = CliRunner().invoke(app, ["faults", "netns", "timeline", str(plan), "--check"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == (
        "timeline valid: 3 events (4 changes: each timed cut ends with its own restore) over 3 s"
    )
    data = CliRunner().invoke(app, ["faults", "netns", "timeline", str(plan), "--check", "--json"])
    parsed = __import__("json").loads(data.stdout)
    assert parsed["declared_events"] == 3 and len(parsed["events"]) == 4
