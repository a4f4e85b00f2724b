"""Selective logging's planner: which pipeline boundaries to log under a storage budget.

Pure: profiles in, a :class:`LoggingPlan` out; no I/O, no torch.

Background
==========

In a pipeline of ``S`` stages, boundary ``b`` (``0 <= b < S-1``) lies between stage ``b`` and stage ``b+1``. When a
boundary is *logged*, its sender keeps every tensor that crosses it (activations downstream, activation gradients
upstream) until the next checkpoint, so a lost stage can be rebuilt by replaying it alone from its last checkpoint
with its inputs read from the logs. Boundaries that are not logged merge their two sides into one *logging
group*: a failure of any stage in a group makes the whole group reload its checkpoints and replay. Choosing the
logged boundaries therefore trades log volume against recovery time; this module makes that choice exactly.

Cost model
==========

Notation: ``t_s`` the forward+backward compute seconds of stage ``s`` per iteration, ``m_b`` the bytes crossing
boundary ``b`` per iteration (both directions), ``K`` the checkpoint interval in iterations, ``w_s`` the failure
weight of stage ``s`` (``p_s = w_s / sum(w)``, uniform by default), ``f`` the replay speed-up (1: the group
replays alone; with parallel recovery, about the number of replicas of the failed group that idle survivors run).

*Log volume.* Logs are garbage-collected at each checkpoint, so the most held at once is one interval's worth::

    peak_log_bytes = K * sum(m_b for b logged)

*When a failure lands.* A failure hits a uniformly random iteration of a checkpoint interval, so the failed group
rolls back ``U`` iterations with ``U`` uniform on ``[0, K]``: ``K/2`` iterations on average, ``K`` at worst (a
failure just before the next checkpoint is written).

*How long a group replays.* A group ``G`` replays every one of its stages for every rolled-back iteration. One
micro-batch crosses the group's stages one after the other, so with one micro-batch, or when the group replays on
one device, an iteration of replay takes the sum of its stages' times; this is the model by default (``M = 1``)
and the one Swift's prototype uses (``r_merge = r_i + r_{i+1}``). When the group's stages replay on their own
devices and pipeline ``M`` micro-batches, an iteration takes about the first micro-batch's trip through the group
plus ``M - 1`` micro-batches at the slowest stage's pace, hence the general form::

    R(G) = (sum(t_s for s in G) + (M - 1) * max(t_s for s in G)) / M / f          (seconds per iteration)

With ``M = 1`` it is the plain sum: an upper bound on a pipelined replay (which takes between the max and the
sum), so the planner errs towards smaller groups, i.e. faster recovery, never towards a slower one than it
reports.

*Expected and worst recovery.* A failure hits group ``G`` with probability ``P(G) = sum(p_s for s in G)`` (one
failure at a time), so::

    expected_recovery = sum over groups G of  P(G) * (K / 2) * R(G)
    worst_recovery    = max over groups G of  K * R(G)

Both count the replay only. Detection, respawn and checkpoint loading cost the same whatever the plan, and the
neighbours' undo and the live redo of the interrupted iteration last one iteration whatever the plan, so they
are left out: they shift every plan's time equally and never change the choice.

Splitting a group ``G = A + B`` at a logged boundary lowers the expected time by ``K/2 * (P(A) (R(G) - R(A)) +
P(B) (R(G) - R(B)))``, which is positive whenever stages have positive times and weights: with an unlimited budget
every boundary is logged. At the other end, logging nothing leaves one group of all stages: any failure makes
every stage reload its checkpoint and replay up to ``K`` iterations, which is the rollback of a global checkpoint
restart (only the surviving processes are spared a restart); :attr:`LoggingPlan.logs_nothing` flags it.

Choice
======

Both the objective (a sum over groups) and the constraint (a sum over logged boundaries) are additive over the
groups of a partition of ``0..S-1`` into runs of consecutive stages, so the exact optimum comes from a dynamic
program over prefixes: ``F[j]``, the Pareto frontier of (log bytes, expected seconds) over partitions of stages
``0..j-1``, is the frontier of ``F[i] + (m_{i-1}, cost of group i..j-1)`` over ``i < j``. Dominated points never
extend into an optimum (extending two partial plans by the same group adds the same bytes and seconds), so they
are dropped at every prefix, as are points over the budget. ``F[S]`` is the whole trade-off curve; the budget's
plan is its cheapest point within the budget. Ties go to fewer bytes, then to the smaller worst case.

Complexity: ``O(S^2 * F log(S F))`` time for a frontier of ``F`` points; ``F <= S`` when boundaries all carry
the same bytes (the usual transformer pipeline), and at most the number of distinct byte totals within the budget
in general. Swift's own greedy (merge the boundary with the least added time per byte saved) is a knapsack-style
heuristic and can miss the optimum; the tests show instances where it does.

Rings
=====

An interleaved (looped) schedule runs virtual stages ``r, r+P, ...`` on rank ``r``; its ranks fail whole, so the
planner's "stages" are then the ``P`` ranks, and they form a ring: boundary ``P-1`` (the *wrap*,
``PlanInput.wrap_bytes``) joins the last rank back to the first (swiftrun/logplan/looped.py builds such inputs).
Groups are arcs of the ring and may wrap around (``(3, 0)``). A plan logs no boundary or at least two (one cut
leaves the ring connected). Every plan whose smallest logged boundary is ``r`` is a plan of the chain obtained by
opening the ring at ``r`` whose last group keeps stages ``0..r`` together, with ``r``'s bytes added, so the best of
the ``S`` restricted chain searches (one per opening edge) and the no-cut plan is exact (``_ring_plans``). Rotations sum group costs in different orders, so ring plans are evaluated with
an exactly rounded sum; ties may differ in the last bit.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

import numpy as np

from swiftrun.errors import ConfigError

# Peak bytes are int64 inside the search; this leaves room for sums without overflow.
_MAX_TOTAL_BYTES = 2**62


class PlanError(ConfigError, ValueError):
    """A planner input is invalid: a negative or unparsable budget, a malformed profile. Exit status 2 at the CLI."""


# ---------------------------------------------------------------------------------------------------------------
# Inputs and outputs
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageProfile:
    """What one stage costs per training iteration.

    ``compute_seconds``: forward plus backward compute of the stage for one iteration (all its micro-batches).
    ``boundary_bytes``: bytes crossing the boundary to the next stage per iteration, both directions: the
    activations this stage sends downstream plus the gradients the next stage sends back. The last stage has no
    next stage; its ``boundary_bytes`` must be 0.
    """

    compute_seconds: float
    boundary_bytes: int = 0

    def __post_init__(self) -> None:
        # Measurements may arrive as numpy scalars: store plain floats and ints.
        if not _finite_non_negative(self.compute_seconds):
            raise PlanError(f"compute_seconds must be a finite number >= 0, not {self.compute_seconds!r}")
        object.__setattr__(self, "compute_seconds", float(self.compute_seconds))
        if not _whole(self.boundary_bytes):
            raise PlanError(f"boundary_bytes must be a whole number of bytes, not {self.boundary_bytes!r}")
        object.__setattr__(self, "boundary_bytes", int(self.boundary_bytes))
        if self.boundary_bytes < 0:
            raise PlanError(f"boundary_bytes must be >= 0, not {self.boundary_bytes}")


@dataclass(frozen=True)
class PlanInput:
    """Everything the planner needs.

    ``stages``: one :class:`StageProfile` per pipeline stage, in pipeline order.
    ``ckpt_every``: the checkpoint interval K, in iterations (logs are dropped at each checkpoint).
    ``failure_weights``: relative failure likelihood of each stage (any non-negative numbers with a positive sum);
        ``None``: uniform.
    ``replay_speedup``: how much faster a group replays than it trains per stage (>= 1): 1 without parallel
        recovery; with it, about the number of copies of the failed group that idle survivors run (capped by the
        micro-batches each copy gets).
    ``micro_batches``: micro-batches per iteration used by the replay model; 1 (the default) models a group's
        replay as the sum of its stages' times (conservative), more models a pipelined replay (module docstring).
    ``restart_seconds``: expected recovery time of a global checkpoint restart, for comparison only (reported,
        never used in the choice); ``None``: unknown.
    ``wrap_bytes``: ``None`` for a chain (one stage per rank); a number of bytes makes the stages a *ring*: an
        interleaved (looped) schedule's pipeline positions, where the wrap boundary from the last position back
        to the first carries ``wrap_bytes`` per iteration and a logging group may wrap around (the module
        docstring, "Rings"; swiftrun/logplan/looped.py builds such inputs from virtual stages).
    """

    stages: tuple[StageProfile, ...]
    ckpt_every: int
    failure_weights: tuple[float, ...] | None = None
    replay_speedup: float = 1.0
    micro_batches: int = 1
    restart_seconds: float | None = None
    wrap_bytes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.stages:
            raise PlanError("a pipeline needs at least one stage")
        for stage in self.stages:
            if not isinstance(stage, StageProfile):
                raise PlanError(f"stages must be StageProfile objects, not {type(stage).__name__}")
        if self.stages[-1].boundary_bytes != 0:
            raise PlanError(
                f"the last stage (stage {len(self.stages) - 1}) has no next stage; its boundary_bytes must be 0, "
                f"not {self.stages[-1].boundary_bytes}"
            )
        if not _whole(self.ckpt_every) or self.ckpt_every < 1:
            raise PlanError(
                f"the checkpoint interval must be a whole number of iterations >= 1, not {self.ckpt_every!r}"
            )
        object.__setattr__(self, "ckpt_every", int(self.ckpt_every))
        if self.failure_weights is not None:
            weights = tuple(self.failure_weights)
            if len(weights) != len(self.stages):
                raise PlanError(f"{len(weights)} failure weights for {len(self.stages)} stages")
            if not all(_finite_non_negative(w) for w in weights):
                raise PlanError(f"failure weights must be finite numbers >= 0, not {list(weights)}")
            object.__setattr__(self, "failure_weights", tuple(float(w) for w in weights))
            if sum(weights) <= 0:
                raise PlanError("failure weights must not all be 0")
        if not (_finite(self.replay_speedup) and self.replay_speedup >= 1):
            raise PlanError(f"the replay speed-up must be a number >= 1, not {self.replay_speedup!r}")
        object.__setattr__(self, "replay_speedup", float(self.replay_speedup))
        if not _whole(self.micro_batches) or self.micro_batches < 1:
            raise PlanError(f"micro_batches must be a whole number >= 1, not {self.micro_batches!r}")
        object.__setattr__(self, "micro_batches", int(self.micro_batches))
        if self.restart_seconds is not None:
            if not _finite_non_negative(self.restart_seconds):
                raise PlanError(f"restart_seconds must be a finite number >= 0, not {self.restart_seconds!r}")
            object.__setattr__(self, "restart_seconds", float(self.restart_seconds))
        if self.wrap_bytes is not None:
            if not _whole(self.wrap_bytes) or self.wrap_bytes < 0:
                raise PlanError(f"wrap_bytes must be a whole number of bytes >= 0, not {self.wrap_bytes!r}")
            object.__setattr__(self, "wrap_bytes", int(self.wrap_bytes))
            if len(self.stages) < 2:
                raise PlanError("a ring (wrap_bytes) needs at least 2 stages: one position has no wrap boundary")
        if sum(self.edge_bytes) * self.ckpt_every > _MAX_TOTAL_BYTES:
            raise PlanError("the log volume of every boundary over one checkpoint interval exceeds 2**62 bytes")

    @classmethod
    def from_lists(
        cls,
        compute_seconds: Sequence[float],
        boundary_bytes: Sequence[int],
        ckpt_every: int,
        **options: object,
    ) -> PlanInput:
        """``S`` compute times and ``S-1`` boundary sizes (boundary ``b``: between stage ``b`` and ``b+1``)."""
        if len(boundary_bytes) != max(len(compute_seconds) - 1, 0):
            raise PlanError(
                f"{len(compute_seconds)} stages have {max(len(compute_seconds) - 1, 0)} boundaries, "
                f"but {len(boundary_bytes)} boundary sizes were given"
            )
        sizes = [*boundary_bytes, 0]
        stages = tuple(StageProfile(t, b) for t, b in zip(compute_seconds, sizes))
        return cls(stages=stages, ckpt_every=ckpt_every, **options)  # type: ignore[arg-type]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def boundary_bytes(self) -> tuple[int, ...]:
        """Bytes per iteration of each of the ``S-1`` boundaries."""
        return tuple(stage.boundary_bytes for stage in self.stages[:-1])

    @property
    def ring(self) -> bool:
        """The stages form a ring (an interleaved schedule's positions): groups may wrap around."""
        return self.wrap_bytes is not None

    @property
    def edge_bytes(self) -> tuple[int, ...]:
        """Bytes per iteration of every boundary a plan can log: the ``S-1`` boundaries, then the wrap on a ring."""
        return self.boundary_bytes + ((self.wrap_bytes,) if self.wrap_bytes is not None else ())

    @property
    def failure_probabilities(self) -> tuple[float, ...]:
        weights = self.failure_weights or (1.0,) * len(self.stages)
        total = math.fsum(weights)
        return tuple(w / total for w in weights)


@dataclass(frozen=True)
class LoggingPlan:
    """Which boundaries are logged, and what that costs.

    ``groups``: the logging groups as inclusive ``(first_stage, last_stage)`` ranges, ordered by first stage; on a
        ring a group that wraps around has ``first > last`` (``(3, 0)``: stages 3 and 0 of 4).
    ``logged_boundaries``: the boundaries logged (boundary ``b`` lies between stage ``b`` and ``b+1``; on a ring,
        boundary ``S-1`` is the wrap, between stage ``S-1`` and stage 0), ascending.
    ``peak_log_bytes``: log volume held at the peak: one checkpoint interval of every logged boundary.
    ``expected_recovery_seconds``: expected replay time of a failure (module docstring).
    ``worst_recovery_seconds``: replay time of the slowest group failing just before a checkpoint.
    ``num_stages``: the stages planned; ``ring``: they form a ring (:attr:`PlanInput.ring`).
    """

    groups: tuple[tuple[int, int], ...]
    logged_boundaries: tuple[int, ...]
    peak_log_bytes: int
    expected_recovery_seconds: float
    worst_recovery_seconds: float
    num_stages: int
    ring: bool = False

    @property
    def logs_nothing(self) -> bool:
        """One group of every stage: any failure replays the whole pipeline from its checkpoints."""
        return not self.logged_boundaries

    @property
    def members(self) -> tuple[tuple[int, ...], ...]:
        """Each group's stages, in ring order from its first (``(3, 0)`` of 4 stages -> ``(3, 0)``)."""
        n = self.num_stages
        return tuple(tuple(s % n for s in range(first, last + 1 + (n if last < first else 0)))
                     for first, last in self.groups)


# ---------------------------------------------------------------------------------------------------------------
# The cost model
# ---------------------------------------------------------------------------------------------------------------


class _Costs:
    """The cost model's numbers for one input, computed once, so every path sums them in the same order."""

    def __init__(self, plan_input: PlanInput) -> None:
        self.input = plan_input
        self.times = [stage.compute_seconds for stage in plan_input.stages]
        self.probabilities = plan_input.failure_probabilities
        # one entry per boundary a plan can log: S-1, and the wrap on a ring
        self.boundary_peak = [b * plan_input.ckpt_every for b in plan_input.edge_bytes]

    def _span(self, values: Sequence[float], first: int, last: int) -> Sequence[float]:
        """``values`` of stages ``first..last``; wrapping around on a ring when ``first > last``."""
        return values[first : last + 1] if first <= last else [*values[first:], *values[: last + 1]]

    def replay_seconds(self, first: int, last: int) -> float:
        """Seconds to replay one iteration of stages ``first..last`` (inclusive)."""
        # fsum and max do not depend on the order: a group's cost is the same float whichever end it is read from
        times = self._span(self.times, first, last)
        total = math.fsum(times)
        m = self.input.micro_batches
        per_iteration = total if m == 1 else (total + (m - 1) * max(times)) / m
        return per_iteration / self.input.replay_speedup

    def expected_seconds(self, first: int, last: int) -> float:
        """This group's term of the expected recovery time: P(failure hits it) * K/2 iterations of its replay."""
        probability = math.fsum(self._span(self.probabilities, first, last))
        return probability * (self.input.ckpt_every / 2) * self.replay_seconds(first, last)

    def worst_seconds(self, first: int, last: int) -> float:
        return self.input.ckpt_every * self.replay_seconds(first, last)


def _groups_of(num_stages: int, logged: Sequence[int], ring: bool = False) -> tuple[tuple[int, int], ...]:
    if ring and len(logged) >= 2:  # arcs between consecutive cuts; the one across the wrap has first > last
        arcs = [((cut + 1) % num_stages, nxt) for cut, nxt in zip(logged, [*logged[1:], logged[0]])]
        return tuple(sorted(arcs))
    if ring:  # no cut, or one: a ring cut once is still connected, one group
        return ((0, num_stages - 1),)
    starts = [0, *(b + 1 for b in logged)]
    ends = [*logged, num_stages - 1]
    return tuple(zip(starts, ends))


def _make_plan(costs: _Costs, logged: Sequence[int]) -> LoggingPlan:
    plan_input = costs.input
    logged = tuple(sorted(logged))
    groups = _groups_of(plan_input.num_stages, logged, plan_input.ring)
    expected = 0.0
    if plan_input.ring:  # rotations of the search sum in different orders: the exactly rounded sum is canonical
        expected = math.fsum(costs.expected_seconds(first, last) for first, last in groups)
    for first, last in () if plan_input.ring else groups:  # left to right, the order the search accumulates in
        expected += costs.expected_seconds(first, last)
    worst = max(costs.worst_seconds(first, last) for first, last in groups)
    return LoggingPlan(
        groups=groups,
        logged_boundaries=logged,
        peak_log_bytes=sum(costs.boundary_peak[b] for b in logged),
        expected_recovery_seconds=expected,
        worst_recovery_seconds=worst,
        num_stages=plan_input.num_stages,
        ring=plan_input.ring,
    )


def evaluate(plan_input: PlanInput, logged_boundaries: Sequence[int]) -> LoggingPlan:
    """The plan that logs exactly ``logged_boundaries``, with its costs (to compare a hand-made grouping)."""
    boundaries = set(logged_boundaries)
    count = len(plan_input.edge_bytes)
    bad = sorted(b for b in boundaries if not (isinstance(b, int) and 0 <= b < count))
    if bad:
        kind = "ring" if plan_input.ring else "pipeline"
        raise PlanError(f"boundaries {bad} do not exist in a {kind} of {plan_input.num_stages} stages")
    return _make_plan(_Costs(plan_input), sorted(boundaries))


# ---------------------------------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Frontier:
    """Pareto points of one prefix, sorted by bytes (strictly rising) and expected seconds (strictly falling)."""

    peak: np.ndarray  # int64
    expected: np.ndarray  # float64
    worst: np.ndarray  # float64
    prev_start: np.ndarray  # int64: the first stage of the point's last group (-1 for the empty prefix)
    prev_index: np.ndarray  # int64: the point of frontier[prev_start] it extends


def _search(costs: _Costs, budget: int, last_start_max: int | None = None) -> list[_Frontier]:
    """Frontiers of every prefix ``0..j-1`` (index ``j``), keeping only points within ``budget``.

    ``last_start_max``: only plans whose last group starts at or before this stage (a ring opened at its smallest
    cut, ``_ring_plans``); the prefixes past it are then never extended and are left empty."""
    n = costs.input.num_stages
    empty = np.zeros(0, dtype=np.int64)
    frontiers = [
        _Frontier(
            peak=np.zeros(1, dtype=np.int64),
            expected=np.zeros(1),
            worst=np.zeros(1),
            prev_start=np.full(1, -1, dtype=np.int64),
            prev_index=np.full(1, -1, dtype=np.int64),
        )
    ]
    limit = n - 1 if last_start_max is None else last_start_max
    for end in range(1, n + 1):  # the last group is stages start..end-1
        peaks, expecteds, worsts, starts, indices = [], [], [], [], []
        if limit < end < n:
            frontiers.append(_Frontier(empty, np.zeros(0), np.zeros(0), empty, empty))
            continue
        for start in range(min(end, limit + 1)):
            base = frontiers[start]
            if base.peak.size == 0:
                continue
            added = costs.boundary_peak[start - 1] if start > 0 else 0
            peak = base.peak + added
            within = peak <= budget
            if not within.any():
                continue
            peaks.append(peak[within])
            expecteds.append(base.expected[within] + costs.expected_seconds(start, end - 1))
            worsts.append(np.maximum(base.worst[within], costs.worst_seconds(start, end - 1)))
            starts.append(np.full(int(within.sum()), start, dtype=np.int64))
            indices.append(np.flatnonzero(within).astype(np.int64))
        if not peaks:  # cannot happen (the one-group plan costs 0 bytes), but keep the shapes right
            frontiers.append(_Frontier(empty, np.zeros(0), np.zeros(0), empty, empty))
            continue
        peak = np.concatenate(peaks)
        expected = np.concatenate(expecteds)
        worst = np.concatenate(worsts)
        start_of = np.concatenate(starts)
        index_of = np.concatenate(indices)
        # Sort by bytes, then expected time, then worst case, then the last group's start (determinism only).
        order = np.lexsort((start_of, worst, expected, peak))
        peak, expected, worst, start_of, index_of = (a[order] for a in (peak, expected, worst, start_of, index_of))
        # Keep a point only if it is strictly faster than everything with fewer or equal bytes before it.
        best_before = np.minimum.accumulate(expected)
        keep = np.empty(expected.size, dtype=bool)
        keep[0] = True
        keep[1:] = expected[1:] < best_before[:-1]
        frontiers.append(_Frontier(peak[keep], expected[keep], worst[keep], start_of[keep], index_of[keep]))
    return frontiers


def _logged_of(frontiers: list[_Frontier], index: int) -> list[int]:
    """The logged boundaries of point ``index`` of the whole pipeline's frontier, by following the back pointers."""
    logged: list[int] = []
    end, point = len(frontiers) - 1, index
    while end > 0:
        frontier = frontiers[end]
        start = int(frontier.prev_start[point])
        point = int(frontier.prev_index[point])
        if start > 0:
            logged.append(start - 1)
        end = start
    return sorted(logged)


def _check_budget(budget_bytes: int | float) -> int:
    """The budget as whole bytes, capped where no plan can reach (so int64 comparisons stay exact)."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Real):
        raise PlanError(f"the log budget must be a number of bytes, not {budget_bytes!r}")
    if math.isnan(budget_bytes):
        raise PlanError("the log budget must be a number of bytes, not NaN")
    if budget_bytes < 0:
        raise PlanError(f"the log budget must be >= 0 bytes, not {budget_bytes}")
    return _MAX_TOTAL_BYTES if budget_bytes >= _MAX_TOTAL_BYTES else int(budget_bytes)


def choose_plan(plan_input: PlanInput, budget_bytes: int | float) -> LoggingPlan:
    """The plan with the least expected recovery time whose peak log volume is at most ``budget_bytes``.

    Exact (dynamic programming over Pareto frontiers, see the module docstring). Ties: fewer bytes, then the
    smaller worst case. ``budget_bytes`` is an int, or ``math.inf`` for no limit; a budget below what any boundary
    needs gives the plan that logs nothing (``plan.logs_nothing``: any failure replays the whole pipeline), which
    is always feasible. Raises :class:`PlanError` for a negative or non-numeric budget.
    """
    budget = _check_budget(budget_bytes)
    costs = _Costs(plan_input)
    if plan_input.ring:
        return min(_ring_plans(costs, budget), key=_preference)
    frontiers = _search(costs, budget)
    final = frontiers[-1]
    best = int(np.argmin(final.expected))  # the fastest within the budget (the last point: the frontier falls)
    return _make_plan(costs, _logged_of(frontiers, best))


def tradeoff_curve(plan_input: PlanInput) -> list[LoggingPlan]:
    """Every budget's optimal plan: the Pareto frontier of (peak log bytes, expected recovery seconds).

    Sorted by bytes (strictly rising); expected time strictly falls along it. The first plan is the cheapest in
    bytes (logs nothing, unless some boundary carries 0 bytes), the last the fastest (logs every boundary whose
    logging saves time). For any budget, ``choose_plan`` returns the last plan of the curve within it.
    """
    costs = _Costs(plan_input)
    if plan_input.ring:
        curve: list[LoggingPlan] = []
        for plan in sorted(_ring_plans(costs, _MAX_TOTAL_BYTES), key=lambda p: (p.peak_log_bytes, *_preference(p))):
            if not curve or plan.expected_recovery_seconds < curve[-1].expected_recovery_seconds:
                curve.append(plan)
        return curve
    frontiers = _search(costs, _MAX_TOTAL_BYTES)
    return [_make_plan(costs, _logged_of(frontiers, i)) for i in range(frontiers[-1].peak.size)]


# ---------------------------------------------------------------------------------------------------------------
# Rings (interleaved schedules)
# ---------------------------------------------------------------------------------------------------------------


def _preference(plan: LoggingPlan) -> tuple[float, int, float]:
    """What the planner minimises, in order: expected seconds, then bytes, then the worst case."""
    return (plan.expected_recovery_seconds, plan.peak_log_bytes, plan.worst_recovery_seconds)


def _ring_plans(costs: _Costs, budget: int) -> list[LoggingPlan]:
    """Candidate plans of a ring within ``budget``, among them an optimal one for every budget up to ``budget``.

    A plan of a ring logs no boundary (one group) or at least two (a single cut leaves the ring connected: it
    would pay for a log and still replay everything). Every plan whose smallest cut is boundary ``r`` is a plan of
    the *chain* obtained by opening the ring at ``r``, stages ``r+1, ..., S-1, 0, ..., r``, plus ``r``'s bytes,
    whose last group holds stages ``0..r`` whole (boundaries ``0..r-1`` are not cut); that chain's exact search
    restricted so (its frontier within ``budget - bytes of r``) holds, for each budget, a plan at least as good as
    any ring plan whose smallest cut is ``r``. Over all ``r`` plus the no-cut plan this covers every ring plan once:
    the best candidate is optimal. ``S`` chain searches of ``S - r`` free stages: ``O(S^3 F log(S F) / 6)``.
    """
    plan_input = costs.input
    n = plan_input.num_stages
    edges = plan_input.edge_bytes  # edge e joins stage e and stage (e + 1) % n; e = n - 1 is the wrap
    weights = plan_input.failure_weights
    found: dict[tuple[int, ...], LoggingPlan] = {(): _make_plan(costs, ())}
    for cut in range(n):
        left = budget - costs.boundary_peak[cut]
        if left < 0:
            continue
        order = [(cut + 1 + i) % n for i in range(n)]  # the chain: its boundary i is the ring's edge order[i]
        chain = PlanInput(
            stages=tuple(StageProfile(plan_input.stages[s].compute_seconds, edges[s] if i < n - 1 else 0)
                         for i, s in enumerate(order)),
            ckpt_every=plan_input.ckpt_every,
            failure_weights=None if weights is None else tuple(weights[s] for s in order),
            replay_speedup=plan_input.replay_speedup,
            micro_batches=plan_input.micro_batches,
        )  # fmt: skip
        frontiers = _search(_Costs(chain), left, last_start_max=n - 1 - cut)  # stages 0..cut stay together
        for point in range(frontiers[-1].peak.size):
            cuts = tuple(sorted({cut, *(order[b] for b in _logged_of(frontiers, point))}))
            if len(cuts) >= 2 and cuts not in found:
                found[cuts] = _make_plan(costs, cuts)
    return list(found.values())


# ---------------------------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------------------------

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "p": 10**15, "pb": 10**15,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
    "pi": 2**50, "pib": 2**50,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*(?P<unit>[A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """``"2GiB"`` -> 2147483648, ``"500MB"`` -> 500000000, ``"1.5G"`` -> 1500000000, ``"123"`` -> 123.

    Decimal units (k, M, G, T, P, with or without B) are powers of 1000; binary ones (Ki, Mi, Gi, Ti, Pi, with or
    without B) powers of 1024; units are case-insensitive and a bare number is bytes. A fraction of a byte is
    rounded down. Raises :class:`PlanError` for anything else, and for a negative size.
    """
    if not isinstance(text, str):
        raise PlanError(f"a size must be text such as '2GiB' or '500MB', not {text!r}")
    match = _SIZE.match(text)
    if match is None:
        raise PlanError(f"{text!r} is not a size; write a number with an optional unit, such as 2GiB, 500MB or 1.5G")
    unit = match["unit"].lower()
    if unit not in _UNITS:
        raise PlanError(
            f"{text!r}: unknown unit {match['unit']!r}; use B, kB, MB, GB, TB, PB (powers of 1000) "
            "or KiB, MiB, GiB, TiB, PiB (powers of 1024)"
        )
    try:
        number = Decimal(match["number"])
    except InvalidOperation:  # the pattern admits only plain decimals; kept for safety
        raise PlanError(f"{text!r} is not a size") from None
    if number < 0:
        raise PlanError(f"{text!r}: a size must not be negative")
    return int(number * _UNITS[unit])


def format_size(num_bytes: int) -> str:
    """Bytes in binary units with about three significant figures: ``2147483648`` -> ``2.00 GiB``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(num_bytes)} B"
    digits = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2
    return f"{value:.{digits}f} {unit}"


def _whole(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _finite(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _finite_non_negative(value: object) -> bool:
    return _finite(value) and value >= 0  # type: ignore[operator]
