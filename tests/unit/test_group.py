"""GroupManager.abort: a repeated ABORT (the launcher repeats one a rank has not answered) must not shut down the
connections of the generation that ABORT announced, which a replacement may already be building."""

from __future__ import annotations

import os
import socket

import pytest

from swiftrun.runtime.comm.group import GroupManager


@pytest.mark.timeout(10)
def test_an_abort_shuts_down_only_an_older_generations_connections():
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname(), timeout=5)
        peer, _ = server.accept()
        peer.settimeout(5)
        try:
            manager = GroupManager(0, 2, "gloo", None, None)
            manager._sockets = [(client.fileno(), os.fstat(client.fileno()).st_ino)]
            manager._sockets_gen = 1  # built for generation 1

            manager.abort(1)  # a repeat of the ABORT that announced generation 1
            client.sendall(b"x")
            assert peer.recv(1) == b"x"

            manager.abort(2)  # generation 2 begins: generation 1's connections go
            assert peer.recv(1) == b""
        finally:
            client.close()
            peer.close()
