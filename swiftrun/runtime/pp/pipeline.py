"""Pipeline stages made recoverable: what crosses a stage boundary is logged, every stage is checkpointed into a
neighbour's memory, and a stage nobody else holds is rebuilt by replaying it alone (docs/ARCHITECTURE.md,
"Pipelines"; measured facts in ../shared/design/PIPELINE.md).

A hand-written point-to-point pipeline (``Run(pipeline=swiftrun.Stage(...))``) shares all of this; only its
interception differs, in runtime/pp/p2p.py (``P2PTap``, ``self.tap``).

Interception (torch.distributed.pipelining, torch 2.13): every schedule gets its point-to-point operations only
from a stage's four factories ``get_fwd_recv_ops``, ``get_bwd_recv_ops``, ``get_fwd_send_ops`` and
``get_bwd_send_ops``, which carry the micro-batch index. They are wrapped per stage instance:

- live: each *sent* tensor is copied into the log under (step, "act"|"grad", from stage, to stage, micro-batch,
  ordinal); the operations go out unchanged;
- replay: a receive is served from the log a neighbour handed over (copied into the stage's existing receive
  buffer) and returns no operation; a send is computed (the backward factory pops the stage's cache) and dropped.

Dropout must draw the same masks in a replay as in the lost run, whatever order the micro-batches run in, so each
``forward_one_chunk`` runs with its generators (CPU, and its GPU's) seeded from (the script's seed, step, stage, micro-batch): the
global RNG streams are left untouched. The per-iteration results of the script's own collectives inside a step
(a global grad norm all-reduced over stages for clipping) are logged too: a replaying stage cannot recompute them
alone, so they are served to it from a neighbour's log.

Stage checkpoints: at every ``checkpoint_every``-th step start (and at the first step after a recovery), each rank
takes a host copy of its registered state and RNG and sends it, in the background over a channel of its own, to
the next rank of its pipeline, which installs it in memory once it has arrived whole (the last stage's goes to
the first; runtime/pp/ckpt.py). A lost stage is rebuilt from that copy with no disk read. Logs older than the
new checkpoint are dropped only once every holder has installed it; until then a failure replays from the
previous checkpoint, whose logs are still there.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from swiftrun.errors import RecoveryError
from swiftrun.protocol.control import EventKind
from swiftrun.runtime.comm import intercept, subgroups
from swiftrun.runtime.comm.group import GroupManager
from swiftrun.runtime.core.step import StepView
from swiftrun.runtime.core.txn import rng_state, set_rng_state
from swiftrun.runtime.pp import selective
from swiftrun.runtime.pp.ckpt import CheckpointDir, Exchange, FlatSnapshots, Packed
from swiftrun.runtime.pp.log import LogStore
from swiftrun.runtime.pp.p2p import P2PTap, Stage
from swiftrun.runtime.pp.plan import StageStatus
from swiftrun.runtime.state import tree as st
from swiftrun.runtime.state.registry import Registry, RegistrationError
from swiftrun.runtime.worker.env import settings
from swiftrun.runtime.worker.link import Link

log = logging.getLogger("swiftrun.runtime")

Key = tuple  # (step, kind, from_stage, to_stage, micro-batch, ordinal)
_LOGGED_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
                       "barrier")


def stages_of(spec: Any) -> tuple[Any, list[Any]]:
    """(schedule or None, stages) from what ``Run(pipeline=...)`` was given."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
    from torch.distributed.pipelining.stage import _PipelineStageBase

    items = spec if isinstance(spec, (list, tuple)) else [spec]
    schedule, stages = None, []
    for item in items:
        if isinstance(item, PipelineScheduleSingle):
            schedule, stages = item, stages + [item._stage]
        elif isinstance(item, PipelineScheduleMulti):
            schedule, stages = item, stages + list(item._stages)
        elif isinstance(item, _PipelineStageBase):
            stages.append(item)
        else:
            raise RegistrationError(
                f"swiftrun.Run(pipeline=...) takes a torch.distributed.pipelining schedule or PipelineStage(s), or "
                f"a swiftrun.Stage for a hand-written point-to-point pipeline, got {type(item).__name__}")
    for stage in stages:
        if getattr(stage, "_user_meta", None) is None or stage._user_meta.inputs is None:
            raise RegistrationError(
                f"pipeline stage {stage.stage_index} has no static shapes: build PipelineStage with input_args= "
                "and output_args= (a replacement joins survivors whose shape inference already ran, so it cannot "
                "run the pipeline-wide inference again)")
    return schedule, stages


class Pipeline:
    """One rank's pipeline stages under swiftrun: logging, checkpoints, replay."""

    def __init__(self, view: StepView, reg: Registry, group: GroupManager, link: Link,
                 next_layouts: Callable[[int], list], spec: Any, checkpoint_every: int) -> None:
        self.view = view  # the step in progress (read-only: the recovery loop keeps it)
        self.reg, self.group, self.link = reg, group, link
        self.next_layouts = next_layouts  # the DDP bucket layouts to redo the step after a point (core/recovery)
        # the tap that sees the stage boundaries: torch pipelining's stage factories (wrapped below), or the
        # script's own point-to-point calls (runtime/pp/p2p.py); the log, checkpoints and replay are shared
        self.tap: P2PTap | None = None
        self.schedule, self.stages = (None, []) if isinstance(spec, Stage) else stages_of(spec)
        self.seed = torch.initial_seed()
        self.every = max(1, int(checkpoint_every))
        self.log = LogStore()  # bounded in memory (--log-memory), the rest spilled to local disk
        self.coll: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._coll_seq = 0
        self.log_start = 0  # the oldest step whose sends are still logged
        self.exchange = Exchange()  # the background checkpoint exchange (runtime/pp/ckpt.py)
        self.channel: Any = None  # its process group, one per generation
        self._snapshots = FlatSnapshots()  # the snapshot's host buffer, reused checkpoint after checkpoint
        self.held: tuple[int, int, Packed] | None = None  # (for rank, step, checkpoint)
        # the previous checkpoints (held, own), kept until the newer one is complete at every holder: a recovery
        # in between may need them (runtime/pp/plan.py picks the newest step a whole replay set has)
        self.held_prev: tuple[int, int, Packed] | None = None
        self.own_prev: tuple[int, Packed] | None = None
        self.force_checkpoint = False
        self.replay: dict[str, Any] | None = None  # {"until", "log", "coll", "gen", ...} while replaying
        self.parallel: Any = None  # runtime/pp/parallel.Leader while helpers replay with this rank
        self.volume: dict[tuple[int, int], int] = {}  # (from, to) stage -> bytes logged in the last full step
        self._volume_now: dict[tuple[int, int], int] = {}
        # selective logging (runtime/pp/selective.py): the boundaries logged (None: all) and the logging groups,
        # as pipeline positions; a rank whose group has other members keeps its own checkpoint copy to roll back
        self.logged: set[int] | None = None
        self.groups: tuple[tuple[int, ...], ...] | None = None
        self.keep_own = False
        self.own: tuple[int, Packed] | None = None
        directory = settings().stage_ckpt_dir
        self.disk = CheckpointDir(directory) if directory else None
        self.compute = 0.0  # seconds spent in forward and backward chunks during the current step
        self.compute_steps: list[float] = []  # per finished step, for the logging plan's profile
        for stage in self.stages:
            self._wrap(stage)
        if isinstance(spec, Stage):
            self.tap = P2PTap(self, spec)

    # ------------------------------------------------------------------ topology

    @property
    def stage_indices(self) -> tuple[int, ...]:
        if self.tap is not None:
            return self.tap.stage_indices
        return tuple(sorted(s.stage_index for s in self.stages))

    def pipe_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's pipeline, in the order of their first stage."""
        if self.tap is not None:
            return self.tap.pipe
        stage = self.stages[0]
        ranks: list[int] = []
        for index in range(stage.num_stages):
            rank = stage._resolve_peer_global_rank(index)
            if rank not in ranks:
                ranks.append(rank)
        return tuple(ranks)

    def _neighbours(self) -> tuple[int, int]:
        """(previous, next) rank in the pipeline's ring: the next one holds this rank's checkpoint."""
        pipe = self.pipe_ranks()
        me = pipe.index(self.view.rank)
        return pipe[me - 1], pipe[(me + 1) % len(pipe)]

    def validate(self) -> None:
        """Every rank of a pipeline must agree on its shape before anything is logged: the same number of stages
        and micro-batches, each stage run by exactly one rank. Checked once, on every rank, at registration."""
        mine = {"rank": self.view.rank, "pipe": self.pipe_ranks(), "stages": self.stage_indices,
                "num_stages": self.num_stages,
                "microbatches": getattr(self.schedule, "_n_microbatches", None)}
        rows: list[Any] = [None] * self.view.world_size
        dist.all_gather_object(rows, mine)
        problem = pipeline_problem([r for r in rows if r["pipe"] == mine["pipe"]])
        if problem:
            raise RegistrationError(f"swiftrun.Run(pipeline=...): {problem}")

    def logging_plan(self) -> tuple | None:
        return None if self.groups is None else (self.groups, None if self.logged is None else sorted(self.logged))

    def adopt(self, plan: tuple | None) -> None:
        """Take the logging plan the survivors chose (the same on every rank)."""
        if plan is None:
            return
        groups, logged = plan
        self.groups = tuple(tuple(g) for g in groups)
        self.logged = None if logged is None else set(logged)
        position = self.pipe_ranks().index(self.view.rank)
        self.keep_own = any(position in g and len(g) > 1 for g in self.groups)

    def regroup(self) -> None:
        """Point stages built on one of the script's subgroups at its counterpart of the new generation, and
        create the checkpoint exchange's channel of this generation (every rank, in the same order; through the
        group manager, so an abort releases an exchange blocked on a dead peer at once)."""
        for stage in self.stages:
            if stage.group is not None:
                stage.group = subgroups.current(stage.group)
        assert not self.exchange.running, "stop_exchange() before the groups are rebuilt"
        self.channel = None
        if len(self.pipe_ranks()) > 1:
            with intercept.internal():
                self.channel = self.group.new_group(list(range(self.view.world_size)))

    def stop_exchange(self, timeout: float) -> None:
        """Before a recovery rebuilds the groups: the exchange in flight ends (the abort released its channel),
        leaving this rank with the last checkpoint it had installed whole."""
        if not self.exchange.wait(timeout):
            raise RecoveryError(f"the stage checkpoint exchange of step {self.exchange.step} did not stop within "
                                f"{timeout:.0f}s of the abort")

    # ------------------------------------------------------------------ interception

    def _wrap(self, stage: Any) -> None:
        fwd_recv, bwd_recv = stage.get_fwd_recv_ops, stage.get_bwd_recv_ops
        fwd_send, bwd_send = stage.get_fwd_send_ops, stage.get_bwd_send_ops
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
        index = stage.stage_index

        def sends(original: Callable, kind: str, to: int) -> Callable:
            def factory(mb: int, *args: Any, **kwargs: Any) -> list:
                ops = original(mb, *args, **kwargs)  # always: the backward factory pops the stage's cache
                if self.replay is not None:  # to a stage replaying with this one: live; elsewhere: dropped
                    return ops if to in self.replay["live"] else []
                if self.logged is None or min(index, to) in self.logged:
                    step = self.view.step
                    for ordinal, op in enumerate(ops):
                        self.record((step, kind, index, to, mb, ordinal), op.tensor)
                return ops
            return factory

        def receives(original: Callable, kind: str, infos: Callable[[], dict]) -> Callable:
            def factory(mb: int, *args: Any, **kwargs: Any) -> list:
                if self.replay is None:
                    return original(mb, *args, **kwargs)
                if kind == "grad" and (not stage.has_backward or stage.is_last):
                    return []
                live = self.replay["live"]
                mine = infos().get(mb, ())
                self._serve(kind, index, mb, [i for i in mine if getattr(i, "source", None) not in live])
                return stage._get_recv_ops(tuple(i for i in mine if getattr(i, "source", None) in live))
            return factory

        generators = _generators(torch.device(stage.device))

        def seeded_forward(mb: int, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            states = [g.get_state() for g in generators]
            seed = _mix(self.seed, self.view.step, index, mb)
            try:
                for g in generators:
                    g.manual_seed(seed)
                return forward(mb, *args, **kwargs)
            finally:
                for g, saved in zip(generators, states):
                    g.set_state(saved)
                self.compute += time.perf_counter() - started

        def timed_backward(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return backward(*args, **kwargs)
            finally:
                self.compute += time.perf_counter() - started

        stage.get_fwd_send_ops = sends(fwd_send, "act", index + 1)
        stage.get_bwd_send_ops = sends(bwd_send, "grad", index - 1)
        stage.get_fwd_recv_ops = receives(fwd_recv, "act", lambda: stage.args_recv_info)
        stage.get_bwd_recv_ops = receives(bwd_recv, "grad", lambda: stage.grad_recv_info)
        stage.forward_one_chunk = seeded_forward
        stage.backward_one_chunk = timed_backward

    def record(self, key: Key, tensor: torch.Tensor) -> None:
        """Log a tensor sent across a stage boundary (both taps call this)."""
        nbytes = self.log.put(key, _host_copy(tensor))
        boundary = (key[2], key[3])
        volume = self._volume_now
        volume[boundary] = volume.get(boundary, 0) + nbytes

    def _serve(self, kind: str, index: int, mb: int, infos: tuple) -> None:
        assert self.replay is not None
        step = self.view.step
        ordinals: dict[int, int] = {}
        with torch.no_grad():
            for info in infos:
                if getattr(info, "is_root_arg", False) or info.buffer is None:
                    continue
                ordinal = ordinals.get(info.source, 0)
                ordinals[info.source] = ordinal + 1
                key = (step, kind, info.source, index, mb, ordinal)
                value = self.replay["log"].get(key)
                if value is None:
                    raise RecoveryError(f"replay of stage {index}: the {kind} of step {step}, micro-batch {mb} from "
                                        f"stage {info.source} is not in the neighbours' logs")
                info.buffer.copy_(value)

    # ------------------------------------------------------------------ the script's collectives in a step

    def collective(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A collective inside a step: logged live, served from the log in a replay."""
        key = (self.view.step, self._coll_seq)
        self._coll_seq += 1
        outputs = _outputs(name, args, kwargs)
        if self.replay is not None and not _members(args, kwargs, self.view.world_size) <= self.replay["together"]:
            # a collective with ranks that do not replay: its result comes from a neighbour's log, which is this
            # call's result only if that neighbour took part in it (a pipeline-wide one, not another stage's
            # data-parallel one). One among replaying ranks only (the replicas of a stage replaying in lockstep,
            # or the whole job) runs live.
            server = self.replay["server"]
            if server is None or server not in _members(args, kwargs, self.view.world_size):
                raise RecoveryError(f"replay cannot reproduce dist.{name} inside a step on a group of ranks "
                                    f"{sorted(_members(args, kwargs, self.view.world_size))}: it has ranks that "
                                    "do not replay, and no neighbour serving this replay's logs took part in it")
            if name not in _LOGGED_COLLECTIVES:
                raise RecoveryError(f"replay cannot reproduce dist.{name} inside a step (only {', '.join(_LOGGED_COLLECTIVES)} are logged)")
            logged = self.replay["coll"].get(key)
            if logged is None or len(logged) != len(outputs):
                raise RecoveryError(f"replay: the result of dist.{name} (call {key[1]} of step {key[0]}) is not "
                                    "in the neighbours' logs")
            with torch.no_grad():
                for out, value in zip(outputs, logged):
                    out.copy_(value)
            return intercept.Done() if kwargs.get("async_op") else None
        result = fn(*args, **kwargs)
        if kwargs.get("async_op") and result is not None:
            result.wait()  # its value is logged now; the caller's wait() on a completed work returns at once
        if name in _LOGGED_COLLECTIVES:
            self.coll[key] = [_host_copy(t) for t in outputs]
        return result

    # ------------------------------------------------------------------ step boundaries

    def begin_step(self, step: int) -> None:
        """Garbage-collect logs, and exchange stage checkpoints when one is due (may raise on a peer failure)."""
        self._coll_seq = 0
        if self.tap is not None:
            self.tap.begin_step()
        if self.compute:
            self.compute_steps = (self.compute_steps + [self.compute])[-16:]
            self.compute = 0.0
        if self._volume_now:
            self.volume, self._volume_now = self._volume_now, {}
        if self.replay is not None:
            return
        self._retire(self.exchange.complete_step)
        due = step % self.every == 0 or self.force_checkpoint
        if due and self.groups is None and step > 0 and selective.budget() is not None:
            self._choose_logging(step)  # a collective: every rank reaches this checkpoint step
        if due:
            self._exchange(step)
            self.force_checkpoint = False

    def _choose_logging(self, step: int) -> None:
        """Selective logging (runtime/pp/selective.py): every rank's profile to every rank, the same plan chosen
        everywhere, adopted; rank 0 tells the launcher."""
        pipe = self.pipe_ranks()
        mine = selective.profile(pipe.index(self.view.rank), len(pipe), self.stage_indices, self.num_stages,
                                 self.compute_steps, self.volume)
        rows: list[Any] = [None] * self.view.world_size
        dist.all_gather_object(rows, mine)
        limit = selective.budget()
        assert limit is not None
        decision = selective.decide(rows, self.every, limit)
        self.adopt((decision.groups, None if decision.logged is None else sorted(decision.logged)))
        log.info("step %d: %s", step, decision.message)
        if self.view.rank == 0:
            self.link.send_event(EventKind.LOG_PLAN, gen=self.view.generation, message=decision.message, step=step,
                                 **decision.data)

    def _retire(self, complete: int) -> None:
        """Checkpoint ``complete`` is installed at every holder: no replay can start before it any more."""
        if complete < 0:
            return
        if complete > self.log_start:
            self._drop_before(complete)
        if self.held_prev is not None and self.held_prev[1] < complete:
            self.held_prev = None
        if self.own_prev is not None and self.own_prev[0] < complete:
            self.own_prev = None

    def _drop_before(self, step: int) -> None:
        self.log.drop(lambda k: k[0] < step)
        for key in [k for k in self.coll if k[0] < step]:
            del self.coll[key]
        self.log_start = step

    def drop_after(self, step: int) -> None:
        """Sends of steps past the recovery point will be made again (same values): forget the old ones."""
        self.log.drop(lambda k: k[0] > step)
        for key in [k for k in self.coll if k[0] > step]:
            del self.coll[key]

    def _exchange(self, step: int) -> None:
        """Snapshot this rank's checkpoint of ``step`` and exchange it in the background: to the next rank of the
        pipeline, the previous rank's in (runtime/pp/ckpt.py)."""
        prev, nxt = self._neighbours()
        if prev == self.view.rank or self.channel is None:
            return  # a one-rank pipeline has nobody to hold its checkpoint (a DP-only job never gets here)
        if self.exchange.running:  # the previous one is still under way: one at a time
            started = time.monotonic()
            self.exchange.wait()
            log.debug("stage checkpoint of step %d waited %.3fs for the exchange of step %d", step,
                      time.monotonic() - started, self.exchange.step)
            self._retire(self.exchange.complete_step)
        started = time.monotonic()
        # this rank's own copies are earlier snapshots: their buffers must not be written
        keep = tuple(own[1].flat for own in (self.own, self.own_prev) if own is not None)
        # the DDP bucket layouts this step runs with: a stage whose every replica replays from this checkpoint
        # rebinds its reducers with them, so its all-reduce sums what the failure-free run summed (ddp.py)
        layouts = self.next_layouts(step - 1) if self.reg.ddps else None
        snap, ready = self._snapshots.take({"step": step, "tree": st.state_tree(self.reg), "rng": rng_state(),
                                            "layouts": layouts}, keep)
        log.debug("stage checkpoint of step %d: snapshot in %.3fs", step, time.monotonic() - started)
        self.exchange.start(step, snap, self.channel, nxt, prev, self.group.device(), ready=ready,
                            install=lambda s, received, sent: self._install(prev, s, received, sent))

    def _install(self, prev: int, step: int, received: Packed, sent: Packed) -> None:
        """In the exchange thread, once both transfers are whole: hold the previous rank's checkpoint, keep this
        rank's own copy (a logging group rolls back to it), write it to the stage checkpoint directory."""
        # the new copy goes in whole, the previous one stays until the new one is complete everywhere
        self.held_prev, self.held = self.held, (prev, step, received)
        self.own_prev, self.own = self.own, ((step, sent) if self.keep_own else None)
        if self.disk is not None:
            self.disk.write(self.view.rank, step, sent)
            self.disk.flush()  # complete means on disk too: the copy of last resort needs the same logs

    # ------------------------------------------------------------------ recovery

    def status(self, valid: bool, updates: int, boundary: bool, undoable: bool, outside: bool) -> StageStatus:
        held_for, held_step = (self.held[0], self.held[1]) if self.held is not None else (-1, -1)
        prev = self.held_prev
        held_prev_step = prev[1] if prev is not None and prev[0] == held_for else -1
        return StageStatus(self.view.rank, valid, updates, boundary, undoable, self.stage_indices, self.pipe_ranks(),
                           held_for, held_step, self.log_start, outside,
                           own_step=self.own[0] if self.own is not None else -1,
                           held_prev_step=held_prev_step,
                           own_prev_step=self.own_prev[0] if self.own_prev is not None else -1,
                           disk_step=self.disk.latest(self.view.rank) if self.disk is not None else -1)

    def part_for(self, replay: Any, member: int, point: int, checkpoint: bool, logs: bool, coll: bool) -> dict:
        """What this rank hands ``member`` of a replay set: the checkpoint it holds for it, the logged sends to its
        stages, the logged collective results."""
        part: dict[str, Any] = {}
        if checkpoint:
            held = next((h for h in (self.held, self.held_prev)
                         if h is not None and h[0] == member and h[1] == replay.start), None)
            if held is None:
                raise RecoveryError(f"rank {self.view.rank} does not hold the checkpoint of step {replay.start} of "
                                    f"rank {member}")
            part["checkpoint"] = held[2]
        if logs:
            to_member = {i for i in range(self.num_stages) if self._rank_of(i) == member}
            part["log"] = self.log.select(lambda k: replay.start <= k[0] <= point and k[3] in to_member)
        if coll:
            part["coll"] = {k: v for k, v in self.coll.items() if replay.start <= k[0] <= point}
        return part

    @property
    def num_stages(self) -> int:
        return self.tap.num_stages if self.tap is not None else self.stages[0].num_stages

    def _rank_of(self, stage_index: int) -> int:
        if self.tap is not None:
            return self.tap.pipe[stage_index]
        return self.stages[0]._resolve_peer_global_rank(stage_index)

    def own_copy(self, step: int) -> Packed | None:
        """This rank's own checkpoint of ``step`` (a logging group rolls back to it), if it keeps one."""
        return next((own[1] for own in (self.own, self.own_prev) if own is not None and own[0] == step), None)

    def enter_replay(self, replay: Any, point: int, checkpoint: Packed, logs: dict, coll: dict) -> None:
        """Install the checkpoint and replay steps ``replay.start .. point``; the set's members talk live, the
        rest is served from ``logs``."""
        loaded = checkpoint.unpack()
        if loaded["step"] != replay.start:
            raise RecoveryError(f"the stage checkpoint received is of step {loaded['step']}, not {replay.start}")
        st.install(self.reg, loaded["tree"])
        set_rng_state(loaded["rng"])
        self.replay = {"start": replay.start, "until": point, "log": logs, "coll": coll,
                       "live": set(replay.stages), "together": set(replay.cohort),
                       # the neighbour whose logged collective results this replay is served (pp_handover)
                       "server": replay.peers[0] if replay.peers else None,
                       # the DDP bucket layouts of the checkpoint's step (runtime/core/recovery.py rebinds with them)
                       "layouts": loaded.get("layouts"),
                       "ranks": list(replay.cohort),
                       "started": time.monotonic()}
        self.log.clear()
        self.coll.clear()
        self.log_start = replay.start

    def end_replay(self) -> float:
        assert self.replay is not None
        if self.parallel is not None:
            self.parallel.close()  # the helpers go back to waiting for RESUME
            self.parallel = None
        took = time.monotonic() - self.replay["started"]
        self.replay = None
        self.force_checkpoint = True
        return took

    def drop_parallel(self) -> None:
        """A replay interrupted by a newer failure: the schedule runs its own micro-batches again."""
        if self.parallel is not None:
            self.parallel.detach()
            self.parallel = None

    def reset_schedule(self) -> None:
        """After an aborted iteration: forget the schedule's half-finished state, and make sure every stage counts
        as initialised (a replacement must not run the pipeline-wide warm-up and shape inference again, and its
        survivors will not)."""
        schedule = self.schedule
        for stage in self.stages:
            stage.clear_runtime_states()
            stage.fwd_cache.clear()
            stage.bwd_cache.clear() if hasattr(stage, "bwd_cache") else None
        if schedule is None:
            return
        if hasattr(schedule, "_internal_losses"):
            schedule._internal_losses.clear()
        for pending in ("fwd_recv_ops", "bwd_recv_ops"):
            # the runtime schedule (interleaved) keeps the receives it posted until the micro-batch's forward or
            # backward runs, across steps: an aborted step's would fail the next with "Recv twice"
            if isinstance(getattr(schedule, pending, None), dict):
                getattr(schedule, pending).clear()
        n = schedule._n_microbatches
        has_backward = schedule._has_backward
        single = hasattr(schedule, "_stage_forward_initialized")
        fwd = schedule._stage_forward_initialized if single else schedule._stages_forward_initialized
        bwd = schedule._stage_backward_initialized if single else schedule._stages_backward_initialized
        if fwd and (bwd or not has_backward):
            return
        from torch.distributed.pipelining._utils import InferenceMode

        for stage in self.stages:
            stage._inference_mode = InferenceMode.STATIC
            stage.has_backward = has_backward
            stage._prepare_forward_infra(n, None, None, has_backward=has_backward)
        if has_backward:
            for stage in reversed(self.stages):
                stage._prepare_backward_infra(n, loss_fn=schedule._loss_fn, target=None)
        if single:
            schedule._stage_forward_initialized = True
            schedule._stage_backward_initialized = has_backward
        else:
            schedule._stages_forward_initialized = True
            schedule._stages_backward_initialized = has_backward


# ---------------------------------------------------------------------- helpers


def _mix(seed: int, step: int, stage: int, mb: int) -> int:
    """A dropout seed per (script seed, step, stage, micro-batch): splitmix64-style, stable across processes."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + stage * 0x94D049BB133111EB + mb) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & (2**64 - 1)
    return (x ^ (x >> 32)) & 0x7FFF_FFFF_FFFF_FFFF


def pipeline_problem(rows: list[dict]) -> str | None:
    """What is inconsistent between the ranks of one pipeline (None: nothing): pure, for the unit tests."""
    for key, what in (("num_stages", "numbers of stages"), ("microbatches", "micro-batch counts")):
        values = {r["rank"]: r[key] for r in rows}
        if len(set(values.values())) > 1:
            listing = ", ".join(f"rank {k}: {v}" for k, v in sorted(values.items()))
            return f"the ranks of one pipeline have different {what} ({listing})"
    owners: dict[int, list[int]] = {}
    for r in rows:
        for stage in r["stages"]:
            owners.setdefault(stage, []).append(r["rank"])
    expected = set(range(rows[0]["num_stages"]))
    doubled = {s: ranks for s, ranks in owners.items() if len(ranks) > 1}
    if doubled:
        s, ranks = sorted(doubled.items())[0]
        return f"stage {s} is run by ranks {ranks} of the same pipeline"
    missing = sorted(expected - set(owners))
    if missing:
        return f"no rank of the pipeline runs stage(s) {missing}"
    return None


def _generators(device: torch.device) -> list[torch.Generator]:
    """The generators a stage's forward draws dropout from: the CPU one, and its GPU's. Seeding just these (not
    torch.manual_seed, which seeds every backend: 275 us against 6 us per micro-batch, measured)."""
    generators = [torch.default_generator]
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        generators.append(torch.cuda.default_generators[index])
    return generators


_copy_streams: dict[int, Any] = {}  # GPU index -> the side stream log copies run on


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of a sent tensor. On a GPU it is off the critical path: a pinned buffer (torch's caching host
    allocator reuses them) filled by an asynchronous copy on a side stream that waits only for the tensor's
    producer, so the compute stream never waits for it; ``record_stream`` keeps the tensor's memory alive until
    the copy is done. Readers synchronise first (pp_handover, pp_log)."""
    t = tensor.detach()
    if not t.is_cuda:
        return t.clone()
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    side = _copy_streams.get(index)
    if side is None:
        side = _copy_streams[index] = torch.cuda.Stream(device=t.device)
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    side.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(side):
        out.copy_(t, non_blocking=True)
    t.record_stream(side)
    return out


def _members(args: tuple, kwargs: dict, world_size: int) -> set[int]:
    """The global ranks of the group a collective runs on: its ``group`` argument, passed by name or among the
    positional ones (whose place differs between collectives), else the default group."""
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    if group is None or group is dist.group.WORLD:
        return set(range(world_size))
    return set(dist.get_process_group_ranks(group))


def _outputs(name: str, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a collective writes (its result), by torch.distributed's signatures."""
    def arg(i: int, key: str) -> Any:
        return args[i] if len(args) > i else kwargs.get(key)

    if name in ("all_reduce", "broadcast"):
        return [arg(0, "tensor")]
    if name == "all_gather":
        return list(arg(0, "tensor_list"))
    if name in ("all_gather_into_tensor", "all_gather_single"):
        return [arg(0, "output_tensor")]
    if name == "barrier":
        return []
    return []
