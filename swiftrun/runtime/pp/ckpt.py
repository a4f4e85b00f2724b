"""Stage checkpoints exchanged in the background: the step that takes one pays only for a host copy of its state.

A stage checkpoint is the state at the start of step ``s`` (after ``s - 1`` updates), sent to the next rank of
the pipeline's ring, which keeps it in memory for a replacement (runtime/pp/pipeline.py). Doing that inside the step
start stalled training for the serialisation and the transfer (measured in docs/BENCHMARKS.md). Here:

1. at the step start the main thread takes a *snapshot* (:class:`FlatSnapshots`): every tensor of the state
   copied into one flat host buffer kept from the previous checkpoint (on a GPU a pinned one, filled by a
   side-stream copy), and the rest of the state pickled with each tensor replaced by its place in that buffer
   (a :class:`Packed` checkpoint), so the training step may update the live state at once;
2. a background thread swaps it with the ring neighbours over a *dedicated* process group (the channel: created
   per generation through the group manager, so a recovery's abort releases it like any other group; the
   schedule's own P2P on the default group never interleaves with it): the small pickled skeleton, then the flat
   buffer as it is (no serialisation copy of the tensors' bytes);
3. when its own send and its receive are complete the thread *installs* the received checkpoint as the one this
   rank holds (a recovery sees the previous checkpoint or the new one, never a part), and writes its own copy
   to the stage checkpoint directory when there is one;
4. then every rank of the channel meets in an all-reduce: once it returns, every holder has installed step
   ``s``, so the logs of steps before ``s`` (and the previous checkpoint copies) can go at the next step start.
   A failure before that leaves the previous checkpoints and their logs in place on every rank that has not seen
   the all-reduce return, and a recovery replays from the newest checkpoint every member of a replay set has.

At most one exchange is in flight: a checkpoint due while the previous one still runs waits for it first.
"""

from __future__ import annotations

import enum
import io
import logging
import os
import pickle
import queue
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from swiftrun.errors import RecoveryError
from swiftrun.runtime.comm import intercept
from swiftrun.runtime.state import skeleton as skeleton_of
from swiftrun.runtime.worker import faults
from swiftrun.runtime.pp.wire import swap

log = logging.getLogger("swiftrun.runtime")

_ALIGN = 64  # every tensor's bytes start at a multiple of this in the flat buffer (any dtype can view them)


@dataclass(frozen=True)
class _Slot:
    """Where a tensor of a packed checkpoint lies in its flat buffer."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


# where _Slot lived before the runtime was split into rooms: --stage-ckpt-dir files written by that version name it
_FORMER_HOMES = {("swiftrun.runtime.pp_ckpt", "_Slot")}


class _SkeletonUnpickler(pickle.Unpickler):
    """Unpickles a skeleton; a :class:`_Slot` pickled under its former module path loads as today's."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _FORMER_HOMES:
            return _Slot
        return super().find_class(module, name)


@dataclass
class Packed:
    """A checkpoint as a pickled skeleton (each tensor replaced by a :class:`_Slot`) and one flat byte buffer
    holding every tensor's data: sent, kept and written as it is, unpacked only by a recovery."""

    skeleton: torch.Tensor  # uint8: the pickled skeleton
    flat: torch.Tensor  # uint8

    @property
    def nbytes(self) -> int:
        return self.skeleton.numel() + self.flat.numel()

    def unpack(self) -> Any:
        """The checkpoint's tree, its tensors copies (never views of a buffer someone keeps)."""
        skeleton = _SkeletonUnpickler(io.BytesIO(self.skeleton.numpy().tobytes())).load()
        flat = self.flat.cpu()
        if flat.storage_offset() % _ALIGN:  # read from a file, behind the skeleton: no dtype could view it
            flat = flat.clone()
        return _fill(skeleton, lambda slot: _view(flat, slot).clone())

    def write(self, f: io.BufferedIOBase) -> None:
        """``f`` gets: skeleton size (8 bytes, little-endian), skeleton, flat buffer."""
        f.write(self.skeleton.numel().to_bytes(8, "little"))
        f.write(memoryview(self.skeleton.numpy()))
        f.write(memoryview(self.flat.cpu().numpy()))

    @staticmethod
    def parse(data: bytes | bytearray) -> Packed:
        """The inverse of :meth:`write`."""
        size = int.from_bytes(bytes(data[:8]), "little")
        if len(data) < 8 or size > len(data) - 8:
            raise ValueError(f"a packed checkpoint of {len(data)} bytes announces a {size}-byte skeleton")
        whole = torch.frombuffer(bytearray(data) if isinstance(data, bytes) else data, dtype=torch.uint8)
        return Packed(whole[8:8 + size], whole[8 + size:])


def _view(flat: torch.Tensor, slot: _Slot) -> torch.Tensor:
    return flat[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def _fill(tree: Any, value: Callable[[_Slot], Any]) -> Any:
    return skeleton_of.map_tree(tree, lambda leaf: value(leaf) if isinstance(leaf, _Slot) else leaf)


def _lift(tree: Any, found: list[tuple[torch.Tensor, _Slot]], at: list[int]) -> Any:
    """``tree`` with each plain dense tensor replaced by its slot (``found`` collects them with their slots, in
    the skeleton's order; ``at`` the next offset); anything else stays in the skeleton and is pickled with it (a
    copy, taken now)."""
    def slot(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        t = leaf.detach()
        if t.layout is not torch.strided or t.is_quantized or t.is_nested:
            return t.cpu().clone()  # rare kinds are pickled whole
        nbytes = t.numel() * t.element_size()
        place = _Slot(at[0], nbytes, t.dtype, tuple(t.shape))
        at[0] += -(-nbytes // _ALIGN) * _ALIGN
        found.append((t, place))
        return place

    return skeleton_of.map_tree(tree, slot)


class FlatSnapshots:
    """Snapshots of a stage's state into flat host buffers that are reused checkpoint after checkpoint: a
    checkpoint step pays one memory copy of the state, not the page faults of fresh allocations (they doubled
    its cost, measured) nor a serialisation. A buffer still in use (``keep``: a rank's own checkpoint copies,
    which are its earlier snapshots) is never written; others are reused once the exchange that read them has
    finished (one exchange at a time). On a GPU the buffer is pinned and filled by a copy on a side stream that
    waits for the compute stream; ``take`` returns what waits for those copies."""

    def __init__(self) -> None:
        self._pool: list[torch.Tensor] = []
        self._streams: dict[int, Any] = {}

    def take(self, tree: Any, keep: tuple[torch.Tensor, ...] = ()) -> tuple[Packed, Callable[[], None]]:
        found: list[tuple[torch.Tensor, _Slot]] = []
        at = [0]
        skeleton = _lift(tree, found, at)
        header = torch.frombuffer(bytearray(pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)),
                                  dtype=torch.uint8)
        flat = self._buffer(at[0], any(t.is_cuda for t, _ in found), keep)
        events = []
        with torch.no_grad():
            for t, slot in found:
                dst = _view(flat, slot)
                if t.is_cuda:
                    events.append(self._gpu_copy(dst, t))
                else:
                    dst.copy_(t)
        return Packed(header, flat), (lambda: [e.synchronize() for e in events] and None)

    def _buffer(self, nbytes: int, pinned: bool, keep: tuple[torch.Tensor, ...]) -> torch.Tensor:
        kept = {id(t) for t in keep}
        free = [b for b in self._pool if id(b) not in kept]
        flat = next((b for b in free if b.numel() == nbytes and b.is_pinned() == pinned), None)
        if flat is None:
            flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        # the pool keeps what is kept elsewhere (it comes back later) and the buffer just used, nothing else
        self._pool = [b for b in self._pool if id(b) in kept] + [flat]
        return flat

    def _gpu_copy(self, dst: torch.Tensor, t: torch.Tensor) -> Any:
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        side = self._streams.get(index)
        if side is None:
            side = self._streams[index] = torch.cuda.Stream(device=t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))  # the state as the step start sees it
        with torch.cuda.stream(side):
            dst.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        t.record_stream(side)
        return event


class ExchangeState(enum.Enum):
    IDLE = "idle"  # no exchange started yet in this generation
    RUNNING = "running"
    COMPLETE = "complete"  # installed at every holder: the logs it supersedes may go
    FAILED = "failed"  # a peer died (or the channel was aborted): the previous checkpoint stays


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

    def start(self, step: int, snap: Packed, channel: Any, to: int, frm: int, device: torch.device,
              ready: Callable[[], None], install: Callable[[int, Packed, Packed], None]) -> None:
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

    def _run(self, step: int, snap: Packed, channel: Any, to: int, frm: int, device: torch.device,
             ready: Callable[[], None], install: Callable[[int, Packed, Packed], None]) -> None:
        started = time.monotonic()
        try:
            with intercept.internal():  # per thread: swiftrun's traffic, never the script's (not logged)
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


def _exchange(step: int, snap: Packed, channel: Any, to: int, frm: int, device: torch.device,
              ready: Callable[[], None], install: Callable[[int, Packed, Packed], None]) -> tuple:
    ready()  # the snapshot's asynchronous GPU copies are complete
    faults.fire("exchange", step)  # tests: this rank dies before any of its checkpoint left it
    skeleton = swap(snap.skeleton, to, frm, device, group=channel)
    flat = swap(snap.flat, to, frm, device, group=channel)
    received = Packed(skeleton, flat)
    install(step, received, snap)
    done = torch.ones(1, dtype=torch.int64, device=device)
    dist.all_reduce(done, group=channel)  # returns once every rank has installed this step's checkpoint
    return snap.nbytes, received.nbytes


class CheckpointDir:
    """Stage checkpoints on (shared) disk: ``rank{R}.step{S}.ckpt``, written in the background, atomically."""

    _NAME = re.compile(r"^rank(\d+)\.step(\d+)\.ckpt$")

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._writer: threading.Thread | None = None

    def write(self, rank: int, step: int, data: Packed) -> None:
        """Write in the background; a write still running is waited for first (one in flight per rank). ``data``
        must not change until :meth:`flush` returns."""
        if self._writer is not None:
            self._writer.join()
        self._writer = threading.Thread(target=self._write, args=(rank, step, data), daemon=True,
                                        name="swiftrun-stage-ckpt")
        self._writer.start()

    def flush(self) -> None:
        """Wait for the write in flight, if any."""
        if self._writer is not None:
            self._writer.join()

    def _write(self, rank: int, step: int, data: Packed) -> None:
        final = self.path / f"rank{rank}.step{step}.ckpt"
        tmp = final.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            data.write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        for old_step in self.steps(rank)[:-2]:  # keep the two newest: the previous one until this one exists
            (self.path / f"rank{rank}.step{old_step}.ckpt").unlink(missing_ok=True)

    def steps(self, rank: int) -> list[int]:
        found = []
        for name in os.listdir(self.path):
            match = self._NAME.match(name)
            if match and int(match.group(1)) == rank:
                found.append(int(match.group(2)))
        return sorted(found)

    def latest(self, rank: int) -> int:
        steps = self.steps(rank)
        return steps[-1] if steps else -1

    def read(self, rank: int, step: int) -> Packed:
        path = self.path / f"rank{rank}.step{step}.ckpt"
        try:
            return Packed.parse(bytearray(path.read_bytes()))
        except (OSError, ValueError) as exc:
            raise RecoveryError(f"the stage checkpoint {path} cannot be read: {exc}") from exc
