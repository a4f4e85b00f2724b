"""The recovery point (swiftrun.runtime.dp.consensus.plan_recovery): who wins, who receives, who undoes.

Notation in the examples: ``at(rank, updates)`` is a survivor on a step boundary, ``partial(rank, updates)`` one
that applied update ``updates`` but was stopped before the end of that step, ``new(rank)`` a fresh replacement.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swiftrun.errors import RecoveryError
from swiftrun.runtime.dp.consensus import Plan, RankStatus, buffers_held, plan_recovery

MODES = ("auto", "roll-forward", "undo")


def at(rank: int, updates: int, undoable: bool = True) -> RankStatus:
    return RankStatus(rank, True, updates, boundary=True, undoable=undoable)


def partial(rank: int, updates: int, undoable: bool = True) -> RankStatus:
    return RankStatus(rank, True, updates, boundary=False, undoable=undoable)


def new(rank: int) -> RankStatus:
    return RankStatus(rank, False)


# --- survivors agree --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_equal_survivors_are_replicas_and_only_the_new_ranks_receive_state(mode):
    plan = plan_recovery([at(0, 7), new(1), at(2, 7), new(3)], mode)

    assert plan == Plan(point=7, source=0, targets=(1, 3), undo=(), mode="replica")


@pytest.mark.parametrize("mode", MODES)
def test_the_source_is_the_lowest_surviving_rank_when_rank_zero_is_the_replacement(mode):
    plan = plan_recovery([new(0), at(1, 4), at(2, 4)], mode)

    assert (plan.point, plan.source, plan.targets, plan.mode) == (4, 1, (0,), "replica")


@pytest.mark.parametrize("mode", MODES)
def test_a_failure_before_the_first_update_recovers_the_initial_state(mode):
    plan = plan_recovery([at(0, -1), new(1)], mode)

    assert (plan.point, plan.source, plan.targets, plan.undo) == (-1, 0, (1,), ())


# --- survivors straddle a step boundary -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "roll-forward"])
def test_straddling_survivors_roll_forward_from_the_lowest_rank_that_completed_the_step(mode):
    plan = plan_recovery([at(0, 4), at(1, 5), new(2), at(3, 5), at(4, 4)], mode)

    assert plan == Plan(point=5, source=1, targets=(0, 2, 4), undo=(), mode="roll-forward")


@pytest.mark.parametrize("mode", ["auto", "roll-forward"])
def test_a_partial_survivor_receives_the_state_of_a_rank_on_a_boundary(mode):
    plan = plan_recovery([partial(0, 5), at(1, 4), new(2)], mode)

    assert (plan.point, plan.source, plan.targets, plan.undo, plan.mode) == (4, 1, (0, 2), (), "roll-forward")


def test_undo_mode_goes_back_one_step_and_undoes_the_ranks_ahead():
    plan = plan_recovery([at(0, 4), at(1, 5), new(2), at(3, 5)], "undo")

    assert plan.point == 4 and plan.mode == "undo"
    assert plan.undo == (1, 3)
    # the source is the lowest rank able to stand at step 4; whoever got there differently receives its state
    assert plan.source == 0
    assert plan.targets == (1, 2, 3)


def test_undo_mode_with_rank_zero_ahead_makes_the_undone_state_the_source():
    plan = plan_recovery([at(0, 5), at(1, 4), new(2)], "undo")

    assert (plan.point, plan.source, plan.undo, plan.targets) == (4, 0, (0,), (1, 2))


def test_undo_mode_a_rank_ahead_that_cannot_undo_receives_the_state_instead():
    plan = plan_recovery([at(0, 5, undoable=False), at(1, 4), at(2, 5)], "undo")

    assert plan.point == 4
    assert plan.undo == (2,)
    assert plan.source == 1 and plan.targets == (0, 2)
    assert plan.notes == ("rank 0 cannot undo its update; it receives the state instead",)


def test_undo_mode_fails_when_no_rank_can_reach_the_step_before_the_most_advanced():
    with pytest.raises(RecoveryError, match="no rank can reach step 4"):
        plan_recovery([at(0, 5, undoable=False), partial(1, 4), new(2)], "undo")


# --- every survivor was stopped inside a step -------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_all_partial_and_undoable_survivors_undo_their_update(mode):
    plan = plan_recovery([partial(0, 5), partial(1, 5), new(2)], mode)

    assert plan.point == 4 and plan.mode == "undo"
    assert plan.undo == (0, 1)
    assert plan.source == 0
    assert 2 in plan.targets and 0 not in plan.targets


@pytest.mark.parametrize("mode", MODES)
def test_all_partial_survivors_undo_if_at_least_one_can_and_the_others_receive(mode):
    plan = plan_recovery([partial(0, 5, undoable=False), partial(1, 5), new(2)], mode)

    assert (plan.point, plan.source, plan.undo, plan.targets) == (4, 1, (1,), (0, 2))


@pytest.mark.parametrize("mode", MODES)
def test_all_partial_survivors_that_cannot_undo_are_unrecoverable(mode):
    with pytest.raises(RecoveryError):
        plan_recovery([partial(0, 5, undoable=False), partial(1, 5, undoable=False), new(2)], mode)


@pytest.mark.parametrize("mode", MODES)
def test_no_valid_rank_is_unrecoverable(mode):
    with pytest.raises(RecoveryError, match="no surviving replica"):
        plan_recovery([new(0), new(1), RankStatus(2, False, 5, True, True)], mode)


@pytest.mark.parametrize("mode", MODES)
def test_a_failure_met_outside_a_step_asks_for_verification_at_the_next_step(mode):
    tail = RankStatus(0, True, 5, boundary=True, undoable=False, outside_step=True)
    assert plan_recovery([tail, at(1, 5), new(2)], mode).verify_next
    assert not plan_recovery([at(0, 5), at(1, 5), new(2)], mode).verify_next


# --- wire format ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [new(3), at(0, -1), at(1, 12, undoable=False), partial(7, 0), partial(2, 99),
                                    RankStatus(4, True, 3, True, False, outside_step=True)])
def test_rank_status_pack_unpack_round_trip(status):
    row = status.pack()

    assert all(type(v) is int for v in row)  # it travels in an integer tensor
    assert RankStatus.unpack(row) == status


def test_plan_as_dict_has_plain_lists():
    plan = plan_recovery([at(0, 4), at(1, 5), new(2)], "auto")
    assert plan.as_dict() == {"point": 5, "source": 1, "targets": [0, 2], "undo": [], "mode": "roll-forward"}


# --- properties -------------------------------------------------------------------------------------------------


def lost_buffers(rank: int, updates: int, undoable: bool = True) -> RankStatus:
    """A survivor on the boundary after ``updates`` that copied rank 0's buffers at the start of ``updates`` but
    never received those of ``updates + 1`` (rank 0 died between its update and the next forward's broadcast)."""
    return RankStatus(rank, True, updates, True, undoable, buffers_next=False, buffers_undo=True)


@pytest.mark.parametrize("mode", ["auto", "roll-forward"])
def test_rank_0_lost_with_the_buffers_of_the_next_step_undoes_the_step_whose_buffers_the_survivors_hold(mode):
    plan = plan_recovery([new(0), lost_buffers(1, 7), lost_buffers(2, 7)], mode)
    assert (plan.point, plan.undo, plan.mode, plan.source, plan.targets) == (6, (1, 2), "undo", 1, (0,))
    assert any("buffers for step 8 were lost" in note for note in plan.notes)


def test_buffers_lost_but_no_survivor_can_undo_rolls_forward_with_the_sources_buffers():
    plan = plan_recovery([new(0), lost_buffers(1, 7, undoable=False), lost_buffers(2, 7, undoable=False)], "auto")
    assert (plan.point, plan.undo, plan.mode) == (7, (), "replica")


def test_one_survivor_holding_the_next_steps_buffers_is_enough_to_roll_forward():
    holder = RankStatus(2, True, 6, False, True, buffers_next=False, buffers_undo=True)  # partial: copied step 7's
    plan = plan_recovery([new(0), lost_buffers(1, 6), holder, at(3, 7)], "auto")
    assert plan.point == 7 and not plan.undo


@st.composite
def reports(draw) -> list[RankStatus]:
    """What the ranks of a data-parallel job can report: survivors one step apart at most, some replacements."""
    world = draw(st.integers(1, 8))
    top = draw(st.integers(-1, 50))
    out = []
    for rank in range(world):
        if draw(st.booleans()) and draw(st.booleans()):
            out.append(RankStatus(rank, False, draw(st.integers(-1, top)), draw(st.booleans()), draw(st.booleans())))
        else:
            updates = draw(st.sampled_from([top, top - 1])) if top > -1 else -1
            boundary = draw(st.booleans()) if updates >= 0 else True
            out.append(RankStatus(rank, True, updates, boundary, draw(st.booleans()) and updates >= 0,
                                  buffers_next=draw(st.booleans()), buffers_undo=draw(st.booleans())))
    return out


def final_state(status: RankStatus, plan: Plan) -> tuple[int, bool, bool]:
    """(updates, boundary, undone) of a rank after the plan's undo and before the transfer."""
    if status.rank in plan.undo:
        return status.updates - 1, True, True
    return status.updates, status.boundary, False


@settings(max_examples=300, deadline=None)
@given(statuses=reports(), mode=st.sampled_from(MODES))
def test_property_every_plan_leaves_all_ranks_equal_to_a_valid_source_at_the_point(statuses, mode):
    try:
        plan = plan_recovery(statuses, mode)
    except RecoveryError:
        valid = [s for s in statuses if s.valid]
        if not valid:
            return
        if mode == "undo":  # only "nobody can reach max-1" may fail once a replica survived
            top = max(s.updates for s in valid)
            assert not any(s.updates == top and s.undoable for s in valid)
            assert not any(s.updates == top - 1 and s.boundary for s in valid)
        else:  # roll-forward fails only without a valid rank, or with every one partial and none undoable
            assert not any(s.boundary or s.undoable for s in valid)
        return

    by_rank = {s.rank: s for s in statuses}
    valid_max = max(s.updates for s in statuses if s.valid)
    source = by_rank[plan.source]
    assert source.valid
    assert plan.source not in plan.targets
    assert plan.point <= valid_max
    assert all(not s.valid and s.rank in plan.targets for s in statuses if not s.valid)  # every new rank receives
    assert all(by_rank[r].valid and by_rank[r].undoable for r in plan.undo)
    assert final_state(source, plan)[:2] == (plan.point, True)
    on_boundary = [s.updates for s in statuses if s.valid and s.boundary]
    valid = [s for s in statuses if s.valid]
    if any("buffers for step" in note for note in plan.notes):  # rank 0's buffers for max + 1 died with it
        assert plan.mode == "undo" and not buffers_held(valid, plan.point + 2) and buffers_held(valid, plan.point + 1)
    elif mode != "undo" and on_boundary:
        assert plan.point == max(on_boundary)  # rolling forward never gives up a completed step
    for status in statuses:  # whoever does not receive the state already holds exactly the source's
        if status.rank not in plan.targets:
            assert final_state(status, plan) == final_state(source, plan)
    assert len(set(plan.targets)) == len(plan.targets)


@settings(max_examples=200, deadline=None)
@given(statuses=reports(), mode=st.sampled_from(MODES), data=st.data())
def test_property_every_rank_computes_the_same_plan_whatever_the_order_of_the_reports(statuses, mode, data):
    shuffled = data.draw(st.permutations(statuses))
    try:
        plan = plan_recovery(statuses, mode)
    except RecoveryError:
        with pytest.raises(RecoveryError):
            plan_recovery(shuffled, mode)
        return
    other = plan_recovery(shuffled, mode)

    assert (other.point, other.source, set(other.targets), set(other.undo), other.mode) == (
        plan.point, plan.source, set(plan.targets), set(plan.undo), plan.mode)


@given(st.builds(RankStatus, st.integers(0, 1 << 20), st.booleans(), st.integers(-1, 1 << 30), st.booleans(),
                 st.booleans()))
def test_property_pack_unpack_round_trip(status):
    assert RankStatus.unpack(status.pack()) == status
