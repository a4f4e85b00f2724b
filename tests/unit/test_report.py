"""``swiftrun report``: the summary of an event log, its error handling and the optional plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from swiftrun.events import EventLog, EventName, read_events
from swiftrun.report import PLOT_INSTALL_HINT, main, summarize


def write_job(path: Path, finished: bool = True) -> None:
    """A 100 s job: rank 1 dies at t=30 and is recovered in place in 1.5 s; a restart-all at t=60 costs 4 s."""
    log = EventLog(path, t0=0.0)  # with t0=0 an event's ``at`` is its ``t``
    log.write(EventName.JOB_START, at=0.0, script="train.py", world_size=4, config={}, pid=1)
    for t in range(1, 30):
        log.write(EventName.PROGRESS, at=float(t), step=t * 10, loss=2.0, step_time=0.1, steps_per_s=10.0)
    log.write(EventName.WORKER_FAILED, at=30.0, rank=1, incarnation=0, pid=11, cause="killed by SIGKILL",
              exitcode=None, signal="SIGKILL", traceback=None)  # fmt: skip
    log.write(EventName.RECOVERY_START, at=30.05, generation=2, failed_ranks=[1], cause="rank 1 killed by SIGKILL")
    for phase, start, duration in [("detect", 30.0, 0.012), ("abort", 30.012, 0.040), ("spawn", 30.052, 0.900),
                                   ("rebuild", 30.952, 0.300), ("consensus", 31.252, 0.005),
                                   ("transfer", 31.257, 0.240), ("resume", 31.497, 0.003)]:  # fmt: skip
        log.write(EventName.RECOVERY_PHASE, at=start + duration, generation=2, phase=phase, start=start,
                  duration=duration)  # fmt: skip
    log.write(EventName.RECOVERY_END, at=31.5, generation=2, outcome="recovered", mode="roll-forward",
              source_rank=0, total=1.5, lost_steps=0)  # fmt: skip
    log.write(EventName.PROGRESS, at=32.0, step=300, loss=1.9, step_time=0.1, steps_per_s=10.0)
    log.write(EventName.RESTART, at=60.0, attempt=1, reason="rendezvous timeout")
    log.write(EventName.PROGRESS, at=64.0, step=310, loss=1.9, step_time=0.1, steps_per_s=10.0)
    log.write(EventName.PROGRESS, at=99.0, step=660, loss=1.5, step_time=0.1, steps_per_s=10.0)
    if finished:
        log.write(EventName.JOB_END, at=100.0, outcome="succeeded", exit_code=0, duration=100.0, failures=1,
                  time_lost=5.5)  # fmt: skip
    log.close()


@pytest.fixture
def job_log(tmp_path: Path) -> Path:
    path = tmp_path / "events.jsonl"
    write_job(path)
    return path


def test_summary_numbers(job_log: Path) -> None:
    summary = summarize(read_events(job_log))

    assert summary.script == "train.py"
    assert summary.world_size == 4
    assert summary.outcome == "succeeded"
    assert summary.exit_code == 0
    assert summary.duration == 100.0
    assert summary.steps == 660
    assert [(failure.rank, failure.cause, failure.t) for failure in summary.failures] == [
        (1, "killed by SIGKILL", 30.0)
    ]
    (recovery,) = summary.recoveries
    assert (recovery.generation, recovery.mode, recovery.source_rank, recovery.total) == (2, "roll-forward", 0, 1.5)
    assert recovery.phases["spawn"] == pytest.approx(0.9)
    assert "undo" not in recovery.phases
    (restart,) = summary.restarts
    assert (restart.t, restart.resumed_at) == (60.0, 64.0)
    assert summary.time_lost == 5.5  # the supervisor's figure
    assert summary.goodput == pytest.approx(0.945)


def test_report_prints_the_summary(job_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(job_log)]) == 0
    out = capsys.readouterr().out

    assert "outcome:    succeeded (exit code 0)" in out
    assert "duration:   100.0 s" in out
    assert "steps:      660" in out
    assert "failures:   1" in out
    assert "t=30.0s  rank 1: killed by SIGKILL" in out
    assert "generation 2 at t=30.1s: rank 1 killed by SIGKILL -> recovered, roll-forward from rank 0" in out
    assert "total 1500 ms, 0 steps lost" in out
    assert "phases (ms): detect 12  abort 40  spawn 900  rebuild 300  consensus 5  transfer 240  resume 3" in out
    assert "restarts:   1" in out
    assert "attempt 1: rendezvous timeout" in out
    assert "time lost:  5.50 s" in out
    assert "goodput:    94.5%" in out


def test_running_job_estimates_its_losses_and_tolerates_a_torn_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "events.jsonl"
    write_job(path, finished=False)
    with path.open("a", encoding="utf-8") as torn:
        torn.write('{"t": 99.5, "event": "progr')  # the launcher is mid-write

    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "outcome:    running (no job_end yet" in out
    assert "duration:   99.0 s" in out
    # No job_end: 1.5 s of recovery plus 4 s from the restart to the next progress.
    assert "time lost:  5.50 s" in out
    assert "goodput:    94.4%" in out


def test_unfinished_recovery_counts_until_the_end_of_the_log(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    lines = [
        {"t": 0.0, "event": "job_start", "script": "train.py", "world_size": 2},
        {"t": 10.0, "event": "recovery_start", "generation": 2, "failed_ranks": [0], "cause": "rank 0 hung"},
        {"t": 10.5, "event": "recovery_phase", "generation": 2, "phase": "detect", "start": 7.0, "duration": 3.0},
        {"t": 12.0, "event": "progress", "step": 5},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")

    summary = summarize(read_events(path))
    assert summary.outcome == "running"
    assert summary.recoveries[0].t_end is None
    assert summary.time_lost == pytest.approx(2.0)  # recovery_start at 10 to the last event at 12


@pytest.mark.parametrize("content", [None, "", "\n\n", "not json at all\n"])
def test_missing_or_empty_log_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None
) -> None:
    path = tmp_path / "events.jsonl"
    if content is not None:
        path.write_text(content, encoding="utf-8")

    assert main([str(path)]) == 1
    captured = capsys.readouterr()
    expected = "no event log at" if content is None else "holds no events"
    assert expected in captured.err
    assert "Traceback" not in captured.err + captured.out


def test_plot_without_matplotlib_exits_1_with_the_install_hint(
    job_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A None entry in sys.modules makes ``import matplotlib`` raise ImportError, as if it were not installed.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    out_png = tmp_path / "timeline.png"

    assert main([str(job_log), "--plot", str(out_png)]) == 1
    captured = capsys.readouterr()
    assert PLOT_INSTALL_HINT in captured.err
    assert "Traceback" not in captured.err
    assert not out_png.exists()


def test_plot_draws_a_png(job_log: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out_png = tmp_path / "timeline.png"

    assert main([str(job_log), "--plot", str(out_png)]) == 0
    assert out_png.read_bytes().startswith(b"\x89PNG")


def test_failure_during_recovery_continues_the_same_recovery(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    lines = [
        {"t": 0.0, "event": "job_start", "script": "train.py", "world_size": 4},
        {"t": 10.0, "event": "recovery_start", "generation": 2, "failed_ranks": [1], "cause": "rank 1 crashed"},
        {"t": 11.0, "event": "recovery_start", "generation": 3, "failed_ranks": [1, 2], "cause": "rank 2 crashed",
         "during_recovery": True},
        {"t": 13.0, "event": "recovery_end", "generation": 3, "outcome": "recovered", "mode": "redo",
         "source_rank": 0, "total": 3.0},
        {"t": 20.0, "event": "progress", "step": 50},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")

    summary = summarize(read_events(path))
    (recovery,) = summary.recoveries
    assert (recovery.generation, recovery.t_start, recovery.failed_ranks) == (3, 10.0, (1, 2))
    assert recovery.cause == "rank 1 crashed; then rank 2 crashed"
    assert summary.time_lost == pytest.approx(3.0)


def test_a_pipeline_replay_and_logging_plan_are_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "events.jsonl"
    lines = [
        {"t": 0.0, "event": "job_start", "script": "train_pp.py", "world_size": 4},
        {"t": 5.0, "event": "log_plan", "message": "selective logging under 10.0 KiB: groups [0,1] [2,3]"},
        {"t": 10.0, "event": "recovery_start", "generation": 1, "failed_ranks": [2], "cause": "rank 2 killed"},
        {"t": 11.0, "event": "replay", "generation": 1, "rank": 2, "ranks": [2, 3], "first": 4, "last": 5},
        {"t": 11.0, "event": "replay", "generation": 1, "rank": 3, "ranks": [2, 3], "first": 4, "last": 5},
        {"t": 11.5, "event": "recovery_end", "generation": 1, "outcome": "recovered", "mode": "replay",
         "total": 1.5},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    summary = summarize(read_events(path))
    assert summary.recoveries[0].replays == ["rank(s) 2, 3 replayed steps 4..5"]
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "replay: rank(s) 2, 3 replayed steps 4..5" in out and "groups [0,1] [2,3]" in out


def test_a_multinode_job_names_the_node_slot_and_machine_of_failures_and_recoveries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Node slot 1 (host-b) is lost, a hot spare (host-c) takes it over; later the restarted host-b rejoins as a
    spare. The events are the coordinator's, with the fields it writes."""
    path = tmp_path / "events.jsonl"
    joined = [{"t": 0.1 * k, "event": "node_joined", "node_rank": k, "slot": k, "incarnation": 0,
               "host": f"host-{'abc'[k]}", "pid": 100 + k} for k in range(2)]
    lines = [
        {"t": 0.0, "event": "job_start", "script": "train.py", "world_size": 4, "nnodes": 2, "coordinator": True},
        *joined,
        {"t": 0.5, "event": "node_joined", "node_rank": 2, "slot": None, "incarnation": -1, "host": "host-c"},
        {"t": 10.0, "event": "node_lost", "node_rank": 1, "slot": 1, "incarnation": 0, "host": "host-b",
         "cause": "its agent's connection closed"},
        *[{"t": 10.0, "event": "worker_failed", "rank": r, "incarnation": 0, "pid": 7, "exitcode": -9,
           "cause": "node slot 1 lost: its agent's connection closed", "node": 1, "node_incarnation": 0,
           "host": "host-b"} for r in (2, 3)],
        {"t": 10.0, "event": "recovery_start", "generation": 1, "failed_ranks": [2, 3], "nodes": [1],
         "cause": "node slot 1 lost: its agent's connection closed"},
        {"t": 10.0, "event": "node_takeover", "node_rank": 2, "slot": 1, "incarnation": 1},
        {"t": 12.0, "event": "recovery_end", "generation": 1, "outcome": "recovered", "mode": "redo",
         "source_rank": 0, "total": 2.0, "failed_ranks": [2, 3]},
        {"t": 20.0, "event": "job_end", "outcome": "succeeded", "exit_code": 0, "duration": 20.0, "time_lost": 2.0},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")

    summary = summarize(read_events(path))
    assert [(e.what, e.slot, e.holder.host) for e in summary.node_events] == [
        ("spare joined", None, "host-c"), ("lost", 1, "host-b"), ("taken over", 1, "host-c")]
    assert [(f.rank, f.node, f.host) for f in summary.failures] == [(2, 1, "host-b"), (3, 1, "host-b")]
    assert summary.recoveries[0].nodes == (1,)

    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "nodes:      2 node slots, 1 lost, 1 taken over, 1 spare joined" in out
    assert "node slot 1 lost (node rank 1, host-b, incarnation 0): its agent's connection closed" in out
    assert "node slot 1 taken over by hot-spare node rank 2, host-c, incarnation 1" in out
    assert "rank 2 on node slot 1 (host-b, incarnation 0): node slot 1 lost" in out
    assert ("node slot 1: node rank 1, host-b, incarnation 0 -> hot-spare node rank 2, host-c, incarnation 1"
            in out), out


def test_an_inexact_undo_is_reported_loudly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "events.jsonl"
    why = "step 5's SGD update was inverted arithmetically, not restored bitwise (--no-exact-undo)"
    lines = [
        {"t": 0.0, "event": "job_start", "script": "train.py", "world_size": 2},
        {"t": 10.0, "event": "recovery_start", "generation": 1, "failed_ranks": [1], "cause": "rank 1 killed"},
        {"t": 11.5, "event": "recovery_end", "generation": 1, "outcome": "recovered", "mode": "undo",
         "total": 1.5, "inexact": why},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    assert summarize(read_events(path)).recoveries[0].inexact == why
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "recovered, undo, total 1500 ms, INEXACT" in out and f"inexact: {why}" in out
