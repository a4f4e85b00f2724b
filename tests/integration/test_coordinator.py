"""`swiftrun coordinator`: the store and the job's control plane on a host that trains nothing, so that losing
any training node, node 0 included, is an in-place recovery. Nodes run as in test_multinode.py: one launcher per
"node", each in its own session; SIGKILL to a node's process group is the machine gone."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
import torch

from tests.helpers import SCRIPTS, swiftrun_cmd, wait_until
from tests.integration.multinode_support import (
    TRAIN, coordinator_cmd, free_port_pair, node_cmd, start_node, stop_all,
)
from tests.integration.recovery_support import flat_state, max_rel_diff
from tests.integration.test_multinode import _events, _pids, _step, alive

EXTERNAL = "--external-coordinator"
ARGS = ("--steps", "300", "--optimizer", "adam", "--hidden", "64", "--layers", "3")


def _job(tmp_path, port: int):
    """The coordinator's and the agents' command lines of one job (the same flags and script)."""
    events = tmp_path / "events.jsonl"
    flags = ("--spares", "0", "--heartbeat-timeout", "20")
    script = (TRAIN, *ARGS, "--save-dir", str(tmp_path / "save"))
    coordinator = coordinator_cmd(2, port, *flags, "--event-log", str(events), *script)
    return events, coordinator, lambda k: node_cmd("swiftrun", 2, k, port, *flags, EXTERNAL, *script)


def _assert_exact(tmp_path, marker) -> None:
    """Replicas bitwise equal, and the model of the failure-free run (one node, same 4 ranks)."""
    ref = tmp_path / "ref"
    proc = start_node(swiftrun_cmd("--nproc-per-node", "4", "--heartbeat-interval", "0.2", "--no-dashboard",
                                   "--spares", "0", TRAIN, *ARGS, "--save-dir", str(ref)), marker, tmp_path / "ref.log")
    try:
        assert proc.wait(timeout=120) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    finally:
        stop_all([proc])
    results = [flat_state(torch.load(tmp_path / "save" / f"rank{r}.pt")) for r in range(4)]
    for r in range(1, 4):
        for key in results[0]:
            assert torch.equal(results[0][key], results[r][key]), f"replica {r} differs from rank 0 in {key}"
    assert max_rel_diff(results[0], flat_state(torch.load(ref / "rank0.pt"))) <= 1e-5


@pytest.mark.integration
@pytest.mark.timeout(400)
@pytest.mark.parametrize("takeover", ["restarted", pytest.param("hot-spare", marks=pytest.mark.extended)])
def test_node_0_killed_mid_run_is_recovered_in_place(tmp_path, marker, takeover):
    """With the coordinator off the training nodes, SIGKILL of node 0's whole process group mid-run; node 0's
    command started again (or a hot-spare node waiting) takes slot 0: every process exits 0, node 1's workers
    keep their pids, the model is the failure-free one."""
    port = free_port_pair()
    events, coordinator, agent = _job(tmp_path, port)
    procs = [start_node(coordinator, marker, tmp_path / "coordinator.log"),
             start_node(agent(0), marker, tmp_path / "n0.log"),
             start_node(agent(1), marker, tmp_path / "n1.log")]
    if takeover == "hot-spare":
        procs.append(start_node(agent(2), marker, tmp_path / "spare.log"))
    try:
        wait_until(lambda: _step(events) >= 20, timeout=240, what="training to pass step 20")
        if takeover == "hot-spare":
            wait_until(lambda: any(e["event"] == "node_joined" and e["slot"] is None for e in _events(events)),
                       timeout=60, what="the hot spare to join")
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        if takeover == "restarted":
            procs.append(start_node(agent(0), marker, tmp_path / "n0b.log"))
        codes = [p.wait(timeout=300) for p in procs if p is not procs[1]]
        assert codes == [0, 0, 0], (tmp_path / "coordinator.log").read_text()[-3000:]
    finally:
        stop_all(procs)
    log = _events(events)
    ended = [e for e in log if e["event"] == "recovery_end"]
    assert [e["outcome"] for e in ended] == ["recovered"] and ended[0]["failed_ranks"] == [0, 1], ended
    assert any(e["event"] == "node_lost" and e["slot"] == 0 for e in log)
    for rank in (2, 3):  # node 1's workers: one process each, incarnation 0 throughout
        seen = {(e["pid"], e["incarnation"]) for e in log if e["event"] == "worker_state" and e["rank"] == rank}
        assert len(seen) == 1 and next(iter(seen))[1] == 0, seen
    lost = next(e for e in log if e["event"] == "node_lost")
    resumed = next(e for e in log if e["event"] == "recovery_phase" and e["phase"] == "resume")
    print(f"\nnode 0 {takeover}: node lost -> training resumed in {resumed['t'] - lost['t']:.2f}s "
          f"(recovery total {ended[0]['total']:.2f}s; load {open('/proc/loadavg').read().split()[0]})")
    _assert_exact(tmp_path, marker)


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.extended
def test_losing_the_coordinator_fences_every_agent(tmp_path, marker):
    """SIGKILL of the coordinator mid-run: each agent hears nothing for --node-lease, kills its workers and exits
    1 saying why; no worker is left behind."""
    port = free_port_pair()
    events, coordinator, agent = _job(tmp_path, port)
    procs = [start_node(coordinator, marker, tmp_path / "coordinator.log")]
    procs += [start_node(agent(k) + [], marker, tmp_path / f"n{k}.log") for k in (0, 1)]
    try:
        wait_until(lambda: _step(events) >= 5, timeout=90, what="training to start")
        workers = _pids(_events(events), (0, 1, 2, 3))
        t0 = time.monotonic()
        os.killpg(procs[0].pid, signal.SIGKILL)
        assert [procs[1].wait(timeout=30), procs[2].wait(timeout=30)] == [1, 1]
        assert time.monotonic() - t0 < 15  # the 5 s default lease, and the agents' teardown
        for k in (0, 1):
            assert "fenced: no word from the coordinator" in (tmp_path / f"n{k}.log").read_text()
        wait_until(lambda: not any(alive(pid) for pid in workers), timeout=10, what="the workers to go")
    finally:
        stop_all(procs)


# --- bad input: fast, no worker ever starts ---------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_no_coordinator_at_the_endpoint_is_a_clear_error_within_seconds(tmp_path, marker):
    port = free_port_pair()
    t0 = time.monotonic()
    proc = start_node(node_cmd("swiftrun", 2, 1, port, EXTERNAL, "--rdzv-conf", "connect_timeout=1",
                               str(SCRIPTS / "dump_env.py")), marker, tmp_path / "n.log")
    try:
        assert proc.wait(timeout=30) == 1
        assert time.monotonic() - t0 < 10
        text = (tmp_path / "n.log").read_text()
        assert f"cannot reach the coordinator at 127.0.0.1:{port + 1}" in text and "Traceback" not in text, text
    finally:
        stop_all([proc])


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_coordinator_port_in_use(tmp_path, marker):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = start_node(coordinator_cmd(2, port, str(SCRIPTS / "dump_env.py")), marker, tmp_path / "c.log")
        try:
            assert proc.wait(timeout=40) == 1
        finally:
            stop_all([proc])
    text = (tmp_path / "c.log").read_text()
    assert f"port {port} is already in use on this host (--rdzv-endpoint)" in text and "Traceback" not in text, text


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.extended  # the same, in-process: tests/unit/test_coordinator_process.py
def test_coordinator_refuses_another_job_and_stops_on_sigterm(tmp_path, marker):
    """The coordinator's own command line is the job's: even the first agent is refused when it differs. A
    SIGTERM before the job started ends the coordinator at once with 128 + 15."""
    port = free_port_pair()
    script = str(SCRIPTS / "dump_env.py")
    coordinator = start_node(coordinator_cmd(2, port, script, "--lr", "1"), marker, tmp_path / "c.log")
    procs = [coordinator]
    try:
        wait_until(lambda: "waiting for 2 node(s)" in (tmp_path / "c.log").read_text(), timeout=60,
                   what="the coordinator to listen")
        procs.append(start_node(node_cmd("swiftrun", 2, 0, port, EXTERNAL, script, "--lr", "2"), marker,
                                tmp_path / "n.log"))
        assert procs[1].wait(timeout=40) == 2
        text = (tmp_path / "n.log").read_text()
        assert "refused this agent: this agent's command line differs from the job's: args" in text, text
        coordinator.send_signal(signal.SIGTERM)
        assert coordinator.wait(timeout=10) == 128 + signal.SIGTERM
    finally:
        stop_all(procs)
