"""The recovery barrier on its own: who a generation waits for, filled once, emptied one answer at a time."""

from __future__ import annotations

import pytest

from swiftrun.launcher.barrier import Member, RecoveryBarrier

pytestmark = pytest.mark.timeout(30)


def test_outside_a_recovery_nothing_is_owed() -> None:
    barrier = RecoveryBarrier()
    assert barrier.ready and barrier.done and barrier.survivors_ready and barrier.replacements_ready
    assert barrier.owing(recover_sent=False) == set() == barrier.owing(recover_sent=True)


def test_a_generation_waits_for_survivors_and_replacements_separately_then_for_every_recovery() -> None:
    barrier = RecoveryBarrier.of(3, [Member(0, False), Member(1, True), Member(2, False)])
    assert (barrier.unready_survivors, barrier.unready_replacements, barrier.unrecovered) == ({0, 2}, {1}, {0, 1, 2})
    barrier.answered(0)
    barrier.answered(2)
    assert barrier.survivors_ready and not barrier.replacements_ready and not barrier.ready
    assert barrier.owing(recover_sent=False) == {1}
    barrier.answered(1)
    assert barrier.ready and not barrier.done
    assert barrier.owing(recover_sent=True) == {0, 1, 2}
    for rank in (2, 0):
        barrier.recovered(rank)
    assert barrier.owing(recover_sent=True) == {1} and not barrier.done
    barrier.recovered(1)
    assert barrier.done


def test_answers_given_before_the_fill_count_and_repeats_are_harmless() -> None:
    """A generation that begins during a recovery keeps what ranks already answered for it (a survivor that said
    ABORTED for this generation before a second failure was handled), and a repeated answer changes nothing."""
    barrier = RecoveryBarrier.of(5, [Member(0, False, ready=True), Member(1, True), Member(2, False, ready=True,
                                                                                         recovered=True)])
    assert barrier.unready_survivors == set() and barrier.unready_replacements == {1}
    assert barrier.unrecovered == {0, 1}
    barrier.answered(1)
    barrier.answered(1)
    barrier.recovered(7)  # a rank the barrier does not wait for
    assert barrier.ready and barrier.unrecovered == {0, 1}


def test_owing_returns_a_copy() -> None:
    barrier = RecoveryBarrier.of(1, [Member(0, False)])
    barrier.owing(recover_sent=True).clear()
    barrier.owing(recover_sent=False).clear()
    assert barrier.unrecovered == {0} and barrier.unready_survivors == {0}
