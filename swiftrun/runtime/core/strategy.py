"""How one kind of parallelism recovers: the part of a recovery the generation loop does not know.

The loop in runtime/core/recovery.py is the same for every job: settle the interrupted step, report ABORTED,
wait for RECOVER, rebuild the process groups, *make the ranks consistent*, report RECOVERED, wait for RESUME.
The emphasised part is a strategy's: data parallelism agrees on a point and copies a replica's state
(runtime/dp/recovery.py); a pipeline copies a stage's replica where it has one and replays a stage that has none
(runtime/pp/recovery.py). ``swiftrun.Run`` chooses the strategy once, from what the script registered; the loop
calls it only through the hooks below, so a new kind of parallelism is a new strategy, not new branches in the
loop.

The hooks' defaults are those of a strategy that needs nothing at that moment.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Protocol


class RecoveryPlan(Protocol):
    """What a strategy decided, as the launcher's event log records it."""

    def as_dict(self) -> dict[str, Any]: ...


@contextmanager
def timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Add the seconds the block took to ``phases[name]``: the rank's part of the recovery record (RECOVERED's
    ``phases``, folded by the launcher into the event log's RECOVERY_PHASE records). Time spent in a block that
    raised is kept too, so a recovery that fails says where its time went."""
    start = time.monotonic()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.monotonic() - start


class Strategy:
    """One kind of parallelism's part of the recovery (see the module docstring)."""

    # a completed step may have to be undone, so its undo records and gradients are kept past its end
    keeps_last_update = False
    # why (said with the cost of the copies that make such an undo bitwise, runtime/core/precopy.py)
    undo_reason: str | None = None
    # why this strategy cannot recover this job in place at all (said at Run(), as an unrecoverable layout is)
    refusal: str | None = None
    # whether the strategy copies a rank's shards from a replica (HSDP); otherwise sharded state is unrecoverable
    recovers_shards = False

    @property
    def compare_group(self) -> Any:
        """The group whose members must hold equal states between steps (None: every rank)."""
        return None

    @property
    def runs_alone(self) -> bool:
        """Whether this rank computes without its peers right now (a pipeline stage replaying): nobody would
        answer a collective the script issues outside a step, and a refusal inside one is a recovery's failure."""
        return False

    def on_start(self) -> None:
        """The first process group was built (generation 0, every rank): check and set up what needs it."""

    def on_step_start(self, step: int) -> bool:
        """A step begins, after the loop's own checks. False: a peer failed meanwhile (recover first)."""
        return True

    def uncompared_buffers(self) -> set[int] | None:
        """For the comparison of every rank's state between steps (``SWIFTRUN_VERIFY_EVERY``, or asked for by a
        recovery): the registered models whose buffers differ between ranks by design at a step start (left out),
        or None when the ranks' states differ by design and are not compared at all."""
        return set()

    def on_abort(self) -> None:
        """A recovery begins on this rank (before ABORTED is reported)."""

    def before_rebuild(self) -> None:
        """The process groups are about to be destroyed and built for the new generation."""

    def after_rebuild(self) -> None:
        """The new generation's default group exists (and the script's subgroups)."""

    def recover(self, phases: dict[str, float]) -> RecoveryPlan:
        """Make every rank consistent over the new group, timing each phase into ``phases``. Sets the loop's
        position (``completed``, ``partial``, ``valid``, ``next_step``). Raises RecoveryError when it cannot be
        done exactly (the launcher then restarts every worker or stops)."""
        raise NotImplementedError

    def reports_later(self, gen: int, phases: dict[str, float], plan: RecoveryPlan) -> bool:
        """True: this rank is not consistent yet when ``recover`` returns (a stage replaying its steps): it reports
        RECOVERED itself once it is, through :meth:`on_step_start` or :meth:`on_finish`."""
        return False

    def on_finish(self) -> bool:
        """Training's last step is done on this rank. False: a failure must be recovered first."""
        return True

    def step_collective(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A collective the script issues inside a step (after the loop's own bookkeeping)."""
        return fn(*args, **kwargs)
