"""Waits on gloo collectives that the launcher's ABORT can always end, and groups that are never torn down while
one of their collectives is still blocked.

The abort of a generation shuts down its group's TCP connections (runtime/comm/group.py), which fails a pending gloo
operation at once, except, rarely, a ring all-reduce's *send*: session 4 caught one in gloo's
``UnboundBuffer::waitSend`` after every connection of its group had been shut down, bounded only by the group's
collective timeout (30 minutes). DDP's ``finalize_backward`` waited on it without a timeout, the training thread
never reached the recovery, and the rank was only replaced after ``--recovery-timeout`` (the "deaf survivor").

Two things make that wait end with the abort, whatever gloo does:

- the training thread never waits on a gloo future directly: it waits on a future of ours (:meth:`PendingOps.watch`)
  that completes with gloo's, or fails as soon as the link thread receives ABORT (:meth:`PendingOps.abort`).
  DDP's gradient all-reduce goes through :func:`allreduce_hook` and its buffer broadcast through
  :func:`broadcast_coalesced` (both installed by runtime/comm/ddp.py ``rebind``), the script's own collectives, and
  FSDP2's all-gathers and reduce-scatters (``dist.all_gather_single``, ``dist.reduce_scatter_single``), through
  :func:`call` (runtime/comm/collectives.py), an asynchronous one's handle a :class:`WatchedWork`;
- a group whose operation may still block a gloo worker thread is never destroyed: ``ProcessGroupGloo``'s
  destructor joins its worker threads, so dropping the last reference would block whoever dropped it for that
  same timeout (measured: 14.7 s with a 15 s timeout, 0.4 s when kept). :func:`keep_forever` holds such groups
  until the process exits; their sockets are already shut down, so they cost only two idle threads each.

Only CPU tensors on gloo are watched. NCCL's ``abort()`` fails its pending work itself, and a CUDA future carries
stream semantics a plain future of ours would lose; both take the unwatched path, with the same numerics.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from swiftrun.runtime.worker import faults

ABORTED = "aborted by a swiftrun recovery (generation {generation} began)"


class PendingOps:
    """The watched operations of this process, by the generation of the group they run on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = 0  # the generation whose group runs the operations watched from now on (the first: 0)
        self._aborted_below = 0  # operations of a generation below this one fail as soon as they are watched
        self._waiting: dict[torch.futures.Future, int] = {}  # our future -> its generation, until it completes
        # generation -> gloo futures not completed yet (each leaves when it completes: a run without failures
        # watches a few per step, for millions of steps)
        self._sources: dict[int, set[torch.futures.Future]] = {}

    def open(self, generation: int) -> None:
        """The group of ``generation`` is built: operations watched from now on belong to it."""
        with self._lock:
            self._generation = generation

    def watch(self, source: torch.futures.Future, first: bool = False) -> torch.futures.Future:
        """A future that completes like ``source`` (with its value's first element if ``first``: a collective's
        future holds the list of its tensors), or fails when the generation it runs in is aborted."""
        ours: torch.futures.Future = torch.futures.Future()
        with self._lock:
            generation = self._generation
            aborted = generation < self._aborted_below
            if not aborted:
                self._waiting[ours] = generation
                self._sources.setdefault(generation, set()).add(source)
        if aborted:
            ours.set_exception(RuntimeError(ABORTED.format(generation=self._aborted_below)))
            return ours

        def finished(done: torch.futures.Future) -> None:
            with self._lock:
                running = self._sources.get(generation)
                if running is not None:
                    running.discard(source)  # ``done`` may be another Python wrapper of the same C++ future
                    if not running:
                        del self._sources[generation]
                if self._waiting.pop(ours, None) is None:  # whoever removes ``ours`` completes it, exactly once
                    return
            try:
                value = done.value()
            except Exception as exc:  # noqa: BLE001 - gloo's own failure, passed on as it is
                ours.set_exception(exc)
                return
            ours.set_result(value[0] if first else value)

        source.add_done_callback(finished)
        return ours

    def abort(self, generation: int) -> int:
        """Generation ``generation`` begins: fail every watched wait of an older one. Any thread; returns how
        many waits it failed."""
        with self._lock:
            self._aborted_below = max(self._aborted_below, generation)
            failed = [f for f, g in self._waiting.items() if g < generation]
            for future in failed:
                del self._waiting[future]
        for future in failed:
            future.set_exception(RuntimeError(ABORTED.format(generation=generation)))
        return len(failed)

    def waiting(self) -> int:
        """How many watched waits are pending now."""
        with self._lock:
            return len(self._waiting)

    def blocked(self, generation: int) -> bool:
        """Whether an operation watched on ``generation``'s group has not completed inside gloo yet (its worker
        thread may be stuck in it: the group must not be destroyed)."""
        with self._lock:
            return bool(self._sources.get(generation))


PENDING = PendingOps()  # the process's one registry: a worker has one runtime and one default group lineage

_kept: set[int] = set()


def keep_forever(groups: list[Any]) -> int:
    """Never run these groups' destructors (they would join a worker thread blocked in gloo): one reference each
    that nothing releases, so neither a rebuilt reducer nor the interpreter's exit drops the last one."""
    count = 0
    for group in groups:
        if id(group) not in _kept:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
            _kept.add(id(group))
            count += 1
    return count


def exit_if_kept(code: Any) -> None:
    """The script is over: if groups were kept, exit now, as ``sys.exit(code)`` would but without the interpreter's
    finalization. A kept group's blocked operation wakes when its peers exit or its timeout passes, and completing
    its future calls back into Python from a gloo thread; during finalization that kills the process (seen:
    SIGABRT, SIGSEGV). The script's atexit handlers still run, and the standard streams are flushed."""
    if not _kept:
        return
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        sys.stderr.write(f"{code}\n")
        status = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _gloo_cpu(tensors: list[torch.Tensor], group: Any) -> bool:
    if any(t.is_cuda for t in tensors):
        return False
    try:
        return str(dist.get_backend(group)).lower() == "gloo"
    except Exception:  # noqa: BLE001 - not a group torch knows (destroyed): the plain path decides
        return False


# -------------------------------------------------------------------------------------------- DDP's all-reduce

def eligible(ddp: Any, scaling: bool = True) -> bool:
    """Whether ``ddp``'s collectives can be waited on abortably: gloo, CPU parameters, no sparse gradient, and
    (``scaling``: for the gradient all-reduce) DDP's scaling reproducible bit for bit (:func:`scaling_is_exact`)."""
    parameters, expect_sparse = ddp._build_params_for_reducer()
    if any(expect_sparse) or any(p.is_cuda for p in parameters) or getattr(ddp, "mixed_precision", None):
        return False
    group = ddp.process_group
    try:
        if str(dist.get_backend(group)).lower() != "gloo":
            return False
    except Exception:  # noqa: BLE001 - a group torch does not know: leave DDP as it is
        return False
    return not scaling or scaling_is_exact(ddp, group.size())


def scaling_is_exact(ddp: Any, group_size: int) -> bool:
    """Whether :func:`allreduce_hook` gives DDP's built-in result bit for bit.

    Without a comm hook the reducer scales each gradient by ``1 / world`` while copying it into its bucket
    (a multiplication), or, for a gradient that is already a view of its bucket (``gradient_as_bucket_view``
    after the first iteration), divides it in place; a hook sees neither which path a gradient took nor can
    reproduce the mix (measured, world 3: the multiplication matches bit for bit, the division does not). With
    a power-of-two world both are the same exactly rounded operation."""
    return not ddp.gradient_as_bucket_view or (group_size & (group_size - 1)) == 0


def allreduce_hook(state: tuple[Any, PendingOps], bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP's own gradient averaging (see :func:`scaling_is_exact`), waited on through :data:`PENDING`."""
    group, pending = state
    buffer = bucket.buffer()
    buffer.mul_(1.0 / group.size())
    work = group.allreduce([buffer])  # the group's own method: not the script's (wrapped, maybe logged) all_reduce
    source = work.get_future()
    if faults.take_deaf("DDP's gradient all-reduce"):  # fault injection: gloo completes it, this rank never hears
        source = torch.futures.Future()
    return pending.watch(source, first=True)


def broadcast_coalesced(group: Any, tensors: list[torch.Tensor], bucket_bytes: int, root: int,
                        pending: PendingOps = PENDING) -> None:
    """DDP's per-forward buffer broadcast (``dist._broadcast_coalesced``, which waits inside C++), with waits the
    abort can end: the buffers flattened into buckets of one dtype and at most ``bucket_bytes``, broadcast from
    ``root`` (a group rank), copied back. A broadcast copies bits, so the result is DDP's own."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or buckets[-1][0].dtype != tensor.dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += nbytes
    flats = [torch._utils._flatten_dense_tensors(bucket) for bucket in buckets]
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    futures = [pending.watch(group.broadcast([flat], opts).get_future()) for flat in flats]
    for future in futures:
        future.wait()
    with torch.no_grad():
        for bucket, flat in zip(buckets, flats):
            for tensor, value in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                tensor.copy_(value)


def abortable_hook(hook: Callable[..., torch.futures.Future], pending: PendingOps = PENDING) -> Callable[..., Any]:
    """A script's own comm hook whose future the abort can fail too (CPU buckets only)."""

    def wrapped(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
        future = hook(state, bucket)
        if bucket.buffer().is_cuda:
            return future
        return pending.watch(future)

    wrapped.__qualname__ = getattr(hook, "__qualname__", "hook")
    return wrapped


# ------------------------------------------------------------------------------------- the script's collectives

# collective -> the positional index and keyword of the group argument
_GROUP_ARG = {
    "all_reduce": (2, "group"), "broadcast": (2, "group"), "reduce": (3, "group"), "all_gather": (2, "group"),
    "all_gather_into_tensor": (2, "group"), "reduce_scatter": (3, "group"), "reduce_scatter_tensor": (3, "group"),
    "gather": (3, "group"), "scatter": (3, "group"), "all_to_all": (2, "group"), "all_to_all_single": (4, "group"),
    "barrier": (0, "group"), "all_gather_single": (2, "group"), "reduce_scatter_single": (3, "group"),
}


class WatchedWork(dist.Work):
    """The handle of an ``async_op=True`` collective whose ``wait()`` the abort can end: FSDP2 waits itself on the
    work of a prefetching all-gather, and checks that it is a ``dist.Work``, so this is one; anything else a
    caller asks of it is the wrapped work's answer."""

    def __init__(self, work: Any, future: torch.futures.Future) -> None:
        super().__init__()
        self._work = work
        self._future = future

    def wait(self, timeout: Any = None) -> bool:
        self._future.wait()  # raises the abort's error, or gloo's own
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:  # noqa: BLE001 - failed: not a success, whatever the reason
            return False
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._work.result()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def call(name: str, fn: Callable[..., Any], args: tuple, kwargs: dict, pending: PendingOps = PENDING) -> Any:
    """``fn(*args, **kwargs)`` for a collective, its wait abortable when it runs on gloo with CPU tensors: a
    synchronous call waits here, an asynchronous one returns a :class:`WatchedWork`. Anything else (another
    backend, CUDA tensors) runs unchanged."""
    if name not in _GROUP_ARG:
        return fn(*args, **kwargs)
    index, keyword = _GROUP_ARG[name]
    if len(args) > index + 1:  # async_op given by position
        args, kwargs = args[:index + 1], {**kwargs, "async_op": args[index + 1]}
    asynchronous = bool(kwargs.get("async_op"))
    group = args[index] if len(args) > index else kwargs.get(keyword)
    group = group if group is not None else dist.group.WORLD
    tensors = tensor_args(args, kwargs)
    if not _gloo_cpu(tensors, group):
        return fn(*args, **kwargs)
    work = fn(*args, **{**kwargs, "async_op": True})
    if work is None:  # this rank is not in the group: torch returns at once
        return None
    try:
        source = work.get_future()
    except RuntimeError:  # an operation whose work has no future: waited on as torch would
        if asynchronous:
            return work
        work.wait()
        return None
    if faults.take_deaf(f"dist.{name}"):  # fault injection: gloo completes it, this rank never hears of it
        source = torch.futures.Future()
    watched = pending.watch(source)
    if asynchronous:
        return WatchedWork(work, watched)
    watched.wait()
    return None


def tensor_args(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Every tensor among a collective's arguments, lists of tensors included (all_gather's output list)."""
    return list(_tensors(list(args) + list(kwargs.values())))


def _tensors(values: list[Any]) -> Iterator[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(list(v))
