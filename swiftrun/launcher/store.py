"""The c10d TCPStore, hosted by the launcher (torchrun's "agent store").

Workers see ``TORCHELASTIC_USE_AGENT_STORE=True`` and connect as clients, so any rank, rank 0 included, may die
without taking the store with it. A restart of every worker gets a *fresh* store on the same port: keys left by
the previous attempt (gloo's peer addresses, barrier counters) are exactly what made torchrun's own restart path
fail here with "Connection refused".
"""

from __future__ import annotations

import socket
from datetime import timedelta

from swiftrun.errors import LaunchError


class AgentStore:
    def __init__(self, host: str, port: int, world_size: int, timeout_s: float = 900.0,
                 flag: str = "--master-port") -> None:
        self.host = host
        self._flag = flag  # the flag that chose the port, for error messages
        self._requested_port = port
        self._world_size = world_size
        self._timeout = timedelta(seconds=timeout_s)
        self._store = None
        self.port = port
        self._open(port)

    def _open(self, port: int) -> None:
        from torch.distributed import TCPStore  # the launcher pays for importing torch only here

        try:
            self._store = TCPStore(
                self.host, port, self._world_size, is_master=True, wait_for_workers=False, timeout=self._timeout
            )
        except Exception as exc:  # torch raises DistNetworkError/RuntimeError with a long C++ message
            text = str(exc)
            if "EADDRINUSE" in text or "address already in use" in text.lower():
                hint = "pick a free port, or pass --standalone to let swiftrun choose one" \
                    if self._flag == "--master-port" else "pick a free port"
                raise LaunchError(f"port {port} on {self.host} is already in use ({self._flag}); {hint}") from None
            if "EADDRNOTAVAIL" in text or "cannot assign" in text.lower():
                flag = "--master-addr" if self._flag == "--master-port" else self._flag
                raise LaunchError(f"cannot listen on {self.host}:{port} ({flag} is not an address of this host)") from None
            raise LaunchError(f"could not start the TCPStore on {self.host}:{port}: {text.splitlines()[0]}") from None
        self.port = self._store.port

    def reset(self) -> None:
        """Close the store and open an empty one on the same port (for a restart of every worker)."""
        port = self.port
        self.close()
        self._open(port)

    def client_view(self):
        """The server-side store object (the launcher uses it only to read and write control keys)."""
        return self._store

    def close(self) -> None:
        self._store = None  # the TCPStore server stops when its last reference goes


def free_port(host: str) -> int:
    """A port nobody listens on right now (for probing only; the store itself binds port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
