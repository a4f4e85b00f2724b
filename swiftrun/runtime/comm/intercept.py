"""What every interception of the script's communication shares: whose traffic a call is, what a peer's failure
looks like, and the handle of a call that completed without running.

The runtime wraps torch.distributed's collectives (runtime/comm/collectives.py), its point-to-point calls for a
hand-written pipeline (runtime/pp/p2p.py) and ``new_group`` (runtime/comm/subgroups.py). All of them must let
swiftrun's own traffic (recovery, transfers, checkpoint exchanges) and calls nested inside a wrapped call through
untouched; that is decided here, per thread, so that this module sits below all of them and imports none.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

# per thread: > 0 while swiftrun's own or an outer wrapped call runs in it (per thread, because the pipeline's
# background checkpoint exchange runs swiftrun's traffic while the script's step runs on)
_local = threading.local()

# gloo and NCCL errors a survivor sees when a peer dies or its group is aborted
PEER_FAILURE_MARKERS = ("connection closed", "connection reset", "timed out", "broken pipe", "aborted",
                        "connection refused", "read error", "nccl", "gloo", "peer")


@contextlib.contextmanager
def internal() -> Iterator[None]:
    """swiftrun's own communication (recovery, verification, exchanges): never intercepted, in this thread."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def bypassed() -> bool:
    """Whether this thread runs swiftrun's own traffic (or a call nested in a wrapped one) right now."""
    return getattr(_local, "depth", 0) > 0


def causes(exc: BaseException) -> list[BaseException]:
    """An exception and its causes: torch's pipelining re-raises a failed collective as a plain RuntimeError
    ("Failed to run stage backward") whose cause names the connection that broke."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 8:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def is_peer_failure(exc: BaseException, chained: bool = True) -> bool:
    """Whether ``exc`` (or, with ``chained``, one of its causes) is the error a peer's death or an abort raises."""
    for e in causes(exc) if chained else [exc]:
        if isinstance(e, RuntimeError) and any(marker in str(e).lower() for marker in PEER_FAILURE_MARKERS):
            return True
    return False


class Done:
    """The handle an ``async_op=True`` call returns when it completed without running (skipped, or served)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> Any:
        import torch

        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future
