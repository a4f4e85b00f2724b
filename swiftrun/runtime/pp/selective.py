"""Selective logging at run time: measure the pipeline, choose the logging groups under ``--log-budget``, apply.

Until the first checkpoint after step 0 every boundary is logged while each rank measures what the planner
needs (swiftrun/logplan/planner.py): its stages' compute time per step (forward and backward chunks) and the
bytes it sends across each boundary per step. At that checkpoint every rank gathers every rank's profile and
runs the same exact planner on the same numbers (averaged over the pipelines of a DP x PP job), so all ranks hold
the same plan without a broadcast (:func:`decide` is pure; ``Pipeline`` gathers the rows and adopts the
result). From then on the boundaries inside a group are not logged; a rank whose group has other members
keeps its own checkpoint copy (a failure in its group rolls it back too). Rank 0 reports the plan to the launcher (printed, and a ``log_plan`` record in the event log).

Interleaved (looped) schedules, several virtual stages per rank, are planned over pipeline positions: a rank's
virtual stages fail together, so groups are still groups of positions, which here form a ring (the wrap boundary
from the last position's stage of one round to the first position's stage of the next). swiftrun/logplan/looped.py
builds the position-level input from the virtual boundaries' bytes and maps the plan back to the virtual
boundaries ``Pipeline.logged`` holds (``min(from, to)`` of a send, a virtual stage index).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from swiftrun.runtime.worker.env import settings


def budget() -> int | None:
    """--log-budget in bytes; None: every boundary is logged (no selective logging)."""
    return settings().log_budget


def profile(position: int, positions: int, stages: tuple[int, ...], num_stages: int, compute_steps: list[float],
            volume: dict[tuple[int, int], int]) -> dict[str, Any]:
    """One rank's measurements: its position in its pipeline, its (virtual) stages, compute seconds per step, and
    the bytes it sent across each boundary in the last full step (boundary ``min(from, to)``, both directions)."""
    steps = compute_steps[1:] or compute_steps  # the first step pays one-off costs
    sent: dict[int, int] = {}
    for (frm, to), nbytes in volume.items():
        sent[min(frm, to)] = sent.get(min(frm, to), 0) + nbytes
    return {"position": position, "positions": positions, "stages": list(stages), "num_stages": num_stages,
            "compute": sum(steps) / len(steps) if steps else 0.0, "sent": sent}


def plan_input(rows: list[dict[str, Any]], ckpt_every: int) -> tuple[Any, list[int]]:
    """The planner's input over positions from every rank's profile, and the position of each virtual stage.

    Pure (the unit tests call it). The ranks of one position in a DP x PP job are replicas: their compute and
    bytes are averaged. Raises ``PlanError`` for a placement the position-level plan cannot describe."""
    from swiftrun.logplan.looped import position_input

    positions, num_stages = rows[0]["positions"], rows[0]["num_stages"]
    owner = [-1] * num_stages
    compute = [0.0] * positions
    sent: dict[int, int] = {}
    count = [0] * positions
    for r in rows:
        p = r["position"]
        compute[p] += r["compute"]
        count[p] += 1
        for stage in r["stages"]:
            owner[stage] = p
        for boundary, nbytes in r["sent"].items():
            sent[int(boundary)] = sent.get(int(boundary), 0) + nbytes
    compute = [c / max(k, 1) for c, k in zip(compute, count)]
    replicas = max(min(count), 1)
    sizes = {b: n // replicas for b, n in sent.items()}
    return position_input(owner, compute, sizes, ckpt_every), owner


@dataclass(frozen=True)
class Decision:
    """The logging plan every rank adopts: the logging groups (pipeline positions), the virtual boundaries still
    logged (None: all), and what to tell the user (``data``: the ``log_plan`` event's fields)."""

    groups: tuple[tuple[int, ...], ...]
    logged: set[int] | None
    message: str
    data: dict[str, Any] = field(default_factory=dict)


def decide(rows: list[dict[str, Any]], every: int, limit: int) -> Decision:
    """Choose the logging plan from every rank's profile (pure: every rank decides the same from the same rows)."""
    from swiftrun.logplan.looped import logged_virtual_boundaries
    from swiftrun.logplan.planner import PlanError, choose_plan, format_size

    try:
        plan_in, owner = plan_input(rows, every)
    except PlanError as error:
        return Decision(tuple((p,) for p in range(rows[0]["positions"])), None,
                        f"every boundary stays logged: {error}")
    plan = choose_plan(plan_in, limit)
    groups = tuple(tuple(g) for g in plan.members)
    logged = logged_virtual_boundaries(plan, owner)
    listed = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups)
    ranks = plan_in.num_stages
    where = f" of ranks (interleaved: {len(owner)} stages on {ranks})" if len(owner) > ranks else ""
    text = (f"selective logging under {format_size(limit)}: groups {listed}{where}; logs "
            f"{format_size(plan.peak_log_bytes)} per checkpoint interval; expected replay "
            f"{plan.expected_recovery_seconds:.3g}s, worst {plan.worst_recovery_seconds:.3g}s")
    if plan.logs_nothing:
        text += " (nothing logged: any failure replays every stage from its checkpoint)"
    return Decision(groups, set(logged), text, {
        "groups": [list(g) for g in groups], "logged": sorted(logged),
        "edges": list(plan.logged_boundaries), "virtual_stages": len(owner),
        "peak_log_bytes": plan.peak_log_bytes, "budget": limit,
        "expected_recovery_s": plan.expected_recovery_seconds,
        "worst_recovery_s": plan.worst_recovery_seconds,
        "compute_s": [s.compute_seconds for s in plan_in.stages],
        # as swiftrun plan's profile takes them (--boundary-bytes, --wrap-bytes)
        "boundary_bytes": list(plan_in.boundary_bytes), "wrap_bytes": plan_in.wrap_bytes,
        "ckpt_every": every})
