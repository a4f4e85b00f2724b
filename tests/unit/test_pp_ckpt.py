"""The background stage checkpoint exchange's pure parts: snapshots, reused host buffers, the exchange's
lifecycle (installed only when whole, complete only after every holder installed), per-thread bypass."""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist

from swiftrun.runtime import collectives, pp_ckpt
from swiftrun.runtime.pp_ckpt import Exchange, ExchangeState, HostCopies, snapshot
from swiftrun.runtime.pp_handover import from_bytes


def clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def test_a_snapshot_is_out_of_reach_of_later_updates_and_keeps_its_containers():
    live = {"w": torch.ones(3), "groups": [{"lr": 0.1, "params": [0]}], "pair": (torch.zeros(2), 5),
            "ordered": OrderedDict(a=torch.arange(2))}
    snap = snapshot(live, clone)
    live["w"].add_(1)
    live["groups"][0]["lr"] = 0.5
    live["pair"][0].add_(1)
    assert torch.equal(snap["w"], torch.ones(3)) and snap["groups"][0]["lr"] == 0.1
    assert isinstance(snap["pair"], tuple) and torch.equal(snap["pair"][0], torch.zeros(2))
    assert isinstance(snap["ordered"], OrderedDict)


def test_host_copies_reuse_their_buffers_while_the_layout_holds():
    copies = HostCopies(clone)
    state = {"a": torch.randn(4), "b": torch.randn(2, 2)}
    first = snapshot(state, copies.begin())
    pointers = [first["a"].data_ptr(), first["b"].data_ptr()]
    state["a"].add_(1)
    second = snapshot(state, copies.begin())
    assert [second["a"].data_ptr(), second["b"].data_ptr()] == pointers  # no new allocation
    assert torch.equal(second["a"], state["a"]) and second["a"].data_ptr() != state["a"].data_ptr()
    state["b"] = torch.randn(3)  # the layout changed: a fresh buffer for that slot
    third = snapshot(state, copies.begin())
    assert third["b"].shape == (3,) and torch.equal(third["b"], state["b"])


@pytest.fixture
def single_rank_gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_an_exchange_installs_the_received_checkpoint_whole_then_completes(single_rank_gloo, monkeypatch):
    seen: list[tuple] = []
    monkeypatch.setattr(pp_ckpt, "swap", lambda data, to, frm, device, group: data.clone())  # a ring of one
    ex = Exchange()
    ex.start(4, {"step": 4, "w": torch.arange(3)}, single_rank_gloo, 0, 0, torch.device("cpu"), ready=lambda: None,
             install=lambda step, received, sent: seen.append((step, from_bytes(received), ex.complete_step)))
    assert ex.wait(30)
    assert ex.state is ExchangeState.COMPLETE and ex.complete_step == 4, ex.error
    (step, got, complete_when_installed), = seen
    assert step == 4 and torch.equal(got["w"], torch.arange(3))
    assert complete_when_installed == -1  # installed first, declared complete only after the all-reduce


@pytest.mark.timeout(60)
def test_a_failed_exchange_installs_nothing_and_keeps_the_previous_completion(single_rank_gloo, monkeypatch):
    def broken(*_a, **_k):
        raise RuntimeError("Connection reset by peer")

    monkeypatch.setattr(pp_ckpt, "swap", broken)
    ex = Exchange()
    ex.complete_step = 0
    installed: list[int] = []
    ex.start(4, {"w": torch.ones(1)}, single_rank_gloo, 0, 0, torch.device("cpu"), ready=lambda: None,
             install=lambda step, *_: installed.append(step))
    assert ex.wait(30)
    assert ex.state is ExchangeState.FAILED and "reset" in str(ex.error)
    assert installed == [] and ex.complete_step == 0


def test_internal_bypasses_only_the_calling_thread():
    seen: dict[str, bool] = {}
    inside = threading.Event()
    release = threading.Event()

    def background() -> None:
        with collectives.internal():
            seen["background"] = collectives.bypassed()
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=background)
    thread.start()
    assert inside.wait(10)
    seen["main"] = collectives.bypassed()
    release.set()
    thread.join(10)
    assert seen == {"background": True, "main": False}
