"""The supervisor's decisions, as a pure state machine.

:class:`Job` receives events (a process exited, a message arrived, time passed, a signal came) together with the
current monotonic time and answers with :mod:`actions <swiftrun.launcher.actions>` for the agent to carry out.
It never touches a process, a socket or the clock itself, so every decision can be replayed in a unit test.

Vocabulary: a *rank* is a position in the job (0..world-1); a *slot* is one process, identified by an increasing
slot id. A rank is served by one slot at a time; a replacement is a new slot (new incarnation) for the same rank.
A *spare* is a slot without a rank, warmed up and waiting to become one.

Failure handling, in order of preference:

1. Swift in-place recovery (every rank created ``swiftrun.Run``, the job is not in restart mode, at least one
   replica survived, budget left): generation += 1, ABORT to survivors, a replacement per failed rank, RECOVER
   once everyone is ready, RESUME once everyone recovered. The barrier lives here, never in a collective.
2. Restart of every worker (torchrun's behaviour) while ``--max-restarts`` allows, on a fresh store. A failure
   the infrastructure caused (a signal, a hang) before every rank registered ``swiftrun.Run`` restarts everyone
   without touching that budget, ``--startup-restarts`` times at most: nothing of the job was lost yet.
3. Stop, with the first failure as the root cause.

A failure after RELEASE went to every rank (training finished everywhere; a rank crashed while saving or
exiting) is not a job failure: the live ranks get ABORT so that no tail collective hangs on the dead peer, and
the job ends with 0 and a loud warning once every worker is gone.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from swiftrun.config import LaunchConfig, RecoveryMode
from swiftrun.events import EventName
from swiftrun.launcher.actions import (
    Action,
    Assign,
    Finish,
    Kill,
    Note,
    Record,
    ResetStore,
    Send,
    Spawn,
)
from swiftrun.launcher.barrier import Member, RecoveryBarrier
from swiftrun.launcher.crashloop import CrashLoop
from swiftrun.launcher.failures import ProcessFailure
from swiftrun.launcher.streams import StreamBackups
from swiftrun.protocol.control import CommandKind, EventKind
from swiftrun.snapshot import JobState, RecoveryPhase, WorkerState

SETUP_GRACE = 15.0  # seconds of silence tolerated while a worker imports and sets up (see _silence_limit)
# seconds a worker whose script returned may take to exit: its heartbeats stop with the script, and torch's exit
# (process groups destroyed, threads joined, atexit handlers) took 4-7 s on 2 loaded cores. Bounded, so a worker
# that hangs in exit is still ended.
EXIT_GRACE = 60.0
# seconds between repeats of the recovery command a rank has not answered yet (ABORT until ABORTED/JOINING, RECOVER
# until RECOVERED). Every message is sent once and the sends are non-blocking (a full queue or a reconnecting TCP
# link between nodes drops it), so without repeats one lost ABORT, ABORTED, RECOVER or RECOVERED stalled the
# recovery for --recovery-timeout and cost a healthy rank. Commands are level-triggered and a worker answers a
# repeat it has already answered by repeating its answer (runtime/worker/link.py), so repeats are harmless; only ranks
# that owe an answer get them, so a recovery costs O(unanswered ranks) more messages per interval.
RESEND_INTERVAL = 2.0

LIVE = {
    WorkerState.STARTING,
    WorkerState.RUNNING,
    WorkerState.ABORTING,
    WorkerState.JOINING,
    WorkerState.RECOVERING,
    WorkerState.REPLAYING,
    WorkerState.FINISHING,
    WorkerState.RESTARTING,
    WorkerState.STOPPING,
}


@dataclass
class Slot:
    """One worker process as the supervisor sees it."""

    slot_id: int
    rank: int | None  # None: a spare
    incarnation: int
    node: int = 0  # the node slot whose agent runs it (always 0 on one node)
    state: WorkerState = WorkerState.STARTING
    pid: int | None = None
    spawned_at: float = 0.0
    hello: bool = False
    hello_at: float = 0.0
    last_seen: float = 0.0
    registered: bool = False  # created swiftrun.Run
    replacement: bool = False  # joining survivors; holds no state of its own until its recovery completes
    joined: bool = False  # a replacement that reported JOINING once: from then on it waits like a survivor
    join_deadline: float | None = None  # a replacement must report JOINING by then (its script's preamble)
    ready_gen: int = -1  # generation this slot reported ABORTED/JOINING for
    recovered_gen: int = -1
    finishing: bool = False
    exiting: bool = False  # its script returned (EXITING): silence is the interpreter's exit, see EXIT_GRACE
    failed_after_release: bool = False  # failed once training had completed on every rank: not a job failure
    step: int | None = None
    step_changed_at: float = 0.0
    loss: float | None = None
    step_time: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    traceback: str | None = None
    exit_code: int | None = None
    recovery_data: dict[str, Any] = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return self.state in LIVE


@dataclass
class Recovery:
    """The book-keeping of one in-place recovery (possibly spanning several generations)."""

    generation: int
    failed_ranks: tuple[int, ...]
    cause: str
    failed_at: float
    detect: float  # seconds from the failure to its detection
    started_at: float  # detection time
    deadline: float
    phase_start: dict[RecoveryPhase, float] = field(default_factory=dict)
    phase_duration: dict[RecoveryPhase, float] = field(default_factory=dict)
    recover_sent_at: float | None = None
    recover_args: dict[str, Any] = field(default_factory=dict)
    resend_at: float = 0.0  # when the command still owed an answer goes again (RESEND_INTERVAL)
    mode: str | None = None
    source_rank: int | None = None
    undo: tuple[int, ...] = ()  # ranks that undid an update (a pipeline replay may undo on other ranks too)
    done: bool = False
    total: float | None = None
    replay: str | None = None  # progress of a pipeline stage's replay, for the dashboard
    inexact: str | None = None  # why an undone update was inverted arithmetically, not restored from a copy


def _undone(before: tuple[int, ...], plan: Any) -> tuple[int, ...]:
    """The ranks that undid an update in any generation of one recovery (a replay interrupted by a second
    failure is planned again, and the second plan finds nothing left to undo)."""
    more = (plan or {}).get("undo") or () if isinstance(plan, dict) else ()
    return tuple(sorted(set(before) | {int(r) for r in more}))


class Job:
    """The supervisor state machine of one node. Feed it events; carry out what it returns."""

    def __init__(self, config: LaunchConfig, now: float, wall_offset: float = 0.0, registers: bool = False) -> None:
        self.config = config
        self.wall_offset = wall_offset  # time.time() - time.monotonic(), for the failure summary's timestamps
        # Whether the script is expected to create swiftrun.Run: the agent reads the script, and the first
        # REGISTERED proves it. It decides what "started" means for a rank (registered, or said HELLO), whether
        # a failure before every rank registered is a start-up failure, and whether spares start with the job.
        self.registers = registers
        self.state = JobState.STARTING
        self.started_at = now
        self.generation = 0
        self.attempt = 0  # torchrun's restart count: every restart of all workers, whatever its cause
        self.restarts_used = 0  # restarts counted against --max-restarts
        self.startup_restarts_used = 0  # restarts after a start-up failure (--startup-restarts)
        self.released = False  # RELEASE went to every rank this attempt: training finished everywhere
        self.late_failures: list[ProcessFailure] = []  # failures after RELEASE: warnings, not job failures
        self.recoveries_used = 0
        self.crash_loop = CrashLoop()  # the same failure right after each recovery stops recovering in place
        # set by a rank's REGISTERED/LAYOUT: why no in-place recovery can be exact for this job (a ZeRO or FSDP
        # shard that exists on one rank only); failures then restart every worker or stop
        self.unrecoverable: str | None = None
        self.streams = StreamBackups()  # each rank's RNG streams, for its replacement (launcher/streams.py)
        self.slots: dict[int, Slot] = {}
        self.rank_slot: dict[int, int] = {}
        self.failures: list[ProcessFailure] = []
        self.recovery: Recovery | None = None
        self.last_recovery: Recovery | None = None
        self.swift_started = False  # START sent: every rank registered swiftrun.Run this attempt
        # ranks whose current slot has not registered swiftrun.Run yet: kept as slots change hands, so checking
        # "did every rank register?" on each REGISTERED is O(1), not a walk of the world (O(world^2) at start)
        self._unregistered: set[int] = set()
        # who the current recovery generation still waits for (launcher/barrier.py): refilled in one walk when a
        # generation begins, each answer then removes one rank
        self.barrier = RecoveryBarrier()
        # the same idea for the end of training: ranks whose current slot has not said FINISHING yet
        self._unfinished: set[int] = set()
        self.stop_deadline: float | None = None
        self.exit_code: int | None = None
        self.time_lost = 0.0
        self.spare_failures = 0
        self._next_slot = 0
        self._next_cmd = 0
        self._stop_signal: int | None = None
        self._restart_pending = False
        self._restart_started = now
        self._records: list[Action] = []  # records produced outside an event's action list (recovery end)
        # multi-node: node slots that have no agent right now (lost, not yet taken over); no spare is started
        # there until an agent holds the slot again (on_node_joined)
        self.vacant_nodes: set[int] = set()
        # multi-node: node slot -> (host, incarnation) of the agent holding it, kept by the coordinator, so that
        # failure records and the event log name the machine; a lost slot keeps its last holder until retaken
        self.node_hosts: dict[int, tuple[str, int]] = {}

    # ------------------------------------------------------------------ events

    def start(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for rank in range(self.config.world_size):
            actions += self._spawn_rank(rank, now, incarnation=0, joining=False)
        actions += self._replenish_spares(now)
        self.state = JobState.RUNNING
        return actions

    def on_spawned(self, slot_id: int, pid: int, now: float) -> list[Action]:
        slot = self.slots[slot_id]
        slot.pid = pid
        slot.spawned_at = now
        slot.last_seen = now
        if self.config.entrypoint.kind.value == "executable":
            # no runtime inside: the process is running as soon as it exists
            return self._set_state(slot, WorkerState.RUNNING, now)
        return []

    def on_spawn_failed(self, slot_id: int, reason: str, now: float) -> list[Action]:
        slot = self.slots[slot_id]
        slot.exit_code = 127
        return self.on_exit(slot_id, 127, now, cause=reason)

    def on_hello(self, slot_id: int, gen: int, now: float) -> list[Action]:
        slot = self.slots[slot_id]
        slot.hello = True
        slot.hello_at = now
        slot.last_seen = now
        if slot.rank is None or slot.state is not WorkerState.STARTING:
            return []
        if slot.replacement and self.recovery:
            return self._set_state(slot, WorkerState.JOINING, now) + self._advance_recovery(now)
        if self._expects_registration():
            return []  # still importing and building its model: it is running once it registered
        return self._set_state(slot, WorkerState.RUNNING, now)

    def on_alive(self, slot_id: int, now: float, step: int | None = None) -> list[Action]:
        slot = self.slots[slot_id]
        slot.last_seen = now
        if step is not None and step >= 0 and step != slot.step:
            slot.step = step
            slot.step_changed_at = now
        return []

    def on_status(self, slot_id: int, now: float, step: int, loss: Any, step_time: Any, metrics: dict) -> list[Action]:
        slot = self.slots[slot_id]
        self.on_alive(slot_id, now, step)
        if isinstance(loss, (int, float)):
            slot.loss = float(loss)
        if isinstance(step_time, (int, float)):
            slot.step_time = float(step_time)
        slot.metrics.update({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
        if slot.rank is not None and slot.state is WorkerState.STARTING and slot.hello and not slot.replacement:
            # it reports progress without having registered (swiftrun.report alone): it is running
            return self._set_state(slot, WorkerState.RUNNING, now)
        return []

    def on_event(self, slot_id: int, gen: int, kind: EventKind, data: dict[str, Any], now: float) -> list[Action]:
        slot = self.slots[slot_id]
        slot.last_seen = now
        if kind is EventKind.WARNING:
            message = str(data.get("message", ""))
            where = f"rank {slot.rank}" if slot.rank is not None else "a spare"
            return [Note(f"WARNING {where}: {message}"),
                    Record(EventName.WARNING, {"rank": slot.rank, "message": message})]
        if kind is EventKind.FAILED:
            slot.traceback = str(data.get("traceback") or "") or None
            return []
        if kind is EventKind.EXITING:
            slot.exiting = True
            return []
        if kind is EventKind.LOG_PLAN:
            return [Note(str(data.get("message", ""))), Record(EventName.LOG_PLAN, dict(data))]
        if kind is EventKind.RNG_BACKUP:
            if self._keeps_backups_of(slot):
                self.streams.keep(slot.rank, int(data.get("step", -1)), str(data.get("at", "start")),
                                  data.get("state"))
            return []
        if slot.rank is None or not slot.alive:
            return []
        if kind in (EventKind.REGISTERED, EventKind.LAYOUT) and data.get("unrecoverable"):
            # a lost rank's state would exist nowhere else (runtime/state/layout.py): no in-place recovery
            if self.unrecoverable is None:
                self.unrecoverable = str(data["unrecoverable"])
        if kind is EventKind.LAYOUT:
            return []
        if kind is EventKind.REGISTERED:
            slot.registered = True
            if self.rank_slot.get(slot.rank) == slot.slot_id:
                self._unregistered.discard(slot.rank)
            self.registers = True
            actions: list[Action] = []
            if slot.state is WorkerState.STARTING:
                actions += self._set_state(slot, WorkerState.RUNNING, now)
            return actions + self._maybe_start_swift(now)
        if kind in (EventKind.ABORTED, EventKind.JOINING):
            if gen < self.generation:
                # it answered an older round: tell it about the current one
                return [self._command(slot, CommandKind.ABORT, {})]
            slot.ready_gen = gen
            if kind is EventKind.JOINING:
                slot.joined = True
            if gen == self.generation and self._is_current(slot):
                self.barrier.answered(slot.rank)
            return self._advance_recovery(now)
        if kind is EventKind.REPLAYING:
            return self._on_replay_progress(slot, gen, data, now)
        if kind is EventKind.RECOVERED:
            if gen == self.generation:
                slot.recovered_gen = gen
                slot.recovery_data = dict(data)
                if self._is_current(slot):
                    self.barrier.recovered(slot.rank)
                if self.recovery is not None:  # a newer generation's plan must not hide an earlier undo
                    self.recovery.undo = _undone(self.recovery.undo, data.get("plan"))
            return self._advance_recovery(now)
        if kind is EventKind.UNRECOVERABLE:
            reason = str(data.get("reason", "no consistent state could be reached in place"))
            return self._escalate(now, f"rank {slot.rank}: {reason}")
        if kind is EventKind.FINISHING:
            slot.finishing = True
            if self._is_current(slot):
                self._unfinished.discard(slot.rank)
            actions = []
            if slot.state is WorkerState.RUNNING:
                actions += self._set_state(slot, WorkerState.FINISHING, now)
            return actions + self._maybe_release(now)
        return []

    def on_ack(self, slot_id: int, cmd_id: int, now: float) -> list[Action]:
        self.slots[slot_id].last_seen = now
        return []

    def on_exit(
        self, slot_id: int, returncode: int, now: float, cause: str = "", error_file: str | None = None
    ) -> list[Action]:
        slot = self.slots[slot_id]
        if not slot.alive:
            return []
        slot.exit_code = returncode
        if slot.rank is None:  # a spare
            asked_to_stop = slot.state in (WorkerState.STOPPING, WorkerState.RESTARTING)
            slot.state = WorkerState.EXITED if returncode == 0 else WorkerState.FAILED
            if returncode != 0 and not asked_to_stop and self.state is not JobState.STOPPING \
                    and not self.state.terminal:
                self.spare_failures += 1
            return self._replenish_spares(now) + self._maybe_finish(now)
        if self.state in (JobState.STOPPING, JobState.RESTARTING) or self.state.terminal:
            actions = self._set_state(slot, WorkerState.EXITED if returncode == 0 else WorkerState.FAILED, now)
            return actions + self._maybe_finish(now)
        if returncode == 0 and not self.recovery:
            actions = self._set_state(slot, WorkerState.EXITED, now)
            return actions + self._maybe_finish(now)
        failure = self._failure(slot, now, cause, exitcode=returncode, error_file=error_file)
        if self.released:
            return self._on_late_failure(slot, failure, now)
        return self._on_failures([(slot, failure)], now, detect=0.0)

    def on_node_lost(self, node: int, now: float, cause: str, detect: float = 0.0) -> list[Action]:
        """Every process of node slot ``node`` is gone with its agent (multi-node): see :meth:`on_nodes_lost`."""
        return self.on_nodes_lost({node: (cause, detect)}, now)

    def on_nodes_lost(self, lost: dict[int, tuple[str, float]], now: float) -> list[Action]:
        """Every process of these node slots is gone with its agent (multi-node; ``lost``: slot -> (cause, seconds
        since it went quiet)): their spares leave quietly and their ranks fail together, as one batch, so one
        generation repairs them all (two nodes behind one failed switch cost one recovery, not two, the second
        superseding the first). Replacements are spawned on each slot, for whichever agent takes it over (the
        restarted node or a hot spare)."""
        self.vacant_nodes.update(lost)
        actions: list[Action] = []
        failed: list[tuple[Slot, ProcessFailure]] = []
        ending = self.state in (JobState.STOPPING, JobState.RESTARTING) or self.state.terminal
        for node, (cause, detect) in sorted(lost.items()):
            for slot in [s for s in self.slots.values() if s.node == node and s.alive]:
                if slot.rank is None:
                    slot.state = WorkerState.EXITED
                    continue
                if ending:
                    actions += self._set_state(slot, WorkerState.FAILED, now)
                    continue
                failed.append((slot, self._failure(slot, now - detect, f"node slot {node} lost: {cause}")))
        if ending:
            return actions + self._maybe_finish(now)
        if not failed:
            return actions
        if self.released:
            for slot, failure in failed:
                actions += self._on_late_failure(slot, failure, now)
            return actions
        return actions + self._on_failures(failed, now, detect=max(detect for _, detect in lost.values()))

    def on_node_joined(self, node: int, now: float) -> list[Action]:
        """An agent holds node slot ``node`` again: it gets its share of warm spares."""
        self.vacant_nodes.discard(node)
        return self._replenish_spares(now)

    def on_signal(self, signum: int, now: float) -> list[Action]:
        if self._stop_signal is not None:
            # a second signal: no more grace
            return [Kill(s.slot_id, signal.SIGKILL) for s in self._live_slots()]
        self._stop_signal = signum
        name = signal.Signals(signum).name
        actions: list[Action] = [Note(f"received {name}: forwarding it to the workers")]
        return actions + self._stop_all(now, 128 + signum, forward=signum)

    def give_up(self, cause: str, now: float) -> list[Action]:
        """The supervisor above the Job ends it (multi-node: a lost node's slot was never taken back)."""
        if self.state in (JobState.STOPPING, JobState.RESTARTING) or self.state.terminal:
            return []
        return [Note(f"stopping the job: {cause}")] + self._stop_all(now, 1)

    def tick(self, now: float, stopped: frozenset[int] = frozenset()) -> list[Action]:
        """Deadlines: silent workers, stalled workers, recovery and shutdown time limits.

        ``stopped`` names the slots whose process the OS reports as stopped (SIGSTOP): those are hung for
        certain, while a silent running process may only be starved of the GIL by a long import at start-up.
        """
        actions: list[Action] = []
        t = self.config.timeouts
        if self.stop_deadline is not None and now >= self.stop_deadline:
            self.stop_deadline = None
            actions += [Kill(s.slot_id, signal.SIGKILL) for s in self._live_slots()]
        if self.state in (JobState.STOPPING, JobState.RESTARTING) or self.state.terminal:
            return actions
        hung: list[tuple[Slot, ProcessFailure]] = []
        spare_lost = False
        for slot in self._live_slots():
            if self.config.entrypoint.kind.value == "executable":
                continue
            silent_for = now - slot.last_seen
            cause = ""
            if not slot.hello:
                if silent_for > t.startup_timeout:
                    cause = f"did not start within {t.startup_timeout:g}s"
                elif slot.slot_id in stopped and silent_for > t.heartbeat_timeout:
                    cause = f"stopped before it said hello ({silent_for:.1f}s)"
            elif silent_for > self._silence_limit(slot, now) or (
                slot.slot_id in stopped and silent_for > t.heartbeat_timeout
            ):
                how = "stopped" if slot.slot_id in stopped else "hung"
                cause = (f"still running {silent_for:.1f}s after its script returned ({how} in exit)" if slot.exiting
                         else f"no heartbeat for {silent_for:.1f}s ({how})")
            elif (
                t.progress_timeout
                and slot.rank is not None
                and slot.state is WorkerState.RUNNING
                and slot.step is not None
                and not slot.finishing
                and now - slot.step_changed_at > t.progress_timeout
            ):
                cause = f"no progress past step {slot.step} for {now - slot.step_changed_at:.1f}s (stalled)"
            if cause:
                if slot.rank is None:  # a spare that never warmed up or got stuck: replace it
                    actions.append(Kill(slot.slot_id, signal.SIGKILL))
                    slot.state = WorkerState.FAILED
                    self.spare_failures += 1
                    spare_lost = True
                    continue
                hung.append((slot, self._failure(slot, now, cause)))
        if spare_lost:
            actions += self._replenish_spares(now)
        if hung and self.released:
            for slot, failure in hung:
                actions += self._on_late_failure(slot, failure, now)
            return actions
        if hung:
            detect = max(now - s.last_seen for s, _ in hung)
            actions += self._on_failures(hung, now, detect=min(detect, t.heartbeat_timeout))
        if self.recovery:
            laggards = self._recovery_laggards(now)
            if laggards:
                actions += self._on_failures(laggards, now, detect=0.0)
        return actions + self._resend_unanswered(now)

    def _resend_unanswered(self, now: float) -> list[Action]:
        """The current recovery command again, to the ranks that still owe its answer (see RESEND_INTERVAL)."""
        rec = self.recovery
        if rec is None or self.state is not JobState.RECOVERING or now < rec.resend_at:
            return []
        rec.resend_at = now + RESEND_INTERVAL
        if rec.recover_sent_at is None:
            kind, args = CommandKind.ABORT, {}
        else:
            kind, args = CommandKind.RECOVER, rec.recover_args
        actions: list[Action] = []
        for rank in sorted(self.barrier.owing(recover_sent=rec.recover_sent_at is not None)):
            slot = self.slots[self.rank_slot[rank]]
            if slot.alive and slot.hello:  # a replacement still starting has no link to hear it yet
                actions.append(self._command(slot, kind, self._recover_args(slot) if rec.recover_sent_at else args))
        return actions

    def _recovery_laggards(self, now: float) -> list[tuple[Slot, ProcessFailure]]:
        """Ranks past the deadline of what they are doing in the current recovery."""
        out: list[tuple[Slot, ProcessFailure]] = []
        for slot in self._rank_slots():
            held = self._recovery_deadline_of(slot)
            if held is not None and now >= held[0]:
                out.append((slot, self._failure(slot, now, held[1])))
        return out

    def _recovery_deadline_of(self, slot: Slot) -> tuple[float, str] | None:
        """The deadline ``slot`` is held to in the current recovery, and what missing it means; None if none.

        Each wait has the deadline of what it measures. A replacement runs the user's script from the top before
        it can join (imports, dataset, model: possibly minutes), so it has ``--startup-timeout`` from its spawn
        or ASSIGN to report JOINING. Survivors have ``--recovery-timeout`` to answer the abort; once they have,
        waiting for a slow replacement is not lagging. Once RECOVER went out, every rank has
        ``--recovery-timeout`` to report RECOVERED.
        """
        rec = self.recovery
        t = self.config.timeouts
        if rec is None or not slot.alive or self._slot_done_with_phase(slot):
            return None
        if rec.recover_sent_at is not None:
            return rec.deadline, f"did not finish recovery {rec.generation} within {t.recovery_timeout:g}s"
        if slot.replacement and not slot.joined:
            if slot.join_deadline is None:
                return None
            return slot.join_deadline, (f"replacement did not reach swiftrun.Run within the start-up timeout "
                                        f"({t.startup_timeout:g}s)")
        return rec.deadline, f"did not answer the abort of recovery {rec.generation} within {t.recovery_timeout:g}s"

    def _silence_limit(self, slot: Slot, now: float) -> float:
        """How long a worker may stay silent. During set-up (before its first reported step, and for at most
        SETUP_GRACE after HELLO) importing torch can hold the GIL for seconds on a loaded machine, starving the
        heartbeat thread: allow SETUP_GRACE then."""
        t = self.config.timeouts
        if slot.exiting:  # the script returned; heartbeats stopped with it
            return max(t.heartbeat_timeout, EXIT_GRACE)
        in_setup = slot.step is None and now - slot.hello_at < SETUP_GRACE
        return max(t.heartbeat_timeout, SETUP_GRACE) if in_setup else t.heartbeat_timeout

    def silent_slots(self, now: float) -> list[int]:
        """Slots silent for longer than the heartbeat timeout (the agent checks whether they are stopped)."""
        limit = self.config.timeouts.heartbeat_timeout
        return [s.slot_id for s in self._live_slots() if now - s.last_seen > limit and s.pid]

    def next_deadline(self, now: float) -> float:
        """The earliest time :meth:`tick` may have something to do."""
        t = self.config.timeouts
        candidates = [now + max(t.heartbeat_interval, 0.05)]
        if self.stop_deadline is not None:
            candidates.append(self.stop_deadline)
        # only the deadlines someone is still held to: survivors that answered and wait for a slow replacement
        # leave the recovery's own deadline behind them, and a deadline in the past would make the loop spin
        for slot in self._rank_slots() if self.recovery else ():
            held = self._recovery_deadline_of(slot)
            if held is not None:
                candidates.append(held[0])
        if self.recovery is not None and self.state is JobState.RECOVERING:
            candidates.append(max(self.recovery.resend_at, now))
        return min(candidates)

    # ------------------------------------------------------------------ failures

    def _failure(self, slot: Slot, now: float, cause: str, exitcode: int = -signal.SIGKILL,
                 error_file: str | None = None) -> ProcessFailure:
        """The failure record of ``slot``; by default one the launcher itself ends with SIGKILL (hang, stall)."""
        assert slot.rank is not None
        where: dict[str, Any] = {}
        if self.config.multinode:
            where["node"] = slot.node
            if slot.node in self.node_hosts:
                where["hostname"], where["node_incarnation"] = self.node_hosts[slot.node]
        return ProcessFailure(
            **where,
            rank=slot.rank,
            local_rank=slot.rank % self.config.nproc_per_node,
            pid=slot.pid or 0,
            exitcode=exitcode,
            timestamp=now + self.wall_offset,
            monotonic=now,
            cause=cause,
            traceback=slot.traceback,
            error_file=error_file,
        )

    def _where(self, failure: ProcessFailure) -> dict[str, Any]:
        """Multi-node: the node slot, its incarnation and host, for a failure's event record."""
        if failure.node is None:
            return {}
        return {"node": failure.node, "node_incarnation": failure.node_incarnation, "host": failure.hostname}

    def _on_failures(self, failed: list[tuple[Slot, ProcessFailure]], now: float, detect: float) -> list[Action]:
        actions: list[Action] = []
        for slot, failure in failed:
            self.failures.append(failure)
            if slot.state is not WorkerState.FAILED:
                actions += self._set_state(slot, WorkerState.FAILED, now)
            # a hung or lagging process is still there: make sure it is gone before its rank is reborn
            actions.append(Kill(slot.slot_id, signal.SIGKILL))
            actions.append(Record(EventName.WORKER_FAILED, {
                "rank": slot.rank, "incarnation": slot.incarnation, "pid": slot.pid,
                "cause": failure.cause or failure.describe(), "exitcode": failure.exitcode,
                "signal": failure.signal_name(), "traceback": failure.traceback, **self._where(failure),
            }))
            actions.append(Note(failure.describe()))
        # a lost node fails its ranks with one cause: say it once
        cause = "; ".join(dict.fromkeys(f.cause or f.describe() for _, f in failed))
        if self._can_recover_in_place():
            loop = self.crash_loop.verdict([f for _, f in failed], [s.step for s in self._rank_slots()])
            if loop is None:
                return actions + self._begin_recovery([s.rank for s, _ in failed], cause, now, detect)
            actions.append(Record(EventName.WARNING, {"rank": failed[0][0].rank, "message": loop}))
            return actions + self._escalate(now, f"{cause}; {loop}")
        if self._is_startup_failure([f for _, f in failed]):
            return actions + self._restart_after_startup_failure(now, cause)
        if self.unrecoverable and self.swift_started:
            cause = f"{cause}; {self.unrecoverable}"
        return actions + self._escalate(now, cause)

    def _expects_registration(self) -> bool:
        """Whether every rank will register swiftrun.Run: a script that creates it, in a world with replicas
        (Run stays inert in a one-process world), run by the Python runtime (not --no-python)."""
        return (
            self.registers
            and self.config.world_size >= 2
            and self.config.entrypoint.kind.value != "executable"
        )

    def _is_startup_failure(self, failed: list[ProcessFailure]) -> bool:
        """A failure the infrastructure caused while the job was still starting, with start-up restarts left.

        Starting: not every rank registered swiftrun.Run this attempt, so no step was trained and a restart of
        every worker loses nothing. Infrastructure: killed by a signal (SIGKILL from the OOM killer, SIGSEGV,
        ...) or hung, which the launcher ends with SIGKILL, and no Python traceback: a script that raises
        (FAILED with a traceback, exit 1) or exits non-zero made its own error, and must still fail fast.
        Only a swift job of a script that registers: for anything else no rank ever registers, so there would
        be no end to "starting", and torchrun's behaviour is kept.
        """
        if (
            not self.config.swift
            or not self._expects_registration()
            or self.swift_started
            or self.startup_restarts_used >= self.config.startup_restarts
        ):
            return False
        return all(f.exitcode < 0 and f.traceback is None for f in failed)

    def _restart_after_startup_failure(self, now: float, cause: str) -> list[Action]:
        self.startup_restarts_used += 1
        n, budget = self.startup_restarts_used, self.config.startup_restarts
        reason = f"start-up failure (before every rank reached swiftrun.Run): {cause}"
        return self._restart_all(now, [
            Note(f"restarting every worker after a start-up failure (start-up restart {n} of {budget}, "
                 f"not counted in --max-restarts): {cause}"),
            Record(EventName.RESTART, {"attempt": self.attempt + 1, "reason": reason, "startup": True,
                                       "startup_restart": n, "startup_restarts": budget}),
        ])

    def _on_late_failure(self, slot: Slot, failure: ProcessFailure, now: float) -> list[Action]:
        """A rank failed after RELEASE went to every rank: training is complete, so this is a warning.

        The live ranks get ABORT in a new generation: their process group is shut down, so a tail collective
        (a barrier after saving) fails at once instead of hanging on the dead peer, and the runtime turns that
        into a warning. No replacement, no recovery: there is nothing left to train.
        """
        self.failures.append(failure)
        self.late_failures.append(failure)
        slot.failed_after_release = True
        how = failure.describe()
        actions: list[Action] = self._set_state(slot, WorkerState.FAILED, now)
        actions.append(Kill(slot.slot_id, signal.SIGKILL))  # a hung one is still there
        actions.append(Record(EventName.WORKER_FAILED, {
            "rank": slot.rank, "incarnation": slot.incarnation, "pid": slot.pid,
            "cause": failure.cause or how, "exitcode": failure.exitcode, "signal": failure.signal_name(),
            "traceback": failure.traceback, "after_release": True, **self._where(failure),
        }))
        actions.append(Note(
            f"WARNING: training had completed on every rank; afterwards {how}. Not a job failure: the other "
            f"ranks' process group is shut down so they do not wait for it"
        ))
        self.generation += 1
        for other in self._rank_slots():
            if other.alive and other.hello:
                actions.append(self._command(other, CommandKind.ABORT, {"after_release": True}))
        return actions + self._maybe_finish(now)

    def _can_recover_in_place(self) -> bool:
        if self.config.recovery is RecoveryMode.RESTART or not self.swift_started or self.unrecoverable:
            return False
        if self.config.world_size < 2 or self.recoveries_used >= self.config.max_recoveries:
            return False
        ranks = self._rank_slots()
        if any(s.state is WorkerState.EXITED for s in ranks):
            return False  # some ranks already left: there is no group to repair (after RELEASE: not needed)
        # a replica must survive: replacements still joining hold no state to copy from
        return any(s.alive and not s.replacement for s in ranks)

    def _escalate(self, now: float, cause: str) -> list[Action]:
        """In-place recovery is not possible: restart everything if allowed, else stop."""
        if self.state in (JobState.STOPPING, JobState.RESTARTING) or self.state.terminal:
            return []  # already decided (every rank of a failed recovery reports it)
        if self.recovery:
            self._close_recovery(now, outcome="escalated")
        if self.restarts_used < self.config.max_restarts:
            self.restarts_used += 1
            return self._restart_all(now, [
                Note(f"restarting every worker (restart {self.restarts_used} of {self.config.max_restarts}): "
                     f"{cause}"),
                Record(EventName.RESTART, {"attempt": self.attempt + 1, "reason": cause}),
            ])
        budget = "no restarts allowed (--max-restarts 0)" if not self.config.max_restarts else "restart budget spent"
        return [Note(f"stopping the job ({budget}): {cause}")] + self._stop_all(now, 1)

    def _restart_all(self, now: float, announce: list[Action]) -> list[Action]:
        """Stop every worker (spares too); :meth:`_restart` starts them again on a fresh store once all are gone."""
        self.state = JobState.RESTARTING
        self._restart_pending = True
        actions = announce + self._signal_live(signal.SIGTERM, now, WorkerState.RESTARTING)
        self.stop_deadline = now + self.config.timeouts.shutdown_timeout
        self._restart_started = now
        return actions + self._maybe_finish(now)

    def _stop_all(self, now: float, exit_code: int, forward: int = signal.SIGTERM) -> list[Action]:
        self.state = JobState.STOPPING
        self.exit_code = exit_code if self.exit_code is None else self.exit_code
        self.stop_deadline = now + self.config.timeouts.shutdown_timeout
        if self.recovery:
            self._close_recovery(now, outcome="stopped")
        return self._signal_live(forward, now, WorkerState.STOPPING) + self._maybe_finish(now)

    def _signal_live(self, sig: int, now: float, state: WorkerState) -> list[Action]:
        actions: list[Action] = []
        for slot in self._live_slots():
            actions.append(Kill(slot.slot_id, sig))
            actions += self._set_state(slot, state, now)
        return actions

    # ------------------------------------------------------------------ in-place recovery

    def _begin_recovery(self, ranks: list[int | None], cause: str, now: float, detect: float) -> list[Action]:
        self.recoveries_used += 1
        self.crash_loop.recovery_began(s.step for s in self._rank_slots() if s.alive and s.rank not in ranks)
        self.generation += 1
        failed = tuple(sorted(r for r in ranks if r is not None))
        actions: list[Action] = []
        if self.recovery is None:
            self.recovery = Recovery(
                generation=self.generation, failed_ranks=failed, cause=cause, failed_at=now - detect,
                # the survivors' abort; replacements have their own start-up deadline (_recovery_deadline_of)
                detect=detect, started_at=now, deadline=now + self.config.timeouts.recovery_timeout,
            )
            self.recovery.phase_duration[RecoveryPhase.DETECT] = detect
            actions.append(Record(EventName.RECOVERY_START, {
                "generation": self.generation, "failed_ranks": list(failed), "cause": cause, **self._nodes_of(failed),
            }))
            actions.append(Record(EventName.RECOVERY_PHASE, {
                "generation": self.generation, "phase": RecoveryPhase.DETECT.value,
                "start": now - detect, "duration": detect,
            }, at=now))
        else:
            # a failure during recovery: the same recovery goes on in a new generation
            rec = self.recovery
            rec.generation = self.generation
            rec.failed_ranks = tuple(sorted(set(rec.failed_ranks) | set(failed)))
            rec.cause = f"{rec.cause}; then {cause}"
            rec.deadline = now + self.config.timeouts.recovery_timeout
            rec.recover_sent_at = None
            actions.append(Note(f"another failure during recovery: generation {self.generation}"))
            actions.append(Record(EventName.RECOVERY_START, {
                "generation": self.generation, "failed_ranks": list(rec.failed_ranks), "cause": cause,
                "during_recovery": True, **self._nodes_of(rec.failed_ranks),
            }))
        rec = self.recovery
        rec.phase_start[RecoveryPhase.ABORT] = now
        rec.resend_at = now + RESEND_INTERVAL
        rec.phase_start[RecoveryPhase.SPAWN] = now
        self.state = JobState.RECOVERING
        for slot in self._rank_slots():
            if slot.alive and slot.rank not in failed:
                slot.ready_gen = -1
                slot.recovered_gen = -1
                slot.finishing = False
                self._unfinished.add(slot.rank)
                if slot.hello:
                    actions.append(self._command(slot, CommandKind.ABORT, {}))
                if slot.state is not WorkerState.JOINING:
                    actions += self._set_state(slot, WorkerState.ABORTING, now)
        for rank in failed:
            old = self.slots[self.rank_slot[rank]]
            actions += self._spawn_rank(rank, now, incarnation=old.incarnation + 1, joining=True)
        self._fill_recovery_barrier()
        actions.append(Note(
            f"recovering in place (generation {self.generation}): replacing rank(s) "
            f"{', '.join(map(str, failed))}"
        ))
        return actions + self._replenish_spares(now)

    def _nodes_of(self, ranks: tuple[int, ...]) -> dict[str, Any]:
        """Multi-node: the node slots whose ranks a recovery replaces, for its event record."""
        if not self.config.multinode:
            return {}
        return {"nodes": sorted({self._node_of_rank(rank) for rank in ranks})}

    def _fill_recovery_barrier(self) -> None:
        """Who the new generation waits for: one walk over the ranks per generation (launcher/barrier.py)."""
        gen = self.generation
        slots = ((rank, self.slots[slot_id]) for rank, slot_id in self.rank_slot.items())
        self.barrier = RecoveryBarrier.of(gen, (
            Member(rank, slot.replacement, ready=slot.ready_gen == gen, recovered=slot.recovered_gen == gen)
            for rank, slot in slots
        ))

    def _recover_args(self, slot: Slot) -> dict[str, Any]:
        """RECOVER's arguments for ``slot``: a replacement also gets its rank's own RNG streams' backups."""
        rec = self.recovery
        assert rec is not None
        if not slot.replacement or slot.rank is None:
            return rec.recover_args
        own = self.streams.of(slot.rank)
        return {**rec.recover_args, "own_rng": own} if own else rec.recover_args

    def _keeps_backups_of(self, slot: Slot) -> bool:
        """Whether ``slot``'s RNG backup is its rank's now: the rank's current process (alive, or dead and not yet
        replaced), or the process an in-place replacement is taking over from, until that replacement joins (the
        backups go out with its RECOVER). A backup sent just before a kill is often read only after the exit woke
        this loop (tests/integration/test_zoo.py, a kill right after the update); a restart of every process
        numbers its steps afresh, so its predecessors' late backups are dropped."""
        if slot.rank is None:
            return False
        if self._is_current(slot):
            return True
        current = self.slots.get(self.rank_slot.get(slot.rank, -1))
        return (current is not None and not slot.alive and current.replacement and not current.joined
                and slot.incarnation == current.incarnation - 1)

    def _is_current(self, slot: Slot) -> bool:
        """``slot`` serves its rank now (not an older incarnation of it, not a spare)."""
        return slot.rank is not None and self.rank_slot.get(slot.rank) == slot.slot_id

    def _slot_done_with_phase(self, slot: Slot) -> bool:
        if self.recovery is None:
            return True
        if self.recovery.recover_sent_at is None:
            return slot.ready_gen == self.generation
        return slot.recovered_gen == self.generation

    def _advance_recovery(self, now: float) -> list[Action]:
        rec = self.recovery
        if rec is None or self.state is not JobState.RECOVERING:
            return []
        actions: list[Action] = []
        if rec.recover_sent_at is None:
            # O(1) per event: the sets say who has not answered; the walks below happen once per phase
            if RecoveryPhase.ABORT not in rec.phase_duration and self.barrier.survivors_ready:
                actions += self._end_phase(RecoveryPhase.ABORT, now)
            if RecoveryPhase.SPAWN not in rec.phase_duration and self.barrier.replacements_ready:
                actions += self._end_phase(RecoveryPhase.SPAWN, now)
            if not self.barrier.ready:
                return actions
            ranks = self._rank_slots()
            if all(s.hello for s in ranks):
                rec.recover_sent_at = now
                rec.deadline = now + self.config.timeouts.recovery_timeout  # RECOVER -> RECOVERED
                rec.resend_at = now + RESEND_INTERVAL
                rec.recover_args = {"world_size": self.config.world_size, "replaced": list(rec.failed_ranks),
                                    "per_rank_rng": self.streams.per_rank}
                for slot in ranks:
                    actions.append(self._command(slot, CommandKind.RECOVER, self._recover_args(slot)))
                    actions += self._set_state(slot, WorkerState.RECOVERING, now)
            return actions
        if self.barrier.done:
            rec.phase_start[RecoveryPhase.RESUME] = now
            for slot in self._rank_slots():
                actions.append(self._command(slot, CommandKind.RESUME, {}))
                actions += self._set_state(slot, WorkerState.RUNNING, now)
                slot.step_changed_at = now
                slot.replacement = False
            actions += self._worker_phases(now)
            actions += self._end_phase(RecoveryPhase.RESUME, now)
            self._close_recovery(now, outcome="recovered")
            self.state = JobState.RUNNING
            actions += self._maybe_release(now)
        return actions

    def _on_replay_progress(self, slot: Slot, gen: int, data: dict[str, Any], now: float) -> list[Action]:
        """A pipeline stage replays towards the recovery point: while it makes progress its recovery deadline
        moves (a replay runs up to a checkpoint interval of steps, far longer than a transfer)."""
        rec = self.recovery
        if rec is None or gen != self.generation:
            return []
        rec.deadline = now + self.config.timeouts.recovery_timeout
        step, first, last = (int(data.get(k, -1)) for k in ("step", "first", "last"))
        rec.replay = f"rank {slot.rank}: step {step} of {first}..{last}"
        actions: list[Action] = []
        ranks = [int(r) for r in data.get("ranks", [slot.rank])]
        if RecoveryPhase.REPLAY not in rec.phase_start:
            rec.phase_start[RecoveryPhase.REPLAY] = now
            rec.mode = "replay"
            who = f"rank {ranks[0]} replays its stage" if len(ranks) == 1 else \
                f"ranks {', '.join(map(str, ranks))} replay their stages together"
            actions.append(Note(f"{who}: steps {first}..{last}, from the stage checkpoint of step {first} and the "
                                "logs of the neighbouring stages"))
        if step == first:
            actions.append(Record(EventName.REPLAY, {"generation": gen, "rank": slot.rank, "ranks": ranks,
                                                     "first": first, "last": last,
                                                     "helpers": [int(r) for r in data.get("helpers", [])]}))
        return actions

    def _worker_phases(self, now: float) -> list[Action]:
        """Fold the phase timings the ranks measured (rebuild, consensus, undo, transfer) into the record."""
        rec = self.recovery
        assert rec is not None
        actions: list[Action] = []
        datas = [s.recovery_data for s in self._rank_slots() if s.recovery_data]
        for phase in (RecoveryPhase.REBUILD, RecoveryPhase.CONSENSUS, RecoveryPhase.UNDO, RecoveryPhase.TRANSFER,
                      RecoveryPhase.REPLAY):
            durations = [float(d["phases"][phase.value]) for d in datas if phase.value in d.get("phases", {})]
            if durations:
                rec.phase_duration[phase] = max(durations)
                actions.append(Record(EventName.RECOVERY_PHASE, {
                    "generation": rec.generation, "phase": phase.value, "duration": max(durations),
                }))
        plans = [d.get("plan", {}) for d in datas]
        if plans:
            rec.mode = plans[0].get("mode")
            rec.source_rank = plans[0].get("source")
            rec.undo = _undone(rec.undo, plans[0])
        # any rank that undid arithmetically makes the recovered state inexact (runtime/core/precopy.py)
        rec.inexact = next((str(p["inexact"]) for p in plans if p.get("inexact")), rec.inexact)
        return actions

    def _end_phase(self, phase: RecoveryPhase, now: float) -> list[Action]:
        rec = self.recovery
        assert rec is not None
        start = rec.phase_start.get(phase, now)
        rec.phase_duration[phase] = now - start
        return [Record(EventName.RECOVERY_PHASE, {
            "generation": rec.generation, "phase": phase.value, "start": start, "duration": now - start,
        }, at=now)]

    def _close_recovery(self, now: float, outcome: str) -> None:
        rec = self.recovery
        if rec is None:
            return
        rec.done = True
        rec.total = now - rec.failed_at
        self.time_lost += rec.total
        self.last_recovery = rec
        self.recovery = None
        self._records.append(Record(EventName.RECOVERY_END, {
            "generation": rec.generation, "outcome": outcome, "mode": rec.mode, "source_rank": rec.source_rank,
            "total": rec.total, "failed_ranks": list(rec.failed_ranks), "undo": list(rec.undo),
            "inexact": rec.inexact,
        }))

    def drain_records(self) -> list[Action]:
        out, self._records = self._records, []
        return out

    # ------------------------------------------------------------------ start, finish, spares

    def _maybe_start_swift(self, now: float) -> list[Action]:
        # O(1) per REGISTERED: the walk over every rank below happens once, when the last one registered
        if self.swift_started or self._unregistered or len(self.rank_slot) < self.config.world_size:
            return []
        self.swift_started = True
        return [self._command(s, CommandKind.START, {}) for s in self._rank_slots()] + self._replenish_spares(now)

    def _maybe_release(self, now: float) -> list[Action]:
        # O(1) per FINISHING: the walk happens once, when the last rank finished
        if self.state is not JobState.RUNNING or not self.rank_slot or self._unfinished:
            return []
        self.released = True
        return [self._command(s, CommandKind.RELEASE, {}) for s in self._rank_slots()]

    def _maybe_finish(self, now: float) -> list[Action]:
        live = self._live_slots()
        if self.state is JobState.RESTARTING and self._restart_pending and not any(s.rank is not None for s in live):
            return self._restart(now)
        ranks = self._rank_slots()
        done = [s.state is WorkerState.EXITED or s.failed_after_release for s in ranks]
        if self.state is JobState.RUNNING and ranks and all(done):
            self.state = JobState.STOPPING
            self.exit_code = 0
            actions: list[Action] = [Kill(s.slot_id, signal.SIGTERM) for s in live]
            self.stop_deadline = now + self.config.timeouts.shutdown_timeout
            if not live:
                return actions + self._finish(now)
            return actions
        if self.state is JobState.STOPPING and not live:
            return self._finish(now)
        return []

    def _finish(self, now: float) -> list[Action]:
        code = self.exit_code if self.exit_code is not None else 1
        self.state = JobState.SUCCEEDED if code == 0 else JobState.FAILED
        self.stop_deadline = None
        return [Finish(code)]

    def _restart(self, now: float) -> list[Action]:
        self._restart_pending = False
        self.stop_deadline = None
        self.attempt += 1
        self.swift_started = False
        self.released = False
        self.crash_loop = CrashLoop()  # fresh processes: a loop of the last attempt says nothing about this one
        self.streams.forget()  # fresh processes number their steps afresh
        self.time_lost += now - self._restart_started
        actions: list[Action] = [ResetStore(self.attempt)]
        for rank in range(self.config.world_size):
            old = self.slots[self.rank_slot[rank]]
            actions += self._spawn_rank(rank, now, incarnation=old.incarnation + 1, joining=False)
        self.state = JobState.RUNNING
        return actions + self._replenish_spares(now)

    def _spawn_rank(self, rank: int, now: float, incarnation: int, joining: bool) -> list[Action]:
        spare = self._take_spare(self._node_of_rank(rank)) if joining else None
        if spare is not None:
            spare.rank = rank
            spare.incarnation = incarnation
            spare.replacement = True
            spare.joined = False
            spare.join_deadline = now + self.config.timeouts.startup_timeout  # runs the script from the top
            spare.state = WorkerState.STARTING
            self._bind_rank(rank, spare)
            # the spare said HELLO already; it joins as soon as it runs the script
            return [
                Assign(spare.slot_id, rank, incarnation, self.generation, self.attempt),
                *self._set_state(spare, WorkerState.JOINING, now),
            ]
        slot = self._new_slot(rank, incarnation, now)
        slot.replacement = joining
        if joining:
            slot.join_deadline = now + self.config.timeouts.startup_timeout
        self._bind_rank(rank, slot)
        return [Spawn(slot.slot_id, rank, incarnation, self.generation, self.attempt, joining, slot.node)]

    def _bind_rank(self, rank: int, slot: Slot) -> None:
        """``slot`` serves ``rank`` from now on (every change of ``rank_slot`` goes through here)."""
        self.rank_slot[rank] = slot.slot_id
        for done, pending in ((slot.registered, self._unregistered), (slot.finishing, self._unfinished)):
            if done:
                pending.discard(rank)
            else:
                pending.add(rank)

    def _node_of_rank(self, rank: int) -> int:
        """Stable slots: node slot k owns ranks [k*P, (k+1)*P) for the whole job (0 on one node)."""
        return rank // self.config.nproc_per_node if self.config.multinode else 0

    def _take_spare(self, node: int) -> Slot | None:
        for slot in self.slots.values():
            # STARTING is a spare's waiting state; one being stopped (restart, shutdown) is no spare any more
            if slot.rank is None and slot.node == node and slot.state is WorkerState.STARTING and slot.hello:
                return slot
        return None

    def _replenish_spares(self, now: float) -> list[Action]:
        if (
            not self.config.swift
            # spares only serve in-place recovery, so only a script that registers swiftrun.Run gets them; they
            # start with the job (a failure in the first steps finds one warm) and warm up at idle priority,
            # so they cost the job's start nothing
            or not (self._expects_registration() or self.swift_started)
            or self.config.entrypoint.kind.value == "executable"
            or self.state in (JobState.STOPPING, JobState.RESTARTING)
            or self.state.terminal
            or self.spare_failures >= 3  # spares that keep dying are not worth it: replacements start cold
        ):
            return []
        actions: list[Action] = []
        nodes = range(self.config.nnodes[0]) if self.config.multinode else range(1)
        spares_on: dict[int, int] = {}  # counted in one pass: per node it would cost nodes x slots (1,250 x 11,250)
        for s in self.slots.values():
            if s.rank is None and s.alive:
                spares_on[s.node] = spares_on.get(s.node, 0) + 1
        for node in nodes:
            if node in self.vacant_nodes:
                continue
            have = spares_on.get(node, 0)
            for _ in range(self.config.spares - have):
                slot = self._new_slot(None, 0, now, node)
                actions.append(Spawn(slot.slot_id, None, 0, self.generation, self.attempt, False, node))
        return actions

    def _new_slot(self, rank: int | None, incarnation: int, now: float, node: int | None = None) -> Slot:
        if node is None:
            node = self._node_of_rank(rank) if rank is not None else 0
        slot = Slot(self._next_slot, rank, incarnation, node=node, spawned_at=now, last_seen=now)
        self._next_slot += 1
        self.slots[slot.slot_id] = slot
        return slot

    # ------------------------------------------------------------------ helpers

    def _command(self, slot: Slot, kind: CommandKind, args: dict[str, Any]) -> Send:
        self._next_cmd += 1
        return Send(slot.slot_id, self.generation, self._next_cmd, kind, args)

    def _set_state(self, slot: Slot, state: WorkerState, now: float) -> list[Action]:
        if slot.state is state:
            return []
        previous, slot.state = slot.state, state
        if slot.rank is None:
            return []
        return [Record(EventName.WORKER_STATE, {
            "rank": slot.rank, "incarnation": slot.incarnation, "pid": slot.pid,
            "state": state.value, "previous": previous.value,
        })]

    def _rank_slots(self) -> list[Slot]:
        # ranks are 0..world-1 once started: index them in order rather than sort the mapping each time
        return [self.slots[self.rank_slot[rank]] for rank in range(self.config.world_size) if rank in self.rank_slot]

    def _live_slots(self) -> list[Slot]:
        return [s for s in self.slots.values() if s.alive]

    def slot_of_rank(self, rank: int) -> Slot:
        return self.slots[self.rank_slot[rank]]
