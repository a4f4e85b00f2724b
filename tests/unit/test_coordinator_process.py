"""The Coordinator's loop in a thread of this process, with ZeroMQ DEALERs standing in for node agents (no
worker runs): the standalone coordinator's own behaviour, over real sockets on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import json
import signal
import socket
import threading
import time

import pytest
import zmq

from swiftrun.config import Entrypoint, EntrypointKind, LaunchConfig, Timeouts
from swiftrun.errors import LaunchError
from swiftrun.launcher import _check_free, wait_reachable, wire
from swiftrun.launcher.coordinator import Coordinator, fingerprint
from swiftrun.launcher.actions import Finish, Spawn
from swiftrun.launcher.wire import NodeKind, ReportKind
from swiftrun.protocol.control import EventKind
from tests.helpers import wait_until
from tests.integration.multinode_support import free_port_pair

pytestmark = pytest.mark.timeout(60)


def _config(port: int, nnodes: int = 2) -> LaunchConfig:
    return LaunchConfig(
        entrypoint=Entrypoint(EntrypointKind.SCRIPT, "train.py", ("--lr", "1")), nproc_per_node=1,
        nnodes=(nnodes, nnodes),
        master_addr="127.0.0.1", master_port=port, rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_id="j1", external_coordinator=True, spares=0,
        timeouts=Timeouts(heartbeat_interval=0.1, node_lease=1.0, node_timeout=2.0, shutdown_timeout=1.0,
                          join_timeout=4.0),
    )


class FakeAgent:
    def __init__(self, ctx: zmq.Context, port: int, node_rank: int) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.identity = f"node:{node_rank}:test".encode()
        self.sock.connect(f"tcp://127.0.0.1:{port + 1}")
        self.node_rank = node_rank

    def send(self, kind: NodeKind, body: dict) -> None:
        self.sock.send_multipart(wire.encode(kind, body))

    def recv(self, want: NodeKind, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                kind, body = wire.decode(self.sock.recv_multipart())
                if kind is want:
                    return body
        raise AssertionError(f"node {self.node_rank}: no {want.value} within {timeout}s")

    def actions(self, timeout: float = 10.0) -> list:
        """The actions of the next DO message."""
        return wire.actions_of(self.recv(NodeKind.DO, timeout))

    def join(self, config: LaunchConfig) -> dict:
        self.send(NodeKind.JOIN, {"proto": wire.NODE_PROTOCOL_VERSION, "node_rank": self.node_rank,
                                  "fingerprint": fingerprint(config), "host": "h", "pid": 1, "registers": True})
        return self.recv(NodeKind.ACCEPT)


@pytest.fixture
def served(tmp_path, request):
    """A standalone coordinator in a thread; ``request.param`` (indirect): ``nnodes`` or ``(nnodes, nproc)``."""
    port = free_port_pair()
    nnodes, nproc = (lambda p: p if isinstance(p, tuple) else (p, 1))(getattr(request, "param", 2))
    config = dataclasses.replace(_config(port, nnodes), nproc_per_node=nproc)
    coordinator = Coordinator(config, tmp_path / "events.jsonl", registers=None, standalone=True)
    sig_r, sig_w = socket.socketpair()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(coordinator.run(signal_sock=sig_r)), daemon=True)
    thread.start()
    ctx = zmq.Context()
    try:
        yield config, port, ctx, thread, result, sig_w
    finally:
        sig_w.close()
        thread.join(10)
        sig_r.close()
        ctx.destroy(linger=0)
        assert not thread.is_alive(), "the coordinator lingered"


def test_every_node_lost_ends_the_job_and_the_coordinator_after_join_timeout(served, capfd):
    """Both nodes lost (node 1 first: every rank is respawned, and those Spawns wait in the queue for the slots'
    next holders): nobody takes the slots back within join_timeout, so the job stops; the kills of processes that
    live nowhere count as exits, so the coordinator ends instead of waiting for exits no agent can report."""
    config, port, ctx, thread, result, _ = served
    agents = [FakeAgent(ctx, port, k) for k in (0, 1)]
    accepted = [a.join(config) for a in agents]
    assert [a["slot"] for a in accepted] == [0, 1] and accepted[0]["store_port"] == port
    for agent in agents:  # the first Spawn of each node, reported started
        spawn = agent.actions()[0]
        agent.send(NodeKind.REPORT, {"what": ReportKind.SPAWNED.value, "slot_id": spawn.slot_id, "data": {"pid": 9}})
    agents[1].sock.close(linger=0)  # the connection closes: node 1 lost
    time.sleep(0.3)
    agents[0].sock.close(linger=0)
    thread.join(15)
    assert not thread.is_alive() and result == [1]
    err = capfd.readouterr().err
    assert "node slot(s) 1 stayed vacant for more than 4s" in err, err


def test_a_quiet_hot_spare_gets_a_lost_slot_only_at_its_next_beat(served):
    """A hot spare silent for a few beats (cut off, frozen: it is about to fence itself) is not handed the slot of
    a node lost meanwhile; the slot goes to it when it beats again: it then receives its LEASE, and only after it
    the TAKE (had the slot been handed out at the loss, the TAKE would come first)."""
    config, port, ctx, thread, result, sig_w = served
    agents = [FakeAgent(ctx, port, k) for k in (0, 1, 2)]
    for agent in agents:
        agent.join(config)
    for agent in agents[:2]:
        spawn = agent.actions()[0]
        agent.send(NodeKind.REPORT, {"what": ReportKind.SPAWNED.value, "slot_id": spawn.slot_id, "data": {"pid": 9}})
    quiet_from = time.monotonic()
    while time.monotonic() - quiet_from < 5 * config.timeouts.heartbeat_interval:  # the spare misses 5 beats
        agents[0].send(NodeKind.BEAT, {"seen": {}, "status": {}, "stopped": []})
        agents[0].recv(NodeKind.LEASE)
    agents[1].sock.close(linger=0)  # node 1 lost, loudly
    agents[0].recv(NodeKind.DO)  # its survivor is told (ABORT): the loss was handled
    assert not agents[2].sock.poll(0), "a quiet spare was handed the slot"
    agents[2].send(NodeKind.BEAT, {"seen": {}, "status": {}, "stopped": []})
    kind, _ = wire.decode(agents[2].sock.recv_multipart())
    assert kind is NodeKind.LEASE
    assert agents[2].recv(NodeKind.TAKE)["slot"] == 1
    sig_w.send(bytes([signal.SIGTERM]))
    for agent in agents:
        agent.sock.close(linger=0)
    thread.join(15)


@pytest.mark.parametrize("served", [3], indirect=True)
def test_nodes_cut_off_together_are_lost_in_one_recovery(served, tmp_path):
    """Nodes 1 and 2 fall silent at the same instant (one switch), their last BEATs 50 ms apart: both are lost in
    one batch, one recovery generation (before, node 2's loss came a tick later: a second generation)."""
    config, port, ctx, thread, result, sig_w = served
    agents = [FakeAgent(ctx, port, k) for k in range(3)]
    for agent in agents:
        agent.join(config)
    for agent in agents:  # each node's worker starts and registers swiftrun.Run: the job is running
        sid = agent.actions()[0].slot_id
        agent.send(NodeKind.REPORT, {"what": ReportKind.SPAWNED.value, "slot_id": sid, "data": {"pid": 9}})
        agent.send(NodeKind.REPORT, {"what": ReportKind.HELLO.value, "slot_id": sid, "data": {"gen": 0}})
        agent.send(NodeKind.REPORT, {"what": ReportKind.EVENT.value, "slot_id": sid,
                                     "data": {"gen": 0, "event": EventKind.REGISTERED.value, "data": {}}})
    beat = {"seen": {}, "status": {}, "stopped": []}
    agents[1].send(NodeKind.BEAT, beat)
    agents[1].recv(NodeKind.LEASE)
    quiet_from = time.monotonic()
    while time.monotonic() - quiet_from < 0.05:
        agents[0].send(NodeKind.BEAT, beat)
        agents[0].recv(NodeKind.LEASE)
    agents[2].send(NodeKind.BEAT, beat)
    agents[2].recv(NodeKind.LEASE)
    log = tmp_path / "events.jsonl"

    def lost() -> list[dict]:
        return [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "node_lost"]

    deadline = time.monotonic() + 10
    while len(lost()) < 2 and time.monotonic() < deadline:  # node 0 beats on
        agents[0].send(NodeKind.BEAT, beat)
        agents[0].sock.poll(int(config.timeouts.heartbeat_interval * 1000))
        while agents[0].sock.poll(0):
            agents[0].sock.recv_multipart()
    assert [e["slot"] for e in lost()] == [1, 2]

    def starts() -> list[dict]:
        return [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "recovery_start"]

    # the Job's records are written after node_lost (and after the ABORTs went out)
    wait_until(lambda: bool(starts()), timeout=10, what="the recovery_start record")
    (start,) = starts()
    assert start["nodes"] == [1, 2] and start["failed_ranks"] == [1, 2], start
    sig_w.send(bytes([signal.SIGTERM]))
    for agent in agents:
        agent.sock.close(linger=0)
    thread.join(15)


def test_a_signal_before_the_job_starts_ends_it_with_128_plus_the_signal(served):
    config, port, ctx, thread, result, sig_w = served
    agent = FakeAgent(ctx, port, 0)
    agent.join(config)
    sig_w.send(bytes([signal.SIGTERM]))
    finish = [a for a in agent.actions() if isinstance(a, Finish)]
    while not finish:
        finish = [a for a in agent.actions() if isinstance(a, Finish)]
    assert finish[0].exit_code == 128 + signal.SIGTERM
    agent.sock.close(linger=0)
    thread.join(10)
    assert result == [128 + signal.SIGTERM]


def test_the_coordinators_own_command_line_is_the_jobs(served):
    """Even the first agent is refused when its job differs from the coordinator's command line."""
    config, port, ctx, thread, result, sig_w = served
    agent = FakeAgent(ctx, port, 0)
    theirs = dataclasses.replace(config, entrypoint=dataclasses.replace(config.entrypoint, args=("--lr", "2")))
    agent.send(NodeKind.JOIN, {"proto": wire.NODE_PROTOCOL_VERSION, "node_rank": 0, "fingerprint": fingerprint(theirs),
                               "host": "h", "pid": 1, "registers": True})
    refused = agent.recv(NodeKind.REFUSE)
    assert refused["exit_code"] == 2 and "command line differs from the job's: args" in refused["reason"]
    sig_w.send(bytes([signal.SIGINT]))
    thread.join(10)
    assert result == [128 + signal.SIGINT]


def test_wait_reachable_and_check_free():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        wait_reachable("127.0.0.1", port, 1.0)  # something listens: returns at once
        with pytest.raises(LaunchError, match=r"already in use on this host \(--rdzv-endpoint\)"):
            _check_free(port, "--rdzv-endpoint")
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="cannot reach the coordinator"):
        wait_reachable("127.0.0.1", port, 0.5)
    assert time.monotonic() - t0 < 3


@pytest.mark.parametrize("served", [(2, 3)], indirect=True)
def test_what_one_decision_sends_a_node_reaches_it_as_one_message(served):
    """Fan-out per node: the three Spawns of a node's ranks (as later the ABORTs of a failure) travel in one DO,
    in slot order, not one message per rank."""
    config, port, ctx, thread, result, sig_w = served
    agents = [FakeAgent(ctx, port, k) for k in (0, 1)]
    for agent in agents:
        agent.join(config)
    for k, agent in enumerate(agents):
        spawns = agent.actions()
        assert all(isinstance(a, Spawn) for a in spawns), spawns
        assert [a.rank for a in spawns] == [3 * k, 3 * k + 1, 3 * k + 2], spawns
    sig_w.send(bytes([signal.SIGTERM]))
    for agent in agents:
        agent.sock.close(linger=0)
