"""Verify, do not trust: after a recovery every rank compares digests of its whole state with every other rank's.

What is compared:

- everything registered with ``swiftrun.Run``: every parameter and buffer, each optimizer's state and param-group
  hyperparameters, the schedulers', the scaler's and the user state;
- what the script did *not* register but holds: optimizers, LR schedulers, GradScalers and root ``nn.Module``
  objects (an EMA or teacher model) found in the locals of the training loop's stack and in ``__main__``
  (:func:`~swiftrun.runtime.state.registry.reachable_objects`; state kept only elsewhere is not seen). A replacement rebuilt those from the
  script's own set-up, so if they carry training state, they differ from the survivors' here, and the job is told
  which object to register instead of training on silently diverged replicas.

RNG streams are not compared (scripts may seed ranks differently on purpose). An unregistered object that exists
on some ranks only (created lazily) cannot be paired and is skipped.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from swiftrun.runtime.state import digest
from swiftrun.runtime.state.registry import Registry, reachable_objects, unwrap_framework
from swiftrun.runtime.state.tree import state_tree

_KINDS: tuple[tuple[str, type], ...] = ()


def _kinds() -> tuple[tuple[str, type], ...]:
    global _KINDS
    if not _KINDS:
        from torch.optim import lr_scheduler

        kinds: list[tuple[str, type]] = [("optimizer", torch.optim.Optimizer),
                                         ("scheduler", lr_scheduler.LRScheduler),
                                         ("scheduler", lr_scheduler.ReduceLROnPlateau)]
        try:
            from torch.amp import GradScaler

            kinds.append(("scaler", GradScaler))
        except ImportError:
            pass
        _KINDS = tuple(kinds)
    return _KINDS


def plain(tree: Any) -> Any:
    """Tensors, numbers, strings and containers as they are; any other object by its type (a function's address
    differs between processes, its identity is not state)."""
    if isinstance(tree, (torch.Tensor, int, float, str, bool, bytes)) or tree is None:
        return tree
    if isinstance(tree, dict):
        return {str(k): plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [plain(v) for v in tree]
    return f"<{type(tree).__qualname__}>"


def registered_digests(reg: Registry, per_rank: set[int] = frozenset()) -> dict[str, str]:
    """``per_rank``: models whose buffers differ between ranks by design (DDP without buffer broadcast, or the
    buffers each rank's own batch updated after DDP's broadcast): not compared, except the buffers the model keeps
    equal itself (:func:`synchronised_buffers`), whose difference is a silent error (a forward all-reduce that
    ran on a stale group returned local statistics: issue 19, case 1)."""
    tree = state_tree(reg)
    for index in per_rank:
        kept = synchronised_buffers(reg.models[index])
        tree["models"][index] = {k: v for k, v in tree["models"][index].items()
                                 if not k.startswith("buffer:") or k[len("buffer:"):] in kept}
    return digest.digest_tree(plain(tree))


def synchronised_buffers(model: torch.nn.Module) -> set[str]:
    """The names of ``model``'s buffers every rank computes alike: a SyncBatchNorm's running statistics and
    batch counter, reduced over the whole job in every training forward; one synchronised over a subgroup only
    agrees within it, and is left out)."""
    return {f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules()
            if isinstance(module, torch.nn.SyncBatchNorm) and getattr(module, "process_group", None) is None
            for name, buffer in module.named_buffers(recurse=False) if buffer is not None}


def unregistered_digests(reg: Registry) -> dict[str, str]:
    """One digest per kind and structure of unregistered stateful object (several alike: their sorted digests)."""
    registered = {id(o) for o in (*reg.models, *reg.optimizers, *reg.schedulers, reg.scaler, reg.user_state)
                  if o is not None}
    owned = [*reg.models, *([reg.user_state] if isinstance(reg.user_state, torch.nn.Module) else [])]
    inside = {id(sub) for m in owned for sub in m.modules()}
    found: dict[str, list[str]] = {}
    modules: list[torch.nn.Module] = []
    kinds = _kinds()
    candidates = [o for o in reachable_objects() if isinstance(o, (torch.nn.Module, *(cls for _, cls in kinds)))]
    for obj in candidates:
        if isinstance(obj, torch.nn.Module):
            if id(obj) not in registered and id(obj) not in inside and not _internal(obj):
                modules.append(obj)
            continue
        for kind, cls in kinds:
            # an Accelerate/Lightning wrapper around a registered optimizer or scheduler is registered with it
            if isinstance(obj, cls) and id(unwrap_framework(obj)) not in registered:
                key = f"unregistered {kind} {type(obj).__qualname__}"
                found.setdefault(key, []).append(_digest_of(obj.state_dict()))
                break
    nested = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    for module in modules:
        if id(module) in nested or any(id(sub) in inside for sub in module.modules()):
            continue  # part of a larger module, or a wrapper (DDP, compile) of a registered model
        tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        if not tensors:
            continue  # a loss function or container with no state
        shape = ",".join(f"{n}:{tuple(t.shape)}" for n, t in tensors.items())
        key = f"unregistered module {type(module).__qualname__} ({len(tensors)} tensors) [{_short(shape)}]"
        found.setdefault(key, []).append(_digest_of(tensors))
    return {key: "|".join(sorted(values)) for key, values in found.items()}


def registration_warnings(reg: Registry) -> list[str]:
    """What the heap holds that training will change but the script did not register (said at ``Run()``)."""
    params = {id(p) for p in reg.parameters()}
    optimizers = {id(o) for o in reg.optimizers}
    schedulers = {id(s) for s in reg.schedulers}
    warnings_: list[str] = []
    objects = [o for o in reachable_objects() if isinstance(o, (torch.optim.Optimizer, torch.nn.Module,
                                                                  *(cls for _, cls in _kinds())))]
    for obj in objects:
        name = type(obj).__name__
        if isinstance(obj, torch.optim.Optimizer):
            updates_model = any(id(p) in params for g in obj.param_groups for p in g["params"])
            if id(unwrap_framework(obj)) not in optimizers and updates_model:
                warnings_.append(f"optimizer {name} updates the registered model but is not registered "
                                 "(swiftrun.Run(optimizer=[...]))")
        elif hasattr(obj, "optimizer") and id(unwrap_framework(obj)) not in schedulers \
                and id(unwrap_framework(getattr(obj, "optimizer", None))) in optimizers:
            warnings_.append(f"scheduler {name} drives a registered optimizer but is not registered "
                             "(swiftrun.Run(scheduler=[...]))")
        elif name == "GradScaler" and obj is not reg.scaler and getattr(obj, "_enabled", True):
            warnings_.append("a GradScaler exists but is not registered (swiftrun.Run(scaler=...))")
        elif name == "AveragedModel" and obj is not reg.user_state:
            warnings_.append("an AveragedModel (EMA/SWA) exists but is not registered (swiftrun.Run(state=...))")
    return sorted(set(warnings_))


def compare(reg: Registry, per_rank: set[int] = frozenset(), group: Any = None) -> list[digest.Mismatch]:
    """A collective over ``group`` (None: the default group): the entries whose digests differ between its
    members (an HSDP job compares the replicas of each shard, over each replica set's group)."""
    mine = registered_digests(reg, per_rank)
    mine.update(unregistered_digests(reg))
    return digest.compare_across_ranks(mine, group)


def describe(mismatches: list[digest.Mismatch]) -> str:
    text = digest.describe(mismatches)
    if any(m.path.startswith("unregistered") for m in mismatches):
        text += (" -- an unregistered object's state does not travel to a replacement: pass it to swiftrun.Run "
                 "as optimizer=, scheduler=, scaler= or state=")
    return text


def _digest_of(tree: Any) -> str:
    entries = digest.digest_tree(plain(tree))
    return _short("".join(f"{k}={v};" for k, v in sorted(entries.items())))


def _short(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _internal(module: torch.nn.Module) -> bool:
    """Modules torch creates for itself (compiled graphs) are not the script's state."""
    name = type(module).__module__
    return name.startswith("torch._") or name.startswith("torch.fx")
