"""A node's agent in a multi-node job: supervises its local workers exactly as on one node, but the decisions
are the coordinator's.

The agent keeps :class:`~swiftrun.launcher.agent.Agent`'s one event loop (local ROUTER for its workers over
ipc, pidfds, the signal pipe) and adds one DEALER to the job's coordinator. In place of the local state machine
it holds a :class:`RemoteJob`: the loop calls it exactly as it would call a :class:`~swiftrun.launcher.job.Job`,
and it turns each call into a message for the coordinator (heartbeats and statuses batched into one BEAT per
interval for the whole node); the coordinator's DO messages are the supervisor's actions, carried out as on one
node.

Fencing: every BEAT is answered by a LEASE. An agent that has not heard from the coordinator for
``--node-lease`` kills its workers and exits; the coordinator hands the slot out again only after the longer
``--node-timeout``, so a frozen or partitioned incarnation is gone before its replacement starts.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import zmq

from swiftrun.config import LaunchConfig
from swiftrun.errors import LaunchError, ProtocolError
from swiftrun.launcher import envs, wire
from swiftrun.launcher.actions import Action, Assign, Finish, Kill, Note, Spawn
from swiftrun.launcher.agent import Agent
from swiftrun.launcher.failures import ProcessFailure
from swiftrun.launcher.script import uses_swiftrun
from swiftrun.launcher.wire import NodeKind, ReportKind
from swiftrun.protocol.control import EventKind

JOIN_RESEND = 2.0  # seconds between JOINs while the coordinator has not answered
FENCED_EXIT = 1


@dataclass
class MirrorSlot:
    """The agent's view of one of its processes; the coordinator's Job holds the real one."""

    slot_id: int
    rank: int | None
    incarnation: int
    last_seen: float
    traceback: str | None = None
    step: int | None = None
    status: list[Any] | None = None
    alive: bool = True


class RemoteJob:
    """The calls :class:`Agent`'s loop makes on a Job (:class:`~swiftrun.launcher.contract.SupervisedJob`),
    forwarded to the coordinator."""

    def __init__(self, config: LaunchConfig, send: Callable[[NodeKind, dict[str, Any]], None], now: float) -> None:
        self.config = config
        self._send = send
        self.slots: dict[int, MirrorSlot] = {}
        self.generation = 0
        self.failures: list[ProcessFailure] = []  # the coordinator keeps the job's; nothing to print here
        self.late_failures: list[ProcessFailure] = []
        self.time_lost = 0.0
        self.accepted = False
        self.started_at = now
        self.last_heard = now
        self.next_beat = now
        self._seen: set[int] = set()
        self._signalled = False

    # ------------------------------------------------------------------ the coordinator's side

    def adopt(self, action: Action, now: float) -> None:
        """Keep the mirror in step with an action the coordinator sent."""
        if isinstance(action, Spawn):
            self.slots[action.slot_id] = MirrorSlot(action.slot_id, action.rank, action.incarnation, now)
        elif isinstance(action, Assign) and action.slot_id in self.slots:
            slot = self.slots[action.slot_id]
            slot.rank, slot.incarnation = action.rank, action.incarnation
        generation = getattr(action, "generation", None)
        if isinstance(generation, int):
            self.generation = max(self.generation, generation)

    # ------------------------------------------------------------------ the Job interface

    def on_spawned(self, slot_id: int, pid: int, now: float) -> list[Action]:
        return self._report(ReportKind.SPAWNED, slot_id, pid=pid)

    def on_spawn_failed(self, slot_id: int, reason: str, now: float) -> list[Action]:
        self.slots[slot_id].alive = False
        return self._report(ReportKind.SPAWN_FAILED, slot_id, reason=reason)

    def on_hello(self, slot_id: int, gen: int, now: float) -> list[Action]:
        self.on_alive(slot_id, now)
        return self._report(ReportKind.HELLO, slot_id, gen=gen)

    def on_alive(self, slot_id: int, now: float, step: int | None = None) -> list[Action]:
        slot = self.slots[slot_id]
        slot.last_seen = now
        if step is not None and step >= 0:
            slot.step = step
        self._seen.add(slot_id)
        return []

    def on_status(self, slot_id: int, now: float, step: int, loss: Any, step_time: Any, metrics: dict) -> list[Action]:
        self.on_alive(slot_id, now, step)
        self.slots[slot_id].status = [step, loss, step_time, metrics]
        return []

    def on_event(self, slot_id: int, gen: int, kind: EventKind, data: dict[str, Any], now: float) -> list[Action]:
        self.on_alive(slot_id, now)
        if kind is EventKind.FAILED:
            self.slots[slot_id].traceback = str(data.get("traceback") or "") or None
        return self._report(ReportKind.EVENT, slot_id, gen=gen, event=kind.value, data=data)

    def on_ack(self, slot_id: int, cmd_id: int, now: float) -> list[Action]:
        return self.on_alive(slot_id, now)

    def on_exit(self, slot_id: int, returncode: int, now: float, cause: str = "",
                error_file: str | None = None) -> list[Action]:
        slot = self.slots[slot_id]
        slot.alive = False
        return self._report(ReportKind.EXITED, slot_id, returncode=returncode, error_file=error_file,
                            traceback=slot.traceback)

    def on_signal(self, signum: int, now: float) -> list[Action]:
        if self._signalled or not self.accepted:
            return self._kill_all() + [Finish(128 + signum)]
        self._signalled = True
        return self._report(ReportKind.SIGNAL, -1, signum=signum)

    def tick(self, now: float, stopped: frozenset[int] = frozenset()) -> list[Action]:
        t = self.config.timeouts
        if not self.accepted:
            if now - self.started_at > t.join_timeout:
                return [Note(f"no answer from the coordinator within {t.join_timeout:g}s (--rdzv-conf join_timeout):"
                             " is the endpoint right, and is node 0 (or `swiftrun coordinator`) running?"),
                        Finish(1)]
            return []
        if now - self.last_heard > t.node_lease:
            return self.fence(f"no word from the coordinator for {now - self.last_heard:.1f}s (--node-lease "
                              f"{t.node_lease:g}s)")
        if now >= self.next_beat:
            self.next_beat = now + t.heartbeat_interval
            seen = {str(sid): self.slots[sid].step for sid in self._seen if sid in self.slots}
            status = {}
            for sid in self._seen:
                slot = self.slots.get(sid)
                if slot is not None and slot.status is not None:
                    status[str(sid)], slot.status = slot.status, None
            self._seen.clear()
            self._send(NodeKind.BEAT, {"seen": seen, "status": status, "stopped": sorted(stopped)})
        return []

    def fence(self, reason: str) -> list[Action]:
        return [Note(f"fenced: {reason}; killing this node's workers"), *self._kill_all(), Finish(FENCED_EXIT)]

    def silent_slots(self, now: float) -> list[int]:
        limit = 2 * self.config.timeouts.heartbeat_interval
        return [s.slot_id for s in self.slots.values() if s.alive and now - s.last_seen > limit]

    def next_deadline(self, now: float) -> float:
        t = self.config.timeouts
        if not self.accepted:
            return min(now + JOIN_RESEND, self.started_at + t.join_timeout)
        return min(self.next_beat, self.last_heard + t.node_lease)

    def drain_records(self) -> list[Action]:
        return []

    # ------------------------------------------------------------------ helpers

    def _report(self, what: ReportKind, slot_id: int, **data: Any) -> list[Action]:
        self._send(NodeKind.REPORT, {"what": what.value, "slot_id": slot_id, "data": data})
        return []

    def _kill_all(self) -> list[Action]:
        return [Kill(s.slot_id, signal.SIGKILL) for s in self.slots.values() if s.alive]


class NodeAgent(Agent):
    """One node's agent: local workers as on one node, decisions from the coordinator."""

    def __init__(self, config: LaunchConfig, reporter: Any, log_root: Path, coordinator_addr: str) -> None:
        super().__init__(config, reporter, log_root, event_log_path=log_root / "node-events.jsonl")
        self.coordinator_addr = coordinator_addr
        self.identity = f"node:{config.node_rank}:{uuid.uuid4().hex[:12]}".encode()
        self.dealer: zmq.Socket | None = None
        self.remote: RemoteJob | None = None
        self._last_join = 0.0
        self.slot: int | None = None

    def _connect(self, ctx: zmq.Context) -> None:
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.linger = 0
        self.dealer.identity = self.identity
        try:
            self.dealer.connect(self.coordinator_addr)
        except zmq.ZMQError as exc:
            raise LaunchError(f"cannot reach the coordinator at {self.coordinator_addr}: {exc}") from None

    def _endpoints(self) -> envs.JobEndpoints:
        """The store lives with the coordinator: its address comes with ACCEPT."""
        return envs.JobEndpoints(
            master_addr=self.config.master_addr, master_port=self.config.master_port, ctl_addr=self.ctl_addr,
            token=self.token, run_id=self.run_id, attempt_dir=self._attempt_dir(0),
        )

    def _begin(self, now: float) -> None:
        """Join the job: the coordinator decides from here on."""
        self.remote = RemoteJob(self.config, self._to_coordinator, now)
        self.job = self.remote  # the loop's calls, forwarded (launcher/contract.py)
        self._join(now)

    # ------------------------------------------------------------------ the coordinator link

    def _join(self, now: float) -> None:
        from swiftrun.launcher.coordinator import fingerprint

        self._last_join = now
        self._to_coordinator(NodeKind.JOIN, {
            "proto": wire.NODE_PROTOCOL_VERSION, "node_rank": self.config.node_rank,
            "fingerprint": fingerprint(self.config), "host": socket.gethostname(), "pid": os.getpid(),
            "registers": uses_swiftrun(self.config.entrypoint),
        })

    def _to_coordinator(self, kind: NodeKind, body: dict[str, Any]) -> None:
        assert self.dealer is not None
        try:
            self.dealer.send_multipart(wire.encode(kind, body), zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):
            pass  # the coordinator is unreachable: the lease decides

    def _register_extra(self, poller: zmq.Poller) -> None:
        poller.register(self.dealer, zmq.POLLIN)

    def _handle_extra(self, ready: dict) -> None:
        assert self.dealer is not None and self.remote is not None
        now = time.monotonic()
        if not self.remote.accepted and now - self._last_join >= JOIN_RESEND:
            self._join(now)
        if self.dealer not in ready:
            return
        while self.exit_code is None:
            try:
                frames = self.dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                kind, body = wire.decode(frames)
                self._on_coordinator(kind, body, time.monotonic())
            except (ProtocolError, KeyError, TypeError, ValueError) as exc:
                self._note(f"dropped a malformed message from the coordinator: {exc}")

    def _on_coordinator(self, kind: NodeKind, body: dict[str, Any], now: float) -> None:
        remote = self.remote
        assert remote is not None
        remote.last_heard = now
        if kind is NodeKind.ACCEPT:
            if remote.accepted:
                return
            remote.accepted = True
            self.run_id = str(body.get("run_id") or self.run_id)
            self.ends = dataclasses.replace(self.ends, master_addr=str(body["store_host"]),
                                            master_port=int(body["store_port"]), run_id=self.run_id)
            self._take_slot(body.get("slot"))
            what = f"node slot {self.slot}" if self.slot is not None else "a hot-spare node"
            self._note(f"joined the job at {self.coordinator_addr} as {what}")
        elif kind is NodeKind.TAKE:
            self._take_slot(int(body["slot"]))
            self._note(f"taking over node slot {self.slot}")
        elif kind is NodeKind.REFUSE:
            print(f"swiftrun: error: the coordinator refused this agent: {body.get('reason')}", file=sys.stderr,
                  flush=True)
            self._execute(remote._kill_all() + [Finish(int(body.get("exit_code", 2)))])
        elif kind is NodeKind.FENCED:
            self._execute(remote.fence(str(body.get("reason"))))
        elif kind is NodeKind.DO:
            for action in wire.actions_of(body):
                remote.adopt(action, now)
                self._execute([action])

    def _take_slot(self, slot: int | None) -> None:
        self.slot = slot
        if slot is not None:
            # from now on this agent is node `slot`: GROUP_RANK, LOCAL_RANK and log folders follow the slot
            self.config = dataclasses.replace(self.config, node_rank=slot)

    def _teardown(self, router, ctx, sig_r, sig_w, old_handlers, old_wakeup) -> None:
        if self.dealer is not None:
            self.dealer.close(linger=0)  # before the context terminates, which waits for every socket
        super()._teardown(router, ctx, sig_r, sig_w, old_handlers, old_wakeup)

    def _publish(self, now: float, force: bool = False) -> None:
        """The job's dashboard belongs to the coordinator; an agent prints its notes only."""
