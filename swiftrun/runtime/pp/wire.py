"""Parallel replay's messages (runtime/pp/parallel.py): any nested structure of tensors and plain values between
two ranks of the current generation's default group, on tags of its own. A small pickled header travels first,
each tensor then as it is (no serialisation, no host copy of parameters and gradients)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from swiftrun.runtime.pp.handover import from_bytes, to_bytes

TAG_SIZE, TAG_DATA = 0x5719, 0x571A  # apart from the schedule's traffic (0) and the hand-over's (0x5717/8)


def _tags(device: torch.device, tag: int) -> dict:
    return {} if device.type == "cuda" else {"tag": tag}


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
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().contiguous())
        return _Slot(len(tensors) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_lift(v, tensors) for v in value)
    if isinstance(value, dict):
        return {k: _lift(v, tensors) for k, v in value.items()}
    return value


def _slots(value: Any, out: list[_Slot]) -> list[_Slot]:
    if isinstance(value, _Slot):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _slots(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _slots(v, out)
    return out


def _drop(value: Any, tensors: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, (list, tuple)):
        return type(value)(_drop(v, tensors) for v in value)
    if isinstance(value, dict):
        return {k: _drop(v, tensors) for k, v in value.items()}
    return value


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
    for slot in sorted(_slots(lifted, []), key=lambda s: s.index):
        t = torch.empty(slot.shape, dtype=slot.dtype, device=device)
        if t.numel():
            dist.recv(t, frm, **_tags(device, TAG_DATA))
        tensors[slot.index] = t
    return _drop(lifted, tensors)


def cpu(value: Any) -> Any:
    """Detached host copies of the tensors in a nested structure (what goes into a message)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: cpu(v) for k, v in value.items()}
    return value


def to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to(v, device) for k, v in value.items()}
    return value
