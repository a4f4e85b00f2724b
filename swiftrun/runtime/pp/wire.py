"""A pipeline recovery's point-to-point messages between two ranks of the current generation's default group.

Two kinds, each on tags of its own, apart from the schedule's own traffic (tag 0):

- whole objects, pickled with ``torch.save`` (:func:`send_obj`/:func:`recv_obj`, the hand-over of stage
  checkpoints and logs; :func:`swap`, one step of the checkpoint exchange's ring);
- parallel replay's messages (runtime/pp/parallel.py, :func:`send`/:func:`recv`): any nested structure of tensors
  and plain values; a small pickled header travels first, each tensor then as it is (no serialisation, no host
  copy of parameters and gradients).
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist

from swiftrun.runtime.state import skeleton as skeleton_of

_TAG_SIZE, _TAG_DATA = 0x5717, 0x5718  # whole objects: the hand-over, the checkpoint exchange
TAG_SIZE, TAG_DATA = 0x5719, 0x571A  # parallel replay's messages


def _tags(device: torch.device, tag: int) -> dict:
    return {} if device.type == "cuda" else {"tag": tag}  # NCCL has no tags: order per pair is enough


def to_bytes(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    # a view of the buffer, not a copy of it (a stage checkpoint is the size of the stage's state)
    return torch.frombuffer(buffer.getbuffer(), dtype=torch.uint8)


def from_bytes(data: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=False)


def swap(data: torch.Tensor, to: int, frm: int, device: torch.device, group: Any = None) -> torch.Tensor:
    """Send ``data`` to ``to`` while receiving the same kind of message from ``frm`` (one step of a ring), on
    ``group`` (global ranks; None: the default group)."""
    size_out = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    size_in = torch.empty(1, dtype=torch.int64, device=device)
    for work in (dist.isend(size_out, to, group=group, **_tags(device, _TAG_SIZE)),
                 dist.irecv(size_in, frm, group=group, **_tags(device, _TAG_SIZE))):
        work.wait()
    inbound = torch.empty(int(size_in.item()), dtype=torch.uint8, device=device)
    for work in (dist.isend(data.to(device), to, group=group, **_tags(device, _TAG_DATA)),
                 dist.irecv(inbound, frm, group=group, **_tags(device, _TAG_DATA))):
        work.wait()
    return inbound.cpu()


def send_obj(obj: Any, to: int, device: torch.device) -> None:
    data = to_bytes(obj).to(device)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=device), to, **_tags(device, _TAG_SIZE))
    dist.send(data, to, **_tags(device, _TAG_DATA))


def recv_obj(frm: int, device: torch.device) -> Any:
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, frm, **_tags(device, _TAG_SIZE))
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(data, frm, **_tags(device, _TAG_DATA))
    return from_bytes(data)


class _Slot:
    """Where a tensor sent after a message's header goes back (tensors travel raw, not pickled)."""

    __slots__ = ("index", "shape", "dtype")

    def __init__(self, index: int, shape: tuple, dtype: torch.dtype) -> None:
        self.index, self.shape, self.dtype = index, shape, dtype

    def __getstate__(self) -> tuple:
        return self.index, self.shape, self.dtype

    def __setstate__(self, state: tuple) -> None:
        self.index, self.shape, self.dtype = state


def _lift(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by a slot; the tensors (contiguous, detached) appended in order."""
    def slot(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        tensors.append(leaf.detach().contiguous())
        return _Slot(len(tensors) - 1, tuple(leaf.shape), leaf.dtype)

    return skeleton_of.map_tree(value, slot)


def _slots(lifted: Any) -> list[_Slot]:
    return [leaf for leaf in skeleton_of.leaves(lifted) if isinstance(leaf, _Slot)]


def _drop(lifted: Any, tensors: dict[int, torch.Tensor]) -> Any:
    return skeleton_of.map_tree(lifted, lambda leaf: tensors[leaf.index] if isinstance(leaf, _Slot) else leaf)


def send(obj: Any, peer: int, device: torch.device) -> list:
    """Start sending ``obj``: a small pickled header, then its tensors as they are (no serialisation, no copy on
    the host). Returns what to wait for (and to keep alive until then)."""
    tensors: list[torch.Tensor] = []
    header = to_bytes(_lift(obj, tensors)).to(device)
    size = torch.tensor([header.numel()], dtype=torch.int64, device=device)
    pending: list = [header, size, dist.isend(size, peer, **_tags(device, TAG_SIZE)),
                     dist.isend(header, peer, **_tags(device, TAG_DATA))]
    for t in tensors:
        if t.numel():
            t = t.to(device)
            pending += [t, dist.isend(t, peer, **_tags(device, TAG_DATA))]
    return pending


def wait(pending: list) -> None:
    for item in pending:
        if isinstance(item, dist.Work):
            item.wait()


def recv(frm: int, device: torch.device) -> Any:
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, frm, **_tags(device, TAG_SIZE))
    header = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(header, frm, **_tags(device, TAG_DATA))
    lifted = from_bytes(header)
    tensors: dict[int, torch.Tensor] = {}
    for slot in sorted(_slots(lifted), key=lambda s: s.index):
        t = torch.empty(slot.shape, dtype=slot.dtype, device=device)
        if t.numel():
            dist.recv(t, frm, **_tags(device, TAG_DATA))
        tensors[slot.index] = t
    return _drop(lifted, tensors)


def cpu(value: Any) -> Any:
    """Detached host copies of the tensors in a nested structure (what goes into a message)."""
    return skeleton_of.map_tree(value, lambda leaf: leaf.detach().cpu() if isinstance(leaf, torch.Tensor) else leaf)


def to(value: Any, device: torch.device) -> Any:
    return skeleton_of.map_tree(value, lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf)
