"""The worker's side of the recovery protocol (see docs/ARCHITECTURE.md, "The recovery sequence").

One :class:`Recovery` per process, created by ``swiftrun.Run``. It tracks where this rank's state stands
(last completed step, whether the update of the step in progress was applied), keeps what an undo would need
only as long as it can be needed, and runs the recovery procedure when the launcher aborts a generation:

    ABORTED/JOINING -> wait RECOVER(g) -> rebuild group g -> consensus -> undo -> transfer -> rebind DDP
    -> RECOVERED(g) -> wait RESUME(g)

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
from swiftrun.protocol import CommandKind, EventKind
from swiftrun.runtime import faults, undo
from swiftrun.runtime import state as st
from swiftrun.runtime.consensus import Plan, RankStatus, plan_recovery
from swiftrun.runtime.ddp import rebind
from swiftrun.runtime.group import GroupManager
from swiftrun.runtime.process import ProcessRuntime

log = logging.getLogger("swiftrun.runtime")

# gloo and NCCL errors a survivor sees when a peer dies or its group is aborted
_PEER_FAILURE_MARKERS = ("connection closed", "connection reset", "timed out", "broken pipe", "aborted",
                         "connection refused", "read error", "nccl", "gloo", "peer")


class Recovery:
    def __init__(self, rt: ProcessRuntime, model: Any, optimizers: list, schedulers: list, scaler: Any,
                 user_state: Any) -> None:
        self.rt = rt
        self.link = rt.link
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.mode = rt.wenv.recovery if rt.wenv.recovery in ("auto", "roll-forward", "undo") else "auto"
        self.reg = st.Registry(model, optimizers, schedulers, scaler, user_state)
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
        self.in_step = False
        self.step = -1
        self.next_step = 0
        self.last_loss: float | None = None
        self._records: dict[int, dict[int, undo.StepRecord]] = {}  # step -> optimizer index -> record
        self._small: dict[int, dict[str, Any]] = {}  # step -> schedulers/scaler at the step's start
        self._rng: dict[int, dict[str, Any]] = {}  # step -> RNG state at the step's start
        self._install_hooks()

    # ------------------------------------------------------------------ start

    def start(self) -> int:
        """Join the job: a fresh rank builds the tracked group of generation 0; a replacement recovers."""
        if self.joining:
            return self.recover()
        self.link.send_event(EventKind.REGISTERED, gen=self.generation)
        self.link.wait_for(lambda: self.link.command(CommandKind.START) is not None or self._aborted())
        if not self._aborted():
            try:
                self.group.build(self.generation, self._connect_timeout())
                if self.reg.ddp is not None:
                    rebind(self.reg.ddp, None)
                return 0
            except Exception:  # noqa: BLE001 - a peer died while the first group was built
                if not self._wait_for_abort():
                    raise
        return self.recover()

    # ------------------------------------------------------------------ step bookkeeping

    def begin_step(self, step: int) -> bool:
        """Snapshot what a redo of ``step`` needs; False when the generation was aborted (recover first)."""
        if self._aborted():
            return False
        self.step = step
        self.in_step = True
        self.link.step = step
        self._rng = {k: v for k, v in self._rng.items() if k >= step - 1}
        self._small = {k: v for k, v in self._small.items() if k >= step - 1}
        self._rng[step] = st.rng_state()
        self._small[step] = self.reg.small_state()
        return True

    def complete_step(self, step: int) -> None:
        self.in_step = False
        self.completed = step
        self.partial = False
        self.next_step = step + 1
        if self.mode != "undo":
            # nobody will ever need to undo a completed step: roll-forward takes a completed rank's state
            self._records.clear()
        else:
            self._records = {k: v for k, v in self._records.items() if k >= step}

    def caused_by_peer_failure(self, exc: BaseException) -> bool:
        """Whether an exception in a step comes from a peer's failure (recover) rather than from the script."""
        if self._aborted():
            return True
        if isinstance(exc, (faults.InjectedFault, KeyboardInterrupt, SystemExit)):
            return False
        text = str(exc).lower()
        if isinstance(exc, RuntimeError) and any(marker in text for marker in _PEER_FAILURE_MARKERS):
            # the launcher learns of the death within milliseconds (or a heartbeat timeout for a hang)
            return self._wait_for_abort()
        return False

    # ------------------------------------------------------------------ the procedure

    def recover(self) -> int:
        """Run the recovery for the newest aborted generation; returns the step to run next."""
        while True:
            gen = self.link.generation
            started = time.monotonic()
            if self.valid:
                self.reg.clear_grads()
            self.in_step = False
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
            log.debug("generation %d recovered: %s %s", gen, plan.as_dict(), phases)
            self.link.send_event(EventKind.RECOVERED, gen=gen, phases=phases, plan=plan.as_dict())
            self.link.wait_for(lambda: self._command_for(CommandKind.RESUME, gen) or self.link.generation > gen)
            if self.link.generation > gen:
                continue
            self.generation = gen
            self.joining = False
            return self.next_step

    def _recover_generation(self, gen: int) -> tuple[Plan, dict[str, float]]:
        phases: dict[str, float] = {}
        t = time.monotonic()
        self.group.build(gen, self._connect_timeout())
        faults.fire("recover", max(self.step, 0))
        phases["rebuild"] = time.monotonic() - t

        t = time.monotonic()
        plan = self._consensus()
        phases["consensus"] = time.monotonic() - t

        t = time.monotonic()
        if self.rank in plan.undo:
            self._undo_last_update()
        phases["undo"] = time.monotonic() - t

        t = time.monotonic()
        self._transfer(plan)
        phases["transfer"] = time.monotonic() - t
        self.completed, self.partial, self.valid = plan.point, False, True
        self.next_step = plan.point + 1
        self._records.clear()
        return plan, phases

    @property
    def position(self) -> int:
        """The last step whose optimizer update this rank's state holds (the step in progress if partial)."""
        return self.completed + (1 if self.partial else 0)

    def _status(self) -> RankStatus:
        return RankStatus(self.rank, self.valid, self.position, not self.partial, self._undoable())

    def _consensus(self) -> Plan:
        device = self.group.device()
        mine = torch.tensor(self._status().pack(), dtype=torch.int64, device=device)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine)
        statuses = [RankStatus.unpack(row.tolist()) for row in rows]
        return plan_recovery(statuses, self.mode)

    def _transfer(self, plan: Plan) -> None:
        device = self.group.device()
        # every rank needs the source's bucket layout and the RNG of the step to redo; the bulk state only
        # goes to the targets
        box: list[Any] = [None]
        if self.rank == plan.source:
            box[0] = {"layout": st.layout_of(self.reg), "rng": self._rng.get(plan.point + 1) or st.rng_state()}
        dist.broadcast_object_list(box, src=plan.source, device=device if device.type == "cuda" else None)
        shared = box[0]
        if plan.targets:
            members = sorted({plan.source, *plan.targets})
            group = None if len(members) == self.world_size else dist.new_group(members)
            if self.rank in members:
                if self.rank != plan.source:
                    self.valid = False  # until the whole state arrived
                st.transfer(self.reg, plan.source, self.rank, group, device, extra={})
        if self.reg.ddp is not None:
            rebind(self.reg.ddp, shared["layout"])
        own_rng = self._rng.get(plan.point + 1)
        st.set_rng_state(own_rng if (own_rng is not None and self.rank not in plan.targets) else shared["rng"])

    # ------------------------------------------------------------------ undo

    def _install_hooks(self) -> None:
        for index, opt in enumerate(self.reg.optimizers):
            opt.register_step_pre_hook(self._make_pre_hook(index))
            opt.register_step_post_hook(self._make_post_hook(index))
        module = self.reg.module
        if module is not None and faults._plan:
            module.register_forward_pre_hook(lambda *_: faults.fire("forward", self.step))
            params = [p for p in module.parameters() if p.requires_grad]
            if params:
                params[-1].register_hook(lambda g: (faults.fire("backward", self.step), g)[1])
                params[0].register_hook(lambda g: (faults.fire("allreduce", self.step), g)[1])

    def _make_pre_hook(self, index: int):
        def pre_hook(optimizer, args, kwargs):
            ok, _ = undo.invertible(optimizer)
            if ok:
                self._records.setdefault(self.step, {})[index] = undo.capture(optimizer, copy_grads=self.mode == "undo")
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
        if not records or step < 0:
            return False
        # every record must be undoable before any is undone: a refusal half-way would leave a mixed state
        return all(undo.undoable(self.reg.optimizers[i], record)[0] for i, record in records.items())

    def _undo_last_update(self) -> None:
        step = self.position
        records = self._records.get(step, {})
        for index in sorted(records, reverse=True):
            undo.undo_step(self.reg.optimizers[index], records[index])
        if step in self._small:
            self.reg.restore_small_state(self._small[step])
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

    def _detect_timeout(self) -> float:
        return float(os.environ.get("SWIFTRUN_DETECT_TIMEOUT", "60"))

    def _recovery_timeout(self) -> float:
        return float(os.environ.get("SWIFTRUN_RECOVERY_TIMEOUT", "300"))

    def _connect_timeout(self) -> float:
        return float(os.environ.get("SWIFTRUN_CONNECT_TIMEOUT", "30"))

    # ------------------------------------------------------------------ the end

    def finish(self, total: int) -> int | None:
        """Every rank waits here until all finished (so a late failure can still be repaired in place).

        Returns None when released, or the step to resume at after a recovery."""
        gen = self.generation
        self.link.send_event(EventKind.FINISHING, gen=gen, completed=self.completed)
        self.link.wait_for(lambda: self._command_for(CommandKind.RELEASE, gen) or self._aborted())
        if self._aborted():
            return self.recover()
        return None
