"""Command-line interface: one thin typer module per command group."""
