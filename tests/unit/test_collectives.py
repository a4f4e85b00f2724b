"""A collective skipped after a recovery leaves this rank's own values where everyone's would have been."""

from __future__ import annotations

import pytest
import torch

from swiftrun.runtime.comm import collectives

pytestmark = pytest.mark.timeout(30)


def test_a_skipped_all_gather_fills_every_slot_with_the_local_value():
    local = torch.tensor([1.0, 2.0])
    slots = [torch.zeros(2) for _ in range(3)]
    collectives._skip("all_gather", (slots, local), {}, "test")
    assert all(torch.equal(s, local) for s in slots)

    objects = [None, None]
    collectives._skip("all_gather_object", (objects, {"acc": 0.5}), {}, "test")
    assert objects == [{"acc": 0.5}, {"acc": 0.5}]

    out = torch.zeros(3, 2)
    collectives._skip("all_gather_into_tensor", (), {"output_tensor": out, "input_tensor": local}, "test")
    assert torch.equal(out, local.repeat(3, 1))


def test_a_skipped_all_reduce_keeps_the_local_value_and_an_async_handle_is_complete():
    value = torch.tensor([3.0])
    assert collectives._skip("all_reduce", (value,), {}, "test") is None
    assert torch.equal(value, torch.tensor([3.0]))
    work = collectives._skip("barrier", (), {"async_op": True}, "test")
    assert work.wait() and work.is_completed() and work.get_future().wait() is None


def test_the_call_site_named_is_the_callers_line():
    assert collectives._call_site().startswith("test_collectives.py:")
