"""Exact undo: a copy of what an optimizer step changes, taken just before it, and when the job needs one.

An undo puts a rank back to the start of a step whose update it already applied: every survivor stopped in a
collective after ``optimizer.step()`` (a loss all-reduce for logging), rank 0 died with the buffers DDP
broadcasts for the next step, a pipeline replay ends before a stage's last update, or ``--recovery undo``. The
arithmetic inverse (runtime/core/undo.py) needs no memory but is not bitwise: a float32 update discards low-order
bits no formula gets back (an AdamW job ended 1.5e-4 relative off its failure-free run). Exactness is the
product, so by default (:class:`CopyPolicy`) the runtime keeps a :class:`PreStepCopy` wherever the job may undo,
says once what it costs, and an undo that still has to invert says so in its recovery's report and on the
dashboard.
"""

from __future__ import annotations

import torch

from swiftrun.runtime.core.txn import Copier
from swiftrun.runtime.state.dtensor import local, rewrap_optimizer_state


class PreStepCopy:
    """What one optimizer step changes, copied just before it runs, so that undoing the step is a copy back:
    bitwise, and for any optimizer whose state lives in ``optimizer.state``.

    Measured on examples/train_dp.py (hidden 64), an arithmetically undone SGD-momentum step leaves 42% of the
    momentum buffer's elements and 0.1% of the parameters a few ULP off, Adam 30% of its moments; this copy costs
    the parameters plus the optimizer state in memory (2x the parameters for momentum SGD, 3x for Adam) and one
    memcpy of them per step. The buffers are allocated once and reused (:class:`Copier`); a GPU's tensors are
    copied into pinned host memory, on the step's own stream, so the copy costs no GPU memory and the update,
    queued after it, cannot overwrite what it has not copied yet.
    """

    def __init__(self) -> None:
        self._copier = Copier(host=True)
        self.step: int | None = None  # the step whose update the copy precedes; None: nothing to restore
        self._params: list[torch.Tensor] = []
        self._saved: dict[str, list] = {"params": [], "state": []}

    def take(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        # every parameter of every group, with or without a gradient: cheaper to reason about than guessing
        # which ones this optimizer's step may touch
        params = [p for group in optimizer.param_groups for p in group["params"]]
        with torch.no_grad():
            # .get, not [...]: optimizer.state is a defaultdict and must not grow entries here
            self._saved = self._copier.freeze(
                {"params": [local(p).detach() for p in params],  # a DTensor's local shard (FSDP2)
                 "state": [{k: local(v) if isinstance(v, torch.Tensor) else v
                            for k, v in optimizer.state.get(p, {}).items()} for p in params]})
        self._params = params
        self.step = step

    def nbytes(self) -> int:
        return self._copier.nbytes()

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the parameters and the optimizer state back as they were before the step; the copy is spent."""
        self._copier.settle()
        with torch.no_grad():
            for param, value, saved in zip(self._params, self._saved["params"], self._saved["state"]):
                local(param).copy_(value)
                if not saved:  # the step created this parameter's state: without it the redo creates it again
                    optimizer.state.pop(param, None)
                    continue
                live = optimizer.state[param]
                for key in [k for k in live if k not in saved]:
                    del live[key]
                for key, kept in saved.items():
                    current = live.get(key)
                    current = local(current) if isinstance(current, torch.Tensor) else current
                    if (isinstance(kept, torch.Tensor) and isinstance(current, torch.Tensor)
                            and current.shape == kept.shape and current.dtype == kept.dtype):
                        current.copy_(kept)  # in place: a fused or compiled step may hold on to the tensor
                    else:
                        live[key] = self._copier.thaw(kept)  # never alias the copy's reused buffers
        rewrap_optimizer_state(optimizer)  # a thawed tensor of a DTensor parameter is one again
        self.step = None


class CopyPolicy:
    """Whether a step's update gets a :class:`PreStepCopy`, and why an undo without one was not bitwise.

    ``setting`` is ``--exact-undo`` (True: always), ``--no-exact-undo`` (False: never) or the default (None):
    copy wherever the job may undo. Known at the start: a strategy that may undo a completed step (DDP-broadcast
    buffers, a pipeline's replay), ``--recovery undo`` or a framework integration that knows its steps issue
    collectives after the update (:meth:`expect_undo`). Seen while the script runs: a collective issued after
    ``optimizer.step()`` inside the step, from which every later step is copied (that first step has no copy:
    copying every job's first step speculatively would cost a large model its host memory for nothing). By
    default a copy that would take more than half the host memory left is declined, loudly: an undo then inverts.
    """

    def __init__(self, setting: bool | None, undo_known: str | None, local_ranks: int = 1) -> None:
        self.setting = setting
        self.reason = undo_known  # why this job may undo; None: nothing seen yet
        self.local_ranks = max(1, local_ranks)  # ranks on this machine, each keeping its own copy
        self.declined: str | None = None  # why the default declined to copy
        self._checked = False
        self._announced = False

    def wanted(self) -> bool:
        if self.setting is not None:
            return self.setting
        return self.reason is not None and self.declined is None

    def expect_undo(self, why: str) -> None:
        """What drives the loop knows before the first step that its steps issue collectives after the update (a
        framework's validation after a window's update): copy from the first step on."""
        if self.reason is None:
            self.reason = why

    def saw_collective_after_update(self, name: str, step: int) -> bool:
        """True the first time: from the next step on, updates are copied."""
        if self.reason is not None:
            return False
        self.reason = f"step {step} issues {name}() after optimizer.step()"
        return True

    def afford(self, estimate: int, available: int | None) -> str | None:
        """Checked once, before the first copy: the default declines one that would crowd the host's memory.
        Returns what to say (None: nothing)."""
        if self._checked or self.setting is not None:
            return None
        self._checked = True
        need = estimate * self.local_ranks
        if available is None or need <= available // 2:
            return None
        self.declined = (f"the copies would take {need / 2**30:.1f} GiB of this machine's "
                         f"{available / 2**30:.1f} GiB of available memory")
        return (f"exact undo declined: {self.reason}, so a failure may be repaired by undoing an update, but "
                f"{self.declined}; an undo will invert the update arithmetically, not bitwise, and say so "
                "(--exact-undo copies anyway)")

    def announcement(self, nbytes: int) -> str | None:
        """What the copies cost, said once, when they are first kept (None: nothing new to say)."""
        if self._announced or not self.wanted():
            return None
        self._announced = True
        why = "--exact-undo" if self.setting else self.reason
        return (f"exact undo: {why}, so a failure may be repaired by undoing an update; each optimizer step is "
                f"preceded by a copy of the parameters and optimizer state ({_size(nbytes)} per rank, "
                "in host memory) that puts it back bitwise (--no-exact-undo saves that memory; an undo then "
                "inverts the update arithmetically and reports the recovery inexact)")

    def why_inexact(self, step: int, optimizer: str) -> str:
        """Why an undo of ``step``'s update (by ``optimizer``) had no copy to restore."""
        if self.setting is False:
            cause = "--no-exact-undo"
        elif self.declined is not None:
            cause = f"exact undo was declined: {self.declined}"
        else:
            cause = "the collective after its update was first seen in that step"
        return (f"step {step}'s {optimizer} update was inverted arithmetically, not restored bitwise ({cause}): "
                "the run continues slightly off a failure-free one")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def estimate_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """What a :class:`PreStepCopy` of ``optimizer`` will hold: its parameters and state, the state guessed as
    two tensors per parameter (Adam's moments) while the first step has not created it yet."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    size = sum(local(p).numel() * p.element_size() for p in params)
    state = sum(local(v).numel() * v.element_size() for p in params for v in optimizer.state.get(p, {}).values()
                if isinstance(v, torch.Tensor))
    return size + (state if state else 2 * size)


def available_memory() -> int | None:
    """MemAvailable of this machine in bytes (None where /proc/meminfo does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
