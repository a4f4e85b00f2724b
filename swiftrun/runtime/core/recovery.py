"""The worker's side of the recovery protocol (see docs/ARCHITECTURE.md, "The recovery sequence").

One :class:`Recovery` per process, created by ``swiftrun.Run``. A training step is a transaction
(:mod:`~swiftrun.runtime.core.txn`): its start is snapshotted, the optimizer update inside it is tracked (and can be
undone), and when the launcher aborts a generation every rank first settles its own state (an interrupted step is
put back to its start; a rank whose state something untracked wrote says it is not valid), then runs:

    ABORTED/JOINING -> wait RECOVER(g) -> rebuild group g -> consensus -> undo -> transfer -> rebind DDP
    -> verify (digests of the whole state agree on every rank) -> RECOVERED(g) -> wait RESUME(g)

A newer ABORT at any point restarts the procedure for the newer generation; what was already made consistent
stays consistent (a rank whose state was being overwritten reports itself invalid until the transfer ends).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from swiftrun.errors import RecoveryError
from swiftrun.protocol.control import CommandKind, EventKind
from swiftrun.runtime.comm import collectives
from swiftrun.runtime.worker import faults
from swiftrun.runtime.core import undo
from swiftrun.runtime.state import verify
from swiftrun.runtime.state import tree as st
from swiftrun.runtime.dp.consensus import Plan, RankStatus, plan_recovery
from swiftrun.runtime.comm import ddp as ddp_tools
from swiftrun.runtime.comm.ddp import rebind
from swiftrun.runtime.comm.group import GroupManager
from swiftrun.runtime.dp.buffers import BroadcastBuffers
from swiftrun.runtime.pp.pipeline import Pipeline
from swiftrun.runtime.pp.handover import hand_over
from swiftrun.runtime.pp import parallel as pp_parallel
from swiftrun.runtime.pp.plan import PipePlan, plan_pipeline
from swiftrun.runtime.worker.process import ProcessRuntime, warn
from swiftrun.runtime.state.registry import Registry, RegistrationError
from swiftrun.runtime.core.txn import PreStepCopy, Transaction, rng_state, set_rng_state

log = logging.getLogger("swiftrun.runtime")

# gloo and NCCL errors a survivor sees when a peer dies or its group is aborted
_PEER_FAILURE_MARKERS = ("connection closed", "connection reset", "timed out", "broken pipe", "aborted",
                         "connection refused", "read error", "nccl", "gloo", "peer")


class Recovery:
    def __init__(self, rt: ProcessRuntime, model: Any, optimizers: list, schedulers: list, scaler: Any,
                 user_state: Any, pipeline: Any = None, checkpoint_every: int | None = None) -> None:
        self.rt = rt
        self.link = rt.link
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.mode = rt.wenv.recovery if rt.wenv.recovery in ("auto", "roll-forward", "undo") else "auto"
        self.reg = Registry.build(model, optimizers, schedulers, scaler, user_state)
        for note in self.reg.notes:
            log.info(note)
        for message in verify.registration_warnings(self.reg):
            warn(f"{message}: a recovery cannot restore its state exactly")
        # stages of a pipeline are not replicas: a stage one update ahead of the others must undo it, possibly
        # after its step completed (so the last step's records and gradients are kept, as in undo mode)
        self.pipeline: Pipeline | None = None
        if pipeline is not None:
            every = checkpoint_every or _env_int("SWIFTRUN_CKPT_EVERY", DEFAULT_CHECKPOINT_EVERY)
            self.pipeline = Pipeline(self, pipeline, every)
        # ... and where DDP broadcasts rank 0's buffers (BatchNorm statistics): rank 0 dying between its update and
        # the next forward's broadcast takes its buffers for the next step with it, and only undoing the completed
        # step (whose start buffers every survivor copied) stays exact (consensus.buffers_held). The cost: the
        # last step's gradients copied once per step.
        self.buffers = BroadcastBuffers(self)
        self.keep_last_update = self.mode == "undo" or self.pipeline is not None or bool(self.buffers.indices)
        # undo mode may undo a completed step, whose start is one snapshot older than the current step's
        self.txn = Transaction(self.reg, keep=2 if self.keep_last_update else 1)
        self._grad_copies = undo.GradCopies()  # where those copies go, kept from step to step
        init = rt.init_kwargs or {}
        backend = init.get("backend") or dist.get_backend()
        self.group = GroupManager(self.rank, self.world_size, backend, init.get("timeout"), init.get("device_id"))
        self.link.on_abort = self.group.abort
        # the generation this process was started in: 0 at first, later after restarts and recoveries
        self.generation = rt.wenv.generation
        self.joining = rt.wenv.joining
        self.valid = not self.joining
        self.completed = -1  # last step whose body finished on this rank
        self.partial = False  # the optimizer update of step completed+1 is applied, the body not finished
        self.in_step = False  # between begin_step and complete_step (the guarded body of a step)
        self.in_guard = False
        self.step = -1
        self.next_step = 0
        self.last_loss: float | None = None
        # set when a recovery interrupts an iteration: the rest of that iteration's collectives are skipped
        self.aborted_iteration = False
        self.released = False  # every rank finished training: the script's tail runs, no more recoveries
        self.tainted = False  # a collective wrote registered state during the current step
        self.verify_next = False  # verify the whole state when the next step begins (set by consensus)
        self.verify_every = _env_int("SWIFTRUN_VERIFY_EVERY", 0)
        # --transfer-chunk-mb; None: the transfer's default for the device (16 MiB on the CPU, 64 MiB on a GPU)
        self.chunk_bytes = (_env_int("SWIFTRUN_TRANSFER_CHUNK_MB", 0) << 20) or None
        self._stepped: dict[int, int] = {}  # registered optimizer index -> steps taken in this iteration
        self._unregistered: dict[int, str] = {}  # id -> name of optimizers that stepped without registration
        self._checked_first_step = False
        # step -> optimizer index -> what undoes that step: an inverse's record, or (--exact-undo) a copy
        self._records: dict[int, dict[int, undo.StepRecord | PreStepCopy]] = {}
        self.exact_undo = rt.wenv.exact_undo
        self._copies: dict[int, PreStepCopy] = {}  # optimizer index -> its pre-step copy (one slot, reused)
        # the gradient order of each DDP's first iterations, for a recovery before DDP reports its rebuilt buckets
        self._orders = [ddp_tools.ReadyOrder(d) if ddp_tools.rebuilds(d) else None for d in self.reg.ddps]
        # DDP index -> the step at whose start it is rebound again with its predicted layout (a static graph
        # recovered at point 0, see _transfer)
        self._rebind_at: dict[int, int] = {}
        self._install_hooks()
        collectives.install(self)

    # ------------------------------------------------------------------ start

    def start(self) -> int:
        """Join the job: a fresh rank builds the tracked group of generation 0; a replacement recovers."""
        if self.joining:
            return self.recover()
        self.link.send_event(EventKind.REGISTERED, gen=self.generation)
        self.link.wait_for(lambda: self.link.command(CommandKind.START) is not None or self._aborted())
        if not self._aborted():
            try:
                faults.fire("connect", 0)
                with collectives.internal():
                    self.group.build(self.generation, self._connect_timeout())
                if self.pipeline is not None:
                    self.pipeline.regroup()
                    with collectives.internal():
                        self.pipeline.validate()
                for ddp in self.reg.ddps:
                    rebind(ddp, None)
                return 0
            except Exception:  # noqa: BLE001 - a peer died while the first group was built
                if not self._wait_for_abort():
                    raise
        return self.recover()

    # ------------------------------------------------------------------ step bookkeeping

    def begin_step(self, step: int) -> bool:
        """Snapshot the step's start; False when the generation was aborted (recover first)."""
        if self._aborted():
            return False
        if self.verify_next or (self.verify_every and step > 0 and step % self.verify_every == 0):
            if not self._verify_between_steps(step):
                return False
        if self.pipeline is not None:
            if not self._pipeline_step_start(step):
                return False
        self.step = step
        self.in_step = True
        self.aborted_iteration = False
        self.tainted = False
        self._stepped.clear()
        self.link.step = step
        self.txn.begin(step)
        for index, at in list(self._rebind_at.items()):
            order = self._orders[index]
            if step >= at and order is not None and order.order is not None:
                # every rank recorded the same order in the step before (same graph): a local, identical rebind
                rebind(order.ddp, ddp_tools.predicted_layout(order.ddp, order.order))
                del self._rebind_at[index]
        for order in self._orders:
            if order is not None and order.active and ddp_tools.rebuilt_layout(order.ddp) is not None:
                order.close()  # DDP reports its own layout now (from its third forward on)
        return True

    def complete_step(self, step: int) -> None:
        if not self.in_step:
            return  # a second guard in the same iteration: the step was completed by the first
        self.in_step = False
        self.completed = step
        self.partial = False
        self.next_step = step + 1
        if not self._checked_first_step:
            self._checked_first_step = True
            self._check_first_step()
        if self._unregistered:
            names = ", ".join(sorted(set(self._unregistered.values())))
            self._unregistered.clear()
            self._warn_once(f"unregistered:{names}", (
                f"an optimizer not passed to swiftrun.Run stepped ({names}); its state does not travel to a "
                "replacement, so recovery would not be exact: pass it with swiftrun.Run(optimizer=[...])"))
        if not self.keep_last_update:
            # nobody will ever need to undo a completed step: roll-forward takes a completed rank's state
            self._records.clear()
        else:
            self._records = {k: v for k, v in self._records.items() if k >= step}

    def _check_first_step(self) -> None:
        """Layouts recovery cannot make exact are refused at the first step, not at the first failure."""
        if self.reg.optimizers and not self._stepped and not self._unregistered and not self._scaler_skipped():
            raise RegistrationError(
                "no registered optimizer stepped in the first iteration of run.steps(): one iteration must hold "
                "a whole optimizer step (accumulate gradients over micro-batches inside the guarded body), "
                "otherwise a recovery would silently drop the gradients accumulated so far")

    def _scaler_skipped(self) -> bool:
        """A GradScaler that found inf/NaN skips optimizer.step() and lowers its scale in update()."""
        scaler, snap = self.reg.scaler, self.txn.current
        if scaler is None or snap is None or not snap.scaler:
            return False
        before = snap.scaler.get("scale")
        return before is not None and float(scaler.get_scale()) < float(before)

    def caused_by_peer_failure(self, exc: BaseException) -> bool:
        """Whether an exception in a step comes from a peer's failure (recover) rather than from the script."""
        if self._aborted():
            return True
        if isinstance(exc, RecoveryError) and self.pipeline is not None and self.pipeline.replay is not None:
            # the replay cannot be completed exactly (a log is missing): a refusal, said by the launcher
            self.link.send_event(EventKind.UNRECOVERABLE, gen=self.generation, reason=str(exc))
            return self.link.wait_for(lambda: self._aborted(), timeout=self._recovery_timeout())
        if isinstance(exc, (faults.InjectedFault, KeyboardInterrupt, SystemExit, RegistrationError)):
            return False
        if any(isinstance(e, RuntimeError) and any(marker in str(e).lower() for marker in _PEER_FAILURE_MARKERS)
               for e in _chain(exc)):
            # the launcher learns of the death within milliseconds (or a heartbeat timeout for a hang)
            return self._wait_for_abort()
        return False

    def note_collective_on_state(self) -> None:
        """A collective the script issued inside the current step reads or writes registered state in place."""
        if self.in_step:
            self.tainted = True

    # ------------------------------------------------------------------ the procedure

    def recover_here(self) -> None:
        """A collective outside the guarded body failed because of a peer (or the generation was aborted):
        recover now; the rest of this iteration's collectives are skipped (the replacement does not run them)."""
        self.next_step = self.recover()
        self.aborted_iteration = True

    def recover(self) -> int:
        """Run the recovery for the newest aborted generation; returns the step to run next."""
        self._settle()
        self.aborted_iteration = True
        if self.pipeline is not None and self.pipeline.replay is not None:
            self.pipeline.replay = None  # a replay interrupted by a newer failure: this state is not valid yet
            self.pipeline.drop_parallel()
            self.valid = False
        while True:
            gen = self.link.generation
            started = time.monotonic()
            kind = EventKind.JOINING if self.joining else EventKind.ABORTED
            log.debug("generation %d: %s (valid=%s completed=%d partial=%s)", gen, kind.value, self.valid,
                      self.completed, self.partial)
            self.link.send_event(kind, gen=gen, valid=self.valid, completed=self.completed, partial=self.partial)
            got = self.link.wait_for(
                lambda: self._command_for(CommandKind.RECOVER, gen) or self.link.generation > gen,
                timeout=self._recovery_timeout(),
            )
            if self.link.generation > gen:
                continue
            if not got:
                raise RecoveryError(f"the launcher never asked generation {gen} to recover")
            try:
                with collectives.internal():
                    plan, phases = self._recover_generation(gen)
            except RecoveryError as exc:
                self.link.send_event(EventKind.UNRECOVERABLE, gen=gen, reason=str(exc))
                self.link.wait_for(lambda: self.link.generation > gen)  # the launcher restarts or stops the job
                continue
            except Exception:  # noqa: BLE001 - a collective of the recovery failed: a newer abort must follow
                if self._wait_for_abort(after=gen):
                    continue
                raise
            phases["total_local"] = time.monotonic() - started
            if self.pipeline is not None and self.pipeline.replay is not None:
                # this rank replays its stage alone first; it reports RECOVERED when the replay reaches the point
                self.pipeline.replay.update(gen=gen, phases=phases, plan=plan.as_dict())
                self.generation = gen
                self.joining = False
                return self.next_step
            log.debug("generation %d recovered: %s %s", gen, plan.as_dict(), phases)
            self.link.send_event(EventKind.RECOVERED, gen=gen, phases=phases, plan=plan.as_dict())
            self.link.wait_for(lambda: self._command_for(CommandKind.RESUME, gen) or self.link.generation > gen)
            if self.link.generation > gen:
                continue
            self.generation = gen
            self.joining = False
            return self.next_step

    def _settle(self) -> None:
        """The step in progress was interrupted: put back what it changed, or declare this rank's state invalid.

        A rank that applied its update (partial) keeps it: consensus decides between undoing it and taking a
        finished rank's state. A rank that did not has only the step's side effects to put back (buffers,
        hyperparameters, schedulers, scaler, user state), unless its parameters were written by something other
        than the optimizer (an in-place collective on the model, a manual edit): then no snapshot covers them."""
        if not self.in_step:
            return
        self.in_step = False
        if not self.valid:
            return
        if self.partial:
            return
        if self.tainted or self.txn.params_touched():
            log.debug("step %d wrote registered state outside the optimizer: this rank is not a valid source",
                      self.step)
            self.valid = False
            return
        snap = self.txn.snapshot(self.step)
        if snap is not None:
            self.txn.restore(snap)

    def _recover_generation(self, gen: int) -> tuple[Plan | PipePlan, dict[str, float]]:
        phases: dict[str, float] = {}
        t = time.monotonic()
        if self.pipeline is not None:  # its background exchange uses a group the rebuild destroys
            self.pipeline.stop_exchange(self._detect_timeout())
        self.group.build(gen, self._connect_timeout())
        faults.fire("recover", max(self.step, 0))
        phases["rebuild"] = time.monotonic() - t
        if self.pipeline is not None:
            self.pipeline.regroup()
            return self._recover_pipeline(phases), phases

        t = time.monotonic()
        plan = self._consensus()
        phases["consensus"] = time.monotonic() - t

        t = time.monotonic()
        if self.rank in plan.undo:
            self._undo_last_update()
        phases["undo"] = time.monotonic() - t

        t = time.monotonic()
        for note in plan.notes:
            if self.rank == plan.source:
                log.info("recovery plan: %s", note)
        canonical = self.buffers.gather(plan.point + 1, plan.source)
        self._transfer(plan)
        self.buffers.install(canonical)
        phases["transfer"] = time.monotonic() - t
        self.completed, self.partial, self.valid = plan.point, False, True
        self.next_step = plan.point + 1
        self._records.clear()
        self.reg.clear_grads()

        t = time.monotonic()
        mismatches = verify.compare(self.reg, self.buffers.per_rank)
        phases["verify"] = time.monotonic() - t
        if mismatches:
            raise RecoveryError("replicas differ after the recovery: " + verify.describe(mismatches))
        self.verify_next = plan.verify_next
        return plan, phases

    def _recover_pipeline(self, phases: dict[str, float]) -> PipePlan:
        """The pipeline's recovery: one point for every stage; a stage with a surviving replica copies it, a
        stage without one is replayed by its replacement (see runtime/pp/plan.py)."""
        pp = self.pipeline
        assert pp is not None
        t = time.monotonic()
        mine = pp.status(self.valid, self.position, not self.partial, self._undoable(),
                         not self.joining and not self.partial and self.step == self.completed)
        rows: list[Any] = [None] * self.world_size
        dist.all_gather_object(rows, (mine, pp.logging_plan()))
        # a replacement missed the logging plan chosen before it started: it takes the survivors'
        pp.adopt(next((p for s, p in rows if s.valid and p is not None), None))
        plan = plan_pipeline([s for s, _ in rows], pp.groups)
        phases["consensus"] = time.monotonic() - t

        t = time.monotonic()
        if self.rank in plan.undo:
            self._undo_last_update()
        phases["undo"] = time.monotonic() - t

        t = time.monotonic()
        device = self.group.device()
        own_rng = self.txn.rng_for(plan.point + 1)
        layouts = self.next_layouts(plan.point)
        for source, targets in plan.copies:  # every rank creates every group, in the same order
            members = sorted({source, *targets})
            group = self.group.new_group(members)
            if self.rank in members:
                st.transfer(self.reg, source, self.rank, group, device, self.chunk_bytes)
                shared = self._from_source(source, plan.point, group)
                if self.rank != source:
                    own_rng, layouts = shared["rng"], shared["layouts"]
        for ddp, layout in zip(self.reg.ddps, layouts):  # a stage's replicas reduce with the same buckets
            rebind(ddp, layout)
        replaying = hand_over(pp, plan)
        if replaying is not None and pp.replay is not None and pp.replay["layouts"] is not None:
            # every replica of this stage replays from the checkpoint's step (pp_plan.py): the reducers run the
            # layout of that step, as the failure-free run did, not the one of the step after the point
            for ddp, layout in zip(self.reg.ddps, pp.replay["layouts"]):
                rebind(ddp, layout)
        phases["transfer"] = time.monotonic() - t
        self._records.clear()
        self.reg.clear_grads()
        pp.drop_after(plan.point)
        pp.reset_schedule()
        pp.force_checkpoint = True  # the replacement lost what it held for its neighbours: exchange again
        if replaying is not None:
            self.completed, self.partial, self.valid = replaying.start - 1, False, False
            self.next_step = replaying.start
        else:
            self.completed, self.partial, self.valid = plan.point, False, True
            self.next_step = plan.point + 1
            if own_rng is not None:
                set_rng_state(own_rng)
        self.verify_next = False  # stages are not replicas: their states are not compared
        self._parallel_replay(plan, phases)
        return plan

    def _parallel_replay(self, plan: PipePlan, phases: dict[str, float]) -> None:
        """Idle survivors help the replaying ranks (runtime/pp/parallel.py), each set its own share of them: a
        replaying rank offers its column of helpers its stage; a helper that takes it computes its part of every
        replayed step before it reports RECOVERED."""
        pp = self.pipeline
        assert pp is not None
        assigned = pp_parallel.assign_helpers(plan, self.world_size)
        replay = plan.replay_of(self.rank)
        if self.rank in assigned:
            assert replay is not None
            pp.parallel = pp_parallel.offer(pp, assigned[self.rank], assigned, replay.ranks)
            return
        if replay is not None:
            if len(replay.ranks) > 1 and not replay.lockstep and pp_parallel.cap() != 0:
                log.info("rank %d replays with ranks %s without helpers: fewer idle ranks than the %d members a "
                         "chain needs", self.rank, [r for r in replay.ranks if r != self.rank], len(replay.ranks))
            return
        leader = next((lead for lead, helpers in assigned.items() if self.rank in helpers), None)
        if leader is None:
            return
        t = time.monotonic()
        setup = pp_parallel.receive_offer(leader, self.group.device())
        if setup is not None:
            steps = pp_parallel.help_replay(self.rank, setup, self.group.device())
            log.info("rank %d helped rank %d replay %d step(s)", self.rank, leader, steps)
        phases["help"] = time.monotonic() - t

    def _pipeline_step_start(self, step: int) -> bool:
        """A pipeline's step start: end a finished replay, then checkpoint when due. False: recover first."""
        pp = self.pipeline
        assert pp is not None
        if pp.replay is not None:
            if step > pp.replay["until"]:
                if not self._end_replay():
                    return False
            else:
                self.link.send_event(EventKind.REPLAYING, gen=self.generation, step=step,
                                     first=pp.replay["start"], last=pp.replay["until"], ranks=pp.replay["ranks"],
                                     helpers=pp.parallel.helpers if pp.parallel is not None else [])
        try:
            with collectives.internal():
                pp.begin_step(step)
        except Exception:  # noqa: BLE001 - a peer died during the checkpoint exchange: recover first
            if self._wait_for_abort():
                return False
            raise
        return True

    def _end_replay(self) -> bool:
        """The replay reached the recovery point: report RECOVERED and wait with everyone for RESUME."""
        pp = self.pipeline
        assert pp is not None and pp.replay is not None
        replay = pp.replay
        gen = replay["gen"]
        phases = dict(replay["phases"])
        phases["replay"] = pp.end_replay()
        phases["total_local"] = phases.get("total_local", 0.0) + phases["replay"]
        self.valid = True
        self.link.send_event(EventKind.RECOVERED, gen=gen, phases=phases, plan=replay["plan"])
        self.link.wait_for(lambda: self._command_for(CommandKind.RESUME, gen) or self.link.generation > gen)
        return self.link.generation == gen

    @property
    def position(self) -> int:
        """The last step whose optimizer update this rank's state holds (the step in progress if partial)."""
        return self.completed + (1 if self.partial else 0)

    def _status(self) -> RankStatus:
        held = self.buffers.indices and self.valid
        return RankStatus(self.rank, self.valid, self.position, not self.partial, self._undoable(),
                          outside_step=not self.joining and not self.partial and self.step == self.completed,
                          buffers_next=not held or self.buffers.offers(self.position + 1),
                          buffers_undo=not held or self.buffers.offers(self.position))

    def _consensus(self) -> Plan:
        device = self.group.device()
        mine = torch.tensor(self._status().pack(), dtype=torch.int64, device=device)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine)
        statuses = [RankStatus.unpack(row.tolist()) for row in rows]
        return plan_recovery(statuses, self.mode)

    def next_layouts(self, point: int) -> list:
        """The bucket layout each DDP wrapper must be rebound with to redo step ``point + 1`` (ddp.next_layout)."""
        return [ddp_tools.next_layout(d, o, point) for d, o in zip(self.reg.ddps, self._orders)]

    def _from_source(self, source: int, point: int, group: Any = None) -> dict:
        """What a recovery's receivers take from its source besides the bulk state, broadcast over ``group``
        (None: every rank): the DDP bucket layouts to rebind with and the RNG state of the step to redo (the
        source's snapshot of that step's start, else its current streams). Data parallelism sends it to every
        rank, a pipeline to the replicas of one stage."""
        device = self.group.device()
        box: list[Any] = [None]
        if self.rank == source:
            box[0] = {"layouts": self.next_layouts(point), "rng": self.txn.rng_for(point + 1) or rng_state()}
        dist.broadcast_object_list(box, src=source, group=group, device=device if device.type == "cuda" else None)
        return box[0]

    def _transfer(self, plan: Plan) -> None:
        device = self.group.device()
        # every rank needs the source's bucket layouts and the RNG of the step to redo; the bulk state only
        # goes to the targets
        own_rng = self.txn.rng_for(plan.point + 1)
        shared = self._from_source(plan.source, plan.point)
        if plan.targets:
            members = sorted({plan.source, *plan.targets})
            group = None if len(members) == self.world_size else self.group.new_group(members)
            if self.rank in members:
                if self.rank != plan.source:
                    self.valid = False  # until the whole state arrived
                st.transfer(self.reg, plan.source, self.rank, group, device, self.chunk_bytes,
                            on_chunk=self._transfer_fault if self.rank == plan.source else None)
        self._rebind_at.clear()
        for index, (ddp, layout) in enumerate(zip(self.reg.ddps, shared["layouts"])):
            rebind(ddp, layout)
            if layout is None and ddp.static_graph and 0 <= plan.point < ddp_tools.first_rebuilt_step(ddp) - 1:
                # a static graph redoing step 1 runs the initial layout, as failure-free, but the rebound reducer
                # counts step 1 as its first iteration and would rebuild one step late: rebind it at step 2 with
                # the layout DDP rebuilds then (its order is recorded during step 1 on every rank)
                self._rebind_at[index] = ddp_tools.first_rebuilt_step(ddp)
        unknown = [lay is None and ddp_tools.rebuilds(d) and index not in self._rebind_at
                   for index, (d, lay) in enumerate(zip(self.reg.ddps, shared["layouts"]))]
        if self.rank == plan.source and plan.point >= 0 and any(unknown):
            # DDP rebuilds its buckets from the gradient order of its first iterations; a reducer rebuilt by the
            # recovery has recorded nothing. The runtime hands on the layout it predicts from its own record of the
            # order (ddp.next_layout); without that record (not expected once a step completed) this run keeps
            # the initial buckets longer than a failure-free run would: sums round differently
            warn("the failure came before DDP rebuilt its gradient buckets and their layout is unknown: the "
                 "recovered run is not bitwise the failure-free one (about 1e-7 relative with 3 ranks or more), "
                 "replicas stay equal")
        set_rng_state(own_rng if (own_rng is not None and self.rank not in plan.targets) else shared["rng"])

    def _transfer_fault(self, chunk: int) -> None:
        if chunk == 0:
            faults.fire("transfer", max(self.step, 0))

    def _verify_between_steps(self, step: int) -> bool:
        """Compare every rank's whole state before ``step``; False if a peer failed meanwhile (recover first)."""
        self.verify_next = False
        if self.pipeline is not None:
            return True  # a pipeline's stages hold different states by design
        try:
            with collectives.internal():
                # between steps the buffers DDP broadcasts differ by design (each rank's own batch updated them)
                mismatches = verify.compare(self.reg, self.buffers.per_rank | set(self.buffers.indices))
        except Exception:  # noqa: BLE001 - a peer died during the comparison: recover, the recovery verifies
            if self._wait_for_abort():
                return False
            raise
        if mismatches:
            # a refusal, said by the launcher (restart from the script's checkpoint or a clean stop), not a
            # traceback from swiftrun's own code in the script
            reason = f"replicas differ before step {step}: " + verify.describe(mismatches)
            self.link.send_event(EventKind.UNRECOVERABLE, gen=self.generation, reason=reason)
            if self.link.wait_for(lambda: self._aborted(), timeout=self._recovery_timeout()):
                return False  # the launcher answered with a new generation (it stops or restarts the job)
            raise RecoveryError(reason)
        return True

    # ------------------------------------------------------------------ undo

    def _install_hooks(self) -> None:
        registered = {id(opt): index for index, opt in enumerate(self.reg.optimizers)}
        for index, opt in enumerate(self.reg.optimizers):
            opt.register_step_pre_hook(self._make_pre_hook(index))
            opt.register_step_post_hook(self._make_post_hook(index))

        def any_step(optimizer, args, kwargs):
            if id(optimizer) not in registered and self.in_step:
                self._unregistered[id(optimizer)] = type(optimizer).__name__

        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(any_step)
        if faults.planned("forward", "backward", "allreduce"):
            for module in self.reg.models:
                module.register_forward_pre_hook(lambda *_: faults.fire("forward", self.step))
                params = [p for p in module.parameters() if p.requires_grad]
                if params:
                    params[-1].register_hook(lambda g: (faults.fire("backward", self.step), g)[1])
                    params[0].register_hook(lambda g: (faults.fire("allreduce", self.step), g)[1])

    def _make_pre_hook(self, index: int):
        def pre_hook(optimizer, args, kwargs):
            stepped = self._stepped.get(index, 0)
            self._stepped[index] = stepped + 1
            if self.exact_undo:
                if not stepped:  # the copy before the first step of the iteration also undoes a second one
                    pre = self._copies.setdefault(index, PreStepCopy())
                    pre.take(optimizer, self.step)
                    self._records.setdefault(self.step, {})[index] = pre
            elif stepped:  # a second step of the same optimizer in one iteration: one record cannot undo both
                self._records.setdefault(self.step, {})[index] = undo.StepRecord(
                    id(optimizer), (), unavailable_reason="the optimizer stepped twice in one iteration")
            elif undo.invertible(optimizer)[0]:
                self._records.setdefault(self.step, {})[index] = undo.capture(
                    optimizer, copy_grads=self.keep_last_update, known_invertible=True, copies=self._grad_copies)
        return pre_hook

    def _make_post_hook(self, index: int):
        def post_hook(optimizer, args, kwargs):
            faults.fire("step", self.step)
            if self.in_step:
                self.partial = True
            faults.fire("after-step", self.step)
        return post_hook

    def _undoable(self) -> bool:
        step = self.position
        records = self._records.get(step)
        if not records or step < 0 or (self.partial and self.tainted):
            return False
        if self.txn.snapshot(step) is None:
            return False
        # every record must be undoable before any is undone: a refusal half-way would leave a mixed state
        return all(record.step == step if isinstance(record, PreStepCopy)
                   else undo.undoable(self.reg.optimizers[index], record)[0] for index, record in records.items())

    def _undo_last_update(self) -> None:
        step = self.position
        records = self._records.get(step, {})
        for index in sorted(records, reverse=True):
            record = records[index]
            if isinstance(record, PreStepCopy):
                record.restore(self.reg.optimizers[index])
            else:
                undo.undo_step(self.reg.optimizers[index], record)
        snap = self.txn.snapshot(step)
        assert snap is not None  # _undoable checked it
        self.txn.restore(snap)
        self.completed, self.partial = step - 1, False

    # ------------------------------------------------------------------ helpers

    def _aborted(self) -> bool:
        return self.link.generation > self.generation

    def _command_for(self, kind: CommandKind, gen: int) -> bool:
        cmd = self.link.command(kind)
        return cmd is not None and cmd.gen == gen

    def _wait_for_abort(self, after: int | None = None) -> bool:
        """A collective failed: wait (bounded) for the launcher to announce the generation that repairs it."""
        base = self.generation if after is None else after
        return self.link.wait_for(lambda: self.link.generation > base, timeout=self._detect_timeout())

    def _warn_once(self, key: str, message: str) -> None:
        if key in _warned:
            return
        _warned.add(key)
        warn(message)

    # the waits follow the launcher's flags (see runtime/worker/env.py); the launcher enforces the deadlines itself,
    # these only bound a rank whose launcher stopped answering
    def _detect_timeout(self) -> float:
        return self.rt.wenv.detect_wait

    def _recovery_timeout(self) -> float:
        return self.rt.wenv.recover_wait

    def _connect_timeout(self) -> float:
        return self.rt.wenv.connect_wait

    # ------------------------------------------------------------------ the end

    def finish(self, total: int) -> int | None:
        """Every rank waits here until all finished (so a late failure can still be repaired in place).

        Returns None when released, or the step to resume at after a recovery."""
        if self.pipeline is not None and self.pipeline.replay is not None and not self._end_replay():
            return self.recover()  # a failure during the replay of the last steps
        if self.pipeline is not None:
            # a checkpoint exchange still under way ends first (a peer's failure ends it too, and the wait for
            # RELEASE below turns that into a recovery): the groups must not go while it uses one
            self.pipeline.exchange.wait()
        gen = self.generation
        self.link.send_event(EventKind.FINISHING, gen=gen, completed=self.completed)
        self.link.wait_for(lambda: self._command_for(CommandKind.RELEASE, gen) or self._aborted())
        if not self._command_for(CommandKind.RELEASE, gen):  # a failure before every rank finished: repair it
            return self.recover()
        self.released = True
        self.step = total  # the script's tail: faults and messages name it as the step after the last one
        self.link.step = total
        return None


_warned: set[str] = set()
DEFAULT_CHECKPOINT_EVERY = 20  # steps between stage checkpoints of a pipeline (Run(checkpoint_every=...))


def _chain(exc: BaseException) -> list[BaseException]:
    """An exception and its causes: torch's pipelining re-raises a failed collective as a plain RuntimeError
    ("Failed to run stage backward") whose cause names the connection that broke."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen and len(seen) < 8:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, "") or default)
    except ValueError:
        return default
