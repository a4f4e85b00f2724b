"""Hand-written point-to-point pipelines (Megatron style) under swiftrun: the script runs its own micro-batch
loop and moves activations and gradients between adjacent stages with ``dist.isend``/``irecv``/``send``/``recv``
or ``dist.batch_isend_irecv`` of ``P2POp``\\s. It registers its stage with a few words::

    run = swiftrun.Run(model=stage_module, optimizer=opt, pipeline=swiftrun.Stage(index=s, num_stages=S))

The log, the stage checkpoints and the replay are :class:`~swiftrun.runtime.pp.pipeline.Pipeline`'s, shared with
``torch.distributed.pipelining``; this module is only the *tap* that sees the traffic (docs/ARCHITECTURE.md,
"Pipelines", "Hand-written P2P pipelines"):

- interception: ``isend``, ``irecv``, ``send`` and ``recv`` are replaced in ``torch.distributed.distributed_c10d``
  and the public names are set to the same objects. ``P2POp`` checks its ``op`` by identity against the c10d
  globals and ``batch_isend_irecv``, ``send`` and ``recv`` call them, so every path meets the tap exactly once
  (a nested call runs under ``intercept.internal()``, like swiftrun's own checkpoint exchange and replay
  hand-over, which are never logged or served);
- key: ``(step, "p2p", from stage, to stage, tag, n)``, where ``n`` counts the messages from one stage to the other
  with that tag within the step. The sender counts its sends, a replaying receiver its receives: both backends
  deliver in order per (peer, tag), so the n-th receive is the n-th send;
- live: a host copy of each sent tensor is logged (in a step only, across the boundaries the logging plan logs),
  and the call goes through;
- replay: traffic with a stage replaying in the same set (a logging group) goes through; otherwise a send is
  dropped (an already-completed work) and a receive copies the logged tensor into the caller's buffer. A missing
  entry raises :class:`~swiftrun.errors.RecoveryError`, which the launcher reports as unrecoverable.

Randomness: there is no per-micro-batch forward to seed here, so dropout draws from the global RNG. The replay is
bitwise because the replacement restores the RNG saved with the stage checkpoint and runs the same per-stage
sequence of operations as the lost run; a script whose randomness depends on something else (wall clock, the
order other ranks' messages arrive in) is not replayed exactly.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from swiftrun.errors import RecoveryError
from swiftrun.runtime.comm import intercept
from swiftrun.runtime.comm import subgroups
from swiftrun.runtime.pp.log import BoundaryLog
from swiftrun.runtime.state.registry import RegistrationError


KIND = "p2p"
_FUNCTIONS = ("isend", "irecv", "send", "recv")


@dataclass(frozen=True)
class Stage:
    """A stage of a hand-written point-to-point pipeline: ``swiftrun.Run(pipeline=swiftrun.Stage(...))``.

    Args:
        index: this rank's stage, 0 .. num_stages-1.
        num_stages: the pipeline's length.
        group: the pipeline's process group (its ranks in stage order), or None when every rank of the job is one
            stage of a single pipeline (stage = rank).
    """

    index: int
    num_stages: int
    group: Any = None


# ---------------------------------------------------------------------- pure key logic


class Sequencer:
    """Numbers the messages of one step: the n-th message from stage ``a`` to stage ``b`` with tag ``t``."""

    def __init__(self) -> None:
        self._counts: dict[tuple[int, int, int], int] = {}

    def reset(self) -> None:
        """A step (re)starts: numbering starts again, also when an interrupted step is redone."""
        self._counts.clear()

    def key(self, step: int, frm: int, to: int, tag: int) -> tuple:
        n = self._counts.get((frm, to, tag), 0)
        self._counts[(frm, to, tag)] = n + 1
        return (step, KIND, frm, to, tag, n)


def adjacent_stage(pipe: tuple[int, ...], index: int, peer: int, what: str) -> int:
    """The stage of global rank ``peer``, which must be next to stage ``index`` in ``pipe`` (ranks in stage order)."""
    if peer not in pipe:
        raise RegistrationError(f"stage {index} {what} rank {peer}, which is not in its pipeline (ranks "
                                f"{list(pipe)}): only adjacent stages may exchange tensors in a step")
    other = pipe.index(peer)
    if abs(other - index) != 1:
        raise RegistrationError(f"stage {index} {what} stage {other} (rank {peer}): only adjacent stages may "
                                "exchange tensors in a step (their logs are what a lost stage is replayed from)")
    return other


# ---------------------------------------------------------------------- the tap


class P2PTap:
    """Sees one rank's point-to-point traffic for its pipeline's boundary log (installed at registration)."""

    def __init__(self, pipeline: BoundaryLog, stage: Stage) -> None:
        if not isinstance(stage.index, int) or not isinstance(stage.num_stages, int) or \
                not 0 <= stage.index < stage.num_stages:
            raise RegistrationError(f"swiftrun.Stage(index={stage.index!r}, num_stages={stage.num_stages!r}): "
                                    "index must be in 0 .. num_stages-1")
        group = stage.group
        pipe = tuple(range(dist.get_world_size())) if group is None else tuple(dist.get_process_group_ranks(group))
        if len(pipe) != stage.num_stages or pipe[stage.index] != dist.get_rank():
            raise RegistrationError(
                f"swiftrun.Stage(index={stage.index}, num_stages={stage.num_stages}) on rank {dist.get_rank()}: "
                f"the pipeline's ranks in stage order are {list(pipe)} (the group's ranks, or every rank for "
                "group=None), so this rank must be stage pipe.index(rank) of len(pipe) stages")
        self.pp = pipeline
        self.index = stage.index
        self.num_stages = stage.num_stages
        self.pipe = pipe
        self.seq = Sequencer()
        self._started: float | None = None
        install(self)

    @property
    def stage_indices(self) -> tuple[int, ...]:
        return (self.index,)

    def begin_step(self) -> None:
        """A step starts. The previous step's wall time stands for its compute time in the logging plan's profile
        (there are no forward/backward chunks to time; every stage's step takes about the same wall time, so the
        planner weighs the stages alike)."""
        self.seq.reset()
        now = time.perf_counter()
        if self._started is not None and self.pp.replay is None:
            self.pp.compute += now - self._started
        self._started = now

    # ------------------------------------------------------------------ the calls

    def send(self, fn: Callable[..., Any], tensor: torch.Tensor, peer: int, tag: int, blocking: bool,
             kwargs: dict) -> Any:
        view, replay = self.pp.view, self.pp.replay
        if not view.in_step:  # outside a step nothing is logged; a replaying rank has nobody listening
            return _skipped(blocking) if replay is not None else fn(tensor, **kwargs)
        to = adjacent_stage(self.pipe, self.index, peer, "sends to")
        key = self.seq.key(view.step, self.index, to, tag)
        if replay is not None:  # to a stage replaying with this one: live; elsewhere: dropped
            return fn(tensor, **kwargs) if to in replay["live"] else _skipped(blocking)
        logged = self.pp.logged
        if logged is None or min(self.index, to) in logged:
            self.pp.record(key, tensor)
        return fn(tensor, **kwargs)

    def recv(self, fn: Callable[..., Any], tensor: torch.Tensor, peer: int | None, tag: int, blocking: bool,
             kwargs: dict) -> Any:
        view, replay = self.pp.view, self.pp.replay
        if not view.in_step:
            return (peer if blocking else intercept.Done()) if replay is not None else fn(tensor, **kwargs)
        if peer is None:
            raise RegistrationError(f"stage {self.index} receives from any source in a step: name the source "
                                    "(a replay serves each receive from the log of the stage it comes from)")
        frm = adjacent_stage(self.pipe, self.index, peer, "receives from")
        key = self.seq.key(view.step, frm, self.index, tag)
        if replay is None or frm in replay["live"]:
            return fn(tensor, **kwargs)
        value = replay["log"].get(key)
        if value is None:
            raise RecoveryError(f"replay of stage {self.index}: message {key[5]} (tag {tag}) of step {key[0]} from "
                                f"stage {frm} is not in the neighbours' logs")
        if value.shape != tensor.shape or value.dtype != tensor.dtype:
            raise RecoveryError(f"replay of stage {self.index}: message {key[5]} of step {key[0]} from stage {frm} "
                                f"was logged as {tuple(value.shape)} {value.dtype}, the receive buffer is "
                                f"{tuple(tensor.shape)} {tensor.dtype}")
        with torch.no_grad():
            tensor.copy_(value)
        return peer if blocking else intercept.Done()


def _skipped(blocking: bool) -> Any:
    return None if blocking else intercept.Done()


# ---------------------------------------------------------------------- interception

_tap: P2PTap | None = None
_originals: dict[str, Callable[..., Any]] = {}
_originals_of_class: dict[str, Callable[..., Any]] = {}


def install(tap: P2PTap) -> None:
    """Route ``isend``/``irecv``/``send``/``recv`` through ``tap`` (the functions are replaced once)."""
    global _tap
    _tap = tap
    c10d = dist.distributed_c10d
    for name in _FUNCTIONS:
        fn = getattr(c10d, name)
        if not getattr(fn, "_swiftrun_wrapped", False):
            _originals[name] = fn
            fn = _wrap(name, fn)
            setattr(c10d, name, fn)
        setattr(dist, name, fn)  # the same object: P2POp's identity check and batch_isend_irecv see one function
    op_class = c10d.P2POp
    if "__init__" not in _originals_of_class:
        _originals_of_class["__init__"] = op_class.__init__
        op_class.__init__ = _p2pop_init(op_class.__init__)


def uninstall() -> None:
    """Put torch's own functions back (tests)."""
    global _tap
    _tap = None
    for name, fn in _originals.items():
        setattr(dist.distributed_c10d, name, fn)
        setattr(dist, name, fn)
    _originals.clear()
    if "__init__" in _originals_of_class:
        dist.distributed_c10d.P2POp.__init__ = _originals_of_class.pop("__init__")  # type: ignore[method-assign]


def _p2pop_init(init: Callable[..., Any]) -> Callable[..., Any]:
    """``P2POp`` resolves its peer against its group when built: a group the script created before a recovery is
    replaced by its counterpart of the current generation first (the old one is destroyed)."""

    @functools.wraps(init)
    def __init__(self: Any, op: Any, tensor: torch.Tensor, peer: int | None = None, group: Any = None,
                 tag: int = 0, group_peer: int | None = None) -> None:
        if group is not None and subgroups.count():
            group = subgroups.current(group)
        init(self, op, tensor, peer, group, tag, group_peer)

    return __init__


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    sending, blocking = "send" in name, not name.startswith("i")
    peer_name = "dst" if sending else "src"

    @functools.wraps(fn)
    def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        tap = _tap
        if tap is None or intercept.bypassed():  # swiftrun's own traffic, or a nested call
            return fn(tensor, *args, **kwargs)
        kwargs = _keywords(args, kwargs, peer_name)
        if subgroups.count() and kwargs.get("group") is not None:
            kwargs["group"] = subgroups.current(kwargs["group"])
        peer = _global_peer(kwargs.get("group"), kwargs.get(peer_name), kwargs.get(f"group_{peer_name}"))
        tag = int(kwargs.get("tag", 0) or 0)
        call = functools.partial(_through, fn)
        if sending:
            return tap.send(call, tensor, peer, tag, blocking, kwargs)  # type: ignore[arg-type]
        return tap.recv(call, tensor, peer, tag, blocking, kwargs)

    wrapper._swiftrun_wrapped = True  # type: ignore[attr-defined]
    return wrapper


def _through(fn: Callable[..., Any], tensor: torch.Tensor, **kwargs: Any) -> Any:
    with intercept.internal():  # send/recv call isend/irecv: the tap has seen this message already
        return fn(tensor, **kwargs)


def _keywords(args: tuple, kwargs: dict, peer_name: str) -> dict:
    """torch's positional order after the tensor: peer, group, tag, group peer."""
    names = (peer_name, "group", "tag", f"group_{peer_name}")
    out = dict(zip(names, args))
    out.update(kwargs)
    return out


def _global_peer(group: Any, rank: int | None, group_rank: int | None) -> int | None:
    if group_rank is None:
        return rank
    if group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)
