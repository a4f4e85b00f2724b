"""The launcher's one event loop: it owns the ROUTER socket, the children's pidfds and the signal pipe.

Each turn it waits (never longer than the state machine's next deadline) for a message, a child's exit or a
signal, feeds what happened to :class:`~swiftrun.launcher.job.Job`, and carries out the actions it answers with.
Nothing else touches the sockets; the dashboard only ever reads published snapshots.
"""

from __future__ import annotations

import collections
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from swiftrun.protocol import control as protocol
from swiftrun.protocol.errorfile import read_error_file
from swiftrun.config import EntrypointKind, LaunchConfig
from swiftrun.errors import LaunchError, ProtocolError
from swiftrun.dashboard.live import Dashboard
from swiftrun.events import EventLog, EventName
from swiftrun.launcher import envs, procs, view
from swiftrun.launcher.actions import Action, Assign, Finish, Kill, Note, Record, ResetStore, Send, Spawn
from swiftrun.launcher.contract import SupervisedJob
from swiftrun.launcher.failures import format_late_failures, format_summary
from swiftrun.launcher.job import Job
from swiftrun.launcher.logs import LogPump, OutputPlan, stdio_writer
from swiftrun.launcher.script import uses_swiftrun
from swiftrun.launcher.store import AgentStore
from swiftrun.launcher.zygote import ZygoteClient, ZygoteEvent, ZygoteState
from swiftrun.protocol.zygote import ZygoteKind
from swiftrun.snapshot import JobSnapshot

SNAPSHOT_PERIOD = 0.2  # seconds between published snapshots
PROGRESS_PERIOD = 0.25  # seconds between sampled progress events in the event log
ZYGOTE_RESTARTS = 3  # a zygote that died (killed from outside, OOM) is started again this many times per agent


class Agent:
    def __init__(self, config: LaunchConfig, reporter: Any, log_root: Path, event_log_path: Path | None = None) -> None:
        self.config = config
        self.reporter = reporter
        self.log_root = log_root
        self.run_id = config.rdzv_id if config.rdzv_id != "none" else "none"
        self.token = secrets.token_hex(16)
        self.procs: dict[int, procs.WorkerProcess] = {}
        self.identities: dict[int, bytes] = {}  # slot -> ZeroMQ routing id
        self.slot_by_identity: dict[bytes, int] = {}
        self.deferred: dict[int, list[Send]] = collections.defaultdict(list)
        self.notes: collections.deque[str] = collections.deque(maxlen=8)
        self.exit_code: int | None = None
        self._last_snapshot = 0.0
        self.throughput = view.Throughput()
        self._last_progress_step = -1
        self._last_progress_record = 0.0
        # rank 0's newest step not yet in the event log, with when it came (written with that time at the end)
        self._pending_progress: tuple[float, protocol.Status] | None = None
        self._run_dir = Path(tempfile.mkdtemp(prefix="swiftrun-"))  # 0700: only this user reaches the socket
        if len(f"{self._run_dir}/ctl") > getattr(zmq, "IPC_PATH_MAX_LEN", 107):
            # a unix socket path has a hard length limit: a long $TMPDIR must not break the launcher
            self._run_dir.rmdir()
            self._run_dir = Path(tempfile.mkdtemp(prefix="swiftrun-", dir="/tmp"))
        self.ctl_addr = f"ipc://{self._run_dir}/ctl"
        self.event_log_path = event_log_path or config.event_log or (log_root / "events.jsonl")
        self.event_log = EventLog(self.event_log_path)
        self.t0 = time.monotonic()
        self.store: AgentStore | None = None
        self.live = isinstance(reporter, Dashboard)  # worker output must go above the live region
        self.plan = OutputPlan(config, relay_console=self.live)
        self.pump: LogPump | None = None
        self.job: SupervisedJob | None = None  # a local Job here; a RemoteJob in a multi-node agent
        self._reaped: set[int] = set()
        self.zygote = ZygoteClient()
        self._zygote_restarts = 0
        self._zygote_noted = False
        self._forking: dict[int, _PendingFork] = {}  # slot -> a FORK the zygote has not answered yet
        self._early_hellos: dict[int, tuple[bytes, protocol.Hello]] = {}  # pid -> HELLO that beat its FORKED
        self._idle_sent = False
        self._router: zmq.Socket | None = None

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> int:
        """The set-up every agent shares (sockets, signals, output, zygote), then the one loop, then teardown."""
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.linger = 0
        router.router_mandatory = 1
        sig_r, sig_w = socket.socketpair()
        sig_r.setblocking(False)
        sig_w.setblocking(False)
        old_handlers: dict[int, Any] = {}
        old_wakeup = -1
        try:
            try:
                router.bind(self.ctl_addr)
            except zmq.ZMQError as exc:
                raise LaunchError(f"cannot open the control socket {self.ctl_addr}: {exc}") from None
            self._connect(ctx)
            self.ends = self._endpoints()
            for signum in self.config.signals_to_handle:
                old_handlers[signum] = signal.signal(signum, _record_signal)
            old_wakeup = signal.set_wakeup_fd(sig_w.fileno(), warn_on_full_buffer=False)
            if self.plan.piped:
                self.pump = LogPump(self.plan, self._console_line)
            banner = envs.omp_threads_banner(self.config)
            if banner:
                print(banner, file=sys.stderr)
            self.reporter.start()
            if uses_swiftrun(self.config.entrypoint):
                self._start_zygote()  # with the workers, as spares start: it warms up while they import
            self._begin(time.monotonic())
            self._loop(router, sig_r)
        finally:
            self._teardown(router, ctx, sig_r, sig_w, old_handlers, old_wakeup)
        return self.exit_code if self.exit_code is not None else 1

    def _connect(self, ctx: zmq.Context) -> None:
        """More sockets before the loop starts (a node agent's DEALER to the coordinator); none on one node."""

    def _endpoints(self) -> envs.JobEndpoints:
        """Where the store and the control socket are; on one node the agent hosts the store."""
        master_addr, port = self._store_endpoint()
        self.store = AgentStore(master_addr, port, self.config.world_size)
        return envs.JobEndpoints(
            master_addr=master_addr, master_port=self.store.port, ctl_addr=self.ctl_addr, token=self.token,
            run_id=self.run_id, attempt_dir=self._attempt_dir(0),
        )

    def _begin(self, now: float) -> None:
        """Start the job: on one node the local state machine decides."""
        self._note(f"event log: {self.event_log_path}")
        job = Job(self.config, now, wall_offset=time.time() - time.monotonic(),
                  registers=uses_swiftrun(self.config.entrypoint))
        self.job = job
        self.event_log.write(EventName.JOB_START, config=_config_dict(self.config), world_size=self.config.world_size,
                             script=self.config.entrypoint.target, pid=os.getpid())
        self._execute(job.start(time.monotonic()))

    def _store_endpoint(self) -> tuple[str, int]:
        c = self.config
        if c.rdzv_backend == "c10d" and c.rdzv_endpoint:
            host, _, port = c.rdzv_endpoint.rpartition(":") if ":" in c.rdzv_endpoint else (c.rdzv_endpoint, "", "29400")
            return (host or c.master_addr), int(port)
        return c.master_addr, c.master_port

    def _loop(self, router: zmq.Socket, sig_r: socket.socket) -> None:
        self._router = router
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(sig_r.fileno(), zmq.POLLIN)
        self._register_extra(poller)
        registered_fds: dict[int, int] = {}
        zygote_fd: int | None = None
        assert self.job is not None
        while self.exit_code is None:
            if self.zygote.fileno() != zygote_fd:  # started, or gone
                if zygote_fd is not None:
                    poller.unregister(zygote_fd)
                zygote_fd = self.zygote.fileno()
                if zygote_fd is not None:
                    poller.register(zygote_fd, zmq.POLLIN)
            for slot_id, proc in self.procs.items():  # keep pidfds in the poller in step with the processes
                if proc.pidfd is not None and proc.pidfd not in registered_fds:
                    registered_fds[proc.pidfd] = slot_id
                    poller.register(proc.pidfd, zmq.POLLIN)
            now = time.monotonic()
            timeout = max(0.0, self.job.next_deadline(now) - now)
            if any(p.pidfd is None and p.alive for p in self.procs.values()):
                timeout = min(timeout, self.config.monitor_interval)
            zygote_deadline = self.zygote.next_deadline(self.config.timeouts.startup_timeout)
            if zygote_deadline is not None:
                timeout = min(timeout, max(0.0, zygote_deadline - now) + 0.01)
            ready = dict(poller.poll(timeout * 1000))
            # the zygote first: a forked worker's HELLO must find its pid known (FORKED names it)
            if zygote_fd is not None and zygote_fd in ready:
                self._on_zygote(self.zygote.read())
            why = self.zygote.overdue(time.monotonic(), self.config.timeouts.startup_timeout)
            if why is not None:
                self._zygote_failed(why)
            if router in ready:
                self._drain_router(router)
            self._handle_extra(ready)
            if self.exit_code is not None:
                break
            if sig_r.fileno() in ready:
                for signum in _drain_signals(sig_r):
                    self._execute(self.job.on_signal(signum, time.monotonic()))
            for fd in [fd for fd in ready if isinstance(fd, int) and fd in registered_fds]:
                poller.unregister(fd)
                slot_id = registered_fds.pop(fd)
                self._reap(slot_id)
            for slot_id, proc in list(self.procs.items()):  # processes without a pidfd, and missed exits
                if proc.pidfd is None and proc.alive and proc.poll() is not None:
                    self._reap(slot_id)
            now = time.monotonic()
            self._execute(self.job.tick(now, self._stopped(self.job.silent_slots(now))))
            self._flush(router)
            self._publish(time.monotonic())

    def _register_extra(self, poller: zmq.Poller) -> None:
        """More sockets for the one loop (a node agent's link to the coordinator); none on one node."""

    def _handle_extra(self, ready: dict) -> None:
        """Handle what :meth:`_register_extra` registered."""

    def _reap(self, slot_id: int) -> None:
        assert self.job is not None
        if slot_id in self._reaped:
            return
        self._reaped.add(slot_id)
        proc = self.procs[slot_id]
        rc = proc.popen.wait()  # the pidfd said it exited: this does not block
        proc.returncode = rc
        proc._close_fds()
        slot = self.job.slots[slot_id]
        error_file = None
        if slot.rank is not None:
            path = self.ends.attempt_dir / str(self._local(slot.rank)) / "error.json"
            if path.exists():
                error_file = str(path)
                if slot.traceback is None:
                    slot.traceback = read_error_file(error_file)
        # a plain exit needs no cause: its exit code says it all (format_summary keeps "cause" for hangs, stalls)
        self._execute(self.job.on_exit(slot_id, rc, time.monotonic(), error_file=error_file))
        self._reap_orphans()

    # ------------------------------------------------------------------ messages

    def _drain_router(self, router: zmq.Socket) -> None:
        assert self.job is not None
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            try:
                msg = protocol.decode(body)
            except ProtocolError as exc:
                self._note(f"dropped a malformed control message: {exc}")
                continue
            now = time.monotonic()
            if isinstance(msg, protocol.Hello):
                self._on_hello(router, identity, msg, now)
                continue
            slot_id = self.slot_by_identity.get(identity)
            if slot_id is None:
                continue  # a peer that never said a valid HELLO
            slot = self.job.slots[slot_id]
            if isinstance(msg, protocol.Heartbeat):
                self._execute(self.job.on_alive(slot_id, now, msg.step))
            elif isinstance(msg, protocol.Status):
                if not self._idle_sent and msg.step >= 0:
                    self._idle_sent = True  # training runs: the zygote's warm-up yields the CPU from now on
                    self.zygote.idle()
                self._execute(self.job.on_status(slot_id, now, msg.step, msg.loss, msg.step_time, msg.metrics))
                if slot.rank == 0 and msg.step != self._last_progress_step:
                    self.throughput.add(now, msg.step)
                    self._last_progress_step = msg.step
                    self._record_progress(now, msg)
            elif isinstance(msg, protocol.Event):
                self._execute(self.job.on_event(slot_id, msg.gen, msg.event, msg.data, now))
            elif isinstance(msg, protocol.Ack):
                self._execute(self.job.on_ack(slot_id, msg.cmd_id, now))
            elif isinstance(msg, protocol.Ping):  # everything this worker sent before it was read above
                self._send_raw(router, slot_id, protocol.Pong(gen=msg.gen, seq=msg.seq))

    def _stopped(self, slot_ids: list[int]) -> frozenset[int]:
        """Which of these slots' processes the kernel reports as stopped (state T), e.g. by SIGSTOP."""
        stopped = set()
        for slot_id in slot_ids:
            proc = self.procs.get(slot_id)
            if proc is not None and proc.alive and procs.is_stopped(proc.pid):
                stopped.add(slot_id)
        return frozenset(stopped)

    def _record_progress(self, now: float, msg: protocol.Status) -> None:
        """A sampled ``progress`` event (at most PROGRESS_PERIOD apart) for the report's timeline."""
        self._pending_progress = (now, msg)
        if now - self._last_progress_record < PROGRESS_PERIOD:
            return
        self._pending_progress = None
        self._last_progress_record = now
        self.event_log.write(EventName.PROGRESS, at=now, step=msg.step, loss=msg.loss, step_time=msg.step_time,
                             steps_per_s=self.throughput.steps_per_s())

    def _on_hello(self, router: zmq.Socket, identity: bytes, msg: protocol.Hello, now: float) -> None:
        assert self.job is not None
        if msg.token != self.token or msg.proto != protocol.PROTOCOL_VERSION:
            self._note(f"refused a control connection from pid {msg.pid} (wrong token or protocol version)")
            return
        slot_id = next((sid for sid, p in self.procs.items() if p.pid == msg.pid), None)
        if slot_id is None:
            if self._forking:  # a forked worker faster than the zygote's FORKED: replayed once it is adopted
                self._early_hellos[msg.pid] = (identity, msg)
            return
        self.identities[slot_id] = identity
        self.slot_by_identity[identity] = slot_id
        welcome = protocol.Welcome(gen=self.job.generation, heartbeat_interval=self.config.timeouts.heartbeat_interval,
                                   heartbeat_timeout=self.config.timeouts.heartbeat_timeout)
        self._send_raw(router, slot_id, welcome)
        self._execute(self.job.on_hello(slot_id, msg.gen, now))

    def _flush(self, router: zmq.Socket) -> None:
        for slot_id in list(self.deferred):
            if slot_id in self.identities:
                for send in self.deferred.pop(slot_id):
                    self._send_command(router, send)

    def _send_command(self, router: zmq.Socket, send: Send) -> None:
        msg = protocol.Command(gen=send.generation, cmd_id=send.cmd_id, command=send.command, args=send.args)
        self._send_raw(router, send.slot_id, msg)

    def _send_raw(self, router: zmq.Socket, slot_id: int, msg: protocol.Message) -> None:
        identity = self.identities.get(slot_id)
        if identity is None:
            return
        try:
            router.send_multipart([identity, *protocol.encode(msg)], zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):
            pass  # the peer is gone; its pidfd tells the state machine

    # ------------------------------------------------------------------ actions

    def _execute(self, actions: list[Action]) -> None:
        assert self.job is not None
        actions = actions + self.job.drain_records()
        for action in actions:
            if isinstance(action, Spawn):
                self._spawn(action)
            elif isinstance(action, Assign):
                self._assign(action)
            elif isinstance(action, Send):
                self.deferred[action.slot_id].append(action)
            elif isinstance(action, Kill):
                proc = self.procs.get(action.slot_id)
                if proc is not None:
                    proc.signal_group(action.signum)
                elif action.slot_id in self._forking:  # carried out once the zygote says which pid it is
                    self._forking[action.slot_id].signals.append(action.signum)
            elif isinstance(action, ResetStore):
                if self.store is not None:  # a node agent's store lives with the coordinator
                    self.store.reset()
                self.ends = envs.JobEndpoints(**{**self.ends.__dict__, "attempt_dir": self._attempt_dir(action.attempt)})
            elif isinstance(action, Record):
                fields = dict(action.fields)
                if isinstance(fields.get("start"), float):  # the state machine speaks monotonic time
                    fields["start"] = self.event_log.since_start(fields["start"])
                self.event_log.write(action.event, at=action.at, **fields)
            elif isinstance(action, Note):
                self._note(action.text)
            elif isinstance(action, Finish):
                self.exit_code = action.exit_code

    def _spawn(self, action: Spawn) -> None:
        assert self.job is not None
        env = envs.worker_environ(
            self.config, self.ends, action.rank, attempt=action.attempt, incarnation=action.incarnation,
            generation=action.generation, joining=action.joining,
        )
        local_rank = None if action.rank is None else self._local(action.rank)
        if local_rank is not None:  # as torchrun: the folder of TORCHELASTIC_ERROR_FILE exists (torch's @record)
            Path(env["TORCHELASTIC_ERROR_FILE"]).parent.mkdir(parents=True, exist_ok=True)
        # spares and replacements come warm from the zygote; the first workers of an attempt start as torchrun's
        if (action.rank is None or action.joining) and self._fork(action, env, local_rank):
            return
        argv = procs.worker_argv(self.config, spare=action.rank is None)
        try:
            if self.plan.piped:
                proc = procs.spawn(argv, env, subprocess.PIPE, subprocess.PIPE)
                assert self.pump is not None
                self.pump.add(action.slot_id, local_rank, proc.stdout, proc.stderr, self.ends.attempt_dir)
            else:
                target = self.plan.inherit_target(local_rank)
                proc = procs.spawn(argv, env, target, target)
        except LaunchError as exc:
            self._execute(self.job.on_spawn_failed(action.slot_id, str(exc), time.monotonic()))
            return
        self.procs[action.slot_id] = proc
        self._execute(self.job.on_spawned(action.slot_id, proc.pid, time.monotonic()))

    # ------------------------------------------------------------------ the zygote

    def _start_zygote(self) -> None:
        """One zygote per agent, for jobs that get spares: it warms up while the workers start."""
        c = self.config
        hot_spare_node = c.multinode and c.node_rank >= c.nnodes[0]  # its whole purpose: take a lost slot at once
        if not c.swift or (c.spares <= 0 and not hot_spare_node) or c.entrypoint.kind is EntrypointKind.EXECUTABLE:
            return
        if os.environ.get("SWIFTRUN_NO_ZYGOTE") == "1":  # benchmarks: spares and replacements as before the zygote
            self.zygote.state = ZygoteState.FAILED
            return
        if self.zygote.state is not ZygoteState.OFF:
            return
        env = envs.worker_environ(c, self.ends, None, attempt=0, incarnation=0, generation=0, joining=False)
        if "OMP_NUM_THREADS" not in env and "OPENBLAS_NUM_THREADS" not in env:
            # numpy's OpenBLAS starts its thread pool at import; the zygote must stay single-threaded to fork
            env["OPENBLAS_NUM_THREADS"] = "1"
        stderr = None if os.environ.get("SWIFTRUN_LOGLEVEL") else subprocess.DEVNULL
        why = self.zygote.start(procs.python_executable(c), env, stderr)
        if why is not None:
            self._note(f"no zygote ({why}): spares start cold")
        else:
            self.event_log.write(EventName.ZYGOTE, state="warming", pid=self.zygote.pid)

    def _fork(self, action: Spawn, env: dict[str, str], local_rank: int | None) -> bool:
        """Ask the zygote for this worker; False: start it cold."""
        if self.config.entrypoint.kind is EntrypointKind.EXECUTABLE:
            return False
        if self.zygote.state is ZygoteState.OFF:
            self._start_zygote()  # a script that registers without saying so in its text: first spare
        if not self.zygote.usable:
            return False
        reads: tuple[int, int] | None = None
        if self.plan.piped:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            reads, writes, ours = (out_r, err_r), (out_w, err_w), [out_w, err_w]
        elif self.plan.inherit_target(local_rank) == subprocess.DEVNULL:
            null = os.open(os.devnull, os.O_WRONLY)
            writes, ours = (null, null), [null]
        else:
            writes, ours = (1, 2), []  # the agent's own terminal, as a spawned worker inherits it
        try:
            sent = self.zygote.fork(action.slot_id, procs.bootstrap_args(self.config), env, *writes)
        finally:
            for fd in ours:
                os.close(fd)  # the zygote holds its own copies now
        if not sent:
            for fd in reads or ():
                os.close(fd)
            self._zygote_note()
            return False
        self._forking[action.slot_id] = _PendingFork(action, local_rank, reads)
        return True

    def _on_zygote(self, events: list[ZygoteEvent]) -> None:
        assert self.job is not None
        for ev in events:
            if ev.kind is ZygoteKind.READY:
                self._note(f"zygote warm in {ev.seconds:.1f}s: spares and replacements fork from it in milliseconds")
                self.event_log.write(EventName.ZYGOTE, state="warm", seconds=ev.seconds)
            elif ev.kind is ZygoteKind.FORKED:
                assert ev.slot is not None and ev.pid is not None
                self._adopt(ev.slot, ev.pid, ev.seconds or 0.0)
            else:  # FORK_FAILED, WARM_FAILED, gone
                self._zygote_failed(ev.reason, also=[ev.slot] if ev.slot is not None else [])
                return

    def _adopt(self, slot_id: int, pid: int, seconds: float) -> None:
        assert self.job is not None
        pending = self._forking.pop(slot_id, None)
        stdout = stderr = None
        if pending is not None and pending.reads is not None:
            stdout, stderr = (os.fdopen(fd, "rb", buffering=0) for fd in pending.reads)
        proc = procs.adopt(pid, stdout, stderr)
        self.procs[slot_id] = proc
        if pending is None:  # not ours to know (never expected): no worker may go unwatched
            proc.signal_group(signal.SIGKILL)
            return
        if self.pump is not None and stdout is not None:
            self.pump.add(slot_id, pending.local_rank, stdout, stderr, self.ends.attempt_dir)
        action = pending.action
        self.event_log.write(EventName.ZYGOTE, state="forked", slot=slot_id, rank=action.rank, pid=pid,
                             ms=round(seconds * 1000, 1))
        if action.rank is not None:  # no spare was left: the replacement itself came warm
            self._note(f"rank {action.rank}: replacement forked warm from the zygote ({seconds * 1000:.0f} ms)")
        self._execute(self.job.on_spawned(slot_id, pid, time.monotonic()))
        for signum in pending.signals:
            proc.signal_group(signum)
        early = self._early_hellos.pop(pid, None)
        if early is not None and self._router is not None:
            self._on_hello(self._router, early[0], early[1], time.monotonic())

    def _zygote_failed(self, reason: str, also: list[int] | None = None) -> None:
        """Never lose the job to the zygote: what it did not fork starts cold, and it is said once."""
        slots = sorted(set(self.zygote.fail(reason)) | set(also or ()))
        self._zygote_note()
        for slot_id in slots:
            pending = self._forking.pop(slot_id, None)
            if pending is None:
                continue
            for fd in pending.reads or ():
                os.close(fd)
            if pending.signals:  # the state machine gave up on it already: nothing to start
                self._execute(self.job.on_exit(slot_id, -pending.signals[-1], time.monotonic()))  # type: ignore[union-attr]
                continue
            self._spawn(pending.action)
        self._early_hellos.clear()
        self._restart_zygote()

    def _restart_zygote(self) -> None:
        """A zygote that was killed or stopped from outside (not one whose warm-up failed: that would fail again)
        is started anew, a few times, so that later spares and replacements come warm again; until it is warm
        they start cold."""
        if self.zygote.warm_up_failed or self._zygote_restarts >= ZYGOTE_RESTARTS or self.exit_code is not None:
            return
        self._zygote_restarts += 1
        self.zygote = ZygoteClient()
        self._zygote_noted = False
        self._note(f"starting a new zygote ({self._zygote_restarts} of at most {ZYGOTE_RESTARTS})")
        self._start_zygote()

    def _zygote_note(self) -> None:
        if self.zygote.state is ZygoteState.FAILED and not self._zygote_noted:
            self._zygote_noted = True
            again = " until a new one is warm" if self._zygote_restarts < ZYGOTE_RESTARTS else " from now on"
            self._note(f"zygote stopped ({self.zygote.failure}): spares and replacements start cold{again}")
            self.event_log.write(EventName.ZYGOTE, state="failed", reason=self.zygote.failure)

    def _reap_orphans(self) -> None:
        """As a child subreaper the agent inherits orphaned descendants of workers (a DataLoader worker whose
        worker died): reap those that exited, so that no zombie piles up."""
        if self.zygote.state is ZygoteState.OFF:
            return
        known = {p.pid for p in self.procs.values() if p.alive}
        if self.zygote.pid is not None:
            known.add(self.zygote.pid)
        for pid in _children():
            if pid in known:
                continue
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass

    def _assign(self, action: Assign) -> None:
        env = envs.rank_env(self.config, self.ends, action.rank, action.attempt)
        Path(env["TORCHELASTIC_ERROR_FILE"]).parent.mkdir(parents=True, exist_ok=True)
        env.update({envs.INCARNATION: str(action.incarnation), envs.GENERATION: str(action.generation),
                    envs.JOINING: "1", envs.SPARE: "0"})
        if self.pump is not None:
            self.pump.relabel(action.slot_id, self._local(action.rank), self.ends.attempt_dir)
        self.deferred[action.slot_id].append(
            Send(action.slot_id, action.generation, 0, protocol.CommandKind.ASSIGN, {"env": env, "rank": action.rank})
        )

    # ------------------------------------------------------------------ output

    def _console_line(self, line: str, is_stderr: bool) -> None:
        if self.live:
            self.reporter.print_line(line)
        else:
            stdio_writer(line, is_stderr)

    def _note(self, text: str) -> None:
        self.notes.append(text)
        if self.live:
            self.reporter.print_line(f"swiftrun: {text}")
        else:
            print(f"swiftrun: {text}", file=sys.stderr, flush=True)

    def _publish(self, now: float, force: bool = False) -> None:
        if not force and now - self._last_snapshot < SNAPSHOT_PERIOD:
            return
        self._last_snapshot = now
        self.reporter.update(self.snapshot(now))

    def snapshot(self, now: float) -> JobSnapshot:
        assert isinstance(self.job, Job)  # a node agent publishes no snapshot of its own (NodeAgent._publish)
        return view.job_snapshot(self.job, self.config, now, started_at=self.t0, notes=tuple(self.notes),
                                 event_log=str(self.event_log_path), throughput=self.throughput,
                                 local_rank=self._local)

    # ------------------------------------------------------------------ teardown

    def _teardown(self, router, ctx, sig_r, sig_w, old_handlers, old_wakeup) -> None:
        # whatever happened, no worker outlives the launcher
        for proc in self.procs.values():
            if proc.alive:
                proc.signal_group(signal.SIGKILL)
        self.zygote.close()
        if self.zygote.state is not ZygoteState.OFF:
            # a worker forked but not yet announced (or anything else reparented to us) is ours to end too
            for pid in _children():
                if not any(p.pid == pid for p in self.procs.values()):
                    _kill_and_reap(pid)
        for proc in self.procs.values():
            if proc.popen.returncode is None:
                try:
                    proc.popen.wait(timeout=5)
                except Exception:
                    pass
            proc._close_fds()
        if old_wakeup is not None:
            signal.set_wakeup_fd(old_wakeup)
        for signum, handler in old_handlers.items():
            signal.signal(signum, handler)
        if self.pump is not None:
            self.pump.close()
        router.close(linger=0)
        ctx.term()
        sig_r.close()
        sig_w.close()
        if self.job is not None:
            now = time.monotonic()
            if self._pending_progress is not None:
                self._last_progress_record = 0.0
                self._record_progress(*self._pending_progress)  # stamped when it came, not at teardown
            self._publish(now, force=True)
            self.event_log.write(EventName.JOB_END, outcome="succeeded" if self.exit_code == 0 else "failed",
                                 exit_code=self.exit_code, duration=now - self.t0, failures=len(self.job.failures),
                                 time_lost=self.job.time_lost,
                                 failures_after_release=len(self.job.late_failures))
        self.reporter.stop()
        self.event_log.close()
        if self.store is not None:
            self.store.close()
        shutil.rmtree(self._run_dir, ignore_errors=True)
        if self.job is not None and self.exit_code not in (0, None) and self.job.failures:
            print(format_summary(self.config.entrypoint.target, self.job.failures), file=sys.stderr, flush=True)
        elif self.job is not None and self.exit_code == 0 and self.job.late_failures:
            print(format_late_failures(self.config.entrypoint.target, self.config.world_size, self.job.late_failures),
                  file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ helpers

    def _attempt_dir(self, attempt: int) -> Path:
        return self.log_root / f"attempt_{attempt}"

    def _local(self, rank: int) -> int:
        return rank - self.config.node_rank * self.config.nproc_per_node


@dataclass
class _PendingFork:
    """A worker asked of the zygote: what to start cold if it never comes, and what the loop did meanwhile."""

    action: Spawn
    local_rank: int | None
    reads: tuple[int, int] | None  # our ends of its stdout/stderr pipes (when output is relayed)
    signals: list[int] = field(default_factory=list)  # Kills the state machine asked for before the pid was known


def _children() -> list[int]:
    """This process's children, as the kernel lists them (every thread's: the subreaper adopts into any)."""
    pids: list[int] = []
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/children") as f:
                    pids.extend(int(p) for p in f.read().split())
            except OSError:
                continue
    except OSError:
        pass
    return pids


def _kill_and_reap(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        time.sleep(0.01)


def _record_signal(signum, frame) -> None:
    """Handlers only mark the signal; the wakeup fd carries it to the loop."""


def _drain_signals(sock: socket.socket) -> list[int]:
    out: list[int] = []
    while True:
        try:
            data = sock.recv(512)
        except (BlockingIOError, InterruptedError):
            return out
        if not data:
            return out
        out.extend(data)


def _config_dict(config: LaunchConfig) -> dict[str, Any]:
    import dataclasses

    def convert(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return {f.name: convert(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, (tuple, list, frozenset, set)):
            return [convert(v) for v in value]
        if isinstance(value, Path):
            return str(value)
        if hasattr(value, "value"):
            return value.value
        return value

    return convert(config)


def new_log_root(config: LaunchConfig) -> Path:
    """torchrun's layout: ``<log_dir>/<run_id>_<random>``; without --log-dir a fresh temporary folder."""
    if config.log_dir is None:
        return Path(tempfile.mkdtemp(prefix="swiftrun_"))
    root = config.log_dir / f"{config.rdzv_id}_{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True, exist_ok=True)
    return root
