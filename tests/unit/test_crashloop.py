"""The crash-loop rule on its own (launcher/crashloop.py): what counts as the same failure, right after a recovery."""

from __future__ import annotations

import pytest

from swiftrun.launcher.crashloop import CrashLoop, signature
from swiftrun.launcher.failures import ProcessFailure

pytestmark = pytest.mark.timeout(30)


def failure(rank: int = 1, pid: int = 4242, exitcode: int = 1, cause: str = "", traceback: str | None = None):
    return ProcessFailure(rank=rank, local_rank=rank, pid=pid, exitcode=exitcode, timestamp=0.0, monotonic=0.0,
                          cause=cause, traceback=traceback, hostname="node0.test")


def test_the_signature_is_the_exceptions_last_line_with_numbers_blanked():
    a = failure(0, 11, traceback="Traceback:\n  File x.py, line 3\nRuntimeError: [pair.cc:589] Connection closed by peer 10.0.0.1:4477\n")
    b = failure(1, 12, traceback="Traceback:\n  File y.py, line 9\nRuntimeError: [pair.cc:589] Connection closed by peer 10.0.0.2:5123\n")
    assert signature(a) == signature(b) and "Connection closed by peer" in signature(a)
    assert signature(failure(cause="no heartbeat for 30.0s (hang)")) == signature(failure(cause="no heartbeat for 31.5s (hang)"))
    assert signature(failure(exitcode=-9)) == "SIGKILL" and signature(failure(exitcode=3)) == "exit code 3"
    assert signature(failure(traceback="Traceback:\nValueError: x\n")) != signature(failure(traceback="Traceback:\nKeyError: x\n"))


def test_three_recoveries_each_followed_at_once_by_the_same_failure_stop():
    loop = CrashLoop()
    crash = [failure(traceback="Traceback:\nRuntimeError: op mismatch\n")]
    assert loop.verdict(crash, [5, 5]) is None  # the first failure: nothing to compare with
    for _ in range(2):
        loop.recovery_began([5])
        assert loop.verdict(crash, [6, 5]) is None
    loop.recovery_began([6])
    reason = loop.verdict(crash, [6, 7])
    assert reason is not None and "op mismatch" in reason and "last 3" in reason


def test_progress_or_another_failure_starts_the_count_again():
    loop = CrashLoop()
    crash = [failure(traceback="Traceback:\nRuntimeError: op mismatch\n")]
    other = [failure(exitcode=-9)]
    loop.verdict(crash, [5])
    for step in (5, 5):
        loop.recovery_began([step])
        assert loop.verdict(crash, [step]) is None
    loop.recovery_began([5])
    assert loop.verdict(other, [5]) is None  # a SIGKILL from outside: a different failure
    loop.recovery_began([5])
    assert loop.verdict(crash, [5]) is None
    loop.recovery_began([5])
    assert loop.verdict(crash, [8]) is None  # steps 6 and 7 completed: a new failure, not a loop
    assert loop.count == 0
