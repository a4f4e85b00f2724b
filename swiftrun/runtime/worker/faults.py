"""Fault injection for tests and demos (``swiftrun --fault RANK:STEP:PHASE:KIND[:every]``).

The runtime calls :func:`fire` at named points of a training step: forward (the model's forward starts),
backward (the first gradient is produced), allreduce (a gradient of the first layer is produced, so earlier
buckets are being all-reduced), update (optimizer.step was called, after every collective of the step: nothing
of the update is applied and the streams the next step starts with are backed up nowhere yet), step (inside
optimizer.step, after the update, before the runtime records it),
scheduler (a scheduler's step() returned), after-step (optimizer.step returned), collective (a torch.distributed
collective the script calls itself: an evaluation all-reduce, a checkpoint barrier), save (torch.save is called;
after the training loop the step is the number of steps, so ``R:TOTAL:save:K`` is a crash while saving the final
file), recover (this rank is in the middle of an in-place recovery), transfer (the source of a state transfer,
after its first chunk), help (a survivor helping a parallel replay, before it computes its micro-batches of
the replayed step STEP), exchange (a pipeline rank's background stage checkpoint exchange of step STEP,
before any of its checkpoint was sent), import (before the script runs), connect (every rank registered
``swiftrun.Run``; this one is about to build its first process group: its peers wait in the store for it). A fault fires once, in the first
incarnation of its rank, unless ``every`` makes each replacement fail the same way. The scheduler and save points are hooked only
when a fault is planned there, so a run without faults runs unpatched code.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Any, Callable

from swiftrun.config import FaultSpec
from swiftrun.runtime.worker.env import WorkerEnv

_plan: list[FaultSpec] = []
_rank = -1
_incarnation = 0
# called before an injected fault strikes: the worker's link delivers what the rank already said (Link.flush)
before_failure: Callable[[], Any] | None = None
_deaf = False  # a ``deaf`` fault fired: the next watched gloo wait is given a source that never completes


class InjectedFault(RuntimeError):
    """The exception an ``exception`` fault raises inside the training step."""


def install(wenv: WorkerEnv) -> None:
    global _plan, _rank, _incarnation
    _rank, _incarnation = wenv.rank, wenv.incarnation
    _plan = [FaultSpec.parse(text) for text in wenv.faults.split(";") if text.strip()]
    fire("import", 0)
    if planned("save"):
        import torch

        torch.save = _before(torch.save, "save")
    if planned("scheduler"):
        from torch.optim import lr_scheduler

        for cls in (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau):
            cls.step = _after(cls.step, "scheduler")


def _current_step() -> int:
    from swiftrun.runtime.worker import process

    rt = process.current()
    return max(rt.link.step, 0) if rt is not None else 0


def _before(fn, phase: str):
    def wrapped(*args, **kwargs):
        fire(phase, _current_step())
        return fn(*args, **kwargs)

    return wrapped


def _after(fn, phase: str):
    def wrapped(*args, **kwargs):
        result = fn(*args, **kwargs)
        fire(phase, _current_step())
        return result

    return wrapped


def take_deaf(what: str) -> bool:
    """Whether a ``deaf`` fault wants this wait (on ``what``, said on stderr) to hang (once per firing)."""
    global _deaf
    deaf, _deaf = _deaf, False
    if deaf:
        sys.stderr.write(f"swiftrun fault: rank {_rank} never hears that {what} completed (deaf)\n")
        sys.stderr.flush()
    return deaf


def planned(*phases: str) -> bool:
    """Whether a fault of this process's rank is planned at any of ``phases`` (hooks are installed only then)."""
    return any(f.rank == _rank and f.phase in phases and (f.every_incarnation or _incarnation == 0) for f in _plan)


def armed(phase: str, step: int) -> FaultSpec | None:
    for fault in _plan:
        if fault.rank == _rank and fault.step == step and fault.phase == phase:
            if fault.every_incarnation or _incarnation == 0:
                return fault
    return None


def fire(phase: str, step: int) -> None:
    fault = armed(phase, step)
    if fault is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    if before_failure is not None:
        before_failure()
    kind = fault.kind
    if kind == "deaf":  # not a failure by itself: the training thread's next watched gloo wait hangs (abortable.py)
        global _deaf
        _deaf = True
        return
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "exit":
        os._exit(3)
    elif kind == "segfault":
        ctypes.string_at(0)
    elif kind == "hang-gil":
        # a C call that never releases the GIL (PyDLL keeps it held): the heartbeat thread cannot run
        ctypes.PyDLL(None).sleep(1_000_000)
    raise InjectedFault(f"injected fault on rank {_rank} at step {step} ({phase})")
