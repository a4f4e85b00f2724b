"""Network partitions, for real: every "node" (its agent and its workers) and the coordinator on a host of its own,
a network namespace on a bridge (tests/integration/netns_support.py). A cut host keeps running but none of its
packets arrive, and nothing tells it so: the silent loss of a machine's network, which neither SIGKILL (loud) nor
SIGSTOP (the processes stop thinking too) reproduces. Skipped where unprivileged network namespaces are not
available."""

from __future__ import annotations

import datetime
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import swiftrun_cmd, wait_until
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
ARGS = ("--steps", "300", "--optimizer", "adam", "--hidden", "64", "--layers", "3")
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

    def __init__(self, switch: Switch, tmp: Path, marker: str, endpoint: Host, nproc: int, *flags: str) -> None:
        self.switch, self.tmp, self.marker, self.endpoint, self.nproc = switch, tmp, marker, endpoint, nproc
        self.flags = ("--spares", "0", "--heartbeat-timeout", "20", *LEASE, *flags)
        self.script = (TRAIN, *ARGS, "--save-dir", str(tmp / "save"))
        self.events = tmp / "events.jsonl"
        self.procs: list[subprocess.Popen] = []

    def node(self, host: Host, node_rank: int, *extra: str, log: str | None = None) -> subprocess.Popen:
        cmd = node_cmd("swiftrun", 2, node_rank, PORT, *self.flags, *extra, *self.script, nproc=self.nproc,
                       host=self.endpoint.addr)
        return self._start(host, cmd, log or f"{host.name}.log")

    def coordinator(self, host: Host, *extra: str) -> subprocess.Popen:
        cmd = coordinator_cmd(2, PORT, *self.flags, "--event-log", str(self.events), *extra, *self.script,
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

    def assert_exact(self) -> None:
        """Replicas bitwise equal, and the model of the failure-free run (one node, the same ranks)."""
        world = 2 * self.nproc
        ref = self.tmp / "ref"
        proc = start_node(swiftrun_cmd("--nproc-per-node", str(world), "--heartbeat-interval", "0.2",
                                       "--no-dashboard", "--spares", "0", TRAIN, *ARGS, "--save-dir", str(ref)),
                          self.marker, self.tmp / "ref.log")
        try:
            assert proc.wait(timeout=120) == 0, (self.tmp / "ref.log").read_text()[-3000:]
        finally:
            stop_all([proc])
        results = [flat_state(torch.load(self.tmp / "save" / f"rank{r}.pt")) for r in range(world)]
        for r in range(1, world):
            for key in results[0]:
                assert torch.equal(results[0][key], results[r][key]), f"replica {r} differs from rank 0 in {key}"
        assert max_rel_diff(results[0], flat_state(torch.load(ref / "rank0.pt"))) <= 1e-5


def _wall(event: dict) -> float:
    return datetime.datetime.fromisoformat(event["wall"]).timestamp()


def _load() -> str:
    return open("/proc/loadavg").read().split()[0]


@pytest.mark.integration
@pytest.mark.timeout(400)
@pytest.mark.parametrize("takeover", ["hot-spare", pytest.param("restarted", marks=pytest.mark.extended)])
def test_a_partitioned_node_fences_itself_and_its_slot_is_taken_over(tmp_path, marker, switch, takeover):
    """Node 1's network is cut mid-run, its processes still running. While cut off, its agent finds its lease
    expired, kills its workers and exits 1; only then (after --node-timeout) does the coordinator hand slot 1 to a
    hot-spare node (or to node 1's command started again on a fresh host). The link comes back while the job
    trains on: nothing of the old incarnation reaches the job, which ends exit 0 with the failure-free model and
    node 0's worker pids unchanged."""
    nproc = 1 if takeover == "hot-spare" else 2
    n0, n1 = switch.host("n0"), switch.host("n1")
    job = Job(switch, tmp_path, marker, n0, nproc)
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
        wait_until(lambda: job.events_of("node_lost"), timeout=30, what="node 1 declared lost")
        if takeover == "restarted":  # the same command on a fresh machine (the old one is still unreachable)
            others.append(job.node(switch.host("n1b"), 1, log="n1b.log"))
        wait_until(lambda: job.events_of("recovery_end"), timeout=120, what="the recovery to end")
        assert _step(job.events) < 290, "training ended before the link came back: lengthen the run"
        switch.heal(n1)
        healed_at = time.time()
        codes = [p.wait(timeout=300) for p in others]
        assert codes == [0] * len(others), job.log("n0.log")[-3000:]
    finally:
        stop_all(job.procs)
    log = _events(job.events)
    lost = job.events_of("node_lost")
    assert [(e["slot"], e["incarnation"]) for e in lost] == [(1, 0)], lost
    assert lost[0]["cause"].startswith("silent for more than 4s"), lost  # a partition shows as silence
    # the lease ran out before the slot was handed out: never two live incarnations of slot 1
    handed = job.events_of("node_takeover" if takeover == "hot-spare" else "node_joined")[-1]
    assert handed["slot"] == 1 and handed["incarnation"] == 1, handed
    assert fenced_at < _wall(handed), (fenced_at, handed)
    ended = job.events_of("recovery_end")
    assert [(e["outcome"], e["failed_ranks"]) for e in ended] == [("recovered", list(ranks1))], ended
    assert _pids(log, ranks0) == survivors  # node 0's workers kept their processes throughout
    resumed = next(e for e in log if e["event"] == "recovery_phase" and e["phase"] == "resume")
    print(f"\npartition ({takeover}): cut -> fenced {fenced_at - cut_at:.2f}s, cut -> node lost "
          f"{_wall(lost[0]) - cut_at:.2f}s, cut -> training resumed {_wall(resumed) - cut_at:.2f}s, healed "
          f"{healed_at - cut_at:.2f}s after the cut (load {_load()})")
    job.assert_exact()
