"""Sharded data parallelism's recovery (FSDP2 with replica groups, HSDP): each lost shard copied from a replica.

Rank (r, s) of an HSDP mesh holds shard s of every parameter and of its optimizer state; rank (r', s) of every
other replica group holds a bitwise copy (design/FSDP.md 4.1). So a lost rank is replaced in place:

- the survivors keep their processes; when the generation is aborted each one clears FSDP's per-iteration state
  and reshards (runtime/comm/fsdp.py ``reset``) before it settles its step, so that its registered parameters
  are the sharded ones its snapshot describes;
- every group is rebuilt in the same order on every rank, the replacement's included (the default group, then
  the script's and the mesh's subgroups: the same names, which the ``DeviceMesh`` resolves), FSDP's cached group
  objects are rebound to them, and one group per replica set is made for the transfer and the comparison;
- the ranks agree on one step for every shard (runtime/hsdp/consensus.py), undo where a shard's replicas stopped
  before an update others applied, and each replica set's source sends its shards, optimizer state, param-group
  hyperparameters, schedulers, scaler and user state to the members that lack them, over that set's group, in
  bounded chunks, into the receivers' own tensors (runtime/state/transfer.py, DTensors by their local shard);
- each rank's own random streams come from the launcher's backups, as for DDP (runtime/core/streams.py);
- the replicas of each shard compare the digests of their whole state before RECOVERED: a mismatch is loud.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from swiftrun.errors import RecoveryError
from swiftrun.runtime.comm import fsdp, intercept
from swiftrun.runtime.core.recovery import Recovery
from swiftrun.runtime.core.strategy import Strategy, timed
from swiftrun.runtime.dp.consensus import RankStatus
from swiftrun.runtime.hsdp.consensus import ShardPlan, plan_sharded
from swiftrun.runtime.state import layout, verify
from swiftrun.runtime.state import tree as st
from swiftrun.runtime.worker import faults

log = logging.getLogger("swiftrun.runtime")

STREAM_STEPS = 4  # how many steps a rank reports its own streams for (the newest it holds)


class ShardedDataParallel(Strategy):
    """Replica sets of shards: agree on one step, undo where needed, copy each set's source to its members."""

    # a ring all-reduce can let one shard's ranks through to their update while another shard's replicas stay
    # before it: the ranks that went through must then undo a step they may have finished (consensus.py)
    keeps_last_update = True
    recovers_shards = True
    undo_reason = ("HSDP: replicas of one shard can stop before an update that the ranks of another shard "
                   "applied")

    def __init__(self, rec: Recovery) -> None:
        self.rec = rec
        self.sets = layout.replica_sets(rec.reg.models, rec.world_size)
        self.mine = next(s for s in self.sets if rec.rank in s)
        self.group: Any = None  # this rank's replica set's group (None: the set is the whole world)
        missing = fsdp.missing_internals(rec.reg.models)
        self.refusal = (f"this torch ({torch.__version__}) lacks FSDP internals the in-place recovery of "
                        f"FSDP2 rebinds ({', '.join(missing)}); it was built for torch 2.13") if missing else None

    @property
    def compare_group(self) -> Any:
        return self.group

    def uncompared_buffers(self) -> set[int]:
        return set()  # replicas of a shard hold the same buffers too (FSDP2 keeps buffers unsharded, equal)

    def on_start(self) -> None:
        self._regroup()

    def on_abort(self) -> None:
        problems = fsdp.reset(self.rec.reg.models)
        if problems:
            log.debug("FSDP reset after the abort: %s", "; ".join(problems))

    def before_rebuild(self) -> None:
        self.group = None  # no reference to a group of the aborted generation outlives it

    def after_rebuild(self) -> None:
        self._regroup()

    def _regroup(self) -> None:
        """FSDP's cached groups follow the new generation's; one group per replica set, made by every rank."""
        rebound = fsdp.rebind(self.rec.reg.models)
        log.debug("rebound %d FSDP mesh infos to generation %d's groups", rebound, self.rec.group.generation)
        self.group = None
        with intercept.internal():  # swiftrun's own groups: not recorded among the script's
            for members in self.sets:
                if len(members) == self.rec.world_size:
                    continue  # the default group
                group = self.rec.group.new_group(list(members))
                if self.rec.rank in members:
                    self.group = group

    def recover(self, phases: dict[str, float]) -> ShardPlan:
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
            device = rec.group.device()
            shared_rng, rng_source = None, None
            for source, targets in plan.copies:  # every rank creates every group, in the same order
                members = sorted({source, *targets})
                group = rec.group.new_group(members)
                if rec.rank not in members:
                    continue
                if rec.rank != source:
                    rec.valid = False  # until the whole state arrived
                st.transfer(rec.reg, source, rec.rank, group, device, rec.chunk_bytes,
                            on_chunk=self._transfer_fault if rec.rank == source else None)
                shared = rec.from_source(source, plan.point, group)
                if rec.rank != source:
                    shared_rng, rng_source = shared["rng"], source
            rec.restore_streams(plan.point, shared_rng, rng_source, receives=shared_rng is not None)
        rec.resume_after(plan.point)
        rec.forget_undo_records()
        rec.reg.clear_grads()
        with timed(phases, "verify"):
            mismatches = verify.compare(rec.reg, group=self.group)
        if mismatches:
            raise RecoveryError("replicas of a shard differ after the recovery: " + verify.describe(mismatches))
        rec.verify_next = plan.verify_next
        return plan

    def _consensus(self) -> ShardPlan:
        rec = self.rec
        status = RankStatus(rec.rank, rec.valid, rec.position, not rec.partial, rec.undoable(),
                            outside_step=rec.between_steps)
        held = rec.streams_held(STREAM_STEPS)
        row = status.pack() + held + [-9] * (STREAM_STEPS - len(held))
        mine = torch.tensor(row, dtype=torch.int64, device=rec.group.device())
        rows = [torch.empty_like(mine) for _ in range(rec.world_size)]
        dist.all_gather(rows, mine)
        width = len(status.pack())
        statuses = [RankStatus.unpack(r.tolist()[:width]) for r in rows]
        streams = {s.rank: {step for step in r.tolist()[width:] if step != -9} for s, r in zip(statuses, rows)}
        return plan_sharded(statuses, self.sets, streams if rec.per_rank_streams else None)

    def _transfer_fault(self, chunk: int) -> None:
        if chunk == 0:
            faults.fire("transfer", max(self.rec.step, 0))
