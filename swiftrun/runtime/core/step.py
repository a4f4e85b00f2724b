"""What the components of a recovery may read of the step in progress: a read-only view.

The recovery loop (runtime/core/recovery.py) owns the step's bookkeeping and is the only writer. Components that
act during a step (the pipeline's log and taps, the broadcast-buffer tracker, the interception of the script's
collectives) are handed this view, not the loop itself, so what they can reach is written down here and a
change to the loop's internals cannot silently become their dependency.
"""

from __future__ import annotations

from typing import Protocol


class StepView(Protocol):
    """The step in progress on this rank, as the recovery loop keeps it."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def generation(self) -> int:
        """The generation this rank's state belongs to (0 at first; later after restarts and recoveries)."""

    @property
    def step(self) -> int:
        """The step the script is in (the last one begun), -1 before the first."""

    @property
    def in_step(self) -> bool:
        """Between the step's start and its completion: inside the transaction a recovery can put back."""

    @property
    def valid(self) -> bool:
        """Whether this rank's state is one a recovery may copy from."""

    @property
    def completed(self) -> int:
        """The last step whose body finished on this rank."""

    @property
    def partial(self) -> bool:
        """Whether the optimizer update of step ``completed + 1`` is applied while its body has not finished."""

    @property
    def position(self) -> int:
        """The last step whose optimizer update this rank's state holds."""
