"""The ``pdx`` command: registers each command group and maps errors to exit codes once."""

from __future__ import annotations

import faulthandler
import signal
import sys
from typing import Any

import typer
from typer._click.core import Context as ClickContext
from typer.core import TyperGroup

from pdx import __version__
from pdx.errors import PdxError


class PdxGroup(TyperGroup):
    """Top-level group: any :class:`PdxError` becomes one line on stderr and its exit code."""

    def invoke(self, ctx: ClickContext) -> Any:
        try:
            return super().invoke(ctx)
        except PdxError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None


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
    from pdx.cli import accept, deploy, faults, kv, measure_kv, probe, simulate

    for module in (measure_kv, probe, faults, simulate, kv, deploy, accept):
        module.register(app)


_register()


def main() -> None:
    """Console-script entry point. ``kill -USR1 <pid>`` prints every thread's stack to stderr."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    sys.exit(app())


if __name__ == "__main__":
    main()
