"""``python -m pdx`` runs the CLI."""

from pdx.cli.main import main

main()
