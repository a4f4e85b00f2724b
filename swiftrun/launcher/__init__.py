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

    ep = config.entrypoint
    if ep.kind is EntrypointKind.SCRIPT and not Path(ep.target).is_file():
        raise LaunchError(f"training script {ep.target!r} not found")
    terminal = Console()
    dashboard = terminal.is_terminal if config.dashboard is None else config.dashboard
    # plain status lines go to stderr, like torchrun's log lines: stdout belongs to the workers' output
    reporter = make_reporter(terminal if dashboard else Console(stderr=True), dashboard)
    if config.multinode:
        hosts_coordinator = config.node_rank == 0 and not config.external_coordinator
        if not hosts_coordinator:
            # the job's dashboard is the coordinator's (it alone sees every node); an agent prints its notes
            reporter = make_reporter(Console(stderr=True), False)
        return _launch_node(config, reporter, new_log_root(config))
    return Agent(config, reporter, new_log_root(config)).run()


def _launch_node(config: LaunchConfig, reporter, log_root) -> int:
    """One node of a multi-node job; node 0 also hosts the coordinator unless it runs elsewhere."""
    import os
    import threading

    from swiftrun.launcher.coordinator import Coordinator, FINISH_GRACE, control_endpoint
    from swiftrun.launcher.node_agent import NodeAgent
    from swiftrun.launcher.script import uses_swiftrun

    coordinator = None
    if config.node_rank == 0 and not config.external_coordinator:
        # the agent starts and stops the reporter; the coordinator's thread feeds it the job's snapshots
        coordinator = Coordinator(config, config.event_log or (log_root / "events.jsonl"),
                                  registers=uses_swiftrun(config.entrypoint), reporter=reporter)
        port = coordinator.port
    else:
        port = control_endpoint(config, config.master_port)
    address = f"tcp://{config.master_addr}:{port}"
    agent = NodeAgent(config, reporter, log_root, address)
    if coordinator is None:
        return agent.run()
    stop_r, stop_w = os.pipe()
    thread = threading.Thread(target=coordinator.run, args=(stop_r,), name="swiftrun-coordinator", daemon=True)
    thread.start()
    try:
        return agent.run()
    finally:
        thread.join(FINISH_GRACE + 2.0)
        os.write(stop_w, b"x")
        thread.join(5.0)
        os.close(stop_r)
        os.close(stop_w)
