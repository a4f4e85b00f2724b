"""The supervisor state machine (swiftrun.launcher.job.Job), driven by replayed event histories.

No processes, sockets or sleeps: a :class:`Sim` feeds the events a real agent would (spawned, HELLO, protocol
events, exits, ticks, signals) with a fake clock that only moves when a test advances it, and keeps every action
the job answered with. Tests assert on those actions and on ``job.state`` / the slots' states (honcho-style
history replay, STYLE.md habit 10).
"""

from __future__ import annotations

import itertools
import signal
from typing import Any

import pytest

from swiftrun.config import Entrypoint, EntrypointKind, LaunchConfig, RecoveryMode, Timeouts
from swiftrun.events import EventName
from swiftrun.launcher import failures
from swiftrun.launcher.actions import Action, Assign, Finish, Kill, Note, Record, ResetStore, Send, Spawn
from swiftrun.launcher.job import EXIT_GRACE, RESEND_INTERVAL, SETUP_GRACE, Job
from swiftrun.protocol.control import CommandKind, EventKind
from swiftrun.snapshot import JobState, RecoveryPhase, WorkerState

SCRIPT = Entrypoint(EntrypointKind.SCRIPT, "train.py")
SIGTERM, SIGKILL, SIGINT = signal.SIGTERM, signal.SIGKILL, signal.SIGINT


@pytest.fixture(autouse=True)
def _no_dns(monkeypatch):
    """ProcessFailure stamps the host name through socket.getfqdn(); keep these tests off the resolver."""
    failures._fqdn.cache_clear()
    monkeypatch.setattr(failures.socket, "getfqdn", lambda: "node0.test")
    yield
    failures._fqdn.cache_clear()


# --- the harness -----------------------------------------------------------------------------------------------


class Sim:
    """A Job, a fake monotonic clock and the log of every action; one method per thing the agent feeds in."""

    def __init__(self, nproc: int = 2, t0: float = 100.0, registers: bool = False, **config: Any) -> None:
        self.now = t0
        self.config = LaunchConfig(entrypoint=SCRIPT, nproc_per_node=nproc, **config)
        self.job = Job(self.config, self.now, registers=registers)
        self.log: list[Action] = []

    # what the agent does with an answer: carry it out, plus the records produced outside the answer
    def _take(self, actions: list[Action]) -> list[Action]:
        actions = actions + self.job.drain_records()
        self.log += actions
        return actions

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def start(self) -> list[Action]:
        return self._take(self.job.start(self.now))

    def spawned(self, slot_id: int) -> list[Action]:
        return self._take(self.job.on_spawned(slot_id, 1000 + slot_id, self.now))

    def hello(self, slot_id: int) -> list[Action]:
        return self._take(self.job.on_hello(slot_id, self.job.generation, self.now))

    def boot(self, actions: list[Action]) -> list[Action]:
        """Every Spawn in ``actions`` starts and says HELLO."""
        out: list[Action] = []
        for spawn in of(actions, Spawn):
            out += self.spawned(spawn.slot_id) + self.hello(spawn.slot_id)
        return out

    def event(self, slot_id: int, kind: EventKind, gen: int | None = None, **data: Any) -> list[Action]:
        gen = self.job.generation if gen is None else gen
        return self._take(self.job.on_event(slot_id, gen, kind, data, self.now))

    def alive(self, slot_id: int, step: int | None = None) -> list[Action]:
        return self._take(self.job.on_alive(slot_id, self.now, step))

    def heartbeat_all(self) -> None:
        for slot in list(self.job.slots.values()):
            if slot.alive:
                self.alive(slot.slot_id)

    def exit(self, slot_id: int, rc: int) -> list[Action]:
        return self._take(self.job.on_exit(slot_id, rc, self.now))

    def tick(self, stopped: frozenset[int] = frozenset()) -> list[Action]:
        return self._take(self.job.tick(self.now, stopped=stopped))

    def signal(self, signum: int) -> list[Action]:
        return self._take(self.job.on_signal(signum, self.now))

    # views
    def slot(self, rank: int) -> int:
        return self.job.slot_of_rank(rank).slot_id

    def state(self, slot_id: int) -> WorkerState:
        return self.job.slots[slot_id].state

    def rank_slots(self) -> list[int]:
        return [self.slot(r) for r in range(self.config.world_size)]

    def spares(self) -> list[int]:
        return [s.slot_id for s in self.job.slots.values() if s.rank is None and s.alive]


def of(actions: list[Action], kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def sends(actions: list[Action], command: CommandKind) -> list[Send]:
    return [a for a in actions if isinstance(a, Send) and a.command is command]


def kills(actions: list[Action], signum: int | None = None) -> list[Kill]:
    return [a for a in actions if isinstance(a, Kill) and (signum is None or a.signum == signum)]


def records(actions: list[Action], event: EventName) -> list[Record]:
    return [a for a in actions if isinstance(a, Record) and a.event is event]


def finishes(actions: list[Action]) -> list[int]:
    return [a.exit_code for a in actions if isinstance(a, Finish)]


def phases(actions: list[Action]) -> list[str]:
    return [r.fields["phase"] for r in records(actions, EventName.RECOVERY_PHASE)]


def running(nproc: int = 2, registers: bool = False, **config: Any) -> Sim:
    """Every rank spawned and said HELLO; by default an unmodified script (nobody registered swiftrun.Run)."""
    sim = Sim(nproc, registers=registers, **config)
    sim.boot(sim.start())
    return sim


def booting(nproc: int = 3, **config: Any) -> Sim:
    """A script that creates swiftrun.Run (the agent read it): every rank said HELLO, none registered yet;
    the warm spares started with the job and said HELLO too."""
    sim = Sim(nproc, registers=True, **config)
    sim.boot(sim.start())
    return sim


def swift_running(nproc: int = 3, spares: int = 1, **config: Any) -> Sim:
    """Every rank registered swiftrun.Run and was told START; the warm spares (if any) said HELLO."""
    sim = running(nproc, spares=spares, **config)
    for slot_id in sim.rank_slots():
        sim.boot(sim.event(slot_id, EventKind.REGISTERED))
    assert sim.job.swift_started
    return sim


# --- start-up and a normal run ---------------------------------------------------------------------------------


def test_start_spawns_one_fresh_worker_per_rank_and_no_spare_before_swift_started():
    sim = Sim(3, spares=1)

    actions = sim.start()

    assert of(actions, Spawn) == [Spawn(i, i, 0, 0, 0, False) for i in range(3)]
    assert sim.job.state is JobState.RUNNING
    assert all(sim.state(s) is WorkerState.STARTING for s in range(3))


def test_hello_turns_a_starting_worker_into_a_running_one():
    sim = Sim(2)
    sim.start()
    sim.spawned(0)

    actions = sim.hello(0)

    assert sim.state(0) is WorkerState.RUNNING
    assert sim.state(1) is WorkerState.STARTING
    assert records(actions, EventName.WORKER_STATE)[0].fields == {
        "rank": 0, "incarnation": 0, "pid": 1000, "state": "running", "previous": "starting"}


def test_every_rank_exiting_zero_finishes_the_job_with_zero_after_the_last_exit():
    sim = running(3)

    assert finishes(sim.exit(0, 0) + sim.exit(2, 0)) == []
    assert sim.job.state is JobState.RUNNING
    assert finishes(sim.exit(1, 0)) == [0]

    assert sim.job.state is JobState.SUCCEEDED
    assert all(sim.state(s) is WorkerState.EXITED for s in range(3))
    assert sim.job.failures == []


def test_release_is_sent_to_every_rank_only_once_all_of_them_report_finishing():
    sim = swift_running(3)

    assert sends(sim.event(0, EventKind.FINISHING) + sim.event(1, EventKind.FINISHING), CommandKind.RELEASE) == []
    released = sends(sim.event(2, EventKind.FINISHING), CommandKind.RELEASE)

    assert sorted(s.slot_id for s in released) == [0, 1, 2]  # the ranks, not the spare


def test_success_with_a_warm_spare_stops_the_spare_before_finishing_with_zero():
    sim = swift_running(2, spares=1)
    (spare,) = sim.spares()
    sim.event(0, EventKind.FINISHING)
    sim.event(1, EventKind.FINISHING)

    sim.exit(0, 0)
    last = sim.exit(1, 0)

    assert kills(last) == [Kill(spare, SIGTERM)]
    assert finishes(last) == []
    assert sim.job.state is JobState.STOPPING
    assert finishes(sim.exit(spare, -SIGTERM)) == [0]
    assert sim.job.state is JobState.SUCCEEDED


def test_a_spare_that_ignores_sigterm_after_success_is_killed_at_the_shutdown_deadline():
    sim = swift_running(2, spares=1, timeouts=Timeouts(shutdown_timeout=10))
    (spare,) = sim.spares()
    sim.exit(0, 0)
    sim.exit(1, 0)

    sim.advance(9.9)
    assert kills(sim.tick()) == []
    sim.advance(0.1)
    assert kills(sim.tick()) == [Kill(spare, SIGKILL)]


# --- failures without Swift: stop, or restart everything -------------------------------------------------------


def test_crash_without_restarts_terminates_the_others_and_fails_once_every_worker_exited():
    sim = running(3)  # unmodified script: nobody registered, so no in-place recovery

    actions = sim._take(sim.job.on_exit(1, 1, sim.now, cause="exited with 1", error_file="/logs/1/error.json"))

    assert kills(actions, SIGTERM) == [Kill(0, SIGTERM), Kill(2, SIGTERM)]
    assert of(actions, Spawn) == [] and of(actions, Send) == []
    assert sim.job.failures[0].error_file == "/logs/1/error.json"
    assert records(actions, EventName.WORKER_FAILED)[0].fields["rank"] == 1
    assert sim.job.state is JobState.STOPPING
    assert sim.state(1) is WorkerState.FAILED
    assert {sim.state(0), sim.state(2)} == {WorkerState.STOPPING}
    assert [(f.rank, f.exitcode) for f in sim.job.failures] == [(1, 1)]

    assert finishes(sim.exit(0, -SIGTERM)) == []
    assert finishes(sim.exit(2, -SIGTERM)) == [1]
    assert sim.job.state is JobState.FAILED
    assert len(sim.job.failures) == 1  # the workers we terminated are not failures


def test_a_crash_before_every_rank_registered_is_not_recovered_in_place():
    sim = running(3, spares=1)
    sim.event(0, EventKind.REGISTERED)
    sim.event(1, EventKind.REGISTERED)

    actions = sim.exit(2, 1)

    assert sends(actions, CommandKind.ABORT) == []
    assert sim.job.generation == 0
    assert sim.job.state is JobState.STOPPING


def test_workers_ignoring_sigterm_are_killed_when_the_shutdown_timeout_expires():
    sim = running(3, timeouts=Timeouts(shutdown_timeout=20))
    sim.exit(1, 1)

    sim.advance(19.9)
    assert kills(sim.tick()) == []
    sim.advance(0.1)
    assert sorted(kills(sim.tick(), SIGKILL), key=lambda k: k.slot_id) == [Kill(0, SIGKILL), Kill(2, SIGKILL)]
    sim.exit(0, -SIGKILL)
    assert finishes(sim.exit(2, -SIGKILL)) == [1]


def test_crash_with_one_restart_restarts_every_worker_on_a_fresh_store_then_succeeds():
    sim = running(3, max_restarts=1)

    actions = sim.exit(1, 1)

    assert sim.job.state is JobState.RESTARTING
    assert kills(actions, SIGTERM) == [Kill(0, SIGTERM), Kill(2, SIGTERM)]
    assert records(actions, EventName.RESTART)[0].fields["attempt"] == 1
    assert of(actions, ResetStore) == [] and of(actions, Spawn) == []  # not before the old workers are gone

    assert of(sim.exit(0, -SIGTERM), Spawn) == []
    restarted = sim.exit(2, -SIGTERM)

    assert of(restarted, ResetStore) == [ResetStore(1)]
    assert restarted.index(ResetStore(1)) < restarted.index(of(restarted, Spawn)[0])  # the store first
    assert of(restarted, Spawn) == [Spawn(3 + r, r, 1, 0, 1, False) for r in range(3)]
    assert sim.job.state is JobState.RUNNING and sim.job.attempt == 1
    sim.boot(restarted)
    assert [sim.state(s) for s in sim.rank_slots()] == [WorkerState.RUNNING] * 3
    out = sim.exit(3, 0) + sim.exit(4, 0) + sim.exit(5, 0)
    assert finishes(out) == [0]


def test_a_script_crashing_every_attempt_stops_after_max_restarts_plus_one_attempts():
    sim = Sim(2, max_restarts=2)
    actions = sim.start()
    attempts = 0
    while not finishes(actions):
        attempts += 1
        assert attempts <= 10, "the job never stopped"
        spawns = of(actions, Spawn)
        assert {s.attempt for s in spawns} == {attempts - 1}
        sim.boot(actions)
        actions = sim.exit(spawns[0].slot_id, 1)
        actions += sim.exit(spawns[1].slot_id, -SIGTERM)

    assert attempts == 3
    assert finishes(actions) == [1]
    assert sim.job.state is JobState.FAILED
    assert [f.rank for f in sim.job.failures] == [0, 0, 0]
    assert of(sim.log, ResetStore) == [ResetStore(1), ResetStore(2)]


def test_a_worker_that_cannot_be_spawned_is_a_failure_with_exit_code_127():
    sim = Sim(2)
    sim.start()
    sim.boot([Spawn(0, 0, 0, 0, 0, False)])

    actions = sim._take(sim.job.on_spawn_failed(1, "train.py: no such file", sim.now))

    assert [(f.rank, f.exitcode, f.cause) for f in sim.job.failures] == [(1, 127, "train.py: no such file")]
    assert kills(actions, SIGTERM) == [Kill(0, SIGTERM)]


# --- hangs and stalls ------------------------------------------------------------------------------------------

FAST = Timeouts(heartbeat_interval=0.5, heartbeat_timeout=5.0)
assert FAST.heartbeat_timeout < SETUP_GRACE  # otherwise the grace would not be visible


def test_silence_beyond_heartbeat_timeout_after_setup_kills_the_worker_and_fails_the_job():
    sim = running(2, timeouts=FAST)
    sim.alive(0, step=1)
    sim.alive(1, step=1)  # set-up is over: a step was reported

    sim.advance(4.9)
    sim.alive(0, step=2)
    assert sim.tick() == []
    sim.advance(0.2)  # rank 1 silent for 5.1 s
    sim.alive(0, step=3)
    actions = sim.tick()

    assert kills(actions, SIGKILL) == [Kill(1, SIGKILL)]
    (failed,) = records(actions, EventName.WORKER_FAILED)
    assert failed.fields["rank"] == 1 and "no heartbeat" in failed.fields["cause"]
    assert sim.job.failures[0].exitcode == -SIGKILL
    assert kills(actions, SIGTERM) == [Kill(0, SIGTERM)]
    assert sim.job.state is JobState.STOPPING


def test_silence_during_setup_grace_is_tolerated_but_not_past_it():
    sim = running(2, timeouts=FAST)  # HELLO said, no step reported yet: still importing / setting up

    sim.advance(SETUP_GRACE - 1)
    assert sim.tick() == []

    sim.advance(2)  # past the grace: the ordinary heartbeat timeout applies
    actions = sim.tick()
    assert sorted(k.slot_id for k in kills(actions, SIGKILL)) == [0, 1]


def test_a_worker_whose_script_returned_may_stay_silent_while_it_exits_but_not_forever():
    """torch's exit (process groups, threads, atexit) took 4-7 s on loaded cores, past short heartbeat
    timeouts: after EXITING the silence is the interpreter's exit, bounded by EXIT_GRACE."""
    sim = running(2, timeouts=FAST)
    sim.alive(0, step=1)
    sim.alive(1, step=1)
    sim.event(1, EventKind.EXITING)

    sim.advance(FAST.heartbeat_timeout + 1)
    sim.alive(0, step=2)
    assert sim.tick() == []

    sim.advance(EXIT_GRACE)
    sim.alive(0, step=3)
    actions = sim.tick()
    assert kills(actions, SIGKILL) == [Kill(1, SIGKILL)]
    assert "after its script returned" in records(actions, EventName.WORKER_FAILED)[0].fields["cause"]


def test_a_stopped_worker_is_hung_even_during_setup_grace():
    sim = running(2, timeouts=FAST)
    sim.advance(FAST.heartbeat_timeout + 1)
    sim.alive(0)

    actions = sim.tick(stopped=frozenset({1}))

    assert kills(actions, SIGKILL) == [Kill(1, SIGKILL)]
    assert "stopped" in records(actions, EventName.WORKER_FAILED)[0].fields["cause"]


def test_a_stopped_worker_is_not_hung_before_the_heartbeat_timeout():
    sim = running(2, timeouts=FAST)
    sim.advance(FAST.heartbeat_timeout - 1)

    assert sim.tick(stopped=frozenset({1})) == []


def test_a_worker_that_never_says_hello_fails_after_the_startup_timeout():
    sim = Sim(2, timeouts=Timeouts(startup_timeout=50))
    actions = sim.start()
    sim.spawned(0)
    sim.spawned(1)
    sim.hello(0)

    sim.advance(49)
    sim.alive(0)
    assert sim.tick() == []
    sim.advance(2)
    sim.alive(0)
    actions = sim.tick()

    assert kills(actions, SIGKILL) == [Kill(1, SIGKILL)]
    assert "did not start within 50s" in records(actions, EventName.WORKER_FAILED)[0].fields["cause"]


def test_a_worker_stopped_before_its_hello_is_hung_after_the_heartbeat_timeout():
    sim = Sim(2, timeouts=FAST)  # startup_timeout stays 600 s
    sim.start()
    sim.boot([Spawn(0, 0, 0, 0, 0, False)])
    sim.spawned(1)  # SIGSTOPped while importing: it will never say HELLO

    sim.advance(FAST.heartbeat_timeout - 0.1)
    sim.alive(0)
    assert sim.tick(stopped=frozenset({1})) == []
    sim.advance(0.2)
    sim.alive(0)
    assert sim.job.silent_slots(sim.now) == [1]  # the agent asks the OS about these
    actions = sim.tick(stopped=frozenset({1}))

    assert kills(actions, SIGKILL) == [Kill(1, SIGKILL)]
    assert "stopped before it said hello" in records(actions, EventName.WORKER_FAILED)[0].fields["cause"]


def test_a_silent_worker_before_hello_that_is_not_stopped_waits_for_the_startup_timeout():
    sim = Sim(2, timeouts=FAST)
    sim.start()
    sim.boot([Spawn(0, 0, 0, 0, 0, False)])
    sim.spawned(1)  # a slow import, still running

    sim.advance(100)
    sim.alive(0)
    assert sim.tick() == []


def test_silent_slots_are_those_with_a_process_silent_beyond_the_heartbeat_timeout():
    sim = Sim(3, timeouts=FAST)
    sim.start()
    sim.spawned(0)
    sim.spawned(1)  # slot 2 has no process yet
    sim.hello(0)

    sim.advance(FAST.heartbeat_timeout + 1)
    sim.alive(0)

    assert sim.job.silent_slots(sim.now) == [1]


def test_a_worker_stuck_at_one_step_beyond_the_progress_timeout_is_stalled():
    sim = running(2, timeouts=Timeouts(heartbeat_timeout=5, progress_timeout=20))
    sim.alive(0, step=3)
    sim.alive(1, step=3)
    for step in range(4, 9):  # rank 1 keeps stepping; rank 0 heartbeats but stays at step 3
        sim.advance(4)
        sim.alive(0, step=3)
        sim.alive(1, step=step)
        assert sim.tick() == []

    sim.advance(1.5)  # 21.5 s at step 3
    sim.alive(0, step=3)
    sim.alive(1, step=9)
    actions = sim.tick()

    assert kills(actions, SIGKILL) == [Kill(0, SIGKILL)]
    assert "stalled" in records(actions, EventName.WORKER_FAILED)[0].fields["cause"]


def test_a_finishing_worker_is_never_stalled():
    sim = swift_running(2, spares=0, timeouts=Timeouts(heartbeat_timeout=5, progress_timeout=20))
    for slot_id in (0, 1):
        sim.alive(slot_id, step=9)
    sim.event(0, EventKind.FINISHING)  # waits for rank 1, which is still on its last step

    sim.advance(21)
    sim.heartbeat_all()
    actions = sim.tick()

    assert [k.slot_id for k in kills(actions, SIGKILL)] == [1]


def test_stall_detection_is_off_unless_a_progress_timeout_is_set():
    sim = running(2, timeouts=Timeouts(heartbeat_timeout=5))
    sim.alive(0, step=3)
    sim.alive(1, step=3)
    for _ in range(100):
        sim.advance(4)
        sim.heartbeat_all()
        assert sim.tick() == []


def test_workers_of_an_executable_run_without_heartbeats_and_are_never_hung():
    sim = Sim(2, timeouts=FAST)
    sim.config = LaunchConfig(entrypoint=Entrypoint(EntrypointKind.EXECUTABLE, "/bin/true"), nproc_per_node=2,
                              timeouts=FAST)
    sim.job = Job(sim.config, sim.now)
    actions = sim.start()
    for spawn in of(actions, Spawn):
        sim.spawned(spawn.slot_id)  # no HELLO: nothing inside speaks the protocol

    assert [sim.state(s) for s in (0, 1)] == [WorkerState.RUNNING] * 2
    sim.advance(10_000)
    assert sim.tick() == []


# --- Swift: start-up -------------------------------------------------------------------------------------------


def test_start_is_sent_to_every_rank_once_all_registered_and_brings_up_the_spares():
    sim = running(3, spares=1)

    assert sim.event(0, EventKind.REGISTERED) + sim.event(2, EventKind.REGISTERED) == []
    actions = sim.event(1, EventKind.REGISTERED)

    assert sorted(s.slot_id for s in sends(actions, CommandKind.START)) == [0, 1, 2]
    assert all(s.generation == 0 for s in sends(actions, CommandKind.START))
    assert of(actions, Spawn) == [Spawn(3, None, 0, 0, 0, False)]
    assert sim.event(1, EventKind.REGISTERED) == []  # START goes out once


def test_registration_is_counted_per_current_slot_of_each_rank_across_a_start_up_restart():
    """The O(1) bookkeeping behind START: a rank counts as registered only through the slot serving it now, so
    registrations of the previous attempt count for nothing and START waits for every new slot."""
    sim = booting(2, spares=0)
    sim.event(0, EventKind.REGISTERED)
    assert sim.job._unregistered == {1}
    _startup_restart(sim, 1, -SIGKILL)  # a start-up failure: every worker starts again (attempt 1)
    assert sim.job._unregistered == {0, 1}
    sim.boot([Spawn(s, r, 1, 0, 1, False) for r, s in enumerate(sim.rank_slots())])

    assert sim.event(0, EventKind.REGISTERED) == []  # an old slot's (stale) registration changes nothing
    assert sends(sim.event(sim.slot(0), EventKind.REGISTERED), CommandKind.START) == []
    assert sim.job._unregistered == {1}
    actions = sim.event(sim.slot(1), EventKind.REGISTERED)

    assert sorted(s.slot_id for s in sends(actions, CommandKind.START)) == sorted(sim.rank_slots())
    assert sim.job._unregistered == set() and sim.job.swift_started


def test_no_spare_is_started_with_spares_zero():
    sim = running(2, spares=0)
    actions = sim.event(0, EventKind.REGISTERED) + sim.event(1, EventKind.REGISTERED)
    assert len(sends(actions, CommandKind.START)) == 2
    assert of(actions, Spawn) == []


def test_a_dead_spare_is_replaced_and_spares_that_keep_dying_are_given_up():
    sim = swift_running(2, spares=1)
    for _ in range(3):
        (spare,) = sim.spares()
        replacement = of(sim.exit(spare, 1), Spawn)
        sim.boot(replacement)
    assert len(replacement) == 0  # the third death in a row: no more spares
    assert sim.spares() == []
    assert sim.job.state is JobState.RUNNING  # a spare's death never touches the ranks


# --- Swift: in-place recovery ----------------------------------------------------------------------------------


def test_crash_begins_in_place_recovery_with_abort_to_survivors_and_a_cold_replacement():
    sim = swift_running(3, spares=0)

    actions = sim.exit(1, -SIGKILL)

    assert sim.job.generation == 1
    assert sim.job.state is JobState.RECOVERING
    aborts = sends(actions, CommandKind.ABORT)
    assert [(a.slot_id, a.generation) for a in aborts] == [(0, 1), (2, 1)]
    assert of(actions, Spawn) == [Spawn(3, 1, 1, 1, 0, True)]
    assert kills(actions, SIGTERM) == []  # survivors keep their state
    assert [sim.state(s) for s in (0, 2)] == [WorkerState.ABORTING] * 2
    (start,) = records(actions, EventName.RECOVERY_START)
    assert start.fields["generation"] == 1 and start.fields["failed_ranks"] == [1]
    assert sim.slot(1) == 3


def test_crash_assigns_a_ready_spare_to_the_failed_rank_and_starts_a_new_spare():
    sim = swift_running(3, spares=1)
    (spare,) = sim.spares()

    actions = sim.exit(1, -SIGKILL)

    assert of(actions, Assign) == [Assign(spare, 1, 1, 1, 0)]
    assert of(actions, Spawn) == [Spawn(spare + 1, None, 0, 1, 0, False)]  # the replenished spare
    assert sim.slot(1) == spare
    assert sim.state(spare) is WorkerState.JOINING


def test_a_spare_that_has_not_said_hello_is_not_assigned():
    sim = running(3, spares=1)
    for slot_id in sim.rank_slots():
        started = sim.event(slot_id, EventKind.REGISTERED)
    (spare,) = [s.slot_id for s in of(started, Spawn)]
    sim.spawned(spare)  # still importing torch

    actions = sim.exit(1, -SIGKILL)

    assert of(actions, Assign) == []
    assert [(s.rank, s.joining) for s in of(actions, Spawn)] == [(1, True)]


def _cold_recovery(nproc: int = 3, **config: Any) -> tuple[Sim, int]:
    """Rank 1 crashed; its cold replacement was spawned. Returns the sim and the replacement's slot."""
    sim = swift_running(nproc, spares=0, **config)
    (spawn,) = of(sim.exit(1, -SIGKILL), Spawn)
    sim.spawned(spawn.slot_id)
    return sim, spawn.slot_id


@pytest.mark.parametrize("order", list(itertools.permutations(["rank0", "rank2", "replacement"])))
def test_recover_is_sent_only_after_every_survivor_aborted_and_the_replacement_joined(order):
    sim, new = _cold_recovery()
    steps = {
        "rank0": lambda: sim.event(0, EventKind.ABORTED),
        "rank2": lambda: sim.event(2, EventKind.ABORTED),
        "replacement": lambda: sim.hello(new) + sim.event(new, EventKind.JOINING),
    }

    for name in order[:-1]:
        assert sends(steps[name](), CommandKind.RECOVER) == []
    recover = sends(steps[order[-1]](), CommandKind.RECOVER)

    assert sorted(r.slot_id for r in recover) == [0, 2, new]
    assert all(r.generation == 1 for r in recover)
    assert recover[0].args == {"world_size": 3, "replaced": [1], "per_rank_rng": False}
    assert [sim.state(s) for s in (0, new, 2)] == [WorkerState.RECOVERING] * 3


def test_a_hung_rank_of_a_swift_job_is_killed_and_recovered_in_place_with_the_silence_as_detection_time():
    sim = swift_running(3, spares=1, timeouts=FAST)
    (spare,) = sim.spares()
    for slot_id in (0, 1, 2, spare):
        sim.alive(slot_id, step=4)
    t_last = sim.now

    sim.advance(FAST.heartbeat_timeout + 0.5)
    for slot_id in (0, 2, spare):
        sim.alive(slot_id)
    actions = sim.tick()

    assert kills(actions, SIGKILL) == [Kill(1, SIGKILL)]
    assert of(actions, Assign) == [Assign(spare, 1, 1, 1, 0)]
    assert sim.job.state is JobState.RECOVERING
    (detect,) = [r for r in records(actions, EventName.RECOVERY_PHASE) if r.fields["phase"] == "detect"]
    # detection is bounded by the heartbeat timeout: the rank may have hung any time after its last message
    assert detect.fields["duration"] == pytest.approx(FAST.heartbeat_timeout)
    assert detect.fields["start"] == pytest.approx(sim.now - FAST.heartbeat_timeout)
    assert sim.now - t_last > FAST.heartbeat_timeout


def test_a_replacement_that_says_hello_during_recovery_is_joining():
    sim, new = _cold_recovery()
    sim.hello(new)
    assert sim.state(new) is WorkerState.JOINING


def _all_ready(sim: Sim, new: list[int], survivors: list[int]) -> list[Action]:
    actions: list[Action] = []
    for slot_id in survivors:
        actions += sim.event(slot_id, EventKind.ABORTED)
    for slot_id in new:
        if not sim.job.slots[slot_id].hello:
            actions += sim.hello(slot_id)
        actions += sim.event(slot_id, EventKind.JOINING)
    return actions


def test_resume_is_sent_only_after_every_rank_recovered_and_the_job_runs_again():
    sim, new = _cold_recovery()
    _all_ready(sim, [new], [0, 2])

    assert sends(sim.event(0, EventKind.RECOVERED) + sim.event(new, EventKind.RECOVERED), CommandKind.RESUME) == []
    assert sim.job.state is JobState.RECOVERING
    actions = sim.event(2, EventKind.RECOVERED)

    resume = sends(actions, CommandKind.RESUME)
    assert sorted(r.slot_id for r in resume) == [0, 2, new] and {r.generation for r in resume} == {1}
    assert sim.job.state is JobState.RUNNING
    assert [sim.state(s) for s in sim.rank_slots()] == [WorkerState.RUNNING] * 3
    assert sim.job.recovery is None and sim.job.last_recovery is not None and sim.job.last_recovery.done


def test_recovered_for_an_older_generation_does_not_count():
    sim, new = _cold_recovery()
    _all_ready(sim, [new], [0, 2])
    sim.event(0, EventKind.RECOVERED)
    sim.event(new, EventKind.RECOVERED)

    assert sends(sim.event(2, EventKind.RECOVERED, gen=0), CommandKind.RESUME) == []
    assert sim.job.state is JobState.RECOVERING


def test_an_aborted_for_an_older_generation_is_answered_with_a_new_abort_and_does_not_count():
    sim, new = _cold_recovery()
    sim.hello(new)
    sim.event(new, EventKind.JOINING)
    sim.event(2, EventKind.ABORTED)

    actions = sim.event(0, EventKind.ABORTED, gen=0)  # it answered something older than generation 1

    assert [(a.slot_id, a.generation) for a in sends(actions, CommandKind.ABORT)] == [(0, 1)]
    assert sends(actions, CommandKind.RECOVER) == []
    assert sends(sim.event(0, EventKind.ABORTED, gen=1), CommandKind.RECOVER) != []


def test_a_recovery_is_recorded_from_start_through_its_phases_to_its_end():
    sim, new = _cold_recovery()  # the crash was at t=100
    t_fail = sim.now
    sim.advance(0.5)
    _all_ready(sim, [new], [0, 2])
    sim.advance(0.25)
    data = {"phases": {"rebuild": 0.01, "consensus": 0.002, "undo": 0.0, "transfer": 0.2},
            "plan": {"mode": "roll-forward", "source": 0, "undo": [2]}}
    sim.event(0, EventKind.RECOVERED, **data)
    inexact = "step 4's SGD update was inverted arithmetically, not restored bitwise (--no-exact-undo)"
    sim.event(2, EventKind.RECOVERED, **{"phases": {**data["phases"], "transfer": 0.1},
                                         "plan": {**data["plan"], "inexact": inexact}})  # the rank that undid

    direct = sim.job.on_event(new, 1, EventKind.RECOVERED, {**data, "phases": {**data["phases"], "transfer": 0.3}},
                              sim.now)
    drained = sim.job.drain_records()
    sim.log += direct + drained

    assert [r.fields["generation"] for r in records(sim.log, EventName.RECOVERY_START)] == [1]
    assert phases(sim.log) == ["detect", "abort", "spawn", "rebuild", "consensus", "undo", "transfer", "resume"]
    transfer = [r for r in records(sim.log, EventName.RECOVERY_PHASE) if r.fields["phase"] == "transfer"]
    assert transfer[0].fields["duration"] == 0.3  # the slowest rank's
    assert records(direct, EventName.RECOVERY_END) == []  # it comes through drain_records
    (end,) = records(drained, EventName.RECOVERY_END)
    assert end.fields["outcome"] == "recovered" and end.fields["generation"] == 1
    assert end.fields["failed_ranks"] == [1]
    assert end.fields["mode"] == "roll-forward" and end.fields["source_rank"] == 0
    assert end.fields["undo"] == [2]  # a pipeline replay's mode is "replay", even where survivors undid a step
    assert end.fields["inexact"] == inexact  # any rank's arithmetic undo makes the recovery inexact
    assert end.fields["total"] == pytest.approx(sim.now - t_fail)
    assert sim.job.time_lost == pytest.approx(0.75)
    assert sim.job.last_recovery.phase_duration[RecoveryPhase.TRANSFER] == 0.3
    assert sim.job.drain_records() == []  # drained once


def test_abort_phase_ends_when_the_survivors_reported_even_while_a_cold_replacement_starts():
    sim, new = _cold_recovery()
    sim.advance(0.05)
    sim.event(0, EventKind.ABORTED)
    actions = sim.event(2, EventKind.ABORTED)

    assert phases(actions) == ["abort"]
    assert records(actions, EventName.RECOVERY_PHASE)[0].fields["duration"] == pytest.approx(0.05)


def test_abort_phase_ends_when_the_survivors_reported_with_a_warm_spare_replacement():
    sim = swift_running(3, spares=1)
    sim.exit(1, -SIGKILL)
    sim.advance(0.05)
    sim.event(0, EventKind.ABORTED)

    actions = sim.event(2, EventKind.ABORTED)

    assert phases(actions) == ["abort"]
    assert records(actions, EventName.RECOVERY_PHASE)[0].fields["duration"] == pytest.approx(0.05)


def test_a_second_failure_during_recovery_moves_the_same_recovery_to_generation_two():
    sim, new1 = _cold_recovery(4)
    sim.hello(new1)
    sim.event(new1, EventKind.JOINING)
    sim.event(0, EventKind.ABORTED)
    recovery = sim.job.recovery

    actions = sim.exit(2, -SIGKILL)

    assert sim.job.generation == 2 and sim.job.recovery is recovery
    assert recovery.failed_ranks == (1, 2)
    (start,) = records(actions, EventName.RECOVERY_START)
    assert start.fields["during_recovery"] is True and start.fields["generation"] == 2
    assert sorted((a.slot_id, a.generation) for a in sends(actions, CommandKind.ABORT)) == [(0, 2), (3, 2), (new1, 2)]
    (spawn,) = of(actions, Spawn)  # only rank 2 is new; rank 1's replacement stays
    assert (spawn.rank, spawn.incarnation, spawn.generation, spawn.joining) == (2, 1, 2, True)
    new2 = spawn.slot_id
    assert sim.slot(1) == new1

    # what was ready for generation 1 does not count for generation 2
    sim.spawned(new2)
    sim.event(3, EventKind.ABORTED)
    assert sends(sim.hello(new2) + sim.event(new2, EventKind.JOINING), CommandKind.RECOVER) == []
    sim.event(0, EventKind.ABORTED)
    recover = sends(sim.event(new1, EventKind.JOINING), CommandKind.RECOVER)
    assert sorted(r.slot_id for r in recover) == sorted([0, 3, new1, new2])
    assert recover[0].args["replaced"] == [1, 2] and recover[0].generation == 2

    for slot_id in (0, 3, new1, new2):
        sim.event(slot_id, EventKind.RECOVERED)
    assert sim.job.state is JobState.RUNNING
    (end,) = records(sim.log, EventName.RECOVERY_END)
    assert end.fields["generation"] == 2 and end.fields["failed_ranks"] == [1, 2]


def test_a_replacement_still_starting_at_a_second_failure_joins_the_new_generation():
    sim, new1 = _cold_recovery(3)  # rank 1's replacement has not said HELLO yet

    actions = sim.exit(2, -SIGKILL)

    assert [a.slot_id for a in sends(actions, CommandKind.ABORT)] == [0]  # nothing to send to before HELLO
    (spawn,) = of(actions, Spawn)
    sim.spawned(spawn.slot_id)
    sim.event(0, EventKind.ABORTED)
    sim.hello(spawn.slot_id)
    sim.event(spawn.slot_id, EventKind.JOINING)
    sim.hello(new1)
    recover = sends(sim.event(new1, EventKind.JOINING), CommandKind.RECOVER)
    assert sorted(r.slot_id for r in recover) == sorted([0, new1, spawn.slot_id])


def test_a_replacement_crashing_during_recovery_is_replaced_again():
    sim, new = _cold_recovery()
    sim.hello(new)

    actions = sim.exit(new, 1)

    (spawn,) = of(actions, Spawn)
    assert (spawn.rank, spawn.incarnation, spawn.generation, spawn.joining) == (1, 2, 2, True)
    assert sim.job.recovery.failed_ranks == (1,)


def _recover_fully(sim: Sim, failed_rank: int) -> None:
    actions = sim.exit(sim.slot(failed_rank), -SIGKILL)
    survivors = [sim.slot(r) for r in range(sim.config.world_size) if r != failed_rank]
    replacement = [a.slot_id for a in of(actions, Assign)] + [s.slot_id for s in of(actions, Spawn) if s.rank is not None]
    for spawn in of(actions, Spawn):
        sim.spawned(spawn.slot_id)
    _all_ready(sim, replacement, survivors)
    for slot_id in sim.rank_slots():
        sim.event(slot_id, EventKind.RECOVERED)
    assert sim.job.state is JobState.RUNNING


def test_an_exhausted_recovery_budget_falls_back_to_restarting_every_worker():
    sim = swift_running(3, spares=0, max_recoveries=1, max_restarts=1)
    _recover_fully(sim, 1)
    ranks = sim.rank_slots()

    actions = sim.exit(sim.slot(2), 1)

    assert sends(actions, CommandKind.ABORT) == []
    assert sim.job.generation == 1 and sim.job.state is JobState.RESTARTING
    assert sorted(k.slot_id for k in kills(actions, SIGTERM)) == sorted([ranks[0], ranks[1]])
    assert len(records(actions, EventName.RESTART)) == 1
    sim.exit(ranks[0], -SIGTERM)
    restarted = sim.exit(ranks[1], -SIGTERM)
    assert of(restarted, ResetStore) == [ResetStore(1)]
    assert [(s.rank, s.attempt, s.joining) for s in of(restarted, Spawn)] == [(r, 1, False) for r in range(3)]


def test_a_restart_after_an_in_place_recovery_keeps_the_generation_in_spawns_and_commands():
    """The generation never goes back: restarted workers are started in it and every command carries it (the
    runtime must treat it as its base generation, not as an abort; see the report on runtime/core/recovery.py)."""
    sim = swift_running(2, spares=0, max_recoveries=1, max_restarts=1)
    _recover_fully(sim, 1)
    old = sim.rank_slots()
    sim.exit(old[0], 1)
    restarted = sim.exit(old[1], -SIGTERM)
    assert {s.generation for s in of(restarted, Spawn)} == {1}
    sim.boot(restarted)

    start = sim.event(sim.slot(0), EventKind.REGISTERED) + sim.event(sim.slot(1), EventKind.REGISTERED)
    release = sim.event(sim.slot(0), EventKind.FINISHING) + sim.event(sim.slot(1), EventKind.FINISHING)

    assert [s.generation for s in sends(start, CommandKind.START)] == [1, 1]
    assert [s.generation for s in sends(release, CommandKind.RELEASE)] == [1, 1]
    assert sim.job.state is JobState.RUNNING and sim.job.recovery is None


def test_an_exhausted_recovery_budget_without_restarts_stops_the_job():
    sim = swift_running(3, spares=0, max_recoveries=0)

    actions = sim.exit(1, 1)

    assert sends(actions, CommandKind.ABORT) == [] and of(actions, Spawn) == []
    assert sim.job.state is JobState.STOPPING
    sim.exit(0, -SIGTERM)
    assert finishes(sim.exit(2, -SIGTERM)) == [1]


def test_recovery_mode_restart_never_recovers_in_place():
    sim = swift_running(2, spares=1, recovery=RecoveryMode.RESTART, max_restarts=1)
    assert sim.spares() == []  # spares only serve in-place recovery

    actions = sim.exit(1, -SIGKILL)

    assert sends(actions, CommandKind.ABORT) == []
    assert sim.job.state is JobState.RESTARTING


def test_a_single_rank_job_is_never_recovered_in_place():
    sim = swift_running(1, spares=1)
    (spare,) = sim.spares()

    actions = sim.exit(0, -SIGKILL)

    assert of(actions, Assign) == [] and sends(actions, CommandKind.ABORT) == []
    assert kills(actions) == [Kill(0, SIGKILL), Kill(spare, SIGTERM)]
    assert finishes(sim.exit(spare, -SIGTERM)) == [1]


def test_a_failure_after_a_rank_already_exited_is_not_recovered_in_place():
    sim = swift_running(3, spares=0)
    sim.exit(0, 0)

    actions = sim.exit(1, 1)

    assert sends(actions, CommandKind.ABORT) == []
    assert sim.job.state is JobState.STOPPING


@pytest.mark.parametrize(("max_restarts", "expected"), [(0, JobState.STOPPING), (1, JobState.RESTARTING)])
def test_unrecoverable_during_recovery_escalates_and_closes_the_recovery(max_restarts, expected):
    sim, new = _cold_recovery(max_restarts=max_restarts)
    sim.hello(new)

    actions = sim.event(0, EventKind.UNRECOVERABLE, reason="optimizer cannot be inverted")

    assert sim.job.state is expected
    assert sim.job.recovery is None
    (end,) = records(actions, EventName.RECOVERY_END)
    assert end.fields["outcome"] == "escalated"
    assert sorted(k.slot_id for k in kills(actions, SIGTERM)) == [0, 2, new]
    if max_restarts:
        assert "rank 0: optimizer cannot be inverted" in records(actions, EventName.RESTART)[0].fields["reason"]


def test_the_recovery_deadline_kills_a_survivor_that_never_aborted_and_replaces_it():
    sim = swift_running(3, spares=0, timeouts=Timeouts(recovery_timeout=60))
    (spawn,) = of(sim.exit(1, -SIGKILL), Spawn)
    new = spawn.slot_id
    sim.spawned(new)
    sim.event(0, EventKind.ABORTED)
    sim.hello(new)
    sim.event(new, EventKind.JOINING)  # rank 2 heartbeats but never reports ABORTED

    sim.advance(59.9)
    sim.heartbeat_all()
    assert [(a.slot_id, a.command) for a in sim.tick()] == [(2, CommandKind.ABORT)]  # asked again, in vain
    sim.advance(0.1)
    sim.heartbeat_all()
    actions = sim.tick()

    assert kills(actions, SIGKILL) == [Kill(2, SIGKILL)]
    cause = records(actions, EventName.WORKER_FAILED)[0].fields["cause"]
    assert "did not answer the abort of recovery 1 within 60s" in cause
    assert sim.job.generation == 2
    assert [(s.rank, s.incarnation, s.joining) for s in of(actions, Spawn)] == [(2, 1, True)]
    assert sim.job.recovery.deadline == sim.now + 60


def test_an_unanswered_abort_is_sent_again_until_answered_and_repeats_are_harmless():
    """One lost ABORT (or ABORTED) must not stall a recovery for --recovery-timeout: the launcher repeats the
    ABORT to the ranks that owe an answer, every RESEND_INTERVAL; a repeated answer changes nothing."""
    sim, new = _cold_recovery()
    assert sends(sim.tick(), CommandKind.ABORT) == []  # not yet due
    sim.advance(RESEND_INTERVAL)
    sim.heartbeat_all()
    again = sends(sim.tick(), CommandKind.ABORT)
    # the survivors (rank 0, rank 2) again; the replacement has no link yet (no HELLO)
    assert [(a.slot_id, a.generation) for a in again] == [(0, 1), (2, 1)]
    sim.event(0, EventKind.ABORTED)
    sim.event(0, EventKind.ABORTED)  # its answer to the repeat: nothing changes
    sim.hello(new)
    sim.advance(RESEND_INTERVAL)
    sim.heartbeat_all()
    again = sends(sim.tick(), CommandKind.ABORT)
    assert [a.slot_id for a in again] == [new, 2]  # rank 0 answered; rank 1 (the replacement) said HELLO only
    assert sends(sim.event(new, EventKind.JOINING), CommandKind.RECOVER) == []
    recover = sends(sim.event(2, EventKind.ABORTED), CommandKind.RECOVER)
    assert sorted(r.slot_id for r in recover) == [0, 2, new]
    assert sends(sim.event(2, EventKind.ABORTED), CommandKind.RECOVER) == []  # a repeat sends no second RECOVER


def test_an_unanswered_recover_is_sent_again_and_a_repeated_recovered_resumes_once():
    sim, new = _cold_recovery()
    (recover, *_) = sends(_all_ready(sim, [new], [0, 2]), CommandKind.RECOVER)
    sim.event(0, EventKind.RECOVERED)
    sim.event(new, EventKind.RECOVERED)
    sim.advance(RESEND_INTERVAL)
    sim.heartbeat_all()
    actions = sim.tick()
    assert sends(actions, CommandKind.ABORT) == []
    (again,) = sends(actions, CommandKind.RECOVER)
    assert (again.slot_id, again.generation, again.args) == (2, 1, recover.args)
    resume = sends(sim.event(2, EventKind.RECOVERED), CommandKind.RESUME)
    assert sorted(r.slot_id for r in resume) == [0, 2, new]
    assert sim.job.state is JobState.RUNNING
    assert sim.event(2, EventKind.RECOVERED) == []  # its answer to the last repeat, after the recovery ended
    sim.advance(RESEND_INTERVAL)
    sim.heartbeat_all()
    assert sim.tick() == []
    ended = [r for r in sim.log if isinstance(r, Record) and r.event is EventName.RECOVERY_END]
    assert len(ended) == 1


def test_the_recovery_deadline_after_recover_kills_ranks_that_did_not_recover():
    sim = swift_running(3, spares=1, timeouts=Timeouts(recovery_timeout=60))
    sim.exit(1, -SIGKILL)
    new = sim.slot(1)
    _all_ready(sim, [new], [0, 2])
    sim.event(0, EventKind.RECOVERED)
    sim.event(new, EventKind.RECOVERED)

    sim.advance(60)
    sim.heartbeat_all()
    actions = sim.tick()

    assert kills(actions, SIGKILL) == [Kill(2, SIGKILL)]
    assert sim.job.generation == 2


# --- signals ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [SIGTERM, SIGINT, signal.SIGHUP])
def test_a_signal_is_forwarded_to_every_worker_and_sets_exit_code_128_plus_signum(signum):
    sim = swift_running(2, spares=1)
    (spare,) = sim.spares()

    actions = sim.signal(signum)

    assert sorted(k.slot_id for k in kills(actions, signum)) == [0, 1, spare]
    assert kills(actions, SIGKILL) == []
    assert sim.job.state is JobState.STOPPING
    assert len(of(actions, Note)) == 1
    sim.exit(0, -signum)
    sim.exit(spare, -signum)
    assert finishes(sim.exit(1, -signum)) == [128 + signum]
    assert sim.job.failures == []


def test_a_second_signal_kills_every_live_worker():
    sim = running(3)
    sim.signal(SIGINT)
    sim.exit(0, -SIGINT)

    actions = sim.signal(SIGINT)

    assert sorted(kills(actions), key=lambda k: k.slot_id) == [Kill(1, SIGKILL), Kill(2, SIGKILL)]


def test_a_signal_during_recovery_stops_the_job_and_closes_the_recovery():
    sim, new = _cold_recovery()

    actions = sim.signal(SIGTERM)

    assert sim.job.state is JobState.STOPPING and sim.job.recovery is None
    assert records(actions, EventName.RECOVERY_END)[0].fields["outcome"] == "stopped"


# --- deadlines -------------------------------------------------------------------------------------------------


def test_next_deadline_is_the_earliest_of_heartbeat_check_recovery_and_shutdown():
    sim = swift_running(3, spares=0, timeouts=Timeouts(heartbeat_interval=0.5, recovery_timeout=0.2))
    assert sim.job.next_deadline(sim.now) == pytest.approx(sim.now + 0.5)
    sim.exit(1, -SIGKILL)
    assert sim.job.next_deadline(sim.now) == pytest.approx(sim.now + 0.2)


# --- behaviour that looks wrong --------------------------------------------------------------------------------


def test_spares_terminated_by_a_restart_do_not_count_as_spare_failures():
    sim = swift_running(2, spares=1, max_recoveries=0, max_restarts=3)
    for _ in range(3):
        (spare,) = sim.spares()
        actions = sim.exit(sim.slot(0), 1)  # no recovery budget: restart every worker
        assert Kill(spare, SIGTERM) in kills(actions)
        sim.exit(spare, -SIGTERM)
        restarted = sim.exit(sim.slot(1), -SIGTERM)
        sim.boot(restarted)
        for rank in range(2):
            sim.boot(sim.event(sim.slot(rank), EventKind.REGISTERED))

    assert sim.job.spare_failures == 0
    assert len(sim.spares()) == 1


def test_a_spare_that_never_says_hello_is_killed_and_replaced():
    sim = running(2, spares=1, timeouts=Timeouts(startup_timeout=50))
    started = sim.event(0, EventKind.REGISTERED) + sim.event(1, EventKind.REGISTERED)
    (spare,) = [s.slot_id for s in of(started, Spawn)]
    sim.spawned(spare)

    sim.advance(51)
    sim.alive(0)
    sim.alive(1)
    actions = sim.tick()
    actions += sim.exit(spare, -SIGKILL)

    assert Kill(spare, SIGKILL) in actions
    assert [(s.rank, s.joining) for s in of(actions, Spawn)] == [(None, False)]


# --- the lifecycle of a rank: starting, running, finishing -----------------------------------------------------


def test_a_rank_of_a_script_that_registers_is_starting_until_it_registered():
    sim = booting(2, spares=0)
    assert [sim.state(s) for s in sim.rank_slots()] == [WorkerState.STARTING] * 2  # HELLO said, still importing

    actions = sim.event(0, EventKind.REGISTERED)

    assert sim.state(0) is WorkerState.RUNNING and sim.state(1) is WorkerState.STARTING
    assert records(actions, EventName.WORKER_STATE)[0].fields["state"] == "running"


def test_a_rank_that_reports_progress_without_registering_is_running():
    sim = booting(2, spares=0)  # e.g. a script that only calls swiftrun.report()
    sim._take(sim.job.on_status(1, sim.now, 3, 0.5, 0.1, {}))
    assert sim.state(1) is WorkerState.RUNNING


def test_a_one_process_job_is_running_at_hello_since_run_stays_inert_there():
    sim = booting(1)
    assert sim.state(0) is WorkerState.RUNNING
    assert sim.spares() == []  # nothing to recover in place: no spare


def test_a_rank_that_finished_its_loop_is_finishing_until_it_exits():
    sim = swift_running(2, spares=0)

    actions = sim.event(0, EventKind.FINISHING)

    assert sim.state(0) is WorkerState.FINISHING and sim.state(1) is WorkerState.RUNNING
    assert records(actions, EventName.WORKER_STATE)[0].fields == {
        "rank": 0, "incarnation": 0, "pid": 1000, "state": "finishing", "previous": "running"}
    sim.event(1, EventKind.FINISHING)
    assert sim.state(1) is WorkerState.FINISHING  # released: saving and exiting
    sim.exit(0, 0)
    assert sim.state(0) is WorkerState.EXITED


def test_a_finishing_rank_becomes_aborting_when_a_peer_fails_before_release():
    sim = swift_running(3, spares=0)
    sim.event(0, EventKind.FINISHING)

    actions = sim.exit(1, -SIGKILL)

    assert sim.job.state is JobState.RECOVERING and sim.state(0) is WorkerState.ABORTING
    assert of(actions, Spawn)  # a replacement: the failure came before RELEASE


# --- warm spares from the start --------------------------------------------------------------------------------


def test_the_spares_of_a_script_that_registers_start_with_the_workers():
    sim = Sim(3, registers=True, spares=2)

    actions = sim.start()

    assert of(actions, Spawn) == [Spawn(i, i, 0, 0, 0, False) for i in range(3)] + [
        Spawn(3, None, 0, 0, 0, False), Spawn(4, None, 0, 0, 0, False)]
    sim.boot(actions)
    started = []
    for slot_id in sim.rank_slots():
        started += sim.event(slot_id, EventKind.REGISTERED)
    assert of(started, Spawn) == []  # START brings up no more: they are there already


@pytest.mark.parametrize("config", [{"recovery": RecoveryMode.RESTART}, {"spares": 0}])
def test_no_spare_at_start_in_restart_mode_or_with_spares_zero(config):
    sim = Sim(3, registers=True, **config)
    assert [s.rank for s in of(sim.start(), Spawn)] == [0, 1, 2]


def test_a_spare_that_warmed_up_during_start_up_replaces_a_rank_failing_in_the_first_step():
    sim = booting(3, spares=1)
    (spare,) = sim.spares()
    for slot_id in sim.rank_slots():
        sim.event(slot_id, EventKind.REGISTERED)

    actions = sim.exit(1, -SIGKILL)

    assert of(actions, Assign) == [Assign(spare, 1, 1, 1, 0)]


def test_spares_are_stopped_by_a_start_up_restart_and_started_again_with_the_new_attempt():
    sim = booting(2, spares=1)
    (spare,) = sim.spares()

    actions = sim.exit(1, -SIGKILL)
    assert Kill(spare, SIGTERM) in kills(actions)
    sim.exit(spare, -SIGTERM)
    restarted = sim.exit(0, -SIGTERM)

    assert [(s.rank, s.attempt) for s in of(restarted, Spawn)] == [(0, 1), (1, 1), (None, 1)]
    assert sim.job.spare_failures == 0


# --- a failure while the job starts ----------------------------------------------------------------------------


def _startup_restart(sim: Sim, failed_slot: int, rc: int) -> list[Action]:
    """``failed_slot`` fails with ``rc``; the others are stopped; returns every action up to the new attempt (or
    the end of the job)."""
    actions = sim.exit(failed_slot, rc)
    for slot in list(sim.job.slots.values()):
        if slot.alive and slot.state in (WorkerState.RESTARTING, WorkerState.STOPPING):
            actions += sim.exit(slot.slot_id, -SIGTERM)
    return actions


def test_a_rank_killed_by_a_signal_before_every_rank_registered_restarts_everyone_without_using_max_restarts():
    sim = booting(3, spares=0)
    sim.event(0, EventKind.REGISTERED)

    first = sim.exit(1, -SIGKILL)

    assert sim.job.state is JobState.RESTARTING
    assert sorted(k.slot_id for k in kills(first, SIGTERM)) == [0, 2]
    (restart,) = records(first, EventName.RESTART)
    assert restart.fields["attempt"] == 1 and restart.fields["startup"] is True
    assert (restart.fields["startup_restart"], restart.fields["startup_restarts"]) == (1, 3)
    assert "start-up failure" in restart.fields["reason"] and "SIGKILL" in restart.fields["reason"]
    assert any("start-up restart 1 of 3" in n.text and "not counted in --max-restarts" in n.text
               for n in of(first, Note))
    sim.exit(0, -SIGTERM)
    restarted = sim.exit(2, -SIGTERM)

    assert of(restarted, ResetStore) == [ResetStore(1)]
    assert [(s.rank, s.attempt, s.joining) for s in of(restarted, Spawn)] == [(0, 1, False), (1, 1, False),
                                                                               (2, 1, False)]
    assert (sim.job.attempt, sim.job.restarts_used, sim.job.startup_restarts_used) == (1, 0, 1)
    assert sim.job.state is JobState.RUNNING


@pytest.mark.parametrize("rc", [-signal.SIGSEGV, -signal.SIGBUS, -SIGKILL])
def test_any_death_by_signal_during_start_up_is_an_infrastructure_failure(rc):
    sim = booting(2, spares=0)
    _startup_restart(sim, 0, rc)
    assert sim.job.attempt == 1 and sim.job.state is JobState.RUNNING


def test_a_rank_stopped_during_start_up_is_hung_and_restarts_everyone():
    sim = booting(2, spares=0, timeouts=FAST)
    sim.advance(FAST.heartbeat_timeout + 0.1)
    sim.alive(0)

    actions = sim.tick(stopped=frozenset({1}))

    assert kills(actions, SIGKILL) == [Kill(1, SIGKILL)]
    assert records(actions, EventName.RESTART)[0].fields["startup"] is True


def test_start_up_restarts_are_bounded_then_max_restarts_then_the_job_stops():
    sim = booting(2, spares=0, startup_restarts=2, max_restarts=1)
    reasons = []
    for _ in range(3):
        actions = _startup_restart(sim, sim.slot(1), -SIGKILL)
        reasons += [r.fields for r in records(actions, EventName.RESTART)]
        sim.boot(actions)
    assert [r.get("startup", False) for r in reasons] == [True, True, False]  # the third one uses --max-restarts
    assert (sim.job.startup_restarts_used, sim.job.restarts_used, sim.job.attempt) == (2, 1, 3)

    actions = _startup_restart(sim, sim.slot(1), -SIGKILL)

    assert any("restart budget spent" in n.text for n in of(actions, Note))
    assert finishes(actions) == [1]
    assert [f.exitcode for f in sim.job.failures] == [-SIGKILL] * 4


def test_a_script_raising_during_start_up_fails_fast():
    sim = booting(2, spares=1)
    sim.event(1, EventKind.FAILED, traceback="Traceback ...\nImportError: no module named x\n")

    actions = _startup_restart(sim, 1, 1)

    assert records(actions, EventName.RESTART) == []
    assert finishes(actions) == [1]
    assert "ImportError" in (sim.job.failures[0].traceback or "")


@pytest.mark.parametrize("rc", [1, 3, 127])
def test_a_plain_non_zero_exit_during_start_up_is_the_scripts_own_and_fails_fast(rc):
    sim = booting(2, spares=0)
    assert finishes(_startup_restart(sim, 1, rc)) == [1]


def test_a_start_up_kill_of_a_script_that_never_registers_keeps_torchruns_behaviour():
    sim = running(2)  # an unmodified torchrun script: no start-up window, or it would never end
    assert finishes(_startup_restart(sim, 1, -SIGKILL)) == [1]


def test_a_start_up_kill_in_restart_mode_keeps_torchruns_behaviour():
    sim = booting(2, spares=0, recovery=RecoveryMode.RESTART)
    assert finishes(_startup_restart(sim, 1, -SIGKILL)) == [1]


def test_with_startup_restarts_zero_a_start_up_kill_uses_max_restarts():
    sim = booting(2, spares=0, startup_restarts=0, max_restarts=1)
    actions = _startup_restart(sim, 1, -SIGKILL)
    assert records(actions, EventName.RESTART)[0].fields.get("startup") is None
    assert sim.job.restarts_used == 1


def test_once_every_rank_registered_a_kill_is_recovered_in_place_not_restarted():
    sim = booting(3, spares=0)
    for slot_id in sim.rank_slots():
        sim.event(slot_id, EventKind.REGISTERED)

    sim.exit(1, -SIGKILL)

    assert sim.job.state is JobState.RECOVERING and sim.job.startup_restarts_used == 0


def test_a_registration_teaches_the_job_that_the_script_registers():
    sim = running(2, spares=0)  # the agent did not recognise it (swiftrun imported by a helper module)
    assert not sim.job.registers
    sim.event(0, EventKind.REGISTERED)
    assert sim.job.registers  # the next attempts start their ranks as "starting" and their spares at once


# --- a failure after training finished on every rank -----------------------------------------------------------


def _released(nproc: int = 3, **config: Any) -> Sim:
    sim = swift_running(nproc, **config)
    released = []
    for slot_id in sim.rank_slots():
        released += sim.event(slot_id, EventKind.FINISHING)
    assert len(sends(released, CommandKind.RELEASE)) == nproc and sim.job.released
    return sim


def test_a_rank_killed_after_release_aborts_the_others_and_the_job_still_succeeds():
    sim = _released(3, spares=1)
    (spare,) = sim.spares()

    actions = sim.exit(1, -SIGKILL)

    assert of(actions, Spawn) == [] and of(actions, Assign) == []  # nothing left to train: no replacement
    assert sim.job.recovery is None and sim.job.state is JobState.RUNNING
    aborts = sends(actions, CommandKind.ABORT)
    assert [(a.slot_id, a.generation) for a in aborts] == [(0, 1), (2, 1)]
    assert sends(actions, CommandKind.RECOVER) == []
    (failed,) = records(actions, EventName.WORKER_FAILED)
    assert failed.fields["after_release"] is True and failed.fields["signal"] == "SIGKILL"
    (note,) = of(actions, Note)
    assert note.text.startswith("WARNING: training had completed on every rank") and "rank 1" in note.text

    assert finishes(sim.exit(0, 0)) == []
    last = sim.exit(2, 0)
    assert kills(last, SIGTERM) == [Kill(spare, SIGTERM)]
    assert finishes(sim.exit(spare, -SIGTERM)) == [0]
    assert sim.job.state is JobState.SUCCEEDED
    assert [(f.rank, f.exitcode) for f in sim.job.late_failures] == [(1, -SIGKILL)]


def test_survivors_failing_in_their_tail_after_a_late_failure_do_not_fail_the_job_either():
    sim = _released(3, spares=0)
    sim.exit(0, 0)  # rank 0 already left: no in-place recovery would be possible anyway

    sim.exit(1, -SIGKILL)
    second = sim.exit(2, 1)  # its barrier failed and the script let it raise

    assert sends(second, CommandKind.ABORT) == []  # nobody left to tell
    assert finishes(second) == [0]
    assert [f.rank for f in sim.job.late_failures] == [1, 2]


def test_a_rank_hung_after_release_is_killed_and_the_job_succeeds():
    sim = _released(2, spares=0, timeouts=FAST)
    sim.exit(0, 0)
    sim.advance(FAST.heartbeat_timeout + 0.1)

    actions = sim.tick(stopped=frozenset({1}))

    assert kills(actions, SIGKILL) == [Kill(1, SIGKILL)]
    assert records(actions, EventName.WORKER_FAILED)[0].fields["after_release"] is True
    assert finishes(actions) == [0]


def test_a_failure_when_only_some_ranks_finished_is_recovered_in_place():
    sim = swift_running(3, spares=0)
    sim.event(0, EventKind.FINISHING)
    sim.event(2, EventKind.FINISHING)

    sim.exit(1, -SIGKILL)

    assert not sim.job.released and sim.job.state is JobState.RECOVERING


# --- deadlines of a recovery: start-up for a replacement, recovery for the rest --------------------------------

SLOW_START = Timeouts(recovery_timeout=60, startup_timeout=300)


def test_survivors_waiting_for_a_slow_replacement_are_not_laggards_while_it_is_within_its_start_up():
    sim, new = _cold_recovery(timeouts=SLOW_START)
    sim.hello(new)  # it runs the user's script from the top: loading a dataset, say
    sim.event(0, EventKind.ABORTED)
    sim.event(2, EventKind.ABORTED)

    for _ in range(29):  # 290 s, far past the recovery timeout
        sim.advance(10)
        sim.heartbeat_all()
        assert kills(sim.tick()) == []
    sim.advance(9.9)
    sim.heartbeat_all()
    assert kills(sim.tick()) == []
    assert sim.job.next_deadline(sim.now) == pytest.approx(sim.now + 0.1)  # the loop wakes up for it
    sim.advance(0.1)
    sim.heartbeat_all()
    actions = sim.tick()

    assert kills(actions, SIGKILL) == [Kill(new, SIGKILL)]  # only the replacement, at its start-up deadline
    cause = records(actions, EventName.WORKER_FAILED)[0].fields["cause"]
    assert "did not reach swiftrun.Run within the start-up timeout (300s)" in cause
    assert sim.job.generation == 2


def test_a_replacement_that_joined_in_time_lets_recover_go_out_and_recover_has_the_recovery_timeout():
    sim, new = _cold_recovery(timeouts=SLOW_START)
    sim.event(0, EventKind.ABORTED)
    sim.event(2, EventKind.ABORTED)
    sim.advance(250)
    sim.heartbeat_all()
    sim.hello(new)
    recover = sends(sim.event(new, EventKind.JOINING), CommandKind.RECOVER)
    assert len(recover) == 3
    sim.event(0, EventKind.RECOVERED)
    sim.event(new, EventKind.RECOVERED)

    sim.advance(59.9)
    sim.heartbeat_all()
    assert kills(sim.tick()) == []
    sim.advance(0.1)
    sim.heartbeat_all()
    assert kills(sim.tick(), SIGKILL) == [Kill(2, SIGKILL)]  # 60 s after RECOVER, not after the failure


def test_an_assigned_spare_has_the_start_up_timeout_from_its_assign():
    sim = swift_running(3, spares=1, timeouts=SLOW_START)
    (spare,) = sim.spares()
    sim.advance(1000)  # the spare waited long before it was needed
    sim.heartbeat_all()
    sim.exit(1, -SIGKILL)
    sim.event(0, EventKind.ABORTED)
    sim.event(2, EventKind.ABORTED)

    sim.advance(299)
    sim.heartbeat_all()
    assert kills(sim.tick()) == []
    sim.advance(1)
    sim.heartbeat_all()
    assert Kill(spare, SIGKILL) in kills(sim.tick())


def test_a_survivor_that_never_answers_the_abort_is_still_a_laggard_at_the_recovery_timeout():
    sim, new = _cold_recovery(timeouts=SLOW_START)
    sim.event(0, EventKind.ABORTED)  # rank 2 never answers; the replacement is still starting

    sim.advance(60)
    sim.heartbeat_all()
    actions = sim.tick()

    assert kills(actions, SIGKILL) == [Kill(2, SIGKILL)]


def test_a_joined_replacement_waits_like_a_survivor_in_a_later_generation():
    sim, new = _cold_recovery(timeouts=SLOW_START)
    sim.hello(new)
    sim.event(new, EventKind.JOINING)
    sim.advance(200)
    sim.heartbeat_all()
    sim.exit(0, -SIGKILL)  # generation 2: rank 0 replaced too; rank 1's replacement must re-report JOINING

    sim.advance(60)
    sim.heartbeat_all()
    actions = sim.tick()

    assert Kill(new, SIGKILL) in kills(actions) and Kill(2, SIGKILL) in kills(actions)  # neither answered


def test_a_workers_warning_reaches_the_console_and_the_event_log():
    sim = swift_running()
    actions = sim.event(sim.slot(1), EventKind.WARNING, message="dist.all_reduce at train.py:9 was skipped")
    assert [r.fields["message"] for r in records(actions, EventName.WARNING)] == [
        "dist.all_reduce at train.py:9 was skipped"]
    assert any("WARNING rank 1" in n.text for n in of(actions, Note))


def test_the_recovery_and_release_barriers_are_kept_per_event_for_the_current_slot_of_each_rank():
    """The O(1) bookkeeping behind RECOVER, RESUME and RELEASE: who has not answered the current generation,
    who has not finished; a rank that finished before a failure must finish again after it."""
    sim = swift_running(3, spares=0)
    sim.event(0, EventKind.FINISHING)
    assert sim.job._unfinished == {1, 2}
    (spawn,) = of(sim.exit(1, -SIGKILL), Spawn)
    new = spawn.slot_id
    sim.spawned(new)
    assert sim.job._unfinished == {0, 1, 2}  # the recovery undid rank 0's finish
    assert (sim.job.barrier.unready_survivors, sim.job.barrier.unready_replacements) == ({0, 2}, {1})

    sim.event(0, EventKind.ABORTED, gen=0)  # an answer to an older round counts for nothing
    assert sim.job.barrier.unready_survivors == {0, 2}
    assert phases(sim.event(0, EventKind.ABORTED) + sim.event(2, EventKind.ABORTED)) == ["abort"]
    actions = sim.hello(new) + sim.event(new, EventKind.JOINING)
    assert len(sends(actions, CommandKind.RECOVER)) == 3 and sim.job.barrier.unrecovered == {0, 1, 2}
    assert sends(sim.event(0, EventKind.RECOVERED) + sim.event(new, EventKind.RECOVERED), CommandKind.RESUME) == []
    assert len(sends(sim.event(2, EventKind.RECOVERED), CommandKind.RESUME)) == 3
    assert sim.job.state is JobState.RUNNING

    assert sends(sim.event(0, EventKind.FINISHING) + sim.event(2, EventKind.FINISHING), CommandKind.RELEASE) == []
    assert sim.job._unfinished == {1}
    assert len(sends(sim.event(new, EventKind.FINISHING), CommandKind.RELEASE)) == 3


def test_undo_of_an_earlier_generation_is_kept_in_the_recovery_record():
    """A replay interrupted by a second failure is planned again; that plan finds nothing left to undo, but the
    recovery_end must still say who undid an update (pipeline campaign, replay-kill run 2)."""
    from swiftrun.launcher.job import _undone

    assert _undone((), {"mode": "replay", "undo": [3, 2]}) == (2, 3)
    assert _undone((2, 3), {"mode": "replay", "undo": []}) == (2, 3)
    assert _undone((2,), None) == (2,)


# --- crash loops -----------------------------------------------------------------------------------------------


def _crash_with(sim: Sim, rank: int, traceback: str) -> list[Action]:
    slot_id = sim.slot(rank)
    sim.event(slot_id, EventKind.FAILED, traceback=traceback)
    return sim.exit(slot_id, 1)


MISMATCH = "Traceback (most recent call last):\n  ...\nRuntimeError: [../gloo/transport/tcp/pair.cc:{n}] op mismatch\n"


def test_the_same_failure_right_after_each_recovery_stops_recovering_in_place_with_that_failure_named():
    sim = swift_running(2, spares=0, max_recoveries=16)
    for slot_id in sim.rank_slots():
        sim.alive(slot_id, step=5)
    for attempt in range(3):  # fails at once after each recovery: the redone step 6 never completes
        actions = _crash_with(sim, 1, MISMATCH.format(n=100 + attempt))
        assert sim.job.state is JobState.RECOVERING, attempt
        _finish_recovery(sim)
        for slot_id in sim.rank_slots():
            sim.alive(slot_id, step=6)
    actions = _crash_with(sim, 1, MISMATCH.format(n=999))
    assert sim.job.recoveries_used == 3 and sim.job.state is JobState.STOPPING
    (warning,) = records(actions, EventName.WARNING)
    assert "right after each of the last 3 in-place recoveries" in warning.fields["message"]
    assert "op mismatch" in warning.fields["message"]
    assert any("op mismatch" in note.text for note in of(actions, Note) if "stopping the job" in note.text)


def test_failures_with_progress_in_between_or_of_different_kinds_keep_recovering():
    sim = swift_running(2, spares=0, max_recoveries=16)
    step = 5
    for attempt in range(6):
        for slot_id in sim.rank_slots():
            sim.alive(slot_id, step=step)
        tb = MISMATCH if attempt % 2 else "Traceback:\nValueError: bad batch\n"
        _crash_with(sim, attempt % 2, tb.format(n=attempt))
        assert sim.job.state is JobState.RECOVERING, attempt
        _finish_recovery(sim)
        step += 1 if attempt < 3 else 0  # no progress at the end, but the failures alternate
    for slot_id in sim.rank_slots():
        sim.alive(slot_id, step=step + 10)
    for attempt in range(3):  # the same failure each time, but training moves on between them
        _crash_with(sim, 1, MISMATCH.format(n=attempt))
        assert sim.job.state is JobState.RECOVERING
        _finish_recovery(sim)
        step += 10
        for slot_id in sim.rank_slots():
            sim.alive(slot_id, step=step + 10)


def _finish_recovery(sim: Sim) -> None:
    """Every rank of the current generation answers and recovers; the replacement boots first."""
    for spawn in of(sim.log, Spawn):
        slot = sim.job.slots[spawn.slot_id]
        if slot.pid is None:
            sim.spawned(spawn.slot_id)
        if not slot.hello:
            sim.hello(spawn.slot_id)
    for slot_id in sim.rank_slots():
        slot = sim.job.slots[slot_id]
        sim.event(slot_id, EventKind.JOINING if slot.replacement else EventKind.ABORTED)
    for slot_id in sim.rank_slots():
        sim.event(slot_id, EventKind.RECOVERED)
    assert sim.job.state is JobState.RUNNING


# --- layouts no in-place recovery can repair -------------------------------------------------------------------


@pytest.mark.parametrize(("max_restarts", "state"), [(0, JobState.STOPPING), (1, JobState.RESTARTING)])
def test_a_job_registered_as_unrecoverable_never_recovers_in_place_and_names_why(max_restarts, state):
    reason = "ZeroRedundancyOptimizer shards the optimizer state over 3 ranks: in-place recovery is impossible"
    sim = running(3, spares=0, max_restarts=max_restarts)
    for slot_id in sim.rank_slots():
        sim.boot(sim.event(slot_id, EventKind.REGISTERED, unrecoverable=reason if slot_id == 0 else None))
    assert sim.job.swift_started and sim.job.unrecoverable == reason

    actions = sim.exit(sim.slot(1), -SIGKILL)

    assert sends(actions, CommandKind.ABORT) == [] and sim.job.recoveries_used == 0
    assert sim.job.state is state
    assert any(reason in note.text for note in of(actions, Note))


def test_a_layout_found_after_registration_counts_too():
    sim = swift_running(2, spares=0)
    sim.event(sim.slot(0), EventKind.LAYOUT, unrecoverable="the PowerSGD comm hook keeps per-rank state")
    actions = sim.exit(sim.slot(1), 1)
    assert sends(actions, CommandKind.ABORT) == [] and sim.job.state is JobState.STOPPING
    assert any("PowerSGD" in note.text for note in of(actions, Note))
