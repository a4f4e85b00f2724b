"""The zygote: one process per agent that imports torch and warms DDP once, then forks warm workers in
milliseconds: ``python -u -m swiftrun.runtime.zygote FD`` (FD: its end of the agent's SEQPACKET socketpair,
messages in swiftrun/protocol/zygote.py).

Why fork is safe here: the zygote never creates a ZeroMQ context, a process group that survives the warm-up, or
CUDA state, and it forks only while it is the single thread of its process (checked in /proc before each fork):
everything with threads (the control link, the store client, NCCL) is created in the child after the fork.

The warm-up runs in a thread so that the main thread, the one that forks, stays at SCHED_OTHER: the thread runs
at normal priority while the workers start (they import the same modules), and the agent moves it to SCHED_IDLE
(IDLE message) once training runs; an unprivileged process could not move a SCHED_IDLE main thread back.

Each FORK forks twice: the middle process exits at once, so the worker is reparented to the agent, a child
subreaper (PR_SET_CHILD_SUBREAPER). The agent then waits for it, gets its exit status and kills it exactly as a
worker it spawned itself; and the worker asks for SIGKILL on the *agent's* death (PR_SET_PDEATHSIG), not on the
zygote's, so losing the zygote never costs a worker. The child takes its own session, its stdout/stderr from
the descriptors that came with FORK, the worker environment, and runs swiftrun.runtime.bootstrap's main.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from swiftrun.errors import ProtocolError
from swiftrun.protocol import zygote as wire
from swiftrun.protocol.zygote import ZygoteKind
from swiftrun.runtime.worker import env

log = logging.getLogger("swiftrun.zygote")
REPARENT_WAIT = 5.0  # seconds a forked worker waits to be reparented to the agent before giving up


@dataclass
class ChildJob:
    """What a freshly forked worker runs: the bootstrap's arguments, its environment, its stdio descriptors."""

    argv: list[str]
    env: dict[str, str]
    fds: list[int]


def thread_count() -> int:
    """Threads of this process as the kernel sees them (native ones too: a BLAS pool would not show in Python)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _single_threaded(wait: float = 2.0) -> int:
    """The thread count once it is 1, or what it still is after ``wait`` seconds: a joined Python thread's OS
    thread lingers for a few milliseconds after ``join`` returns (seen here right after the warm-up)."""
    deadline = time.monotonic() + wait
    while True:
        n = thread_count()
        if n == 1 or time.monotonic() > deadline:
            return n
        time.sleep(0.002)


class Zygote:
    def __init__(self, sock: socket.socket, launcher_pid: int) -> None:
        self.sock = sock
        self.launcher_pid = launcher_pid
        self.warm = False
        self.queue: list[tuple[dict, list[int]]] = []  # FORKs that came during the warm-up
        self.warm_error: str | None = None
        self._warmer: threading.Thread | None = None

    def start_warm_up(self) -> None:
        from swiftrun.runtime.bootstrap import _warm_torch

        # torch.cuda.is_available() would otherwise ask the CUDA driver (cuInit), and a process forked after
        # cuInit cannot use CUDA; NVML answers the same question without it. Only the zygote's environment:
        # each child gets its worker environment whole.
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

        def warm_up() -> None:
            try:
                _warm_torch()
                torch = sys.modules["torch"]
                if torch.cuda.is_initialized():  # never expected: the warm-up runs on the CPU
                    raise RuntimeError("CUDA was initialised during the warm-up; forking now would not be safe")
            except Exception as exc:  # noqa: BLE001 - reported to the agent, which then starts workers cold
                self.warm_error = f"{type(exc).__name__}: {exc}"
                log.debug("zygote warm-up failed\n%s", traceback.format_exc())

        self._warmer = threading.Thread(target=warm_up, name="swiftrun-zygote-warm", daemon=True)
        self._warmer.start()

    def idle(self) -> None:
        """Training runs: the rest of the warm-up only gets CPU time nobody else wants."""
        if self._warmer is not None and self._warmer.is_alive() and self._warmer.native_id:
            from swiftrun.runtime.bootstrap import _set_idle_priority

            _set_idle_priority(self._warmer.native_id, idle=True)

    def serve(self) -> ChildJob | None:
        """The zygote's loop; returns in a forked worker (with what it must run), or when the agent is gone."""
        t0 = time.monotonic()
        while True:
            if not self.warm and self._warmer is not None and not self._warmer.is_alive():
                self._warmer.join()
                self._warmer = None
                if self.warm_error is not None:
                    wire.send(self.sock, ZygoteKind.WARM_FAILED, reason=self.warm_error)
                    return None
                self.warm = True
                wire.send(self.sock, ZygoteKind.READY, seconds=round(time.monotonic() - t0, 3))
                while self.queue:
                    body, fds = self.queue.pop(0)
                    child = self._fork(body, fds)
                    if child is not None:
                        return child
            readable, _, _ = select.select([self.sock], [], [], None if self.warm else 0.05)
            if not readable:
                continue
            try:
                msg = wire.recv(self.sock)
            except ProtocolError as exc:
                log.debug("zygote: %s", exc)
                continue
            except OSError:
                return None
            if msg is None:
                return None  # the agent closed its end: nothing more to fork
            kind, body, fds = msg
            if kind is ZygoteKind.IDLE:
                self.idle()
            elif kind is ZygoteKind.FORK:
                if not self.warm:
                    self.queue.append((body, fds))
                    continue
                child = self._fork(body, fds)
                if child is not None:
                    return child
            else:
                for fd in fds:
                    os.close(fd)

    def _fork(self, body: dict, fds: list[int]) -> ChildJob | None:
        slot = int(body["slot"])
        threads = _single_threaded()
        if threads != 1:
            self._refuse(slot, fds, f"the zygote has {threads} threads alive; forking now would not be safe")
            return None
        if len(fds) != wire.STDIO_FDS:
            self._refuse(slot, fds, "FORK came without the child's stdout and stderr")
            return None
        r, w = os.pipe()
        try:
            middle = os.fork()
        except OSError as exc:
            os.close(r)
            os.close(w)
            self._refuse(slot, fds, f"fork failed: {exc}")
            return None
        if middle == 0:  # the middle process: fork the worker, say its pid, vanish (the agent adopts it)
            try:
                worker = os.fork()
            except OSError:
                os._exit(1)
            if worker:
                os.write(w, str(worker).encode())
                os._exit(0)
            os.close(r)
            os.close(w)
            for _, queued in self.queue:  # other children's descriptors
                for fd in queued:
                    os.close(fd)
            self.queue.clear()
            return ChildJob(argv=[str(a) for a in body["argv"]], env={str(k): str(v) for k, v in body["env"].items()},
                            fds=fds)
        os.close(w)
        data = b""
        while True:
            chunk = os.read(r, 64)
            if not chunk:
                break
            data += chunk
        os.close(r)
        os.waitpid(middle, 0)
        for fd in fds:
            os.close(fd)
        if not data:
            wire.send(self.sock, ZygoteKind.FORK_FAILED, slot=slot, reason="the second fork failed")
            return None
        wire.send(self.sock, ZygoteKind.FORKED, slot=slot, pid=int(data))
        return None

    def _refuse(self, slot: int, fds: list[int], reason: str) -> None:
        for fd in fds:
            os.close(fd)
        wire.send(self.sock, ZygoteKind.FORK_FAILED, slot=slot, reason=reason)


def become_worker(job: ChildJob, sock: socket.socket, launcher_pid: int) -> None:
    """In the forked worker: detach from the zygote, take the worker's stdio and environment, run the bootstrap."""
    sock.close()  # the zygote's channel is not ours
    os.setsid()  # the agent signals a worker's process group, as for a spawned one
    deadline = time.monotonic() + REPARENT_WAIT
    while launcher_pid and os.getppid() != launcher_pid:  # the middle process is exiting: wait for the agent
        if time.monotonic() > deadline:
            os._exit(70)
        time.sleep(0.0005)
    for target, fd in zip((1, 2), job.fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(job.env)
    from swiftrun.runtime import bootstrap

    # bootstrap asks for SIGKILL on the agent's death and checks the parent once more; the link thread's parent
    # check uses the same SWIFTRUN_LAUNCHER_PID
    bootstrap.main(job.argv, warm=True)


def main(argv: list[str]) -> None:
    if len(argv) != 1 or not argv[0].isdigit():
        sys.stderr.write("usage: python -m swiftrun.runtime.zygote FD (started by the swiftrun agent)\n")
        sys.exit(2)
    loglevel = env.settings().loglevel
    if loglevel:
        logging.basicConfig(level=loglevel.upper(),
                            format="%(relativeCreated)8.0fms swiftrun-zygote[%(process)d] %(message)s")
    launcher_pid = env.launcher_pid()
    from swiftrun.runtime.bootstrap import _die_with_parent

    _die_with_parent(launcher_pid)
    sock = socket.socket(fileno=int(argv[0]))
    zygote = Zygote(sock, launcher_pid)
    zygote.start_warm_up()
    job = zygote.serve()
    if job is None:
        sys.exit(0)
    become_worker(job, sock, launcher_pid)


if __name__ == "__main__":
    main(sys.argv[1:])
