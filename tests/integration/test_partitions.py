"""Network partitions, for real: every "node" (its agent and its workers) and the coordinator on a host of its own,
a network namespace on a bridge (tests/integration/netns_support.py). A cut host keeps running but none of its
packets arrive, and nothing tells it so: the silent loss of a machine's network, which neither SIGKILL (loud) nor
SIGSTOP (the processes stop thinking too) reproduces. Skipped where unprivileged network namespaces are not
available."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import wait_until
from tests.integration.multinode_support import (
    TRAIN, coordinator_cmd, node_cmd, start_node, stop_all,
)
from tests.integration.netns_support import Host, Switch, unavailable
from tests.integration.recovery_support import flat_state, max_rel_diff
from tests.integration.test_multinode import _events, _pids, _step, alive

# every host is a network namespace of its own: nothing else can listen on its ports
PORT = 29500
# a cut node fences itself after 2 s without a LEASE; the coordinator hands its slot out after 4 s of silence
LEASE = ("--node-lease", "2", "--node-timeout", "4")
# the random-SIGKILL test's configuration (tests/integration/test_recovery.py), so that the failure-free reference
# (the session's `references` fixture) is computed once for both
WORLD, STEPS = 4, 200


def args(steps: int) -> tuple[str, ...]:
    return ("--steps", str(steps), "--optimizer", "adam", "--hidden", "64", "--layers", "3")
EXTERNAL = "--external-coordinator"


@pytest.fixture
def switch(marker):
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    switch = Switch(marker)
    yield switch
    switch.close()


class Job:
    """One job's processes on the switch's hosts: the command lines, logs, and the job's event log."""

    def __init__(self, switch: Switch, tmp: Path, marker: str, endpoint: Host, flags: tuple[str, ...] = LEASE,
                 steps: int = STEPS, nnodes: int = 2) -> None:
        self.switch, self.tmp, self.marker, self.endpoint = switch, tmp, marker, endpoint
        self.nnodes, self.nproc = nnodes, WORLD // 2 if nnodes == 2 else 1
        self.world = self.nnodes * self.nproc
        self.flags = ("--spares", "0", "--heartbeat-timeout", "20", *flags)
        self.steps = steps
        self.script = (TRAIN, *args(steps), "--save-dir", str(tmp / "save"))
        self.events = tmp / "events.jsonl"
        self.procs: list[subprocess.Popen] = []

    def node(self, host: Host, node_rank: int, *extra: str, log: str | None = None) -> subprocess.Popen:
        cmd = node_cmd("swiftrun", self.nnodes, node_rank, PORT, *self.flags, *extra, *self.script, nproc=self.nproc,
                       host=self.endpoint.addr)
        return self._start(host, cmd, log or f"{host.name}.log")

    def coordinator(self, host: Host, *extra: str) -> subprocess.Popen:
        cmd = coordinator_cmd(self.nnodes, PORT, *self.flags, "--event-log", str(self.events), *extra, *self.script,
                              nproc=self.nproc, host=self.endpoint.addr)
        return self._start(host, cmd, f"{host.name}.log")

    def _start(self, host: Host, cmd: list[str], log: str) -> subprocess.Popen:
        proc = start_node(self.switch.command(host, cmd), self.marker, self.tmp / log, **self.switch.env())
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / name).read_text()

    def events_of(self, kind: str) -> list[dict]:
        return [e for e in _events(self.events) if e["event"] == kind]

    def assert_exact(self, references) -> None:
        """Replicas bitwise equal, and the model of the failure-free run (one node, the same ranks)."""
        reference = references(self.world, "adam", self.steps)
        results = [flat_state(torch.load(self.tmp / "save" / f"rank{r}.pt")) for r in range(self.world)]
        for r in range(1, self.world):
            for key in results[0]:
                assert torch.equal(results[0][key], results[r][key]), f"replica {r} differs from rank 0 in {key}"
        assert max_rel_diff(results[0], flat_state(torch.load(reference / "rank0.pt"))) <= 1e-5


def _wall(event: dict) -> float:
    return datetime.datetime.fromisoformat(event["wall"]).timestamp()


def _load() -> str:
    return open("/proc/loadavg").read().split()[0]


@pytest.mark.integration
@pytest.mark.timeout(400)
@pytest.mark.parametrize("takeover,heal", [
    ("hot-spare", "late"),
    pytest.param("hot-spare", "early", marks=pytest.mark.extended),
    pytest.param("restarted", "late", marks=pytest.mark.extended),
])
def test_a_partitioned_node_fences_itself_and_its_slot_is_taken_over(tmp_path, marker, switch, references,
                                                                       takeover, heal):
    """Node 1's network is cut mid-run, its processes still running. While cut off, its agent finds its lease
    expired, kills its workers and exits 1; only then (after --node-timeout) does the coordinator hand slot 1 to a
    hot-spare node (or to node 1's command started again on a fresh host). The link comes back while the job
    trains on: nothing of the old incarnation reaches the job, which ends exit 0 with the failure-free model and
    node 0's worker pids unchanged.

    heal="early": the link comes back as soon as the old agent has fenced itself, before --node-timeout, so what
    its sockets still held when it exited (its last BEATs and its reports of the workers it killed, queued in
    the kernel while cut off) reaches a coordinator that still counts node 1 live, followed by the connection's
    close: a loud loss then, with the same outcome."""
    n0, n1 = switch.host("n0"), switch.host("n1")
    job = Job(switch, tmp_path, marker, n0)
    nproc = job.nproc
    ranks0, ranks1 = tuple(range(nproc)), tuple(range(nproc, 2 * nproc))
    node0 = job.node(n0, 0, "--event-log", str(job.events))
    node1 = job.node(n1, 1)
    others = [node0]
    if takeover == "hot-spare":
        others.append(job.node(switch.host("spare"), 2))
    try:
        wait_until(lambda: _step(job.events) >= 30 and (takeover != "hot-spare" or any(
            e["slot"] is None for e in job.events_of("node_joined"))), timeout=240,
            what="training past step 30 (and the hot spare joined)")
        survivors, old_workers = _pids(_events(job.events), ranks0), _pids(_events(job.events), ranks1)
        assert len(old_workers) == nproc, old_workers
        switch.cut(n1)
        cut_at = time.time()
        # while still cut off: the old incarnation fences itself, its workers go
        assert node1.wait(timeout=30) == 1, job.log("n1.log")[-3000:]
        fenced_at = time.time()
        assert "fenced: no word from the coordinator" in job.log("n1.log")
        wait_until(lambda: not any(alive(pid) for pid in old_workers), timeout=10, what="the old workers to go")
        if heal == "early":
            assert not job.events_of("node_lost"), "node 1 was declared lost before its agent fenced itself"
            switch.heal(n1)
            healed_at = time.time()
        wait_until(lambda: job.events_of("node_lost"), timeout=30, what="node 1 declared lost")
        if takeover == "restarted":  # the same command on a fresh machine (the old one is still unreachable)
            others.append(job.node(switch.host("n1b"), 1, log="n1b.log"))
        wait_until(lambda: job.events_of("recovery_end"), timeout=120, what="the recovery to end")
        if heal == "late":
            assert _step(job.events) < STEPS - 10, "training ended before the link came back: lengthen the run"
            switch.heal(n1)
            healed_at = time.time()
        codes = [p.wait(timeout=300) for p in others]
        assert codes == [0] * len(others), job.log("n0.log")[-3000:]
    finally:
        stop_all(job.procs)
    log = _events(job.events)
    lost = job.events_of("node_lost")
    assert [(e["slot"], e["incarnation"]) for e in lost] == [(1, 0)], lost
    if heal == "late":  # a partition shows as silence
        assert lost[0]["cause"].startswith("silent for more than 4s"), lost
    # the lease ran out before the slot was handed out: never two live incarnations of slot 1
    handed = job.events_of("node_takeover" if takeover == "hot-spare" else "node_joined")[-1]
    assert handed["slot"] == 1 and handed["incarnation"] == 1, handed
    assert fenced_at < _wall(handed), (fenced_at, handed)
    ended = job.events_of("recovery_end")
    assert [(e["outcome"], e["failed_ranks"]) for e in ended] == [("recovered", list(ranks1))], ended
    assert _pids(log, ranks0) == survivors  # node 0's workers kept their processes throughout
    resumed = next(e for e in log if e["event"] == "recovery_phase" and e["phase"] == "resume")
    print(f"\npartition ({takeover}, heal {heal}): cut -> fenced {fenced_at - cut_at:.2f}s, cut -> node lost "
          f"{_wall(lost[0]) - cut_at:.2f}s, cut -> training resumed {_wall(resumed) - cut_at:.2f}s, healed "
          f"{healed_at - cut_at:.2f}s after the cut (load {_load()})")
    job.assert_exact(references)


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.extended
def test_a_short_partition_is_ridden_out(tmp_path, marker, switch, references):
    """Node 1 cut off for 1.5 s, under its 3 s lease: training stalls (its all-reduces wait on the cut link),
    then TCP retransmits what was in flight and the job goes on as if nothing happened: no node lost, no
    recovery, no process replaced, exit 0, the failure-free model."""
    n0, n1 = switch.host("n0"), switch.host("n1")
    job = Job(switch, tmp_path, marker, n0, ("--node-lease", "3", "--node-timeout", "6"))
    nodes = [job.node(n0, 0, "--event-log", str(job.events)), job.node(n1, 1)]
    try:
        wait_until(lambda: _step(job.events) >= 30, timeout=240, what="training past step 30")
        pids = _pids(_events(job.events), tuple(range(WORLD)))
        switch.cut(n1)
        # the partition itself (how long the link stays down, not a wait for anything): 1.5 s. The event log's
        # progress lags the steps by up to ~0.5 s (statuses ride on heartbeats, progress is sampled), so the
        # stall is read between 0.7 s and 1.5 s into the cut
        time.sleep(0.7)
        before = _step(job.events)
        time.sleep(0.8)
        stalled = _step(job.events)
        switch.heal(n1)
        assert stalled - before <= 1, "training went on while node 1 was cut off: was it?"
        assert [p.wait(timeout=200) for p in nodes] == [0, 0], job.log("n0.log")[-3000:]
    finally:
        stop_all(job.procs)
    log = _events(job.events)
    assert not [e for e in log if e["event"] in ("node_lost", "recovery_start", "worker_failed", "restart")]
    assert _pids(log, tuple(range(WORLD))) == pids and len(pids) == WORLD  # one process per rank, throughout
    assert "fenced" not in job.log("n1.log")
    job.assert_exact(references)


@pytest.mark.integration
@pytest.mark.timeout(200)
@pytest.mark.extended
def test_a_partitioned_coordinator_fences_every_agent(tmp_path, marker, switch):
    """`swiftrun coordinator` on a host of its own, cut off from every node mid-run: each agent, hearing nothing
    for --node-lease, kills its workers and exits 1 saying why, while the coordinator cannot even tell them; the
    coordinator declares both nodes lost after --node-timeout and, every node gone (a restart of all, which
    --max-restarts 0 forbids), ends the job with exit 1 and the failure summary. No process is left."""
    c, n0, n1 = switch.host("coordinator"), switch.host("n0"), switch.host("n1")
    job = Job(switch, tmp_path, marker, c)
    coordinator = job.coordinator(c)
    nodes = [job.node(n, k, EXTERNAL) for k, n in enumerate((n0, n1))]
    try:
        wait_until(lambda: _step(job.events) >= 10, timeout=120, what="training to start")
        workers = _pids(_events(job.events), tuple(range(WORLD)))
        switch.cut(c)
        t0 = time.monotonic()
        assert [p.wait(timeout=30) for p in nodes] == [1, 1]
        fenced = time.monotonic() - t0
        for n in ("n0", "n1"):
            assert "fenced: no word from the coordinator" in job.log(f"{n}.log")
        wait_until(lambda: not any(alive(pid) for pid in workers), timeout=10, what="the workers to go")
        wait_until(lambda: len(job.events_of("node_lost")) == 2, timeout=30, what="both nodes declared lost")
        switch.heal(c)
        assert coordinator.wait(timeout=60) == 1, job.log("coordinator.log")[-3000:]
    finally:
        stop_all(job.procs)
    text = job.log("coordinator.log")
    assert "node slot 0 lost: silent for more than 4s" in text and "Traceback" not in text, text[-3000:]
    assert [e["outcome"] for e in job.events_of("job_end")] == ["failed"], job.events_of("job_end")
    print(f"\ncoordinator cut off: both agents fenced {fenced:.2f}s after the cut (load {_load()})")


@pytest.mark.integration
@pytest.mark.timeout(400)
@pytest.mark.extended
@pytest.mark.parametrize("kill", ["at-once", "after-its-fence"])
def test_a_hot_spare_cut_off_before_it_is_needed(tmp_path, marker, switch, references, kill):
    """The hot spare is cut off, then node 1 dies (SIGKILL, a loud loss). at-once: the coordinator cannot know
    yet, hands slot 1 to the spare, which never hears of it and fences itself; once the spare is declared lost
    (--node-timeout), a second recovery waits for slot 1 again. after-its-fence: the spare, quiet for more than a
    few beats, is passed over (before the fix it got the slot, and the job waited --node-timeout more for a
    process that had already fenced itself), so slot 1 just waits, one recovery. Either way node 1's command,
    started again on a fresh host, takes slot 1: exit 0, the failure-free model, node 0's workers untouched."""
    n0, n1, spare = switch.host("n0"), switch.host("n1"), switch.host("spare")
    job = Job(switch, tmp_path, marker, n0, steps=1000)  # training goes on while the spare fences itself
    node0 = job.node(n0, 0, "--event-log", str(job.events))
    node1 = job.node(n1, 1)
    hot = job.node(spare, 2)
    try:
        wait_until(lambda: _step(job.events) >= 30 and any(e["slot"] is None for e in job.events_of("node_joined")),
                   timeout=240, what="training past step 30 with the hot spare joined")
        survivors = _pids(_events(job.events), (0, 1))
        switch.cut(spare)
        if kill == "after-its-fence":
            assert hot.wait(timeout=30) == 1
        assert _step(job.events) < job.steps - 100, "training nearly over before the kill: lengthen the run"
        os.killpg(node1.pid, signal.SIGKILL)
        assert hot.wait(timeout=30) == 1 and "fenced" in job.log("spare.log"), job.log("spare.log")[-3000:]
        wait_until(lambda: len(job.events_of("node_lost")) == 2, timeout=30, what="the hot spare declared lost")
        node1b = job.node(switch.host("n1b"), 1, log="n1b.log")
        assert [node0.wait(timeout=300), node1b.wait(timeout=60)] == [0, 0], job.log("n0.log")[-3000:]
    finally:
        stop_all(job.procs)
    log = _events(job.events)
    lost = [(e["slot"], e["incarnation"]) for e in job.events_of("node_lost")]
    outcomes = [e["outcome"] for e in job.events_of("recovery_end")]
    # at once, the spare was heard from a moment ago: it takes the slot (unless, on a loaded machine, its last
    # beat was already a few intervals old: then it is passed over as after its fence)
    handed = bool(job.events_of("node_takeover"))
    if handed:
        assert kill == "at-once", "a spare that had fenced itself was handed the slot"
        assert lost == [(1, 0), (1, 1)] and outcomes[-1] == "recovered", (lost, outcomes)
    else:
        assert lost == [(1, 0), (None, -1)] and outcomes == ["recovered"], (lost, outcomes)
    joined = job.events_of("node_joined")[-1]
    assert (joined["slot"], joined["incarnation"]) == (1, 2 if handed else 1), joined
    assert _pids(log, (0, 1)) == survivors
    print(f"\nhot spare cut off, node 1 killed {kill}: slot 1 {'handed to the spare' if handed else 'left vacant'}"
          f", recoveries {outcomes} (load {_load()})")
    job.assert_exact(references)


@pytest.mark.integration
@pytest.mark.timeout(400)
@pytest.mark.extended
def test_two_nodes_cut_off_together_cost_one_recovery(tmp_path, marker, switch, references):
    """Nodes 1 and 2 (3 nodes x 1 rank) are cut off at the same instant, as behind one failed switch: both fence
    themselves, both are declared lost in one batch, one recovery generation replaces their ranks on two hot
    spares; exit 0, the failure-free model, node 0's worker untouched. (Before, their last beats a fraction of
    an interval apart made two losses a tick apart, each its own generation.)"""
    n0, n1, n2 = switch.host("n0"), switch.host("n1"), switch.host("n2")
    job = Job(switch, tmp_path, marker, n0, nnodes=3)
    node0 = job.node(n0, 0, "--event-log", str(job.events))
    cut = [job.node(n1, 1), job.node(n2, 2)]
    spares = [job.node(switch.host(f"spare{k}"), k) for k in (3, 4)]
    try:
        wait_until(lambda: _step(job.events) >= 30 and sum(e["slot"] is None for e in job.events_of("node_joined"))
                   == 2, timeout=240, what="training past step 30 with both hot spares joined")
        survivor = _pids(_events(job.events), (0,))
        switch.cut(n1, n2)
        assert [p.wait(timeout=30) for p in cut] == [1, 1]
        wait_until(lambda: job.events_of("recovery_end"), timeout=120, what="the recovery to end")
        switch.heal(n1, n2)
        assert [p.wait(timeout=300) for p in (node0, *spares)] == [0, 0, 0], job.log("n0.log")[-3000:]
    finally:
        stop_all(job.procs)
    assert sorted(e["slot"] for e in job.events_of("node_lost")) == [1, 2]
    starts = job.events_of("recovery_start")
    assert [(e["generation"], e["nodes"]) for e in starts] == [(1, [1, 2])], starts
    ended = job.events_of("recovery_end")
    assert [(e["generation"], e["outcome"], e["failed_ranks"]) for e in ended] == [(1, "recovered", [1, 2])], ended
    assert sorted(e["slot"] for e in job.events_of("node_takeover")) == [1, 2]
    assert _pids(_events(job.events), (0,)) == survivor
    job.assert_exact(references)
