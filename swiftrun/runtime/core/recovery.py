"""The worker's side of the recovery protocol (see docs/ARCHITECTURE.md, "The recovery sequence").

One :class:`Recovery` per process, created by ``swiftrun.Run`` with the :class:`~swiftrun.runtime.core.strategy.Strategy`
of the job's kind of parallelism. A training step is a transaction
(:mod:`~swiftrun.runtime.core.txn`): its start is snapshotted, the optimizer update inside it is tracked (and can be
undone), and when the launcher aborts a generation every rank first settles its own state (an interrupted step is
put back to its start; a rank whose state something untracked wrote says it is not valid), then runs:

    ABORTED/JOINING -> wait RECOVER(g) -> rebuild group g -> the strategy makes the ranks consistent
    -> RECOVERED(g) -> wait RESUME(g)

(data parallelism: consensus -> undo -> transfer -> rebind DDP -> verify, runtime/dp/recovery.py; a pipeline:
the same per stage, or a replay of a stage without a replica, runtime/pp/recovery.py).

A newer ABORT at any point restarts the procedure for the newer generation; what was already made consistent
stays consistent (a rank whose state was being overwritten reports itself invalid until the transfer ends).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

import torch.distributed as dist

from swiftrun.errors import RecoveryError
from swiftrun.protocol.control import CommandKind, EventKind
from swiftrun.runtime.comm import collectives, intercept
from swiftrun.runtime.comm import ddp as ddp_tools
from swiftrun.runtime.comm.ddp import rebind
from swiftrun.runtime.comm.group import GroupManager
from swiftrun.runtime.core import undo
from swiftrun.runtime.core.strategy import RecoveryPlan, Strategy, timed
from swiftrun.runtime.core import streams
from swiftrun.runtime.core.precopy import CopyPolicy, PreStepCopy, available_memory, estimate_nbytes
from swiftrun.runtime.core.txn import Transaction, rng_state, set_rng_state
from swiftrun.runtime.state import layout, verify
from swiftrun.runtime.state.registry import Registry, RegistrationError, reachable_objects
from swiftrun.runtime.worker import faults
from swiftrun.runtime.worker.env import settings
from swiftrun.runtime.worker.process import ProcessRuntime, notice, warn

log = logging.getLogger("swiftrun.runtime")


class Recovery:
    def __init__(self, rt: ProcessRuntime, model: Any, optimizers: list, schedulers: list, scaler: Any,
                 user_state: Any, strategy: Callable[[Recovery], Strategy]) -> None:
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
        tuning = settings()
        self.verify_every = tuning.verify_every
        # --transfer-chunk-mb; None: the transfer's default for the device (16 MiB on the CPU, 64 MiB on a GPU)
        self.chunk_bytes = (tuning.transfer_chunk_mb << 20) or None
        self._stepped: dict[int, int] = {}  # registered optimizer index -> steps taken in this iteration
        self._unregistered: dict[int, str] = {}  # id -> name of optimizers that stepped without registration
        self._checked_first_step = False
        # each rank's own RNG streams (runtime/core/streams.py): backups from the launcher, kept by a replacement
        self.stream_backups: dict[int, dict[str, Any]] = {}
        # this rank's own "update" backup (the next step's streams, taken before its update: runtime/core/streams.py)
        # with its encoding, and whether the script was seen to draw between an update and the next step
        self._update_streams: tuple[int, dict[str, Any], dict[str, Any]] | None = None
        self._draws_after_update = False
        self.per_rank_streams = False
        # step -> optimizer index -> what undoes that step: an inverse's record, or (exact undo) a copy
        self._records: dict[int, dict[int, undo.StepRecord | PreStepCopy]] = {}
        self._copies: dict[int, PreStepCopy] = {}  # optimizer index -> its pre-step copy (one slot, reused)
        # the gradient order of each DDP's first iterations, for a recovery before DDP reports its rebuilt buckets
        self._orders = [ddp_tools.ReadyOrder(d) if ddp_tools.rebuilds(d) else None for d in self.reg.ddps]
        # DDP index -> the step at whose start it is rebound again with its predicted layout (a static graph
        # recovered at point 0, see runtime/dp/recovery.py)
        self.rebind_at: dict[int, int] = {}
        # the part of a recovery that depends on the kind of parallelism (chosen by swiftrun.Run)
        self.strategy = strategy(self)
        # a completed step must stay undoable (its records and gradients kept) in undo mode and wherever the
        # strategy may undo one after its end
        self.keep_last_update = self.mode == "undo" or self.strategy.keeps_last_update
        # undo mode may undo a completed step, whose start is one snapshot older than the current step's
        self.txn = Transaction(self.reg, keep=2 if self.keep_last_update else 1)
        # when an update is copied before it runs, so that undoing it is bitwise (runtime/core/precopy.py)
        self.copies = CopyPolicy(rt.wenv.exact_undo, "--recovery undo" if self.mode == "undo"
                                 else self.strategy.undo_reason, _local_ranks())
        self.inexact_undo: str | None = None  # why this recovery's undo was not bitwise, for its report
        # a layout that keeps part of a rank's state on that rank alone (runtime/state/layout.py): said now, and
        # with REGISTERED, so that the launcher never tries an in-place recovery that cannot be exact
        self.unrecoverable = self._unrecoverable()
        if self.unrecoverable and self.rank == 0:  # the same for every rank: said once
            warn(self.unrecoverable)
        # a data source whose position cannot travel (an IterableDataset): said now or at the first step, and
        # again after each recovery, which cannot be exact for it
        self.data_warning = layout.unrestorable_data(reachable_objects())
        if self.data_warning:
            warn(self.data_warning)
        self._grad_copies = undo.GradCopies()  # where those copies go, kept from step to step
        self._install_hooks()
        collectives.install(self)

    # ------------------------------------------------------------------ start

    def start(self) -> int:
        """Join the job: a fresh rank builds the tracked group of generation 0; a replacement recovers."""
        if self.joining:
            return self.recover()
        self.link.send_event(EventKind.REGISTERED, gen=self.generation, unrecoverable=self.unrecoverable)
        self.link.wait_for(lambda: self.link.command(CommandKind.START) is not None or self.aborted())
        if not self.aborted():
            try:
                faults.fire("connect", 0)
                with intercept.internal():
                    self.group.build(self.generation, self._connect_timeout())
                self.strategy.on_start()
                for ddp in self.reg.ddps:
                    rebind(ddp, None)
                ddp_tools.rebind_optimizers(self.reg.optimizers)
                return 0
            except Exception:  # noqa: BLE001 - a peer died while the first group was built
                if not self.wait_for_abort():
                    raise
        return self.recover()

    # ------------------------------------------------------------------ step bookkeeping

    def begin_step(self, step: int) -> bool:
        """Snapshot the step's start; False when the generation was aborted (recover first)."""
        if self.aborted():
            return False
        if self.verify_next or (self.verify_every and step > 0 and step % self.verify_every == 0):
            if not self._verify_between_steps(step):
                return False
        if not self.strategy.on_step_start(step):
            return False
        self.step = step
        self.in_step = True
        self.aborted_iteration = False
        self.tainted = False
        self._stepped.clear()
        self.link.step = step
        snap = self.txn.begin(step)
        self._back_up_streams(step, snap.rng, "start")
        for index, at in list(self.rebind_at.items()):
            order = self._orders[index]
            if step >= at and order is not None and order.order is not None:
                # every rank recorded the same order in the step before (same graph): a local, identical rebind
                rebind(order.ddp, ddp_tools.predicted_layout(order.ddp, order.order))
                del self.rebind_at[index]
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
        if self._copies and self.rank == 0:
            said = self.copies.announcement(sum(c.nbytes() for c in self._copies.values()))
            if said:
                notice(said)
        if not self.keep_last_update:
            # nobody will ever need to undo a completed step: roll-forward takes a completed rank's state
            self._records.clear()
        else:
            self._records = {k: v for k, v in self._records.items() if k >= step}

    def _check_first_step(self) -> None:
        """Layouts recovery cannot make exact are refused at the first step, not at the first failure."""
        if self.data_warning is None:  # the loader's iterator is often made after Run(), in the loop
            self.data_warning = layout.unrestorable_data(reachable_objects())
            if self.data_warning:
                warn(self.data_warning)
        found = self._unrecoverable()  # a comm hook registered after Run() shows only now
        if found and found != self.unrecoverable:
            self.unrecoverable = found
            warn(found)
            self.link.send_event(EventKind.LAYOUT, gen=self.generation, unrecoverable=found)
        if self.reg.optimizers and not self._stepped and not self._unregistered and not self._scaler_skipped():
            raise RegistrationError(
                "no registered optimizer stepped in the first iteration of run.steps(): one iteration must hold "
                "a whole optimizer step (accumulate gradients over micro-batches inside the guarded body), "
                "otherwise a recovery would silently drop the gradients accumulated so far")

    def _unrecoverable(self) -> str | None:
        found = layout.unrecoverable(self.reg, sharding_recovered=self.strategy.recovers_shards)
        refusal = self.strategy.refusal
        if refusal:
            found = f"{refusal}; {found}" if found else f"{refusal}: {layout.WHAT_HAPPENS}"
        return found

    def _scaler_skipped(self) -> bool:
        """A GradScaler that found inf/NaN skips optimizer.step() and lowers its scale in update()."""
        scaler, snap = self.reg.scaler, self.txn.current
        if scaler is None or snap is None or not snap.scaler:
            return False
        before = snap.scaler.get("scale")
        return before is not None and float(scaler.get_scale()) < float(before)

    def caused_by_peer_failure(self, exc: BaseException) -> bool:
        """Whether an exception in a step comes from a peer's failure (recover) rather than from the script."""
        if self.aborted():
            return True
        if isinstance(exc, RecoveryError) and self.strategy.runs_alone:
            # what this rank recomputes alone cannot be completed exactly (a replay's log is missing): a refusal,
            # said by the launcher
            self.link.send_event(EventKind.UNRECOVERABLE, gen=self.generation, reason=str(exc))
            return self.link.wait_for(lambda: self.aborted(), timeout=self.recovery_timeout())
        if isinstance(exc, (faults.InjectedFault, KeyboardInterrupt, SystemExit, RegistrationError)):
            return False
        if intercept.is_peer_failure(exc):
            # the launcher learns of the death within milliseconds (or a heartbeat timeout for a hang)
            return self.wait_for_abort()
        return False

    @property
    def runs_alone(self) -> bool:
        """Whether this rank computes without its peers right now (see Strategy.runs_alone)."""
        return self.strategy.runs_alone

    def step_collective(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A collective the script issues inside a step, as the strategy runs it (a pipeline logs its result)."""
        if self.partial:  # after the update: a failure in it leaves every survivor to undo
            self.copies.saw_collective_after_update(name, self.step)
        return self.strategy.step_collective(name, fn, args, kwargs)

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
        # the strategy first (FSDP reshards: the parameters the step's snapshot describes are registered again)
        self.strategy.on_abort()
        self._settle()
        self.aborted_iteration = True
        while True:
            gen = self.link.generation
            started = time.monotonic()
            kind = EventKind.JOINING if self.joining else EventKind.ABORTED
            log.debug("generation %d: %s (valid=%s completed=%d partial=%s)", gen, kind.value, self.valid,
                      self.completed, self.partial)
            self.link.send_event(kind, gen=gen, valid=self.valid, completed=self.completed, partial=self.partial)
            got = self.link.wait_for(
                lambda: self._command_for(CommandKind.RECOVER, gen) or self.link.generation > gen,
                timeout=self.recovery_timeout(),
            )
            if self.link.generation > gen:
                continue
            if not got:
                raise RecoveryError(f"the launcher never asked generation {gen} to recover")
            try:
                with intercept.internal():
                    plan, phases = self._recover_generation(gen)
            except RecoveryError as exc:
                self.link.send_event(EventKind.UNRECOVERABLE, gen=gen, reason=str(exc))
                self.link.wait_for(lambda: self.link.generation > gen)  # the launcher restarts or stops the job
                continue
            except Exception:  # noqa: BLE001 - a collective of the recovery failed: a newer abort must follow
                if self.wait_for_abort(after=gen):
                    continue
                raise
            phases["total_local"] = time.monotonic() - started
            if self.strategy.reports_later(gen, phases, plan):
                # this rank is not consistent yet (it replays its stage alone first): it reports RECOVERED itself
                self.generation = gen
                self.joining = False
                return self.next_step
            log.debug("generation %d recovered: %s %s", gen, plan.as_dict(), phases)
            if self.data_warning and self.rank == min(getattr(plan, "source", 0) or 0, self.world_size - 1):
                warn(f"recovery {gen} is not exact: {self.data_warning}")
            self.link.send_event(EventKind.RECOVERED, gen=gen, phases=phases, plan=self.plan_report(plan.as_dict()))
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

    def _recover_generation(self, gen: int) -> tuple[RecoveryPlan, dict[str, float]]:
        phases: dict[str, float] = {}
        self._take_recover_args()
        with timed(phases, "rebuild"):
            self.strategy.before_rebuild()
            self.group.build(gen, self._connect_timeout())
            faults.fire("recover", max(self.step, 0))
        self.strategy.after_rebuild()
        return self.strategy.recover(phases), phases

    def report_recovered(self, gen: int, phases: dict[str, float], plan: dict[str, Any]) -> bool:
        """For a strategy that reports later (Strategy.reports_later): this rank is consistent now; report
        RECOVERED and wait with everyone for RESUME. False: a newer failure came first (recover again)."""
        self.valid = True
        self.link.send_event(EventKind.RECOVERED, gen=gen, phases=phases, plan=self.plan_report(plan))
        self.link.wait_for(lambda: self._command_for(CommandKind.RESUME, gen) or self.link.generation > gen)
        return self.link.generation == gen

    @property
    def position(self) -> int:
        """The last step whose optimizer update this rank's state holds (the step in progress if partial)."""
        return self.completed + (1 if self.partial else 0)

    @property
    def between_steps(self) -> bool:
        """The failure reached this rank outside a step's body (evaluation, a checkpoint barrier after the
        guard): what that code does next may depend on a skipped collective, so a recovery asks for the states to
        be compared at the next step."""
        return not self.joining and not self.partial and self.step == self.completed

    def resume_after(self, point: int, valid: bool = True) -> None:
        """A strategy's recovery put this rank's state at the end of step ``point``: training goes on with the
        step after it (``valid`` False: the state is not one to copy from yet, a stage still replaying)."""
        self.completed, self.partial, self.valid = point, False, valid
        self.next_step = point + 1

    def next_layouts(self, point: int) -> list:
        """The bucket layout each DDP wrapper must be rebound with to redo step ``point + 1`` (ddp.next_layout)."""
        return [ddp_tools.next_layout(d, o, point) for d, o in zip(self.reg.ddps, self._orders)]

    # ------------------------------------------------------------------ each rank's own RNG streams

    def _back_up_streams(self, step: int, state: dict[str, Any], at: str) -> None:
        """Send this rank's streams of ``step``'s start to the launcher (runtime/core/streams.py); ``at``: taken
        when that step began ("start"), or after the previous step's update ("update", provisional)."""
        encoded = streams.encode(state)
        if at == "update":
            self._update_streams = (step, state, encoded)
        elif self._update_streams is not None and self._update_streams[0] == step \
                and self._update_streams[2] != encoded:
            self._draws_after_update = True  # as the launcher concludes (launcher/streams.py)
        self.link.send_event(EventKind.RNG_BACKUP, step=step, at=at, state=encoded)

    def _take_recover_args(self) -> None:
        """What the RECOVER command carries for this rank: its own streams' backups, whether streams are per rank."""
        cmd = self.link.command(CommandKind.RECOVER)
        args = cmd.args if cmd is not None else {}
        self.per_rank_streams = bool(args.get("per_rank_rng"))
        own = args.get("own_rng") or {}
        if own:
            self.stream_backups = {int(step): streams.decode(state) for step, state in own.items()}

    def streams_held(self, most: int) -> list[int]:
        """The newest ``most`` steps as of whose start this rank holds its own streams: those near its position
        (snapshots, its update's backup, its live streams) and a replacement's backups from the launcher, which
        lie wherever its predecessor was, far from the fresh process's own position."""
        near = range(self.position - 1, self.position + 3)
        return sorted(s for s in {*near, *self.stream_backups} if self.own_streams_for(s) is not None)[-most:]

    def own_streams_for(self, step: int) -> dict[str, Any] | None:
        """This rank's own streams as of ``step``'s start, if it has them: its snapshot of that step, its backup
        (a replacement), or its live streams when it stands right before that step."""
        # Streams are not state a replica hands over: whether this rank's state is valid (it is not while it
        # receives its replica's, which is when a recovery asks for its streams) says nothing about them. Each
        # source below holds this process's own streams: a snapshot exists only for a step it began, an update
        # backup only for an update it ran, and its live streams are asked for only between steps. Validity was
        # asked here once, and a survivor receiving its replica's state (after its update, or between steps) had
        # its streams "backed up nowhere": a warning, and the rest of the run not the failure-free one (CI saw it
        # in test_hsdp's random-moment test)
        snap = self.txn.rng_for(step)
        if snap is not None:
            return snap
        if step in self.stream_backups:
            return self.stream_backups[step]
        update = self._update_streams
        if update is not None and update[0] == step and not self._draws_after_update:
            # a survivor stopped after its update, before the step's end (a partial rank that receives its
            # replica's state): its streams as of the next step are the ones it backed up before the update
            return update[1]
        if not self.partial and self.completed == step - 1 and not self.in_step:
            # between steps the live streams are the next step's; a fresh replacement's before step 0 are too
            # (it ran the script from the top as the first process of its rank did)
            return rng_state()
        return None

    def restore_streams(self, point: int, shared: dict[str, Any] | None, source: int | None,
                        receives: bool) -> None:
        """Set the streams the recovery's next step (``point + 1``) is redone with (see runtime/core/streams.py)."""
        own = self.own_streams_for(point + 1)
        if shared is None:
            if own is not None:
                set_rng_state(own)
            return
        state, exact = streams.choose(own, shared, per_rank=self.per_rank_streams, receives=receives)
        if not exact:
            warn(f"the ranks draw from random streams of their own (seeded per rank), and rank {self.rank}'s "
                 f"streams as of step {point + 1} were backed up nowhere (it failed before that step's backup "
                 f"reached the launcher, or was behind the recovery point; {self._where()}): it continues with "
                 f"rank {source}'s "
                 "streams, so its dropout and other random draws repeat that rank's and the recovered run is "
                 "not the failure-free one")
        set_rng_state(state)

    def _where(self) -> str:
        """Where this rank stood when the recovery began, in words (for a warning that must be diagnosable)."""
        if self.joining:
            return f"it replaces a lost process, whose backups reached step(s) {sorted(self.stream_backups)}"
        inside = f", inside step {self.step}" if self.in_step else ""
        partial = ", part-way through its update" if self.partial else ""
        return f"it had completed step {self.completed}{inside}{partial}"

    def from_source(self, source: int, point: int, group: Any = None) -> dict:
        """What a recovery's receivers take from its source besides the bulk state, broadcast over ``group``
        (None: every rank): the DDP bucket layouts to rebind with and the RNG state of the step to redo (the
        source's snapshot of that step's start, else its current streams). Data parallelism sends it to every
        rank, a pipeline to the replicas of one stage."""
        device = self.group.device()
        box: list[Any] = [None]
        if self.rank == source:
            box[0] = {"layouts": self.next_layouts(point), "rng": self.own_streams_for(point + 1) or rng_state()}
        dist.broadcast_object_list(box, src=source, group=group, device=device if device.type == "cuda" else None)
        return box[0]

    def _verify_between_steps(self, step: int) -> bool:
        """Compare every rank's whole state before ``step``; False if a peer failed meanwhile (recover first)."""
        self.verify_next = False
        uncompared = self.strategy.uncompared_buffers()
        if uncompared is None:
            return True  # the ranks hold different states by design (a pipeline's stages)
        try:
            with intercept.internal():
                mismatches = verify.compare(self.reg, uncompared, group=self.strategy.compare_group)
        except Exception:  # noqa: BLE001 - a peer died during the comparison: recover, the recovery verifies
            if self.wait_for_abort():
                return False
            raise
        if mismatches:
            # a refusal, said by the launcher (restart from the script's checkpoint or a clean stop), not a
            # traceback from swiftrun's own code in the script
            reason = f"replicas differ before step {step}: " + verify.describe(mismatches)
            self.link.send_event(EventKind.UNRECOVERABLE, gen=self.generation, reason=reason)
            if self.link.wait_for(lambda: self.aborted(), timeout=self.recovery_timeout()):
                return False  # the launcher answered with a new generation (it stops or restarts the job)
            raise RecoveryError(reason)
        return True

    # ------------------------------------------------------------------ undo

    def _install_hooks(self) -> None:
        registered = {id(opt): index for index, opt in enumerate(self.reg.optimizers)}
        # the optimizer a ZeroRedundancyOptimizer wraps steps inside it: registered with it, not on its own
        inner = {id(opt.optim) for opt in self.reg.optimizers
                 if type(opt).__name__ == "ZeroRedundancyOptimizer" and hasattr(opt, "optim")}
        for index, opt in enumerate(self.reg.optimizers):
            opt.register_step_pre_hook(self._make_pre_hook(index))
            opt.register_step_post_hook(self._make_post_hook(index))

        def any_step(optimizer, args, kwargs):
            if id(optimizer) not in registered and id(optimizer) not in inner and self.in_step:
                self._unregistered[id(optimizer)] = type(optimizer).__name__

        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(any_step)
        sharded = layout.sharded_models(self.reg)
        if sharded and faults.planned("backward", "allreduce"):
            raise RegistrationError(
                f"--fault ...:backward/allreduce cannot fire for a sharded model ({', '.join(sharded)}): its "
                "parameters' gradient hooks never run; use the forward, update, step or after-step phases")
        if faults.planned("forward", "backward", "allreduce"):
            for module in self.reg.models:
                module.register_forward_pre_hook(lambda *_: faults.fire("forward", self.step))
                params = [p for p in module.parameters() if p.requires_grad]
                if params:
                    params[-1].register_hook(lambda g: (faults.fire("backward", self.step), g)[1])
                    params[0].register_hook(lambda g: (faults.fire("allreduce", self.step), g)[1])

    def _make_pre_hook(self, index: int):
        def pre_hook(optimizer, args, kwargs):
            faults.fire("update", self.step)
            if self.in_step and not self._stepped:
                # the streams the next step starts with, unless the script draws after its update (optimizers
                # draw none): a failure from here on may be rolled forward past this step. Sent before the
                # update, so it is on its way while the update runs (runtime/core/streams.py)
                self._back_up_streams(self.step + 1, rng_state(), "update")
            stepped = self._stepped.get(index, 0)
            self._stepped[index] = stepped + 1
            if self.copies.wanted() and not stepped and index not in self._copies:
                declined = self.copies.afford(estimate_nbytes(optimizer), available_memory())
                if declined and self.rank == 0:
                    warn(declined)
            if self.copies.wanted():
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

    def undoable(self) -> bool:
        """Whether this rank can undo the update its state holds last (reported to the consensus)."""
        return self._undoable()

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

    def undo_last_update(self) -> None:
        """Put this rank back to the start of the step whose update its state holds last (checked undoable)."""
        step = self.position
        records = self._records.get(step, {})
        for index in sorted(records, reverse=True):
            record = records[index]
            optimizer = self.reg.optimizers[index]
            if isinstance(record, PreStepCopy):
                record.restore(optimizer)
            else:
                undo.undo_step(optimizer, record)
                self.inexact_undo = self.copies.why_inexact(step, type(optimizer).__name__)
        if self.inexact_undo:
            warn(f"rank {self.rank}: {self.inexact_undo}")
        snap = self.txn.snapshot(step)
        assert snap is not None  # _undoable checked it
        self.txn.restore(snap)
        self.completed, self.partial = step - 1, False

    # ------------------------------------------------------------------ helpers

    def aborted(self) -> bool:
        """Whether the launcher aborted this rank's generation (a recovery is due)."""
        return self.link.generation > self.generation

    def plan_report(self, plan: dict[str, Any]) -> dict[str, Any]:
        """The plan as RECOVERED reports it: with why this rank's undo was not bitwise, where it was not."""
        if self.inexact_undo is None:
            return plan
        report, self.inexact_undo = dict(plan, inexact=self.inexact_undo), None
        return report

    def forget_undo_records(self) -> None:
        """A recovery made this rank consistent: nothing before it can be undone any more."""
        self._records.clear()

    def _command_for(self, kind: CommandKind, gen: int) -> bool:
        cmd = self.link.command(kind)
        return cmd is not None and cmd.gen == gen

    def wait_for_abort(self, after: int | None = None) -> bool:
        """A collective failed: wait (bounded) for the launcher to announce the generation that repairs it."""
        base = self.generation if after is None else after
        return self.link.wait_for(lambda: self.link.generation > base, timeout=self.detect_timeout())

    def _warn_once(self, key: str, message: str) -> None:
        if key in _warned:
            return
        _warned.add(key)
        warn(message)

    # the waits follow the launcher's flags (see runtime/worker/env.py); the launcher enforces the deadlines itself,
    # these only bound a rank whose launcher stopped answering
    def detect_timeout(self) -> float:
        return self.rt.wenv.detect_wait

    def recovery_timeout(self) -> float:
        return self.rt.wenv.recover_wait

    def _connect_timeout(self) -> float:
        return self.rt.wenv.connect_wait

    # ------------------------------------------------------------------ the end

    def finish(self, total: int) -> int | None:
        """Every rank waits here until all finished (so a late failure can still be repaired in place).

        Returns None when released, or the step to resume at after a recovery."""
        if not self.strategy.on_finish():
            return self.recover()  # a failure while this rank was still becoming consistent
        gen = self.generation
        self.link.send_event(EventKind.FINISHING, gen=gen, completed=self.completed)
        self.link.wait_for(lambda: self._command_for(CommandKind.RELEASE, gen) or self.aborted())
        if not self._command_for(CommandKind.RELEASE, gen):  # a failure before every rank finished: repair it
            return self.recover()
        self.released = True
        self.step = total  # the script's tail: faults and messages name it as the step after the last one
        self.link.step = total
        return None


_warned: set[str] = set()


def _local_ranks() -> int:
    """The ranks on this machine (each keeps its own pre-step copy in its host memory)."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return 1
