"""The control protocol between the launcher and its workers.

One ROUTER in the launcher, one DEALER per worker. A frame is ``[kind, payload]`` on the DEALER side (the ROUTER
prepends the peer's routing id). ``kind`` is a :class:`MsgKind` value as ASCII, ``payload`` the JSON of a frozen
dataclass. JSON rather than pickle: a control socket must never execute what it receives. Every message carries
the generation it belongs to; both sides drop messages of an older generation.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from swiftrun.errors import ProtocolError

PROTOCOL_VERSION = 1


class MsgKind(str, enum.Enum):
    HELLO = "HELLO"  # worker -> launcher, first message
    WELCOME = "WELCOME"  # launcher -> worker, reply to HELLO
    HEARTBEAT = "HEARTBEAT"  # worker -> launcher, from the link thread
    STATUS = "STATUS"  # worker -> launcher, conflated step/loss/metrics
    EVENT = "EVENT"  # worker -> launcher, protocol events (see EventKind)
    COMMAND = "COMMAND"  # launcher -> worker, acknowledged
    ACK = "ACK"  # worker -> launcher
    PING = "PING"  # worker -> launcher: answered with PONG once everything sent before it was read
    PONG = "PONG"  # launcher -> worker


class EventKind(str, enum.Enum):
    """What a worker tells the launcher about its own progress through the protocol."""

    REGISTERED = "REGISTERED"  # swiftrun.Run was created: this worker can be recovered in place
    JOINING = "JOINING"  # a replacement reached swiftrun.Run and waits to join generation g
    ABORTED = "ABORTED"  # a survivor stopped training for generation g and waits for RECOVER
    RECOVERED = "RECOVERED"  # this rank's part of recovery g is done (data: phase timings, plan)
    LOG_PLAN = "LOG_PLAN"  # rank 0 of a pipeline chose its logging groups (data: message, groups, sizes)
    REPLAYING = "REPLAYING"  # a pipeline stage replays alone towards the recovery point (data: step, first, last)
    UNRECOVERABLE = "UNRECOVERABLE"  # no consistent state can be reached in place (data: reason)
    FINISHING = "FINISHING"  # the training loop ended; waits for every rank before leaving
    FAILED = "FAILED"  # the user's script raised (data: traceback); sent before the process exits
    EXITING = "EXITING"  # the script returned: the interpreter shuts down and heartbeats stop
    WARNING = "WARNING"  # something the user must know (data: message): an inexact recovery, a skipped call
    LAYOUT = "LAYOUT"  # found after REGISTERED: a lost rank's state would exist nowhere else (data: unrecoverable)
    RNG_BACKUP = "RNG_BACKUP"  # this rank's RNG streams as of a step's start (data: step, state), kept for its replacement


class CommandKind(str, enum.Enum):
    START = "START"  # every rank registered: build the tracked group of generation g
    ABORT = "ABORT"  # abort the process group now; generation g begins
    RECOVER = "RECOVER"  # every participant is ready: rebuild, agree, transfer (args: world, replaced ranks)
    RESUME = "RESUME"  # every rank recovered: continue training
    RELEASE = "RELEASE"  # every rank finished: leave the training loop
    ASSIGN = "ASSIGN"  # a warm spare becomes rank r (args: env, log paths)
    SHUTDOWN = "SHUTDOWN"  # exit now (a spare no longer needed)


@dataclass(frozen=True)
class Message:
    kind: ClassVar[MsgKind]
    gen: int = 0


@dataclass(frozen=True)
class Hello(Message):
    kind: ClassVar[MsgKind] = MsgKind.HELLO
    proto: int = PROTOCOL_VERSION
    token: str = ""
    rank: int = -1  # -1 for a spare that has no rank yet
    incarnation: int = 0
    pid: int = 0
    spare: bool = False


@dataclass(frozen=True)
class Welcome(Message):
    kind: ClassVar[MsgKind] = MsgKind.WELCOME
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 30.0


@dataclass(frozen=True)
class Heartbeat(Message):
    kind: ClassVar[MsgKind] = MsgKind.HEARTBEAT
    step: int = -1


@dataclass(frozen=True)
class Status(Message):
    kind: ClassVar[MsgKind] = MsgKind.STATUS
    step: int = -1
    loss: float | None = None
    step_time: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Event(Message):
    kind: ClassVar[MsgKind] = MsgKind.EVENT
    event: EventKind = EventKind.FAILED
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Command(Message):
    kind: ClassVar[MsgKind] = MsgKind.COMMAND
    cmd_id: int = 0
    command: CommandKind = CommandKind.SHUTDOWN
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Ack(Message):
    kind: ClassVar[MsgKind] = MsgKind.ACK
    cmd_id: int = 0


@dataclass(frozen=True)
class Ping(Message):
    """Asks the launcher to confirm that it read everything this worker sent before (one connection keeps the
    order). An injected fault waits for it before it strikes, so that what the rank said before its failure is
    not lost in its socket's send queue, which a SIGKILL discards (tests/integration/test_zoo.py)."""

    kind: ClassVar[MsgKind] = MsgKind.PING
    seq: int = 0


@dataclass(frozen=True)
class Pong(Message):
    kind: ClassVar[MsgKind] = MsgKind.PONG
    seq: int = 0


_TYPES: dict[MsgKind, type[Message]] = {
    cls.kind: cls for cls in (Hello, Welcome, Heartbeat, Status, Event, Command, Ack, Ping, Pong)
}
_ENUM_FIELDS = {"event": EventKind, "command": CommandKind}


def encode(msg: Message) -> list[bytes]:
    """Frames for a DEALER (the ROUTER side prepends the routing id)."""
    payload = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    return [msg.kind.value.encode(), json.dumps(payload, separators=(",", ":"), default=_jsonable).encode()]


def decode(frames: list[bytes]) -> Message:
    """The inverse of :func:`encode`; raises :class:`ProtocolError` for anything malformed."""
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames, got {len(frames)}")
    try:
        cls = _TYPES[MsgKind(frames[0].decode())]
        payload = json.loads(frames[1])
        if not isinstance(payload, dict):
            raise ValueError("payload is not an object")
        known = _FIELD_TYPES[cls]
        kwargs = {k: (_ENUM_FIELDS[k](v) if k in _ENUM_FIELDS else v) for k, v in payload.items() if k in known}
        for name, value in kwargs.items():
            if not _conforms(value, known[name]):
                # a wrongly typed field would raise later, inside the launcher's event loop
                raise TypeError(f"{cls.__name__}.{name} = {value!r} is not {known[name]}")
        return cls(**kwargs)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"undecodable control message: {exc}") from None


_FIELD_TYPES: dict[type[Message], dict[str, Any]] = {
    cls: {f.name: typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls)} for cls in _TYPES.values()
}


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a decoded JSON value fits a field's annotation (shallow: containers by their own type)."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is not None:
        hint = origin
    if isinstance(value, bool) and hint in (int, float):
        return False
    if hint is float:
        return isinstance(value, (int, float))
    return isinstance(value, hint)


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
