"""What a script registered with ``swiftrun.Run``, normalised, plus what swiftrun found that it did not register.

A script may hand ``Run`` a DDP module, the module DDP wraps, a ``torch.compile``d DDP, or several of them (a
GAN's generator and discriminator). Recovery needs two things from that: the plain modules whose parameters and
buffers travel, and every DDP wrapper whose reducer must be rebound to the rebuilt process group. DDP wrappers
the script did not pass are found in the process (a DDP wraps replicated state by definition), so registering
the unwrapped module works the same as registering its DDP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from swiftrun.errors import SwiftrunError


class RegistrationError(SwiftrunError):
    """``swiftrun.Run`` was given something recovery cannot handle exactly; the message says what to change."""


# Framework wrappers around the objects a script registers, and the attribute that holds the wrapped object. Users
# of Accelerate and Lightning Fabric hold only the wrapper (prepare() and setup() return it); the runtime must see
# the torch object inside: an optimizer hook registered on AcceleratedOptimizer never fires (its step() calls the
# inner optimizer's), and a _FabricModule is not the DDP to rebind. Matched by name and package so that
# registering works without importing the framework, and a class of the same name elsewhere is left alone.
_ACCELERATE = ("accelerate",)
_LIGHTNING = ("lightning", "lightning_fabric", "pytorch_lightning")  # the unified package and the standalone ones
_FRAMEWORK_WRAPPERS = {
    "AcceleratedOptimizer": (_ACCELERATE, "optimizer"),
    "AcceleratedScheduler": (_ACCELERATE, "scheduler"),
    "_FabricOptimizer": (_LIGHTNING, "_optimizer"),
    "_FabricModule": (_LIGHTNING, "_forward_module"),
    "LightningOptimizer": (_LIGHTNING, "_optimizer"),
}


def _package(obj: Any) -> str:
    """The top-level package ``obj``'s class comes from ("accelerate", "lightning"...)."""
    return type(obj).__module__.split(".", 1)[0]


def _framework_inner(obj: Any) -> Any | None:
    """The object one framework wrapper holds, or None when ``obj`` is not one. The wrapper's class may be a
    subclass made on the fly (Lightning's trainer makes ``LightningAdamW`` from ``LightningOptimizer`` and the
    optimizer's class), so its bases are looked at too."""
    for cls in type(obj).__mro__:
        known = _FRAMEWORK_WRAPPERS.get(cls.__name__)
        if known is not None and cls.__module__.split(".", 1)[0] in known[0]:
            return getattr(obj, known[1], None)
    return None


def _is_accelerate(obj: Any) -> bool:
    return _package(obj) in _ACCELERATE and _framework_inner(obj) is not None


def _accelerators() -> list[Any]:
    """The Accelerators the script holds (its prepare()d objects do not point back at theirs), found where the
    script keeps its training state (reachable_objects)."""
    return [o for o in reachable_objects() if type(o).__name__ == "Accelerator" and _package(o) in _ACCELERATE]


def unwrap_framework(obj: Any) -> Any:
    """The torch object inside an Accelerate or Lightning wrapper (a prepared optimizer or scheduler, a Fabric
    module or optimizer); anything else unchanged."""
    while (inner := _framework_inner(obj)) is not None:
        obj = inner
    return obj


def unwrap(model: Any) -> Any:
    """Strip ``torch.compile``'s wrapper (OptimizedModule keeps the original in ``_orig_mod``) and framework
    wrappers, nested in either order (a compiled ``_FabricModule``, a Fabric module around a compiled DDP)."""
    while True:
        if isinstance(model, torch.nn.Module) and hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif (inner := _framework_inner(model)) is not None:
            model = inner
        else:
            return model


def plain(model: torch.nn.Module) -> torch.nn.Module:
    model = unwrap(model)
    return unwrap(model.module) if isinstance(model, DistributedDataParallel) else model


@dataclass
class Registry:
    """Everything the script registered with swiftrun.Run, and the DDP wrappers to rebind."""

    models: list[torch.nn.Module]  # plain modules (no DDP, no compile wrapper), in registration order
    ddps: list[DistributedDataParallel]  # one per model that has a DDP wrapper, same order as ``models``
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any]
    scaler: Any | None
    user_state: Any | None
    notes: list[str] = field(default_factory=list)  # what registration found and decided, for the user
    # counters a framework keeps beside the objects registered (an Accelerator's micro-batch count), travelling
    # and restored with the user state: (holder, attribute names)
    counters: list[tuple[Any, tuple[str, ...]]] = field(default_factory=list)

    @classmethod
    def build(cls, model: Any, optimizers: list, schedulers: list, scaler: Any, user_state: Any) -> Registry:
        accelerators = _accelerators() if any(
            _is_accelerate(o) for o in (*optimizers, *schedulers)) else []
        if scaler is None:  # Accelerate's mixed precision keeps its GradScaler on the Accelerator
            scaler = next((a.scaler for a in accelerators if getattr(a, "scaler", None) is not None), None)
        given = [unwrap(m) for m in _as_list(model)]
        optimizers = [unwrap_framework(o) for o in optimizers]
        schedulers = [unwrap_framework(s) for s in schedulers]
        for m in given:
            if not isinstance(m, torch.nn.Module):
                raise RegistrationError(f"swiftrun.Run(model=...) takes nn.Modules, got {type(m).__name__}")
        models = [plain(m) for m in given]
        if len({id(m) for m in models}) != len(models):
            raise RegistrationError("swiftrun.Run(model=...) names the same module twice")
        wrappers = {id(plain(d)): d for d in _live_ddps()}
        for m in given:  # the wrappers the script passed win over any other wrapper of the same module
            if isinstance(m, DistributedDataParallel):
                wrappers[id(m.module)] = m
        notes: list[str] = []
        registered = {id(m) for m in models}
        extra = [d for key, d in wrappers.items() if key not in registered and not _inside(plain(d), models)]
        if extra:
            # replicated by definition; register in a deterministic order (by structure), refusing ambiguity
            keyed = sorted(((_signature(plain(d)), d) for d in extra), key=lambda kv: kv[0])
            signatures = [k for k, _ in keyed]
            if len(set(signatures)) != len(signatures):
                raise RegistrationError(
                    "this process has several DistributedDataParallel modules of the same structure that were not "
                    "passed to swiftrun.Run; pass them all, in a fixed order: swiftrun.Run(model=[ddp_a, ddp_b], ...)")
            for _, d in keyed:
                models.append(plain(d))
                notes.append(f"registered {type(plain(d)).__name__} (a DDP module not passed to swiftrun.Run)")
        ddps = [wrappers[id(m)] for m in models if id(m) in wrappers]
        # accelerator.accumulate() counts micro-batches and synchronises gradients at every n-th: a redone window
        # must count from the count its start had, and a replacement from its replica's
        counters = [(a, ("step",)) for a in accelerators]
        return cls(models, ddps, list(optimizers), list(schedulers), scaler, user_state, notes, counters)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for model in self.models for p in model.parameters()]

    @property
    def has_user_state(self) -> bool:
        return self.user_state is not None or bool(self.counters)

    def user_state_dict(self) -> Any:
        if self.counters:  # the script's state beside the framework's counters (only where there are some)
            counted = [{name: getattr(holder, name) for name in names} for holder, names in self.counters]
            return {"script": self._script_state_dict(), "counters": counted}
        return self._script_state_dict()

    def load_user_state(self, sd: Any) -> None:
        if self.counters and sd is not None:
            for (holder, _), values in zip(self.counters, sd["counters"]):
                for name, value in values.items():
                    setattr(holder, name, value)
            sd = sd["script"]
        self._load_script_state(sd)

    def _script_state_dict(self) -> Any:
        user = self.user_state
        if user is None:
            return None
        if hasattr(user, "state_dict"):
            return user.state_dict()
        return dict(user)

    def _load_script_state(self, sd: Any) -> None:
        user = self.user_state
        if user is None or sd is None:
            return
        if hasattr(user, "load_state_dict"):
            user.load_state_dict(sd)
        else:
            user.clear()
            user.update(sd)

    def clear_grads(self) -> None:
        """Gradients of an aborted step are garbage (half accumulated); redo starts from none, like a fresh rank."""
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = None
        for p in self.parameters():
            p.grad = None


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _live_ddps() -> list[DistributedDataParallel]:
    return [o for o in reachable_objects() if isinstance(o, DistributedDataParallel)]


def reachable_objects() -> list[Any]:
    """The objects a script holds where scripts hold their training state: the locals of every frame of this
    thread's stack (the training loop's function, ``main``...) and ``__main__``'s globals, plus one level into
    containers and into objects' attributes (a trainer holding ``self.ema``).

    A scan of the whole heap (``gc.get_objects()``) would also find state held elsewhere, but it took 1.2 s in a
    worker here, on the recovery's critical path; this walk takes microseconds."""
    import sys
    import types

    roots: list[Any] = []
    frame = sys._getframe(1)
    while frame is not None:
        roots.extend(frame.f_locals.values())
        frame = frame.f_back
    main = sys.modules.get("__main__")
    if main is not None:
        roots.extend(vars(main).values())
    seen: set[int] = set()
    out: list[Any] = []

    def visit(obj: Any, depth: int) -> None:
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.Tensor,
                                               types.ModuleType)):
            return
        seen.add(id(obj))
        out.append(obj)
        if depth == 0 or isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)) or callable(obj):
            return
        if isinstance(obj, dict):
            children = list(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            children = list(obj)
        else:
            children = list(getattr(obj, "__dict__", {}).values())
        for child in children[:256]:
            visit(child, depth - 1)

    for root in roots:
        visit(root, 2)
    return out


def _inside(module: torch.nn.Module, models: list[torch.nn.Module]) -> bool:
    return any(module is sub for m in models for sub in m.modules())


def _signature(module: torch.nn.Module) -> tuple:
    return (type(module).__qualname__,
            tuple((name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()))
