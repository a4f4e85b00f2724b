"""Pipelines across machines (examples/train_pp.py on 2 nodes x 2 ranks), node 1 SIGKILLed mid-run and its
command started again:

- DP x PP (``--dp 2``): node 1 holds the whole second pipeline replica; its stages come back from the replicas on
  node 0 (no replay, no checkpoint read);
- 4 stages: node 1 holds stages 2 and 3, adjacent, with the checkpoint of stage 2 (kept by stage 3) lost with
  them; with ``--stage-ckpt-dir`` on storage both nodes see, the two stages replay together from their
  checkpoints on disk and the logs of stage 1 (node 0), while node 0 keeps its processes."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.helpers import EXAMPLES, run, swiftrun_cmd, wait_until
from tests.integration.multinode_support import free_port_pair, node_cmd, start_node, stop_all
from tests.integration.recovery_support import flat_state, max_rel_diff
from tests.integration.test_multinode import _events, _step

TRAIN_PP = str(EXAMPLES / "train_pp.py")
ARGS = ("--steps", "80", "--schedule", "1f1b", "--optimizer", "adamw", "--dropout", "0.1", "--ckpt-every", "10")


def _flat(path) -> dict[str, torch.Tensor]:
    return flat_state(torch.load(path, weights_only=True))


@pytest.mark.integration
@pytest.mark.extended  # two nodes, a restarted node's cold start and a reference run: ~1 min on 2 cores
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["replicas", "stages"])
def test_a_lost_node_of_a_pipeline_job_is_recovered_in_place(tmp_path, marker, layout):
    port = free_port_pair()
    events = tmp_path / "events.jsonl"
    script = ("--dp", "2") if layout == "replicas" else ()
    launcher = ("--stage-ckpt-dir", str(tmp_path / "ckpt")) if layout == "stages" else ()

    def cmd(k: int, *extra: str) -> list[str]:
        return node_cmd("swiftrun", 2, k, port, "--spares", "0", "--heartbeat-timeout", "20", *launcher, *extra,
                        TRAIN_PP, *ARGS, *script, "--save-dir", str(tmp_path / "save"))

    procs = [start_node(cmd(0, "--event-log", str(events)), marker, tmp_path / "n0.log"),
             start_node(cmd(1), marker, tmp_path / "n1.log")]
    try:
        wait_until(lambda: _step(events) >= 25, timeout=240, what="training to pass step 25")
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        procs.append(start_node(cmd(1), marker, tmp_path / "n1b.log"))
        codes = [procs[0].wait(timeout=400), procs[2].wait(timeout=60)]
        assert codes == [0, 0], (tmp_path / "n0.log").read_text()[-3000:]
    finally:
        stop_all(procs)
    log = _events(events)
    ended = [e for e in log if e["event"] == "recovery_end"]
    assert [e["outcome"] for e in ended] == ["recovered"] and ended[0]["failed_ranks"] == [2, 3], ended
    replays = {tuple(e["ranks"]) for e in log if e["event"] == "replay"}
    if layout == "replicas":  # "undo": node 0's ranks had applied the interrupted step's update, undone first
        assert ended[0]["mode"] in ("replica", "undo") and not replays, ended
    else:
        assert ended[0]["mode"] == "replay" and replays == {(2, 3)}, (ended, replays)
    for rank in (0, 1):  # node 0's processes kept
        assert len({e["pid"] for e in log if e["event"] == "worker_state" and e["rank"] == rank}) == 1

    reference = tmp_path / "ref"
    proc = run(swiftrun_cmd("--nproc-per-node", "4", "--no-dashboard", "--spares", "0", TRAIN_PP, *ARGS, *script,
                            "--save-dir", str(reference)), marker, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(4):
        got, want = _flat(tmp_path / "save" / f"rank{rank}.pt"), _flat(reference / f"rank{rank}.pt")
        assert max_rel_diff(got, want) <= 1e-5, f"rank {rank}"  # bitwise unless an update was undone
    for rank in (0, 1) if layout == "replicas" else ():  # a stage's replicas are bitwise equal
        a, b = _flat(tmp_path / "save" / f"rank{rank}.pt"), _flat(tmp_path / "save" / f"rank{rank + 2}.pt")
        assert all(torch.equal(a[k], b[k]) for k in a), f"stage {rank}'s replicas differ"
