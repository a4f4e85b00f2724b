"""The supervisor of one node: ``launch(config)`` runs a job to the end and returns its exit status."""

from __future__ import annotations

from swiftrun.config import EntrypointKind, LaunchConfig
from swiftrun.errors import LaunchError


def launch(config: LaunchConfig) -> int:
    """Run the job described by ``config``; returns the exit status for the launcher process."""
    from pathlib import Path

    from rich.console import Console

    from swiftrun.dashboard.live import make_reporter
    from swiftrun.launcher.agent import Agent, new_log_root

    if config.multinode:
        raise LaunchError("multi-node launching is being built; this build parses the flags only")
    ep = config.entrypoint
    if ep.kind is EntrypointKind.SCRIPT and not Path(ep.target).is_file():
        raise LaunchError(f"training script {ep.target!r} not found")
    terminal = Console()
    dashboard = terminal.is_terminal if config.dashboard is None else config.dashboard
    # plain status lines go to stderr, like torchrun's log lines: stdout belongs to the workers' output
    reporter = make_reporter(terminal if dashboard else Console(stderr=True), dashboard)
    return Agent(config, reporter, new_log_root(config)).run()
