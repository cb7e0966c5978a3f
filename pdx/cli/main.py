"""The ``pdx`` command: registers each command group and maps errors to exit codes once."""

from __future__ import annotations

import faulthandler
import signal
import sys
from collections.abc import Sequence
from typing import Any

import typer
from typer._click.core import Context as ClickContext
from typer._click.exceptions import (
    BadParameter,
    ClickException,
    MissingParameter,
    NoArgsIsHelpError,
    NoSuchOption,
    UsageError,
)
from typer.core import TyperGroup, TyperOption
from typer.exceptions import Abort

from pdx import __version__
from pdx.errors import PdxError


class PdxGroup(TyperGroup):
    """Top-level group: any :class:`PdxError`, and any bad option (a wrong type, an unknown
    name, a missing value), becomes one line on stderr and its exit code."""

    def invoke(self, ctx: ClickContext) -> Any:
        try:
            return super().invoke(ctx)
        except PdxError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        """Typer prints a usage error as a framed box of several lines; pdx prints it the
        way it prints every other error: ``error: <what>`` on one line, exit 2."""
        call = {"args": args, "prog_name": prog_name, "complete_var": complete_var,
                "windows_expand_args": windows_expand_args, **extra}  # fmt: skip
        if not standalone_mode:
            return super().main(standalone_mode=False, **call)
        argv = list(args if args is not None else sys.argv[1:])
        try:
            rv = super().main(standalone_mode=False, **call)
        except NoArgsIsHelpError as exc:  # the help is already printed
            sys.exit(exc.exit_code)
        except ClickException as exc:
            typer.echo(f"error: {usage_error_line(exc, argv)}", err=True)
            sys.exit(exc.exit_code)
        except Abort:
            typer.echo("aborted", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


def usage_error_line(exc: ClickException, argv: list[str]) -> str:
    """One line for a bad command line: the option, the value given and what it takes
    (``--kv-gbps: got 'abc': Input should be a valid number ...``), and where to look."""
    message = " ".join(exc.format_message().split())
    if isinstance(exc, NoSuchOption):
        maybe = sorted(exc.possibilities or ())
        message = f"{exc.option_name}: no such option" + (
            f" (did you mean {', '.join(maybe)}?)" if maybe else ""
        )
    elif isinstance(exc, BadParameter) and not isinstance(exc, MissingParameter) and exc.param:
        name = max(exc.param.opts, key=len) if exc.param.opts else exc.param.name or "?"
        given = _value_given(argv, exc.param.opts)
        detail = " ".join(exc.message.split())
        message = f"{name}: got {given!r}: {detail}" if given is not None else f"{name}: {detail}"
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, UsageError) and ctx is not None:
        message += f" (see '{ctx.command_path} --help')"
    return message


def _value_given(argv: list[str], opts: list[str]) -> str | None:
    """The last value the command line gave one of ``opts`` (``--x v`` or ``--x=v``)."""
    found = None
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in opts:
            found = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return found


def _flags_take_no_type() -> None:
    """Typer's help shows ``<bool>`` beside a flag (``--json <bool>``) though a flag takes no
    value (``--json true`` is refused): pdx's help shows a flag as a bare name, as click's
    plain help and every tool our users know do. Typer has no setting for it."""
    shown = TyperOption.display_type_rich

    def display_type_rich(self: TyperOption, ctx: ClickContext) -> str | None:
        if self.is_flag and not self.count:
            return None
        return shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


app = typer.Typer(
    cls=PdxGroup,
    help="Prefill/decode disaggregation across datacenters: measure, probe, deploy, break, accept.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"pdx {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """pdx: prefill/decode disaggregation across datacenters, measured and proven."""


def _register() -> None:
    """Attach every command group; each module exposes ``register(app)`` and imports lazily."""
    from pdx.cli import accept, deploy, faults, kv, link_watch, measure_kv, probe, simulate, trace

    _flags_take_no_type()
    for module in (measure_kv, probe, link_watch, faults, simulate, kv, deploy, accept, trace):
        module.register(app)


_register()


def main() -> None:
    """Console-script entry point. ``kill -USR1 <pid>`` prints every thread's stack to stderr."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    sys.exit(app())


if __name__ == "__main__":
    main()
