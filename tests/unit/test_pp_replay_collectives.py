"""The script's collectives inside a replayed step (runtime/pp/pipeline.py ``Pipeline.collective``): which run live
among the replaying ranks, which are served from a neighbour's log, which are refused. One process, a world of
one for the groups; the pipeline's other state is stubbed (a pure routing rule)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from swiftrun.errors import RecoveryError
from swiftrun.runtime.pp.pipeline import Pipeline


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def replaying(together: set[int], server: int | None, logged: dict) -> Pipeline:
    """A pipeline replaying step 4 in a job of 4 ranks, as runtime/pp/handover.py leaves it."""
    pp = Pipeline.__new__(Pipeline)
    pp.view = SimpleNamespace(step=4, world_size=4)
    pp._coll_seq = 0
    pp.coll = {}
    pp.replay = {"together": together, "server": server, "coll": logged}
    return pp


def test_a_collective_among_replaying_ranks_runs_live(world_of_one):
    """The stage's data-parallel group when every replica replays in lockstep (here the group of rank 0 alone)."""
    calls = []
    pp = replaying({0, 2}, server=1, logged={})
    t = torch.ones(1)
    pp.collective("all_reduce", lambda *a, **k: calls.append(a), (t, dist.ReduceOp.SUM, dist.new_group([0])), {})
    assert len(calls) == 1 and pp._coll_seq == 1


def test_a_pipeline_wide_collective_is_served_from_the_neighbours_log(world_of_one):
    pp = replaying({0, 2}, server=1, logged={(4, 0): [torch.tensor([7.0])]})
    t = torch.ones(1)
    pp.collective("all_reduce", lambda *a, **k: pytest.fail("ran live"), (t,), {})  # the default group: 4 ranks
    assert t.item() == 7.0


def test_a_collective_the_serving_neighbour_did_not_take_part_in_is_refused(world_of_one):
    """Another stage's data-parallel group, say: a log would hold a different collective's value."""
    pp = replaying({2}, server=1, logged={(4, 0): [torch.tensor([7.0])]})
    with pytest.raises(RecoveryError, match=r"group of ranks \[0\]"):
        pp.collective("all_reduce", lambda *a, **k: None, (torch.ones(1),), {"group": dist.new_group([0])})
    alone = replaying({2}, server=None, logged={})
    with pytest.raises(RecoveryError, match="no neighbour serving"):
        alone.collective("all_reduce", lambda *a, **k: None, (torch.ones(1),), {})
