"""A training step as a transaction: what a step changes that cannot be inverted, saved at the step's start.

After a recovery every rank that redoes step ``s`` must hold exactly the state it had when ``s`` began. The
optimizer's own update is tracked precisely (it can be undone, or the state is taken from a rank that finished
the step), but a step also changes things no inverse formula covers:

- buffers its forward pass mutates: BatchNorm's running statistics and batch counter, spectral norm's ``u``/``v``,
  any counter a module keeps (non-persistent buffers included). The kernels update them without bumping the
  tensor's version counter (measured: BatchNorm's ``running_mean`` keeps ``_version`` 1 while it changes), so
  "copy only what changed" cannot be decided cheaply: they are copied every step. They are tiny next to the
  parameters (BatchNorm: 2 floats per channel);
- the optimizer's param-group hyperparameters, which ``scheduler.step()`` writes (lr; OneCycle's momentum or
  betas); restoring a scheduler's ``state_dict`` alone leaves them at the next step's values;
- the schedulers' and the scaler's ``state_dict``, and the registered user state (an EMA model: one copy of its
  tensors, the one real cost here, said in the README);
- the RNG streams (Python, NumPy, torch, CUDA).

:class:`StepSnapshot` holds all of that for one step. Copies are made into tensors allocated once and reused
(``copy_``), so a step costs a memcpy of the buffers and user state and no allocation. The rest is kept cheap
because it runs at every step start (a 10 ms pipeline step showed it): immutable settings are kept by reference
rather than deep-copied, the buffers and the parameters' version counters come from one walk over the modules,
and NumPy's global generator is read only once something imported ``numpy.random`` (reading it cost more than
the rest of the snapshot together, for a generator nobody had created).
"""

from __future__ import annotations

import copy
import ctypes
import random
import sys
from dataclasses import dataclass
from typing import Any

import torch

from swiftrun.runtime.state import skeleton
from swiftrun.runtime.state.registry import Registry

Tree = Any


def rng_state() -> dict[str, Any]:
    """The global RNG streams a script may draw from: Python's, torch's CPU one, NumPy's legacy global one once
    ``numpy.random`` is imported (accessing ``np.random`` here would import it), and the CUDA ones once CUDA is
    initialised."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.default_generator.get_state()}
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        state["numpy"] = _numpy_state(np_random)
    if torch.cuda.is_initialized():  # never True without CUDA; cheaper than is_available()
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


class NumpyGlobalState:
    """NumPy's legacy global generator's state, read cheaply when it did not change.

    ``np.random.get_state()`` costs 25 us (MT19937 copies its 624-word key element by element in Python-level
    code): more than the rest of a step's snapshot, at every step start, and torch.distributed.pipelining imports
    numpy.random (through torch._dynamo) whether or not a script draws from it. The bit generator's public ctypes
    interface gives the address of its raw state (the key and the position: 2500 bytes, read in 0.3 us). The full
    state is ``(key, pos)`` plus the legacy Gaussian cache (``has_gauss``, ``gauss``), which only ``get_state``
    reads. So: the last full read is reused while the raw bytes are unchanged *and* that read's Gaussian cache
    was empty. Exact because any draw moves the position or the key (MT19937 returns to a state only after its
    period), and filling the cache is a Gaussian draw; a non-empty cache could be consumed without a draw, so it
    is read in full again every time. (One case escapes: ``set_state`` of a tuple whose key and position equal
    the current ones but whose cache is full; nobody writes that.) The raw layout is checked against
    ``get_state`` once; if it differs (another NumPy, another bit generator) every read is a full one."""

    RAW_BYTES = 624 * 4 + 4  # mt19937_state: uint32_t key[624]; int pos

    def __init__(self, np_random: Any) -> None:
        self.full = np_random.get_state  # bound to the global RandomState the module's functions use
        self.address: int | None = None
        self.last: tuple[bytes, tuple] | None = None
        try:
            generator = self.full.__self__._bit_generator
            if type(generator).__name__ == "MT19937":
                address = generator.ctypes.state_address
                raw = ctypes.string_at(address, self.RAW_BYTES)
                _, key, pos, _, _ = self.full()
                if raw[:-4] == key.astype("=u4").tobytes() and int.from_bytes(raw[-4:], sys.byteorder,
                                                                                 signed=True) == pos:
                    self.address = address
        except Exception:  # noqa: BLE001 - any surprise in NumPy's internals: full reads, always correct
            self.address = None

    def __call__(self) -> tuple:
        if self.address is None:
            return self.full()
        raw = ctypes.string_at(self.address, self.RAW_BYTES)
        last = self.last
        if last is not None and last[0] == raw:
            return last[1]
        state = self.full()
        self.last = (raw, state) if not state[3] else None  # state[3]: has_gauss
        return state


_numpy_reader: NumpyGlobalState | None = None


def _numpy_state(np_random: Any) -> tuple:
    global _numpy_reader
    reader = _numpy_reader
    if reader is None or reader.full != np_random.get_state:
        reader = _numpy_reader = NumpyGlobalState(np_random)
    return reader()


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Copier:
    """Copies tensor leaves of a tree into buffers kept from the previous call (same path, shape, dtype).

    ``host``: a GPU tensor's buffer is pinned host memory, filled on the current stream without blocking the host
    (work queued after it on that stream, such as the update it precedes, runs after the copy); :meth:`thaw`
    brings such a copy back to its device.
    """

    def __init__(self, host: bool = False) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._host = host
        self._homes: dict[int, torch.device] = {}  # id of a host buffer -> the device its source lives on

    def freeze(self, tree: Tree, path: str = "") -> Tree:
        """A copy of ``tree``: each tensor in the buffer kept for its path, anything else deep-copied."""
        return skeleton.map_tree_at(tree, lambda leaf, at: self._freeze_leaf(leaf, path, at))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def settle(self) -> None:
        """Wait for the copies into host memory still in flight (before they are read)."""
        if self._homes:
            torch.cuda.synchronize()

    def thaw(self, kept: Tree) -> Tree:
        """A private copy of a frozen tree, each tensor on the device its source was on."""
        return skeleton.map_tree(kept, self._thaw_leaf)

    def _thaw_leaf(self, leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return copy.deepcopy(leaf)
        home = self._homes.get(id(leaf))
        return leaf.to(home, copy=True) if home is not None else leaf.clone()

    def _freeze_leaf(self, leaf: Any, root: str, at: tuple) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return copy.deepcopy(leaf)
        path = root + "".join(f".{k}" for k in at)  # the buffer's key, only built for a tensor
        kept = self._buffers.get(path)
        value = leaf.detach()
        offload = self._host and value.device.type == "cuda"
        device = torch.device("cpu") if offload else value.device
        if kept is None or kept.shape != value.shape or kept.dtype != value.dtype or kept.device != device:
            if kept is not None:
                self._homes.pop(id(kept), None)
            if offload:
                kept = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=True)
                self._homes[id(kept)] = value.device
            else:
                kept = torch.empty_like(value)
            self._buffers[path] = kept
        kept.copy_(value, non_blocking=offload)
        return kept


@dataclass
class StepSnapshot:
    step: int
    buffers: list[dict[str, torch.Tensor]]  # per registered model: every buffer, by name
    hyperparameters: list[list[dict[str, Any]]]  # per optimizer, per param group: everything but "params"
    schedulers: list[Any]
    scaler: Any
    user: Any
    rng: dict[str, Any]
    param_versions: int  # sum of the parameters' version counters: moves when anything writes a parameter


def param_versions(reg: Registry) -> int:
    return sum(p._version for model in reg.models for p in model.parameters())


def buffers_and_versions(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], int]:
    """``dict(model.named_buffers())`` and the sum of ``p._version`` over ``model.parameters()`` in one walk over
    the modules (each a walk of its own before; same names, same de-duplication of shared modules and tensors)."""
    buffers: dict[str, torch.Tensor] = {}
    versions = 0
    seen_buffers: set[int] = set()
    seen_params: set[int] = set()
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and id(buf) not in seen_buffers:
                seen_buffers.add(id(buf))
                buffers[f"{prefix}.{name}" if prefix else name] = buf
        for param in module._parameters.values():
            if param is not None and id(param) not in seen_params:
                seen_params.add(id(param))
                versions += param._version
    return buffers, versions


class Transaction:
    """Takes the snapshot of each step as it starts and puts it back when the step must be redone.

    ``keep`` snapshots are kept (1 suffices to redo the step in progress; undo mode may also undo the step
    before it). Each slot reuses its copy buffers, so the snapshot of step s overwrites that of step s-keep."""

    def __init__(self, reg: Registry, keep: int = 1) -> None:
        self.reg = reg
        self._copiers = [Copier() for _ in range(keep)]
        self._snaps: list[StepSnapshot | None] = [None] * keep
        self.current: StepSnapshot | None = None

    def begin(self, step: int) -> StepSnapshot:
        reg = self.reg
        slot = step % len(self._copiers)
        copier = self._copiers[slot]
        buffers, versions = [], 0
        with torch.no_grad():
            for i, model in enumerate(reg.models):
                live, counted = buffers_and_versions(model)
                buffers.append(copier.freeze(live, f"b{i}"))
                versions += counted
            snap = StepSnapshot(
                step=step,
                buffers=buffers,
                hyperparameters=[[_settings(g, copier, f"h{i}.{j}") for j, g in enumerate(opt.param_groups)]
                                 for i, opt in enumerate(reg.optimizers)],
                schedulers=[copy.deepcopy(s.state_dict()) for s in reg.schedulers],
                scaler=copy.deepcopy(reg.scaler.state_dict()) if reg.scaler is not None else None,
                user=copier.freeze(reg.user_state_dict(), "u") if reg.has_user_state else None,
                rng=rng_state(),
                param_versions=versions,
            )
        self._snaps[slot] = snap
        self.current = snap
        return snap

    def snapshot(self, step: int) -> StepSnapshot | None:
        """The snapshot taken when ``step`` began, if it is still kept."""
        snap = self._snaps[step % len(self._snaps)] if step >= 0 else None
        return snap if snap is not None and snap.step == step else None

    def rng_for(self, step: int) -> dict[str, Any] | None:
        snap = self.snapshot(step)
        return snap.rng if snap is not None else None

    def params_touched(self) -> bool:
        """Whether something wrote the parameters since the step began (asked only when no optimizer
        stepped, so the optimizer cannot be what moved the version counters)."""
        return self.current is not None and param_versions(self.reg) != self.current.param_versions

    def restore(self, snap: StepSnapshot) -> None:
        """Put back everything the snapshot holds except the RNG (set by the recovery for the step to redo)."""
        reg = self.reg
        with torch.no_grad():
            for model, saved in zip(reg.models, snap.buffers):
                live = dict(model.named_buffers())
                for name, value in saved.items():
                    target = live.get(name)
                    if target is not None and target.shape == value.shape and target.dtype == value.dtype:
                        target.copy_(value)
                    else:  # the step replaced the buffer object: put a copy of the old one back in its place
                        _set_buffer(model, name, value.clone())
            for opt, groups in zip(reg.optimizers, snap.hyperparameters):
                for group, saved in zip(opt.param_groups, groups):
                    for key, value in saved.items():
                        if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                            group[key].copy_(value)  # a tensor lr may be shared with a compiled step
                        else:
                            group[key] = copy.deepcopy(value)
        for sched, sd in zip(reg.schedulers, snap.schedulers):
            sched.load_state_dict(copy.deepcopy(sd))
        if reg.scaler is not None and snap.scaler is not None:
            reg.scaler.load_state_dict(copy.deepcopy(snap.scaler))
        if snap.user is not None:
            reg.load_user_state(_clone_tree(snap.user))


def _settings(group: dict[str, Any], copier: Copier, path: str) -> dict[str, Any]:
    """A param group's settings but its params: immutable values by reference (deep-copying a dozen floats and
    flags per group at every step start was most of the snapshot's cost), the rest (a tensor lr, a list) copied."""
    return {k: v if skeleton.immutable(v) else copier.freeze(v, f"{path}.{k}")
            for k, v in group.items() if k != "params"}


def _clone_tree(tree: Tree) -> Tree:
    """A private copy, so that loading it never aliases the snapshot's reused buffers."""
    return skeleton.map_tree(
        tree, lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else copy.deepcopy(leaf))


def _set_buffer(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    owner._buffers[leaf] = value
