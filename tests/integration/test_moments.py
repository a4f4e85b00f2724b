"""A failure at any moment of a job: while it starts, and after training finished on every rank.

Real launcher, real workers, real signals. A failure the infrastructure causes while the ranks are still
starting (before every rank reached ``swiftrun.Run``) restarts the job without using ``--max-restarts``, and
the job ends exactly as a failure-free one; a script's own error at that moment still fails fast; a rank that
dies after every rank was released does not fail a completed job.
"""

from __future__ import annotations

import json
import time

import pytest

from swiftrun.events import read_events
from tests.helpers import SCRIPTS, run, swiftrun_cmd
from tests.integration.recovery_support import flat_state, launch_args, load_results

pytestmark = pytest.mark.integration

RUN_TIMEOUT = 120


def events_of(path, name: str) -> list[dict]:
    return [e for e in read_events(path) if e["event"] == name]


@pytest.mark.timeout(240)
def test_a_rank_killed_while_the_job_starts_restarts_it_and_the_result_equals_a_failure_free_run(
    references, tmp_path, marker
):
    events = tmp_path / "events.jsonl"
    # rank 1 is SIGKILLed by the bootstrap before the script runs (an OOM kill while importing, say); defaults
    # otherwise: --max-restarts 0, so without the start-up window this would end the job with 1
    proc = run(launch_args(2, "sgd", tmp_path / "save", events, ["--fault", "1:0:import:sigkill"]), marker,
               timeout=RUN_TIMEOUT)

    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "start-up restart 1 of 3" in proc.stderr and "not counted in --max-restarts" in proc.stderr
    (restart,) = events_of(events, "restart")
    assert restart["startup"] is True and restart["attempt"] == 1 and "start-up failure" in restart["reason"]
    (failed,) = events_of(events, "worker_failed")
    assert (failed["rank"], failed["signal"]) == (1, "SIGKILL")
    assert events_of(events, "recovery_start") == []  # restarted, not recovered in place
    expected = flat_state(load_results(references(2, "sgd"), 1)[0])
    for result in load_results(tmp_path / "save", 2):
        state = flat_state(result)
        assert all(state[k].equal(expected[k]) for k in expected), "restarted run differs from the reference"
    # the ranks were "starting" until they registered swiftrun.Run, and "finishing" at the end of their loop
    states = [(e["rank"], e["previous"], e["state"]) for e in events_of(events, "worker_state")]
    assert (0, "starting", "running") in states and (0, "running", "finishing") in states


@pytest.mark.timeout(120)
def test_a_script_raising_on_import_in_every_rank_still_fails_fast(tmp_path, marker):
    attempts = tmp_path / "attempts"
    began = time.monotonic()
    proc = run(swiftrun_cmd("--no-dashboard", "--nproc-per-node", "2", str(SCRIPTS / "swift_import_error.py"),
                            str(attempts)), marker, timeout=RUN_TIMEOUT)

    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "No module named 'swiftrun_test_no_such_module'" in proc.stderr.split("Root Cause", 1)[1]
    assert {line.split()[0] for line in attempts.read_text().splitlines()} == {"0"}  # no restart of any kind
    assert "restarting" not in proc.stderr
    assert time.monotonic() - began < 60


@pytest.mark.timeout(180)
def test_a_rank_killed_after_training_completed_everywhere_does_not_fail_the_job(tmp_path, marker):
    events = tmp_path / "events.jsonl"
    proc = run(swiftrun_cmd("--no-dashboard", "--nproc-per-node", "3", "--heartbeat-interval", "0.2",
                            "--event-log", str(events), str(SCRIPTS / "late_failure.py"), str(tmp_path)),
               marker, timeout=RUN_TIMEOUT)

    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "WARNING: training had completed on every rank; afterwards rank 1" in proc.stderr  # the Note
    assert "training completed on every rank (3 of 3 finished and were released)" in proc.stderr  # the summary
    assert "Root Cause" not in proc.stderr
    assert (tmp_path / "0.saved").exists() and (tmp_path / "2.saved").exists()
    late = [e for e in events_of(events, "worker_failed") if e.get("after_release")]
    assert [(e["rank"], e["signal"]) for e in late][:1] == [(1, "SIGKILL")]
    assert events_of(events, "recovery_start") == [] and events_of(events, "restart") == []
    (end,) = events_of(events, "job_end")
    assert end["exit_code"] == 0 and end["failures_after_release"] >= 1
    assert json.dumps(end)  # the record stays plain JSON
