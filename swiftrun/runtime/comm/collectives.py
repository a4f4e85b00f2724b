"""The collectives a script issues itself (``dist.all_reduce`` of a metric, a barrier around a checkpoint), made
to survive a peer's failure wherever that can be exact.

DDP's gradient all-reduce runs inside the guarded body of a step, where ``Run.guard`` repairs a failure. But
scripts also call collectives elsewhere: an evaluation that all-reduces its metric after the guard, ``if rank ==
0: save(); dist.barrier()``, a final barrier after the loop. An aborted process group fails those too, and
without help every survivor would die with it. So the runtime wraps torch.distributed's collective functions:

- inside the guarded body, and in code of a step before its guard: the call goes through unchanged; a failure
  propagates to the guard (before the guard nothing can repair it; said once per call site);
- outside a step's body (the tail of an iteration after its guard, evaluation, between steps): a failure, or an
  abort that arrived before the call, is repaired right there: the rank joins the recovery, then the call is
  *skipped*, and so is every later collective of the same iteration, since the replacement is not running that
  iteration's tail and would never match them. A skipped call leaves this rank's own values in place
  (all-reduce: the local value; all-gather: the local value in every slot), says so once per call site, and the
  whole state is verified when the next step begins (a scheduler fed a local metric would show up there);
- after training (every rank released from the loop): a failure is reported and the call skipped; the job
  completed training, and a dead peer must not turn the script's tail into a crash.

Calls made by swiftrun itself run under :func:`internal` and bypass all of this, as do calls nested inside a
wrapped call (``broadcast_object_list`` calls ``broadcast``).
"""

from __future__ import annotations

import functools
import os
import traceback
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
import torch.distributed as dist

from swiftrun.runtime.comm import abortable, subgroups
from swiftrun.runtime.comm.intercept import Done, bypassed, internal, is_peer_failure
from swiftrun.runtime.worker import faults
from swiftrun.runtime.worker.process import warn

if TYPE_CHECKING:
    from swiftrun.runtime.state.registry import Registry

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list",
    "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    # torch 2.13's single-tensor forms, which FSDP2 issues for its all-gathers and reduce-scatters: without them
    # a survivor waited on FSDP's collectives inside gloo, where the abort does not always reach (abortable.py)
    "all_gather_single", "reduce_scatter_single",
)

class ScriptCollectives(Protocol):
    """What routing the script's collectives needs from the recovery loop (runtime/core/recovery.py implements
    it): where the rank is in its step, and the two ways out, recovering here or letting the guard do it."""

    reg: Registry  # the registered state (an in-place collective on it taints the step)
    step: int
    in_step: bool  # inside the guarded body's transaction
    in_guard: bool
    aborted_iteration: bool  # a recovery interrupted this iteration: its remaining collectives are skipped
    released: bool  # training is over on every rank: the script's tail runs

    @property
    def runs_alone(self) -> bool:
        """This rank computes without its peers (a pipeline stage replaying): nobody would answer."""

    def aborted(self) -> bool: ...

    def recover_here(self) -> None: ...

    def caused_by_peer_failure(self, exc: BaseException) -> bool: ...

    def note_collective_on_state(self) -> None: ...

    def step_collective(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run a collective issued inside a step (a pipeline logs its result, or serves it in a replay)."""


_recovery: ScriptCollectives | None = None
_said: set[tuple[str, str]] = set()
_owned: tuple[int, set[int]] = (-2, set())  # (step, storages of registered state) for _touches_state
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the runtime root: all of swiftrun.runtime


def install(recovery: ScriptCollectives) -> None:
    """Route the script's collectives through ``recovery`` (idempotent: the functions are wrapped once)."""
    global _recovery
    _recovery = recovery
    for module in (dist, dist.distributed_c10d):
        for name in COLLECTIVES:
            fn = getattr(module, name, None)
            if fn is not None and not getattr(fn, "_swiftrun_wrapped", False):
                setattr(module, name, _wrap(name, fn))
        destroy = getattr(module, "destroy_process_group")
        if not getattr(destroy, "_swiftrun_wrapped", False):
            setattr(module, "destroy_process_group", _wrap_destroy(destroy))


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rec = _recovery
        if subgroups.count():  # a group the script holds may be one a recovery replaced
            args, kwargs = _current_groups(args, kwargs)
        if rec is None or bypassed():
            return fn(*args, **kwargs)
        with internal():
            return _call(rec, name, functools.partial(_abortable, name, fn), args, kwargs)

    wrapper._swiftrun_wrapped = True  # type: ignore[attr-defined]
    return wrapper


def _abortable(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The script's call, its wait ended by an ABORT even where gloo would not end it (runtime/comm/abortable.py)."""
    return abortable.call(name, fn, args, kwargs)


def _wrap_destroy(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def destroy(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - tearing down a group a recovery already aborted may complain
            if _recovery is None or not (_recovery.released or _recovery.aborted()):
                raise
            return None

    destroy._swiftrun_wrapped = True  # type: ignore[attr-defined]
    return destroy


def _call(rec: ScriptCollectives, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    faults.fire("collective", max(rec.step, 0))
    if rec.released:  # the script's tail after training: report a dead peer, never die of it
        if rec.aborted():
            return _skip(name, args, kwargs, "a peer failed after training had completed")
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - sorted below
            if not is_peer_failure(exc, chained=False) and not rec.aborted():
                raise
            return _skip(name, args, kwargs, "a peer failed after training had completed")
    if rec.runs_alone:  # nobody would answer
        if rec.in_step:
            return rec.step_collective(name, fn, args, kwargs)
        return _skip(name, args, kwargs, "this rank was replaying its pipeline stage alone")
    if rec.aborted_iteration:
        return _skip(name, args, kwargs, "a recovery interrupted this iteration")
    if rec.in_step:
        if _touches_state(rec, args, kwargs):
            rec.note_collective_on_state()
        if not rec.in_guard:
            _say_once(name, "is issued inside a step but before `with run.guard()`: a failure there cannot be "
                            "recovered in place; move it into the guarded body")
        return rec.step_collective(name, fn, args, kwargs)
    if rec.in_guard:  # a second guard after the step (evaluation): the guard repairs a failure
        return fn(*args, **kwargs)
    if rec.aborted():
        rec.recover_here()
        return _skip(name, args, kwargs, "a recovery interrupted this iteration")
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a peer's failure is repaired here; the script's own error is not
        if not rec.caused_by_peer_failure(exc):
            raise
    rec.recover_here()
    return _skip(name, args, kwargs, "a recovery interrupted this iteration")


def _current_groups(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Swap every process group argument for its current generation's counterpart (runtime/comm/subgroups.py)."""
    group_type = dist.ProcessGroup
    args = tuple(subgroups.current(a) if isinstance(a, group_type) else a for a in args)
    if isinstance(kwargs.get("group"), group_type):
        kwargs = {**kwargs, "group": subgroups.current(kwargs["group"])}
    return args, kwargs


def _skip(name: str, args: tuple, kwargs: dict, why: str) -> Any:
    """Leave this rank's own values where the collective would have written everyone's."""
    _say_once(name, f"was skipped ({why}); its result is this rank's own value")
    if name in ("all_gather", "all_gather_object"):
        outputs, value = _arg(args, kwargs, 0, "tensor_list" if name == "all_gather" else "object_list"), \
            _arg(args, kwargs, 1, "tensor" if name == "all_gather" else "obj")
        for i in range(len(outputs)):
            if isinstance(value, torch.Tensor):
                outputs[i].copy_(value)
            else:
                outputs[i] = value
    elif name in ("all_gather_into_tensor", "all_gather_single"):
        output, value = _arg(args, kwargs, 0, "output_tensor"), _arg(args, kwargs, 1, "input_tensor")
        output.view(-1, *value.shape)[:] = value
    return Done() if kwargs.get("async_op") else None


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs[name]


def _touches_state(rec: ScriptCollectives, args: tuple, kwargs: dict) -> bool:
    """Whether a tensor argument shares storage with registered state (an in-place collective on the model)."""
    tensors = abortable.tensor_args(args, kwargs)
    if not tensors:
        return False
    global _owned
    if _owned[0] != rec.step:  # once per step: optimizer state appears lazily, at the first optimizer step
        state = [*rec.reg.parameters(), *(b for m in rec.reg.models for b in m.buffers())]
        for opt in rec.reg.optimizers:
            state += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        _owned = (rec.step, {key for key in map(_storage, state) if key is not None})
    return any(_storage(t) in _owned[1] for t in tensors)


def _storage(t: torch.Tensor) -> int | None:
    """Where a tensor's data lives: a DTensor's (FSDP2, TP) is its local shard's; None for a storage FSDP freed
    (an unsharded parameter between all-gathers) or a tensor without one."""
    local = getattr(t, "_local_tensor", None)  # DTensor, without importing torch.distributed.tensor
    if isinstance(local, torch.Tensor):
        t = local
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _say_once(name: str, what: str) -> None:
    site = _call_site()
    key = (site, what.split(" ", 1)[0])
    if key in _said:
        return
    _said.add(key)
    warn(f"dist.{name} at {site} {what}")


def _call_site() -> str:
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_HERE) and not path.startswith(torch_dir) and "contextlib" not in path:
            return f"{os.path.basename(path)}:{frame.lineno}"
    return "?"
