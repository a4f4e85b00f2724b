"""Starting, signalling and reaping worker processes: the mechanism, no policy.

Workers run in their own session (like torchrun), so a signal to the process group also reaches DataLoader
workers and other children. Python workers start through ``swiftrun.runtime.bootstrap``, which asks the kernel
to SIGKILL them when the launcher dies; ``--no-python`` targets go through a tiny exec shim that does the same
before ``execvp``. Spawning happens on the event loop's thread only: the parent-death signal fires when the
*thread* that forked exits.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import IO

from swiftrun.config import Entrypoint, EntrypointKind, LaunchConfig
from swiftrun.errors import LaunchError


def python_executable(config: LaunchConfig) -> str:
    return config.python or os.environ.get("PYTHON_EXEC") or sys.executable


def worker_argv(config: LaunchConfig, spare: bool = False) -> list[str]:
    """The command line of a worker. A spare runs the bootstrap with the target it will run once assigned."""
    ep: Entrypoint = config.entrypoint
    if ep.kind is EntrypointKind.EXECUTABLE:
        return [python_executable(config), "-m", "swiftrun.runtime.execshim", ep.target, *ep.args]
    mode = "module" if ep.kind is EntrypointKind.MODULE else "script"
    # -u as torchrun does: worker output must not sit in a buffer when the process dies
    return [python_executable(config), "-u", "-m", "swiftrun.runtime.bootstrap", mode, ep.target, *ep.args]


@dataclass
class WorkerProcess:
    """One spawned OS process and the file descriptors the event loop watches for it."""

    popen: subprocess.Popen
    pidfd: int | None  # readable when the process exits; None where pidfd_open is unavailable
    stdout: IO[bytes] | None = None  # pipes, when the launcher relays output
    stderr: IO[bytes] | None = None
    returncode: int | None = None
    opened_files: list[IO[bytes]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.returncode is None

    def poll(self) -> int | None:
        """Reap the process if it exited; returns its return code (negative: killed by that signal)."""
        if self.returncode is None:
            rc = self.popen.poll()
            if rc is not None:
                self.returncode = rc
                self._close_fds()
        return self.returncode

    def signal_group(self, sig: int) -> None:
        """Signal the worker's whole process group; a vanished process is not an error."""
        if self.returncode is not None:
            return
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:  # the group leader exited and the pgid was reused: signal the pid only
            try:
                os.kill(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def _close_fds(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        for f in self.opened_files:
            f.close()
        self.opened_files.clear()


def spawn(
    argv: list[str],
    env: dict[str, str],
    stdout: int | IO[bytes] | None,
    stderr: int | IO[bytes] | None,
    opened_files: list[IO[bytes]] | None = None,
) -> WorkerProcess:
    """Start ``argv`` in a new session. ``stdout``/``stderr`` as for Popen (None inherits, PIPE relays)."""
    try:
        popen = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, start_new_session=True,
            close_fds=True,
        )
    except OSError as exc:
        for f in opened_files or ():
            f.close()
        raise LaunchError(f"could not start {argv[0]!r}: {exc.strerror or exc}") from None
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(popen.pid)
        except OSError:
            pidfd = None  # old kernel: the loop falls back to polling
    return WorkerProcess(
        popen=popen,
        pidfd=pidfd,
        stdout=popen.stdout,
        stderr=popen.stderr,
        opened_files=list(opened_files or ()),
    )

