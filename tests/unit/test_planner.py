"""Selective logging's planner: the cost model, the exact search against brute force, the curve, sizes."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swiftrun.errors import ConfigError
from swiftrun.logplan.planner import (
    LoggingPlan,
    PlanError,
    PlanInput,
    StageProfile,
    choose_plan,
    evaluate,
    format_size,
    parse_size,
    tradeoff_curve,
)

GiB = 2**30


def key(plan: LoggingPlan) -> tuple[float, int, float]:
    """What the planner minimises, in order: expected seconds, then bytes, then the worst case."""
    return (plan.expected_recovery_seconds, plan.peak_log_bytes, plan.worst_recovery_seconds)


def all_plans(plan_input: PlanInput) -> list[LoggingPlan]:
    """Every one of the 2^(S-1) choices of logged boundaries."""
    boundaries = range(plan_input.num_stages - 1)
    return [
        evaluate(plan_input, subset)
        for size in range(plan_input.num_stages)
        for subset in itertools.combinations(boundaries, size)
    ]


def brute_force(plan_input: PlanInput, budget: float) -> LoggingPlan:
    return min((plan for plan in all_plans(plan_input) if plan.peak_log_bytes <= budget), key=key)


def random_input(rng: random.Random, max_stages: int = 10) -> PlanInput:
    stages = rng.randint(1, max_stages)
    weights = tuple(rng.choice([0.0, rng.uniform(0.1, 3)]) for _ in range(stages))
    # Small integer byte sizes make equal byte totals (ties) common; zero-byte boundaries and zero weights occur.
    return PlanInput.from_lists(
        [rng.choice([0.0, rng.uniform(0.01, 10.0)]) if rng.random() < 0.1 else rng.uniform(0.01, 10.0)
         for _ in range(stages)],
        [rng.choice([0, rng.randint(1, 8), rng.randint(1, 10**9)]) for _ in range(stages - 1)],
        ckpt_every=rng.randint(1, 200),
        failure_weights=None if rng.random() < 0.5 or not any(weights) else weights,
        replay_speedup=rng.choice([1.0, 1.0, 3.0, 7.5]),
        micro_batches=rng.choice([1, 1, 4, 8]),
    )  # fmt: skip


def uniform(times: list[float], sizes: list[int], ckpt_every: int = 1, **options: object) -> PlanInput:
    return PlanInput.from_lists(times, sizes, ckpt_every=ckpt_every, **options)


# --- the cost model ---------------------------------------------------------------------------------------------


def test_cost_model_by_hand() -> None:
    # Stages 10, 1, 1 s; K = 4; uniform failures. Groups [0] [1-2]:
    #   expected = 1/3 * (4/2) * 10 + 2/3 * (4/2) * (1 + 1) = 20/3 + 8/3 = 28/3; worst = 4 * 10.
    plan_input = uniform([10.0, 1.0, 1.0], [100, 7], ckpt_every=4)
    plan = evaluate(plan_input, [0])
    assert plan.groups == ((0, 0), (1, 2))
    assert plan.logged_boundaries == (0,)
    assert plan.peak_log_bytes == 400
    assert plan.expected_recovery_seconds == pytest.approx(28 / 3)
    assert plan.worst_recovery_seconds == pytest.approx(40.0)
    assert not plan.logs_nothing


def test_weights_speedup_and_pipelined_replay() -> None:
    # Weights 3:1 on a 2-stage group; parallel replay 2x; 4 micro-batches pipelined:
    #   R = (2 + 6 + 3 * 6) / 4 / 2 = 3.25 s per iteration; expected = 1 * (10 / 2) * 3.25; worst = 10 * 3.25.
    plan_input = uniform([2.0, 6.0], [5], ckpt_every=10, failure_weights=(3.0, 1.0), replay_speedup=2.0,
                         micro_batches=4)  # fmt: skip
    plan = evaluate(plan_input, [])
    assert plan.logs_nothing
    assert plan.expected_recovery_seconds == pytest.approx(16.25)
    assert plan.worst_recovery_seconds == pytest.approx(32.5)
    # Logged: stage 0 fails with p = 3/4 and replays 2 s; stage 1 with p = 1/4 and replays 6 s; both halved.
    split = evaluate(plan_input, [0])
    assert split.expected_recovery_seconds == pytest.approx((0.75 * 5 * 2 + 0.25 * 5 * 6) / 2)


def test_one_micro_batch_model_is_the_sum_of_stage_times() -> None:
    plan_input = uniform([1.0, 2.0, 3.0], [1, 1], ckpt_every=2)
    assert evaluate(plan_input, []).worst_recovery_seconds == pytest.approx(2 * 6.0)


def test_numpy_scalars_are_accepted_as_plain_numbers() -> None:
    import numpy as np

    stage = StageProfile(np.float32(1.5), np.int64(1024))  # type: ignore[arg-type]
    assert stage == StageProfile(1.5, 1024)
    assert type(stage.compute_seconds) is float and type(stage.boundary_bytes) is int
    plan_input = PlanInput(stages=(stage, StageProfile(2.0)), ckpt_every=np.int64(10),  # type: ignore[arg-type]
                           failure_weights=np.array([1.0, 2.0]), micro_batches=np.int32(2))  # type: ignore[arg-type]
    assert plan_input == PlanInput(stages=(stage, StageProfile(2.0)), ckpt_every=10, failure_weights=(1.0, 2.0),
                                   micro_batches=2)  # fmt: skip


def test_single_stage_pipeline() -> None:
    plan = choose_plan(PlanInput(stages=(StageProfile(4.0),), ckpt_every=10), 0)
    assert plan.groups == ((0, 0),)
    assert plan.logs_nothing
    assert plan.expected_recovery_seconds == pytest.approx(20.0)
    assert tradeoff_curve(PlanInput(stages=(StageProfile(4.0),), ckpt_every=10)) == [plan]


# --- the exact search ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_choose_plan_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    plan_input = random_input(rng)
    total = sum(plan_input.boundary_bytes) * plan_input.ckpt_every
    plans = all_plans(plan_input)
    budgets = {0, total, total + 1, math.inf, *(rng.randint(0, total + 1) for _ in range(6))}
    budgets |= {plan.peak_log_bytes for plan in plans[:: max(1, len(plans) // 8)]}  # exactly at a plan's bytes
    for budget in budgets:
        chosen = choose_plan(plan_input, budget)
        expected = min((plan for plan in plans if plan.peak_log_bytes <= budget), key=key)
        assert key(chosen) == key(expected), (seed, budget)
        assert chosen == evaluate(plan_input, chosen.logged_boundaries)  # its numbers are its own grouping's


@settings(max_examples=60, deadline=None)
@given(
    times=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=8),
    data=st.data(),
)
def test_choose_plan_equals_brute_force_hypothesis(times: list[float], data: st.DataObject) -> None:
    sizes = data.draw(st.lists(st.integers(0, 50), min_size=len(times) - 1, max_size=len(times) - 1))
    ckpt_every = data.draw(st.integers(1, 20))
    budget = data.draw(st.integers(0, sum(sizes) * ckpt_every + 5))
    plan_input = uniform(times, sizes, ckpt_every=ckpt_every)
    assert key(choose_plan(plan_input, budget)) == key(brute_force(plan_input, budget))


@pytest.mark.parametrize("seed", range(10))
def test_budget_monotonicity(seed: int) -> None:
    rng = random.Random(1000 + seed)
    plan_input = random_input(rng)
    total = sum(plan_input.boundary_bytes) * plan_input.ckpt_every
    previous = None
    for budget in sorted({0, total, *(rng.randint(0, total) for _ in range(20))}):
        plan = choose_plan(plan_input, budget)
        assert plan.peak_log_bytes <= budget
        if previous is not None:  # more room never makes the expected recovery slower
            assert plan.expected_recovery_seconds <= previous.expected_recovery_seconds
        previous = plan


def test_unlimited_budget_logs_every_boundary() -> None:
    rng = random.Random(7)
    for _ in range(20):
        stages = rng.randint(2, 12)
        plan_input = uniform([rng.uniform(0.1, 5) for _ in range(stages)],
                             [rng.randint(1, 10**9) for _ in range(stages - 1)], ckpt_every=rng.randint(1, 500))
        plan = choose_plan(plan_input, math.inf)
        assert plan.logged_boundaries == tuple(range(stages - 1))
        assert plan.groups == tuple((s, s) for s in range(stages))
        assert choose_plan(plan_input, plan.peak_log_bytes) == plan  # exactly enough is enough


def test_zero_budget_logs_nothing() -> None:
    plan_input = uniform([1.0, 2.0, 3.0, 4.0], [10, 20, 30], ckpt_every=5)
    plan = choose_plan(plan_input, 0)
    assert plan.logs_nothing
    assert plan.groups == ((0, 3),)
    assert plan.peak_log_bytes == 0
    # The whole pipeline replays K/2 iterations: the rollback of a global restart.
    assert plan.expected_recovery_seconds == pytest.approx(2.5 * 10.0)
    # A budget too small for the cheapest boundary is the same.
    assert choose_plan(plan_input, 49) == plan


def test_zero_byte_boundaries_are_logged_for_free() -> None:
    plan = choose_plan(uniform([1.0, 1.0, 1.0], [0, 10], ckpt_every=3), 0)
    assert plan.logged_boundaries == (0,)
    assert not plan.logs_nothing


def test_ties_go_to_fewer_bytes() -> None:
    # Stage 1 never fails and takes no time: logging either side of it changes nothing but the bytes.
    plan_input = uniform([1.0, 0.0, 1.0], [5, 3], ckpt_every=1, failure_weights=(1.0, 0.0, 1.0))
    plan = choose_plan(plan_input, math.inf)
    assert plan.logged_boundaries == (1,)  # 3 bytes, not 5 or 8, for the same expected time
    assert plan.expected_recovery_seconds == evaluate(plan_input, [0, 1]).expected_recovery_seconds


def test_biggest_boundary_first_greedy_is_suboptimal() -> None:
    # Naive greedy: drop the boundary with the most bytes until within budget. Stage 0 is slow; its boundary is the
    # biggest, so the greedy merges it and makes the slow stage replay with its neighbour on every failure there.
    plan_input = uniform([10.0, 1.0, 1.0], [10, 9], ckpt_every=1)
    greedy = evaluate(plan_input, [1])  # merged boundary 0 (10 bytes), kept 9 bytes
    best = choose_plan(plan_input, 10)
    assert best.logged_boundaries == (0,)
    assert best.expected_recovery_seconds == pytest.approx(1 / 3 * 0.5 * 10 + 2 / 3 * 0.5 * 2)
    assert greedy.expected_recovery_seconds == pytest.approx(2 / 3 * 0.5 * 11 + 1 / 3 * 0.5 * 1)
    assert best.expected_recovery_seconds < 0.7 * greedy.expected_recovery_seconds


def naive_greedy(plan_input: PlanInput, budget: float) -> LoggingPlan:
    logged = set(range(plan_input.num_stages - 1))
    while evaluate(plan_input, logged).peak_log_bytes > budget:
        logged.remove(max(logged, key=lambda b: (plan_input.boundary_bytes[b], -b)))
    return evaluate(plan_input, logged)


def ratio_greedy(plan_input: PlanInput, budget: float) -> LoggingPlan:
    """The paper's idea, written from its description: merge the boundary adding the least time per byte saved."""
    logged = set(range(plan_input.num_stages - 1))
    while (current := evaluate(plan_input, logged)).peak_log_bytes > budget:

        def added_seconds_per_byte(b: int) -> tuple[float, int]:
            merged = evaluate(plan_input, logged - {b})
            saved = current.peak_log_bytes - merged.peak_log_bytes
            added = merged.expected_recovery_seconds - current.expected_recovery_seconds
            return (added / saved if saved else math.inf, b)

        logged.remove(min(logged, key=added_seconds_per_byte))
    return evaluate(plan_input, logged)


def test_both_greedies_miss_the_optimum_here() -> None:
    # Found by a seeded search; budget 15 = at most 7 bytes per iteration with K = 2.
    plan_input = uniform([9.0, 2.0, 4.0, 2.0, 4.0], [5, 5, 3, 2], ckpt_every=2)
    best = choose_plan(plan_input, 15)
    assert best.groups == ((0, 0), (1, 3), (4, 4))
    assert best.expected_recovery_seconds == pytest.approx(7.4)
    assert naive_greedy(plan_input, 15).expected_recovery_seconds == pytest.approx(10.2)
    assert ratio_greedy(plan_input, 15).expected_recovery_seconds == pytest.approx(11.4)


def test_greedies_never_beat_the_planner() -> None:
    rng = random.Random(3)
    for _ in range(30):
        plan_input = random_input(rng, max_stages=7)
        total = sum(plan_input.boundary_bytes) * plan_input.ckpt_every
        budget = rng.randint(0, total)
        best = choose_plan(plan_input, budget).expected_recovery_seconds
        assert best <= naive_greedy(plan_input, budget).expected_recovery_seconds
        assert best <= ratio_greedy(plan_input, budget).expected_recovery_seconds


# --- the trade-off curve ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(15))
def test_curve_is_the_pareto_frontier(seed: int) -> None:
    rng = random.Random(2000 + seed)
    plan_input = random_input(rng, max_stages=9)
    curve = tradeoff_curve(plan_input)
    # Strictly more bytes buys strictly less expected time.
    for cheaper, dearer in itertools.pairwise(curve):
        assert cheaper.peak_log_bytes < dearer.peak_log_bytes
        assert cheaper.expected_recovery_seconds > dearer.expected_recovery_seconds
    # Nothing beats a curve point on both counts, and every plan is matched or beaten by one.
    plans = all_plans(plan_input)
    for point in curve:
        assert not any(
            plan.peak_log_bytes <= point.peak_log_bytes
            and plan.expected_recovery_seconds < point.expected_recovery_seconds
            for plan in plans
        )
    for plan in plans:
        assert any(
            point.peak_log_bytes <= plan.peak_log_bytes
            and point.expected_recovery_seconds <= plan.expected_recovery_seconds
            for point in curve
        )
    # Each point is its own budget's choice.
    for point in curve:
        assert choose_plan(plan_input, point.peak_log_bytes) == point


def test_curve_of_a_uniform_pipeline() -> None:
    curve = tradeoff_curve(uniform([1.0] * 4, [GiB] * 3, ckpt_every=10))
    assert [len(plan.logged_boundaries) for plan in curve] == [0, 1, 2, 3]
    assert curve[0].logs_nothing
    assert curve[1].logged_boundaries == (1,)  # two equal halves
    assert curve[-1].peak_log_bytes == 30 * GiB


def test_a_few_hundred_stages() -> None:
    rng = random.Random(11)
    stages = 200
    plan_input = uniform([rng.uniform(0.5, 1.5) for _ in range(stages)], [256 * 2**20] * (stages - 1),
                         ckpt_every=100)  # fmt: skip
    curve = tradeoff_curve(plan_input)
    assert len(curve) == stages  # one optimum per number of logged boundaries
    plan = choose_plan(plan_input, 100 * GiB)
    assert plan.peak_log_bytes <= 100 * GiB
    assert len(plan.logged_boundaries) == 100 * GiB // (100 * 256 * 2**20)


# --- errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [-1, -0.5, math.nan, "2GiB", None, True])
def test_bad_budgets(budget: object) -> None:
    with pytest.raises(PlanError):
        choose_plan(uniform([1.0, 1.0], [1]), budget)  # type: ignore[arg-type]


def test_plan_error_is_a_value_error_and_a_usage_error() -> None:
    assert issubclass(PlanError, ValueError)
    assert issubclass(PlanError, ConfigError)
    assert PlanError("x").exit_code == 2


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: PlanInput(stages=(), ckpt_every=1), "at least one stage"),
        (lambda: uniform([1.0, 1.0], [1, 2]), "2 stages have 1 boundaries"),
        (lambda: uniform([1.0, -1.0], [1]), "compute_seconds"),
        (lambda: uniform([1.0, math.inf], [1]), "compute_seconds"),
        (lambda: uniform([1.0, 1.0], [-1]), "boundary_bytes must be >= 0"),
        (lambda: uniform([1.0, 1.0], [1.5]), "whole number of bytes"),  # type: ignore[list-item]
        (lambda: uniform([1.0, 1.0], [1], ckpt_every=0), "checkpoint interval"),
        (lambda: uniform([1.0, 1.0], [1], failure_weights=(1.0,)), "1 failure weights for 2 stages"),
        (lambda: uniform([1.0, 1.0], [1], failure_weights=(0.0, 0.0)), "not all be 0"),
        (lambda: uniform([1.0, 1.0], [1], failure_weights=(1.0, -1.0)), "failure weights"),
        (lambda: uniform([1.0, 1.0], [1], replay_speedup=0.5), "speed-up"),
        (lambda: uniform([1.0, 1.0], [1], micro_batches=0), "micro_batches"),
        (lambda: uniform([1.0, 1.0], [1], restart_seconds=-3.0), "restart_seconds"),
        (lambda: PlanInput(stages=(StageProfile(1.0, 5),), ckpt_every=1), "last stage"),
        (lambda: uniform([1.0, 1.0], [2**61], ckpt_every=4), "2**62"),
    ],
)
def test_bad_inputs(build: object, message: str) -> None:
    with pytest.raises(PlanError, match=message.replace("*", r"\*")):
        build()  # type: ignore[operator]


def test_evaluate_refuses_unknown_boundaries() -> None:
    with pytest.raises(PlanError, match=r"boundaries \[2\] do not exist"):
        evaluate(uniform([1.0, 1.0, 1.0], [1, 1]), [0, 2])


# --- sizes ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("2GiB", 2 * GiB),
        ("500MB", 500_000_000),
        ("1.5G", 1_500_000_000),
        ("123", 123),
        ("0", 0),
        ("123B", 123),
        ("1k", 1000),
        ("1KiB", 1024),
        ("1.5 gib", 3 * 2**29),
        ("  64 MiB ", 64 * 2**20),
        ("2Ti", 2 * 2**40),
        ("1PB", 10**15),
        (".5KB", 500),
        ("0.3KiB", 307),  # 307.2 bytes, rounded down
        ("+7MB", 7_000_000),
    ],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "not a size"),
        ("GiB", "not a size"),
        ("abc", "not a size"),
        ("1.2.3G", "not a size"),
        ("1e9", "not a size"),
        ("1 e", "unknown unit 'e'"),
        ("5 XB", "unknown unit 'XB'"),
        ("2 GiBs", "unknown unit"),
        ("-1GB", "must not be negative"),
        ("inf", "not a size"),
        ("nan", "not a size"),
        ("1,000", "not a size"),
    ],
)
def test_parse_size_errors(text: str, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        parse_size(text)


def test_parse_size_refuses_non_text() -> None:
    with pytest.raises(PlanError):
        parse_size(1024)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("size", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (2 * GiB, "2.00 GiB"), (1536 * 2**20, "1.50 GiB"),
     (25 * GiB, "25.0 GiB"), (300 * 2**20, "300 MiB"), (3 * 2**50, "3.00 PiB")],
)  # fmt: skip
def test_format_size(size: int, text: str) -> None:
    assert format_size(size) == text
