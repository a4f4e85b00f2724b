"""Build the dashboard's :class:`~swiftrun.snapshot.JobSnapshot` from the supervisor's own state.

Shared by the single-node :class:`~swiftrun.launcher.agent.Agent` and the multi-node
:class:`~swiftrun.launcher.coordinator.Coordinator` (in node 0's process or in ``swiftrun coordinator``): both
call it on the thread that owns the :class:`~swiftrun.launcher.job.Job`, and hand the immutable result to a
reporter, which may read it from another thread.
"""

from __future__ import annotations

import collections
from typing import Callable

from swiftrun.config import LaunchConfig
from swiftrun.launcher.job import Job
from swiftrun.launcher.nodes import Node, NodeState, NodeTable
from swiftrun.snapshot import (
    JobSnapshot,
    JobState,
    NodeSlotState,
    NodeView,
    PhaseView,
    RankView,
    RecoveryPhase,
    RecoveryView,
)


class Throughput:
    """Rank 0's recent steps per second, over the last steps it reported, and its history for the dashboard's
    sparkline: one rate per ``period`` (sampled when a snapshot is built, so a stall reads as zero)."""

    def __init__(self, window: int = 50, history: int = 16, period: float = 1.0) -> None:
        self._points: collections.deque[tuple[float, int]] = collections.deque(maxlen=window)
        self._history: collections.deque[float] = collections.deque(maxlen=history)
        self._sampled: tuple[float, int] | None = None  # (when, rank 0's step) at the last history sample
        self.period = period

    def add(self, now: float, step: int) -> None:
        if not self._points or self._points[-1][1] != step:
            self._points.append((now, step))

    def steps_per_s(self) -> float | None:
        if len(self._points) < 2:
            return None
        (t_a, s_a), (t_b, s_b) = self._points[0], self._points[-1]
        return (s_b - s_a) / (t_b - t_a) if t_b > t_a else None

    def history(self, now: float) -> tuple[float, ...]:
        """Steps per second over each of the last periods, oldest first (a redone step counts as none)."""
        if self._points:
            step = self._points[-1][1]
            if self._sampled is None:
                self._sampled = (now, step)
            elif now - self._sampled[0] >= self.period:
                since, before = self._sampled
                self._history.append(max(0.0, (step - before) / (now - since)))
                self._sampled = (now, step)
        return tuple(self._history)


def job_snapshot(job: Job, config: LaunchConfig, now: float, *, started_at: float, notes: tuple[str, ...],
                 event_log: str | None, throughput: Throughput, local_rank: Callable[[int], int],
                 nodes: tuple[NodeView, ...] = ()) -> JobSnapshot:
    multinode = bool(nodes)
    ranks = []
    for rank in range(config.world_size):
        slot = job.slot_of_rank(rank)
        ranks.append(RankView(
            rank=rank, local_rank=local_rank(rank), pid=slot.pid, state=slot.state, step=slot.step,
            loss=slot.loss, step_time=slot.step_time,
            heartbeat_age=(now - slot.last_seen) if slot.hello and slot.alive else None,
            restarts=slot.incarnation, metrics=dict(slot.metrics), node=slot.node if multinode else None,
        ))
    samples = None
    rank0 = job.slot_of_rank(0)
    for key in ("samples_per_s", "tokens_per_s"):
        if key in rank0.metrics:
            samples = rank0.metrics[key] * config.world_size
    return JobSnapshot(
        script=config.entrypoint.target, world_size=config.world_size, nnodes=config.nnodes[0],
        generation=job.generation, state=job.state, uptime=now - started_at, ranks=tuple(ranks),
        steps_per_s=throughput.steps_per_s(), rate_history=throughput.history(now), samples_per_s=samples,
        failures=len(job.failures), time_lost=job.time_lost,
        recovery=_recovery_view(job), events=notes, event_log=event_log, nodes=nodes,
    )


def waiting_snapshot(config: LaunchConfig, now: float, *, started_at: float, notes: tuple[str, ...],
                     event_log: str | None, nodes: tuple[NodeView, ...]) -> JobSnapshot:
    """A multi-node job before every node slot is held: no rank exists yet, the nodes say who is missing."""
    return JobSnapshot(
        script=config.entrypoint.target, world_size=config.world_size, nnodes=config.nnodes[0], generation=0,
        state=JobState.STARTING, uptime=now - started_at, ranks=(), events=notes, event_log=event_log, nodes=nodes,
    )


def node_views(table: NodeTable, job: Job | None, nproc: int, now: float) -> tuple[NodeView, ...]:
    """Every node slot in order (its holder, or its last holder while vacant), then the hot-spare nodes."""
    last: dict[int, Node] = {}  # slot -> its most recent holder, lost or not: one pass over every identity
    spares: list[Node] = []
    for node in table.by_identity.values():
        if node.slot is None:
            if node.state is NodeState.SPARE:
                spares.append(node)
        elif node.slot not in last or node.incarnation > last[node.slot].incarnation:
            last[node.slot] = node
    views = []
    for k in range(table.nnodes):
        ranks = tuple(range(k * nproc, (k + 1) * nproc))
        holder, previous = table.holder.get(k), last.get(k)
        if holder is not None:
            state = NodeSlotState.REJOINING if _replacing_all(job, ranks) else NodeSlotState.LIVE
            views.append(_view(holder, k, state, ranks, now))
        elif previous is not None:
            views.append(_view(previous, k, NodeSlotState.LOST, ranks, None))
        else:
            views.append(NodeView(k, NodeSlotState.WAITING, ranks=ranks))
    for spare in sorted(spares, key=lambda n: n.node_rank):
        views.append(_view(spare, None, NodeSlotState.SPARE, (), now))
    return tuple(views)


def _replacing_all(job: Job | None, ranks: tuple[int, ...]) -> bool:
    """Every rank of the slot is a replacement still on its way in: the node as a whole is coming back (a single
    rank replaced on a healthy node leaves the node LIVE)."""
    if job is None or not job.swift_started:
        return False
    return all(rank in job.rank_slot and job.slot_of_rank(rank).replacement for rank in ranks)


def _view(node: Node, slot: int | None, state: NodeSlotState, ranks: tuple[int, ...], now: float | None) -> NodeView:
    host = node.info.get("host")
    return NodeView(
        slot=slot, state=state, node_rank=node.node_rank, host=None if host is None else str(host),
        incarnation=node.incarnation if slot is not None else None, ranks=ranks,
        heartbeat_age=None if now is None else max(0.0, now - node.last_seen),
    )


def _recovery_view(job: Job) -> RecoveryView | None:
    rec = job.recovery or job.last_recovery
    if rec is None:
        return None
    phases = []
    for phase in RecoveryPhase:
        if phase in rec.phase_duration:
            phases.append(PhaseView(phase, rec.phase_duration[phase]))
        elif phase in rec.phase_start and not rec.done:
            phases.append(PhaseView(phase, None))
    return RecoveryView(rec.generation, rec.failed_ranks, rec.cause, tuple(phases), rec.mode, rec.source_rank,
                        rec.done, rec.total, None if rec.done else rec.replay, rec.inexact)
