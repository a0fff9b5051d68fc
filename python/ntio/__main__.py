"""`python -m ntio`: the `ntio` command."""

from ntio.cli import main

main(prog_name="ntio")
