"""What a replica hands a replacement: model, optimizers, schedulers, scaler, RNG, user state, step.

The transfer is one broadcast of a small pickled description (everything that is not a large tensor on the
group's device) followed by one flat buffer per dtype holding every large tensor, so the cost is close to
``state bytes / bandwidth`` whatever the number of tensors. Receivers rebuild optimizer state from the
description (a fresh replacement's optimizer has no state yet).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from swiftrun.runtime import ddp as ddp_tools

_PLACEHOLDER = "__swiftrun_tensor__"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class Registry:
    """Everything the script registered with swiftrun.Run."""

    model: torch.nn.Module | None
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any]
    scaler: Any | None
    user_state: Any | None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ddp(self) -> DistributedDataParallel | None:
        return self.model if isinstance(self.model, DistributedDataParallel) else None

    @property
    def module(self) -> torch.nn.Module | None:
        return self.model.module if isinstance(self.model, DistributedDataParallel) else self.model

    def small_state(self) -> dict[str, Any]:
        """State cheap to snapshot at every step start (restored when a step is undone)."""
        return {
            "schedulers": [copy.deepcopy(s.state_dict()) for s in self.schedulers],
            "scaler": copy.deepcopy(self.scaler.state_dict()) if self.scaler is not None else None,
        }

    def restore_small_state(self, snap: dict[str, Any]) -> None:
        for sched, sd in zip(self.schedulers, snap["schedulers"]):
            sched.load_state_dict(sd)
        if self.scaler is not None and snap["scaler"] is not None:
            self.scaler.load_state_dict(snap["scaler"])

    def clear_grads(self) -> None:
        """Gradients of an aborted step are garbage (half accumulated); redo starts from none, like a fresh rank."""
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = None
        if self.module is not None:
            for p in self.module.parameters():
                p.grad = None


def _split(obj: Any, device: torch.device, tensors: list[torch.Tensor]) -> Any:
    """Replace large tensors on ``device`` by placeholders (collected in ``tensors``); the rest stays inline."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == device.type and obj.numel() > 1:
            tensors.append(obj.detach())
            return (_PLACEHOLDER, len(tensors) - 1, tuple(obj.shape), str(obj.dtype).removeprefix("torch."))
        return obj.detach().cpu() if obj.device.type != "cpu" else obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _split(v, device, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_split(v, device, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_split(v, device, tensors) for v in obj)
    return obj


def _join(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == _PLACEHOLDER:
        return tensors[obj[1]]
    if isinstance(obj, dict):
        return {k: _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_join(v, tensors) for v in obj)
    return obj


def _placeholders(obj: Any, out: list[tuple[int, tuple[int, ...], str]]) -> None:
    if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == _PLACEHOLDER:
        out.append((obj[1], obj[2], obj[3]))
    elif isinstance(obj, dict):
        for v in obj.values():
            _placeholders(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _placeholders(v, out)


def _user_state_dict(user: Any) -> Any:
    if user is None:
        return None
    if hasattr(user, "state_dict"):
        return user.state_dict()
    return copy.deepcopy(dict(user))


def _load_user_state(user: Any, sd: Any) -> None:
    if user is None or sd is None:
        return
    if hasattr(user, "load_state_dict"):
        user.load_state_dict(sd)
    else:
        user.clear()
        user.update(sd)


def transfer(reg: Registry, source: int, rank: int, group: Any, device: torch.device, extra: dict[str, Any]) -> dict[str, Any]:
    """Broadcast the source's state over ``group`` and install it on every other member.

    Returns the source's ``extra`` dict (step, RNG, layout...) on every member.
    """
    tensors: list[torch.Tensor] = []
    description: Any = None
    if rank == source:
        module = reg.module
        description = {
            "model": _split(module.state_dict(), device, tensors) if module is not None else None,
            "optimizers": [_split(o.state_dict(), device, tensors) for o in reg.optimizers],
            "schedulers": [s.state_dict() for s in reg.schedulers],
            "scaler": reg.scaler.state_dict() if reg.scaler is not None else None,
            "user": _user_state_dict(reg.user_state),
            "extra": extra,
        }
    box = [description]
    dist.broadcast_object_list(box, src=source, group=group, device=device if device.type == "cuda" else None)
    description = box[0]
    slots: list[tuple[int, tuple[int, ...], str]] = []
    _placeholders(description, slots)
    slots.sort()
    by_dtype: dict[str, list[int]] = {}
    for index, _shape, dtype in slots:
        by_dtype.setdefault(dtype, []).append(index)
    shapes = {index: shape for index, shape, _ in slots}
    received: dict[int, torch.Tensor] = {}
    for dtype, indices in sorted(by_dtype.items()):
        if rank == source:
            flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        else:
            numel = sum(int(torch.Size(shapes[i]).numel()) for i in indices)
            flat = torch.empty(numel, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(flat, src=source, group=group)
        if rank != source:
            offset = 0
            for i in indices:
                n = int(torch.Size(shapes[i]).numel())
                received[i] = flat[offset:offset + n].view(shapes[i]).clone()
                offset += n
    if rank != source:
        ordered = [received[i] for i in range(len(slots))]
        _install(reg, description, ordered)
    return description["extra"]


def _install(reg: Registry, description: dict[str, Any], tensors: list[torch.Tensor]) -> None:
    module = reg.module
    with torch.no_grad():
        if module is not None and description["model"] is not None:
            incoming = _join(description["model"], tensors)
            own = module.state_dict()
            for name, value in incoming.items():
                target = own[name]
                if target.shape == value.shape and target.dtype == value.dtype:
                    target.copy_(value)
                else:
                    raise RuntimeError(f"model entry {name!r} differs between replicas ({target.shape} vs {value.shape})")
    for opt, sd in zip(reg.optimizers, description["optimizers"]):
        state_dict = _join(sd, tensors)
        opt.load_state_dict(state_dict)
        _move_state_like_params(opt)
    for sched, sd in zip(reg.schedulers, description["schedulers"]):
        sched.load_state_dict(sd)
    if reg.scaler is not None and description["scaler"] is not None:
        reg.scaler.load_state_dict(description["scaler"])
    _load_user_state(reg.user_state, description["user"])


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


def layout_of(reg: Registry) -> ddp_tools.Layout | None:
    return ddp_tools.current_layout(reg.ddp) if reg.ddp is not None else None
