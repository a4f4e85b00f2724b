"""What a replica hands a replacement: models, optimizers, schedulers, scaler, user state, and a few extras.

The state is one tree (:func:`state_tree`): every parameter and every buffer of each registered model (non-persistent
buffers included: they are state a step may have changed), each optimizer's ``state_dict`` (param-group
hyperparameters included), the schedulers', the scaler's and the user's state. :func:`transfer` broadcasts it
from the source to the other members of a group and installs it there (:func:`install`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from swiftrun.runtime.state import transfer as streaming
from swiftrun.runtime.state.dtensor import local, local_tree, rewrap_optimizer_state
from swiftrun.runtime.state.destinations import own_tensors
from swiftrun.runtime.state.registry import Registry


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name (shared tensors once), as detached views of the live tensors (a
    DTensor's local shard: runtime/state/dtensor.py)."""
    out = {f"param:{name}": local(p).detach() for name, p in model.named_parameters()}
    out.update({f"buffer:{name}": local(b).detach() for name, b in model.named_buffers() if b is not None})
    return out


def state_tree(reg: Registry) -> dict[str, Any]:
    return {
        "models": [model_tensors(m) for m in reg.models],
        "optimizers": [local_tree(o.state_dict()) for o in reg.optimizers],
        "schedulers": [s.state_dict() for s in reg.schedulers],
        "scaler": reg.scaler.state_dict() if reg.scaler is not None else None,
        "user": reg.user_state_dict(),
    }


def destinations(reg: Registry) -> Callable[[tuple, Any, torch.dtype, torch.device], torch.Tensor | None]:
    """Where a receiver writes each incoming tensor: straight into its own parameters and buffers (no copy of
    the model is ever held) and into its existing optimizer state; anything else is allocated. A shape or dtype
    that differs from the source's fails the transfer on every member with the entry named."""
    own = own_tensors((), reg.optimizers)
    for i, model in enumerate(reg.models):
        own.update({("models", i, name): t for name, t in model_tensors(model).items()})

    def resolve(path: tuple, shape: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        if path[0] == "models" and path not in own:
            raise RuntimeError(f"the source has {path[2]!r} in model {path[1]}, this rank does not: the replicas "
                               "were built differently")
        return own.get(path)

    return resolve


def install(reg: Registry, tree: dict[str, Any]) -> None:
    """Install a received tree. Model tensors were written in place by the transfer (see :func:`destinations`)."""
    for model, incoming in zip(reg.models, tree["models"]):
        live = model_tensors(model)
        with torch.no_grad():
            for name, value in incoming.items():
                if live[name].data_ptr() != value.data_ptr():
                    live[name].copy_(value)
    for opt, sd in zip(reg.optimizers, tree["optimizers"]):
        opt.load_state_dict(sd)
        _move_state_like_params(opt)
        rewrap_optimizer_state(opt)
    for sched, sd in zip(reg.schedulers, tree["schedulers"]):
        sched.load_state_dict(sd)
    if reg.scaler is not None and tree["scaler"] is not None:
        reg.scaler.load_state_dict(tree["scaler"])
    reg.load_user_state(tree["user"])


def transfer(reg: Registry, source: int, rank: int, group: Any, device: torch.device, chunk_bytes: int | None,
             on_chunk: Callable[[int], None] | None = None) -> None:
    """Broadcast the source's state over ``group`` in chunks of ``chunk_bytes`` and install it on every other
    member (None: the default for the device). Peak extra memory on any member: one chunk (plus the optimizer
    state a fresh replacement creates)."""
    tree = state_tree(reg) if rank == source else None
    received = streaming.broadcast_tree(tree, src=source, rank=rank, group=group, device=device,
                                        chunk_bytes=chunk_bytes, destination=None if rank == source else
                                        destinations(reg), on_chunk=on_chunk)
    if rank != source:
        install(reg, received)


def _move_state_like_params(opt: torch.optim.Optimizer) -> None:
    """load_state_dict casts state to the parameter's device and dtype already; keep 'step' where torch wants it."""
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if not st:
                continue
            for key, value in list(st.items()):
                if isinstance(value, torch.Tensor) and key != "step" and value.device != p.device:
                    st[key] = value.to(p.device)
