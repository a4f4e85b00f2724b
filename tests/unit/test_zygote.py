"""The zygote's wire protocol and the agent-side bookkeeping that needs no process."""

from __future__ import annotations

import os
import socket
import time

import pytest

from swiftrun.errors import ProtocolError
from swiftrun.launcher.zygote import FORK_ANSWER_TIMEOUT, STOPPED_CHECK, ZygoteClient, ZygoteState
from swiftrun.protocol import zygote as wire
from swiftrun.runtime.zygote import thread_count
from swiftrun.protocol.zygote import ZygoteKind


def test_messages_round_trip():
    data = wire.encode(ZygoteKind.FORK, slot=3, env={"RANK": "1"}, argv=["script", "t.py", "--x"])
    assert wire.decode(data) == (ZygoteKind.FORK, {"slot": 3, "env": {"RANK": "1"}, "argv": ["script", "t.py", "--x"]})
    assert wire.decode(wire.encode(ZygoteKind.FORKED, slot=1, pid=42)) == (ZygoteKind.FORKED, {"slot": 1, "pid": 42})
    assert wire.decode(wire.encode(ZygoteKind.IDLE)) == (ZygoteKind.IDLE, {})


@pytest.mark.parametrize("data", [
    b"not json", b"[]", b'{"k": "nope"}', b'{"slot": 1}',
    b'{"k": "fork", "slot": "1", "env": {}, "argv": []}',  # slot must be an int
    b'{"k": "forked", "slot": 1}',  # no pid
    b'{"k": "forked", "slot": true, "pid": 3}',  # a bool is no slot
    b'{"k": "fork_failed", "slot": 1, "reason": 5}',
])
def test_malformed_messages_are_protocol_errors(data):
    with pytest.raises(ProtocolError):
        wire.decode(data)


def test_descriptors_travel_with_a_fork_request():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    try:
        wire.send(a, ZygoteKind.FORK, [w, w], slot=0, env={}, argv=["script", "x.py"])
        kind, body, fds = wire.recv(b)
        assert kind is ZygoteKind.FORK and body["slot"] == 0 and len(fds) == 2
        os.write(fds[0], b"hi")  # the received descriptor is the pipe's write end
        assert os.read(r, 2) == b"hi"
        for fd in fds:
            os.close(fd)
        a.close()
        assert wire.recv(b) is None  # EOF: the other side is gone
    finally:
        for fd in (r, w):
            os.close(fd)
        b.close()


def test_a_malformed_datagram_closes_its_descriptors():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    try:
        socket.send_fds(a, [b"garbage"], [w])
        os.close(w)
        with pytest.raises(ProtocolError):
            wire.recv(b)
        assert os.read(r, 1) == b""  # every write end closed: nothing leaked
    finally:
        os.close(r)
        a.close()
        b.close()


def test_pending_forks_time_out_only_once_the_zygote_is_warm():
    # Times relative to the real monotonic clock: next_deadline also caps its answer at now + STOPPED_CHECK, and a
    # freshly booted machine's clock can read under a few hundred seconds (a fixed 100.0 made this test fail there).
    t0 = time.monotonic() - 1000.0
    client = ZygoteClient()
    client.state = ZygoteState.WARMING
    client.started_at = t0
    client.pending = {1: t0}
    assert client.overdue(t0 + FORK_ANSWER_TIMEOUT + 1, startup_timeout=600) is None  # still importing torch
    assert "startup-timeout" in client.overdue(t0 + 601, startup_timeout=600)
    assert client.next_deadline(600) == t0 + 600  # the warm-up deadline, not the FORK answer's
    client.state = ZygoteState.WARM
    client.pending = {1: t0 + 100}
    assert client.overdue(t0 + 100 + FORK_ANSWER_TIMEOUT / 2, startup_timeout=600) is None
    assert "no answer" in client.overdue(t0 + 100 + FORK_ANSWER_TIMEOUT + 1, startup_timeout=600)
    assert client.next_deadline(600) == t0 + 100 + FORK_ANSWER_TIMEOUT
    client.pending = {1: time.monotonic() + 3600}  # far off: still woken to check that the zygote is not stopped
    assert client.next_deadline(600) <= time.monotonic() + STOPPED_CHECK


def test_a_failed_zygote_hands_back_what_it_did_not_fork():
    client = ZygoteClient()
    client.state = ZygoteState.WARM
    client.pending = {4: 1.0, 2: 1.0}
    assert client.fail("test") == [2, 4]
    assert client.state is ZygoteState.FAILED and client.failure == "test" and not client.usable
    assert client.fork(5, ["script", "x.py"], {}, 1, 2) is False  # workers start cold from now on


def test_a_zygote_that_says_its_warm_up_failed_is_marked_so_and_one_that_vanished_is_not():
    """The agent starts a new zygote after one died, never after one whose warm-up failed (it would again)."""
    for says_failed in (True, False):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        client = ZygoteClient()
        client.sock, client.state = ours, ZygoteState.WARMING
        if says_failed:
            wire.send(theirs, ZygoteKind.WARM_FAILED, reason="import failed")
        theirs.close()
        events = client.read()
        assert [e.kind for e in events][-1] is ZygoteKind.WARM_FAILED
        assert client.warm_up_failed is says_failed, events
        client.close()


def test_thread_count_sees_native_threads():
    assert thread_count() >= 1


def test_a_cold_spare_warms_up_in_an_idle_thread_and_its_main_thread_keeps_normal_priority(monkeypatch):
    """An unprivileged process cannot return from SCHED_IDLE to SCHED_OTHER: the main thread, which runs the
    user's script after ASSIGN, must never be lowered (only the warm-up thread is)."""
    import threading

    from swiftrun.protocol.control import Command, CommandKind
    from swiftrun.runtime import bootstrap

    if not hasattr(os, "SCHED_IDLE"):
        pytest.skip("no SCHED_IDLE here")
    seen: dict[str, int] = {}
    main_policy = os.sched_getscheduler(0)

    def fake_warm() -> None:
        seen["warm"] = os.sched_getscheduler(threading.get_native_id())
        seen["main"] = os.sched_getscheduler(threading.main_thread().native_id)

    monkeypatch.setattr(bootstrap, "_warm_torch", fake_warm)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("RANK", "-1")  # restored afterwards: ASSIGN sets it

    class Link:
        rank = -1
        on_assign = None

        def wait_for(self, predicate, timeout=None):
            return True

        def command(self, kind):
            return Command(gen=0, cmd_id=1, command=CommandKind.ASSIGN, args={"env": {"RANK": "1"}, "rank": 1}) \
                if kind is CommandKind.ASSIGN else None

    link = Link()
    bootstrap._wait_for_rank(link)  # type: ignore[arg-type]
    assert link.rank == 1 and os.environ["RANK"] == "1"
    assert seen["warm"] == os.SCHED_IDLE
    assert seen["main"] == main_policy == os.sched_getscheduler(0)
