"""Hand-written P2P pipelines (runtime/pp/p2p.py): message keys, adjacency, and the tap in one process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from swiftrun.errors import RecoveryError
from swiftrun.runtime.comm import collectives
from swiftrun.runtime.pp import p2p
from swiftrun.runtime.state.registry import RegistrationError

pytestmark = pytest.mark.timeout(30)


def test_messages_are_numbered_per_pair_of_stages_and_tag_within_a_step():
    seq = p2p.Sequencer()
    assert seq.key(3, 1, 2, 0) == (3, "p2p", 1, 2, 0, 0)
    assert seq.key(3, 1, 2, 0) == (3, "p2p", 1, 2, 0, 1)
    assert seq.key(3, 1, 0, 0) == (3, "p2p", 1, 0, 0, 0)  # the other direction counts on its own
    assert seq.key(3, 1, 2, 7) == (3, "p2p", 1, 2, 7, 0)  # so does another tag
    seq.reset()  # a step starts, or an interrupted one is redone
    assert seq.key(3, 1, 2, 0) == (3, "p2p", 1, 2, 0, 0)


def test_only_adjacent_stages_exchange_tensors():
    pipe = (4, 5, 6, 7)  # a pipeline's global ranks in stage order
    assert p2p.adjacent_stage(pipe, 1, 6, "sends to") == 2
    assert p2p.adjacent_stage(pipe, 1, 4, "receives from") == 0
    with pytest.raises(RegistrationError, match="stage 1 sends to stage 3 .rank 7.: only adjacent"):
        p2p.adjacent_stage(pipe, 1, 7, "sends to")
    with pytest.raises(RegistrationError, match="not in its pipeline"):
        p2p.adjacent_stage(pipe, 1, 0, "receives from")


@pytest.fixture
def tap():
    """A one-rank gloo world whose tap believes it is stage 0 of (0, 1): nothing it tests reaches the network."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    logged: dict = {}
    pipeline = SimpleNamespace(view=SimpleNamespace(in_step=True, step=5), replay=None, logged=None, compute=0.0,
                               record=lambda key, tensor: logged.__setitem__(key, tensor.clone()))
    try:
        t = p2p.P2PTap(pipeline, p2p.Stage(index=0, num_stages=1))  # type: ignore[arg-type]
        t.pipe = (0, 1)
        yield t, pipeline, logged
    finally:
        p2p.uninstall()
        dist.destroy_process_group()


def test_public_and_c10d_names_are_the_same_patched_function_so_p2pop_accepts_it(tap):
    assert dist.isend is dist.distributed_c10d.isend and getattr(dist.isend, "_swiftrun_wrapped", False)
    assert dist.recv is dist.distributed_c10d.recv and getattr(dist.recv, "_swiftrun_wrapped", False)
    dist.P2POp(dist.isend, torch.zeros(2), 0)  # no "Invalid op"


def test_a_replay_drops_sends_and_serves_receives_from_the_log(tap):
    t, pipeline, logged = tap
    pipeline.replay = {"live": set(), "log": {(5, "p2p", 1, 0, 0, 0): torch.tensor([1.0, 2.0]),
                                              (5, "p2p", 1, 0, 0, 1): torch.tensor([3.0, 4.0])}}
    t.begin_step()
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.tensor([9.0, 9.0]), 1)])
    assert all(w.is_completed() for w in works)
    assert dist.send(torch.tensor([8.0, 8.0]), dst=1) is None
    first, second = torch.zeros(2), torch.zeros(2)
    dist.irecv(first, src=1).wait()
    assert dist.recv(second, 1) == 1
    assert first.tolist() == [1.0, 2.0] and second.tolist() == [3.0, 4.0]
    assert not logged  # nothing is logged during a replay
    with pytest.raises(RecoveryError, match="message 2 .tag 0. of step 5 from stage 1 is not in the neighbours"):
        dist.recv(torch.zeros(2), src=1)


def test_bad_traffic_fails_loudly(tap):
    t, pipeline, _ = tap
    with pytest.raises(RegistrationError, match="only adjacent"):
        dist.isend(torch.zeros(1), dst=0)  # stage 0 to itself
    with pytest.raises(RegistrationError, match="any source"):
        dist.irecv(torch.zeros(1))
    pipeline.replay = {"live": set(), "log": {(5, "p2p", 1, 0, 0, 0): torch.zeros(3)}}
    t.begin_step()
    with pytest.raises(RecoveryError, match="logged as .3,. torch.float32"):
        dist.recv(torch.zeros(2), src=1)


def test_swiftrun_s_own_traffic_is_never_logged_or_served(tap):
    """Under collectives.internal() (the checkpoint exchange, the replay hand-over) a call goes straight to torch:
    a send to itself reaches torch (which refuses it) instead of the tap's adjacency check, and nothing is logged."""
    t, pipeline, logged = tap
    with collectives.internal(), pytest.raises(ValueError, match="should not be the same") as raised:
        dist.send(torch.zeros(1), dst=0, tag=0x5717)
    assert not isinstance(raised.value, RegistrationError) and not logged


def test_live_sends_are_logged_across_logged_boundaries_only(tap):
    t, pipeline, logged = tap
    calls: list = []
    through = lambda tensor, **kw: calls.append(kw) or "work"  # noqa: E731 - torch's call, recorded
    t.begin_step()
    assert t.send(through, torch.tensor([1.0]), 1, 0, False, {"dst": 1}) == "work"
    assert list(logged) == [(5, "p2p", 0, 1, 0, 0)]
    pipeline.logged = set()  # selective logging: boundary 0|1 inside a logging group
    assert t.send(through, torch.tensor([1.0]), 1, 0, False, {"dst": 1}) == "work"
    assert list(logged) == [(5, "p2p", 0, 1, 0, 0)] and len(calls) == 2


def test_a_stage_replaying_in_the_same_set_is_talked_to_live(tap):
    t, pipeline, logged = tap
    through = lambda tensor, **kw: "work"  # noqa: E731
    pipeline.replay = {"live": {0, 1}, "log": {}}
    t.begin_step()
    assert t.recv(through, torch.zeros(1), 1, 0, False, {"src": 1}) == "work"  # not served from the (empty) log
    assert t.send(through, torch.zeros(1), 1, 0, False, {"dst": 1}) == "work"
    assert not logged
