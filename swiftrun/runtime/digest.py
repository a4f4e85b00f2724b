"""Interim digests (replaced by the full module)."""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def _tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous().reshape(-1)
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def digest_tree(tree: Any, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    if isinstance(tree, torch.Tensor):
        out[prefix] = _tensor_digest(tree)
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(digest_tree(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(digest_tree(v, f"{prefix}.{i}" if prefix else str(i)))
    else:
        out[prefix] = hashlib.blake2b(repr(tree).encode(), digest_size=8).hexdigest()
    return out


@dataclass(frozen=True)
class Mismatch:
    path: str
    odd_ranks: tuple[int, ...]


def compare_across_ranks(digests: dict[str, str], group: Any = None) -> list[Mismatch]:
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, digests, group=group)
    out = []
    for path in sorted(set().union(*[set(g) for g in gathered])):
        values = [g.get(path) for g in gathered]
        counts: dict[Any, int] = {}
        for v in values:
            counts[v] = counts.get(v, 0) + 1
        if len(counts) > 1:
            common = max(counts, key=lambda v: counts[v])
            out.append(Mismatch(path, tuple(r for r, v in enumerate(values) if v != common)))
    return out
