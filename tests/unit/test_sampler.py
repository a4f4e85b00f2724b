"""ResumableDistributedSampler: torch's index sequence, resumable at any position."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from swiftrun.runtime.sampler import ResumableDistributedSampler, position_for_step


class Sized:
    """A dataset of ``n`` items; the samplers only ever call len() on it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def resumable(n: int, replicas: int, rank: int, **kwargs: object) -> ResumableDistributedSampler:
    return ResumableDistributedSampler(Sized(n), num_replicas=replicas, rank=rank, **kwargs)  # type: ignore[arg-type]


def stream(sampler: ResumableDistributedSampler, epochs: range) -> list[int]:
    """The indices of whole epochs, in order, as a training loop would draw them."""
    out: list[int] = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        out += list(sampler)
    return out


@pytest.mark.parametrize("n", [0, 1, 2, 7, 10, 13])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_same_indices_as_torch_distributed_sampler(n: int, replicas: int, shuffle: bool, drop_last: bool) -> None:
    for rank in range(replicas):
        ours = resumable(n, replicas, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
        theirs: DistributedSampler[int] = DistributedSampler(
            Sized(n), replicas, rank, shuffle=shuffle, seed=5, drop_last=drop_last  # type: ignore[arg-type]
        )
        assert len(ours) == len(theirs)
        for epoch in range(4):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs), (rank, epoch)


def test_epochs_and_seeds_actually_reshuffle() -> None:
    # Guards the equality test against a sampler that ignores epoch and seed on both sides.
    sampler = resumable(50, 2, 0, seed=0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first
    assert list(resumable(50, 2, 0, seed=1)) != first


@pytest.mark.parametrize("replicas", [1, 3])
@pytest.mark.parametrize("drop_last", [True, False])
def test_seek_to_every_position_yields_the_rest_of_that_epoch(replicas: int, drop_last: bool) -> None:
    n = 10
    for rank in range(replicas):
        reference = resumable(n, replicas, rank, drop_last=drop_last)
        per_epoch = len(reference)
        epochs = [stream(reference, range(e, e + 1)) for e in range(3)]
        sampler = resumable(n, replicas, rank, drop_last=drop_last)
        for position in range(3 * per_epoch):
            sampler.seek(position)
            epoch, offset = divmod(position, per_epoch)
            assert (sampler.epoch, sampler.offset) == (epoch, offset)
            assert list(sampler) == epochs[epoch][offset:]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    replicas=st.integers(1, 5),
    data=st.data(),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
)
def test_resuming_at_any_position_continues_the_uninterrupted_stream(
    n: int, replicas: int, data: st.DataObject, drop_last: bool, shuffle: bool
) -> None:
    rank = data.draw(st.integers(0, replicas - 1))
    uninterrupted = resumable(n, replicas, rank, drop_last=drop_last, shuffle=shuffle)
    per_epoch = len(uninterrupted)
    epochs = 4
    if per_epoch == 0:  # drop_last with fewer items than ranks: nothing to resume
        return
    whole = stream(uninterrupted, range(epochs))
    position = data.draw(st.integers(0, epochs * per_epoch - 1))

    resumed = resumable(n, replicas, rank, drop_last=drop_last, shuffle=shuffle)
    resumed.seek(position)
    # The usual loop: set_epoch at the top of every epoch, starting from the seeked one.
    tail = stream(resumed, range(resumed.epoch, epochs))

    assert whole[:position] + tail == whole


def test_iterating_does_not_consume_the_offset() -> None:
    sampler = resumable(12, 2, 1)
    sampler.seek(8)  # epoch 1, offset 2
    assert list(sampler) == list(sampler)
    assert (sampler.epoch, sampler.offset) == (1, 2)


def test_set_epoch_to_another_epoch_resets_the_offset() -> None:
    sampler = resumable(12, 2, 0)
    full_epoch_2 = stream(resumable(12, 2, 0), range(2, 3))
    sampler.seek(9)  # epoch 1, offset 3
    sampler.set_epoch(2)
    assert (sampler.epoch, sampler.offset) == (2, 0)
    assert list(sampler) == full_epoch_2


def test_set_epoch_to_the_seeked_epoch_keeps_the_offset() -> None:
    sampler = resumable(12, 2, 0)
    sampler.seek(9)
    sampler.set_epoch(1)
    assert (sampler.epoch, sampler.offset) == (1, 3)


def test_a_fresh_seek_replaces_the_previous_one() -> None:
    sampler = resumable(12, 2, 0)
    sampler.seek(9)
    sampler.seek(12)
    assert (sampler.epoch, sampler.offset) == (2, 0)
    assert len(list(sampler)) == 6


def test_invalid_positions_and_epochs_are_refused() -> None:
    sampler = resumable(12, 2, 0)
    with pytest.raises(ValueError):
        sampler.seek(-1)
    with pytest.raises(ValueError):
        sampler.set_epoch(-1)
    empty = resumable(0, 2, 0)
    empty.seek(0)
    assert list(empty) == []
    with pytest.raises(ValueError):
        empty.seek(1)


def test_state_dict_round_trip_restores_the_exact_remaining_indices() -> None:
    saved = resumable(30, 3, 1, seed=7)
    saved.seek(23)
    restored = resumable(30, 3, 1, seed=7)
    restored.load_state_dict(saved.state_dict())
    assert (restored.epoch, restored.offset) == (saved.epoch, saved.offset) == (2, 3)
    assert list(restored) == list(saved)


def test_state_dict_of_a_peer_rank_gives_the_position_not_the_peer_indices() -> None:
    # A replacement rank may load a surviving peer's state: it resumes at the same place with its own indices.
    peer = resumable(30, 3, 0, seed=7)
    peer.seek(23)
    replacement = resumable(30, 3, 2, seed=7)
    replacement.load_state_dict(peer.state_dict())
    expected = resumable(30, 3, 2, seed=7)
    expected.seek(23)
    assert list(replacement) == list(expected)
    assert list(replacement) != list(peer)


@pytest.mark.parametrize(
    "other",
    [
        dict(n=30, replicas=3, seed=8),
        dict(n=30, replicas=2, seed=7),
        dict(n=33, replicas=3, seed=7),
    ],
)
def test_state_dict_from_a_differently_configured_sampler_is_refused(other: dict[str, int]) -> None:
    saved = resumable(other["n"], other["replicas"], 0, seed=other["seed"])
    sampler = resumable(30, 3, 0, seed=7)
    with pytest.raises(ValueError):
        sampler.load_state_dict(saved.state_dict())


def test_padding_repeats_the_first_indices_so_every_rank_gets_the_same_count() -> None:
    # 10 items on 4 ranks: 3 each, the two missing slots repeat the first two indices of the permutation.
    ranks = [resumable(10, 4, r, shuffle=False) for r in range(4)]
    assert [len(s) for s in ranks] == [3, 3, 3, 3]
    drawn = sorted(itertools.chain.from_iterable(ranks))
    assert drawn == sorted(list(range(10)) + [0, 1])


def test_padding_when_ranks_outnumber_items_wraps_around_repeatedly() -> None:
    ranks = [resumable(2, 5, r, shuffle=False) for r in range(5)]
    assert [list(s) for s in ranks] == [[0], [1], [0], [1], [0]]


def test_drop_last_drops_the_tail_so_no_index_repeats() -> None:
    ranks = [resumable(10, 4, r, shuffle=False, drop_last=True) for r in range(4)]
    assert [len(s) for s in ranks] == [2, 2, 2, 2]
    drawn = sorted(itertools.chain.from_iterable(ranks))
    assert drawn == list(range(8))
    ranks[1].seek(3)  # epoch 1, offset 1
    assert list(ranks[1]) == [5]


def test_position_for_step() -> None:
    assert position_for_step(0, 32) == 0
    assert position_for_step(7, 32) == 224
    assert ResumableDistributedSampler.position_for_step(3, 4) == 12
    with pytest.raises(ValueError):
        position_for_step(-1, 4)
    with pytest.raises(ValueError):
        position_for_step(1, 0)


def test_dataloader_resumes_at_the_batch_after_the_last_finished_step() -> None:
    data = TensorDataset(torch.arange(40))
    sampler = ResumableDistributedSampler(data, num_replicas=2, rank=1, seed=3)
    batches = [b[0].tolist() for b in DataLoader(data, batch_size=4, sampler=sampler)]
    sampler.seek(position_for_step(2, 4))
    resumed = [b[0].tolist() for b in DataLoader(data, batch_size=4, sampler=sampler)]
    assert resumed == batches[2:]


def test_world_defaults_to_a_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    sampler = ResumableDistributedSampler(Sized(10))  # type: ignore[arg-type]
    assert (sampler.num_replicas, sampler.rank) == (1, 0)


def test_world_defaults_to_the_launcher_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    sampler = ResumableDistributedSampler(Sized(10))  # type: ignore[arg-type]
    assert (sampler.num_replicas, sampler.rank) == (4, 3)
    assert ResumableDistributedSampler(Sized(10), rank=1).rank == 1  # type: ignore[arg-type]


def test_an_initialised_process_group_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sampler = ResumableDistributedSampler(Sized(10))  # type: ignore[arg-type]
    finally:
        dist.destroy_process_group()
    assert (sampler.num_replicas, sampler.rank) == (1, 0)


def test_rank_outside_the_world_is_refused() -> None:
    with pytest.raises(ValueError):
        resumable(10, 2, 2)
