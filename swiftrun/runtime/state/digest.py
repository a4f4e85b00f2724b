"""Digests of a state tree, to check that replicas agree after a recovery.

:func:`digest_tree` maps every leaf's path (``"models.0.layer.weight"``, ``"optimizers.0.state.3.exp_avg"``,
``"optimizers.0.param_groups.1.lr"``) to a short BLAKE2b digest of its exact value:

- tensors: dtype, shape and the bytes of the elements in row-major order (strides, device and memory format do
  not matter; conjugate/negative views are resolved first). Contiguous CPU tensors are hashed in place through
  a zero-copy byte view; anything else (non-contiguous, CUDA) goes through bounded pieces of at most
  ``piece_bytes`` each, so hashing never copies a whole large tensor at once;
- floats by their IEEE-754 bits (``-0.0`` differs from ``0.0``, NaN payloads count), ints, bools, None,
  strings, bytes exactly, each with its type (``1``, ``1.0`` and ``True`` differ);
- numpy arrays like tensors; any other object by its pickle (deterministic for plain data), else its repr;
- empty dicts, lists and tuples are leaves too, so ``{"state": {}}`` and ``{}`` differ.

:func:`compare_across_ranks` finds the paths whose digests differ between the members of a group. It gathers in
two rounds: one combined digest per top-level entry first (a few hundred bytes per rank), then, only for the
entries that differ somewhere, every path of those entries. A healthy check therefore costs one small
``all_gather_object`` whatever the model size, and a failed one names the exact paths and ranks.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from swiftrun.runtime.state.blocks import element_blocks

DIGEST_BYTES = 8
PIECE_BYTES = 16 << 20
ROOT = "<root>"
MISSING = "<missing>"


def _hasher() -> Any:
    return hashlib.blake2b(digest_size=DIGEST_BYTES)


def tensor_digest(t: torch.Tensor, piece_bytes: int = PIECE_BYTES) -> str:
    h = _hasher()
    t = t.detach()
    h.update(f"tensor|{t.dtype}|{tuple(t.shape)}|".encode())
    if t.layout != torch.strided or t.is_quantized:
        if t.is_quantized:
            h.update(f"{t.qscheme()}|".encode())
            t = t.int_repr()  # scale/zero point are not covered beyond the qscheme: rare in training state
        else:
            h.update(f"{t.layout}|".encode())
            t = t.to_dense()
    if t.device.type == "meta":
        h.update(b"meta")
        return h.hexdigest()
    t = t.resolve_conj().resolve_neg()
    numel = t.numel()
    if numel == 0:
        return h.hexdigest()
    if t.device.type == "cpu" and t.is_contiguous():
        _update(h, t)
        return h.hexdigest()
    per_piece = max(1, piece_bytes // t.element_size())
    for start in range(0, numel, per_piece):
        stop = min(numel, start + per_piece)
        for view in element_blocks(t, start, stop):
            _update(h, view.to("cpu").contiguous())
    return h.hexdigest()


def _update(h: Any, t: torch.Tensor) -> None:
    """Feed the bytes of a contiguous CPU tensor (any dtype, bfloat16 and bool included) without copying."""
    flat = t.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # "contiguous" to torch (one element), not viewable as bytes
        flat = torch.empty(flat.shape, dtype=flat.dtype).copy_(flat)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    h.update(memoryview(flat.numpy()))


def value_digest(value: Any) -> str:
    """Digest of one non-container leaf."""
    if isinstance(value, torch.Tensor):
        return tensor_digest(value)
    h = _hasher()
    if value is None:
        h.update(b"none")
    elif isinstance(value, bool):
        h.update(b"bool|1" if value else b"bool|0")
    elif isinstance(value, int):
        h.update(f"int|{value}".encode())
    elif isinstance(value, float):
        h.update(b"float|" + struct.pack("<d", value))
    elif isinstance(value, complex):
        h.update(b"complex|" + struct.pack("<dd", value.real, value.imag))
    elif isinstance(value, str):
        h.update(b"str|" + value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        h.update(b"bytes|" + bytes(value))
    elif type(value).__module__ == "numpy" and hasattr(value, "dtype"):
        import numpy as np

        arr = np.ascontiguousarray(value)
        h.update(f"numpy|{arr.dtype.str}|{arr.shape}|".encode())
        h.update(pickle.dumps(arr, protocol=4) if arr.dtype.hasobject else memoryview(arr.reshape(-1).view(np.uint8)))
    else:
        h.update(f"object|{type(value).__module__}.{type(value).__qualname__}|".encode())
        try:
            h.update(pickle.dumps(value, protocol=4))
        except Exception:  # noqa: BLE001 - unpicklable: the repr is the best we have
            h.update(repr(value).encode("utf-8", "replace"))
    return h.hexdigest()


def digest_tree(tree: Any, prefix: str = "") -> dict[str, str]:
    """Path -> digest of every leaf of ``tree`` (dicts, lists and tuples are walked; see the module doc)."""
    out: dict[str, str] = {}
    _walk(tree, prefix, out)
    return out


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _walk(obj: Any, prefix: str, out: dict[str, str]) -> None:
    if isinstance(obj, dict):
        if not obj:
            out[prefix or ROOT] = value_digest(("empty", "dict"))
        for key, value in obj.items():
            _walk(value, _join(prefix, key), out)
    elif isinstance(obj, (list, tuple)):
        if not obj:
            out[prefix or ROOT] = value_digest(("empty", type(obj).__name__))
        for i, value in enumerate(obj):
            _walk(value, _join(prefix, i), out)
    else:
        out[prefix or ROOT] = value_digest(obj)


def top_level(path: str) -> str:
    return path.split(".", 1)[0]


def combined(digests: dict[str, str]) -> dict[str, str]:
    """One digest per top-level entry, over its sorted (path, digest) pairs."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for path, d in digests.items():
        groups.setdefault(top_level(path), []).append((path, d))
    out = {}
    for key, pairs in groups.items():
        h = _hasher()
        for path, d in sorted(pairs):
            h.update(f"{path}\0{d}\0".encode())
        out[key] = h.hexdigest()
    return out


@dataclass(frozen=True)
class Mismatch:
    """A path whose digest is not the same on every rank."""

    path: str
    majority: str  # the digest most ranks hold (ties: the one the lowest rank holds); MISSING if absent
    majority_ranks: tuple[int, ...]
    others: tuple[tuple[str, tuple[int, ...]], ...]  # (digest, ranks) for every other value

    @property
    def odd_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for _, ranks in self.others for r in ranks))

    def __str__(self) -> str:
        odd = self.odd_ranks
        where = f"rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))}"
        parts = "; ".join(f"{d} on {_ranks(rs)}" for d, rs in self.others)
        return f"{self.path} differs on {where} ({parts}; {self.majority} on {_ranks(self.majority_ranks)})"


def _ranks(ranks: tuple[int, ...]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def mismatches(per_rank: dict[int, dict[str, str]], paths: list[str] | None = None) -> list[Mismatch]:
    """Pure: the paths (all, or ``paths``) whose digest differs between the ranks of ``per_rank``."""
    if paths is None:
        paths = sorted(set().union(*per_rank.values())) if per_rank else []
    found = []
    ranks = sorted(per_rank)
    for path in paths:
        holders: dict[str, list[int]] = {}
        for r in ranks:
            holders.setdefault(per_rank[r].get(path, MISSING), []).append(r)
        if len(holders) < 2:
            continue
        counts = Counter({d: len(rs) for d, rs in holders.items()})
        top = max(counts.values())
        majority = min((d for d, n in counts.items() if n == top), key=lambda d: holders[d][0])
        others = tuple(sorted(((d, tuple(rs)) for d, rs in holders.items() if d != majority),
                              key=lambda item: item[1][0]))
        found.append(Mismatch(path, majority, tuple(holders[majority]), others))
    return found


def compare_across_ranks(digests: dict[str, str], group: Any = None) -> list[Mismatch]:
    """Collective over ``group``: the paths whose digests differ between members (same list on every member).

    Ranks in the result are global ranks. Round one gathers one combined digest per top-level entry; round two
    (only when round one found a difference, on every member alike) gathers the full digests of the entries
    that differ.
    """
    me = dist.get_rank()
    size = dist.get_world_size(group)
    summary: list[Any] = [None] * size
    dist.all_gather_object(summary, (me, combined(digests)), group=group)
    per_rank_summary = {r: s for r, s in summary}
    differing = sorted({m.path for m in mismatches(per_rank_summary)})
    if not differing:
        return []
    wanted = set(differing)
    mine = {p: d for p, d in digests.items() if top_level(p) in wanted}
    detail: list[Any] = [None] * size
    dist.all_gather_object(detail, (me, mine), group=group)
    return mismatches({r: d for r, d in detail})


def describe(found: list[Mismatch], limit: int = 10) -> str:
    """A one-paragraph summary for an error message."""
    if not found:
        return "replicas agree"
    lines = [str(m) for m in found[:limit]]
    if len(found) > limit:
        lines.append(f"... and {len(found) - limit} more paths")
    return f"{len(found)} path{'s' if len(found) > 1 else ''} differ: " + "; ".join(lines)
