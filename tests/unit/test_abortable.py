"""PendingOps: the waits an ABORT ends whatever gloo does (runtime/comm/abortable.py), with plain torch futures."""

from __future__ import annotations

import sys

import pytest
import torch

from swiftrun.runtime.comm import abortable
from swiftrun.runtime.comm.abortable import PendingOps

pytestmark = pytest.mark.timeout(30)


def test_a_watched_wait_completes_with_its_source():
    pending, source = PendingOps(), torch.futures.Future()
    ours = pending.watch(source)
    assert pending.waiting() == 1 and pending.blocked(0)
    source.set_result([torch.ones(2)])
    assert torch.equal(ours.wait()[0], torch.ones(2))
    assert pending.waiting() == 0 and not pending.blocked(0)


def test_a_source_failure_is_passed_on():
    pending, source = PendingOps(), torch.futures.Future()
    ours = pending.watch(source)
    source.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed"):
        ours.wait()


def test_an_abort_fails_the_older_generations_waits_at_once_and_only_those():
    pending, old_source, new_source = PendingOps(), torch.futures.Future(), torch.futures.Future()
    old = pending.watch(old_source)  # generation 0
    pending.open(1)
    new = pending.watch(new_source)
    assert pending.abort(1) == 1  # generation 1 begins: generation 0's wait ends, generation 1's does not
    with pytest.raises(RuntimeError, match=r"aborted by a swiftrun recovery \(generation 1 began\)"):
        old.wait()
    assert not new.done() and pending.waiting() == 1
    assert pending.blocked(0)  # gloo has not finished generation 0's operation: its group must be kept
    old_source.set_result(None)  # gloo finishes late: nothing is completed twice
    assert not pending.blocked(0)
    new_source.set_result(7)
    assert new.wait() == 7


def test_a_wait_begun_on_an_aborted_generation_fails_at_once():
    pending = PendingOps()
    pending.abort(1)
    with pytest.raises(RuntimeError, match="aborted"):
        pending.watch(torch.futures.Future()).wait()
    pending.open(1)
    source = torch.futures.Future()
    ours = pending.watch(source)
    source.set_result(3)
    assert ours.wait() == 3


def test_only_operations_still_inside_gloo_are_remembered():
    pending, done, stuck, late = PendingOps(), torch.futures.Future(), torch.futures.Future(), torch.futures.Future()
    for step in range(1000):  # a run without failures: what completes is forgotten at once
        source = torch.futures.Future()
        pending.watch(source, first=True)
        source.set_result([step])
    assert pending._sources == {} and pending.waiting() == 0
    pending.watch(done)
    pending.watch(stuck)
    pending.watch(late)
    done.set_result(None)
    pending.abort(1)
    pending.open(1)
    assert pending._sources == {0: {stuck, late}}  # what may still block a gloo thread
    late.set_result(None)  # completes after its wait was failed by the abort: forgotten too
    assert pending._sources == {0: {stuck}} and pending.blocked(0) and not pending.blocked(1)


def test_kept_objects_get_exactly_one_reference_that_is_never_released():
    class Group:
        pass

    group = Group()
    before = sys.getrefcount(group)
    assert abortable.keep_forever([group, group]) == 1
    assert abortable.keep_forever([group]) == 0
    assert sys.getrefcount(group) == before + 1
    abortable._kept.discard(id(group))  # this test's object only: let the process-wide set forget it
