"""The worker's link thread against a real ROUTER over ipc (no worker process): a recovery command repeated by the
launcher (launcher/job.py RESEND_INTERVAL, for a lost message) is answered again when this rank already answered
it, and releases the process group only once."""

from __future__ import annotations

import time

import pytest
import zmq

from swiftrun.protocol import control as protocol
from swiftrun.protocol.control import CommandKind, EventKind
from swiftrun.runtime.worker.env import WorkerEnv
from swiftrun.runtime.worker.link import Link


class Launcher:
    """A ROUTER playing the launcher's side; every wait has a deadline."""

    def __init__(self, tmp_path) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        self.addr = f"ipc://{tmp_path}/ctl"
        self.router.bind(self.addr)
        self.identity = b""
        self._cmd = 0

    def next(self, kinds: tuple[type, ...], timeout: float = 10.0) -> protocol.Message:
        """The next message of one of ``kinds`` (heartbeats and others skipped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.router.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                identity, *frames = self.router.recv_multipart()
                self.identity = identity
                msg = protocol.decode(frames)
                if isinstance(msg, kinds):
                    return msg
        raise AssertionError(f"no {kinds} within {timeout}s")

    def events(self, window: float) -> list[protocol.Event]:
        """Every event that arrives within ``window`` seconds."""
        out: list[protocol.Event] = []
        deadline = time.monotonic() + window
        while (left := deadline - time.monotonic()) > 0:
            if self.router.poll(int(left * 1000)):
                msg = protocol.decode(self.router.recv_multipart()[1:])
                if isinstance(msg, protocol.Event):
                    out.append(msg)
        return out

    def command(self, kind: CommandKind, gen: int) -> int:
        self._cmd += 1
        self.router.send_multipart([self.identity, *protocol.encode(
            protocol.Command(gen=gen, cmd_id=self._cmd, command=kind))])
        return self._cmd

    def close(self) -> None:
        self.router.close(0)
        self.ctx.term()


@pytest.fixture
def pair(tmp_path):
    launcher = Launcher(tmp_path)
    wenv = WorkerEnv(ctl_addr=launcher.addr, token="t", launcher_pid=0, rank=1, world_size=2, incarnation=0,
                     generation=0, joining=False, spare=False, heartbeat_interval=0.2, faults="", recovery="auto")
    link = Link(wenv)
    launcher.next((protocol.Hello,))
    try:
        yield launcher, link
    finally:
        link.close()
        launcher.close()


@pytest.mark.timeout(30)
def test_a_repeated_abort_is_answered_again_and_aborts_the_group_once(pair):
    launcher, link = pair
    aborted: list[int] = []
    link.on_abort = aborted.append

    launcher.command(CommandKind.ABORT, 1)
    assert link.wait_for(lambda: link.generation == 1, timeout=10)
    assert launcher.events(0.3) == []  # the training thread has not answered yet: nothing to repeat
    link.send_event(EventKind.ABORTED, gen=1, valid=True)
    (first,) = [e for e in launcher.events(0.5)]
    assert (first.event, first.gen) == (EventKind.ABORTED, 1)

    launcher.command(CommandKind.ABORT, 1)  # the launcher did not get it (lost): it asks again
    launcher.next((protocol.Ack,))
    (again,) = launcher.events(0.5)
    assert again == first
    assert aborted == [1, 1]  # the group manager ignores a repeat for a generation it already aborted

    launcher.command(CommandKind.RECOVER, 1)  # not answered yet: no answer repeated
    launcher.command(CommandKind.ABORT, 2)  # a newer generation: the old answer is not an answer to it
    assert link.wait_for(lambda: link.generation == 2, timeout=10)
    assert launcher.events(0.5) == []
