"""Rebinding FSDP2 (``fully_shard``) modules to the process groups of a new generation.

FSDP2 caches process-group *objects* when ``fully_shard()`` runs (``shard_process_group`` and
``replicate_process_group`` of each mesh info, a separate reduce-scatter group), while its ``DeviceMesh`` keeps
only group *names* and resolves them on each call. The runtime rebuilds every group of a generation in the same
order on every rank, survivors and replacement alike (the default group, then the script's and the mesh's
subgroups, runtime/comm/group.py and subgroups.py), so the new groups carry the names the mesh knows: what is left
is to make the cached objects follow, which re-running each mesh info's ``__post_init__`` does (it reads them from
the mesh again). Dropping the old objects matters as much as binding the new ones: a gloo group kept alive by a
reference never notices that a peer left (a survivor blocked about 90 s in the prototype, design/FSDP.md 4.2).

There is no public API for this in torch 2.13: :data:`INTERNALS` names every private attribute used, and
:func:`missing_internals` (a test, and ``swiftrun.Run`` for an FSDP job) fails loudly when one disappears.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from swiftrun.runtime.comm import subgroups

# what the rebind and the reset rely on, by the object that has it (torch 2.13.0)
INTERNALS = {
    "FSDPModule": ("_get_fsdp_state", "reset_iter_state", "reshard"),
    "FSDPState": ("_fsdp_param_groups", "_is_root"),
    "FSDPParamGroup": ("mesh_info", "post_forward_mesh_info", "fsdp_params"),
    # _unsharded_param appears at the first all-gather; its property (unsharded_param) is the class's
    "FSDPParam": ("unsharded_param", "unsharded_accumulated_grad", "mesh_info", "_sharded_param_data"),
    "FSDPMeshInfo": ("mesh", "shard_process_group", "shard_mesh_rank"),
    "DeviceMesh": ("_dim_group_names", "get_group"),
}


def fsdp_modules(models: list[torch.nn.Module]) -> list[Any]:
    """Every FSDP2 module inside ``models`` (``fully_shard`` makes a module's class an ``FSDPModule``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    return [m for model in models for m in model.modules() if isinstance(m, FSDPModule)]


def roots(models: list[torch.nn.Module]) -> list[Any]:
    """The root FSDP modules (where ``reset_iter_state`` must be called): those no other FSDP module contains."""
    found = fsdp_modules(models)
    inner = {id(sub) for m in found for sub in m.modules() if sub is not m}
    return [m for m in found if id(m) not in inner]


def _mesh_infos(module: Any) -> Iterator[Any]:
    state = module._get_fsdp_state()
    for group in state._fsdp_param_groups:
        yield group.mesh_info
        yield group.post_forward_mesh_info
        for param in group.fsdp_params:  # a shard_placement_fn gives a parameter a mesh info of its own
            yield getattr(param, "mesh_info", None)
            yield getattr(param, "post_forward_mesh_info", None)


def rebind(models: list[torch.nn.Module]) -> int:
    """Point every FSDP2 module of ``models`` at the current generation's groups; returns how many mesh infos
    were rebound. The meshes' compile-path caches (``_pg_registry``) are refreshed too."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    seen: set[int] = set()
    for module in fsdp_modules(models):
        for info in _mesh_infos(module):
            if info is None or id(info) in seen:
                continue
            seen.add(id(info))
            separate = getattr(info, "reduce_scatter_process_group", None)  # __post_init__ clears it
            info.__post_init__()
            if separate is not None:
                info.reduce_scatter_process_group = subgroups.current(separate)
            registry = getattr(info.mesh, "_pg_registry", None)
            if isinstance(registry, dict):
                for name in info.mesh._dim_group_names:
                    if name is not None and name in registry:
                        registry[name] = _resolve_process_group(name)
    return len(seen)


def reset(models: list[torch.nn.Module]) -> list[str]:
    """After an aborted forward or backward: FSDP's per-iteration state cleared and every parameter resharded
    (its registered parameters are the sharded DTensors again). Returns what could not be reset, for the log;
    an in-flight collective of the aborted group may raise while it is waited for."""
    problems = []
    for root in roots(models):
        try:
            root.reset_iter_state()
        except Exception as exc:  # noqa: BLE001 - the reset waits on work of an aborted group
            problems.append(f"{type(root).__name__}.reset_iter_state: {exc}")
    for module in fsdp_modules(models):
        try:
            module.reshard()
        except Exception as exc:  # noqa: BLE001 - as above
            problems.append(f"{type(module).__name__}.reshard: {exc}")
        # the aborted backward's gradients on the *unsharded* parameters survive the reset, and the redo's
        # backward would accumulate into them (a recovered HSDP run drifted 38% off its failure-free one when a
        # survivor had got into the backward before the abort)
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                unsharded = getattr(param, "_unsharded_param", None)
                if isinstance(unsharded, torch.Tensor):
                    unsharded.grad = None
                if getattr(param, "unsharded_accumulated_grad", None) is not None:
                    param.unsharded_accumulated_grad = None
    return problems


def missing_internals(models: list[torch.nn.Module]) -> list[str]:
    """The private attributes of :data:`INTERNALS` that the FSDP2 modules of ``models`` lack (empty: all there)."""
    missing = []
    for module in fsdp_modules(models):
        missing += [f"FSDPModule.{a}" for a in INTERNALS["FSDPModule"] if not hasattr(module, a)]
        if missing:
            break
        state = module._get_fsdp_state()
        missing += [f"FSDPState.{a}" for a in INTERNALS["FSDPState"] if not hasattr(state, a)]
        for group in getattr(state, "_fsdp_param_groups", ()):
            missing += [f"FSDPParamGroup.{a}" for a in INTERNALS["FSDPParamGroup"] if not hasattr(group, a)]
            info = getattr(group, "mesh_info", None)
            missing += [f"FSDPMeshInfo.{a}" for a in INTERNALS["FSDPMeshInfo"] if not hasattr(info, a)]
            for param in getattr(group, "fsdp_params", ())[:1]:
                missing += [f"FSDPParam.{a}" for a in INTERNALS["FSDPParam"]
                            if not hasattr(param, a) and not hasattr(type(param), a)]
            mesh = getattr(info, "mesh", None)
            missing += [f"DeviceMesh.{a}" for a in INTERNALS["DeviceMesh"] if not hasattr(mesh, a)]
        break
    return sorted(set(missing))
