"""Parallel replay: idle survivors help the replacement of a lost pipeline stage (or a logging group) replay its steps.

A lost stage is replayed from its checkpoint by its replacement while every other survivor waits for RESUME. With
helpers, each replayed step's micro-batches are split into contiguous ranges: the replacement computes the first,
helper k the k-th, all at once. Gradients are then *folded in micro-batch order* along a chain: the replacement
sends the gradient it accumulated over its range to helper 1, which adds its micro-batches' gradients to it one by
one, in order, and passes it on; the last helper sends the total back. Each addition is the one autograd would
have made (``grad += new``, in the same order), so the result is bitwise the replacement's own (summing per-helper
partial sums is not: ../shared/design/PIPELINE.md, fact 5). The replacement then runs the schedule's gradient
scaling and the script's optimizer step as usual, and sends the new parameters with the next step's work.

Who helps: the valid ranks that neither replay nor receive a replica's copy, shared out among the replay sets in
contiguous shares, the same assignment on every rank, from the plan (:func:`assign_helpers`);
``SWIFTRUN_PARALLEL_REPLAY`` (``--parallel-replay N``) caps each set's share, 0 turns parallel replay off. Replicas
replaying in lockstep replay alone. A set of one rank (two stages lost at once, not adjacent: two such sets) leads
its share as one chain. A set of k ranks (a logging group, adjacent stages lost together) takes it in *chains* of k
helpers, each chain a full copy of the set's segment computing its own range: helper ``H[c][j]`` runs member j's
stage, activations flow ``H[c][j] -> H[c][j+1]`` and input gradients back, live; member j leads *column* j (its
helper in every chain: the module, and what only it can give: inputs from the logs or the script when they come
from outside the set, logged output gradients or targets when its outputs leave it) and folds that column's
gradients as above. The members compute the first range among themselves, live, in GPipe order, issuing the
operations the wrapped factories return for traffic inside the set. Right after the hand-over each replaying rank
sends each helper of its column an offer: the stage module and loss function (pickled: the helpers run the same
script, so the classes resolve), or ``None`` when its stage, or another member's, cannot be split (not a GPipe or
1F1B schedule of one stage, a DDP/FSDP-wrapped or ``dw_builder`` stage, something that does not pickle: the members
exchange their reasons first, so every column gets work or none); then the set replays alone, said in a log line.

A helper computes its range from the step's start, so the stage must be a function of its parameters, inputs and
the seeded generators. Two things break that and are handled: what the script changes between steps (a step
counter a module reads) travels, since each step's work carries the pickled module itself, not only its state
dict; what a *forward* changes (a buffer such as BatchNorm's running statistics, a call counter, a generator of
the module's own) would make helper k start from the step's start instead of from where micro-batch k-1 left it.
The replacement checks its first micro-batch's forward for such a change (:func:`side_state`) before it hands out
any work (every member of a set checks its own and they exchange verdicts); on one it releases the helpers and
replays alone (said in a log line): slower, never a wrong model.

The replacement's schedule keeps its public behaviour: ``_step_microbatches`` (what ``step()`` calls with the
split micro-batches) is replaced on that instance for the replay only; losses and last-stage outputs of the
helpers' micro-batches are handed back so ``step(losses=...)`` and the merged output are complete. Messages:
runtime/pp/wire.py (the current generation's default group, tags of their own).
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist

from swiftrun.runtime.comm import intercept

from swiftrun.runtime.worker import faults
from swiftrun.runtime.worker.env import settings
from swiftrun.runtime.pp import wire
from swiftrun.runtime.pp.wire import to_bytes

if TYPE_CHECKING:
    from swiftrun.runtime.pp.pipeline import Pipeline
    from swiftrun.runtime.pp.plan import PipePlan

log = logging.getLogger("swiftrun.runtime")

def cap() -> int:
    """The most helpers a replay may take (-1: every idle survivor; 0: off)."""
    return settings().parallel_replay


def assign_helpers(plan: PipePlan, world_size: int, limit: int | None = None) -> dict[int, tuple[int, ...]]:
    """Which idle survivors help which replaying rank: ``{replaying rank: its column}``, the column holding one
    helper per chain, in chain order. A pure function of the plan: every rank computes the same assignment.

    Idle: the valid ranks that neither replay nor receive a replica's copy. They are dealt out in contiguous
    shares, as even as possible (the larger shares first), to the replay sets in plan order; ``limit``
    (``--parallel-replay N``) caps each set's share: N helpers *per replay set*, since every set replays the same
    steps at once and the recovery lasts as long as the slowest. A set of k ranks (a logging group) takes its share
    in chains of k helpers, one per member (members in rank order): chain c is ``share[c*k:(c+1)*k]``, a full copy
    of the set's segment; a share smaller than k gives no chain (absent: the set replays alone). Replicas replaying
    in lockstep (a DDP-wrapped stage, never split) get no helper and are not idle."""
    limit = cap() if limit is None else limit
    sets = [r.ranks for r in plan.replays if not r.lockstep]
    if limit == 0 or not sets:
        return {}
    busy = {m for r in plan.replays for m in (*r.ranks, *r.together)} | {t for _, ts in plan.copies for t in ts}
    idle = [r for r in range(world_size) if r not in busy]
    out: dict[int, tuple[int, ...]] = {}
    for ranks, (lo, hi) in zip(sets, ranges(len(idle), len(sets)) if idle else []):
        share = idle[lo:hi] if limit < 0 else idle[lo:hi][:limit]
        members, chains = sorted(ranks), len(share) // len(ranks)
        for j, member in enumerate(members):
            if chains:
                out[member] = tuple(share[c * len(members) + j] for c in range(chains))
    return out


def ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """``n`` micro-batches in ``min(parts, n)`` contiguous ranges, as even as possible, the larger ones first."""
    parts = max(1, min(parts, n))
    size, extra = divmod(n, parts)
    out, start = [], 0
    for k in range(parts):
        end = start + size + (1 if k < extra else 0)
        out.append((start, end))
        start = end
    return out


def fold(partial: list[torch.Tensor | None], grads: list[list[torch.Tensor | None]]) -> list[torch.Tensor | None]:
    """Add each micro-batch's parameter gradients to ``partial`` in order, as autograd accumulates ``.grad``: the
    first gradient of a parameter is taken as is, the next ones added in place."""
    for per_mb in grads:
        for j, g in enumerate(per_mb):
            if g is None:
                continue
            if partial[j] is None:
                partial[j] = g
            else:
                partial[j].add_(g)
    return partial


@contextlib.contextmanager
def seeded(generators: list[torch.Generator], seed: int) -> Iterator[None]:
    """Run with ``generators`` seeded from ``seed``; their states are put back afterwards."""
    states = [g.get_state() for g in generators]
    try:
        for g in generators:
            g.manual_seed(seed)
        yield
    finally:
        for g, saved in zip(generators, states):
            g.set_state(saved)


# ---------------------------------------------------------------------- a forward's side effects


_PLAIN = (int, float, bool, str, bytes, type(None))


def _plain(value: Any) -> Any:
    """A comparable copy of a plain attribute value (None when it is not plain: not compared)."""
    if isinstance(value, _PLAIN):
        return ("v", value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return ("v", tuple(value))
    if isinstance(value, torch.Generator):
        return ("g", value.get_state())
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        return ("t", value.detach().clone())
    return None


def side_state(module: torch.nn.Module) -> dict:
    """What a forward may change besides its output: every buffer, the plain attributes (numbers, strings, tuples
    of them), tensors and generators of every submodule, and those of the plain objects they hold (a script's
    clock or counter object), one level deep."""
    out: dict = {}
    for name, sub in module.named_modules():
        for bname, buf in sub.named_buffers(recurse=False):
            out[(name, "buffer", bname)] = ("t", buf.detach().clone())
        for attr, value in vars(sub).items():
            if attr.startswith("_") and attr in ("_parameters", "_buffers", "_modules") or attr.endswith("hooks"):
                continue
            snap = _plain(value)
            if snap is not None:
                out[(name, attr)] = snap
            elif not isinstance(value, (torch.nn.Module, dict)) and hasattr(value, "__dict__"):
                for inner, v in vars(value).items():
                    snap = _plain(v)
                    if snap is not None:
                        out[(name, attr, inner)] = snap
    return out


def changed_by(before: dict, after: dict) -> list[str]:
    """The entries of two :func:`side_state` snapshots that differ."""
    diff = []
    for key in sorted(set(before) | set(after), key=str):
        a, b = before.get(key), after.get(key)
        if a is None or b is None or a[0] != b[0]:
            diff.append(".".join(map(str, key)))
        elif a[0] in ("t", "g"):
            if a[1].shape != b[1].shape or a[1].dtype != b[1].dtype or not torch.equal(a[1], b[1]):
                diff.append(".".join(map(str, key)))
        elif a[1] != b[1]:
            diff.append(".".join(map(str, key)))
    return diff


# ---------------------------------------------------------------------- the replacement's side


def _unsplittable(pp: Pipeline) -> str | None:
    """Why this rank's stage cannot be replayed in parts (None: it can)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe
    from torch.nn.parallel import DistributedDataParallel

    schedule = pp.schedule
    if pp.tap is not None or schedule is None or type(schedule) not in (ScheduleGPipe, Schedule1F1B):
        return "only GPipe and 1F1B schedules of torch.distributed.pipelining are split"
    stage = pp.stages[0]
    if isinstance(stage.submod, (DistributedDataParallel, FSDPModule)):
        return "the stage module is wrapped by DDP or FSDP"
    if stage.dw_builder is not None or not schedule._has_backward:
        return "the stage has a custom weight backward or no backward"
    if schedule._n_microbatches < 2:
        return "a step has one micro-batch"
    if not stage.is_first and any(i.is_root_arg for i in stage.args_recv_info[0]):
        return "the stage takes root arguments"
    return None


def _agree(why: str | None, others: list[int], device: torch.device) -> str | None:
    """Every member of a replay set learns every member's reason not to split (None: none): the set splits only
    when no member has one, or a chain would miss a column. Returns the first reason found (None: split)."""
    if not others:
        return why
    with intercept.internal():
        pending: list = []
        for other in others:
            pending += wire.send(why, other, device)
        theirs = {other: wire.recv(other, device) for other in others}
        wire.wait(pending)
    return why or next((f"rank {other}: {reason}" for other, reason in theirs.items() if reason), None)


def _live_neighbours(pp: Pipeline) -> tuple[int | None, int | None]:
    """The ranks of the stages before and after this rank's that replay in its set (their traffic runs live;
    None: the stage's inputs or output gradients come from the logs, the script's micro-batches or the loss)."""
    stage = pp.stages[0]
    live = pp.replay["live"] if pp.replay is not None else set()
    index = stage.stage_index
    up = pp._rank_of(index - 1) if not stage.is_first and index - 1 in live else None
    down = pp._rank_of(index + 1) if not stage.is_last and index + 1 in live else None
    return up, down


def offer(pp: Pipeline, column: tuple[int, ...], assigned: dict[int, tuple[int, ...]],
          members: tuple[int, ...]) -> Leader | None:
    """On a replaying rank, right after the hand-over: offer each helper of its column its part (or nothing, when
    a member of its set cannot be split). ``assigned``: every replaying rank's column (:func:`assign_helpers`), to
    find the helpers of the neighbouring members in each chain; ``members``: the rank's replay set."""
    device = pp.group.device()
    me = pp.view.rank
    why = _unsplittable(pp)
    payload = None
    if why is None:
        stage = pp.stages[0]
        try:
            payload = to_bytes({"module": stage.submod, "loss_fn": pp.schedule._loss_fn if stage.is_last else None})
        except Exception as exc:  # noqa: BLE001 - whatever does not pickle: replay alone
            why = f"the stage module or loss function does not pickle ({type(exc).__name__}: {exc})"
    others = [m for m in members if m != me]
    why = _agree(why, others, device)
    setups: list[dict | None] = [None] * len(column)
    if why is None:
        stage = pp.stages[0]
        parts = ranges(pp.schedule._n_microbatches, 1 + len(column))
        chains = len(parts) - 1  # the same on every member: one schedule, one micro-batch count
        up, down = _live_neighbours(pp)
        fold = [me, *column[:chains]]
        for c in range(chains):
            setups[c] = {"payload": payload, "chain": fold, "index": stage.stage_index, "first": stage.is_first,
                         "last": stage.is_last, "seed": pp.seed,
                         # this chain's helpers of the neighbouring members: activations and gradients run live
                         "up": assigned[up][c] if up is not None else None,
                         "down": assigned[down][c] if down is not None else None}
    pending = []
    with intercept.internal():
        for helper, setup in zip(column, setups):
            pending += wire.send(setup, helper, device)
        wire.wait(pending)
    if why is not None:
        log.info("rank %d replays its stage%s without helpers: %s", me, " with its set" if others else "", why)
        return None
    log.info("rank %d replays its stage with helpers %s (micro-batch ranges %s%s)", me, fold[1:], parts,
             f"; chains run the stages of ranks {sorted(members)}" if others else "")
    return Leader(pp, fold, parts, others)


class Leader:
    """A replaying rank's schedule, split across its helpers for the replay. In a set of several ranks every
    member leads its own column; the members run the first range among themselves, live."""

    def __init__(self, pp: Pipeline, chain: list[int], parts: list[tuple[int, int]], others: list[int]) -> None:
        self.pp, self.chain, self.parts, self.others = pp, chain, parts, others
        self.schedule, self.stage = pp.schedule, pp.stages[0]
        self.device = pp.group.device()
        self.schedule._step_microbatches = self._step_microbatches  # this instance, for the replay only
        self.checked = False  # the first micro-batch's forward was checked for side effects
        self.sends: list = []  # live sends to the set's other members, waited at the step's end
        # whether the stage's inputs / output gradients come live from a member of the set (else: logs, the
        # script's micro-batches or the loss)
        up, down = _live_neighbours(pp)
        self.live_in, self.live_out = up is not None, down is not None

    @property
    def helpers(self) -> list[int]:
        return self.chain[1:]

    def detach(self) -> None:
        """Give the schedule its own ``_step_microbatches`` back (a replay interrupted: nothing is sent)."""
        self.schedule.__dict__.pop("_step_microbatches", None)

    def close(self) -> None:
        """The replay is over: release the helpers, restore the schedule."""
        self.detach()
        with intercept.internal():
            pending = []
            for helper in self.helpers:
                pending += wire.send(None, helper, self.device)
            wire.wait(pending)

    def _work(self, lo: int, hi: int, arg_mbs: list, kwarg_mbs: list, target_mbs: list | None,
              loss_kwargs: dict | None) -> dict:
        """Everything a helper needs for micro-batches ``lo..hi-1`` of this step that only this rank can give:
        inputs (the script's on the first stage, else served from the neighbours' logs into the stage's buffers,
        as in a replay alone), output gradients from the logs or targets; what crosses a boundary inside the
        replay set flows between the chain's helpers instead."""
        stage = self.stage
        mbs: dict[int, dict] = {}
        for i in range(lo, hi):
            entry: dict[str, Any] = {"kwargs": wire.cpu(kwarg_mbs[i] or {})}
            if stage.is_first:
                entry["args"] = wire.cpu(tuple(arg_mbs[i]))
                entry["requires_grad"] = None
            elif not self.live_in:
                stage.get_fwd_recv_ops(i)  # served from the logs: no operation
                acts = stage._retrieve_recv_activations(i)
                entry["args"] = wire.cpu(tuple(acts))
                entry["requires_grad"] = [bool(a.requires_grad) for a in acts]
            if stage.is_last:
                entry["target"] = wire.cpu(target_mbs[i]) if target_mbs is not None else None
            elif not self.live_out:
                stage.get_bwd_recv_ops(i)
                entry["grads"] = wire.cpu(tuple(stage._retrieve_recv_grads(i)))
            mbs[i] = entry
        # the module itself, not only its state dict: what the script changed on it since (a step counter a
        # forward reads) must be what the helper's copy sees
        return {"step": self.pp.view.step, "module": to_bytes(self.stage.submod), "mbs": mbs,
                "loss_kwargs": loss_kwargs}

    def _issue(self, ops: list, wait: bool) -> None:
        """Run the live operations a factory returned (traffic with the set's other members; none when this rank
        replays alone): receives are waited for now, sends at the step's end."""
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        if wait:
            for work in works:
                work.wait()
        else:
            self.sends += works

    def _forward(self, i: int, arg_mbs: list, kwarg_mbs: list, target_mbs: list | None, loss_kwargs: dict | None,
                 return_outputs: bool) -> None:
        schedule, stage = self.schedule, self.stage
        self._issue(stage.get_fwd_recv_ops(i), wait=True)
        output = stage.forward_one_chunk(i, arg_mbs[i], kwarg_mbs[i], save_forward_output=return_outputs)
        schedule._maybe_compute_loss(stage, output, target_mbs, i, loss_kwargs)
        self._issue(stage.get_fwd_send_ops(i), wait=False)

    def _backward(self, i: int) -> None:
        stage = self.stage
        self._issue(stage.get_bwd_recv_ops(i), wait=True)
        stage.backward_one_chunk(i, loss=self.schedule._maybe_get_loss(stage, i), last_backward=False)
        self._issue(stage.get_bwd_send_ops(i), wait=False)

    def _end_sends(self) -> None:
        sends, self.sends = self.sends, []
        for work in sends:
            work.wait()

    def _first_forward_is_pure(self, arg_mbs: list, kwarg_mbs: list, target_mbs: list | None,
                               loss_kwargs: dict | None, return_outputs: bool) -> bool:
        """Run micro-batch 0's forward; False (helpers released, the replay goes on alone) when it changed the
        module's side state (a helper would start its range from the wrong one) on this rank or on another member
        of its set (they agree: a chain needs every column)."""
        self.checked = True
        before = side_state(self.stage.submod)
        self._forward(0, arg_mbs, kwarg_mbs, target_mbs, loss_kwargs, return_outputs)
        changed = changed_by(before, side_state(self.stage.submod))
        mine = f"its forward changes {', '.join(changed[:4])}" if changed else None
        why = _agree(mine, self.others, self.device)
        if why is None:
            return True
        log.info("rank %d replays its stage without helpers: %s (a helper would not see the change made by the "
                 "micro-batches before its range)", self.pp.view.rank, why)
        self.close()
        self.pp.parallel = None
        return False

    def _step_microbatches(self, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
                           target_mbs: list | None = None, losses: list | None = None, return_outputs: bool = True,
                           loss_kwargs: dict | None = None) -> None:
        """One replayed step in GPipe order, the same on every member of the set (forwards, then backwards, in
        micro-batch order: gradients accumulate in micro-batch order as in every schedule, and live traffic
        between members cannot deadlock)."""
        schedule, stage = self.schedule, self.stage
        arg_mbs, kwarg_mbs = schedule._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        lo, hi = self.parts[0]
        done = lo
        if not self.checked:
            done = lo + 1
            if not self._first_forward_is_pure(arg_mbs, kwarg_mbs, target_mbs, loss_kwargs, return_outputs):
                # this step alone; later steps run the schedule's own code again
                n = schedule._n_microbatches
                for i in range(done, n):
                    self._forward(i, arg_mbs, kwarg_mbs, target_mbs, loss_kwargs, return_outputs)
                for i in range(n):
                    self._backward(i)
                self._end_sends()
                schedule._update_losses(stage, losses)
                stage.perform_reduce_grad(n if schedule.scale_grads else 1)
                return
        with intercept.internal():
            pending = []
            for helper, (h_lo, h_hi) in zip(self.helpers, self.parts[1:]):
                pending += wire.send(self._work(h_lo, h_hi, arg_mbs, kwarg_mbs, target_mbs, loss_kwargs), helper,
                                 self.device)
        for i in range(done, hi):  # this rank's range (with the set's other members, live)
            self._forward(i, arg_mbs, kwarg_mbs, target_mbs, loss_kwargs, return_outputs)
        for i in range(lo, hi):
            self._backward(i)
        self._end_sends()
        params = list(stage.submod.parameters())
        with intercept.internal():
            wire.wait(pending)
            wire.wait(wire.send({"grads": [p.grad for p in params], "losses": [], "outputs": []}, self.helpers[0],
                        self.device))
            total = wire.recv(self.helpers[-1], self.device)
        for p, g in zip(params, total["grads"]):
            p.grad = None if g is None else g.to(p.device)
        if stage.is_last:
            schedule._internal_losses.extend(wire.to(total["losses"], self.device))
            if return_outputs:
                stage.output_chunks.extend(wire.to(total["outputs"], self.device))
        schedule._update_losses(stage, losses)
        stage.perform_reduce_grad(schedule._n_microbatches if schedule.scale_grads else 1)


# ---------------------------------------------------------------------- a helper's side


def receive_offer(leader: int, device: torch.device) -> dict | None:
    with intercept.internal():
        return wire.recv(leader, device)


def help_replay(rank: int, setup: dict, device: torch.device) -> int:
    """Compute this rank's range of every replayed step and fold it into the chain, until the replacement says the
    replay is over. Returns the number of steps helped.

    In a chain (the replay set has several members) the stage's inputs come live from the chain's helper of the
    member before (``up``) and its output gradients from the one after (``down``); the rest from the member this
    rank helps. GPipe order, as the members run: every forward, then every backward, in micro-batch order."""
    from torch.distributed.pipelining._utils import flatten_args
    from torch.distributed.pipelining.stage import _normalize_model_output_as_tuple

    from swiftrun.runtime.pp.pipeline import _generators, _mix

    shipped = torch.load(io.BytesIO(setup["payload"].numpy().tobytes()), weights_only=False, map_location=device)
    loss_fn = shipped["loss_fn"]
    chain = setup["chain"]
    me = chain.index(rank)
    prev, nxt = chain[me - 1], chain[(me + 1) % len(chain)]
    index, first, seed = setup["index"], setup["first"], setup["seed"]
    up, down = setup.get("up"), setup.get("down")
    generators = _generators(device)
    steps = 0
    with intercept.internal(), torch.enable_grad():
        while True:
            work = wire.recv(chain[0], device)
            if work is None:
                return steps
            faults.fire("help", work["step"])
            started = time.perf_counter()
            module = torch.load(io.BytesIO(work["module"].cpu().numpy().tobytes()), weights_only=False,
                                map_location=device)
            bwd = _HelperStep(list(module.parameters()), work, setup, loss_fn, device)
            graphs = []  # in a chain: every forward first, then every backward (GPipe order, as the members)
            for i in sorted(work["mbs"]):
                entry = wire.to(work["mbs"][i], device)
                if up is not None:
                    sent = wire.recv(up, device)
                    args = tuple(a.requires_grad_(rg) for a, rg in zip(sent["acts"], sent["requires_grad"]))
                elif first:
                    args = tuple(entry["args"])
                else:
                    args = tuple(a.requires_grad_(rg) for a, rg in zip(entry["args"], entry["requires_grad"]))
                kwargs = entry["kwargs"] or {}
                with seeded(generators, _mix(seed, work["step"], index, i)):
                    output = module(*args, **kwargs)
                if down is not None:
                    outs = _normalize_model_output_as_tuple(output)
                    bwd.pending += wire.send({"acts": outs, "requires_grad": [bool(o.requires_grad) for o in outs]},
                                             down, device)
                graph = (entry, args, output, flatten_args(args) + flatten_args(kwargs))
                if up is None and down is None:
                    bwd.backward(*graph)  # alone in its chain: one micro-batch's graph alive at a time
                else:
                    graphs.append(graph)
            for graph in graphs:
                bwd.backward(*graph)
            for p in bwd.params:
                p.grad = None
            partial = wire.recv(prev, device)
            grads = fold(wire.to(partial["grads"], device), bwd.per_mb)
            message = {"grads": wire.cpu(grads), "losses": partial["losses"] + bwd.losses,
                       "outputs": partial["outputs"] + bwd.outputs}
            wire.wait(bwd.pending)
            wire.wait(wire.send(message, nxt, device))
            steps += 1
            log.debug("helped step %d (micro-batches %s) in %.3fs", work["step"], sorted(work["mbs"]),
                      time.perf_counter() - started)


class _HelperStep:
    """A helper's backward passes of one replayed step: each micro-batch's from ``.grad = None`` (its parameter
    gradients kept apart for the fold), the gradients of its inputs sent to the chain's helper before."""

    def __init__(self, params: list, work: dict, setup: dict, loss_fn: Any, device: torch.device) -> None:
        self.params, self.work, self.loss_fn, self.device = params, work, loss_fn, device
        self.last, self.up, self.down = setup["last"], setup.get("up"), setup.get("down")
        self.pending: list = []  # sends to wait for before the step's fold goes on
        self.per_mb: list[list[torch.Tensor | None]] = []
        self.losses: list[torch.Tensor] = []
        self.outputs: list = []

    def backward(self, entry: dict, args: tuple, output: Any, inputs: list) -> None:
        from torch.distributed.pipelining._backward import stage_backward
        from torch.distributed.pipelining._utils import flatten_args
        from torch.distributed.pipelining.stage import _normalize_model_output_as_tuple

        for p in self.params:
            p.grad = None
        if self.last:
            loss = self.loss_fn(output, entry["target"], **(self.work["loss_kwargs"] or {}))
            grads_in = stage_backward(loss, None, inputs)
            self.losses.append(loss.detach().cpu())
            self.outputs.append(wire.cpu(output))
        else:
            grads = (wire.to(wire.recv(self.down, self.device)["grads"], self.device) if self.down is not None
                     else entry["grads"])
            grads_in = stage_backward(_normalize_model_output_as_tuple(output), grads, inputs)
        if self.up is not None:  # the gradients of the inputs the helper before sent (not of the kwargs)
            self.pending += wire.send({"grads": list(grads_in)[:len(flatten_args(args))]}, self.up, self.device)
        self.per_mb.append([p.grad for p in self.params])
