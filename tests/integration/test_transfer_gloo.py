"""broadcast_tree and compare_across_ranks over a real gloo group of 3 processes (tests/scripts/transfer_worker.py)."""

from __future__ import annotations

import pytest

from tests import helpers
from tests.helpers import SCRIPTS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def run_world(tmp_path, marker, scenario, world=3, **env):
    # exit 17: the rank that dies on purpose in the src-dies scenario
    return helpers.run_world(SCRIPTS / "transfer_worker.py", tmp_path, marker, scenario, world, deadline=90.0,
                             expected_codes=(0, 17), **env)


def test_bitwise_delivery_in_place_and_digests(tmp_path, marker):
    procs, outs = run_world(tmp_path, marker, "deliver")
    for out in outs:
        assert out is not None and "error" not in out, out
        assert out["deliver_bad"] == [] and out["unaligned_bad"] == [] and out["default_bad"] == []
        assert out["default_chunk"] == [16 << 20, 1]
        assert out["chunks"] > 50 and out["chunk_indices_ok"]
        assert out["metadata"]
        assert out["agree"] == []
        assert out["mismatches"] == [["models.0.lin.bias", [2], [0, 1]],
                                     ["optimizers.0.param_groups.0.lr", [2], [0, 1]]]
        assert "optimizers.0.param_groups.0.lr differs on rank 2" in out["mismatch_text"]
    replacement, source, survivor = outs
    assert replacement["in_place"] and replacement["provided"] == 7
    assert survivor["in_place"] and survivor["provided"] == 7 + 9
    assert survivor["allocated"] == ["extra.rng"]  # a byte tensor of 5056 elements: streamed
    assert sorted(replacement["allocated"]) == sorted(["extra.rng"] + [
        f"optimizers.0.state.{i}.{k}" for i in range(3) for k in ("exp_avg", "exp_avg_sq")])  # step is inline
    assert outs[1]["subgroup_bad"] == [] and outs[2]["subgroup_bad"] == [] and "subgroup_bad" not in outs[0]
    assert all(p.returncode == 0 for p in procs)


def test_bad_destination_raises_on_every_rank(tmp_path, marker):
    procs, outs = run_world(tmp_path, marker, "refuse")
    for out in outs:
        assert out is not None and "error" not in out, out
        assert "rank 2: destination for models.0.emb.weight: shape (49, 8) but the source sends (50, 8)" in out["raised"]
        assert out["group_usable"]
    assert all(p.returncode == 0 for p in procs)


def test_source_dying_mid_transfer_fails_the_receivers(tmp_path, marker):
    procs, outs = run_world(tmp_path, marker, "src-dies", TRANSFER_TEST_PG_TIMEOUT="30")
    assert procs[0].returncode == 17 and outs[0] is None
    for out in outs[1:]:
        assert out is not None and "error" not in out, out
        assert out["raised"], out
        assert out["seconds"] < 25, out  # failed on the closed connection, not the group timeout
