"""Selective logging at run time: measure the pipeline, choose the logging groups under ``--log-budget``, apply.

Until the first checkpoint after step 0 every boundary is logged while each rank measures what the planner
needs (swiftrun/pipeline/planner.py): its stages' compute time per step (forward and backward chunks) and the
bytes it sends across each boundary per step. At that checkpoint every rank gathers every rank's profile and
runs the same exact planner on the same numbers (averaged over the pipelines of a DP x PP job), so all ranks hold
the same plan without a broadcast. From then on the boundaries inside a group are not logged; a rank whose group
has other members keeps its own checkpoint copy (a failure in its group rolls it back too). Rank 0 reports the
plan to the launcher (printed, and a ``log_plan`` record in the event log).

Interleaved schedules (several stages per rank) keep logging every boundary: their ranks are not a chain.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from swiftrun.protocol import EventKind

if TYPE_CHECKING:
    from swiftrun.runtime.pipeline import Pipeline

log = logging.getLogger("swiftrun.runtime")


def budget() -> int | None:
    text = os.environ.get("SWIFTRUN_LOG_BUDGET", "")
    return int(text) if text.strip() else None


def profile(pp: Pipeline) -> dict[str, Any]:
    """This rank's measurements: position in its pipeline, compute seconds per step, bytes sent each way."""
    pipe = pp.pipe_ranks()
    steps = pp.compute_steps[1:] or pp.compute_steps  # the first step pays one-off costs
    down = sum(b for (frm, to), b in pp.volume.items() if to == frm + 1)
    up = sum(b for (frm, to), b in pp.volume.items() if to == frm - 1)
    return {"position": pipe.index(pp.rec.rank), "stages": len(pipe), "interleaved": len(pp.stages) > 1,
            "compute": sum(steps) / len(steps) if steps else 0.0, "down": down, "up": up}


def decide(pp: Pipeline, step: int) -> None:
    """Gather every rank's profile, choose the plan, apply it (every rank, at the same checkpoint step)."""
    from swiftrun.pipeline.planner import PlanInput, choose_plan, format_size

    rows: list[Any] = [None] * pp.rec.world_size
    dist.all_gather_object(rows, profile(pp))
    if any(r["interleaved"] for r in rows):
        pp.groups = tuple((p,) for p in range(rows[0]["stages"]))
        _report(pp, step, "interleaved stages: every boundary stays logged", None)
        return
    n = rows[0]["stages"]
    compute = [0.0] * n
    down, up, count = [0] * n, [0] * n, [0] * n
    for r in rows:
        p = r["position"]
        compute[p] += r["compute"]
        down[p] += r["down"]
        up[p] += r["up"]
        count[p] += 1
    compute = [c / max(k, 1) for c, k in zip(compute, count)]
    sizes = [(down[b] + up[b + 1]) // max(count[b], 1) for b in range(n - 1)]
    plan_input = PlanInput.from_lists(compute, sizes, pp.every)
    limit = budget()
    assert limit is not None
    plan = choose_plan(plan_input, limit)
    pp.groups = tuple(tuple(range(first, last + 1)) for first, last in plan.groups)
    pp.logged = set(plan.logged_boundaries)
    position = pp.pipe_ranks().index(pp.rec.rank)
    pp.keep_own = any(position in g and len(g) > 1 for g in pp.groups)
    groups = " ".join("[" + ",".join(map(str, g)) + "]" for g in pp.groups)
    text = (f"selective logging under {format_size(limit)}: groups {groups}; logs {format_size(plan.peak_log_bytes)} "
            f"per checkpoint interval; expected replay {plan.expected_recovery_seconds:.3g}s, worst "
            f"{plan.worst_recovery_seconds:.3g}s")
    if plan.logs_nothing:
        text += " (nothing logged: any failure replays every stage from its checkpoint)"
    _report(pp, step, text, {"groups": [list(g) for g in pp.groups], "logged": sorted(pp.logged),
                             "peak_log_bytes": plan.peak_log_bytes, "budget": limit,
                             "expected_recovery_s": plan.expected_recovery_seconds,
                             "worst_recovery_s": plan.worst_recovery_seconds,
                             "compute_s": compute, "boundary_bytes": sizes, "ckpt_every": pp.every})


def _report(pp: Pipeline, step: int, text: str, data: dict | None) -> None:
    log.info("step %d: %s", step, text)
    if pp.rec.rank == 0:
        pp.rec.link.send_event(EventKind.LOG_PLAN, gen=pp.rec.generation, message=text, step=step, **(data or {}))
