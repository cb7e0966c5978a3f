"""Command-line interface: one thin typer module per command group; ``main`` holds the app."""

__all__ = ["main"]
