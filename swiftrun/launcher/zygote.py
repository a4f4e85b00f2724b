"""The agent's end of its zygote (swiftrun/runtime/zygote.py): start it, ask it to fork, hear what it did.

The agent becomes a child subreaper first: a worker the zygote forks (through a middle process that exits at
once) is then reparented to the agent, which waits for it, reads its exit status and kills its process group
exactly as for a worker it spawned. Nothing here blocks: the agent's loop polls :meth:`ZygoteClient.fileno` and
calls :meth:`read`.

The zygote is an optimisation only. Whatever goes wrong with it (it cannot start, fails to warm up, refuses or
fails a fork, dies, stops answering), :meth:`fail` kills it and hands back the requests still pending, which the
agent then starts cold, as it would without a zygote; it says so once.
"""

from __future__ import annotations

import enum
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass

from swiftrun.errors import ProtocolError
from swiftrun.launcher.procs import is_stopped
from swiftrun.protocol import zygote as wire
from swiftrun.protocol.zygote import ZygoteKind

PR_SET_CHILD_SUBREAPER = 36
FORK_ANSWER_TIMEOUT = 10.0  # seconds a warm zygote may take to answer a FORK before it counts as hung
STOPPED_CHECK = 1.0  # seconds between checks, while a FORK waits, that the zygote is not stopped (SIGSTOP)


class ZygoteState(str, enum.Enum):
    OFF = "off"  # not started (no spares for this job, or not started yet)
    WARMING = "warming"  # importing torch; FORKs wait for it
    WARM = "warm"  # forks in milliseconds
    FAILED = "failed"  # gone: workers start cold (the agent may start a new zygote, a new client)


@dataclass(frozen=True)
class ZygoteEvent:
    kind: ZygoteKind
    slot: int | None = None
    pid: int | None = None
    reason: str = ""
    seconds: float | None = None  # READY: the warm-up; FORKED: request to answer


def become_subreaper() -> str | None:
    """Make orphaned descendants this process's children; None on success, else why not."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            return f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(ctypes.get_errno())}"
    except (OSError, AttributeError) as exc:
        return f"no prctl here ({exc})"
    return None


class ZygoteClient:
    def __init__(self) -> None:
        self.state = ZygoteState.OFF
        self.popen: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.pending: dict[int, float] = {}  # slot -> when its FORK was sent
        self.failure: str | None = None
        self.warm_up_failed = False  # the zygote itself said its warm-up failed (a new one would fail the same way)
        self.started_at = 0.0
        self.forks = 0

    @property
    def usable(self) -> bool:
        return self.state in (ZygoteState.WARMING, ZygoteState.WARM)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def fileno(self) -> int | None:
        return self.sock.fileno() if self.sock is not None else None

    def start(self, python: str, env: dict[str, str], stderr: int | None) -> str | None:
        """Start the zygote; None on success, else why it could not (the agent then starts spares cold)."""
        if self.state is not ZygoteState.OFF:
            return None
        why = become_subreaper()
        if why is not None:
            return self._give_up(why)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.popen = subprocess.Popen(
                [python, "-u", "-m", "swiftrun.runtime.zygote", str(theirs.fileno())], env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
                pass_fds=(theirs.fileno(),),
            )
        except OSError as exc:
            ours.close()
            return self._give_up(f"could not start it: {exc.strerror or exc}")
        finally:
            theirs.close()
        ours.setblocking(False)
        self.sock = ours
        self.state = ZygoteState.WARMING
        self.started_at = time.monotonic()
        return None

    def fork(self, slot: int, argv: list[str], env: dict[str, str], stdout_fd: int, stderr_fd: int) -> bool:
        """Ask for a worker in ``slot``; False if the request could not even be sent (the zygote is then failed)."""
        if not self.usable or self.sock is None:
            return False
        try:
            wire.send(self.sock, ZygoteKind.FORK, [stdout_fd, stderr_fd], slot=slot, argv=argv, env=env)
        except OSError as exc:
            self.fail(f"could not reach it: {exc}")
            return False
        self.pending[slot] = time.monotonic()
        return True

    def idle(self) -> None:
        if self.usable and self.sock is not None:
            try:
                wire.send(self.sock, ZygoteKind.IDLE)
            except OSError:
                pass  # the next read sees it gone

    def read(self) -> list[ZygoteEvent]:
        """Everything the zygote said since the last call; a zygote that is gone yields one WARM_FAILED event."""
        out: list[ZygoteEvent] = []
        while self.sock is not None:
            try:
                msg = wire.recv(self.sock)
            except BlockingIOError:
                break
            except ProtocolError as exc:
                out.append(ZygoteEvent(ZygoteKind.WARM_FAILED, reason=str(exc)))
                break
            except OSError as exc:
                msg = None
                out.append(ZygoteEvent(ZygoteKind.WARM_FAILED, reason=f"its socket failed: {exc}"))
                break
            if msg is None:
                out.append(ZygoteEvent(ZygoteKind.WARM_FAILED, reason=f"it exited ({self._exit_status()})"))
                break
            kind, body, fds = msg
            for fd in fds:
                os.close(fd)
            now = time.monotonic()
            if kind is ZygoteKind.READY:
                self.state = ZygoteState.WARM
                for slot in self.pending:  # queued during the warm-up: answered from now on
                    self.pending[slot] = now
                out.append(ZygoteEvent(kind, seconds=float(body.get("seconds") or now - self.started_at)))
            elif kind is ZygoteKind.FORKED:
                sent = self.pending.pop(body["slot"], now)
                self.forks += 1
                out.append(ZygoteEvent(kind, slot=body["slot"], pid=body["pid"], seconds=now - sent))
            elif kind is ZygoteKind.FORK_FAILED:
                self.pending.pop(body["slot"], None)
                out.append(ZygoteEvent(kind, slot=body["slot"], reason=str(body["reason"])))
            elif kind is ZygoteKind.WARM_FAILED:
                self.warm_up_failed = True
                out.append(ZygoteEvent(kind, reason=f"its warm-up failed: {body.get('reason')}"))
        return out

    def overdue(self, now: float, startup_timeout: float) -> str | None:
        """Why the zygote counts as hung, or None: a warm one answers a FORK within seconds."""
        if not self.pending:
            return None
        # a stopped zygote answers nothing until SIGCONT: waiting for it would hold a replacement (or the end of
        # the job, for a spare being stopped) for the whole start-up timeout (fault campaign, SIGSTOP at start-up)
        if self.popen is not None and is_stopped(self.popen.pid):
            return "stopped (state T, e.g. SIGSTOP)"
        oldest = min(self.pending.values())
        if self.state is ZygoteState.WARM and now - oldest > FORK_ANSWER_TIMEOUT:
            return f"no answer to a fork request for {now - oldest:.1f}s"
        if self.state is ZygoteState.WARMING and now - self.started_at > startup_timeout:
            return f"not warm after {now - self.started_at:.0f}s (--startup-timeout)"
        return None

    def next_deadline(self, startup_timeout: float) -> float | None:
        """When :meth:`overdue` could next say yes (None: nothing pending)."""
        if not self.pending:
            return None
        if self.state is ZygoteState.WARMING:
            deadline = self.started_at + startup_timeout
        else:
            deadline = min(self.pending.values()) + FORK_ANSWER_TIMEOUT
        return min(deadline, time.monotonic() + STOPPED_CHECK)

    def fail(self, reason: str) -> list[int]:
        """Stop using the zygote (kill it); returns the slots whose FORK was never answered."""
        pending = sorted(self.pending)
        self.pending.clear()
        if self.state is not ZygoteState.FAILED:
            self.failure = reason
        self.state = ZygoteState.FAILED
        self.close()
        return pending

    def close(self) -> None:
        if self.popen is not None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _exit_status(self) -> str:
        if self.popen is None:
            return "never started"
        try:
            rc = self.popen.wait(timeout=1)
        except subprocess.TimeoutExpired:
            return "closed its socket"
        return f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"

    def _give_up(self, reason: str) -> str:
        self.state = ZygoteState.FAILED
        self.failure = reason
        return reason
