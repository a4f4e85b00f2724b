"""The background stage checkpoint exchange's pure parts: flat snapshots (packed, reused buffers, on disk), the
exchange's lifecycle (installed only when whole, complete only after every holder installed), per-thread bypass."""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist

from swiftrun.runtime.comm import collectives

from swiftrun.runtime.pp import ckpt as pp_ckpt
from swiftrun.runtime.pp.ckpt import Exchange, ExchangeState, FlatSnapshots, Packed


def test_a_snapshot_is_out_of_reach_of_later_updates_and_unpacks_to_the_same_tree(tmp_path):
    live = {"w": torch.ones(3), "groups": [{"lr": 0.1, "params": [0]}], "pair": (torch.zeros(2, 2).t(), 5),
            "ordered": OrderedDict(a=torch.arange(3, dtype=torch.int16)), "flag": torch.tensor(True),
            "rng": (3, tuple(range(625)), None)}
    packed, ready = FlatSnapshots().take(live)
    ready()
    live["w"].add_(1)
    live["groups"][0]["lr"] = 0.5
    live["pair"][0].add_(1)
    for got in (packed.unpack(), _through_a_file(packed, tmp_path).unpack()):
        assert torch.equal(got["w"], torch.ones(3)) and got["groups"][0]["lr"] == 0.1
        assert isinstance(got["pair"], tuple) and torch.equal(got["pair"][0], torch.zeros(2, 2))
        assert isinstance(got["ordered"], OrderedDict) and got["ordered"]["a"].dtype == torch.int16
        assert got["flag"].item() is True and got["rng"] == (3, tuple(range(625)), None)
        assert got["w"].data_ptr() != packed.flat.data_ptr()  # copies, never views of the kept buffer


@pytest.mark.parametrize("name", ["a", "ab", "abc", "abcd"])  # skeletons of different lengths: any alignment
def test_a_checkpoint_read_from_a_file_unpacks_whatever_its_skeleton_length(tmp_path, name):
    packed, _ = FlatSnapshots().take({name: torch.arange(5, dtype=torch.float64), "x": torch.ones(3)})
    got = _through_a_file(packed, tmp_path).unpack()
    assert torch.equal(got[name], torch.arange(5, dtype=torch.float64)) and torch.equal(got["x"], torch.ones(3))


def _through_a_file(packed: Packed, tmp_path) -> Packed:
    path = tmp_path / "ckpt"
    with open(path, "wb") as f:
        packed.write(f)
    return Packed.parse(bytearray(path.read_bytes()))


def test_a_truncated_checkpoint_file_is_refused():
    with pytest.raises(ValueError, match="skeleton"):
        Packed.parse(bytearray((1000).to_bytes(8, "little") + b"xx"))


def test_snapshots_reuse_their_flat_buffer_unless_it_is_kept():
    state = {"a": torch.randn(4), "b": torch.randn(2, 2)}
    snaps = FlatSnapshots()
    first, _ = snaps.take(state)
    state["a"].add_(1)
    second, _ = snaps.take(state)
    assert second.flat.data_ptr() == first.flat.data_ptr()  # no new allocation while the layout holds
    assert torch.equal(second.unpack()["a"], state["a"])
    kept = second.unpack()
    third, _ = snaps.take(state, keep=(second.flat,))  # a rank's own copy: never written over
    state["a"].add_(1)
    fourth, _ = snaps.take(state, keep=(third.flat,))
    assert third.flat.data_ptr() != second.flat.data_ptr() and fourth.flat.data_ptr() == second.flat.data_ptr()
    assert torch.equal(third.unpack()["a"], kept["a"]) and torch.equal(fourth.unpack()["a"], state["a"])
    state["b"] = torch.randn(5)  # the layout changed: a buffer of the new size
    assert torch.equal(snaps.take(state)[0].unpack()["b"], state["b"])


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
    snap, ready = FlatSnapshots().take({"step": 4, "w": torch.arange(3)})
    ex.start(4, snap, single_rank_gloo, 0, 0, torch.device("cpu"), ready=ready,
             install=lambda step, received, sent: seen.append((step, received.unpack(), ex.complete_step)))
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
    snap, ready = FlatSnapshots().take({"w": torch.ones(1)})
    ex.start(4, snap, single_rank_gloo, 0, 0, torch.device("cpu"), ready=ready,
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


def test_a_checkpoint_written_before_the_runtime_moved_into_rooms_still_unpacks():
    # --stage-ckpt-dir files name their slot class by module path; the path was swiftrun.runtime.pp_ckpt then
    import pickle

    packed, ready = FlatSnapshots().take({"w": torch.arange(4.0)})
    ready()
    skeleton = packed.skeleton.numpy().tobytes()
    assert b"swiftrun.runtime.pp.ckpt" in skeleton
    old = skeleton.replace(b"swiftrun.runtime.pp.ckpt", b"swiftrun.runtime.pp_ckpt")
    with pytest.raises(ModuleNotFoundError):
        pickle.loads(old)
    got = Packed(torch.frombuffer(bytearray(old), dtype=torch.uint8), packed.flat).unpack()
    assert torch.equal(got["w"], torch.arange(4.0))
