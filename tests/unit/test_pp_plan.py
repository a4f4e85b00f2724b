"""The pipeline recovery plan (runtime/pp/plan.py): a pure function of what the ranks report."""

from __future__ import annotations

import pytest

from swiftrun.errors import RecoveryError
from swiftrun.runtime.pp.plan import DISK, StageStatus, plan_pipeline

PIPE = (0, 1, 2, 3)


def status(rank, valid=True, updates=5, boundary=True, undoable=False, stages=None, pipe=PIPE, held_for=None,
           held_step=4, log_start=0, own_step=-1, disk_step=-1):
    stages = (rank % len(pipe),) if stages is None else stages
    if held_for is None:  # the next rank of the ring holds this one's predecessor's checkpoint
        held_for = pipe[(pipe.index(rank) - 1) % len(pipe)]
    return StageStatus(rank, valid, updates, boundary, undoable, stages, pipe, held_for, held_step, log_start,
                       own_step=own_step, disk_step=disk_step)


def test_a_lost_middle_stage_is_replayed_from_the_next_stage_checkpoint():
    plan = plan_pipeline([status(0), status(1), status(2, valid=False, updates=-1), status(3)])
    assert plan.point == 5 and plan.mode == "replay" and not plan.undo and not plan.copies
    (replay,) = plan.replays
    assert (replay.ranks, replay.sources, replay.start, replay.peers, replay.stages) == ((2,), ((2, 3),), 4, (1, 3),
                                                                                        (2,))


def test_the_last_stage_checkpoint_is_held_by_the_first():
    plan = plan_pipeline([status(0), status(1), status(2), status(3, valid=False, updates=-1)])
    (replay,) = plan.replays
    assert (replay.source_of(3), replay.peers) == (0, (2,))


def test_a_stage_one_update_ahead_undoes_it():
    statuses = [status(0, updates=6, undoable=True), status(1, updates=6, boundary=False, undoable=True),
                status(2), status(3, valid=False, updates=-1)]
    plan = plan_pipeline(statuses)
    assert plan.point == 5 and plan.undo == (0, 1)


def test_a_stage_ahead_that_cannot_undo_is_refused():
    with pytest.raises(RecoveryError, match="cannot undo"):
        plan_pipeline([status(0, updates=6), status(1), status(2), status(3, valid=False, updates=-1)])


def test_adjacent_stages_lost_together_replay_together_from_disk_or_are_refused():
    with pytest.raises(RecoveryError, match="lost together"):
        plan_pipeline([status(0), status(1, valid=False), status(2, valid=False), status(3)])
    plan = plan_pipeline([status(0), status(1, valid=False, disk_step=4), status(2, valid=False), status(3)])
    (replay,) = plan.replays
    assert replay.ranks == (1, 2) and replay.sources == ((1, DISK), (2, 3)) and replay.peers == (0, 3)


def test_a_logging_group_replays_whole_its_survivors_from_their_own_copy():
    groups = ((0,), (1, 2), (3,))
    statuses = [status(0), status(1, own_step=4), status(2, valid=False, own_step=4), status(3)]
    (replay,) = plan_pipeline(statuses, groups).replays
    assert replay.ranks == (1, 2) and replay.sources == ((1, 1), (2, 3)) and replay.peers == (0, 3)
    assert replay.stages == (1, 2)


def test_a_group_member_without_its_own_copy_or_checkpoints_of_different_steps_are_refused():
    groups = ((0, 1), (2, 3))
    with pytest.raises(RecoveryError, match="keeps no checkpoint"):
        plan_pipeline([status(0), status(1, valid=False), status(2), status(3)], groups)
    with pytest.raises(RecoveryError, match="different steps"):
        plan_pipeline([status(0, own_step=0), status(1, valid=False), status(2), status(3)], groups)


def test_logging_nothing_replays_the_whole_pipeline_in_place():
    groups = ((0, 1, 2, 3),)
    statuses = [status(r, own_step=4, valid=r != 2) for r in range(4)]
    (replay,) = plan_pipeline(statuses, groups).replays
    assert replay.ranks == PIPE and replay.peers == () and replay.source_of(2) == 3


def test_a_checkpoint_past_the_point_or_logs_already_dropped_are_refused():
    with pytest.raises(RecoveryError, match="past the recovery point"):
        plan_pipeline([status(0), status(1), status(2, valid=False), status(3, held_step=8)])
    with pytest.raises(RecoveryError, match="no longer holds the logs"):
        plan_pipeline([status(0), status(1, log_start=5), status(2, valid=False), status(3)])


def test_a_checkpoint_at_the_point_needs_no_replay_steps():
    plan = plan_pipeline([status(0), status(1), status(2, valid=False), status(3, held_step=6)])
    assert plan.replays[0].start == 6 and plan.point == 5


def test_a_stage_with_a_surviving_replica_copies_it():
    # 2 stages x 2 replicas: pipelines (0, 1) and (2, 3); rank 3 (stage 1) lost, rank 1 is its replica
    pipes = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    statuses = [status(r, stages=(r % 2,), pipe=pipes[r], valid=r != 3) for r in range(4)]
    plan = plan_pipeline(statuses)
    assert plan.copies == ((1, (3,)),) and not plan.replays and plan.mode == "replica"


DP2_PIPES = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}  # 2 stages x 2 replicas: rank r is stage r % 2


def dp2(lost, **per_rank):
    """The statuses of a 2 x 2 DP x PP job with ``lost`` replaced; ``per_rank``: {"r3": {field: value}}."""
    from dataclasses import replace

    rows = []
    for r in range(4):
        row = status(r, stages=(r % 2,), pipe=DP2_PIPES[r], valid=r not in lost,
                     updates=-1 if r in lost else 5)
        rows.append(replace(row, **per_rank.get(f"r{r}", {})))
    return rows


@pytest.mark.parametrize("stage", [0, 1])
def test_every_replica_of_a_stage_lost_replays_in_lockstep_each_in_its_own_pipeline(stage):
    """Both replicas of a stage lost together: one replay set per replica, each served by its own pipeline's
    neighbour (which also holds its checkpoint), the two in lockstep (one start step; the stage's DDP all-reduce
    runs live between them)."""
    lost = (stage, stage + 2)
    plan = plan_pipeline(dp2(lost))
    assert plan.mode == "replay" and not plan.copies and plan.point == 5
    first, second = plan.replays
    other = 1 - stage
    assert (first.ranks, first.peers, first.source_of(stage), first.stages) == ((stage,), (other,), other, (stage,))
    assert (second.ranks, second.peers, second.source_of(stage + 2)) == ((stage + 2,), (other + 2,), other + 2)
    assert first.start == second.start == 4 and first.together == second.together == lost
    assert plan.as_dict()["targets"] == list(lost)


def test_replicas_replay_from_the_newest_checkpoint_step_both_have():
    """A checkpoint exchange cut short by the failure: rank 1 installed rank 0's checkpoint of step 8, rank 3 only
    holds rank 2's of step 4 (and rank 1 still keeps its step 4 copy): both replicas replay from step 4."""
    plan = plan_pipeline(dp2((0, 2), r1={"held_step": 8, "held_prev_step": 4, "updates": 9}, r3={"updates": 9}))
    assert [(r.ranks, r.start) for r in plan.replays] == [((0,), 4), ((2,), 4)]
    with pytest.raises(RecoveryError, match="different steps"):  # no step in common: refused
        plan_pipeline(dp2((0, 2), r1={"held_step": 8, "updates": 9}, r3={"updates": 9}))


def test_every_replica_lost_and_one_checkpoint_missing_is_refused():
    """Rank 3 holds no checkpoint of rank 2 (and there is no --stage-ckpt-dir): that replica cannot replay, and
    replaying only the other one is not exact. Refused, with the reason."""
    with pytest.raises(RecoveryError, match="stage checkpoint of rank 2 was lost"):
        plan_pipeline(dp2((0, 2), r3={"held_for": -1, "held_step": -1}))
    # from --stage-ckpt-dir the same loss is recovered
    plan = plan_pipeline(dp2((0, 2), r3={"held_for": -1, "held_step": -1}, r2={"disk_step": 4}))
    assert [(r.ranks, r.source_of(r.ranks[0]), r.start) for r in plan.replays] == [((0,), 1, 4), ((2,), DISK, 4)]


def test_every_replica_of_a_stage_lost_with_a_replica_of_the_adjacent_stage_is_refused():
    """Ranks 0, 2 (stage 0) and 1 (stage 1 of replica 0) lost: rank 0's replay needs the gradients rank 1 logged,
    lost with it, so rank 1 would replay too; but its replica rank 3 survives and cannot run the stage's all-reduce
    of steps it already took. Refused (a restart of every worker with --max-restarts), never a wrong model."""
    with pytest.raises(RecoveryError, match=r"rank 1 \(stage\(s\) \[1\]\) must replay with rank\(s\) 0 .*"
                                            r"replica\(s\) 3 survive"):
        plan_pipeline(dp2((0, 1, 2), r0={"disk_step": 4}, r1={"disk_step": 4}))
    with pytest.raises(RecoveryError, match="no rank of the pipeline"):  # everything lost
        plan_pipeline(dp2((0, 1, 2, 3)))


def test_logging_groups_of_a_dp_x_pp_job_roll_back_every_replica_together():
    """Logging group (0, 1) in each replica. Ranks 0 and 2 lost: ranks 1 and 3 roll back with them, every replica
    of both stages replaying in lockstep. Only rank 0 lost: the replica path, nobody rolls back. Ranks 0, 2 and 3
    lost: ranks 2 and 3 replay from --stage-ckpt-dir (each held the other's checkpoint) and rank 3 takes no copy
    of rank 1, which rolls back; without the disk copies, refused."""
    groups = ((0, 1),)
    own = {"own_step": 4}
    plan = plan_pipeline(dp2((0, 2), r1=own, r3=own), groups)
    assert [(r.ranks, r.start, r.together) for r in plan.replays] == [((0, 1), 4, (0, 1, 2, 3)),
                                                                       ((2, 3), 4, (0, 1, 2, 3))]
    plan = plan_pipeline(dp2((0,), r1=own, r3=own), groups)
    assert plan.copies == ((2, (0,)),) and not plan.replays
    disk = {"disk_step": 4}
    plan = plan_pipeline(dp2((0, 2, 3), r1=own, r2=disk, r3=disk), groups)
    assert not plan.copies and [(r.ranks, r.sources) for r in plan.replays] == [((0, 1), ((0, 1), (1, 1))),
                                                                                ((2, 3), ((2, DISK), (3, DISK)))]
    with pytest.raises(RecoveryError, match="stage checkpoint of rank 2 was lost with the rank that held it"):
        plan_pipeline(dp2((0, 2, 3), r1=own), groups)


def test_interleaved_stages_replay_with_both_ring_neighbours():
    # 2 ranks, 4 virtual stages: rank 0 runs 0 and 2, rank 1 runs 1 and 3
    statuses = [status(0, stages=(0, 2), pipe=(0, 1), held_for=1), status(1, stages=(1, 3), pipe=(0, 1),
                                                                         valid=False, held_for=0)]
    (replay,) = plan_pipeline(statuses).replays
    assert replay.peers == (0,) and replay.source_of(1) == 0 and replay.stages == (1, 3)


def test_nobody_valid_is_refused():
    with pytest.raises(RecoveryError):
        plan_pipeline([status(0, valid=False), status(1, valid=False)])


def test_pipeline_shape_problems_are_named():
    from swiftrun.runtime.pp.pipeline import pipeline_problem

    good = [{"rank": r, "stages": (r,), "num_stages": 4, "microbatches": 4} for r in range(4)]
    assert pipeline_problem(good) is None
    bad_mb = [dict(r, microbatches=8 if r["rank"] == 2 else 4) for r in good]
    assert "different micro-batch counts" in pipeline_problem(bad_mb) and "rank 2: 8" in pipeline_problem(bad_mb)
    doubled = [dict(r, stages=(1,) if r["rank"] == 2 else r["stages"]) for r in good]
    assert "stage 1 is run by ranks [1, 2]" in pipeline_problem(doubled)
    assert "different numbers of stages" in pipeline_problem([dict(good[0], num_stages=3)] + good[1:])


def test_an_interrupted_checkpoint_exchange_falls_back_to_the_step_every_member_has():
    """Logging group [2, 3]; the background exchange of step 8 was cut short by rank 2's death: rank 3 had
    installed rank 2's checkpoint of step 8 but not yet its own copy of it. Both still have step 4: the set
    replays from there."""
    from dataclasses import replace

    groups = ((0, 1), (2, 3))
    statuses = [status(0, updates=9), status(1, updates=9, own_step=8, held_step=8),
                replace(status(2, valid=False, updates=-1), own_step=-1),
                replace(status(3, updates=9, own_step=4), held_step=8, held_prev_step=4)]
    (replay,) = plan_pipeline(statuses, groups).replays
    assert replay.ranks == (2, 3) and replay.start == 4 and replay.sources == ((2, 3), (3, 3))
    # once rank 3's own copy of step 8 arrived too, the newer step wins
    statuses[3] = replace(statuses[3], own_step=8, own_prev_step=4)
    (replay,) = plan_pipeline(statuses, groups).replays
    assert replay.start == 8


def test_a_lone_replay_takes_the_holders_newest_checkpoint_and_refuses_disjoint_steps():
    from dataclasses import replace

    plan = plan_pipeline([status(0), status(1), status(2, valid=False, updates=-1),
                          replace(status(3), held_step=4, held_prev_step=0)])
    assert plan.replays[0].start == 4 and plan.replays[0].source_of(2) == 3
    groups = ((0, 1), (2, 3))
    with pytest.raises(RecoveryError, match="different steps"):
        plan_pipeline([status(0), status(1), status(2, valid=False),
                       replace(status(3, own_step=8, held_step=4), own_prev_step=6)], groups)


def test_a_stage_lost_before_the_first_checkpoint_starts_from_its_initial_state():
    """A rank lost after start-up but before the first step's checkpoint exchange (found by the fault campaign):
    nothing was trained, so its replacement keeps the state the script built; no replay, no refusal."""
    fresh = [status(r, updates=-1, held_for=-1, held_step=-1) for r in PIPE]
    plan = plan_pipeline([*fresh[:2], status(2, valid=False, updates=-1, held_for=-1, held_step=-1), fresh[3]])
    assert (plan.point, plan.replays, plan.copies, plan.undo) == (-1, (), (), ())
    assert "rank(s) 2 start from the script's initial state" in plan.notes[0]
    # once a checkpoint of step 0 exists (killed during step 0), it is installed as usual
    held = [status(r, updates=-1, held_step=0) for r in PIPE]
    plan = plan_pipeline([*held[:2], status(2, valid=False, updates=-1), held[3]])
    assert [(r.ranks, r.start) for r in plan.replays] == [((2,), 0)]
    # and a stage lost after training began still needs its checkpoint
    with pytest.raises(RecoveryError, match="lost with the rank that held it"):
        plan_pipeline([status(0), status(1), status(2, valid=False, held_for=-1), status(3, held_for=-1)])
