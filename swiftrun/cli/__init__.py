"""The ``swiftrun`` command line: :func:`main` dispatches, the rest of the package parses.

- :mod:`swiftrun.cli.parse`: one flag's text -> its typed value (pure);
- :mod:`swiftrun.cli.resolve`: :class:`~swiftrun.cli.resolve.Flags` + an environment mapping ->
  :class:`~swiftrun.config.LaunchConfig` (:func:`~swiftrun.cli.resolve.build_config`, pure, no typer);
- :mod:`swiftrun.cli.command`: the typer declarations of every flag;
- :mod:`swiftrun.cli.plan`: ``swiftrun plan``.

A :class:`~swiftrun.errors.SwiftrunError` from anywhere below becomes ``swiftrun: error: <message>`` and its exit
code. ``swiftrun report ...`` is dispatched to :mod:`swiftrun.report`, ``swiftrun plan ...`` to
:mod:`swiftrun.cli.plan`; ``swiftrun coordinator FLAGS SCRIPT ...`` parses the launcher's command line and runs the
job's coordinator (:func:`swiftrun.launcher.coordinate`) instead of a node. typer is imported only by ``main`` and
``app``, so the parsing and resolution modules import without it.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from swiftrun.cli.parse import (  # the command line's value parsers, as tests and scripts use them
    parse_endpoint,
    parse_local_ranks_filter,
    parse_nnodes,
    parse_nproc_per_node,
    parse_rdzv_conf,
    parse_signals,
    parse_std,
)
from swiftrun.errors import SwiftrunError

__all__ = [
    "main", "app", "parse_endpoint", "parse_local_ranks_filter", "parse_nnodes", "parse_nproc_per_node",
    "parse_rdzv_conf", "parse_signals", "parse_std",
]

# ``swiftrun NAME ...``: commands other than launching, each a module with ``main(argv) -> exit code``.
SUBCOMMANDS = {"report": "swiftrun.report", "plan": "swiftrun.cli.plan"}


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: ``swiftrun [FLAGS] SCRIPT [ARGS...]``, ``swiftrun report|plan|coordinator ...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        try:
            # import_module, not "from swiftrun import report": the package lazily exports a report() function
            code = importlib.import_module(SUBCOMMANDS[args[0]]).main(args[1:])
        except SwiftrunError as err:
            print(f"swiftrun: error: {err}", file=sys.stderr)
            sys.exit(err.exit_code)
        sys.exit(code)
    from swiftrun.cli import command as cli_app

    if args and args[0] == cli_app.COORDINATOR:
        # the launcher's own flags and rules (PET_*, Slurm defaults, abbreviations), a different ending
        import typer

        command = typer.main.get_command(cli_app.app)
        command.help = cli_app.COORDINATOR_HELP
        command.main(args=args[1:], prog_name="swiftrun coordinator", obj=cli_app.COORDINATOR)
        return
    cli_app.app(args=args, prog_name="swiftrun")


def __getattr__(name: str) -> Any:
    if name == "app":  # the typer app, imported on first use (tests drive it with typer's CliRunner)
        from swiftrun.cli.command import app

        return app
    raise AttributeError(f"module 'swiftrun.cli' has no attribute {name!r}")
