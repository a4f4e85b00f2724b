"""The bucket layout DDP's first rebuild makes, predicted from the gradient order the runtime records."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from swiftrun.runtime.comm import ddp as ddp_tools

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _mlp(hidden: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(hidden, 1))


@pytest.mark.parametrize(("hidden", "cap_mb"), [(512, None), (64, 0.01), (32, 25.0)])
def test_predicted_layout_is_the_one_ddp_rebuilds(world_of_one, hidden, cap_mb):
    kwargs = {} if cap_mb is None else {"bucket_cap_mb": cap_mb}
    ddp = DistributedDataParallel(_mlp(hidden, 4), **kwargs)
    order = ddp_tools.ReadyOrder(ddp)
    ddp(torch.randn(4, hidden)).sum().backward()
    assert order.order is not None and sorted(order.order) == list(range(9 + 1))
    predicted = ddp_tools.predicted_layout(ddp, order.order)
    for _ in range(2):  # DDP rebuilds at the second forward and reports it from the third on
        assert ddp_tools.rebuilt_layout(ddp) is None
        ddp(torch.randn(4, hidden)).sum().backward()
    assert ddp_tools.rebuilt_layout(ddp) == predicted
    if cap_mb is None:  # the default caps: one initial bucket, two rebuilt ones (first bucket capped at 1 MiB)
        assert len(predicted) == 2
    order.close()
    assert not order.active


def test_order_restarts_with_each_backward_and_needs_a_complete_one(world_of_one):
    ddp = DistributedDataParallel(_mlp(8, 2))
    order = ddp_tools.ReadyOrder(ddp)
    assert ddp_tools.next_layout(ddp, order, 0) is None  # nothing recorded: the initial layout
    out = ddp(torch.randn(2, 8)).sum()
    out.backward(retain_graph=True)
    out.backward()  # the second backward starts a new order instead of extending the first
    assert order.order == [5, 4, 3, 2, 1, 0]
    assert ddp_tools.next_layout(ddp, order, -1) is None  # redoing step 0: the initial layout, as failure-free
    assert ddp_tools.next_layout(ddp, order, 0) == ddp_tools.predicted_layout(ddp, order.order)
    order.close()


def test_static_graph_rebuilds_one_iteration_later_as_predicted(world_of_one):
    ddp = DistributedDataParallel(_mlp(64, 4), bucket_cap_mb=0.01, static_graph=True)
    order = ddp_tools.ReadyOrder(ddp)
    ddp(torch.randn(2, 64)).sum().backward()
    assert ddp_tools.next_layout(ddp, order, 0) is None  # step 1 still runs the initial layout
    predicted = ddp_tools.next_layout(ddp, order, 1)
    assert predicted is not None and len(predicted) > 1
    for _ in range(3):  # rebuilt at the third forward, reported from the fourth
        assert ddp_tools.rebuilt_layout(ddp) is None
        ddp(torch.randn(2, 64)).sum().backward()
    assert ddp_tools.rebuilt_layout(ddp) == predicted
    order.close()


def test_find_unused_parameters_never_rebuilds(world_of_one):
    ddp = DistributedDataParallel(_mlp(64, 4), bucket_cap_mb=0.01, find_unused_parameters=True)
    assert not ddp_tools.rebuilds(ddp)
    for _ in range(4):
        ddp(torch.randn(2, 64)).sum().backward()
    assert ddp_tools.rebuilt_layout(ddp) is None  # its initial layout is the exact one throughout
