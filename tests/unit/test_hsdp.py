"""Sharded layouts (FSDP2): which ranks are replicas, what is refused, and the recovery plan over replica sets.

The meshes are real (``init_device_mesh`` and ``fully_shard`` on torch's fake process group, one process playing
one rank of four); the plan is a pure function of the ranks' statuses.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from swiftrun.errors import RecoveryError
from swiftrun.runtime.comm import fsdp
from swiftrun.runtime.dp.consensus import RankStatus
from swiftrun.runtime.hsdp.consensus import plan_sharded
from swiftrun.runtime.state import layout
from swiftrun.runtime.state.dtensor import is_dtensor, local, local_tree
from swiftrun.runtime.state.registry import Registry

WORLD = 4


@pytest.fixture
def fake_world():
    """torch's fake process group: rank 1 of a world of four, no peers needed."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=WORLD)
    yield
    dist.destroy_process_group()


def sharded(shape: tuple[int, ...], names: tuple[str, ...]) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 1))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def test_hsdp_ranks_with_the_same_shard_are_replicas_and_the_job_is_recoverable(fake_world):
    model = sharded((2, 2), ("replicate", "shard"))
    assert layout.replica_sets([model], WORLD) == [(0, 2), (1, 3)]
    reg = Registry.build(model, [torch.optim.AdamW(model.parameters())], [], None, None)
    assert layout.is_sharded(reg)
    assert layout.unrecoverable(reg) is None


def test_1d_fsdp_is_refused_naming_the_mesh_dimension_and_hsdp(fake_world):
    model = sharded((WORLD,), ("dp",))
    assert layout.replica_sets([model], WORLD) == [(0,), (1,), (2,), (3,)]
    reason = layout.unrecoverable(Registry.build(model, [], [], None, None))
    assert reason is not None
    assert "FSDP2 (fully_shard)" in reason and "'dp' (4)" in reason and "HSDP" in reason
    assert "init_device_mesh" in reason and "--max-restarts" in reason


def test_sharding_inside_a_pipeline_is_refused(fake_world):
    reg = Registry.build(sharded((2, 2), ("replicate", "shard")), [], [], None, None)
    reason = layout.unrecoverable(reg, sharding_recovered=False)
    assert reason is not None and "pipeline" in reason


def test_without_dtensors_every_rank_is_a_replica():
    assert layout.replica_sets([nn.Linear(2, 2)], WORLD) == [(0, 1, 2, 3)]


def test_the_fsdp_internals_the_rebind_needs_exist_in_this_torch(fake_world):
    """The canary: fails loudly on a torch that renamed what runtime/comm/fsdp.py rebinds."""
    model = sharded((2, 2), ("replicate", "shard"))
    assert fsdp.missing_internals([model]) == []
    assert len(fsdp.roots([model])) == 1 and len(fsdp.fsdp_modules([model])) == 2
    assert fsdp.rebind([model]) >= 2


def test_a_missing_internal_is_named(fake_world, monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    model = sharded((2, 2), ("replicate", "shard"))
    monkeypatch.delattr(FSDPModule, "reset_iter_state")
    assert fsdp.missing_internals([model]) == ["FSDPModule.reset_iter_state"]


def test_a_dtensor_is_seen_by_its_local_shard(fake_world):
    model = sharded((2, 2), ("replicate", "shard"))
    weight = model[0].weight
    assert is_dtensor(weight) and not is_dtensor(local(weight))
    assert local(weight).shape == (4, 4)  # 9 rows over 2 shards: rank 1 (shard 1) holds rows 5..8
    tree = local_tree({"w": weight, "n": [weight, 3]})
    assert tree["w"] is local(weight) and tree["n"][0] is local(weight) and tree["n"][1] == 3


# ---------------------------------------------------------------------- the plan over replica sets

SETS = [(0, 2), (1, 3)]


def status(rank: int, updates: int, *, valid: bool = True, boundary: bool = True, undoable: bool = False):
    return RankStatus(rank, valid, updates, boundary, undoable)


def test_a_lost_rank_receives_from_the_replica_of_its_shard():
    plan = plan_sharded([status(0, 3), status(1, -1, valid=False), status(2, 3), status(3, 3)], SETS)
    assert plan.point == 3 and plan.copies == ((3, (1,)),) and plan.undo == ()
    assert plan.sources == (0, 3)


def test_ranks_through_an_update_another_shard_never_reached_undo_it():
    # ranks 0 and 2 (shard 0) finished step 4; rank 3 (shard 1's only survivor) stayed before its update
    statuses = [status(0, 4, undoable=True), status(1, -1, valid=False), status(2, 4, undoable=True),
                status(3, 3)]
    plan = plan_sharded(statuses, SETS)
    assert plan.point == 3 and plan.undo == (0, 2)
    assert plan.copies == ((3, (1,)),)


def test_roll_forward_when_every_shard_has_a_rank_past_the_update():
    statuses = [status(0, 4), status(1, -1, valid=False), status(2, 3), status(3, 4)]
    plan = plan_sharded(statuses, SETS)
    assert plan.point == 4 and plan.copies == ((0, (2,)), (3, (1,)))


def test_a_shard_with_no_consistent_replica_is_refused():
    statuses = [status(0, 3), status(1, -1, valid=False), status(2, 3), status(3, -1, valid=False)]
    with pytest.raises(RecoveryError, match="ranks 1,3"):
        plan_sharded(statuses, SETS)


def test_shards_that_cannot_meet_at_one_step_are_refused():
    # shard 0 is past step 4's update with no way back; shard 1 stayed before it
    statuses = [status(0, 4), status(1, -1, valid=False), status(2, 4), status(3, 3)]
    with pytest.raises(RecoveryError, match="cannot come back to one step"):
        plan_sharded(statuses, SETS)


def test_a_rank_partway_through_its_step_receives_the_finished_state():
    statuses = [status(0, 4, boundary=False), status(1, 3), status(2, 3), status(3, 3)]
    plan = plan_sharded(statuses, SETS)
    assert plan.point == 3 and plan.copies == ((2, (0,)),)


def test_where_ranks_draw_their_own_streams_the_point_is_one_every_receiver_can_redo_from():
    # a ring all-reduce let ranks 0 and 1 through to step 13's update; rank 3 stayed inside it (its streams as of
    # step 14 exist nowhere: it never reached the backup before its update); rank 2 is a replacement whose
    # launcher backups reach step 13's start
    statuses = [status(0, 13, undoable=True), status(1, 13, undoable=True), status(2, -1, valid=False),
                status(3, 12)]
    assert plan_sharded(statuses, SETS).point == 13
    streams = {0: {13, 14}, 1: {13, 14}, 2: {12, 13}, 3: {12, 13}}
    plan = plan_sharded(statuses, SETS, streams)
    assert plan.point == 12 and plan.undo == (0, 1)
    # rank 3 stands on step 12 without an undo: the source of its set, whose undone rank 1 takes its state (equal
    # bits even where an undo inverted arithmetically)
    assert plan.copies == ((0, (2,)), (3, (1,)))
    # nobody can reach a step every receiver has streams for: the newest step, which says so
    assert plan_sharded(statuses, SETS, {0: set(), 1: set(), 2: set(), 3: set()}).point == 13


def test_hsdp_with_tensor_parallelism_inside_keeps_the_tp_coordinate_in_the_shard():
    """torchtitan's 3-D layout: TP over the innermost dimension, FSDP over (replicate, shard): rank r*4 + s*2 + t
    holds a copy of rank r'*4 + s*2 + t only (placements (Replicate, _StridedShard, Shard))."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["replicate", "shard"])
        assert layout.replica_sets([model], 8) == [(0, 4), (1, 5), (2, 6), (3, 7)]
        assert layout.unrecoverable(Registry.build(model, [], [], None, None)) is None
    finally:
        dist.destroy_process_group()
