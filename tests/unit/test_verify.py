"""Which buffers a verification compares when DDP's broadcast buffers are left out."""

from __future__ import annotations

import torch
from torch import nn

from swiftrun.runtime.state.registry import Registry
from swiftrun.runtime.state.verify import registered_digests, synchronised_buffers


def model_with_both_norms() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.SyncBatchNorm(4))


def test_a_sync_batchnorms_statistics_are_compared_where_other_buffers_are_each_ranks_own():
    model = model_with_both_norms()
    assert synchronised_buffers(model) == {"3.running_mean", "3.running_var", "3.num_batches_tracked"}
    reg = Registry.build(model, [], [], None, None)
    before = registered_digests(reg, per_rank={0})
    with torch.no_grad():
        model[1].running_mean.add_(1.0)  # each rank's own batch updates a plain BatchNorm: differs by design
    assert registered_digests(reg, per_rank={0}) == before
    with torch.no_grad():
        model[3].running_mean.add_(1.0)  # every rank computes a SyncBatchNorm's alike: a difference is an error
    assert registered_digests(reg, per_rank={0}) != before


def test_a_sync_batchnorm_over_a_subgroup_is_left_out():
    model = model_with_both_norms()
    model[3].process_group = object()  # synchronised within a subgroup only: ranks of two subgroups differ
    assert synchronised_buffers(model) == set()
