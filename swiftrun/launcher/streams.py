"""The launcher's copy of each rank's own RNG streams: :class:`StreamBackups`.

The runtime sends a rank's streams at each step start (``at="start"``) and as its first optimizer update of a
step, labelled with the next step (``at="update"``: provisional, exact unless the script draws after its update);
see ``runtime/core/streams.py``. This keeps the last two steps per rank, opaque except for two comparisons:

- two ranks' ``start`` backups of the same step differ: the job's ranks have streams of their own
  (:attr:`StreamBackups.per_rank`, said in every RECOVER so that each rank redoes the step with its own);
- a rank's ``start`` backup differs from its ``update`` backup of the same step: that script draws after its
  update, so its provisional backups are wrong and are never handed out again.

Each event costs O(1) and the memory is two backups per rank (about 10 KB each): 200 MB for 10,000 ranks at the
coordinator of a multi-node job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KEPT_STEPS = 2  # per rank: the step in flight and the one after its update


@dataclass
class StreamBackups:
    per_rank: bool = False
    _by_rank: dict[int, dict[int, tuple[str, Any]]] = field(default_factory=dict)
    _first: dict[int, tuple[int, Any]] = field(default_factory=dict)  # step -> a rank's "start" backup of it
    _drawn_after_update: set[int] = field(default_factory=set)  # ranks whose "update" backups are wrong

    def keep(self, rank: int, step: int, at: str, state: Any) -> None:
        if step < 0 or state is None:
            return
        kept = self._by_rank.setdefault(rank, {})
        earlier = kept.get(step)
        if at == "start":
            if earlier is not None and earlier[0] == "update" and earlier[1] != state:
                self._drawn_after_update.add(rank)
            self._compare(rank, step, state)
        elif earlier is not None and earlier[0] == "start":
            return  # a step's own start backup is never replaced by a provisional one
        if at == "update" and rank in self._drawn_after_update:
            return
        kept[step] = (at, state)
        for old in [s for s in kept if s <= step - KEPT_STEPS]:
            del kept[old]

    def of(self, rank: int) -> dict[str, Any]:
        """``rank``'s backups to hand to its replacement: step (as text, for JSON) -> encoded streams."""
        return {str(step): state for step, (_, state) in sorted(self._by_rank.get(rank, {}).items())}

    def forget(self) -> None:
        """Every worker restarts: steps are numbered afresh, the backups say nothing about the new processes."""
        self._by_rank.clear()
        self._first.clear()
        self._drawn_after_update.clear()

    def _compare(self, rank: int, step: int, state: Any) -> None:
        if self.per_rank:
            return
        first = self._first.get(step)
        if first is None:
            self._first[step] = (rank, state)
            for old in [s for s in self._first if s <= step - KEPT_STEPS]:
                del self._first[old]
        elif first[0] != rank and first[1] != state:
            self.per_rank = True
            self._first.clear()
