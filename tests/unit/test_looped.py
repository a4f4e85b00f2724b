"""Selective logging for interleaved (looped) schedules: the ring planner against brute force, the mapping from
virtual stages to positions and back, and the runtime's profile aggregation."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from swiftrun.logplan.looped import edge_of, logged_virtual_boundaries, looped_owner, position_input
from swiftrun.logplan.planner import LoggingPlan, PlanError, PlanInput, choose_plan, evaluate, tradeoff_curve


def ring(times: list[float], sizes: list[int], wrap: int, ckpt_every: int = 1, **options: object) -> PlanInput:
    return PlanInput.from_lists(times, sizes, ckpt_every, wrap_bytes=wrap, **options)


def all_ring_plans(plan_input: PlanInput) -> list[LoggingPlan]:
    """Every subset of the S edges (the wrap included) as the logged boundaries."""
    edges = range(plan_input.num_stages)
    return [evaluate(plan_input, cuts) for size in range(plan_input.num_stages + 1)
            for cuts in itertools.combinations(edges, size)]


def random_ring(rng: random.Random, max_stages: int = 8) -> PlanInput:
    n = rng.randint(2, max_stages)
    weights = tuple(rng.choice([0.0, rng.uniform(0.1, 3)]) for _ in range(n))
    return ring([rng.uniform(0.01, 10.0) if rng.random() > 0.1 else 0.0 for _ in range(n)],
                [rng.choice([0, rng.randint(1, 8), rng.randint(1, 10**9)]) for _ in range(n - 1)],
                rng.choice([0, rng.randint(1, 8), rng.randint(1, 10**9)]),
                ckpt_every=rng.randint(1, 50),
                failure_weights=None if rng.random() < 0.5 or not any(weights) else weights,
                replay_speedup=rng.choice([1.0, 3.0]), micro_batches=rng.choice([1, 1, 4]))


def close(a: float, b: float) -> bool:
    # group costs are summed in different orders by different rotations of the search: equal up to rounding
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)


# --- the ring cost model -----------------------------------------------------------------------------------------


def test_a_group_may_wrap_around_the_ring() -> None:
    # 4 positions of 1 s, K = 2; logging edges 0 and 2 leaves [1,2] and [3,0] (the wrap inside a group)
    plan = evaluate(ring([1.0, 1.0, 1.0, 1.0], [1, 10, 1], wrap=10, ckpt_every=2), [0, 2])
    assert plan.groups == ((1, 2), (3, 0))
    assert plan.members == ((1, 2), (3, 0))
    assert plan.peak_log_bytes == 4
    assert plan.expected_recovery_seconds == pytest.approx(2 * 0.5 * 1 * 2.0)
    assert plan.worst_recovery_seconds == pytest.approx(2 * 2.0) and plan.ring and plan.num_stages == 4


def test_one_cut_leaves_the_ring_in_one_group() -> None:
    plan_input = ring([1.0, 2.0, 3.0], [5, 5], wrap=5, ckpt_every=3)
    one_cut = evaluate(plan_input, [1])
    assert one_cut.groups == ((0, 2),) and one_cut.peak_log_bytes == 15  # paid for, and nothing gained
    assert one_cut.expected_recovery_seconds == evaluate(plan_input, []).expected_recovery_seconds
    assert choose_plan(plan_input, 15).logs_nothing  # the planner never picks it
    assert all(len(p.logged_boundaries) != 1 for p in tradeoff_curve(plan_input))


def test_the_ring_beats_a_chain_that_always_logs_the_wrap() -> None:
    # The wrap is dear, the edges around it cheap: the best pair of groups wraps around ([1,2] [3,0], 2 bytes).
    # Treating the positions as a chain with the wrap always logged would need 10 bytes before any split.
    plan_input = ring([1.0, 1.0, 1.0, 1.0], [1, 10, 1], wrap=10)
    best = choose_plan(plan_input, 2)
    assert best.groups == ((1, 2), (3, 0)) and best.peak_log_bytes == 2
    wrap_logged = [p for p in all_ring_plans(plan_input) if 3 in p.logged_boundaries and p.peak_log_bytes <= 2]
    assert not wrap_logged
    assert best.expected_recovery_seconds < evaluate(plan_input, []).expected_recovery_seconds


@pytest.mark.parametrize("seed", range(40))
def test_ring_choice_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    plan_input = random_ring(rng)
    plans = all_ring_plans(plan_input)
    total = sum(plan_input.edge_bytes) * plan_input.ckpt_every
    budgets = {0, total, math.inf, *(rng.randint(0, total + 1) for _ in range(6)),
               *(p.peak_log_bytes for p in plans[:: max(1, len(plans) // 8)])}
    for budget in budgets:
        chosen = choose_plan(plan_input, budget)
        best = min(p.expected_recovery_seconds for p in plans if p.peak_log_bytes <= budget)
        assert chosen.peak_log_bytes <= budget, (seed, budget)
        assert close(chosen.expected_recovery_seconds, best), (seed, budget, chosen, best)
        assert chosen == evaluate(plan_input, chosen.logged_boundaries)  # its numbers are its own grouping's
        assert len(chosen.logged_boundaries) != 1


@pytest.mark.parametrize("seed", range(15))
def test_ring_curve_is_the_pareto_frontier(seed: int) -> None:
    rng = random.Random(500 + seed)
    plan_input = random_ring(rng, max_stages=7)
    curve = tradeoff_curve(plan_input)
    for cheaper, dearer in itertools.pairwise(curve):
        assert cheaper.peak_log_bytes < dearer.peak_log_bytes
        assert cheaper.expected_recovery_seconds > dearer.expected_recovery_seconds
    for plan in all_ring_plans(plan_input):  # every plan is matched or beaten by a curve point
        assert any(point.peak_log_bytes <= plan.peak_log_bytes
                   and (point.expected_recovery_seconds <= plan.expected_recovery_seconds
                        or close(point.expected_recovery_seconds, plan.expected_recovery_seconds))
                   for point in curve)
    for point in curve:
        assert close(choose_plan(plan_input, point.peak_log_bytes).expected_recovery_seconds,
                     point.expected_recovery_seconds)


def test_ring_inputs_are_checked() -> None:
    with pytest.raises(PlanError, match="at least 2 stages"):
        PlanInput.from_lists([1.0], [], 1, wrap_bytes=3)
    with pytest.raises(PlanError, match="wrap_bytes"):
        ring([1.0, 1.0], [1], wrap=-1)
    with pytest.raises(PlanError, match=r"boundaries \[3\] do not exist in a ring of 3"):
        evaluate(ring([1.0, 1.0, 1.0], [1, 1], wrap=1), [3])
    with pytest.raises(PlanError, match=r"boundaries \[2\] do not exist in a pipeline"):
        evaluate(PlanInput.from_lists([1.0, 1.0, 1.0], [1, 1], 1), [2])  # a chain has no wrap


# --- virtual stages <-> positions --------------------------------------------------------------------------------


def test_looped_positions_form_a_ring_with_the_wrap_between_rounds() -> None:
    owner = looped_owner(4, 8)  # rank r runs r and r + 4
    assert owner == [0, 1, 2, 3, 0, 1, 2, 3]
    sizes = {s: 100 + s for s in range(7)}  # virtual boundary s carries 100 + s bytes
    plan_input = position_input(owner, [1.0, 2.0, 3.0, 4.0], sizes, ckpt_every=2)
    # edge e < 3 carries boundaries e and e + 4; the wrap (edge 3) carries boundary 3 only (3 -> 4)
    assert plan_input.boundary_bytes == (100 + 104, 101 + 105, 102 + 106)
    assert plan_input.wrap_bytes == 103 and plan_input.ring
    assert [s.compute_seconds for s in plan_input.stages] == [1.0, 2.0, 3.0, 4.0]


def test_one_stage_per_rank_is_the_usual_chain() -> None:
    plan_input = position_input(looped_owner(4, 4), [1.0] * 4, {0: 7, 1: 8, 2: 9}, ckpt_every=3)
    assert plan_input == PlanInput.from_lists([1.0] * 4, [7, 8, 9], 3)
    plan = choose_plan(plan_input, 3 * 8)
    assert logged_virtual_boundaries(plan, looped_owner(4, 4)) == set(plan.logged_boundaries) == {1}


def test_two_ranks_interleaved() -> None:
    owner = looped_owner(2, 4)  # boundaries 0 (0->1), 1 (1->0: the wrap), 2 (0->1)
    plan_input = position_input(owner, [1.0, 1.0], {0: 5, 1: 6, 2: 7}, ckpt_every=1)
    assert plan_input.boundary_bytes == (12,) and plan_input.wrap_bytes == 6
    alone = choose_plan(plan_input, math.inf)
    assert alone.members == ((0,), (1,)) and logged_virtual_boundaries(alone, owner) == {0, 1, 2}
    assert choose_plan(plan_input, 17).logs_nothing  # both edges or none: 18 bytes


@pytest.mark.parametrize("positions,rounds", [(2, 2), (3, 2), (4, 2), (4, 3), (5, 2)])
def test_every_ring_plan_logs_exactly_what_its_replays_need_and_what_it_pays_for(positions: int,
                                                                               rounds: int) -> None:
    """Brute force over every grouping: the virtual boundaries logged are exactly those between a group and the
    rest (a replaying group is served everything from outside it, nothing inside it is logged), and their bytes
    over an interval are the planner's peak log volume."""
    rng = random.Random(positions * 10 + rounds)
    owner = looped_owner(positions, positions * rounds)
    sizes = {s: rng.randint(1, 1000) for s in range(len(owner) - 1)}
    plan_input = position_input(owner, [rng.uniform(0.1, 2) for _ in range(positions)], sizes, ckpt_every=3)
    for plan in all_ring_plans(plan_input):
        logged = logged_virtual_boundaries(plan, owner)
        for members in plan.members:
            crossing = {s for s in range(len(owner) - 1) if (owner[s] in members) != (owner[s + 1] in members)}
            inside = {s for s in range(len(owner) - 1) if owner[s] in members and owner[s + 1] in members}
            assert crossing <= logged and not inside & logged
        if len(plan.logged_boundaries) != 1:  # one cut pays for a log the one group never needs
            assert 3 * sum(sizes[s] for s in logged) == plan.peak_log_bytes
        assert sorted(p for g in plan.members for p in g) == list(range(positions))


def test_placements_that_are_not_a_ring_of_neighbours() -> None:
    with pytest.raises(PlanError, match="not neighbours"):
        position_input([0, 2, 1, 3], [1.0] * 4, {}, ckpt_every=1)  # stage 0 -> 1 jumps from position 0 to 2
    with pytest.raises(PlanError, match="run by positions"):
        position_input([0, 1, 0, 1], [1.0] * 3, {}, ckpt_every=1)  # position 2 runs nothing
    # a "V" (rank r runs r and 2P-1-r) joins neighbours only, never across the ends: a chain
    v = position_input([0, 1, 2, 2, 1, 0], [1.0] * 3, {s: 10 for s in range(5)}, ckpt_every=1)
    assert v.boundary_bytes == (20, 20) and not v.ring
    assert edge_of(3, 0, 4) == 3 and edge_of(0, 3, 4) == 3 and edge_of(1, 3, 4) is None


# --- the runtime's aggregation (swiftrun/runtime/pp/selective.py) ---------------------------------------------------


def _row(position: int, stages: list[int], compute: float, sent: dict[int, int], positions: int = 4) -> dict:
    return {"position": position, "positions": positions, "stages": stages, "num_stages": 2 * positions,
            "compute": compute, "sent": sent}


def test_profiles_of_an_interleaved_dp_by_pp_job_are_averaged_per_position() -> None:
    from swiftrun.runtime.pp.selective import plan_input

    rows = []
    for replica, scale in ((0, 1), (1, 3)):  # two pipelines; their measurements are averaged
        for p in range(4):
            # position p sends forward across p and p + 4, backward across p - 1 and p + 3 (none before stage 0)
            sent = {b: 100 * scale for b in (p, p + 4, p - 1, p + 3) if 0 <= b < 7}
            rows.append(_row(p, [p, p + 4], float(p + 1) * scale, sent))
    got, owner = plan_input(rows, ckpt_every=2)
    assert owner == looped_owner(4, 8)
    assert [s.compute_seconds for s in got.stages] == [2.0, 4.0, 6.0, 8.0]
    # each virtual boundary: 200 bytes per pipeline both ways; edges 0-2 carry two, the wrap one
    assert got.boundary_bytes == (800, 800, 800) and got.wrap_bytes == 400
    plan = choose_plan(got, 2 * (800 + 400))
    assert plan.members == ((0, 1), (2, 3))
    assert logged_virtual_boundaries(plan, owner) == {1, 3, 5}
