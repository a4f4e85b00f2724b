"""What the supervisor state machine asks the agent to do. Plain data; the agent carries them out in order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from swiftrun.events import EventName
from swiftrun.protocol.control import CommandKind


@dataclass(frozen=True)
class Spawn:
    """Start a new process in slot ``slot_id``: a worker for ``rank``, or a warm spare when rank is None."""

    slot_id: int
    rank: int | None
    incarnation: int
    generation: int
    attempt: int
    joining: bool  # a replacement that joins survivors (Swift) rather than a fresh start
    node: int = 0  # the node slot whose agent starts it (multi-node; a rank's is rank // nproc_per_node)


@dataclass(frozen=True)
class Assign:
    """Turn the warm spare in ``slot_id`` into ``rank`` (send it ASSIGN with the rank's environment)."""

    slot_id: int
    rank: int
    incarnation: int
    generation: int
    attempt: int


@dataclass(frozen=True)
class Send:
    """Send a COMMAND to the process in ``slot_id``."""

    slot_id: int
    generation: int
    cmd_id: int
    command: CommandKind
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Kill:
    """Send ``signum`` to the process group of ``slot_id`` (ignored if it is gone)."""

    slot_id: int
    signum: int


@dataclass(frozen=True)
class ResetStore:
    """Replace the TCPStore by a fresh one before restart attempt ``attempt`` (stale keys break gloo)."""

    attempt: int


@dataclass(frozen=True)
class Record:
    """Append an event to the event log."""

    event: EventName
    fields: dict[str, Any]
    at: float | None = None  # monotonic time the event refers to; None: now


@dataclass(frozen=True)
class Note:
    """A notable, human-readable line for the dashboard's event tail and the plain log."""

    text: str


@dataclass(frozen=True)
class Finish:
    """The job is over: leave the loop and exit with ``exit_code``."""

    exit_code: int


Action = Union[Spawn, Assign, Send, Kill, ResetStore, Record, Note, Finish]
