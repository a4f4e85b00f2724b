"""A receiver's own tensors, by the paths :func:`swiftrun.runtime.state.transfer.broadcast_tree` asks for.

For a tree laid out as ``{"models": [module.state_dict(), ...], "optimizers": [opt.state_dict(), ...], ...}``
(the keys are parameters), :func:`own_tensors` maps

- ``(models_key, i, name)`` to the tensor ``modules[i].state_dict()[name]`` (it shares storage with the
  parameter or buffer, so writing it writes the model);
- ``(optimizers_key, i, "state", index, key)`` to ``opt.state[param][key]`` for every tensor of the optimizer
  state that already exists (a survivor's; a fresh replacement has none, so those are allocated), where
  ``index`` numbers the parameters over ``param_groups`` in order, as ``Optimizer.state_dict()`` does.

After the transfer, ``opt.load_state_dict(result[optimizers_key][i])`` keeps these very tensors when dtype and
device match (torch only casts state to the parameter's dtype and device), so the survivor's state is
overwritten in place, never copied.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from swiftrun.runtime.state.dtensor import local
from swiftrun.runtime.state.transfer import Destination, Path


def optimizer_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters in ``state_dict()`` index order (over param_groups, each counted once)."""
    seen: set[int] = set()
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def own_tensors(modules: Iterable[torch.nn.Module | None] = (), optimizers: Iterable[torch.optim.Optimizer] = (),
                models_key: str = "models", optimizers_key: str = "optimizers") -> dict[Path, torch.Tensor]:
    own: dict[Path, torch.Tensor] = {}
    for i, module in enumerate(modules):
        if module is None:
            continue
        for name, tensor in module.state_dict(keep_vars=False).items():
            own[(models_key, i, name)] = tensor
    for i, opt in enumerate(optimizers):
        for index, p in enumerate(optimizer_params(opt)):
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    own[(optimizers_key, i, "state", index, key)] = local(value)
    return own


def destination_from(own: dict[Path, torch.Tensor]) -> Destination:
    """A ``destination`` for broadcast_tree that hands out ``own[path]`` (None, i.e. allocate, elsewhere).

    A tensor of ``own`` whose shape or dtype differs from the source's makes the transfer fail with a clear
    error on every member; callers that prefer to allocate in that case can filter ``own`` first."""

    def destination(path: Path, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Any:
        return own.get(path)

    return destination
