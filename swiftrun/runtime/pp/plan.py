"""The recovery plan of a pipeline-parallel job. A pure function of what every rank reports.

In a pipeline the ranks are not replicas of one another: each runs one or more stages, and only the ranks that run
the *same* stages (data-parallel replicas of a stage, in a DP x PP job) hold the same state. So the plan works per
*stage class* (ranks running the same stage indices):

- every stage must come back to the same step boundary ``point``: the pipeline's stages depend on each other's
  activations and gradients of the same iteration. ``point`` is the lowest boundary any valid rank can stand on;
  a rank one update ahead (it applied the interrupted iteration's update) undoes it, as in data parallelism;
- a class with a surviving valid rank recovers from it (the replica path, no replay);
- a class with no valid rank left is *replayed*: its replacement loads the class's last stage checkpoint (held in
  the memory of the next rank of the pipeline, or on disk) and re-runs the iterations from that checkpoint up to
  ``point``, its receives from outside the replay served from the neighbours' logs and its sends there dropped.

What replays together is a *replay set*: the lost rank's logging group (selective logging leaves the boundaries
inside a group unlogged, so a group's surviving members roll back to their own checkpoint copy and replay with
it, talking live among themselves). Sets grow when a rank whose logs they need is itself lost (two adjacent
stages lost together: both replay, from their checkpoints).

When every data-parallel replica of a stage is lost together (a DP x PP job), each replica's rank replays in its
own pipeline replica (a set per pipeline: its neighbours there serve its logs), and the sets that share a stage
class replay in *lockstep*: the same steps from the same checkpoint step, the stage's gradient all-reduce running
live between them (``Replay.together``). That is exact only if *every* replica of each replayed stage replays:
a set that would replay one replica while another survives (a replica lost with the neighbour whose logs it
needs, or rolled back by its logging group) is refused, since the survivor cannot run the all-reduce of steps it
already took. Every member must find a checkpoint of the same step
(its own copy, the copy its holder keeps, or the stage checkpoint directory; the newest step every member has,
since a checkpoint exchange interrupted by the failure leaves some with the new step and some with only the
previous one); when none exists the plan raises
:class:`~swiftrun.errors.RecoveryError` with the reason, which the launcher turns into a restart of every worker
(with ``--max-restarts``) or a clean stop: never a silently wrong model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swiftrun.errors import RecoveryError


DISK = -2  # a checkpoint source: the stage checkpoint directory (--stage-ckpt-dir)


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
    own_step: int = -1  # the step of this rank's own checkpoint copy (kept when its logging group has peers)
    disk_step: int = -1  # the newest complete checkpoint of this rank in the stage checkpoint directory
    # while a background checkpoint exchange is incomplete (runtime/pp/ckpt.py) the previous copies are kept too:
    # a replay set whose members' new checkpoints did not all arrive falls back to the previous step
    held_prev_step: int = -1
    own_prev_step: int = -1


@dataclass(frozen=True)
class Replay:
    ranks: tuple[int, ...]  # the ranks that replay together (talking live to each other)
    start: int  # the checkpoint's step: the replay runs steps start .. point
    sources: tuple[tuple[int, int], ...]  # (member, where its checkpoint comes from: a rank, itself, or DISK)
    peers: tuple[int, ...]  # ranks outside the set next to it: they serve the logged activations and gradients
    stages: tuple[int, ...]  # every stage index the set runs
    # the ranks of every set replaying in lockstep with this one (the replicas of its stages, in their own
    # pipelines: the stage's data-parallel all-reduce runs live between them); just ``ranks`` otherwise
    together: tuple[int, ...] = ()

    def source_of(self, rank: int) -> int:
        return dict(self.sources)[rank]

    @property
    def cohort(self) -> tuple[int, ...]:
        """Every rank replaying in step with this set: its lockstep component, or just its own ranks."""
        return self.together or self.ranks

    @property
    def lockstep(self) -> bool:
        """Replicas of its stages replay with it in their own pipelines (their DDP all-reduce runs live)."""
        return set(self.cohort) != set(self.ranks)


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

    def replay_of(self, rank: int) -> Replay | None:
        return next((r for r in self.replays if rank in r.ranks), None)

    def as_dict(self) -> dict:
        return {"point": self.point, "mode": self.mode, "undo": list(self.undo),
                "copies": [[s, list(t)] for s, t in self.copies],
                "replays": [{"ranks": list(r.ranks), "from": r.start, "to": self.point, "together": list(r.together)}
                            for r in self.replays],
                "notes": list(self.notes), "source": self.copies[0][0] if self.copies else None,
                "targets": sorted({t for _, ts in self.copies for t in ts} | {m for r in self.replays
                                                                             for m in r.ranks})}


def plan_pipeline(statuses: list[StageStatus], groups: tuple[tuple[int, ...], ...] | None = None) -> PipePlan:
    """``groups``: the logging groups, as tuples of pipeline positions (None: every position its own group)."""
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
    lost: list[int] = []
    for stages in sorted(classes):
        members = classes[stages]
        alive = [s for s in members if s.valid]
        gone = tuple(s.rank for s in members if not s.valid)
        if alive:
            if gone:
                copies.append((min(s.rank for s in alive), gone))
            continue
        lost.extend(s.rank for s in members)  # every replica: they replay in lockstep (see the docstring)
    notes: list[str] = []
    fresh: list[int] = []
    if point < 0:
        # nothing was trained: a replacement's own state is the stage's initial state (the script built it with
        # the same seed), and before the first step's checkpoint exchange nobody holds a copy to replay from
        fresh = [r for r in lost if not _has_checkpoint(r, by_rank)]
        lost = [r for r in lost if r not in fresh]
        if fresh:
            notes.append(f"rank(s) {', '.join(map(str, fresh))} start from the script's initial state: no step "
                         "was trained")
    sets = _replay_sets(lost, by_rank, groups)
    _check_replicas(sets, classes, set(fresh))
    replays = tuple(r for component in _lockstep(sets, by_rank) for r in _replays(component, by_rank, point))
    # a lost replica that replays with its whole stage class (a logging group rolled its survivors back) needs no
    # copy of a survivor's state: the replay rebuilds it
    replaying = {m for r in replays for m in r.ranks}
    copies = [(source, targets) for source, targets in copies if not set(targets) & replaying]
    return PipePlan(point, tuple(undo), tuple(copies), replays, tuple(notes),
                    verify_next=any(s.outside_step for s in statuses))


def _has_checkpoint(rank: int, by_rank: dict[int, StageStatus]) -> bool:
    return by_rank[rank].disk_step >= 0 or any(s.held_for == rank and s.valid and s.held_step >= 0
                                               for s in by_rank.values())


def _group_of(rank: int, by_rank: dict[int, StageStatus], groups: tuple[tuple[int, ...], ...] | None) -> set[int]:
    pipe = by_rank[rank].pipe
    position = pipe.index(rank)
    for group in groups or ():
        if position in group:
            return {pipe[p] for p in group if p < len(pipe)}
    return {rank}


def _peers(members: set[int], by_rank: dict[int, StageStatus]) -> set[int]:
    """The ranks outside ``members`` that run a stage adjacent to one of theirs (they exchanged tensors)."""
    pipe = by_rank[next(iter(members))].pipe
    stage_rank = {stage: r for r in pipe if r in by_rank for stage in by_rank[r].stages}
    return {stage_rank[n] for m in members for stage in by_rank[m].stages for n in (stage - 1, stage + 1)
            if n in stage_rank and stage_rank[n] not in members}


def _replay_sets(lost: list[int], by_rank: dict[int, StageStatus],
                 groups: tuple[tuple[int, ...], ...] | None) -> list[set[int]]:
    """Each lost rank's logging group; sets merged while one needs logs from a rank that is itself lost."""
    sets = [_group_of(r, by_rank, groups) for r in lost]
    merged = True
    while merged:
        merged = False
        for i, members in enumerate(sets):
            needs = {p for p in _peers(members, by_rank) if not by_rank[p].valid
                     or any(p in other for j, other in enumerate(sets) if j != i)}
            if not needs:
                continue
            for p in needs:
                members |= _group_of(p, by_rank, groups)
            others = [o for j, o in enumerate(sets) if j != i and not (o & members)]
            touching = [o for j, o in enumerate(sets) if j != i and (o & members)]
            for o in touching:
                members |= o
            sets = [members] + others
            merged = True
            break
    return sorted(sets, key=min)


def _check_replicas(sets: list[set[int]], classes: dict[tuple[int, ...], list[StageStatus]],
                    fresh: set[int]) -> None:
    """Refuse a replay of some but not all replicas of a stage: its data-parallel all-reduce would need a
    surviving replica to run again steps it already took. (A fresh rank, nothing trained, replays no step.)"""
    replaying = set().union(*sets) if sets else set()
    for members in sets:
        for m in sorted(members):
            stages = next(k for k, ranks in classes.items() if any(s.rank == m for s in ranks))
            outside = [s.rank for s in classes[stages] if s.rank not in replaying and s.rank not in fresh]
            if outside:
                why = ("it rolls back with its logging group" if any(s.rank == m and s.valid for s in classes[stages])
                       else "the logs it needs were lost with it")
                raise RecoveryError(
                    f"rank {m} (stage(s) {list(stages)}) must replay with rank(s) "
                    f"{', '.join(map(str, sorted(members - {m}))) or 'none'} ({why}), but its data-parallel "
                    f"replica(s) {', '.join(map(str, outside))} survive: a stage's gradient all-reduce can only be "
                    "replayed by all its replicas together")


def _lockstep(sets: list[set[int]], by_rank: dict[int, StageStatus]) -> list[list[set[int]]]:
    """The replay sets grouped into components that share a stage class (replicas of one stage, each in its own
    pipeline): a component replays in lockstep. Alone in its component, a set replays as it always did."""
    components: list[list[set[int]]] = []
    for members in sets:
        classes = {by_rank[m].stages for m in members}
        joined = [c for c in components if any(by_rank[m].stages in classes for other in c for m in other)]
        merged = [members] + [s for c in joined for s in c]
        components = [c for c in components if not any(c is j for j in joined)] + [merged]
    return sorted((sorted(c, key=min) for c in components), key=lambda c: min(c[0]))


def _replays(component: list[set[int]], by_rank: dict[int, StageStatus], point: int) -> list[Replay]:
    """The component's replays, all from one checkpoint step: the newest every member has, not past the point."""
    everyone = sorted(set().union(*component))
    label = "rank(s) " + ", ".join(map(str, everyone))
    options = {m: _checkpoints(m, by_rank, label) for m in everyone}  # member -> step -> source
    common = set.intersection(*(set(o) for o in options.values()))
    if not common:
        raise RecoveryError(f"{label} must replay together, but their checkpoints are of different steps "
                            f"({', '.join(f'rank {r}: {sorted(o)}' for r, o in options.items())})")
    usable = [step for step in common if step <= point + 1]
    if not usable:
        raise RecoveryError(f"the checkpoint of {label} is at step {min(common)}, past the recovery point {point}")
    start = max(usable)  # the newest: the shortest replay
    replays = []
    for members in component:
        name = "rank(s) " + ", ".join(map(str, sorted(members)))
        sources = [(m, options[m][start]) for m in sorted(members)]
        peers = _peers(members, by_rank)
        for rank in sorted(peers):
            if start <= point and by_rank[rank].log_start > start:
                raise RecoveryError(f"rank {rank} no longer holds the logs of step {start} that replaying {name} "
                                    "needs")
        stages = tuple(sorted(stage for m in members for stage in by_rank[m].stages))
        replays.append(Replay(tuple(sorted(members)), start, tuple(sources), tuple(sorted(peers)), stages,
                              together=tuple(everyone)))
    return replays


def _checkpoints(m: int, by_rank: dict[int, StageStatus], label: str) -> dict[int, int]:
    """The steps of member ``m``'s checkpoints a replay can start from, each with its source (a rank, or DISK)."""
    status = by_rank[m]
    if status.valid:  # a surviving group member rolls back to its own copy
        found = {step: m for step in (status.own_step, status.own_prev_step) if step >= 0}
        if not found:
            raise RecoveryError(f"rank {m} must roll back with {label} but keeps no checkpoint of its own")
        return found
    found = {status.disk_step: DISK} if status.disk_step >= 0 else {}
    holders = sorted((s for s in by_rank.values() if s.held_for == m and s.valid), key=lambda s: -s.rank)
    for holder in holders:  # a copy in memory beats the disk; the lowest rank among several holders
        for step in (holder.held_step, holder.held_prev_step):
            if step >= 0:
                found[step] = holder.rank
    if not found:
        raise RecoveryError(
            f"{label} must replay, but the stage checkpoint of rank {m} was lost with the rank that held it "
            "(adjacent stages lost together) and no --stage-ckpt-dir copy exists")
    return found
