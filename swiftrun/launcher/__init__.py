"""The supervisor of one node: ``launch(config)`` runs a job to the end and returns its exit status.
``coordinate(config)`` runs a multi-node job's coordinator alone (``swiftrun coordinator``)."""

from __future__ import annotations

import sys

from swiftrun.config import EntrypointKind, LaunchConfig
from swiftrun.errors import ConfigError, LaunchError


def launch(config: LaunchConfig) -> int:
    """Run the job described by ``config``; returns the exit status for the launcher process."""
    from pathlib import Path

    from rich.console import Console

    from swiftrun.dashboard.live import make_reporter
    from swiftrun.launcher.agent import Agent, new_log_root

    ep = config.entrypoint
    if ep.kind is EntrypointKind.SCRIPT and not Path(ep.target).is_file():
        raise LaunchError(f"training script {ep.target!r} not found")
    reporter = _reporter(config)
    if config.multinode:
        hosts_coordinator = config.node_rank == 0 and not config.external_coordinator
        if not hosts_coordinator:
            # the job's dashboard is the coordinator's (it alone sees every node); an agent prints its notes
            reporter = make_reporter(Console(stderr=True), False)
        return _launch_node(config, reporter, new_log_root(config))
    return Agent(config, reporter, new_log_root(config)).run()


def _reporter(config: LaunchConfig):
    """The live dashboard on a terminal (or with --dashboard), else plain status lines."""
    from rich.console import Console

    from swiftrun.dashboard.live import make_reporter

    terminal = Console()
    dashboard = terminal.is_terminal if config.dashboard is None else config.dashboard
    # plain status lines go to stderr, like torchrun's log lines: stdout belongs to the workers' output
    return make_reporter(terminal if dashboard else Console(stderr=True), dashboard)


def coordinate(config: LaunchConfig) -> int:
    """``swiftrun coordinator``: the job's store and control plane as a process of their own, on a host that
    trains nothing, so that losing any training node (node 0 included) is an in-place recovery.

    It runs the same decision loop as the coordinator node 0 hosts by default (:class:`Coordinator`), in this
    process's main thread, and exits with the job's status as soon as the job ends. SIGINT/SIGTERM/... stop the
    job as they would stop a one-node swiftrun (forwarded to every worker; a second signal kills them).
    """
    import signal
    import socket

    from swiftrun.launcher.agent import new_log_root
    from swiftrun.launcher.coordinator import Coordinator, control_endpoint

    if not config.master_port:
        raise ConfigError("swiftrun coordinator needs a fixed port (--rdzv-endpoint HOST:PORT): the agents must "
                          "find it")
    _check_free(config.master_port, "--rdzv-endpoint")
    _check_free(control_endpoint(config, config.master_port), "--rdzv-conf control_port")
    log_root = new_log_root(config)
    reporter = _reporter(config)
    coordinator = Coordinator(config, config.event_log or (log_root / "events.jsonl"), registers=None,
                              standalone=True, reporter=reporter)
    sig_r, sig_w = socket.socketpair()
    sig_r.setblocking(False)
    sig_w.setblocking(False)
    old = {signum: signal.signal(signum, lambda *_: None) for signum in config.signals_to_handle}
    old_wakeup = signal.set_wakeup_fd(sig_w.fileno(), warn_on_full_buffer=False)
    print(f"swiftrun coordinator: waiting for {config.nnodes[0]} node(s) of {config.nproc_per_node} worker(s): "
          f"store {config.master_addr}:{coordinator.store.port}, control port "
          f"{control_endpoint(config, coordinator.store.port)}; event log {coordinator.event_log.path}",
          file=sys.stderr, flush=True)
    reporter.start()
    try:
        return coordinator.run(signal_sock=sig_r)
    finally:
        reporter.stop()
        signal.set_wakeup_fd(old_wakeup)
        for signum, handler in old.items():
            signal.signal(signum, handler)
        sig_r.close()
        sig_w.close()


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
        try:
            coordinator = Coordinator(config, config.event_log or (log_root / "events.jsonl"),
                                      registers=uses_swiftrun(config.entrypoint), reporter=reporter)
        except LaunchError as err:
            raise LaunchError(f"{err} (if `swiftrun coordinator` runs at the endpoint, start every agent with "
                              "--external-coordinator)") from None
        port = coordinator.port
    else:
        port = control_endpoint(config, config.master_port)
        if config.external_coordinator:
            wait_reachable(config.master_addr, port, config.timeouts.connect_timeout)
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


def _check_free(port: int, flag: str) -> None:
    """Fail fast (before importing torch for the store) when the coordinator cannot listen where it must. The
    TCPStore server and the ROUTER listen on every interface, whatever the endpoint's host (which may be a name
    that only resolves elsewhere, such as a Kubernetes Service), so the port is checked on every interface."""
    import errno
    import socket

    try:
        with socket.socket() as probe:
            probe.bind(("", port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise LaunchError(f"port {port} is already in use on this host ({flag}); pick a free port") from None
        raise LaunchError(f"cannot listen on port {port} ({flag}): {exc.strerror or exc}") from None


def wait_reachable(host: str, port: int, timeout: float) -> None:
    """Wait until something listens at the external coordinator's control port, or fail clearly.

    ZeroMQ connects in the background and would leave the agent waiting for the whole join timeout; a plain TCP
    connect says within seconds that nothing listens there (a wrong endpoint, a coordinator not started yet or
    already gone: it exits when its job ends). Refused connections are retried for ``timeout`` seconds, since
    the coordinator may still be starting."""
    import socket
    import time

    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, left))):
                return
        except OSError as exc:
            why = exc.strerror or str(exc) or type(exc).__name__
        if time.monotonic() >= deadline:
            raise LaunchError(f"cannot reach the coordinator at {host}:{port} ({why}) within {timeout:g}s "
                              "(--rdzv-conf connect_timeout): is `swiftrun coordinator` running there with the same "
                              "--rdzv-endpoint? It exits when its job ends.")
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
