"""The multi-node dashboard: ranks grouped by node, node states, and a view that stays readable at 1,000+ ranks.

Rendered on the same fixed-size capture console as tests/unit/test_dashboard.py; snapshots are made by hand, and
the snapshot builder (launcher/view.py) is driven through the real NodeTable and Job with a fake clock.
"""

from __future__ import annotations

import dataclasses
import io
import re

import pytest

from swiftrun.config import Entrypoint, EntrypointKind, LaunchConfig
from swiftrun.dashboard.live import PlainReporter
from swiftrun.dashboard.render import MAX_NODE_ROWS
from swiftrun.launcher import view
from swiftrun.launcher.actions import Spawn
from swiftrun.launcher.job import Job
from swiftrun.launcher.nodes import NodeTable
from swiftrun.protocol.control import EventKind
from swiftrun.snapshot import JobState, NodeSlotState, NodeView, RankView, WorkerState
from tests.unit.test_dashboard import HEIGHT, assert_fits, healthy_rank, plain_lines, rendered, snapshot
from tests.unit.test_job import _no_dns  # noqa: F401  (fixture)

# A node-table row: node slot (or "-" for a hot spare), state, host.
NODE_STATES = "|".join(state.value for state in NodeSlotState)
NODE_ROW = re.compile(rf"^\s*(\d+|-)\s+({NODE_STATES})\s+(\S+)")
# A rank-table row with the node column first: node, rank, local, pid, state.
RANK_STATES = "|".join(state.value for state in WorkerState)
RANK_ROW = re.compile(rf"^\s*(\d+)\s+(\d+)\s+\d+\s+(?:\d+|-)\s+({RANK_STATES})\b")


def node_rows(text: str) -> dict[str, tuple[str, str]]:
    """Node slot ("-" for spares: the last one wins) -> (state, host), for every node with a row."""
    return {m[1]: (m[2], m[3]) for line in text.splitlines() if (m := NODE_ROW.match(line))}


def rank_rows(text: str) -> dict[int, tuple[int, str]]:
    """Rank -> (node slot, state), for every rank with a row."""
    return {int(m[2]): (int(m[1]), m[3]) for line in text.splitlines() if (m := RANK_ROW.match(line))}


def cluster(nnodes: int, per_node: int, spares: int = 0) -> tuple[list[RankView], list[NodeView]]:
    ranks = [dataclasses.replace(healthy_rank(r), local_rank=r % per_node, node=r // per_node)
             for r in range(nnodes * per_node)]
    nodes = [NodeView(k, NodeSlotState.LIVE, k, f"host-{k}", 0, tuple(range(k * per_node, (k + 1) * per_node)), 0.3)
             for k in range(nnodes)]
    nodes += [NodeView(None, NodeSlotState.SPARE, nnodes + i, f"spare-{i}", None, (), 0.2) for i in range(spares)]
    return ranks, nodes


def lose(ranks: list[RankView], nodes: list[NodeView], slot: int) -> None:
    nodes[slot] = dataclasses.replace(nodes[slot], state=NodeSlotState.LOST, heartbeat_age=None)
    for r in nodes[slot].ranks:
        ranks[r] = dataclasses.replace(ranks[r], state=WorkerState.FAILED, heartbeat_age=None)


def rejoin(ranks: list[RankView], nodes: list[NodeView], slot: int, host: str, node_rank: int) -> None:
    nodes[slot] = dataclasses.replace(nodes[slot], state=NodeSlotState.REJOINING, host=host, node_rank=node_rank,
                                      incarnation=1)
    for r in nodes[slot].ranks:
        ranks[r] = dataclasses.replace(ranks[r], state=WorkerState.JOINING, step=None, restarts=1, pid=None)


def multinode(ranks: list[RankView], nodes: list[NodeView], **overrides: object):
    return snapshot(ranks, nodes=tuple(nodes), nnodes=sum(1 for n in nodes if n.slot is not None), **overrides)


# --- render: small jobs show every node and every rank ----------------------------------------------------------


def test_a_small_job_lists_every_node_with_its_state_host_and_incarnation_and_every_rank_with_its_node():
    ranks, nodes = cluster(3, 2, spares=1)
    lose(ranks, nodes, 1)
    rejoin(ranks, nodes, 2, "host-9", 9)

    text = rendered(multinode(ranks, nodes, state=JobState.RECOVERING))

    assert node_rows(text) == {"0": ("live", "host-0"), "1": ("lost", "host-1"), "2": ("rejoining", "host-9"),
                               "-": ("spare", "spare-0")}
    rejoined = next(line for line in text.splitlines() if NODE_ROW.match(line) and "rejoining" in line)
    assert re.search(r"rejoining\s+host-9\s+9\s+1\s+4-5\b", rejoined), rejoined  # node rank 9, incarnation 1
    assert rank_rows(text) == {0: (0, "running"), 1: (0, "running"), 2: (1, "failed"), 3: (1, "failed"),
                               4: (2, "joining"), 5: (2, "joining")}
    assert "nodes live 1  rejoining 1  lost 1  spare 1" in text  # the header's count
    assert_fits(text)


def test_before_every_node_joined_the_dashboard_shows_who_is_missing():
    nodes = [NodeView(0, NodeSlotState.LIVE, 0, "host-0", 0, (0, 1), 0.1), NodeView(1, NodeSlotState.WAITING,
                                                                                    ranks=(2, 3))]
    text = rendered(snapshot([], nodes=tuple(nodes), nnodes=2, world_size=4, state=JobState.STARTING))

    assert node_rows(text) == {"0": ("live", "host-0"), "1": ("waiting", "-")}
    assert_fits(text)


# --- render: 1,000+ ranks ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("nnodes", [128, 1250])  # 1,024 and 10,000 ranks
def test_at_scale_healthy_nodes_collapse_into_one_line_and_problem_nodes_are_expanded(nnodes: int):
    ranks, nodes = cluster(nnodes, 8, spares=2)
    lose(ranks, nodes, 7)
    rejoin(ranks, nodes, 3, "host-new", nnodes + 5)
    ranks[8 * 20 + 3] = dataclasses.replace(ranks[8 * 20 + 3], step_time=0.9)  # a straggler on node 20
    nodes[40] = dataclasses.replace(nodes[40], heartbeat_age=6.0)  # a quiet agent on node 40

    text = rendered(multinode(ranks, nodes, events=tuple(f"event {i}" for i in range(20))))

    listed = node_rows(text)
    assert list(listed)[:4] == ["7", "3", "20", "40"]  # lost, rejoining, then live nodes with a problem
    assert listed["-"] == ("spare", "spare-1") and len(listed) == 5  # both spares had a row; "-" keeps the last
    assert re.search(r"rank 163 slow", text) and "agent quiet 6.0s" in text
    healthy = nnodes - 4
    assert re.search(rf"{healthy} healthy nodes \(slots 0-2,4-6,8-19,21-39,41-{nnodes - 1}\)", text), text
    assert rank_rows(text) == {163: (20, "running")}  # the ranks of live nodes worth a look, with their node
    assert f"{nnodes} node slots:  live {nnodes - 2}  rejoining 1  lost 1  spare 2" in text
    assert_fits(text)


def test_many_problem_nodes_list_the_worst_and_count_the_rest():
    ranks, nodes = cluster(200, 8)
    for slot in range(10, 60):
        lose(ranks, nodes, slot)
    ranks[8 * 100] = dataclasses.replace(ranks[8 * 100], state=WorkerState.FAILED)  # one rank of a live node

    text = rendered(multinode(ranks, nodes, state=JobState.RECOVERING))

    listed = node_rows(text)
    assert len(listed) == MAX_NODE_ROWS and all(state == "lost" for state, _ in listed.values())
    assert "150 healthy nodes" not in text and "149 healthy nodes" in text
    assert f"{51 - MAX_NODE_ROWS} more with problems not listed" in text
    assert rank_rows(text)[800] == (100, "failed")
    assert len(text.splitlines()) <= HEIGHT
    assert_fits(text)


def test_a_recovery_at_scale_is_not_every_node_s_problem():
    """Survivors aborting together is the recovery, not a node's trouble: only the lost node gets a row."""
    ranks, nodes = cluster(1250, 8)
    lose(ranks, nodes, 5)
    ranks = [r if r.state is WorkerState.FAILED else dataclasses.replace(r, state=WorkerState.ABORTING)
             for r in ranks]

    text = rendered(multinode(ranks, nodes, state=JobState.RECOVERING))

    assert list(node_rows(text)) == ["5"]
    assert re.search(r"1249 healthy nodes .*their ranks: aborting 9992", text), text
    assert_fits(text)


# --- plain lines ------------------------------------------------------------------------------------------------


def test_plain_reporter_names_node_slot_host_and_incarnation_on_every_node_change():
    out = io.StringIO()
    reporter = PlainReporter(out)
    ranks, nodes = cluster(1000, 2, spares=1)
    reporter.update(multinode([], [NodeView(n.slot, NodeSlotState.WAITING, ranks=n.ranks) for n in nodes[:1000]],
                              world_size=2000, state=JobState.STARTING))
    reporter.update(multinode(ranks, nodes))
    lose(ranks, nodes, 1)
    reporter.update(multinode(ranks, nodes))
    rejoin(ranks, nodes, 1, "spare-0", 1000)
    reporter.update(multinode(ranks, nodes[:-1]))  # the spare took the slot: it is no spare any more
    nodes[1] = dataclasses.replace(nodes[1], state=NodeSlotState.LIVE)
    reporter.update(multinode(ranks, nodes[:-1]))

    lines = plain_lines(out)
    assert "[swiftrun] node slots 0-999 waiting -> live" in lines  # 1,000 nodes coming up: one line
    assert "[swiftrun] hot-spare node rank 1000 (spare-0) joined: waiting to take over a lost node slot" in lines
    assert "[swiftrun] node slot 1 (node rank 1, host-1, incarnation 0) live -> lost" in lines
    assert ("[swiftrun] node slot 1 (node rank 1000, spare-0, incarnation 1; was node rank 1, host-1, incarnation 0)"
            " lost -> rejoining") in lines
    assert "[swiftrun] node slot 1 (node rank 1000, spare-0, incarnation 1) rejoining -> live" in lines
    assert sum(line.startswith("[swiftrun] node slot") for line in lines) == 4  # one line per change, no repeats


def test_plain_reporter_names_both_holders_when_a_hot_spare_took_a_slot_between_two_snapshots():
    out = io.StringIO()
    reporter = PlainReporter(out)
    ranks, nodes = cluster(2, 2, spares=1)
    reporter.update(multinode(ranks, nodes))
    rejoin(ranks, nodes, 1, "spare-0", 2)  # lost and taken over at once: no snapshot saw it lost
    reporter.update(multinode(ranks, nodes[:-1]))

    assert ("[swiftrun] node slot 1 (node rank 2, spare-0, incarnation 1; was node rank 1, host-1, incarnation 0)"
            " live -> rejoining") in plain_lines(out)


# --- the snapshot builder, on the real node table and supervisor ------------------------------------------------


def _config(nnodes: int, nproc: int) -> LaunchConfig:
    return LaunchConfig(entrypoint=Entrypoint(EntrypointKind.SCRIPT, "train.py"), nproc_per_node=nproc,
                        nnodes=(nnodes, nnodes), node_rank=0, master_addr="127.0.0.1", rdzv_backend="c10d",
                        rdzv_id="t", external_coordinator=True, spares=0)


def test_node_views_follow_a_node_lost_and_rejoined_through_its_recovery():
    config = _config(2, 2)
    table = NodeTable(2, node_timeout=10.0)
    table.join(b"a", 0, {}, 0.0, {"host": "host-a"})
    table.join(b"b", 1, {}, 0.0, {"host": "host-b"})
    table.join(b"s", 2, {}, 0.0, {"host": "host-s"})
    job = Job(config, 0.0, registers=True)
    for spawn in [a for a in job.start(0.0) if isinstance(a, Spawn)]:
        job.on_spawned(spawn.slot_id, 100 + spawn.slot_id, 0.0)
        job.on_hello(spawn.slot_id, 0, 0.0)
        job.on_event(spawn.slot_id, 0, EventKind.REGISTERED, {}, 0.0)

    def states(now: float) -> list[tuple[int | None, str, str | None, int | None]]:
        return [(n.slot, n.state.value, n.host, n.incarnation) for n in view.node_views(table, job, 2, now)]

    assert states(1.0) == [(0, "live", "host-a", 0), (1, "live", "host-b", 0), (None, "spare", "host-s", None)]
    table.lose(b"b")
    job.on_node_lost(1, 2.0, "its agent's connection closed")
    assert states(2.0)[1] == (1, "lost", "host-b", 0)  # the last holder, while the slot is vacant

    table.take_over(1, 3.0)
    job.on_node_joined(1, 3.0)
    assert states(3.0) == [(0, "live", "host-a", 0), (1, "rejoining", "host-s", 1)]

    snap = view.job_snapshot(job, config, 3.0, started_at=0.0, notes=(), event_log=None, throughput=view.Throughput(),
                             local_rank=lambda r: r % 2, nodes=view.node_views(table, job, 2, 3.0))
    assert [(r.rank, r.node) for r in snap.ranks] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert snap.failures == 2 and snap.recovery is not None and snap.recovery.failed_ranks == (2, 3)
    assert all("node slot 1 lost" in f.cause and f.node == 1 for f in job.failures)
