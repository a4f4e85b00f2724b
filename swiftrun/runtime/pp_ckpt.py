"""Stage checkpoints exchanged in the background: the step that takes one pays only for a host copy of its state.

A stage checkpoint is the state at the start of step ``s`` (after ``s - 1`` updates), sent to the next rank of
the pipeline's ring, which keeps it in memory for a replacement (runtime/pipeline.py). Doing that inside the step
start stalled training for the serialisation and the transfer (measured in docs/BENCHMARKS.md). Here:

1. at the step start the main thread takes a *snapshot*: every tensor of the state copied to host memory (on a
   GPU into pinned buffers by a side-stream copy, see ``pipeline._host_copy``), the rest deep-copied, so the
   training step may update the live state at once;
2. a background thread serialises the snapshot and swaps it with the ring neighbours over a *dedicated* process
   group (the channel: created per generation through the group manager, so a recovery's abort releases it
   like any other group; the schedule's own P2P on the default group never interleaves with it);
3. when its own send and its receive are complete the thread *installs* the received checkpoint as the one this
   rank holds (one attribute assignment: a recovery sees the previous checkpoint or the new one, never a part),
   and writes its own copy to the stage checkpoint directory when there is one;
4. then every rank of the channel meets in an all-reduce: once it returns, every holder has installed step
   ``s``, so the logs of steps before ``s`` can go (the next step start drops them). A failure before that
   leaves the logs of the previous checkpoint in place on every rank that has not seen the all-reduce return,
   and a recovery replays from whichever checkpoint the holder had installed.

At most one exchange is in flight: a checkpoint due while the previous one still runs waits for it first.
"""

from __future__ import annotations

import copy
import enum
import logging
import queue
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from swiftrun.runtime import collectives, faults
from swiftrun.runtime.pp_handover import swap, to_bytes

log = logging.getLogger("swiftrun.runtime")


class HostCopies:
    """The tensor copier of successive snapshots: the n-th tensor of a snapshot is copied into the n-th buffer of
    the previous one when shape and dtype match (a stage's state keeps its layout), so a checkpoint step pays a
    memory copy, not the page faults of fresh allocations (they doubled its cost, measured). Costs one host copy
    of the stage's state, kept between checkpoints. A GPU tensor goes to ``gpu_copy`` (pinned, side stream).
    Only reused once the exchange that read the previous snapshot has finished (one exchange at a time)."""

    def __init__(self, gpu_copy: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.gpu_copy = gpu_copy
        self._pool: list[torch.Tensor] = []
        self._next = 0

    def begin(self) -> HostCopies:
        self._next = 0
        return self

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        t = tensor.detach()
        if t.is_cuda:
            return self.gpu_copy(t)
        i, self._next = self._next, self._next + 1
        if i < len(self._pool):
            buf = self._pool[i]
            if buf.shape == t.shape and buf.dtype == t.dtype and not buf.is_cuda:
                return buf.copy_(t)
            buf = self._pool[i] = t.clone()
        else:
            buf = t.clone()
            self._pool.append(buf)
        return buf


class ExchangeState(enum.Enum):
    IDLE = "idle"  # no exchange started yet in this generation
    RUNNING = "running"
    COMPLETE = "complete"  # installed at every holder: the logs it supersedes may go
    FAILED = "failed"  # a peer died (or the channel was aborted): the previous checkpoint stays


def snapshot(tree: Any, copy_tensor: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A copy of ``tree`` that later updates of the live state cannot reach: tensors through ``copy_tensor``
    (a host copy), containers rebuilt, any other leaf deep-copied."""
    if isinstance(tree, torch.Tensor):
        return copy_tensor(tree)
    if isinstance(tree, dict):
        items = [(k, snapshot(v, copy_tensor)) for k, v in tree.items()]
        try:
            return type(tree)(items)  # an OrderedDict stays one
        except TypeError:  # a dict subclass with another constructor (defaultdict)
            return dict(items)
    if isinstance(tree, list):
        return [snapshot(v, copy_tensor) for v in tree]
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        if all(type(v) in _ATOMIC for v in tree):
            return tree  # immutable all the way down (Python's RNG state: 625 ints, walked once per step before)
        return tuple(snapshot(v, copy_tensor) for v in tree)
    if type(tree) in _ATOMIC:
        return tree
    return copy.deepcopy(tree)


_ATOMIC = (int, float, bool, str, bytes, type(None))


class Exchange:
    """One rank's background checkpoint exchange (at most one in flight)."""

    def __init__(self) -> None:
        self.state = ExchangeState.IDLE
        self.step = -1  # the step of the exchange started last
        self.complete_step = -1  # the newest step installed at every holder (logs before it may go)
        self.error: BaseException | None = None
        self.seconds = 0.0  # how long the last finished exchange took in the background
        # one long-lived thread takes the exchanges from a queue: starting a thread per checkpoint made the
        # step wait for the new thread to get the GIL (8 ms per checkpoint on a loaded machine, profiled)
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()

    @property
    def running(self) -> bool:
        return not self._idle.is_set()

    def start(self, step: int, snap: Any, channel: Any, to: int, frm: int, device: torch.device,
              ready: Callable[[], None], install: Callable[[int, torch.Tensor, torch.Tensor], None]) -> None:
        """Send ``snap`` (the state of ``step``) to ``to`` and take ``frm``'s in the background. ``ready()`` runs
        first in the thread (waits for the snapshot's asynchronous copies); ``install(step, received, sent)``
        when both transfers are complete, before the completion all-reduce."""
        assert not self.running, "one checkpoint exchange at a time"
        self.state, self.step, self.error = ExchangeState.RUNNING, step, None
        self._idle.clear()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="swiftrun-stage-ckpt-exchange", daemon=True)
            self._thread.start()
        self._jobs.put((step, snap, channel, to, frm, device, ready, install))

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                self._run(*job)
            finally:
                del job  # the snapshot's references go before the next one is taken
                self._idle.set()

    def _run(self, step: int, snap: Any, channel: Any, to: int, frm: int, device: torch.device,
             ready: Callable[[], None], install: Callable[[int, torch.Tensor, torch.Tensor], None]) -> None:
        started = time.monotonic()
        try:
            with collectives.internal():  # per thread: swiftrun's traffic, never the script's (not logged)
                sizes = _exchange(step, snap, channel, to, frm, device, ready, install)
        except BaseException as exc:  # noqa: BLE001 - a peer died or the channel was aborted: keep the previous
            self.error = exc
            self.state = ExchangeState.FAILED
            log.debug("stage checkpoint exchange of step %d failed: %s", step, exc)
            return
        self.complete_step = step
        self.state = ExchangeState.COMPLETE
        self.seconds = time.monotonic() - started
        log.debug("stage checkpoint of step %d exchanged in the background (%d bytes out, %d in) in %.3fs", step,
                  sizes[0], sizes[1], self.seconds)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the exchange in flight (if any); True when it finished (complete or failed)."""
        return self._idle.wait(timeout)


def _exchange(step: int, snap: Any, channel: Any, to: int, frm: int, device: torch.device,
              ready: Callable[[], None], install: Callable[[int, torch.Tensor, torch.Tensor], None]) -> tuple:
    ready()
    data = to_bytes(snap)
    del snap
    faults.fire("exchange", step)  # tests: this rank dies before any of its checkpoint left it
    received = swap(data, to, frm, device, group=channel)
    install(step, received, data)
    done = torch.ones(1, dtype=torch.int64, device=device)
    dist.all_reduce(done, group=channel)  # returns once every rank has installed this step's checkpoint
    return data.numel(), received.numel()
