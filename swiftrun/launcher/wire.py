"""The job-level control protocol between node agents (DEALER) and the coordinator (ROUTER), over TCP.

A frame pair ``[kind, json]`` like the worker protocol (:mod:`swiftrun.protocol.control`): JSON, never pickle. Fan-in is
per node: an agent sends one BEAT per heartbeat interval for all of its workers, and relays only the rare
protocol moments (spawned, hello, events, exits) one by one. The coordinator answers every BEAT (the agent's
lease) and sends the supervisor's actions for that node as DO messages, one per node per decision carrying its
actions in order: a failure's ABORT to the P ranks of a node is one message, not P.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

from swiftrun.errors import ProtocolError
from swiftrun.launcher.actions import Action, Assign, Finish, Kill, Note, ResetStore, Send, Spawn
from swiftrun.protocol.control import CommandKind

NODE_PROTOCOL_VERSION = 2  # 2: a DO carries a list of actions


class NodeKind(str, enum.Enum):
    # agent -> coordinator
    JOIN = "JOIN"  # node_rank, fingerprint, info, proto
    BEAT = "BEAT"  # seen {slot_id: step}, stopped [slot_id], status {slot_id: [step, loss, step_time, metrics]}
    REPORT = "REPORT"  # one worker moment: what (ReportKind), slot_id, data
    # coordinator -> agent
    ACCEPT = "ACCEPT"  # slot (None: a hot spare), incarnation, store host/port, run_id
    REFUSE = "REFUSE"  # reason, exit_code: the agent exits with it
    TAKE = "TAKE"  # a hot spare takes over slot k (incarnation)
    LEASE = "LEASE"  # the answer to a BEAT: the agent's lease is renewed
    DO = "DO"  # actions: the supervisor's actions for this node, in order
    FENCED = "FENCED"  # you are not the current incarnation: kill your workers and exit


class ReportKind(str, enum.Enum):
    SPAWNED = "SPAWNED"  # data: pid
    SPAWN_FAILED = "SPAWN_FAILED"  # data: reason
    HELLO = "HELLO"  # data: gen
    EVENT = "EVENT"  # data: gen, event, data
    EXITED = "EXITED"  # data: returncode, error_file, traceback
    SIGNAL = "SIGNAL"  # data: signum (the agent received it; the job stops); slot_id -1


def encode(kind: NodeKind, body: dict[str, Any]) -> list[bytes]:
    return [kind.value.encode(), json.dumps(body, separators=(",", ":"), default=_jsonable).encode()]


def decode(frames: list[bytes]) -> tuple[NodeKind, dict[str, Any]]:
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames, got {len(frames)}")
    try:
        kind = NodeKind(frames[0].decode())
        body = json.loads(frames[1])
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"undecodable node message: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("a node message's body is not an object")
    return kind, body


_ACTIONS = {cls.__name__: cls for cls in (Spawn, Assign, Send, Kill, ResetStore, Finish, Note)}


def do_body(actions: list[dict[str, Any]]) -> dict[str, Any]:
    """A DO message's body: actions (each an ``action_body``) the agent carries out in this order."""
    return {"actions": actions}


def actions_of(body: dict[str, Any]) -> list[Action]:
    entries = body.get("actions")
    if not isinstance(entries, list):
        raise ProtocolError("a DO message carries no list of actions")
    return [action_of(entry) for entry in entries]


def action_body(action: Action) -> dict[str, Any]:
    """One action the agent carries out, as a DO message lists it (not Record: the coordinator keeps the log)."""
    fields = {f.name: getattr(action, f.name) for f in dataclasses.fields(action)}
    return {"type": type(action).__name__, "fields": fields}


def action_of(body: dict[str, Any]) -> Action:
    try:
        cls = _ACTIONS[body["type"]]  # a KeyError or TypeError (not a dict) is a malformed action
        fields = dict(body["fields"])
        if cls is Send:
            fields["command"] = CommandKind(fields["command"])
        return cls(**fields)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"undecodable action: {exc}") from None


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
