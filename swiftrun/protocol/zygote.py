"""The messages between an agent and its zygote (swiftrun/runtime/zygote.py), pure and fork-safe.

The channel is a ``SOCK_SEQPACKET`` socketpair: one datagram per message (no framing to get wrong), file
descriptors ride along with ``socket.send_fds`` (a FORK carries the child's stdout and stderr), and EOF tells
either side that the other is gone. No ZeroMQ: its context owns threads, and the zygote must have none when it
forks. A message is a small JSON object ``{"k": kind, ...}``.

Agent -> zygote: FORK {slot, env, argv} + 2 fds (stdout, stderr); IDLE (training runs: warm up at SCHED_IDLE).
Zygote -> agent: READY {seconds} (warm, forks from now on); WARM_FAILED {reason} (exits: the agent starts
workers cold); FORKED {slot, pid}; FORK_FAILED {slot, reason}.
"""

from __future__ import annotations

import enum
import json
import socket
from typing import Any

from swiftrun.errors import ProtocolError

MAX_MESSAGE = 1 << 20  # a worker environment is a few KiB; the datagram must fit in one recv
STDIO_FDS = 2  # a FORK carries the child's stdout and stderr


class ZygoteKind(str, enum.Enum):
    FORK = "fork"
    IDLE = "idle"
    READY = "ready"
    WARM_FAILED = "warm_failed"
    FORKED = "forked"
    FORK_FAILED = "fork_failed"


def encode(kind: ZygoteKind, **body: Any) -> bytes:
    return json.dumps({"k": kind.value, **body}, separators=(",", ":")).encode()


def decode(data: bytes) -> tuple[ZygoteKind, dict[str, Any]]:
    """One datagram to (kind, body); anything else is a :class:`ProtocolError`."""
    try:
        obj = json.loads(data)
        kind = ZygoteKind(obj.pop("k"))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"malformed zygote message: {exc}") from None
    if kind is ZygoteKind.FORK:
        _require(kind, obj, slot=int, env=dict, argv=list)
    elif kind is ZygoteKind.FORKED:
        _require(kind, obj, slot=int, pid=int)
    elif kind is ZygoteKind.FORK_FAILED:
        _require(kind, obj, slot=int, reason=str)
    return kind, obj


def _require(kind: ZygoteKind, obj: dict[str, Any], **fields: type) -> None:
    for name, typ in fields.items():
        if not isinstance(obj.get(name), typ) or isinstance(obj.get(name), bool):
            raise ProtocolError(f"zygote message {kind.value} lacks a valid {name!r}")


def send(sock: socket.socket, kind: ZygoteKind, fds: list[int] | None = None, **body: Any) -> None:
    data = encode(kind, **body)
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def recv(sock: socket.socket) -> tuple[ZygoteKind, dict[str, Any], list[int]] | None:
    """The next message and the descriptors that came with it; None on EOF (the other side is gone)."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, STDIO_FDS)
    if not data:
        for fd in fds:
            _close(fd)
        return None
    try:
        kind, body = decode(data)
    except ProtocolError:
        for fd in fds:
            _close(fd)
        raise
    return kind, body, list(fds)


def _close(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass
