"""Run.steps(loader=...): each step gets the batch failure-free training would give it, after any jump."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from swiftrun.runtime.api import Run, _LoaderCursor
from swiftrun.runtime.sampler import ResumableDistributedSampler


def _loader(n: int = 23, batch: int = 4, drop_last: bool = True) -> DataLoader:
    data = TensorDataset(torch.arange(n))
    sampler = ResumableDistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    return DataLoader(data, batch_size=batch, sampler=sampler, drop_last=drop_last)


def _stream(loader: DataLoader, steps: int) -> list[list[int]]:
    """The reference: plain epoch-by-epoch iteration, as a script without swiftrun would do it."""
    out, epoch = [], 0
    while len(out) < steps:
        loader.sampler.set_epoch(epoch)
        out += [b[0].tolist() for b in loader]
        epoch += 1
    return out[:steps]


@pytest.mark.timeout(30)
def test_inert_run_yields_the_plain_epoch_stream():
    expected = _stream(_loader(), 17)
    got = [batch[0].tolist() for _, batch in Run().steps(17, loader=_loader())]
    assert got == expected


@pytest.mark.timeout(30)
def test_any_step_order_gets_that_steps_batch():
    expected = _stream(_loader(), 20)
    cursor = _LoaderCursor(_loader())
    for step in [0, 1, 2, 7, 8, 3, 4, 5, 6, 19, 12, 13]:  # a recovery jumps back; a resume jumps ahead
        assert cursor.batch_for(step)[0].tolist() == expected[step], step


@pytest.mark.timeout(30)
def test_a_loader_without_a_resumable_sampler_is_refused():
    with pytest.raises(TypeError, match="ResumableDistributedSampler"):
        _LoaderCursor(DataLoader(TensorDataset(torch.arange(4)), batch_size=2))


@pytest.mark.timeout(30)
def test_a_short_last_batch_counts_as_a_step():
    expected = _stream(_loader(drop_last=False), 15)
    cursor = _LoaderCursor(_loader(drop_last=False))
    for step in [0, 5, 6, 11, 2, 14]:
        assert cursor.batch_for(step)[0].tolist() == expected[step], step
