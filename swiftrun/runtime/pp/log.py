"""The sender-side log of a pipeline stage: host copies of what it sent, bounded in memory, spilled to local disk.

A checkpoint interval of boundary tensors can be far larger than host memory allows (PIPELINE.md: 25 GiB per
boundary over 100 iterations of a 4096-wide model), so the log keeps at most ``memory_limit`` bytes in memory
(``--log-memory``, default 4 GiB) and writes the oldest entries beyond that to files in a private directory on
local disk (``SWIFTRUN_LOG_SPILL_DIR`` or the system's temporary directory), one file per entry, read back only
by a recovery. Oldest first: a replay needs the steps since the last checkpoint in order, and recent steps are
the likeliest to be overwritten by a redo. Entries are dropped at each checkpoint (``drop_before``), spilled
files with them; the directory is removed when the process exits.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator, Protocol

import torch

from swiftrun.runtime.core.step import StepView
from swiftrun.runtime.worker.env import settings

DEFAULT_MEMORY_LIMIT = 4 << 30


class BoundaryLog(Protocol):
    """What a tap (torch pipelining's stage factories, or runtime/pp/p2p.py's point-to-point calls) needs from the
    pipeline it feeds: the step in progress, the replay it serves from, which boundaries are logged, and where
    to log a sent tensor and the stage's compute time."""

    view: StepView
    replay: dict[str, Any] | None  # set while this rank replays: {"live", "log", ...} (runtime/pp/pipeline.py)
    logged: set[int] | None  # the boundaries logged (``min(from, to)``); None: all
    compute: float  # seconds of forward and backward in the current step (the logging plan's profile)

    def record(self, key: tuple, tensor: torch.Tensor) -> None: ...


class _Spilled:
    __slots__ = ("path", "nbytes")

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        self.nbytes = nbytes


class LogStore:
    """A mapping of log keys (tuples whose first item is the step) to tensors, bounded in memory."""

    def __init__(self, memory_limit: int | None = None) -> None:
        configured = settings().log_memory
        self.memory_limit = memory_limit if memory_limit is not None else (
            configured if configured is not None else DEFAULT_MEMORY_LIMIT)
        self._entries: OrderedDict[tuple, torch.Tensor | _Spilled] = OrderedDict()
        self.memory_bytes = 0
        self.disk_bytes = 0
        self._dir: Path | None = None
        self._serial = 0

    # ------------------------------------------------------------------ mapping

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[tuple]:
        return iter(list(self._entries))

    @property
    def total_bytes(self) -> int:
        return self.memory_bytes + self.disk_bytes

    def put(self, key: tuple, tensor: torch.Tensor) -> int:
        """Log ``tensor`` under ``key`` (replacing an entry of that key); returns its size in bytes. Called for
        every sent tensor: the common case (a new key, under the memory limit) is kept to a few dict operations."""
        if key in self._entries:
            self.pop(key)
        self._entries[key] = tensor
        nbytes = _nbytes(tensor)
        self.memory_bytes += nbytes
        if self.memory_bytes > self.memory_limit:
            self._spill()
        return nbytes

    def get(self, key: tuple) -> torch.Tensor | None:
        value = self._entries.get(key)
        if isinstance(value, _Spilled):
            return torch.load(value.path, weights_only=True)
        return value

    def pop(self, key: tuple) -> None:
        value = self._entries.pop(key, None)
        if value is None:
            return
        if isinstance(value, _Spilled):
            self.disk_bytes -= value.nbytes
            value.path.unlink(missing_ok=True)
        else:
            self.memory_bytes -= _nbytes(value)

    def select(self, keep) -> dict[tuple, torch.Tensor]:
        """The entries whose key satisfies ``keep``, loaded (for a recovery's hand-over)."""
        return {k: self.get(k) for k in list(self._entries) if keep(k)}

    def drop(self, doomed) -> None:
        for key in [k for k in self._entries if doomed(k)]:
            self.pop(key)

    def clear(self) -> None:
        self.drop(lambda _k: True)

    # ------------------------------------------------------------------ spill

    def _spill(self) -> None:
        if self.memory_bytes <= self.memory_limit:
            return
        for key, value in list(self._entries.items()):
            if self.memory_bytes <= self.memory_limit:
                break
            if isinstance(value, _Spilled):
                continue
            if value.is_pinned():
                torch.cuda.synchronize()  # its asynchronous copy from the GPU must be complete
            path = self._directory() / f"{self._serial}.pt"
            self._serial += 1
            torch.save(value, path)
            nbytes = _nbytes(value)
            self._entries[key] = _Spilled(path, nbytes)
            self.memory_bytes -= nbytes
            self.disk_bytes += nbytes

    def _directory(self) -> Path:
        if self._dir is None:
            base = settings().log_spill_dir
            self._dir = Path(tempfile.mkdtemp(prefix="swiftrun-log-", dir=base))
            atexit.register(shutil.rmtree, self._dir, True)
        return self._dir


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
