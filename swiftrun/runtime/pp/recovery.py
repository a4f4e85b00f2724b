"""A pipeline's recovery: stages are not replicas of each other, so each stage is made consistent on its own.

One point for every stage (runtime/pp/plan.py): a stage with a surviving data-parallel replica copies it; a
stage without one is rebuilt by its replacement from its last stage checkpoint, handed over by the neighbour
that holds it (runtime/pp/handover.py), and replayed from the neighbours' logs up to the point, helped by idle
survivors where it can be (runtime/pp/parallel.py). A replaying rank reports RECOVERED only when its replay
reaches the point; everyone else waits for RESUME meanwhile.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch.distributed as dist

from swiftrun.protocol.control import EventKind
from swiftrun.runtime.comm import intercept
from swiftrun.runtime.comm.ddp import rebind
from swiftrun.runtime.core.recovery import Recovery
from swiftrun.runtime.core.strategy import Strategy, timed
from swiftrun.runtime.dp.buffers import warn_per_rank_buffers
from swiftrun.runtime.pp import parallel
from swiftrun.runtime.pp.handover import hand_over
from swiftrun.runtime.pp.pipeline import Pipeline
from swiftrun.runtime.pp.plan import PipePlan, plan_pipeline
from swiftrun.runtime.state import tree as st
from swiftrun.runtime.worker.env import settings

log = logging.getLogger("swiftrun.runtime")

DEFAULT_CHECKPOINT_EVERY = 20  # steps between stage checkpoints of a pipeline (Run(checkpoint_every=...))


class PipelineRecovery(Strategy):
    """Stages of a pipeline (each possibly with data-parallel replicas): copy a replica, or replay."""

    # a stage one update ahead of the others must undo it, possibly after its step completed (so the last
    # step's records and gradients are kept, as in undo mode)
    keeps_last_update = True
    undo_reason = "a stage's replay may end before its peers' last update"

    def __init__(self, rec: Recovery, spec: Any, checkpoint_every: int | None) -> None:
        self.rec = rec
        every = checkpoint_every or settings().ckpt_every or DEFAULT_CHECKPOINT_EVERY
        self.pipeline = Pipeline(rec, rec.reg, rec.group, rec.link, rec.next_layouts, spec, every)
        warn_per_rank_buffers(rec.reg)

    @property
    def runs_alone(self) -> bool:
        return self.pipeline.replay is not None

    def uncompared_buffers(self) -> None:
        return None  # a pipeline's stages hold different states by design

    def step_collective(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        # its result is logged: a stage that replays later cannot recompute it alone
        return self.pipeline.collective(name, fn, args, kwargs)

    # ------------------------------------------------------------------ lifecycle

    def on_start(self) -> None:
        self.pipeline.regroup()
        with intercept.internal():
            self.pipeline.validate()

    def on_step_start(self, step: int) -> bool:
        """End a finished replay, then checkpoint when due. False: recover first."""
        rec, pp = self.rec, self.pipeline
        if pp.replay is not None:
            if step > pp.replay["until"]:
                if not self._end_replay():
                    return False
            else:
                rec.link.send_event(EventKind.REPLAYING, gen=rec.generation, step=step,
                                    first=pp.replay["start"], last=pp.replay["until"], ranks=pp.replay["ranks"],
                                    helpers=pp.parallel.helpers if pp.parallel is not None else [])
        try:
            with intercept.internal():
                pp.begin_step(step)
        except Exception:  # noqa: BLE001 - a peer died during the checkpoint exchange: recover first
            if rec.wait_for_abort():
                return False
            raise
        return True

    def on_abort(self) -> None:
        pp = self.pipeline
        if pp.replay is not None:
            pp.replay = None  # a replay interrupted by a newer failure: this state is not valid yet
            pp.drop_parallel()
            self.rec.valid = False

    def before_rebuild(self) -> None:
        self.pipeline.stop_exchange(self.rec.detect_timeout())  # its channel is a group the rebuild destroys

    def after_rebuild(self) -> None:
        self.pipeline.regroup()

    def reports_later(self, gen: int, phases: dict[str, float], plan: Any) -> bool:
        replay = self.pipeline.replay
        if replay is None:
            return False
        # this rank replays its stage alone first; it reports RECOVERED when the replay reaches the point
        replay.update(gen=gen, phases=phases, plan=plan.as_dict())
        return True

    def on_finish(self) -> bool:
        pp = self.pipeline
        if pp.replay is not None and not self._end_replay():
            return False  # a failure during the replay of the last steps
        # a checkpoint exchange still under way ends first (a peer's failure ends it too, and the wait for
        # RELEASE turns that into a recovery): the groups must not go while it uses one
        pp.exchange.wait()
        return True

    def _end_replay(self) -> bool:
        """The replay reached the recovery point: report RECOVERED and wait with everyone for RESUME."""
        pp = self.pipeline
        assert pp.replay is not None
        replay = pp.replay
        phases = dict(replay["phases"])
        phases["replay"] = pp.end_replay()
        phases["total_local"] = phases.get("total_local", 0.0) + phases["replay"]
        return self.rec.report_recovered(replay["gen"], phases, replay["plan"])

    # ------------------------------------------------------------------ the recovery

    def recover(self, phases: dict[str, float]) -> PipePlan:
        """One point for every stage; a stage with a surviving replica copies it, a stage without one is replayed
        by its replacement (see runtime/pp/plan.py)."""
        rec, pp = self.rec, self.pipeline
        with timed(phases, "consensus"):
            mine = pp.status(rec.valid, rec.position, not rec.partial, rec.undoable(), rec.between_steps)
            rows: list[Any] = [None] * rec.world_size
            dist.all_gather_object(rows, (mine, pp.logging_plan()))
            # a replacement missed the logging plan chosen before it started: it takes the survivors'
            pp.adopt(next((p for s, p in rows if s.valid and p is not None), None))
            plan = plan_pipeline([s for s, _ in rows], pp.groups)

        with timed(phases, "undo"):
            if rec.rank in plan.undo:
                rec.undo_last_update()

        with timed(phases, "transfer"):
            device = rec.group.device()
            shared_rng, rng_source = None, None  # the source's streams, where this rank took part in a copy
            layouts = rec.next_layouts(plan.point)
            for source, targets in plan.copies:  # every rank creates every group, in the same order
                members = sorted({source, *targets})
                group = rec.group.new_group(members)
                if rec.rank in members:
                    st.transfer(rec.reg, source, rec.rank, group, device, rec.chunk_bytes)
                    shared = rec.from_source(source, plan.point, group)
                    if rec.rank != source:
                        shared_rng, rng_source, layouts = shared["rng"], source, shared["layouts"]
            for ddp, layout in zip(rec.reg.ddps, layouts):  # a stage's replicas reduce with the same buckets
                rebind(ddp, layout)
            replaying = hand_over(pp, plan)
            if replaying is not None and pp.replay is not None and pp.replay["layouts"] is not None:
                # every replica of this stage replays from the checkpoint's step (pp/plan.py): the reducers run the
                # layout of that step, as the failure-free run did, not the one of the step after the point
                for ddp, layout in zip(rec.reg.ddps, pp.replay["layouts"]):
                    rebind(ddp, layout)
        rec.forget_undo_records()
        rec.reg.clear_grads()
        pp.drop_after(plan.point)
        pp.reset_schedule()
        pp.force_checkpoint = True  # the replacement lost what it held for its neighbours: exchange again
        if replaying is not None:
            rec.resume_after(replaying.start - 1, valid=False)
        else:
            # before resume_after: a replacement's live streams are not its own once it counts as recovered
            rec.restore_streams(plan.point, shared_rng, rng_source, receives=shared_rng is not None)
            rec.resume_after(plan.point)
        rec.verify_next = False  # stages are not replicas: their states are not compared
        self._parallel_replay(plan, phases)
        return plan

    def _parallel_replay(self, plan: PipePlan, phases: dict[str, float]) -> None:
        """Idle survivors help the replaying ranks (runtime/pp/parallel.py), each set its own share of them: a
        replaying rank offers its column of helpers its stage; a helper that takes it computes its part of every
        replayed step before it reports RECOVERED."""
        rec, pp = self.rec, self.pipeline
        assigned = parallel.assign_helpers(plan, rec.world_size)
        replay = plan.replay_of(rec.rank)
        if rec.rank in assigned:
            assert replay is not None
            pp.parallel = parallel.offer(pp, assigned[rec.rank], assigned, replay.ranks)
            return
        if replay is not None:
            if len(replay.ranks) > 1 and not replay.lockstep and parallel.cap() != 0:
                log.info("rank %d replays with ranks %s without helpers: fewer idle ranks than the %d members a "
                         "chain needs", rec.rank, [r for r in replay.ranks if r != rec.rank], len(replay.ranks))
            return
        leader = next((lead for lead, helpers in assigned.items() if rec.rank in helpers), None)
        if leader is None:
            return
        with timed(phases, "help"):
            setup = parallel.receive_offer(leader, rec.group.device())
            if setup is not None:
                steps = parallel.help_replay(rec.rank, setup, rec.group.device())
                log.info("rank %d helped rank %d replay %d step(s)", rec.rank, leader, steps)
