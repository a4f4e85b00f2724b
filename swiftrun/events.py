"""The JSON-lines event log of a job.

One object per line, always with ``t`` (seconds since the job started, from the monotonic clock), ``wall``
(ISO-8601 UTC, for humans) and ``event`` (one of :class:`EventName`). The other fields per event are listed in
the README ("Event log") and are stable: add fields, never rename them.
"""

from __future__ import annotations

import datetime as _dt
import enum
import json
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, TextIO


class EventName(str, enum.Enum):
    JOB_START = "job_start"  # config, world_size, script, pid
    WORKER_STATE = "worker_state"  # rank, incarnation, pid, state, previous
    WORKER_FAILED = "worker_failed"  # rank, incarnation, pid, cause, exitcode, signal, traceback (+ node,
    #                                  node_incarnation, host on several nodes)
    PROGRESS = "progress"  # step, loss, step_time, steps_per_s (sampled, at most a few per second)
    RECOVERY_START = "recovery_start"  # generation, failed_ranks, cause (+ nodes: node slots, on several nodes)
    RECOVERY_PHASE = "recovery_phase"  # generation, phase, start (t of phase start), duration
    RECOVERY_END = "recovery_end"  # generation, outcome, mode, source_rank, total, failed_ranks, undo, inexact
    LOG_PLAN = "log_plan"  # pipelines: the logging groups chosen under --log-budget and their predicted cost
    # generation, rank, ranks (every rank replaying with it: its logging group, or the replicas of its stage
    # replaying in lockstep), first, last, helpers: a pipeline stage replays these steps
    REPLAY = "replay"
    RESTART = "restart"  # attempt, reason
    WARNING = "warning"  # rank, message: recovery would not be exact, a collective was skipped
    JOB_END = "job_end"  # outcome, exit_code, duration, failures, time_lost
    # multi-node (written by the coordinator)
    NODE_JOINED = "node_joined"  # node_rank, slot (None: a hot spare), incarnation, host, pid
    NODE_LOST = "node_lost"  # node_rank, slot, incarnation, cause, host
    NODE_TAKEOVER = "node_takeover"  # node_rank (the spare's), slot, incarnation
    # the agent's zygote: state warming (pid) / warm (seconds) / forked (slot, rank, pid, ms) / failed (reason)
    ZYGOTE = "zygote"


class EventLog:
    """Appends events to a file; safe to call from any thread, flushed per line so a crash loses nothing."""

    def __init__(self, path: Path, t0: float | None = None) -> None:
        self.path = path
        self._t0 = time.monotonic() if t0 is None else t0
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def since_start(self, monotonic: float) -> float:
        return round(monotonic - self._t0, 6)

    def write(self, event: EventName, at: float | None = None, **fields: Any) -> None:
        record = {
            "t": self.since_start(time.monotonic() if at is None else at),
            "wall": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"),
            "event": event.value,
            **fields,
        }
        line = json.dumps(record, default=_jsonable, separators=(",", ":"))
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """Yield the events of a log, skipping a torn last line (the job may still be running)."""
    with path.open(encoding="utf-8") as f:
        yield from parse_events(f)


def parse_events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The events among JSON lines; blank, torn or foreign lines are skipped."""
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "event" in record:
            yield record


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return repr(value)
