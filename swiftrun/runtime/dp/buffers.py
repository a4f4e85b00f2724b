"""Rank 0's buffers, which DDP broadcasts at every forward, handed to every rank by a recovery."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from swiftrun.runtime.comm.group import GroupManager
from swiftrun.runtime.core.step import StepView
from swiftrun.runtime.core.txn import Copier, StepSnapshot
from swiftrun.runtime.state.registry import Registry, plain
from swiftrun.runtime.state.transfer import broadcast_tree
from swiftrun.runtime.worker.process import warn


class BroadcastBuffers:
    """Buffers DDP broadcasts from rank 0 at every forward (``broadcast_buffers=True``, the default).

    Each rank's buffers then start a step as rank 0's and end it updated with its own batch, so they differ
    between ranks and only rank 0's matter: the next forward overwrites everyone's with them. A recovery must
    therefore hand every rank *rank 0's* buffers as of the start of the step to redo. Rank 0 holds them if it
    survived (its own, or its step-start snapshot when it applied an update); when rank 0 died, every survivor
    that passed the broadcast of that step's first forward holds them too: a forward pre-hook on the wrapped
    module keeps a copy of what DDP just broadcast, once per step (a memcpy of the buffers). If nobody holds
    them (rank 0 died before that broadcast), the recovery goes on with the source's buffers and says loudly
    that they are not the failure-free ones.

    With ``broadcast_buffers=False`` each rank keeps its own buffers: a replacement can only receive another
    rank's (said at registration), and verification does not compare them."""

    def __init__(self, view: StepView, reg: Registry, group: GroupManager,
                 snapshot: Callable[[int], StepSnapshot | None]) -> None:
        self.view = view  # the step in progress (read-only)
        self.reg, self.group = reg, group
        self._snapshot = snapshot  # the transaction's snapshot of a step's start
        self.indices: list[int] = []  # registered models whose buffers DDP broadcasts
        self.per_rank: set[int] = set()  # registered models whose buffers are each rank's own
        self._copier = Copier()
        self._copies: dict[int, dict[str, torch.Tensor]] = {}
        self._copied_at: dict[int, int] = {}  # model index -> step whose start the copy holds (-1: none)
        self._first_forward: dict[int, int] = {}
        wrappers = {id(plain(d)): d for d in reg.ddps}
        for index, model in enumerate(reg.models):
            ddp = wrappers.get(id(model))
            if ddp is None or not any(True for _ in model.buffers()):
                continue
            if ddp.broadcast_buffers:
                self.indices.append(index)
                # first among the module's hooks: a script's own pre-hook may already change a buffer
                model.register_forward_pre_hook(self._hook(index, ddp), prepend=True)
            else:
                self.per_rank.add(index)
        warn_per_rank_buffers(reg)

    def _hook(self, index: int, ddp: Any):
        def pre_forward(module: torch.nn.Module, args: Any) -> None:
            view = self.view
            if not view.in_step or self._first_forward.get(index) == view.step:
                return
            self._first_forward[index] = view.step
            if ddp._check_sync_bufs_pre_fwd():  # this forward started by broadcasting rank 0's buffers
                with torch.no_grad():
                    self._copies[index] = self._copier.freeze(dict(module.named_buffers()), str(index))
                self._copied_at[index] = view.step
            else:  # a no_sync forward first: rank 0's step-start buffers were not broadcast this step
                self._copied_at[index] = -1
        return pre_forward

    def offers(self, step: int) -> bool:
        """Whether this rank holds rank 0's buffers as of the start of ``step`` (reported to the consensus)."""
        return self._offer(step) is not None

    def _offer(self, step: int) -> str | None:
        """Whether (and from where) this rank can give rank 0's buffers as of the start of ``step``."""
        view = self.view
        if view.rank == 0 and view.valid:
            if step == view.completed + 1:
                return "snapshot" if view.partial else "live"
            if view.partial and step == view.completed + 2:
                return "live"  # the update's step ran its forward: rank 0's buffers are that step's end
        if all(self._copied_at.get(i) == step for i in self.indices):
            return "copy"
        return None

    def _tree(self, where: str, step: int) -> dict[int, dict[str, torch.Tensor]]:
        models = self.reg.models
        if where == "copy":
            return {i: self._copies[i] for i in self.indices}
        if where == "snapshot":
            snap = self._snapshot(step)
            assert snap is not None
            return {i: snap.buffers[i] for i in self.indices}
        return {i: {n: b.detach() for n, b in models[i].named_buffers()} for i in self.indices}

    def gather(self, step: int, source: int) -> dict[int, dict[str, torch.Tensor]] | None:
        """Collective: rank 0's buffers as of the start of ``step``, on every rank; if nobody has them, the
        recovery's ``source``'s, so that replicas still agree (said loudly: not the failure-free ones)."""
        if not self.indices:
            return None
        view = self.view
        offers: list[Any] = [None] * view.world_size
        mine = self._offer(step)
        dist.all_gather_object(offers, mine)
        holders = [r for r, o in enumerate(offers) if o is not None]
        if holders:
            holder, where = holders[0], mine
        else:  # the consensus undoes a step to avoid this where it can (consensus.buffers_held)
            if view.rank == source:
                warn(f"rank 0 died before broadcasting its buffers for step {step}; they are lost with it, so "
                     f"every rank takes rank {source}'s: the recovered buffers are not bitwise the failure-free ones")
            holder, where = source, "live"
        tree = self._tree(where, step) if view.rank == holder else None
        return broadcast_tree(tree, src=holder, group=None, device=self.group.device())

    def install(self, tree: dict[int, dict[str, torch.Tensor]] | None) -> None:
        if tree is None:
            return
        with torch.no_grad():
            for index, buffers in tree.items():
                live = dict(self.reg.models[index].named_buffers())
                for name, value in buffers.items():
                    if live[name].data_ptr() != value.data_ptr():
                        live[name].copy_(value)


def _per_rank_buffer_models(reg: Registry) -> list[Any]:
    wrappers = {id(plain(d)): d for d in reg.ddps}
    return [model for model in reg.models if id(model) in wrappers and not wrappers[id(model)].broadcast_buffers
            and any(True for _ in model.buffers())]


def warn_per_rank_buffers(reg: Registry) -> None:
    """Said at registration, whatever the kind of parallelism: buffers each rank keeps to itself cannot be the
    failure-free ones on a replacement, which receives another rank's."""
    for model in _per_rank_buffer_models(reg):
        warn(f"DDP(broadcast_buffers=False) keeps each rank's own buffers in {type(model).__name__}: a "
             "replaced rank receives another rank's, so its buffers will not be the failure-free ones")
