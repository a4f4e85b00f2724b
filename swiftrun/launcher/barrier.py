"""The recovery barrier: who a generation of an in-place recovery still waits for.

A recovery has two waits, both held by the supervisor and never by a collective (a collective would hang on the
dead peer it is meant to route around):

1. **ready**: every survivor answered the ABORT (ABORTED: its groups are down, it waits at the barrier) and every
   replacement reported JOINING (its script reached ``swiftrun.Run``). The two halves end separately because they
   are timed separately: the ABORT phase ends with the last survivor, the SPAWN phase with the last replacement.
2. **recovered**: once RECOVER went out, every rank reported RECOVERED (groups rebuilt, consensus, undo,
   transfer done); then RESUME goes to all.

The barrier is filled in one walk over the ranks when a generation begins (:meth:`RecoveryBarrier.of`) and each
answer then removes one rank, so that each of the world's answers costs O(1) however many ranks there are
(walking every rank per answer was ~110 s + 80 s of one recovery at 10,000 ranks). An answer from an older
generation, or from a slot that no longer serves its rank, is filtered out by the caller
(:class:`~swiftrun.launcher.job.Job`), which knows about slots; this module knows ranks only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Member:
    """One rank as a new generation starts: whether a replacement serves it and what it has already answered."""

    rank: int
    replacement: bool
    ready: bool = False  # answered ABORTED / JOINING for this generation already
    recovered: bool = False  # reported RECOVERED for this generation already


@dataclass
class RecoveryBarrier:
    """The ranks a generation waits for, by wait; empty (nothing owed) outside a recovery."""

    generation: int = 0
    unready_survivors: set[int] = field(default_factory=set)
    unready_replacements: set[int] = field(default_factory=set)
    unrecovered: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, generation: int, members: Iterable[Member]) -> RecoveryBarrier:
        barrier = cls(generation)
        for member in members:
            if not member.ready:
                (barrier.unready_replacements if member.replacement else barrier.unready_survivors).add(member.rank)
            if not member.recovered:
                barrier.unrecovered.add(member.rank)
        return barrier

    # ------------------------------------------------------------------ answers

    def answered(self, rank: int) -> None:
        """``rank`` said ABORTED (a survivor) or JOINING (a replacement) for this generation."""
        self.unready_survivors.discard(rank)
        self.unready_replacements.discard(rank)

    def recovered(self, rank: int) -> None:
        """``rank`` said RECOVERED for this generation."""
        self.unrecovered.discard(rank)

    # ------------------------------------------------------------------ what is owed

    @property
    def survivors_ready(self) -> bool:
        return not self.unready_survivors

    @property
    def replacements_ready(self) -> bool:
        return not self.unready_replacements

    @property
    def ready(self) -> bool:
        """Every rank is at the barrier: RECOVER may go out (once every replacement's link is up)."""
        return not self.unready_survivors and not self.unready_replacements

    @property
    def done(self) -> bool:
        """Every rank recovered: RESUME may go out."""
        return not self.unrecovered

    def owing(self, recover_sent: bool) -> set[int]:
        """The ranks that owe an answer to the command now in force (ABORT before RECOVER went out, RECOVER after):
        the ones a repeat of that command goes to."""
        return set(self.unrecovered) if recover_sent else self.unready_survivors | self.unready_replacements
