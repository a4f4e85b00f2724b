"""Failure records, the root cause, torchrun's failure summary and @record-compatible error files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path

import pytest

from swiftrun.launcher.failures import (
    NO_TRACEBACK_HINT,
    ProcessFailure,
    format_late_failures,
    format_summary,
    root_cause,
)
from swiftrun.protocol.errorfile import read_error_file, write_error_file

T0 = 1_767_225_600.0  # a fixed wall-clock time for readable expectations


def failure(rank: int, exitcode: int, at: float, **kwargs) -> ProcessFailure:
    fields: dict[str, object] = {"local_rank": rank, "pid": 1000 + rank, "hostname": "node0.example", **kwargs}
    return ProcessFailure(rank=rank, exitcode=exitcode, timestamp=T0 + at, monotonic=at, **fields)  # type: ignore[arg-type]


def stamp(at: float) -> str:
    return datetime.fromtimestamp(int(T0 + at)).isoformat(sep="_")


# --- ProcessFailure ------------------------------------------------------------------------------------------


def test_signal_name() -> None:
    assert failure(0, -9, 0).signal_name() == "SIGKILL"
    assert failure(0, -int(signal.SIGSEGV), 0).signal_name() == "SIGSEGV"
    assert failure(0, 3, 0).signal_name() is None
    assert failure(0, 0, 0).signal_name() is None
    assert failure(0, -200, 0).signal_name() is None  # no such signal


def test_describe() -> None:
    assert failure(2, -9, 0, pid=1234).describe() == "rank 2 (local_rank 2) killed by SIGKILL (pid 1234)"
    assert failure(2, 3, 0, pid=1234).describe() == "rank 2 (local_rank 2) exited with code 3 (pid 1234)"
    assert failure(5, -200, 0, local_rank=1, pid=7).describe() == "rank 5 (local_rank 1) killed by signal 200 (pid 7)"
    never = ProcessFailure(rank=3, local_rank=1, pid=0, exitcode=-9, timestamp=0.0, monotonic=0.0, node=1,
                           hostname="h1", cause="node slot 1 lost: silent for more than 4s")
    assert never.describe() == ("rank 3 (local_rank 1) on node slot 1 (h1) was given up before its process started: "
                                "node slot 1 lost: silent for more than 4s")
    hung = failure(1, -9, 0, pid=9, cause="no heartbeat for 30.0s (hang)")
    assert hung.describe() == "rank 1 (local_rank 1) killed by SIGKILL (pid 9): no heartbeat for 30.0s (hang)"


def test_hostname_defaults_to_this_host() -> None:
    import socket

    record = ProcessFailure(rank=0, local_rank=0, pid=1, exitcode=1, timestamp=time.time(), monotonic=time.monotonic())
    assert record.hostname == socket.getfqdn()


def test_failure_is_frozen() -> None:
    with pytest.raises(AttributeError):
        failure(0, 1, 0).exitcode = 2  # type: ignore[misc]


# --- root cause ----------------------------------------------------------------------------------------------


def test_root_cause_is_the_earliest_observed() -> None:
    late, early, middle = failure(0, 1, 5.0), failure(3, -9, 1.0), failure(1, -15, 2.0)
    assert root_cause([late, early, middle]) is early
    assert root_cause(iter([middle, late])) is middle


def test_root_cause_ties_keep_the_given_order() -> None:
    first, second = failure(4, 1, 1.0), failure(2, 1, 1.0)
    assert root_cause([first, second]) is first


def test_root_cause_needs_a_failure() -> None:
    with pytest.raises(ValueError):
        root_cause([])


# --- summary -------------------------------------------------------------------------------------------------


def test_summary_of_one_signal_failure_matches_torchrun_layout() -> None:
    summary = format_summary("train.py", [failure(3, -9, 0.0, pid=1234)])
    block = [
        "[0]:",
        f"  time      : {stamp(0.0)}",
        "  host      : node0.example",
        "  rank      : 3 (local_rank: 3)",
        "  exitcode  : -9 (pid: 1234) (SIGKILL)",
        "  error_file: <N/A>",
        "  traceback : Signal 9 (SIGKILL) received by PID 1234",
    ]
    width = max(len(line) for line in block)  # the widest line, as in torchrun (capped at 60)
    assert summary.splitlines() == [
        "=" * width,
        "train.py FAILED",
        "-" * width,
        "Failures:",
        "  <NO_OTHER_FAILURES>",
        "-" * width,
        "Root Cause (first observed failure):",
        *block,
        "=" * width,
    ]


def test_summary_rules_are_as_wide_as_the_widest_line_up_to_60() -> None:
    short = format_summary("t", [failure(0, -9, 0.0, hostname="h")]).splitlines()
    widest = max(len(line) for line in short[7:-1])
    assert short[0] == "=" * widest and short[2] == "-" * widest and widest < 60
    long = format_summary("t", [failure(0, 1, 0.0, hostname="h" * 100)]).splitlines()
    assert long[0] == "=" * 60


def test_summary_exact_text_for_an_exit_without_traceback() -> None:
    summary = format_summary("train.py", [failure(0, 1, 0.0, pid=42, hostname="h")])
    block = textwrap.dedent(
        f"""\
        [0]:
          time      : {stamp(0.0)}
          host      : h
          rank      : 0 (local_rank: 0)
          exitcode  : 1 (pid: 42)
          error_file: <N/A>
          traceback : {NO_TRACEBACK_HINT}"""
    )
    width = min(max(len(line) for line in block.splitlines()), 60)
    expected = "\n".join(
        ["=" * width, "train.py FAILED", "-" * width, "Failures:", "  <NO_OTHER_FAILURES>", "-" * width,
         "Root Cause (first observed failure):", block, "=" * width]
    )  # fmt: skip
    assert summary == expected


def test_summary_lists_other_failures_and_picks_the_earliest_as_root() -> None:
    failures = [failure(0, -15, 3.0), failure(2, -9, 1.0), failure(1, 1, 2.0)]
    lines = format_summary("train.py", failures).splitlines()
    failures_at, root_at = lines.index("Failures:"), lines.index("Root Cause (first observed failure):")
    others, root = lines[failures_at + 1 : root_at - 1], lines[root_at + 1 : -1]
    assert root[0] == "[0]:" and "  rank      : 2 (local_rank: 2)" in root
    assert [line for line in others if line.startswith("[")] == ["[1]:", "[2]:"]
    ranks = [line for line in others if line.startswith("  rank")]
    assert ranks == ["  rank      : 1 (local_rank: 1)", "  rank      : 0 (local_rank: 0)"]
    assert "  <NO_OTHER_FAILURES>" not in lines
    assert "  exitcode  : -15 (pid: 1000) (SIGTERM)" in others


def test_summary_shows_the_workers_traceback_indented() -> None:
    tb = 'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\nValueError: bad\n'
    lines = format_summary("train.py", [failure(0, 1, 0.0, traceback=tb)]).splitlines()
    at = lines.index("  traceback : Traceback (most recent call last):")
    assert lines[at + 1 : at + 3] == ['    File "train.py", line 3, in <module>', "  ValueError: bad"]
    assert lines[at + 3].startswith("=")


def test_summary_shows_the_cause_the_launcher_diagnosed() -> None:
    lines = format_summary("train.py", [failure(1, -9, 0.0, pid=5, cause="no heartbeat for 30.0s (hang)")]).splitlines()
    assert "  cause     : no heartbeat for 30.0s (hang)" in lines
    cause_at = lines.index("  cause     : no heartbeat for 30.0s (hang)")
    assert lines[cause_at + 1] == "  traceback : Signal 9 (SIGKILL) received by PID 5"
    assert not any(line.startswith("  cause") for line in format_summary("t", [failure(1, -9, 0.0)]).splitlines())


def test_summary_reads_the_error_file(tmp_path: Path) -> None:
    path = tmp_path / "0" / "error.json"
    write_error_file(path, ValueError, "bad", "Traceback (most recent call last):\nValueError: bad\n")
    lines = format_summary("train.py", [failure(0, 1, 0.0, error_file=str(path))]).splitlines()
    assert f"  error_file: {path}" in lines
    assert "  traceback : Traceback (most recent call last):" in lines and "  ValueError: bad" in lines


def test_summary_error_file_that_was_never_written(tmp_path: Path) -> None:
    never_written = failure(0, -9, 0.0, pid=8, error_file=str(tmp_path / "error.json"))
    lines = format_summary("train.py", [never_written]).splitlines()
    assert "  error_file: <N/A>" in lines and "  traceback : Signal 9 (SIGKILL) received by PID 8" in lines


def test_summary_needs_a_failure() -> None:
    with pytest.raises(ValueError):
        format_summary("train.py", [])


# --- error files ---------------------------------------------------------------------------------------------


def test_write_error_file_matches_torch_record_format(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    before = int(time.time())
    write_error_file(path, "RuntimeError", "boom", "Traceback ...\nRuntimeError: boom\n")
    data = json.loads(path.read_text())
    assert set(data) == {"message"}
    assert data["message"]["message"] == "RuntimeError: boom"
    assert data["message"]["extraInfo"]["py_callstack"] == "Traceback ...\nRuntimeError: boom\n"
    timestamp = data["message"]["extraInfo"]["timestamp"]
    assert isinstance(timestamp, str) and before <= int(timestamp) <= int(time.time())
    assert os.listdir(tmp_path) == ["error.json"]  # no temporary file left behind


def test_read_error_file_round_trip_and_fallbacks(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    write_error_file(path, KeyError, "'x'", "Traceback ...\nKeyError: 'x'\n")
    assert read_error_file(path) == "Traceback ...\nKeyError: 'x'\n"
    path.write_text(json.dumps({"message": {"message": "OSError: disk", "extraInfo": {"timestamp": "1"}}}))
    assert read_error_file(path) == "OSError: disk"
    path.write_text(json.dumps({"message": "a new-format message", "timestamp": 1}))
    assert read_error_file(path) == "a new-format message"
    for junk in ("not json", "[]", "{}", '{"message": 3}'):
        path.write_text(junk)
        assert read_error_file(path) is None
    assert read_error_file(tmp_path / "missing.json") is None


def test_reads_what_torch_record_writes(tmp_path: Path) -> None:
    """A worker decorated with torch's @record writes a file swiftrun reads (skipped without torch)."""
    pytest.importorskip("torch.distributed.elastic.multiprocessing.errors")
    path = tmp_path / "error.json"
    script = textwrap.dedent(
        """
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main():
            raise ValueError("from the worker")

        main()
        """
    )
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(path)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=60)
    assert proc.returncode != 0
    text = read_error_file(path)
    assert text is not None and "ValueError: from the worker" in text and "Traceback" in text


def test_torch_error_handler_reads_what_we_write(tmp_path: Path) -> None:
    """torch's own ProcessFailure parses our file and finds the message and timestamp."""
    errors = pytest.importorskip("torch.distributed.elastic.multiprocessing.errors")
    path = tmp_path / "error.json"
    write_error_file(path, ValueError, "bad", "Traceback ...\nValueError: bad\n")
    torch_failure = errors.ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert torch_failure.message["message"] == "ValueError: bad"
    assert torch_failure.message["extraInfo"]["py_callstack"].endswith("ValueError: bad\n")
    assert abs(torch_failure.timestamp - time.time()) < 60


# --- failures after training completed ------------------------------------------------------------------------


def test_late_failures_warning_says_training_completed_and_who_failed_how() -> None:
    text = format_late_failures("train.py", 4, [
        failure(2, 1, 5.0, traceback="Traceback (most recent call last):\nOSError: disk full\n"),
        failure(1, -signal.SIGKILL, 3.0),
    ])
    lines = text.splitlines()

    assert set(lines[0]) == {"!"} and set(lines[-1]) == {"!"}
    assert "training completed on every rank (4 of 4 finished and were released)" in lines[1]
    assert lines[2] == "  rank 1 (local_rank 1) killed by SIGKILL (pid 1001)"  # first observed first
    assert lines[3] == "  rank 2 (local_rank 2) exited with code 1 (pid 1002)"
    assert "    OSError: disk full" in lines
    assert "Exit status 0" in text


def test_late_failures_warning_needs_a_failure() -> None:
    with pytest.raises(ValueError):
        format_late_failures("train.py", 2, [])


def test_a_multinode_failure_names_its_node_slot_and_that_nodes_host() -> None:
    record = failure(2, -signal.SIGKILL, 5.0, local_rank=0, hostname="host-b", node=1, node_incarnation=0,
                     cause="node slot 1 lost: its agent's connection closed")

    assert record.describe().startswith("rank 2 (local_rank 0) on node slot 1 (host-b) killed by SIGKILL")
    text = format_summary("train.py", [record])
    assert "  host      : host-b\n  rank      : 2 (local_rank: 0)" in text
    assert "  node      : slot 1 (incarnation 0)\n  cause     : node slot 1 lost" in text
