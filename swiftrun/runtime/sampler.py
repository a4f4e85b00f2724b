"""A DistributedSampler that can resume in the middle of an epoch.

After an in-place recovery the training loop continues at step ``s``, not at the start of an epoch; a plain
:class:`torch.utils.data.distributed.DistributedSampler` would hand the replacement rank the epoch from its first
index again. :class:`ResumableDistributedSampler` yields exactly the indices of the torch sampler (same epoch,
seed and rank give the same sequence) and can :meth:`~ResumableDistributedSampler.seek` to any position::

    sampler = swiftrun.ResumableDistributedSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size=B, sampler=sampler)
    sampler.seek(position_for_step(start_step, B))     # B is the per-rank batch size
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)                         # the seeked epoch keeps its offset
        for batch in loader: ...

A *position* counts the samples this rank has consumed since the start of training, across epochs, so
``epoch = position // len(sampler)`` and ``offset = position % len(sampler)``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sized
from typing import Any

import torch.distributed as dist
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler


def position_for_step(step: int, batch_size: int) -> int:
    """The position of a rank that has finished ``step`` steps of ``batch_size`` samples each (per rank)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    return step * batch_size


def _default_world() -> tuple[int, int]:
    """(num_replicas, rank) from an initialised process group, else WORLD_SIZE/RANK, else a single process.

    torch's sampler insists on an initialised process group; falling back to the launcher's environment lets
    a dataloader be built before ``init_process_group`` and lets the sampler be used in a plain script.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


class ResumableDistributedSampler(Sampler[int]):
    """:class:`DistributedSampler`'s index sequence, plus :meth:`seek` and a ``state_dict`` to resume mid-epoch.

    ``len(sampler)`` is the full per-rank epoch length, also right after a seek: a position is defined in whole
    epochs of that length. Iterating does not consume the offset; only :meth:`set_epoch` to another epoch or a
    new :meth:`seek` moves it.
    """

    # Reachable from the public class as well, so that ``swiftrun.ResumableDistributedSampler`` is all one imports.
    position_for_step = staticmethod(position_for_step)

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        default_replicas, default_rank = _default_world()
        # The index arithmetic is delegated to torch's own sampler, so the sequences cannot drift apart when
        # torch changes its padding or shuffling; it also validates rank against num_replicas.
        self._reference: DistributedSampler[int] = DistributedSampler(
            dataset,  # type: ignore[arg-type]
            num_replicas=default_replicas if num_replicas is None else num_replicas,
            rank=default_rank if rank is None else rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self._epoch = 0
        self._offset = 0

    # The torch sampler's public attributes, read-only here so they cannot disagree with the delegate.
    @property
    def dataset(self) -> Sized:
        return self._reference.dataset  # type: ignore[return-value]

    @property
    def num_replicas(self) -> int:
        return self._reference.num_replicas

    @property
    def rank(self) -> int:
        return self._reference.rank

    @property
    def shuffle(self) -> bool:
        return self._reference.shuffle

    @property
    def seed(self) -> int:
        return self._reference.seed

    @property
    def drop_last(self) -> bool:
        return self._reference.drop_last

    @property
    def num_samples(self) -> int:
        return self._reference.num_samples

    @property
    def total_size(self) -> int:
        return self._reference.total_size

    @property
    def epoch(self) -> int:
        """The epoch the next iteration yields."""
        return self._epoch

    @property
    def offset(self) -> int:
        """How many of this epoch's indices the next iteration skips."""
        return self._offset

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        self._reference.set_epoch(self._epoch)
        indices = list(self._reference)
        return iter(indices[self._offset :])

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first index, unless a seek already placed us inside that very epoch.

        Keeping the offset when the epoch does not change is what makes the usual loop
        ``seek(p); for e in ...: set_epoch(e)`` resume mid-epoch instead of silently replaying the epoch.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self._epoch:
            self._epoch = epoch
            self._offset = 0

    def seek(self, position: int) -> None:
        """Continue from ``position``: the number of samples this rank has consumed since training began."""
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        if self.num_samples == 0:
            # An empty sampler has no epochs to divide by; only the start is a valid place to be.
            if position != 0:
                raise ValueError(f"cannot seek to {position}: this rank's sampler has no samples")
            self._epoch, self._offset = 0, 0
            return
        self._epoch, self._offset = divmod(position, self.num_samples)

    def state_dict(self) -> dict[str, Any]:
        """Where the next iteration starts, plus what must match for that place to mean the same indices.

        The rank is deliberately left out: every data-parallel rank is at the same position, so a replacement
        rank may load the state of any surviving peer.
        """
        return {
            "epoch": self._epoch,
            "offset": self._offset,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_replicas": self.num_replicas,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; refuses a state whose indices would differ from this sampler's."""
        for key in ("seed", "shuffle", "num_replicas", "num_samples"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has {key}={getattr(self, key)!r}"
                )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset <= max(self.num_samples - 1, 0):
            raise ValueError(f"invalid sampler position: epoch={epoch} offset={offset}")
        self._epoch, self._offset = epoch, offset
