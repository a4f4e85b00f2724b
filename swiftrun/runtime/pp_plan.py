"""The recovery plan of a pipeline-parallel job. A pure function of what every rank reports.

In a pipeline the ranks are not replicas of one another: each runs one or more stages, and only the ranks that run
the *same* stages (data-parallel replicas of a stage, in a DP x PP job) hold the same state. So the plan works per
*stage class* (ranks running the same stage indices):

- every stage must come back to the same step boundary ``point``: the pipeline's stages depend on each other's
  activations and gradients of the same iteration. ``point`` is the lowest boundary any valid rank can stand on;
  a rank one update ahead (it applied the interrupted iteration's update) undoes it, as in data parallelism;
- a class with a surviving valid rank recovers from it (the replica path, no replay);
- a class with no valid rank left is *replayed*: its replacement loads the class's last stage checkpoint (held in
  the memory of the next stage's rank) and re-runs the iterations from that checkpoint up to ``point`` alone, its
  receives served from the neighbours' logs and its sends dropped.

A replay needs the checkpoint's holder and both neighbours alive and valid (they hold the checkpoint and the logs);
when they are not (two adjacent stages lost together, a checkpoint lost with its holder) the plan raises
:class:`~swiftrun.errors.RecoveryError` with the reason, which the launcher turns into a restart of every worker
(with ``--max-restarts``) or a clean stop: never a silently wrong model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swiftrun.errors import RecoveryError


@dataclass(frozen=True)
class StageStatus:
    rank: int
    valid: bool  # False: a replacement, or a rank whose state is being rebuilt
    updates: int  # the last step whose optimizer update this rank's state holds
    boundary: bool  # the rank finished that step's body (False: it applied the update mid-step)
    undoable: bool  # that update can be inverted
    stages: tuple[int, ...]  # the stage indices this rank runs
    pipe: tuple[int, ...]  # global ranks of this rank's pipeline, in stage order of their first stage
    held_for: int = -1  # the rank whose stage checkpoint this rank holds (-1: none)
    held_step: int = -1  # that checkpoint's step: the state at the start of this step
    log_start: int = 0  # the oldest step this rank still holds logged sends for
    outside_step: bool = False


@dataclass(frozen=True)
class Replay:
    rank: int  # the replacement that replays its stages
    holder: int  # the rank that holds its checkpoint
    start: int  # the checkpoint's step: replay runs steps start .. point
    peers: tuple[int, ...]  # the ranks of the adjacent stages: they serve the logged activations and gradients
    stages: tuple[int, ...] = ()  # the stage indices it replays


@dataclass(frozen=True)
class PipePlan:
    point: int
    undo: tuple[int, ...] = ()
    copies: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (source, targets) per stage class with a survivor
    replays: tuple[Replay, ...] = ()
    notes: tuple[str, ...] = field(default=())
    verify_next: bool = False

    @property
    def mode(self) -> str:
        return "replay" if self.replays else ("undo" if self.undo else "replica")

    def as_dict(self) -> dict:
        return {"point": self.point, "mode": self.mode, "undo": list(self.undo),
                "copies": [[s, list(t)] for s, t in self.copies],
                "replays": [{"rank": r.rank, "from": r.start, "to": self.point, "holder": r.holder}
                            for r in self.replays],
                "source": self.copies[0][0] if self.copies else None,
                "targets": sorted({t for _, ts in self.copies for t in ts} | {r.rank for r in self.replays})}


def plan_pipeline(statuses: list[StageStatus]) -> PipePlan:
    valid = [s for s in statuses if s.valid]
    if not valid:
        raise RecoveryError("no rank of the pipeline holds a consistent state")
    # the boundary each valid rank can stand on without replaying: its own, or one below through an undo
    point = min(s.updates if s.boundary else s.updates - 1 for s in valid)
    undo: list[int] = []
    for s in valid:
        if s.updates == point and s.boundary:
            continue
        if s.updates in (point, point + 1) and s.undoable:
            undo.append(s.rank)
            continue
        raise RecoveryError(
            f"rank {s.rank} (stages {list(s.stages)}) is past step {point} and cannot undo its update: the "
            "pipeline cannot be brought back to one iteration in place")
    by_rank = {s.rank: s for s in statuses}
    classes: dict[tuple[int, ...], list[StageStatus]] = {}
    for s in statuses:
        classes.setdefault(s.stages, []).append(s)
    copies: list[tuple[int, tuple[int, ...]]] = []
    replays: list[Replay] = []
    for stages in sorted(classes):
        members = classes[stages]
        alive = [s for s in members if s.valid]
        lost = tuple(s.rank for s in members if not s.valid)
        if alive:
            if lost:
                copies.append((min(s.rank for s in alive), lost))
            continue
        if len(members) > 1:
            raise RecoveryError(
                f"every replica of stage(s) {list(stages)} was lost together: replaying several replicas of a "
                "stage is not supported")
        replays.append(_replay_of(members[0], by_rank, point))
    return PipePlan(point, tuple(undo), tuple(copies), tuple(replays),
                    verify_next=any(s.outside_step for s in statuses))


def _replay_of(lost: StageStatus, by_rank: dict[int, StageStatus], point: int) -> Replay:
    label = f"stage(s) {list(lost.stages)} (rank {lost.rank})"
    holders = [s for s in by_rank.values() if s.held_for == lost.rank and s.valid]
    if not holders:
        raise RecoveryError(f"{label} has no surviving replica and its stage checkpoint was lost with the rank "
                            "that held it (two stages lost together)")
    holder = max(holders, key=lambda s: s.held_step)
    if holder.held_step > point + 1:
        raise RecoveryError(f"the checkpoint of {label} is at step {holder.held_step}, past the recovery point "
                            f"{point}")
    stage_rank = {stage: rank for rank in lost.pipe if rank in by_rank for stage in by_rank[rank].stages}
    peers = sorted({stage_rank[n] for stage in lost.stages for n in (stage - 1, stage + 1)
                    if n in stage_rank and stage_rank[n] != lost.rank})
    for rank in peers:
        peer = by_rank[rank]
        if not peer.valid:
            raise RecoveryError(f"{label} and an adjacent stage (rank {rank}) were lost together: the logs that "
                                "would replay it were lost too")
        if holder.held_step <= point and peer.log_start > holder.held_step:
            raise RecoveryError(f"rank {rank} no longer holds the logs of step {holder.held_step} that replaying "
                                f"{label} needs")
    return Replay(lost.rank, holder.rank, holder.held_step, tuple(peers), lost.stages)
