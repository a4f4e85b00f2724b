"""Waits the abort always ends, over a real gloo group of 3 processes (tests/scripts/abortable_worker.py)."""

from __future__ import annotations

import pytest

from tests import helpers
from tests.helpers import SCRIPTS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]


def run_world(tmp_path, marker, scenario: str, world: int = 3) -> list[dict | None]:
    procs, outs = helpers.run_world(SCRIPTS / "abortable_worker.py", tmp_path, marker, scenario, world, deadline=100.0)
    assert [p.returncode for p in procs] == [0] * world
    return outs


def test_the_abortable_ddp_all_reduce_is_bitwise_ddps_own_at_world_3(tmp_path, marker):
    for out in run_world(tmp_path, marker, "exact"):
        assert out is not None and out["hooked"], out
        assert out["equal"] == [True] * 5 and out["buffers"], out


def test_a_ddp_backward_blocked_inside_gloo_ends_with_the_abort_and_its_group_is_kept(tmp_path, marker):
    outs = run_world(tmp_path, marker, "deaf")
    for out in outs[:2]:
        assert out is not None, outs
        assert "aborted by a swiftrun recovery" in out["error"], out
        assert out["blocked"] and out["kept"] == 1, out
        assert out["dropped"], out  # dropping the DDP module and the group did not join the blocked gloo thread


def test_an_async_collective_of_the_script_is_a_work_whose_wait_the_abort_ends(tmp_path, marker):
    outs = run_world(tmp_path, marker, "async")
    for out in outs:  # the one every rank joined: gloo's sum, through a dist.Work of ours
        assert out is not None and out["is_work"] and out["waited"] and out["success"], outs
        assert out["result"] == [6.0] * 4, out
    for out in outs[:2]:  # the one rank 2 never joined: only the abort ended its wait
        assert "aborted by a swiftrun recovery" in out["error"], out
        assert out["blocked"] and out["kept"] == 1 and out["dropped"], out
