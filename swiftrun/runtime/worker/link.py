"""The worker's end of the control channel: one thread, the sole owner of the DEALER socket.

It says HELLO, sends a heartbeat every interval (from a Python thread on purpose: a worker stuck holding the
GIL, or SIGSTOPped, stops heartbeating and the launcher notices), relays status and events queued by the
training thread, acknowledges commands, and exposes the launcher's commands to the training thread as state
guarded by a condition variable. ABORT is acted on *in this thread*, at once: the training thread may be blocked
inside a collective and can only be released from outside.

A process forked from the worker (DataLoader workers) inherits this object but not the thread; it must never
touch the inherited socket, so every entry point is a no-op there.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from typing import Any, Callable

import zmq

from swiftrun.protocol import control as protocol
from swiftrun.protocol.control import CommandKind, EventKind
from swiftrun.runtime.worker.env import WorkerEnv

log = logging.getLogger("swiftrun.runtime")

# The launcher repeats a recovery command until the rank's answer arrives (launcher/job.py RESEND_INTERVAL): a
# rank that already answered it repeats its answer, since either message may have been lost on the way.
ANSWERS = {
    EventKind.ABORTED: CommandKind.ABORT,
    EventKind.JOINING: CommandKind.ABORT,
    EventKind.RECOVERED: CommandKind.RECOVER,
    EventKind.UNRECOVERABLE: CommandKind.RECOVER,
}


class Link:
    def __init__(self, wenv: WorkerEnv) -> None:
        self.wenv = wenv
        self.rank = wenv.rank
        self.generation = wenv.generation  # the newest generation the launcher announced
        self.step = -1
        self.on_abort: Callable[[int], None] | None = None  # called in the link thread on ABORT
        self.on_assign: Callable[[], None] | None = None  # called in the link thread on ASSIGN (a spare)
        self._pid = os.getpid()
        self._cv = threading.Condition()
        self._commands: dict[CommandKind, protocol.Command] = {}  # newest command of each kind
        self._outbox: queue.SimpleQueue[protocol.Message] = queue.SimpleQueue()
        self._queued = 0  # events put in the outbox (training thread) ...
        self._sent = 0  # ... and handed to the socket (link thread): flush() waits for these to meet
        self._pings = 0  # PINGs flush() sent, and the newest PONG the launcher answered (link thread)
        self._pong = 0
        self._status: protocol.Status | None = None
        self._answers: dict[CommandKind, protocol.Event] = {}  # link thread only: the last answer to each command
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = threading.Event()
        self._connected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swiftrun-link", daemon=True)
        os.register_at_fork(after_in_child=self._forget_in_child)
        self._thread.start()

    # ------------------------------------------------------------------ training-thread API

    @property
    def usable(self) -> bool:
        return os.getpid() == self._pid

    def send_event(self, kind: EventKind, gen: int | None = None, **data: Any) -> None:
        if self.usable:
            self._queued += 1
            self._outbox.put(protocol.Event(gen=self.generation if gen is None else gen, event=kind, data=data))
            self._ring()

    def flush(self, timeout: float = 2.0) -> bool:
        """Wait (bounded) until every event queued so far was read by the launcher: handed to the socket, then a
        PING answered. Used by an injected fault before it kills its process: the fault models a failure at that
        point of the script, after what the rank already said, not one that also races the link thread's
        scheduling or the socket's send queue (which a SIGKILL discards) on a loaded machine."""
        if not self.usable or not self._thread.is_alive():
            return False
        deadline = time.monotonic() + timeout
        target = self._queued
        self._ring()
        with self._cv:
            if not self._cv.wait_for(lambda: self._sent >= target, timeout):
                return False
            self._pings += 1
            seq = self._pings
        self._outbox.put(protocol.Ping(gen=self.generation, seq=seq))
        self._ring()
        with self._cv:
            return self._cv.wait_for(lambda: self._pong >= seq, max(0.0, deadline - time.monotonic()))

    def set_status(self, step: int, loss: float | None = None, step_time: float | None = None,
                   metrics: dict[str, float] | None = None) -> None:
        """Conflated: only the newest status is sent, on the next heartbeat tick; never blocks."""
        if self.usable:
            self.step = step
            self._status = protocol.Status(gen=self.generation, step=step, loss=loss, step_time=step_time,
                                           metrics=dict(metrics or {}))

    def command(self, kind: CommandKind) -> protocol.Command | None:
        with self._cv:
            return self._commands.get(kind)

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Block until ``predicate()`` holds (evaluated under the link's lock) or the timeout passes."""
        with self._cv:
            return self._cv.wait_for(predicate, timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Flush queued events (bounded) and stop the thread."""
        if not self.usable or not self._thread.is_alive():
            return
        self._stopping.set()
        self._ring()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.immediate = 1  # never queue onto a connection that is not up; HELLO below waits for it
        sock.sndtimeo = 10_000  # a blocking send gives up after 10 s rather than hanging a dying worker
        sock.routing_id = f"{self.rank}:{self.wenv.incarnation}:{uuid.uuid4().hex[:8]}".encode()
        sock.connect(self.wenv.ctl_addr)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        interval = self.wenv.heartbeat_interval
        self._send(sock, protocol.Hello(gen=self.generation, token=self.wenv.token, rank=self.rank,
                                        incarnation=self.wenv.incarnation, pid=os.getpid(), spare=self.wenv.spare),
                   block=True)
        next_beat = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                if now >= next_beat:
                    self._beat(sock)
                    next_beat = now + interval
                    if self.wenv.launcher_pid and os.getppid() != self.wenv.launcher_pid:
                        os._exit(70)  # the launcher is gone: a worker must not outlive it
                ready = dict(poller.poll(max(0.0, next_beat - time.monotonic()) * 1000))
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                if sock in ready:
                    self._receive(sock)
                self._drain_outbox(sock)
                if self._stopping.is_set():
                    if self._status is not None:  # the last step's status, so the launcher's view ends complete
                        self._send(sock, self._status, block=True)
                    return
        finally:
            sock.close(linger=0)
            ctx.term()

    def _beat(self, sock: zmq.Socket) -> None:
        status, self._status = self._status, None
        self._send(sock, status if status is not None else protocol.Heartbeat(gen=self.generation, step=self.step))

    def _drain_outbox(self, sock: zmq.Socket) -> None:
        while True:
            try:
                msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, protocol.Event):
                log.debug("link: sending %s(%d)", msg.event.value, msg.gen)
                if msg.event in ANSWERS:
                    self._answers[ANSWERS[msg.event]] = msg
            self._send(sock, msg, block=True)
            if isinstance(msg, protocol.Event):
                with self._cv:
                    self._sent += 1
                    self._cv.notify_all()

    def _send(self, sock: zmq.Socket, msg: protocol.Message, block: bool = False) -> None:
        try:
            sock.send_multipart(protocol.encode(msg), 0 if block else zmq.NOBLOCK)
        except zmq.Again:
            pass  # telemetry is best-effort; a lost event shows up at the launcher as a missed deadline

    def _receive(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = protocol.decode(frames)
            except Exception:
                continue
            if isinstance(msg, protocol.Welcome):
                self._connected.set()
                with self._cv:
                    self.generation = max(self.generation, msg.gen)
                    self._cv.notify_all()
            elif isinstance(msg, protocol.Command):
                self._on_command(sock, msg)
            elif isinstance(msg, protocol.Pong):
                with self._cv:
                    self._pong = max(self._pong, msg.seq)
                    self._cv.notify_all()

    def _on_command(self, sock: zmq.Socket, cmd: protocol.Command) -> None:
        log.debug("link: received %s(%d)", cmd.command.value, cmd.gen)
        if cmd.command is CommandKind.ABORT and self.on_abort is not None:
            # release a training thread blocked in a collective before anything else
            self.on_abort(cmd.gen)
        if cmd.command is CommandKind.ASSIGN and self.on_assign is not None:
            self.on_assign()  # the spare's main thread may still be warming up at idle priority
        with self._cv:
            previous = self._commands.get(cmd.command)
            if previous is None or cmd.gen >= previous.gen:
                self._commands[cmd.command] = cmd
            self.generation = max(self.generation, cmd.gen)
            self._cv.notify_all()
        if cmd.cmd_id:
            self._send(sock, protocol.Ack(gen=cmd.gen, cmd_id=cmd.cmd_id))
        answer = self._answers.get(cmd.command)
        if answer is not None and answer.gen == cmd.gen:
            log.debug("link: %s(%d) again: answering %s again", cmd.command.value, cmd.gen, answer.event.value)
            self._send(sock, answer, block=True)

    def _ring(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _forget_in_child(self) -> None:
        # the child has the object but not the thread; usable turns False because the pid changed
        self.on_abort = None
        self.on_assign = None
