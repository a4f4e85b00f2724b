"""Interim: one broadcast per tensor (replaced by the chunked stream)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

_SLOT = "__swiftrun_tensor__"
DEFAULT_CHUNK_BYTES = 64 << 20


def _split(obj: Any, path: tuple, device: torch.device, out: list) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.device.type == device.type and obj.numel() > 1:
            out.append((path, obj.detach()))
            return (_SLOT, len(out) - 1, tuple(obj.shape), str(obj.dtype).removeprefix("torch."))
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _split(v, (*path, k), device, out) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split(v, (*path, i), device, out) for i, v in enumerate(obj))
    return obj


def _fill(obj: Any, path: tuple, fn: Callable) -> Any:
    if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == _SLOT:
        return fn(path, obj)
    if isinstance(obj, dict):
        return {k: _fill(v, (*path, k), fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, (*path, i), fn) for i, v in enumerate(obj))
    return obj


def broadcast_tree(tree: Any, *, src: int, rank: int, group: Any, device: torch.device, chunk_bytes: int,
                   destination: Callable | None = None, on_chunk: Callable[[int], None] | None = None) -> Any:
    tensors: list = []
    box = [_split(tree, (), device, tensors) if rank == src else None]
    dist.broadcast_object_list(box, src=src, group=group, device=device if device.type == "cuda" else None)
    skeleton = box[0]
    count = [0]

    def receive(path: tuple, slot: tuple) -> torch.Tensor:
        _, index, shape, dtype_name = slot
        dtype = getattr(torch, dtype_name)
        if rank == src:
            value = tensors[index][1].contiguous()
        else:
            value = destination(path, shape, dtype, device) if destination else None
            if value is None:
                value = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(value, src=src, group=group)
        if on_chunk is not None:
            on_chunk(count[0])
        count[0] += 1
        return value

    return _fill(skeleton, (), receive)
