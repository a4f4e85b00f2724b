"""DTensors (FSDP2's sharded parameters and their optimizer state, tensor parallelism) as a rank holds them.

A rank's part of a DTensor is its local tensor: FSDP2 keeps it as a view of a padded flat buffer that is also the
all-gather's input, so what a recovery copies, digests and writes is that local tensor, in place, never the
DTensor object (a new Parameter would break the keys of ``optimizer.state``). ``torch.distributed.tensor`` is
never imported here: a plain DDP job does not pay for it.
"""

from __future__ import annotations

from typing import Any

import torch


def is_dtensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and type(value).__name__ == "DTensor" and hasattr(value, "_local_tensor")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (a view that writes the DTensor), else ``t``."""
    return t._local_tensor if is_dtensor(t) else t


def local_tree(obj: Any) -> Any:
    """``obj`` (an optimizer's ``state_dict()``, say) with every DTensor replaced by its local tensor."""
    if is_dtensor(obj):
        return obj._local_tensor
    if isinstance(obj, dict):
        return {k: local_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [local_tree(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(local_tree(v) for v in obj)
    return obj


def rewrap_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """After a load of local tensors (:func:`local_tree`): each state tensor of a DTensor parameter that has the
    parameter's local shape becomes a DTensor again, laid out as its parameter (no copy: it wraps the tensor). A
    scalar such as Adam's ``step`` stays the plain tensor torch keeps it as."""
    from_local = None
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p)
            if not state or not is_dtensor(p):
                continue
            shape = p._local_tensor.shape
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and not is_dtensor(value) and key != "step" \
                        and value.shape == shape:
                    if from_local is None:
                        from torch.distributed.tensor import DTensor

                        from_local = DTensor.from_local
                    state[key] = from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                            stride=p.stride())
