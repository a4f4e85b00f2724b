"""Views of a tensor's elements in logical (row-major) order, without copying.

A range ``[start, stop)`` of a tensor's flattened elements is, for a contiguous tensor, one view of
``t.view(-1)``. For any other strided tensor (transposed, sliced, channels_last...) ``reshape(-1)`` would copy
the whole tensor; :func:`element_blocks` instead yields a few views (at most about two per dimension) that
together cover the range in order, so a caller can copy a bounded piece of any tensor with ``copy_`` alone.
"""

from __future__ import annotations

from typing import Iterator

import torch


def element_blocks(t: torch.Tensor, start: int, stop: int) -> Iterator[torch.Tensor]:
    """Views of ``t`` covering flattened elements ``[start, stop)`` in row-major order (no copy)."""
    if not 0 <= start <= stop <= t.numel():
        raise ValueError(f"element range [{start}, {stop}) outside a tensor of {t.numel()} elements")
    if start == stop:
        return
    if t.dim() == 0:
        yield t
        return
    if t.is_contiguous():
        yield t.view(-1)[start:stop]
        return
    yield from _blocks(t, start, stop)


def _blocks(t: torch.Tensor, start: int, stop: int) -> Iterator[torch.Tensor]:
    if t.dim() == 1 or t.is_contiguous():
        yield t.reshape(-1)[start:stop] if t.dim() != 1 else t[start:stop]
        return
    row = t[0].numel() if t.shape[0] else 0
    first, first_off = divmod(start, row)
    last, last_off = divmod(stop, row)
    if first == last:  # inside one row
        yield from _blocks(t[first], first_off, last_off)
        return
    if first_off:  # partial head row
        yield from _blocks(t[first], first_off, row)
        first += 1
    if last > first:  # whole rows, one strided view
        yield t[first:last]
    if last_off:  # partial tail row
        yield from _blocks(t[last], 0, last_off)
