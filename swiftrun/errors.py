"""The typed errors of swiftrun.

Only the CLI turns these into exit statuses and messages; every other layer raises them. An error that means
"stop, do not retry" inside a worker is a :class:`BaseException`, so that a training script's
``except Exception:`` cannot swallow it.
"""

from __future__ import annotations


class SwiftrunError(Exception):
    """Base of every error swiftrun raises on purpose. Its message is meant for the user as it is."""

    exit_code = 1


class ConfigError(SwiftrunError):
    """A flag, an environment variable or their combination is invalid (a usage error)."""

    exit_code = 2


class LaunchError(SwiftrunError):
    """The job could not be started: a missing script, a port in use, an unusable interpreter."""

    exit_code = 1


class ProtocolError(SwiftrunError):
    """A control message could not be decoded, or came from a peer speaking another protocol version."""


class RecoveryError(SwiftrunError):
    """An in-place recovery could not reach a consistent state (no surviving replica, for example)."""


class RecoveryInterrupted(BaseException):
    """Raised inside a worker when the launcher aborts the current generation; the runtime catches it."""

    def __init__(self, generation: int) -> None:
        super().__init__(f"generation {generation} was aborted by the launcher")
        self.generation = generation
