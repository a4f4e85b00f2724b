"""Multi-node decisions with a fake clock: the node table (identity = slot + incarnation, fencing deadlines),
the node-level wire format, and the supervisor's handling of a whole node lost."""

from __future__ import annotations

import pytest

from swiftrun.errors import ProtocolError
from swiftrun.launcher import wire
from swiftrun.events import EventName
from swiftrun.launcher.actions import Assign, Finish, Kill, Record, Send, Spawn
from swiftrun.launcher.nodes import Accepted, NodeState, NodeTable, Refused
from swiftrun.protocol.control import CommandKind, EventKind
from swiftrun.snapshot import JobState, WorkerState
from tests.unit.test_job import _no_dns, of, sends, Sim  # noqa: F401  (fixture)

FP = {"nproc_per_node": 2, "script": "train.py"}


def table(nnodes: int = 2) -> NodeTable:
    return NodeTable(nnodes, node_timeout=10.0)


def test_slots_fill_by_node_rank_and_a_live_slot_is_never_handed_out_twice():
    t = table()
    a = t.join(b"a", 0, FP, 0.0, {"pid": 1, "host": "h0"})
    assert isinstance(a, Accepted) and (a.node.slot, a.node.incarnation) == (0, 0)
    assert not t.full()
    dup = t.join(b"a2", 0, FP, 1.0)
    assert isinstance(dup, Refused) and "already held by a live agent (pid 1 on h0)" in dup.reason
    assert isinstance(t.join(b"b", 1, FP, 1.0), Accepted) and t.full()
    assert t.join(b"a", 0, FP, 2.0) == a  # a JOIN repeated: the same answer


def test_another_command_line_is_refused_with_the_difference_named():
    t = table()
    t.join(b"a", 0, FP, 0.0)
    res = t.join(b"b", 1, {**FP, "nproc_per_node": 4}, 0.0)
    assert isinstance(res, Refused) and "nproc_per_node: 4 here, 2 in the job" in res.reason


def test_a_lost_slot_is_rejoined_with_a_new_incarnation_and_the_old_one_is_fenced():
    t = table()
    t.join(b"a", 0, FP, 0.0)
    t.join(b"b", 1, FP, 0.0)
    lost = t.lose(b"b")
    assert lost is not None and lost.state is NodeState.LOST and t.vacant() == [1]
    assert t.lose(b"b") is None  # once
    assert t.seen(b"b", 1.0) is None  # a stale incarnation is not listened to
    again = t.join(b"b2", 1, FP, 2.0)
    assert isinstance(again, Accepted) and again.node.incarnation == 1 and t.full()


def test_silence_longer_than_the_node_timeout_loses_the_node():
    t = table()
    t.join(b"a", 0, FP, 0.0)
    t.join(b"b", 1, FP, 0.0)
    t.seen(b"a", 9.0)
    assert t.tick(10.0) == []  # exactly the timeout: not yet
    lost = t.tick(10.5)
    assert [n.identity for n in lost] == [b"b"] and t.vacant() == [1]
    assert t.next_deadline(10.5) == 19.0


def test_a_hot_spare_waits_and_takes_over_a_vacant_slot():
    t = table()
    t.join(b"a", 0, FP, 0.0)
    t.join(b"b", 1, FP, 0.0)
    spare = t.join(b"s", 2, FP, 1.0)
    assert isinstance(spare, Accepted) and spare.node.slot is None and spare.node.state is NodeState.SPARE
    assert t.take_over(1, 2.0) is None  # slot 1 is held
    t.lose(b"b")
    taken = t.take_over(1, 3.0)
    assert taken is not None and (taken.slot, taken.incarnation, taken.state) == (1, 1, NodeState.LIVE)
    assert t.full()


def test_nodes_that_went_quiet_together_are_lost_in_one_batch():
    t = NodeTable(3, node_timeout=10.0, settle=0.4)
    for k, ident in enumerate((b"a", b"b", b"c")):
        t.join(ident, k, FP, 0.0)
    t.seen(b"a", 9.9)  # a keeps beating
    t.seen(b"b", 0.0)
    t.seen(b"c", 0.15)  # b and c were cut off together, their last beats 0.15 s apart
    assert t.tick(10.05) == [] and t.next_deadline(10.05) == 10.15  # b is due, c about to be: wait for c
    assert [n.identity for n in t.tick(10.2)] == [b"b", b"c"] and t.vacant() == [1, 2]
    # alone, a silent node is lost at its timeout; one that merely beats late does not hold it back past settle
    t2 = NodeTable(2, node_timeout=10.0, settle=0.4)
    t2.join(b"a", 0, FP, 0.0)
    t2.join(b"b", 1, FP, 0.0)
    t2.seen(b"a", 9.9)
    assert [n.identity for n in t2.tick(10.05)] == [b"b"]
    t3 = NodeTable(2, node_timeout=10.0, settle=0.4)
    t3.join(b"a", 0, FP, 0.0)
    t3.join(b"b", 1, FP, 0.0)
    t3.seen(b"a", 0.1)
    assert t3.tick(10.05) == []
    t3.seen(b"a", 10.3)  # a beat after all
    assert [n.identity for n in t3.tick(10.31)] == [b"b"]


def test_two_nodes_lost_together_cost_one_generation():
    sim = Sim(1, registers=True, nnodes=(3, 3), master_port=5, spares=0)
    sim.boot(sim.start())
    for rank in range(3):
        sim.event(sim.slot(rank), EventKind.REGISTERED)
    actions = sim._take(sim.job.on_nodes_lost({1: ("silent for more than 4s", 4.0), 2: ("silent for more than 4s",
                                                                                        4.1)}, sim.now))
    assert sim.job.generation == 1 and sim.job.state is JobState.RECOVERING
    (start,) = [a.fields for a in actions if isinstance(a, Record) and a.event is EventName.RECOVERY_START]
    assert start["nodes"] == [1, 2] and start["failed_ranks"] == [1, 2], start
    assert sorted(s.rank for s in of(actions, Spawn) if s.rank is not None) == [1, 2]
    assert {a.slot_id for a in sends(actions, CommandKind.ABORT)} == {sim.slot(0)}


def test_a_slot_goes_to_the_longest_waiting_spare_heard_from_lately():
    t = table(1)
    t.join(b"a", 0, FP, 0.0)
    t.join(b"s1", 1, FP, 1.0)  # the longest waiting, but quiet since
    t.join(b"s2", 2, FP, 2.0)
    t.seen(b"s2", 9.5)
    t.lose(b"a")
    assert t.take_over(0, 10.0, fresh_within=0.3) is None  # nobody beat within 0.3 s
    t.seen(b"s2", 10.1)
    taken = t.take_over(0, 10.2, fresh_within=0.3)
    assert taken is not None and taken.identity == b"s2" and taken.slot == 0


def test_nobody_joins_a_finished_job():
    t = table()
    t.join(b"a", 0, FP, 0.0)
    t.close("it finished")
    res = t.join(b"b", 1, FP, 1.0)
    assert isinstance(res, Refused) and "the job is over (it finished)" in res.reason


@pytest.mark.parametrize("action", [
    Spawn(3, 2, 1, 4, 0, True, 1), Spawn(5, None, 0, 0, 0, False, 1), Assign(3, 2, 1, 4, 0),
    Send(3, 4, 7, CommandKind.RECOVER, {"world_size": 4, "replaced": [2, 3]}), Kill(3, 9), Finish(0),
])
def test_actions_cross_the_wire_unchanged(action):
    kind, body = wire.decode(wire.encode(wire.NodeKind.DO, wire.do_body([wire.action_body(action)] * 2)))
    assert kind is wire.NodeKind.DO and wire.actions_of(body) == [action, action]


@pytest.mark.parametrize("body", [{}, {"actions": "Kill"}, {"actions": [{"type": "Nope", "fields": {}}]},
                                  {"actions": [["Kill"]]}])
def test_a_malformed_do_message_is_a_protocol_error(body):
    with pytest.raises(ProtocolError):
        wire.actions_of(body)


def multinode_sim(**config) -> Sim:
    sim = Sim(2, registers=True, nnodes=(2, 2), master_port=5, spares=1, **config)
    sim.boot(sim.start())
    for rank in range(4):
        sim.event(sim.slot(rank), EventKind.REGISTERED)
    return sim


def test_spares_live_on_every_node_and_a_worker_failure_uses_its_own_nodes_spare():
    sim = multinode_sim()
    spares = {sim.job.slots[s].node: s for s in sim.spares()}
    assert sorted(spares) == [0, 1]
    actions = sim.exit(sim.slot(3), -9)
    (assign,) = of(actions, Assign)
    assert assign.rank == 3 and assign.slot_id == spares[1]


def test_a_lost_node_fails_its_ranks_in_one_generation_and_replaces_them_on_its_slot():
    sim = multinode_sim()
    survivors = [sim.slot(0), sim.slot(1)]
    sim.job.node_hosts[1] = ("host-b", 0)  # the coordinator keeps who holds each slot
    actions = sim._take(sim.job.on_node_lost(1, sim.now, "its agent's connection closed"))
    assert sim.job.generation == 1 and sim.job.state is JobState.RECOVERING
    # the event log names the node slot, the machine and its incarnation for each failure and the recovery
    failed = [a.fields for a in actions if isinstance(a, Record) and a.event is EventName.WORKER_FAILED]
    assert [(f["rank"], f["node"], f["host"], f["node_incarnation"]) for f in failed] == [(2, 1, "host-b", 0),
                                                                                         (3, 1, "host-b", 0)]
    (start,) = [a.fields for a in actions if isinstance(a, Record) and a.event is EventName.RECOVERY_START]
    assert start["nodes"] == [1] and start["cause"] == "node slot 1 lost: its agent's connection closed"
    spawns = of(actions, Spawn)
    assert sorted(s.rank for s in spawns if s.rank is not None) == [2, 3]
    assert all(s.node == 1 and s.joining for s in spawns if s.rank is not None)
    assert not [s for s in spawns if s.rank is None and s.node == 1]  # no spare for a vacant node
    assert {a.slot_id for a in sends(actions, CommandKind.ABORT)} == set(survivors)
    assert all(sim.state(s) is WorkerState.ABORTING for s in survivors)
    # the slot's agent is back: it gets its spare again
    back = sim._take(sim.job.on_node_joined(1, sim.now))
    assert [s.node for s in of(back, Spawn)] == [1]
