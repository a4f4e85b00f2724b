"""Immutable views of a running job, for the dashboard and the plain-line reporter.

The supervisor's event loop publishes a new :class:`JobSnapshot` whenever something visible changed (at most a few
times a second); readers never touch the supervisor's own state, so rendering can never slow the loop down.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class WorkerState(str, enum.Enum):
    """The life of one worker process (one incarnation of a rank).

    STARTING while it starts: for a script that creates ``swiftrun.Run``, until it registered (importing torch,
    building the model); for any other script, until its runtime says HELLO, since it never registers (a first
    STATUS also ends it; --no-python executables skip straight to RUNNING);
    RUNNING while it trains; ABORTING once the launcher told it to abort and until it reports back;
    JOINING for a replacement on its way into the job; RECOVERING during the rebuild/consensus/transfer;
    REPLAYING for pipeline-stage replay; FINISHING once its training loop ended (held until RELEASE, then
    saving and exiting); RESTARTING while a restart-all tears it down;
    STOPPING when the job is shutting down; EXITED (status 0) and FAILED are terminal.
    """

    STARTING = "starting"
    RUNNING = "running"
    ABORTING = "aborting"
    JOINING = "joining"
    RECOVERING = "recovering"
    REPLAYING = "replaying"
    FINISHING = "finishing"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    EXITED = "exited"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (WorkerState.EXITED, WorkerState.FAILED)


class JobState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"  # Swift in-place recovery of failed ranks
    RESTARTING = "restarting"  # torchrun-style restart of every worker
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED)


class RecoveryPhase(str, enum.Enum):
    """The phases of one in-place recovery, in order."""

    DETECT = "detect"  # failure happened -> launcher knows (crash: pidfd; hang: heartbeat deadline)
    ABORT = "abort"  # ABORT sent -> every survivor stopped and reported
    SPAWN = "spawn"  # replacement started -> it reached swiftrun.Run
    REBUILD = "rebuild"  # process group of the new generation built
    CONSENSUS = "consensus"  # recovery point agreed
    UNDO = "undo"  # partially applied update undone (or skipped when rolling forward)
    TRANSFER = "transfer"  # state broadcast from the source replica (pipelines: checkpoint and logs handed over)
    REPLAY = "replay"  # a pipeline stage with no replica re-ran the steps since its checkpoint, alone
    RESUME = "resume"  # every rank recovered -> RESUME sent


class NodeSlotState(str, enum.Enum):
    """A node as the multi-node dashboard shows it: a node slot (which owns a fixed range of ranks), or a
    hot-spare node that holds none yet.

    WAITING: no agent joined this slot yet (the job is starting); LIVE: its agent is heard from and its ranks
    are not being replaced; LOST: its agent is gone (connection closed, silent, fenced) and nobody took the slot
    yet; REJOINING: a new incarnation holds the slot (the node restarted, or a hot spare took it over) and its
    ranks are still being replaced; SPARE: a hot-spare node waiting for a slot to take over.
    """

    WAITING = "waiting"
    LIVE = "live"
    REJOINING = "rejoining"
    LOST = "lost"
    SPARE = "spare"


@dataclass(frozen=True)
class NodeView:
    slot: int | None  # the node slot; None for a hot-spare node
    state: NodeSlotState
    node_rank: int | None = None  # what its agent was started with (a spare that took slot k: still its own)
    host: str | None = None
    incarnation: int | None = None  # of the slot: how many agents held it before this one
    ranks: tuple[int, ...] = ()  # the ranks this slot owns (stable for the whole job)
    heartbeat_age: float | None = None  # seconds since its agent's last message


@dataclass(frozen=True)
class RankView:
    rank: int
    local_rank: int
    pid: int | None
    state: WorkerState
    step: int | None = None
    loss: float | None = None
    step_time: float | None = None  # seconds
    heartbeat_age: float | None = None  # seconds since the last message from this worker
    restarts: int = 0  # how many times this rank was replaced or restarted
    metrics: dict[str, float] = field(default_factory=dict)
    node: int | None = None  # multi-node: the node slot that owns this rank


@dataclass(frozen=True)
class PhaseView:
    phase: RecoveryPhase
    duration: float | None  # seconds; None while the phase runs


@dataclass(frozen=True)
class RecoveryView:
    generation: int
    failed_ranks: tuple[int, ...]
    cause: str  # e.g. "rank 2 killed by SIGKILL"
    phases: tuple[PhaseView, ...]
    mode: str | None = None  # "roll-forward", "undo", "redo" (nobody had applied the step)
    source_rank: int | None = None
    done: bool = False
    total: float | None = None  # seconds from failure to resume, once done
    replay: str | None = None  # a pipeline stage's replay progress, e.g. "rank 2: step 7 of 4..9"
    inexact: str | None = None  # an update was undone arithmetically: why, e.g. "--no-exact-undo"


@dataclass(frozen=True)
class JobSnapshot:
    script: str
    world_size: int
    nnodes: int
    generation: int
    state: JobState
    uptime: float  # seconds since the job started
    ranks: tuple[RankView, ...]
    steps_per_s: float | None = None
    rate_history: tuple[float, ...] = ()  # steps/s per second, oldest first: the header's sparkline
    samples_per_s: float | None = None  # from a reported "samples_per_s" or "tokens_per_s" metric
    failures: int = 0
    time_lost: float = 0.0  # seconds spent in recoveries and restarts
    recovery: RecoveryView | None = None  # the current recovery, else the last one
    events: tuple[str, ...] = ()  # newest last, already formatted for humans
    event_log: str | None = None
    nodes: tuple[NodeView, ...] = ()  # multi-node: every node slot in order, then the hot-spare nodes
