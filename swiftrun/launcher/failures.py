"""Worker failure records, the root cause, and torchrun's end-of-run failure summary.

A :class:`ProcessFailure` is what the launcher knows about one worker that died or was killed: who it was,
how it ended and, when the worker told us, its traceback. :func:`format_summary` prints the same block torchrun
prints when a job fails (``torch/distributed/elastic/multiprocessing/errors``), so that people and log scrapers
used to torchrun find what they expect. A worker's traceback comes from torch's ``@record`` error file, whose
format lives in :mod:`swiftrun.protocol.errorfile` because the runtime writes it.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from swiftrun.protocol.errorfile import read_error_file

__all__ = [
    "ProcessFailure", "root_cause", "format_summary", "format_late_failures",
]

NOT_AVAILABLE = "<N/A>"
NO_TRACEBACK_HINT = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
_SUMMARY_MAX_WIDTH = 60  # torchrun caps the rules at 60 characters


@functools.lru_cache(maxsize=1)
def _fqdn() -> str:
    # getfqdn() may wait on DNS; look it up once per process, and only when a failure is recorded.
    return socket.getfqdn()


@dataclass(frozen=True)
class ProcessFailure:
    """One worker that ended badly, as observed by the launcher."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int  # negative: killed by signal -exitcode (the Popen convention)
    timestamp: float  # time.time() when observed, for people
    monotonic: float  # time.monotonic() when observed, for ordering
    cause: str = ""  # why the launcher acted, e.g. "no heartbeat for 30.0s (hang)"
    traceback: str | None = None  # the worker's traceback, when it raised and told us
    error_file: str | None = None  # the worker's TORCHELASTIC_ERROR_FILE
    hostname: str = field(default_factory=_fqdn)
    node: int | None = None  # multi-node: the node slot whose agent ran it (hostname is then that agent's host)
    node_incarnation: int | None = None  # ... and which incarnation of that slot

    def signal_name(self) -> str | None:
        """The name of the signal that killed the worker ("SIGKILL" for -9), or None if it exited."""
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return None

    def describe(self) -> str:
        """One line for logs and the dashboard."""
        who = f"rank {self.rank} (local_rank {self.local_rank})"
        if self.node is not None:
            who += f" on node slot {self.node} ({self.hostname})"
        if not self.pid:
            # e.g. a replacement whose node was lost before it ran (multi-node: its Spawn went to a hot spare that
            # had vanished): "killed by SIGKILL (pid 0)" would name a kill and a process that never were
            line = f"{who} was given up before its process started"
        elif self.exitcode < 0:
            line = f"{who} killed by {self.signal_name() or f'signal {-self.exitcode}'} (pid {self.pid})"
        else:
            line = f"{who} exited with code {self.exitcode} (pid {self.pid})"
        return f"{line}: {self.cause}" if self.cause else line


def root_cause(failures: Iterable[ProcessFailure]) -> ProcessFailure:
    """The first observed failure (earliest ``monotonic``); the first listed wins a tie."""
    failures = list(failures)
    if not failures:
        raise ValueError("root_cause() needs at least one failure")
    return min(failures, key=lambda f: f.monotonic)


def format_summary(entrypoint: str, failures: list[ProcessFailure]) -> str:
    """torchrun's failure block: the other failures, then the root cause, between ``=`` rules.

    Failures are listed in the order they were observed, so the root cause is ``[0]``. One line is added to
    torchrun's layout, ``cause``, and only for failures the launcher diagnosed itself (a hang, a stall): there a
    bare "Signal 9" would hide why the worker was killed.
    """
    if not failures:
        raise ValueError("format_summary() needs at least one failure")
    ordered = sorted(failures, key=lambda f: f.monotonic)  # stable: ties keep their given order
    blocks = [_format_failure(idx, failure) for idx, failure in enumerate(ordered)]
    title = f"{entrypoint} FAILED"
    width = min(max([len(title)] + [len(line) for block in blocks for line in block.splitlines()]), _SUMMARY_MAX_WIDTH)
    rule, section = "=" * width, "-" * width
    others = "\n".join(blocks[1:]) or "  <NO_OTHER_FAILURES>"
    return "\n".join(
        [rule, title, section, "Failures:", others, section, "Root Cause (first observed failure):", blocks[0], rule]
    )


def format_late_failures(entrypoint: str, world_size: int, failures: list[ProcessFailure]) -> str:
    """The closing warning of a job that succeeded although ranks failed after training completed everywhere.

    The exit status is 0 (the training finished on every rank), so this block is the only place that says a
    rank's last act (saving its final file, exiting) went wrong: it must be impossible to miss.
    """
    if not failures:
        raise ValueError("format_late_failures() needs at least one failure")
    lines = [
        f"WARNING: {entrypoint}: training completed on every rank ({world_size} of {world_size} finished and were "
        f"released), but afterwards:",
    ]
    for failure in sorted(failures, key=lambda f: f.monotonic):
        lines.append(f"  {failure.describe()}")
        if failure.traceback:
            lines.append("    " + failure.traceback.rstrip("\n").replace("\n", "\n    "))
    lines.append("  Exit status 0: check that rank's final output (a checkpoint or file it wrote after training).")
    rule = "!" * min(max(len(line) for line in lines), _SUMMARY_MAX_WIDTH)
    return "\n".join([rule, *lines, rule])


def _format_failure(idx: int, failure: ProcessFailure) -> str:
    signal_name = failure.signal_name()
    exitcode = f"{failure.exitcode} (pid: {failure.pid})" + (f" ({signal_name})" if signal_name else "")
    error_file = failure.error_file if failure.error_file and os.path.isfile(failure.error_file) else NOT_AVAILABLE
    time_text = datetime.fromtimestamp(int(failure.timestamp)).isoformat(sep="_")
    lines = [
        f"[{idx}]:",
        f"  time      : {time_text}",
        f"  host      : {failure.hostname}",
        f"  rank      : {failure.rank} (local_rank: {failure.local_rank})",
        f"  exitcode  : {exitcode}",
        f"  error_file: {error_file}",
    ]
    if failure.node is not None:  # multi-node only, as "cause": which machine, as the job numbers them
        incarnation = "" if failure.node_incarnation is None else f" (incarnation {failure.node_incarnation})"
        lines.append(f"  node      : slot {failure.node}{incarnation}")
    if failure.cause:
        lines.append(f"  cause     : {failure.cause}")
    lines.append(f"  traceback : {_traceback_text(failure)}")
    return "\n".join(lines)


def _traceback_text(failure: ProcessFailure) -> str:
    text = failure.traceback
    if text is None and failure.error_file:
        text = read_error_file(failure.error_file)
    if text:
        return text.rstrip("\n").replace("\n", "\n  ")  # indent continuation lines, as torchrun does
    if failure.exitcode < 0:
        return f"Signal {-failure.exitcode} ({failure.signal_name() or NOT_AVAILABLE}) received by PID {failure.pid}"
    return NO_TRACEBACK_HINT
