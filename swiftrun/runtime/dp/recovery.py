"""Data parallelism's recovery: every rank is a replica, so the ranks agree on one point and copy a replica.

Over the new generation's group: every rank reports its status (valid, the last update its state holds,
whether it can undo it), the consensus (runtime/dp/consensus.py) picks the point every rank can reach and the
source to copy, ranks ahead of the point undo their update, the source's state goes to the ranks that need it
(runtime/state/transfer.py) together with the DDP bucket layouts and the RNG of the step to redo, rank 0's
broadcast buffers go to everyone (runtime/dp/buffers.py), and the digests of the whole state must agree on every
rank before RECOVERED is reported.
"""

from __future__ import annotations

import logging
import torch
import torch.distributed as dist

from swiftrun.errors import RecoveryError
from swiftrun.runtime.comm import ddp as ddp_tools
from swiftrun.runtime.comm.ddp import rebind
from swiftrun.runtime.core.recovery import Recovery
from swiftrun.runtime.core.strategy import Strategy, timed
from swiftrun.runtime.dp.buffers import BroadcastBuffers
from swiftrun.runtime.dp.consensus import Plan, RankStatus, plan_recovery
from swiftrun.runtime.state import tree as st
from swiftrun.runtime.state import verify
from swiftrun.runtime.worker import faults
from swiftrun.runtime.worker.process import warn

log = logging.getLogger("swiftrun.runtime")


class DataParallel(Strategy):
    """Replicas: agree on a point, undo where needed, copy the source's state to the ranks that lack it."""

    def __init__(self, rec: Recovery) -> None:
        self.rec = rec
        self.buffers = BroadcastBuffers(rec, rec.reg, rec.group, lambda step: rec.txn.snapshot(step))
        # where DDP broadcasts rank 0's buffers (BatchNorm statistics): rank 0 dying between its update and the
        # next forward's broadcast takes its buffers for the next step with it, and only undoing the completed
        # step (whose start buffers every survivor copied) stays exact (consensus.buffers_held). The cost: the
        # last step's gradients copied once per step.
        self.keeps_last_update = bool(self.buffers.indices)
        if self.keeps_last_update:
            self.undo_reason = "DDP broadcasts rank 0's buffers (BatchNorm statistics, counters), which its failure can lose"

    def uncompared_buffers(self) -> set[int]:
        # between steps the buffers DDP broadcasts differ by design (each rank's own batch updated them)
        return self.buffers.per_rank | set(self.buffers.indices)

    def recover(self, phases: dict[str, float]) -> Plan:
        rec = self.rec
        with timed(phases, "consensus"):
            plan = self._consensus()

        with timed(phases, "undo"):
            if rec.rank in plan.undo:
                rec.undo_last_update()

        with timed(phases, "transfer"):
            for note in plan.notes:
                if rec.rank == plan.source:
                    log.info("recovery plan: %s", note)
            canonical = self.buffers.gather(plan.point + 1, plan.source)
            self._transfer(plan)
            self.buffers.install(canonical)
        rec.resume_after(plan.point)
        rec.forget_undo_records()
        rec.reg.clear_grads()

        with timed(phases, "verify"):
            mismatches = verify.compare(rec.reg, self.buffers.per_rank)
        if mismatches:
            raise RecoveryError("replicas differ after the recovery: " + verify.describe(mismatches))
        rec.verify_next = plan.verify_next
        return plan

    def _status(self) -> RankStatus:
        rec = self.rec
        held = self.buffers.indices and rec.valid
        return RankStatus(rec.rank, rec.valid, rec.position, not rec.partial, rec.undoable(),
                          outside_step=rec.between_steps,
                          buffers_next=not held or self.buffers.offers(rec.position + 1),
                          buffers_undo=not held or self.buffers.offers(rec.position))

    def _consensus(self) -> Plan:
        rec = self.rec
        device = rec.group.device()
        mine = torch.tensor(self._status().pack(), dtype=torch.int64, device=device)
        rows = [torch.empty_like(mine) for _ in range(rec.world_size)]
        dist.all_gather(rows, mine)
        statuses = [RankStatus.unpack(row.tolist()) for row in rows]
        return plan_recovery(statuses, rec.mode)

    def _transfer(self, plan: Plan) -> None:
        rec = self.rec
        device = rec.group.device()
        # every rank needs the source's bucket layouts and the RNG of the step to redo; the bulk state only
        # goes to the targets
        shared = rec.from_source(plan.source, plan.point)
        if plan.targets:
            members = sorted({plan.source, *plan.targets})
            group = None if len(members) == rec.world_size else rec.group.new_group(members)
            if rec.rank in members:
                if rec.rank != plan.source:
                    rec.valid = False  # until the whole state arrived
                st.transfer(rec.reg, plan.source, rec.rank, group, device, rec.chunk_bytes,
                            on_chunk=self._transfer_fault if rec.rank == plan.source else None)
        rec.rebind_at.clear()
        for index, (ddp, layout) in enumerate(zip(rec.reg.ddps, shared["layouts"])):
            rebind(ddp, layout)
            if layout is None and ddp.static_graph and 0 <= plan.point < ddp_tools.first_rebuilt_step(ddp) - 1:
                # a static graph redoing step 1 runs the initial layout, as failure-free, but the rebound reducer
                # counts step 1 as its first iteration and would rebuild one step late: rebind it at step 2 with
                # the layout DDP rebuilds then (its order is recorded during step 1 on every rank)
                rec.rebind_at[index] = ddp_tools.first_rebuilt_step(ddp)
        unknown = [lay is None and ddp_tools.rebuilds(d) and index not in rec.rebind_at
                   for index, (d, lay) in enumerate(zip(rec.reg.ddps, shared["layouts"]))]
        if rec.rank == plan.source and plan.point >= 0 and any(unknown):
            # DDP rebuilds its buckets from the gradient order of its first iterations; a reducer rebuilt by the
            # recovery has recorded nothing. The runtime hands on the layout it predicts from its own record of the
            # order (ddp.next_layout); without that record (not expected once a step completed) this run keeps
            # the initial buckets longer than a failure-free run would: sums round differently
            warn("the failure came before DDP rebuilt its gradient buckets and their layout is unknown: the "
                 "recovered run is not bitwise the failure-free one (about 1e-7 relative with 3 ranks or more), "
                 "replicas stay equal")
        rec.restore_streams(plan.point, shared["rng"], plan.source, receives=rec.rank in plan.targets)

    def _transfer_fault(self, chunk: int) -> None:
        if chunk == 0:
            faults.fire("transfer", max(self.rec.step, 0))
