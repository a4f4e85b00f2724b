"""The script's own process groups (``dist.new_group``), re-created in every generation.

A DP x PP script builds subgroups before ``swiftrun.Run`` exists: one group per pipeline (its stages' P2P) and one
per stage (its replicas' DDP all-reduce). Rebuilding the default group for a new generation destroys every group,
so the runtime must create the script's subgroups again, in the same order on every rank (torch's contract: all
ranks call ``new_group`` for every group, members or not), and point what holds the old ones at the new ones:
DDP's ``process_group``, a ``PipelineStage``'s ``group``, and the ``group=`` the script passes to a collective.

Because ranks call ``new_group`` even for groups they are not members of (torch then returns a non-member
sentinel and keeps no record), the calls are recorded from the first one on: a finder on ``sys.meta_path``
wraps ``torch.distributed.distributed_c10d.new_group`` as that module is imported (the bootstrap installs it
before the script runs; nothing is imported early). Calls swiftrun makes itself (its transfer groups) run under
``intercept.internal()`` and are not recorded.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from typing import Any, Callable

from swiftrun.runtime.comm import intercept

_C10D = "torch.distributed.distributed_c10d"

_specs: list[tuple[tuple, dict]] = []  # (args, kwargs) of every recorded new_group call, in call order
_current: list[Any] = []  # the group each spec stands for in the current generation (a sentinel if not a member)
_index: dict[int, int] = {}  # id(group ever returned for a spec) -> spec index
_keep: list[Any] = []  # every group handed out, so no id() is ever reused by another object
_original: Callable[..., Any] | None = None


def recording_allowed() -> bool:
    return not intercept.bypassed()  # swiftrun's own groups are not the script's


def _wrap(new_group: Callable[..., Any]) -> Callable[..., Any]:
    global _original
    _original = new_group

    @functools.wraps(new_group)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        group = new_group(*args, **kwargs)
        if recording_allowed():
            _index[id(group)] = len(_specs)
            _specs.append((args, kwargs))
            _current.append(group)
            _keep.append(group)
        return group

    recorded._swiftrun_wrapped = True  # type: ignore[attr-defined]
    return recorded


def _patch(module: Any) -> None:
    fn = getattr(module, "new_group", None)
    if fn is not None and not getattr(fn, "_swiftrun_wrapped", False):
        module.new_group = _wrap(fn)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches distributed_c10d right after it executes, before ``torch.distributed`` re-exports its names."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _C10D:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        execute = loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            _patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Record the script's ``new_group`` calls from now on (before torch is imported, or patch it now)."""
    module = sys.modules.get(_C10D)
    if module is not None:
        original = getattr(module, "new_group", None)
        _patch(module)
        # modules that imported the name already hold the unwrapped function: torch.distributed itself, and
        # DeviceMesh (a replacement forked from the warm zygote imported it before this ran), whose mesh
        # dimensions would otherwise never be re-created in a new generation
        for name, other in list(sys.modules.items()):
            if (name == "torch.distributed" or name.startswith("torch.distributed.")) and other is not module \
                    and original is not None and getattr(other, "new_group", None) is original:
                other.new_group = module.new_group
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def recreate(create: Callable[[Callable[..., Any], tuple, dict], Any]) -> None:
    """Create every recorded group again for the new default group; ``create(new_group, args, kwargs)`` runs one
    creation (the group manager bounds its connection phase and tracks the new connections for aborts)."""
    assert _original is not None or not _specs
    for i, (args, kwargs) in enumerate(_specs):
        group = create(_original, args, kwargs)
        _current[i] = group
        _index[id(group)] = i
        _keep.append(group)


def current(group: Any) -> Any:
    """The current generation's counterpart of a group the script (or an object) holds; others unchanged."""
    if group is None:
        return None
    i = _index.get(id(group))
    return _current[i] if i is not None else group


def count() -> int:
    return len(_specs)
