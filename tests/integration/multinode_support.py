"""Several "nodes" on one machine: one launcher per node, each in its own session, on 127.0.0.x addresses."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests.helpers import EXAMPLES, test_env

TRAIN = str(EXAMPLES / "train_dp.py")
TRAIN_ARGS = ("--steps", "12", "--optimizer", "adam", "--hidden", "64", "--layers", "3")
FAST = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "6", "--no-dashboard")


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p with p and p+1 free (the store, and the coordinator's control socket at p+1)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind((host, 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind((host, port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair")


def node_cmd(launcher: str, nnodes: int, node_rank: int, port: int, *extra: str, nproc: int = 2,
             host: str = "127.0.0.1", rdzv_id: str = "job7") -> list[str]:
    head = [sys.executable, "-m", "swiftrun", *FAST] if launcher == "swiftrun" else \
        [sys.executable, "-m", "torch.distributed.run"]
    return [*head, "--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--node-rank", str(node_rank),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id", rdzv_id, *extra]


def start_node(cmd: list[str], marker: str, log: Path, **env: str) -> subprocess.Popen:
    """One node's launcher in its own session (SIGKILL to its process group = the machine is gone)."""
    out = log.open("w")
    try:
        return subprocess.Popen(cmd, env=test_env(marker, **env), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        out.close()


def kill_node(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def stop_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            kill_node(proc)
        proc.wait()


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    return [proc.wait(timeout=timeout) for proc in procs]


def coordinator_cmd(nnodes: int, port: int, *extra: str, nproc: int = 2, host: str = "127.0.0.1",
                    rdzv_id: str = "job7") -> list[str]:
    """`swiftrun coordinator` with the agents' command line (node_cmd's, less --node-rank)."""
    return [sys.executable, "-m", "swiftrun", "coordinator", *FAST, "--nnodes", str(nnodes), "--nproc-per-node",
            str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id", rdzv_id, *extra]
