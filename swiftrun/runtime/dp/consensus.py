"""The recovery point: who is where, which state wins, who must receive it. A pure function of what ranks report.

Every rank reports a :class:`RankStatus` after the group of the new generation is built; all ranks gather the
same list and compute the same :class:`Plan`. A rank's state is described by ``updates``, the last step whose
optimizer update it applied (-1: none), and ``boundary``: whether it also finished that step's body (so its
whole state, schedulers included, is exactly "after step ``updates``"). A rank that applied the update but was
stopped before the end of the step (a collective after ``optimizer.step()``) is *partial*.

Roll-forward (``auto``/``roll-forward``): the state of the most advanced rank on a step boundary is exact
("after step P" of failure-free training, because its all-reduce included every rank's gradient) and wins;
everyone else receives it and training resumes at step P+1. No undo, no gradient buffer needed. Partial ranks
are undone first only when no rank stands on a boundary at all.

Undo (``undo``, the paper's rule): P = max-1 when some rank is behind the most advanced one; ranks at max undo
their last update; the lowest-numbered surviving rank is the source and everyone not equal to it receives its
state, so replicas end bitwise equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from swiftrun.errors import RecoveryError


@dataclass(frozen=True)
class RankStatus:
    rank: int
    valid: bool  # False: a fresh replacement, or a rank whose state was partly overwritten
    updates: int = -1
    boundary: bool = True
    undoable: bool = False  # the last update can be inverted (records intact, optimizer invertible)
    # the failure reached this rank outside a step's body (evaluation, a checkpoint barrier after the guard):
    # what that code does next may depend on a skipped collective, so the state is verified at the next step
    outside_step: bool = False
    # rank 0's buffers that DDP broadcasts at each forward (runtime/dp/buffers.py): whether this rank holds them as
    # of the start of step updates + 1 (what resuming after ``updates`` needs) and of step ``updates`` (what an
    # undo of ``updates`` needs); True when the job has no such buffers
    buffers_next: bool = True
    buffers_undo: bool = True

    def pack(self) -> list[int]:
        return [self.rank, int(self.valid), self.updates, int(self.boundary), int(self.undoable),
                int(self.outside_step), int(self.buffers_next), int(self.buffers_undo)]

    @classmethod
    def unpack(cls, row: list[int]) -> RankStatus:
        return cls(int(row[0]), bool(row[1]), int(row[2]), bool(row[3]), bool(row[4]), bool(row[5]),
                   bool(row[6]), bool(row[7]))


@dataclass(frozen=True)
class Plan:
    point: int  # the recovered state is "after step point"; training resumes at point + 1
    source: int
    targets: tuple[int, ...]  # ranks that receive the source's state
    undo: tuple[int, ...] = ()  # ranks that invert their last update before the transfer
    mode: str = "replica"  # "replica" (survivors agreed), "roll-forward", "undo"
    notes: tuple[str, ...] = field(default=())
    verify_next: bool = False  # compare every rank's whole state when the next step begins

    def as_dict(self) -> dict:
        return {"point": self.point, "source": self.source, "targets": list(self.targets), "undo": list(self.undo),
                "mode": self.mode}


def plan_recovery(statuses: list[RankStatus], mode: str) -> Plan:
    """Decide the recovery. ``mode`` is "auto", "roll-forward" or "undo" (the RecoveryMode values)."""
    valid = [s for s in statuses if s.valid]
    if not valid:
        raise RecoveryError("no surviving replica holds a consistent state (every rank is new or was overwritten)")
    plan = _plan_undo(statuses, valid) if mode == "undo" else _plan_roll_forward(statuses, valid)
    if not buffers_held(valid, plan.point + 1) and plan.point >= 0 and buffers_held(valid, plan.point):
        # rank 0 died after its update of step P and before broadcasting its buffers for P + 1 (its batch's
        # BatchNorm statistics, say): nobody can resume after P exactly, but the survivors copied rank 0's
        # buffers of P's start, so undoing P and redoing it is exact (to the undo's few ULP)
        try:
            back = _undo_to(statuses, valid, plan.point)
        except RecoveryError:
            back = None
        if back is not None and back.undo:
            note = (f"rank 0's buffers for step {plan.point + 1} were lost with it; step {plan.point} is undone "
                    "and redone, from the buffers every survivor copied at its start")
            plan = replace(back, notes=back.notes + (note,))
    return replace(plan, verify_next=any(s.outside_step for s in statuses))


def buffers_held(valid: list[RankStatus], step: int) -> bool:
    """Whether a valid rank holds rank 0's broadcast buffers as of the start of ``step``."""
    return any((s.updates + 1 == step and s.boundary and s.buffers_next) or (s.updates == step and s.buffers_undo)
               for s in valid)


def _plan_roll_forward(statuses: list[RankStatus], valid: list[RankStatus]) -> Plan:
    on_boundary = [s for s in valid if s.boundary]
    undo: tuple[int, ...] = ()
    if not on_boundary:
        # every survivor stopped between its optimizer update and the end of the step: undo is the only way back
        undoable = [s for s in valid if s.undoable]
        if not undoable:
            raise RecoveryError(
                "every surviving rank applied an optimizer update without finishing its step, and that update "
                "cannot be inverted (a non-invertible optimizer, gradients overwritten, or parameters written in place by a "
                "collective after the update)"
            )
        undo = tuple(s.rank for s in undoable)
        on_boundary = [RankStatus(s.rank, True, s.updates - 1, True, False) for s in undoable]
    point = max(s.updates for s in on_boundary)
    source = min(s.rank for s in on_boundary if s.updates == point)
    exact = {s.rank for s in valid if s.boundary and s.updates == point}
    if undo:
        exact = {source}
    targets = tuple(s.rank for s in statuses if s.rank not in exact)
    behind = any(s.valid and (s.updates, s.boundary) != (point, True) for s in statuses if s.rank not in undo)
    kind = "undo" if undo else ("roll-forward" if behind else "replica")
    return Plan(point, source, targets, undo, kind)


def _plan_undo(statuses: list[RankStatus], valid: list[RankStatus]) -> Plan:
    top = max(s.updates for s in valid)
    lagging = any(s.updates < top or not s.boundary for s in valid)
    if not lagging:
        source = min(s.rank for s in valid)
        return Plan(top, source, tuple(s.rank for s in statuses if not s.valid), (), "replica")
    return _undo_to(statuses, valid, top)


def _undo_to(statuses: list[RankStatus], valid: list[RankStatus], top: int) -> Plan:
    """Back to ``top - 1``: the ranks at ``top`` undo their update where they can; the others receive."""
    point = top - 1
    undo = tuple(s.rank for s in valid if s.updates == top and s.undoable)
    stuck = [s.rank for s in valid if s.updates == top and not s.undoable]
    at_point = [s for s in valid if s.rank in undo or (s.updates == point and s.boundary)]
    if not at_point:
        raise RecoveryError(f"no rank can reach step {point}: the ranks at step {top} cannot undo their update")
    source = min(s.rank for s in at_point)
    # replicas must end bitwise equal: whoever is not in the source's group (undone or not) receives its state
    source_undid = source in undo
    same = {s.rank for s in at_point if (s.rank in undo) == source_undid}
    targets = tuple(s.rank for s in statuses if s.rank not in same)
    notes = tuple(f"rank {r} cannot undo its update; it receives the state instead" for r in stuck)
    return Plan(point, source, targets, undo, "undo", notes)
