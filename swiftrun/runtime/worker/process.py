"""The one runtime object of a worker process (created by the bootstrap, absent under torchrun).

A process has exactly one control link and one identity, so this is a process-wide singleton by nature; it is
created explicitly by :mod:`swiftrun.runtime.bootstrap` and never implicitly on import.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

from swiftrun.runtime.worker.env import WorkerEnv
from swiftrun.runtime.worker.link import Link


@dataclass
class ProcessRuntime:
    wenv: WorkerEnv
    link: Link
    # for a replacement: how the script asked for its process group, replayed for real when it joins
    init_kwargs: dict[str, Any] = field(default_factory=dict)


_current: ProcessRuntime | None = None


def install(runtime: ProcessRuntime) -> None:
    global _current
    _current = runtime


def current() -> ProcessRuntime | None:
    """The runtime of this process, or None (plain torchrun, a single process, or a forked child)."""
    if _current is None or not _current.link.usable:
        return None
    return _current


def notice(message: str) -> None:
    """Something the user should know that is not wrong (what a safeguard costs): on the worker's stderr."""
    sys.stderr.write(f"[swiftrun] rank {os.environ.get('RANK', '?')}: {message}\n")
    sys.stderr.flush()


def warn(message: str) -> None:
    """A warning the user must see: on the worker's stderr, and to the launcher (dashboard, event log)."""
    from swiftrun.protocol.control import EventKind

    sys.stderr.write(f"[swiftrun] WARNING rank {os.environ.get('RANK', '?')}: {message}\n")
    sys.stderr.flush()
    rt = current()
    if rt is not None:
        rt.link.send_event(EventKind.WARNING, message=message)
