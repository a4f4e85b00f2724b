"""Fault injection for tests and demos (``swiftrun --fault RANK:STEP:PHASE:KIND[:every]``).

The runtime calls :func:`fire` at named points of a training step: forward (the model's forward starts),
backward (the first gradient is produced), allreduce (a gradient of the first layer is produced, so earlier
buckets are being all-reduced), step (inside optimizer.step, after the update, before the runtime records it),
after-step (optimizer.step returned), recover (this rank is in the middle of an in-place recovery). A fault
fires once, in the first incarnation of its rank, unless ``every`` makes each replacement fail the same way.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from swiftrun.config import FaultSpec
from swiftrun.runtime.env import WorkerEnv

_plan: list[FaultSpec] = []
_rank = -1
_incarnation = 0


class InjectedFault(RuntimeError):
    """The exception an ``exception`` fault raises inside the training step."""


def install(wenv: WorkerEnv) -> None:
    global _plan, _rank, _incarnation
    _rank, _incarnation = wenv.rank, wenv.incarnation
    _plan = [FaultSpec.parse(text) for text in wenv.faults.split(";") if text.strip()]
    fire("import", 0)


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
    kind = fault.kind
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
