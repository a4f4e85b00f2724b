"""What an agent's event loop needs from the job it supervises: :class:`SupervisedJob`.

:class:`~swiftrun.launcher.agent.Agent` owns a node's processes, sockets and clock; the decisions are not its own.
On one node it asks the local state machine (:class:`~swiftrun.launcher.job.Job`); in a multi-node job each node's
agent asks :class:`~swiftrun.launcher.node_agent.RemoteJob`, which forwards the same calls to the coordinator's
``Job`` and answers the loop from a mirror of the node's slots. The loop is written once, against this contract,
so that neither side can grow a method the other lacks without the type checker and
``tests/unit/test_job_contract.py`` saying so.

Every ``on_*`` call reports one fact with the monotonic time it was observed and returns the actions to carry
out now; ``tick`` is called when nothing happened until ``next_deadline``. Actions left over from a decision
taken outside a call (records of a recovery's phases) come out of ``drain_records``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from swiftrun.launcher.actions import Action
from swiftrun.launcher.failures import ProcessFailure
from swiftrun.protocol.control import EventKind


class SupervisedSlot(Protocol):
    """One process as the loop sees it: which rank it serves (None: a spare) and the traceback it left."""

    slot_id: int
    rank: int | None
    traceback: str | None


@runtime_checkable
class SupervisedJob(Protocol):
    """The decisions an agent's loop asks for; implemented by ``Job`` (local) and ``RemoteJob`` (a node's)."""

    generation: int  # the recovery generation a new worker is welcomed into
    time_lost: float  # seconds of training lost to failures so far (the summary's figure)

    @property
    def slots(self) -> Mapping[int, SupervisedSlot]: ...

    @property
    def failures(self) -> Sequence[ProcessFailure]: ...  # every failure of the job, the root cause first

    @property
    def late_failures(self) -> Sequence[ProcessFailure]: ...  # failures after training had completed everywhere

    def on_spawned(self, slot_id: int, pid: int, now: float) -> list[Action]: ...

    def on_spawn_failed(self, slot_id: int, reason: str, now: float) -> list[Action]: ...

    def on_hello(self, slot_id: int, gen: int, now: float) -> list[Action]: ...

    def on_alive(self, slot_id: int, now: float, step: int | None = None) -> list[Action]: ...

    def on_status(
        self, slot_id: int, now: float, step: int, loss: Any, step_time: Any, metrics: dict
    ) -> list[Action]: ...

    def on_event(self, slot_id: int, gen: int, kind: EventKind, data: dict[str, Any], now: float) -> list[Action]: ...

    def on_ack(self, slot_id: int, cmd_id: int, now: float) -> list[Action]: ...

    def on_exit(
        self, slot_id: int, returncode: int, now: float, cause: str = "", error_file: str | None = None
    ) -> list[Action]: ...

    def on_signal(self, signum: int, now: float) -> list[Action]: ...

    def tick(self, now: float, stopped: frozenset[int] = frozenset()) -> list[Action]: ...

    def silent_slots(self, now: float) -> list[int]: ...

    def next_deadline(self, now: float) -> float: ...

    def drain_records(self) -> list[Action]: ...
