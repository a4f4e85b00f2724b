"""The recovery point of a sharded job (HSDP): one step for every shard, each shard's state from its replicas.

In HSDP the ranks are replicas of one another only within a *replica set* (the ranks holding the same shards,
runtime/state/layout.py ``replica_sets``): rank (r, s) and rank (r', s) of another replica group. So the plan is
made per set, under one constraint across sets: every shard must come back to the same step boundary ``point``,
since the next step's collectives (FSDP's all-gathers and reduce-scatters, the gradient-norm all-reduce of
clipping) join every shard of that step.

A rank can stand on a step ``u`` it finished (``boundary``), or on ``u - 1`` by undoing its last update (exact: a
pre-step copy, runtime/core/precopy.py). A set can reach the steps one of its valid ranks can. ``point`` is the
newest step every set can reach: where a ring all-reduce let some ranks of one shard through to their update
while the replicas of another shard stayed before it, the ranks that went through undo (even a step they
finished: the strategy keeps its copy), because the other shard has no state after that update anywhere.
In each set the lowest rank that stands on ``point`` without an undo is the source (else one that undid), and
every member not in the same situation (invalid, behind, ahead without an undo, or undone when the source was
not) receives its state, so the replicas end bitwise equal. A set with no rank able to reach ``point`` raises
:class:`~swiftrun.errors.RecoveryError` naming it: the launcher restarts every worker or stops, never a silently
wrong shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swiftrun.errors import RecoveryError
from swiftrun.runtime.dp.consensus import RankStatus


@dataclass(frozen=True)
class ShardPlan:
    point: int  # every shard's state is "after step point"; training resumes at point + 1
    copies: tuple[tuple[int, tuple[int, ...]], ...]  # (source, targets) of each replica set that needs a copy
    undo: tuple[int, ...] = ()  # ranks that undo their last update first
    sources: tuple[int, ...] = ()  # the source of each replica set, in set order (the digests' reference)
    notes: tuple[str, ...] = field(default=())
    verify_next: bool = False

    @property
    def mode(self) -> str:
        return "undo" if self.undo else "replica"

    @property
    def source(self) -> int:
        return self.sources[0] if self.sources else 0

    def as_dict(self) -> dict:
        return {"point": self.point, "source": self.source, "sources": list(self.sources),
                "targets": sorted(t for _, targets in self.copies for t in targets), "undo": list(self.undo),
                "mode": self.mode}


def _reach(s: RankStatus) -> set[int]:
    """The steps this rank's state can stand on: the one it finished, and the one before through an undo."""
    if not s.valid:
        return set()
    out = {s.updates} if s.boundary else set()
    if s.undoable:
        out.add(s.updates - 1)
    return out


def plan_sharded(statuses: list[RankStatus], sets: list[tuple[int, ...]],
                 streams: dict[int, set[int]] | None = None) -> ShardPlan:
    """``streams``: where the ranks draw from random streams of their own, the steps as of whose start each rank
    holds its own streams (its snapshots, its launcher backups). A rank that receives its replica's state at
    ``point`` redoes step ``point + 1`` with its own streams of that step, so the newest step every set can
    reach *and* every receiver has its streams for is chosen; where there is none, the newest reachable step
    (the recovery then says that a rank continues with its source's streams)."""
    by_rank = {s.rank: s for s in statuses}
    reachable: list[set[int]] = []
    for members in sets:
        steps: set[int] = set()
        for r in members:
            steps |= _reach(by_rank[r])
        if not steps:
            raise RecoveryError(
                f"no rank holding the shards of ranks {_ranks(members)} survived with a consistent state (each is "
                "new, was being overwritten, or stopped inside an update it cannot undo): those shards exist "
                "nowhere else")
        reachable.append(steps)
    common = set.intersection(*reachable)
    if not common:
        spans = "; ".join(f"ranks {_ranks(m)}: step(s) {sorted(r)}" for m, r in zip(sets, reachable))
        raise RecoveryError(f"the shards cannot come back to one step ({spans})")
    plans = [_plan_at(point, statuses, sets, by_rank) for point in sorted(common, reverse=True)]
    if streams is not None:
        for plan in plans:
            if all(plan.point + 1 in streams.get(t, set()) for _, targets in plan.copies for t in targets):
                return plan
    return plans[0]


def _plan_at(point: int, statuses: list[RankStatus], sets: list[tuple[int, ...]],
             by_rank: dict[int, RankStatus]) -> ShardPlan:
    undo = tuple(sorted(s.rank for s in statuses if s.valid and s.undoable and s.updates == point + 1))
    copies, sources = [], []
    for members in sets:
        on_point = [r for r in members if by_rank[r].valid and by_rank[r].boundary and by_rank[r].updates == point]
        undone = [r for r in members if r in undo]
        source = min(on_point) if on_point else min(undone)
        same = set(on_point) if on_point else set(undone)
        sources.append(source)
        targets = tuple(r for r in members if r not in same)
        if targets:
            copies.append((source, targets))
    notes = tuple(f"rank {s.rank} is ahead of step {point} and cannot undo its update; it receives the state instead"
                  for s in statuses if s.valid and s.updates > point and s.rank not in undo)
    return ShardPlan(point, tuple(copies), undo, tuple(sources), notes,
                     verify_next=any(s.outside_step for s in statuses))


def _ranks(members: tuple[int, ...]) -> str:
    return ",".join(str(r) for r in members)
