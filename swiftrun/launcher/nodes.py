"""Who holds which node slot: the coordinator's membership table, as a pure state machine (no I/O, no clock).

Identity = slot + incarnation. A job of N nodes has node slots 0..N-1; slot k owns ranks [k*P, (k+1)*P) for the
whole job. An agent joins with its ``--node-rank``: below N it asks for that slot, at or above N it is a
hot-spare node. Every agent start is a new *incarnation* (a fresh ZeroMQ routing id); only the current
incarnation of a slot is listened to, anything else is told it is fenced.

- A slot held by a live agent is never handed to another one: a second agent claiming it is refused.
- A slot whose agent was lost (its connection closed, or silent for ``node_timeout``) is *vacant*: the same
  node restarted takes it back, or a hot spare takes it over at once.
- ``node_timeout`` is longer than the agents' lease, so a silent (frozen, partitioned) agent has killed its own
  workers before its slot is handed out again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class NodeState(str, enum.Enum):
    LIVE = "live"  # holds a slot and is heard from
    SPARE = "spare"  # a hot-spare node: joined, holds no slot yet
    LOST = "lost"  # gone (connection closed, silent, or fenced); never comes back under this identity


@dataclass
class Node:
    identity: bytes
    node_rank: int  # what the agent was started with
    slot: int | None  # the node slot it holds; None for a spare
    incarnation: int  # of its slot (0 for the first holder); spares get theirs when they take a slot
    state: NodeState
    joined_at: float
    last_seen: float
    info: dict[str, Any] = field(default_factory=dict)  # host, pid: for messages and the dashboard


@dataclass(frozen=True)
class Accepted:
    node: Node


@dataclass(frozen=True)
class Refused:
    reason: str


def fingerprint_mismatch(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """What differs between two agents' job descriptions (None: the same job)."""
    differing = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if not differing:
        return None
    return "; ".join(f"{k}: {theirs.get(k)!r} here, {ours.get(k)!r} in the job" for k in differing)


class NodeTable:
    def __init__(self, nnodes: int, node_timeout: float, settle: float = 0.0) -> None:
        self.nnodes = nnodes
        self.node_timeout = node_timeout
        # nodes that went quiet together (cut off behind one switch, a rack's power) stop beating at the same
        # instant, but their last beats differ by up to a heartbeat interval: a node past node_timeout waits up to
        # ``settle`` for the others that went quiet with it, so that they are lost in one batch (one recovery).
        # Declaring a loss later than node_timeout is always safe: the lease has expired all the longer.
        self.settle = settle
        self.holder: dict[int, Node | None] = {k: None for k in range(nnodes)}
        self.incarnations: dict[int, int] = {k: -1 for k in range(nnodes)}
        self.by_identity: dict[bytes, Node] = {}
        self.fingerprint: dict[str, Any] | None = None  # the job's: the first agent's, or the coordinator's own
        self.closed_reason: str | None = None  # the job finished: nobody joins any more

    # ------------------------------------------------------------------ events

    def join(self, identity: bytes, node_rank: int, fingerprint: dict[str, Any], now: float,
             info: dict[str, Any] | None = None) -> Accepted | Refused:
        if self.closed_reason is not None:
            return Refused(f"the job is over ({self.closed_reason}); start a new job with a new --rdzv-id")
        if self.fingerprint is None:
            self.fingerprint = dict(fingerprint)
        diff = fingerprint_mismatch(self.fingerprint, fingerprint)
        if diff is not None:
            return Refused(f"this agent's command line differs from the job's: {diff}")
        if identity in self.by_identity:
            return Accepted(self.by_identity[identity])  # a repeated JOIN (lost reply): same answer
        info = dict(info or {})
        for other in self.live_nodes():
            if other.node_rank == node_rank:
                where = f" (pid {other.info.get('pid')} on {other.info.get('host')})" if other.info else ""
                return Refused(f"--node-rank {node_rank} is already held by a live agent{where}")
        if node_rank < self.nnodes:
            node = self._occupy(identity, node_rank, node_rank, now, info)
        else:
            node = Node(identity, node_rank, None, -1, NodeState.SPARE, now, now, info)
        self.by_identity[identity] = node
        return Accepted(node)

    def seen(self, identity: bytes, now: float) -> Node | None:
        """A message from ``identity``: the node if it is current (live or spare), else None (fence it)."""
        node = self.by_identity.get(identity)
        if node is None or node.state is NodeState.LOST:
            return None
        node.last_seen = now
        return node

    def lose(self, identity: bytes) -> Node | None:
        """``identity`` is gone (its connection closed, or it was fenced). Returns it if it was current."""
        node = self.by_identity.get(identity)
        if node is None or node.state is NodeState.LOST:
            return None
        node.state = NodeState.LOST
        if node.slot is not None and self.holder.get(node.slot) is node:
            self.holder[node.slot] = None
        return node

    def tick(self, now: float) -> list[Node]:
        """Nodes silent for longer than ``node_timeout``: lost (their slots become vacant), in one batch with any
        node that went quiet with them (see ``settle``)."""
        current = self.current()
        silent = [n for n in current if now - n.last_seen > self.node_timeout]
        quiet = [n for n in current if self.node_timeout - self.settle < now - n.last_seen <= self.node_timeout]
        if not silent or quiet:
            return []
        return [n for n in silent if self.lose(n.identity) is not None]

    def take_over(self, slot: int, now: float, fresh_within: float | None = None) -> Node | None:
        """Give vacant ``slot`` to a waiting hot-spare node (the longest waiting first), or None.

        ``fresh_within``: only to a spare heard from within that many seconds. One that went quiet is frozen,
        dead or cut off (or soon fences itself: its lease is renewed only by the answers to its beats), and a
        slot handed to it would wait for --node-timeout and cost a second recovery; a spare merely late is
        handed the slot at its next beat instead."""
        if self.holder.get(slot) is not None:
            return None
        spares = sorted((n for n in self.current() if n.state is NodeState.SPARE
                         and (fresh_within is None or now - n.last_seen <= fresh_within)), key=lambda n: n.joined_at)
        if not spares:
            return None
        spare = spares[0]
        self._occupy(spare.identity, spare.node_rank, slot, now, spare.info, node=spare)
        return spare

    def close(self, reason: str) -> None:
        self.closed_reason = reason

    # ------------------------------------------------------------------ queries

    def current(self) -> list[Node]:
        return [n for n in self.by_identity.values() if n.state is not NodeState.LOST]

    def live_nodes(self) -> list[Node]:
        return [n for n in self.current()]

    def vacant(self) -> list[int]:
        return [k for k, node in self.holder.items() if node is None]

    def full(self) -> bool:
        return not self.vacant()

    def next_deadline(self, now: float) -> float:
        current = self.current()
        if not current:
            return now + self.node_timeout
        deadlines = sorted(n.last_seen + self.node_timeout for n in current)
        if deadlines[0] < now:  # a loss held back by tick: due when the next node's silence is
            return next((d for d in deadlines if d >= now), deadlines[0])
        return deadlines[0]

    # ------------------------------------------------------------------ helpers

    def _occupy(self, identity: bytes, node_rank: int, slot: int, now: float, info: dict[str, Any],
                node: Node | None = None) -> Node:
        self.incarnations[slot] += 1
        if node is None:
            node = Node(identity, node_rank, slot, self.incarnations[slot], NodeState.LIVE, now, now, info)
        node.slot, node.incarnation, node.state = slot, self.incarnations[slot], NodeState.LIVE
        self.holder[slot] = node
        return node
