"""A crash loop is a stop with its reason: :class:`CrashLoop`.

In-place recovery repairs a lost process; it cannot repair a failure that the recovered state itself causes (a
per-rank state that did not travel and makes the next collective mismatch, a script that raises on the redone
step, a library whose captured group is gone). Such a job fails again right after each recovery, and before
this guard it burnt all of ``--max-recoveries`` (16) in a few seconds and stopped with a generic message that hid
the cause.

The rule: a failure is *right after a recovery* when no rank got more than one step past where the survivors
stood when that recovery began (the redone step may be the one that fails). When the same failure (its signature:
the exception's last traceback line, else the signal or exit code, else the launcher's cause, with numbers
blanked out so that pids, ranks and timings do not tell two occurrences apart) comes right after
:data:`CRASH_LOOP_TRIES` recoveries in a row, the job stops recovering in place and escalates with that failure
named: a restart of every worker where ``--max-restarts`` allows (a fresh process may not carry the bad state),
else a stop. Any progress in between, or a different failure, starts the count again, so a job that genuinely
loses a process every few steps keeps recovering.

Pure: ranks' steps and failure records in, a verdict out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from swiftrun.launcher.failures import ProcessFailure

CRASH_LOOP_TRIES = 3  # recoveries each followed at once by the same failure before in-place recovery stops

_NUMBER = re.compile(r"\d+(\.\d+)?")


def signature(failure: ProcessFailure) -> str:
    """What identifies "the same failure" across ranks, pids and recoveries."""
    if failure.traceback:
        lines = [line.strip() for line in failure.traceback.strip().splitlines() if line.strip()]
        if lines:
            return _NUMBER.sub("#", lines[-1])
    if failure.cause:
        return _NUMBER.sub("#", failure.cause)
    return failure.signal_name() or f"exit code {failure.exitcode}"


@dataclass
class CrashLoop:
    """The streak of identical failures, each right after a recovery; see the module docstring."""

    tries: int = CRASH_LOOP_TRIES
    mark: int | None = None  # the survivors' furthest step when the last recovery began; None: none began yet
    last: str | None = None  # the signature of the last failure
    count: int = 0  # recoveries in a row each followed at once by that same failure

    def recovery_began(self, survivor_steps: Iterable[int | None]) -> None:
        self.mark = max((s for s in survivor_steps if s is not None), default=-1)

    def verdict(self, failed: Iterable[ProcessFailure], steps: Iterable[int | None]) -> str | None:
        """Called on a failure the job would recover in place, with every live rank's step: the reason to stop
        recovering in place, or None."""
        failures = list(failed)
        if not failures:
            return None
        sig = signature(failures[0])
        furthest = max((s for s in steps if s is not None), default=-1)
        right_after = self.mark is not None and furthest <= self.mark + 1
        self.count = self.count + 1 if right_after and sig == self.last else 0
        self.last = sig
        if self.count >= self.tries:
            return (f"the same failure came right after each of the last {self.tries} in-place recoveries, with no "
                    f"training step completed in between ({sig}): recovery cannot repair it, so swiftrun stops "
                    "recovering in place")
        return None
