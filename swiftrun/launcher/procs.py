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
import time
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
    # -u as torchrun does: worker output must not sit in a buffer when the process dies
    return [python_executable(config), "-u", "-m", "swiftrun.runtime.bootstrap", *bootstrap_args(config)]


class _Adopted:
    """The Popen-like handle of a worker the zygote forked: not started by us, but our child all the same.

    The zygote forks twice and the middle process exits at once, so the worker is reparented to the agent (a
    child subreaper, see swiftrun/launcher/zygote.py): ``waitpid`` works on it exactly as on a spawned worker.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # someone else reaped it (never expected): its status is lost
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            if self.returncode is None:
                try:
                    _, status = os.waitpid(self.pid, 0)
                    self.returncode = os.waitstatus_to_exitcode(status)
                except ChildProcessError:
                    self.returncode = 255
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


def bootstrap_args(config: LaunchConfig) -> list[str]:
    """What follows ``-m swiftrun.runtime.bootstrap`` for a Python target (a zygote's child runs it in-process)."""
    ep: Entrypoint = config.entrypoint
    mode = "module" if ep.kind is EntrypointKind.MODULE else "script"
    return [mode, ep.target, *ep.args]


@dataclass
class WorkerProcess:
    """One worker OS process (spawned, or forked by the zygote) and the file descriptors the loop watches."""

    popen: subprocess.Popen | _Adopted
    pidfd: int | None  # readable when the process exits; None where pidfd_open is unavailable
    stdout: IO[bytes] | None = None  # pipes, when the launcher relays output
    stderr: IO[bytes] | None = None
    returncode: int | None = None
    opened_files: list[IO[bytes]] = field(default_factory=list)
    forked: bool = False  # came from the zygote

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


def is_stopped(pid: int) -> bool:
    """Whether the kernel reports ``pid`` as stopped (state T: SIGSTOP, a debugger); False if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"T", b"t")


def adopt(pid: int, stdout: IO[bytes] | None = None, stderr: IO[bytes] | None = None) -> WorkerProcess:
    """Watch a worker the zygote forked (already our child through the subreaper)."""
    return WorkerProcess(popen=_Adopted(pid), pidfd=_pidfd(pid), stdout=stdout, stderr=stderr, forked=True)


def _pidfd(pid: int) -> int | None:
    if hasattr(os, "pidfd_open"):
        try:
            return os.pidfd_open(pid)
        except OSError:
            return None  # old kernel: the loop falls back to polling
    return None


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
    return WorkerProcess(
        popen=popen,
        pidfd=_pidfd(popen.pid),
        stdout=popen.stdout,
        stderr=popen.stderr,
        opened_files=list(opened_files or ()),
    )

