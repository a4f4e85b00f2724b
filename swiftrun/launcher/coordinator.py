"""The job's coordinator (multi-node): the c10d TCPStore, the job-level ROUTER, the node table and the supervisor.

One per job. It runs inside node 0's agent (a thread with its own event loop and sockets: the default, as
torchrun's agent store) or as its own process on a host that trains nothing (``swiftrun coordinator``), so that
losing any training node is an in-place recovery. It holds the one :class:`~swiftrun.launcher.job.Job` of the
whole world, with stable slots (node slot k owns ranks [k*P, (k+1)*P)), and routes that state machine's actions
to the agent holding each node slot; agents turn their workers' moments into the state machine's events.

Node loss is seen two ways: the agent's TCP connection closes (the ROUTER's socket monitor: a loud loss, at
once), or the agent stays silent for ``--node-timeout`` (a frozen or partitioned node). Either way its ranks
fail as one batch (one generation), and their replacements wait for whoever takes the slot: the same node
restarted, or a hot spare at once. Every store call lives in the workers; this loop makes none.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from swiftrun.config import LaunchConfig
from swiftrun.errors import LaunchError, ProtocolError
from swiftrun.dashboard.live import Dashboard
from swiftrun.events import EventLog, EventName
from swiftrun.launcher import view, wire
from swiftrun.launcher.actions import Action, Assign, Finish, Kill, Note, Record, ResetStore, Send, Spawn
from swiftrun.launcher.failures import format_summary
from swiftrun.launcher.job import Job
from swiftrun.launcher.nodes import Accepted, Node, NodeState, NodeTable
from swiftrun.launcher.store import AgentStore
from swiftrun.launcher.wire import NodeKind, ReportKind
from swiftrun.protocol.control import EventKind
from swiftrun.snapshot import JobSnapshot, NodeView

FINISH_GRACE = 5.0
PROGRESS_PERIOD = 0.25  # seconds between sampled progress events in the event log
SNAPSHOT_PERIOD = 0.2  # seconds between published snapshots, at least (see _publish)
# a hot-spare node unheard for this many heartbeat intervals is passed over when a slot is handed out, and gets
# it at its next beat (a vacant slot costs that wait; a slot handed to a spare that is gone costs --node-timeout)
SPARE_FRESH_BEATS = 3
SNAPSHOT_SHARE = 0.05  # at most this share of the loop's time goes to building snapshots (10,000 ranks: ~50 ms)


def fingerprint(config: LaunchConfig) -> dict[str, Any]:
    """What every agent of one job must agree on."""
    ep = config.entrypoint
    return {
        "nnodes": list(config.nnodes), "nproc_per_node": config.nproc_per_node, "kind": ep.kind.value,
        "script": ep.target, "args": list(ep.args), "rdzv_id": config.rdzv_id, "recovery": config.recovery.value,
        "max_restarts": config.max_restarts, "max_recoveries": config.max_recoveries,
    }


def control_endpoint(config: LaunchConfig, store_port: int) -> int:
    return config.control_port or store_port + 1


class Coordinator:
    """``registers``: whether the job's script registers ``swiftrun.Run`` (the Job needs it). Node 0's agent reads
    its own copy of the script; a standalone coordinator (``standalone=True``) may have no copy of it and takes
    the first agent's answer from its JOIN."""

    def __init__(self, config: LaunchConfig, event_log_path: Path, registers: bool | None,
                 standalone: bool = False, reporter: Any = None) -> None:
        self.config = config
        self.registers = registers
        self.standalone = standalone
        self.reporter = reporter  # the job's dashboard or plain lines (None: nobody watches, e.g. a benchmark)
        self.notes: collections.deque[str] = collections.deque(maxlen=8)
        self.throughput = view.Throughput()
        self._next_publish = 0.0
        self._nodes_at_end: tuple[NodeView, ...] | None = None  # as the job ended: agents leaving then are not lost
        # nodes that went quiet together are lost together if their last beats are within 2 intervals
        self.nodes = NodeTable(config.nnodes[0], config.timeouts.node_timeout,
                               settle=2 * config.timeouts.heartbeat_interval)
        self.nodes.fingerprint = fingerprint(config)
        self.event_log = EventLog(event_log_path)
        self.job: Job | None = None
        self.pending: dict[int, list[Action]] = {k: [] for k in range(config.nnodes[0])}
        self.stopped: dict[int, frozenset[int]] = {}
        self.vacant_since: dict[int, float] = {}  # node slots lost while the job runs, until taken back
        self.exit_code: int | None = None
        self.finish_deadline: float | None = None
        self.t0 = time.monotonic()
        self.store = AgentStore(config.master_addr, config.master_port, config.world_size,
                                flag="--rdzv-endpoint" if standalone else "--master-port")
        self.port = control_endpoint(config, self.store.port)
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        self.router.router_mandatory = 1
        self.monitor = self.router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        try:
            self.router.bind(f"tcp://*:{self.port}")
        except zmq.ZMQError as exc:
            self.close()
            raise LaunchError(f"cannot open the coordinator's control port {self.port}: {exc} (--rdzv-conf "
                              "control_port=N picks another)") from None
        self._fd_identity: dict[int, bytes] = {}
        # actions for each agent, sent as one DO per agent once a decision is made (_flush_actions)
        self._outbox: dict[bytes, list[dict[str, Any]]] = {}
        self._last_progress: tuple[float, Any] = (0.0, None)
        self._job_due = 0.0  # when Job.tick is next due (its next_deadline at the last tick)
        self.event_log.write(EventName.JOB_START, world_size=config.world_size, nnodes=config.nnodes[0],
                             script=config.entrypoint.target, pid=os.getpid(), coordinator=True,
                             standalone=standalone)

    # ------------------------------------------------------------------ loop

    def run(self, stop_fd: int | None = None, signal_sock: socket.socket | None = None) -> int:
        """The one decision loop, whoever hosts it. ``stop_fd`` readable: stop now (node 0's agent is done).
        ``signal_sock``: the process's signal wakeup socket (a standalone coordinator is its process's main
        thread): a signal stops the job as it would on one node, a second one kills the workers at once."""
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        if stop_fd is not None:
            poller.register(stop_fd, zmq.POLLIN)
        if signal_sock is not None:
            poller.register(signal_sock.fileno(), zmq.POLLIN)
        self.t0 = time.monotonic()  # join_timeout counts from here, not from before the store's torch import
        try:
            while True:
                now = time.monotonic()
                if self.finish_deadline is not None and (now >= self.finish_deadline or not self.nodes.current()):
                    break
                ready = dict(poller.poll(max(0.0, self._next_deadline(now) - now) * 1000))
                if stop_fd is not None and stop_fd in ready:
                    break
                if signal_sock is not None and signal_sock.fileno() in ready:
                    self._on_signals(signal_sock, time.monotonic())
                if self.monitor in ready:
                    self._drain_monitor()
                if self.router in ready:
                    self._drain_router()
                self._tick(time.monotonic())
                self._flush_actions()
                self._publish(time.monotonic())
        finally:
            self.close()
        return self.exit_code if self.exit_code is not None else 1

    def _next_deadline(self, now: float) -> float:
        candidates = [now + self.config.timeouts.heartbeat_interval, self.nodes.next_deadline(now)]
        if self.vacant_since:
            candidates.append(min(self.vacant_since.values()) + self.config.timeouts.join_timeout)
        if self.job is not None:
            candidates.append(self._job_due)
        if self.finish_deadline is not None:
            candidates.append(self.finish_deadline)
        return max(now, min(candidates))

    def _tick(self, now: float) -> None:
        silent = f"silent for more than {self.config.timeouts.node_timeout:g}s"
        self._nodes_gone([(node, silent, now - node.last_seen) for node in self.nodes.tick(now)], now)
        if self.job is None and self.exit_code is None and now - self.t0 > self.config.timeouts.join_timeout:
            missing = ", ".join(map(str, self.nodes.vacant()))
            self._note(f"node slot(s) {missing} did not join within {self.config.timeouts.join_timeout:g}s "
                       "(--rdzv-conf join_timeout)")
            self._finish(1, now)
        self._vacant_too_long(now)
        if self.job is not None and now >= self._job_due:
            # Job.tick walks every slot of the world: run it when its own next_deadline says it may have work
            # (at most every heartbeat interval), not after every message, which at 10,000 ranks is the cost
            stopped = frozenset().union(*self.stopped.values()) if self.stopped else frozenset()
            self._execute(self.job.tick(now, stopped), now)
            self._job_due = self.job.next_deadline(now)

    def _on_signals(self, sock: socket.socket, now: float) -> None:
        try:
            received = sock.recv(64)
        except (BlockingIOError, InterruptedError):
            return
        for signum in received:
            self._note(f"received {signal.Signals(signum).name}")
            if self.job is None:
                self._finish(128 + signum, now)  # nothing runs yet: the agents leave with the job's status
            elif self.exit_code is None:
                self._execute(self.job.on_signal(signum, now), now)

    def _vacant_too_long(self, now: float) -> None:
        """A lost node slot nobody takes back within join_timeout ends the job: the survivors would wait for it
        until the workers' start-up deadline, and with every node lost nobody is left to wait for."""
        limit = self.config.timeouts.join_timeout
        late = sorted(k for k, since in self.vacant_since.items() if now - since > limit)
        if not late or self.job is None or self.exit_code is not None:
            return
        for k in late:
            del self.vacant_since[k]
        slots = ", ".join(map(str, late))
        self._execute(self.job.give_up(f"node slot(s) {slots} stayed vacant for more than {limit:g}s: neither the "
                                       "restarted node nor a hot spare took it (--rdzv-conf join_timeout)", now), now)

    # ------------------------------------------------------------------ messages

    def _drain_monitor(self) -> None:
        gone: list[tuple[Node, str, float]] = []  # connections that closed together: one batch, one recovery
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            event = parse_monitor_message(frames)
            fd = event["value"]
            identity = self._fd_identity.pop(fd, None)
            if event["event"] == zmq.EVENT_DISCONNECTED and identity is not None:
                node = self.nodes.lose(identity)
                if node is not None:
                    gone.append((node, "its agent's connection closed", 0.0))
        self._nodes_gone(gone, time.monotonic())

    def _drain_router(self) -> None:
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            try:
                self._fd_identity[frames[1].get(zmq.SRCFD)] = identity
            except zmq.ZMQError:
                pass
            try:
                kind, body = wire.decode([f.bytes for f in frames[1:]])
            except ProtocolError as exc:
                self._note(f"dropped a malformed node message: {exc}")
                continue
            now = time.monotonic()
            if kind is NodeKind.JOIN:
                self._on_join(identity, body, now)
                continue
            node = self.nodes.seen(identity, now)
            if node is None:
                self._send(identity, NodeKind.FENCED, {"reason": "this agent is not the current incarnation of "
                                                                 "its node slot any more"})
                continue
            if kind is NodeKind.BEAT:
                self._send(identity, NodeKind.LEASE, {})
                if node.state is NodeState.SPARE and self.vacant_since and self.exit_code is None:
                    for slot in sorted(self.vacant_since):  # a spare passed over while it was quiet
                        self._take_over(slot, now)
                self._on_beat(node, body, now)
            elif kind is NodeKind.REPORT:
                self._on_report(node, body, now)

    def _on_join(self, identity: bytes, body: dict[str, Any], now: float) -> None:
        if body.get("proto") != wire.NODE_PROTOCOL_VERSION:
            self._send(identity, NodeKind.REFUSE, {"reason": "swiftrun versions differ between nodes", "exit_code": 2})
            return
        info = {"host": body.get("host"), "pid": body.get("pid")}
        result = self.nodes.join(identity, int(body.get("node_rank", -1)), dict(body.get("fingerprint") or {}), now,
                                 info)
        if not isinstance(result, Accepted):
            self._note(f"refused the agent of node rank {body.get('node_rank')} ({info['host']}): {result.reason}")
            self._send(identity, NodeKind.REFUSE, {"reason": result.reason, "exit_code": 2})
            return
        node = result.node
        if self.registers is None:
            self.registers = bool(body.get("registers"))
        repeated = node.joined_at != now
        self._send(identity, NodeKind.ACCEPT, {
            "slot": node.slot, "incarnation": node.incarnation, "store_host": self.config.master_addr,
            "store_port": self.store.port, "run_id": self.config.rdzv_id,
        })
        if repeated:
            return  # a JOIN sent again before our answer arrived
        self._log(EventName.NODE_JOINED, node_rank=node.node_rank, slot=node.slot, incarnation=node.incarnation,
                  **info)
        self._note(f"node rank {node.node_rank} joined" + (f" as slot {node.slot} (incarnation {node.incarnation})"
                                                           if node.slot is not None else " as a hot spare"))
        if node.slot is not None:
            self._slot_filled(node, now)
        elif self.job is not None:
            for slot in self.nodes.vacant():
                self._take_over(slot, now)

    def _on_beat(self, node: Node, body: dict[str, Any], now: float) -> None:
        if self.job is None or node.slot is None:
            return
        slots = self.job.slots

        def mine(key: Any) -> bool:  # one of this node's processes (looked up per key: a BEAT costs O(P))
            slot = slots.get(int(key))
            return slot is not None and slot.node == node.slot

        for key, step in dict(body.get("seen") or {}).items():
            if mine(key):
                self.job.on_alive(int(key), now, step if isinstance(step, int) else None)
        for key, status in dict(body.get("status") or {}).items():
            if mine(key) and isinstance(status, list) and len(status) == 4:
                self._execute(self.job.on_status(int(key), now, *status), now)
                if slots[int(key)].rank == 0:
                    self._progress(now, status)
        self.stopped[node.slot] = frozenset(int(s) for s in body.get("stopped") or () if mine(s))

    def _on_report(self, node: Node, body: dict[str, Any], now: float) -> None:
        if self.job is None or node.slot is None:
            return
        try:
            what = ReportKind(body["what"])
            slot_id = int(body["slot_id"])
            data = dict(body.get("data") or {})
        except (KeyError, ValueError, TypeError):
            self._note(f"dropped a malformed report from node slot {node.slot}")
            return
        if what is ReportKind.SIGNAL:
            self._execute(self.job.on_signal(int(data["signum"]), now), now)
            return
        slot = self.job.slots.get(slot_id)
        if slot is None or slot.node != node.slot:
            return  # not this node's process (a stale report)
        if what is ReportKind.SPAWNED:
            self._execute(self.job.on_spawned(slot_id, int(data["pid"]), now), now)
        elif what is ReportKind.SPAWN_FAILED:
            self._execute(self.job.on_spawn_failed(slot_id, str(data.get("reason")), now), now)
        elif what is ReportKind.HELLO:
            self._execute(self.job.on_hello(slot_id, int(data.get("gen", 0)), now), now)
        elif what is ReportKind.EVENT:
            try:
                kind = EventKind(data["event"])
            except (KeyError, ValueError):
                return
            self._execute(self.job.on_event(slot_id, int(data.get("gen", 0)), kind, dict(data.get("data") or {}),
                                            now), now)
        elif what is ReportKind.EXITED:
            if data.get("traceback") and slot.traceback is None:
                slot.traceback = str(data["traceback"])
            self._execute(self.job.on_exit(slot_id, int(data["returncode"]), now,
                                           error_file=data.get("error_file")), now)

    def _progress(self, now: float, status: list[Any]) -> None:
        """Rank 0's progress, sampled (at most every PROGRESS_PERIOD), for the report's timeline."""
        step, loss, step_time, _ = status
        if isinstance(step, int):
            self.throughput.add(now, step)
        if step == self._last_progress[1] or now - self._last_progress[0] < PROGRESS_PERIOD:
            return
        self._last_progress = (now, step)
        self.event_log.write(EventName.PROGRESS, at=now, step=step, loss=loss, step_time=step_time)

    # ------------------------------------------------------------------ membership

    def _slot_filled(self, node: Node, now: float) -> None:
        assert node.slot is not None
        if self.job is None:
            if self.nodes.full():
                self.job = Job(self.config, now, wall_offset=time.time() - time.monotonic(),
                               registers=bool(self.registers))
                for holder in self.nodes.holder.values():
                    self._tell_job_host(holder)
                self._note(f"every node joined: starting {self.config.world_size} ranks on "
                           f"{self.config.nnodes[0]} nodes")
                self._execute(self.job.start(now), now)
            return
        self.vacant_since.pop(node.slot, None)
        self._tell_job_host(node)
        self._execute(self.job.on_node_joined(node.slot, now), now)
        queued, self.pending[node.slot] = self.pending[node.slot], []
        for action in queued:
            self._do(node.identity, action)

    def _take_over(self, slot: int, now: float) -> None:
        # a spare that missed beats is not trusted with a slot (NodeTable.take_over); found by the partition
        # tests: slot 1 went to a spare cut off 2 s earlier, which had already fenced itself, and the job waited
        # --node-timeout more for it, then recovered a second time
        fresh = SPARE_FRESH_BEATS * self.config.timeouts.heartbeat_interval
        spare = self.nodes.take_over(slot, now, fresh_within=fresh)
        if spare is None:
            return
        self._log(EventName.NODE_TAKEOVER, node_rank=spare.node_rank, slot=slot, incarnation=spare.incarnation)
        self._note(f"hot-spare node rank {spare.node_rank} takes over node slot {slot}")
        self._send(spare.identity, NodeKind.TAKE, {"slot": slot, "incarnation": spare.incarnation})
        self._slot_filled(spare, now)

    def _nodes_gone(self, gone: list[tuple[Node, str, float]], now: float) -> None:
        """Nodes lost together ((node, cause, seconds since it went quiet) each): their slots fail in one Job
        call, so one generation repairs them all."""
        if not gone or self.exit_code is not None:
            return  # the job is over: agents leaving is expected
        lost: dict[int, tuple[str, float]] = {}
        for node, cause, detect in gone:
            self._log(EventName.NODE_LOST, node_rank=node.node_rank, slot=node.slot, incarnation=node.incarnation,
                      cause=cause, host=node.info.get("host"))
            self._send(node.identity, NodeKind.FENCED, {"reason": f"this node was declared lost: {cause}"})
            if node.slot is None:
                self._note(f"hot-spare node rank {node.node_rank} left: {cause}")
                continue
            self._note(f"node slot {node.slot} (node rank {node.node_rank}) lost: {cause}")
            self.stopped.pop(node.slot, None)
            if self.job is not None:
                self.vacant_since[node.slot] = now
                self.pending[node.slot] = []
                lost[node.slot] = (cause, detect)
        if not lost:
            return
        assert self.job is not None
        self._execute(self.job.on_nodes_lost(lost, now), now)
        for slot in sorted(lost):
            if self.exit_code is None:
                self._take_over(slot, now)

    # ------------------------------------------------------------------ actions

    def _execute(self, actions: list[Action], now: float) -> None:
        assert self.job is not None
        vanished: list[Kill] = []
        records: list[Record] = []
        for action in actions + self.job.drain_records():
            if isinstance(action, Spawn):
                self._route(action.node, action)
            elif isinstance(action, Kill) and self.nodes.holder.get(self.job.slots[action.slot_id].node) is None:
                vanished.append(action)
            elif isinstance(action, (Assign, Send, Kill)):
                self._route(self.job.slots[action.slot_id].node, action, queue=isinstance(action, Assign))
            elif isinstance(action, ResetStore):
                self.store.reset()
                for node in self.nodes.current():
                    self._do(node.identity, action)
            elif isinstance(action, Record):
                records.append(action)
            elif isinstance(action, Note):
                self._note(action.text)
            elif isinstance(action, Finish):
                self._finish(action.exit_code, now)
        # the agents first, the event log after: a failure at 10,000 ranks writes 10,000 worker_state records,
        # which must not delay the ABORTs
        self._flush_actions()
        for record in records:
            fields = dict(record.fields)
            if isinstance(fields.get("start"), float):
                fields["start"] = self.event_log.since_start(fields["start"])
            self.event_log.write(record.event, at=record.at, **fields)
        for kill in vanished:
            self._kill_on_vacant_node(kill, now)

    def _kill_on_vacant_node(self, kill: Kill, now: float) -> None:
        """A process to kill on a node slot nobody holds lives nowhere: it died with its agent, or its Spawn
        still waits in the queue for the slot's next holder. Drop what waits for it and tell the Job it is
        gone, or a job stopping with a node missing would wait forever for exits no agent can report."""
        assert self.job is not None
        node = self.job.slots[kill.slot_id].node
        self.pending[node] = [a for a in self.pending[node] if getattr(a, "slot_id", None) != kill.slot_id]
        self._execute(self.job.on_exit(kill.slot_id, -int(kill.signum), now,
                                       cause=f"node slot {node} is vacant"), now)

    def _route(self, slot: int, action: Action, queue: bool = True) -> None:
        holder = self.nodes.holder.get(slot)
        if holder is None:
            if queue:
                self.pending[slot].append(action)  # for whoever takes the slot
            return
        self._do(holder.identity, action)

    def _finish(self, code: int, now: float) -> None:
        if self.exit_code is not None:
            return
        self.exit_code = code
        self._nodes_at_end = view.node_views(self.nodes, self.job, self.config.nproc_per_node, now)
        self._publish(now, force=True)  # the final state reaches the dashboard before the agents stop it
        self.nodes.close("it finished" if code == 0 else f"it failed with exit code {code}")
        told = self._summary_for_agents(code)
        for node in self.nodes.current():
            if told is not None:
                self._do(node.identity, told)
            self._do(node.identity, Finish(code))
        self.finish_deadline = now + FINISH_GRACE

    def _summary_for_agents(self, code: int) -> Note | None:
        """A standalone coordinator's output is on another host: each agent also prints why the job failed."""
        if not self.standalone or code == 0:
            return None
        if self.job is not None and self.job.failures:
            return Note(format_summary(self.config.entrypoint.target, self.job.failures))
        return Note(f"the job ended with exit code {code} (see the coordinator's output and event log)")

    # ------------------------------------------------------------------ output

    def _do(self, identity: bytes, action: Action) -> None:
        self._outbox.setdefault(identity, []).append(wire.action_body(action))

    def _flush_actions(self) -> None:
        """One DO per agent for everything decided since the last flush (a decision, or what the loop's turn
        queued): a failure's ABORTs to a node's ranks travel in one message (at 1,000 ranks, 125 messages for 8
        ranks per node rather than 1,000)."""
        outbox, self._outbox = self._outbox, {}
        for identity, actions in outbox.items():
            self._send(identity, NodeKind.DO, wire.do_body(actions))

    def _send(self, identity: bytes, kind: NodeKind, body: dict[str, Any]) -> None:
        if kind is not NodeKind.DO and identity in self._outbox:  # what was decided before goes first
            self._send(identity, NodeKind.DO, wire.do_body(self._outbox.pop(identity)))
        try:
            self.router.send_multipart([identity, *wire.encode(kind, body)], zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):
            pass  # the agent is gone: its connection's close or its silence tells the node table

    def _tell_job_host(self, node: Node | None) -> None:
        """The Job names a failure's machine: which host and incarnation hold each node slot."""
        if self.job is not None and node is not None and node.slot is not None:
            self.job.node_hosts[node.slot] = (str(node.info.get("host") or "?"), node.incarnation)

    def _note(self, text: str) -> None:
        self.notes.append(text)
        self._say(f"swiftrun coordinator: {text}")

    def _say(self, text: str) -> None:
        if isinstance(self.reporter, Dashboard):
            self.reporter.print_line(text)  # above the live dashboard, which a bare print would tear
        else:
            print(text, file=sys.stderr, flush=True)

    def snapshot(self, now: float) -> JobSnapshot:
        """The whole job as the dashboard shows it, nodes included. Call it on the thread running :meth:`run`
        (it reads the Job); the result is immutable and may go to any thread."""
        nodes = self._nodes_at_end or view.node_views(self.nodes, self.job, self.config.nproc_per_node, now)
        common = dict(started_at=self.t0, notes=tuple(self.notes), event_log=str(self.event_log.path))
        if self.job is None:
            return view.waiting_snapshot(self.config, now, nodes=nodes, **common)
        return view.job_snapshot(self.job, self.config, now, throughput=self.throughput,
                                 local_rank=lambda rank: rank % self.config.nproc_per_node, nodes=nodes, **common)

    def _publish(self, now: float, force: bool = False) -> None:
        if self.reporter is None or (now < self._next_publish and not force):
            return
        built = time.monotonic()
        self.reporter.update(self.snapshot(now))
        # a snapshot walks every rank: keep it a small share of the loop's time at any world size
        self._next_publish = now + max(SNAPSHOT_PERIOD, (time.monotonic() - built) / SNAPSHOT_SHARE)

    def _log(self, event: EventName, **fields: Any) -> None:
        self.event_log.write(event, **fields)

    def close(self) -> None:
        if self.router.closed:
            return
        if self.job is not None:
            self._publish(time.monotonic(), force=True)  # the final state (its host stops the reporter)
            self.event_log.write(EventName.JOB_END, outcome="succeeded" if self.exit_code == 0 else "failed",
                                 exit_code=self.exit_code, duration=time.monotonic() - self.t0,
                                 failures=len(self.job.failures), time_lost=self.job.time_lost,
                                 failures_after_release=len(self.job.late_failures))
            if self.exit_code not in (0, None) and self.job.failures:
                self._say(format_summary(self.config.entrypoint.target, self.job.failures))
        self.router.disable_monitor()
        self.monitor.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()
        self.event_log.close()
        self.store.close()
