"""scripts/_goodput_model.py: the arithmetic behind scripts/goodput.py, checked against its published anchors."""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "_goodput_model", Path(__file__).resolve().parents[2] / "scripts" / "_goodput_model.py")
G = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = G  # dataclasses look their module up there
_SPEC.loader.exec_module(G)

PUB = G.Published()
# a measurement of the shape scripts/goodput.py takes (seconds)
MEASURED = G.Measured(swift_rank_lost_s=0.4, swift_rank_local_s=0.05, swift_node_lost_s=10.5, swift_node_local_s=0.05,
                      swift_step_extra_s=0.002, torchrun_restart_s=8.0, swift_hang_detect_s=30.0)


def test_the_causes_are_llama3s_419_interruptions_and_their_weights_sum_to_one():
    assert sum(c.count for c in G.LLAMA3_CAUSES) == 419
    weights = G.cause_weights()
    assert math.isclose(sum(weights.values()), 1.0)
    assert math.isclose(weights[G.Path.NODE], (268 + 46 + 42) / 419)


def test_llama3_failure_rate_gives_its_own_mtbf_at_its_own_size():
    assert G.gpu_hours_per_failure() == pytest.approx(16_384 * 54 * 24 / 419)
    assert G.job_mtbf_s(G.Job(gpus=16_384), PUB) / 3600 == pytest.approx(54 * 24 / 419)
    assert G.job_mtbf_s(G.Job(gpus=1_024), PUB) == pytest.approx(16 * G.job_mtbf_s(G.Job(gpus=16_384), PUB))


def test_rsc_mttf_passes_through_its_published_points_and_falls_with_size():
    for n, hours in PUB.rsc_mttf_h:
        assert G.job_mtbf_s(G.Job(gpus=n, failure_model="rsc"), PUB) / 3600 == pytest.approx(hours)
    sizes = (512, 1_024, 4_096, 16_384, 65_536, 131_072, 200_000)
    mttf = [G.job_mtbf_s(G.Job(gpus=n, failure_model="rsc"), PUB) for n in sizes]
    assert mttf == sorted(mttf, reverse=True)
    with pytest.raises(ValueError, match="unknown failure model"):
        G.job_mtbf_s(G.Job(gpus=8, failure_model="weibull"), PUB)


def test_what_grows_with_n_meets_its_anchors():
    for n, seconds in PUB.nccl_init_s:
        assert G.nccl_init_s(n, PUB) == pytest.approx(seconds)
    assert G.barrier_s(16_384, PUB) == pytest.approx(0.5)
    assert G.barrier_s(32_768, PUB) == pytest.approx(1.0)


def test_daly_interval_is_youngs_less_the_checkpoint_cost_and_never_below_it():
    assert G.daly_interval_s(6.3, 3600.0) == pytest.approx(math.sqrt(2 * 6.3 * 3600) - 6.3)
    assert G.daly_interval_s(100.0, 1.0) == 100.0


def test_daly_interval_is_near_the_best_for_the_torchrun_goodput_it_feeds():
    job, mtbf = G.Job(gpus=16_384), G.job_mtbf_s(G.Job(gpus=16_384), PUB)
    best = G.breakdown(G.Method.TORCHRUN, job, PUB, MEASURED)

    def goodput_at(interval: float) -> float:
        overhead = PUB.ckpt_stall_s / (interval + PUB.ckpt_stall_s)
        return (1 - overhead) * mtbf / (mtbf + best.loss_per_failure_s - best.ckpt_interval_s / 2 + interval / 2)

    assert goodput_at(best.ckpt_interval_s) >= max(goodput_at(best.ckpt_interval_s * f) for f in (0.5, 2.0))


def test_goodput_falls_with_job_size_for_every_method_and_a_spare_never_hurts():
    sizes = (1_024, 4_096, 16_384, 65_536, 100_000)
    results = G.sweep(sizes, G.Job(gpus=1), PUB, MEASURED)
    for method in G.Method:
        series = [results[n][method].goodput for n in sizes]
        assert series == sorted(series, reverse=True), method
        assert all(0 < g < 1 for g in series)
    for n in sizes:
        for method in G.Method:
            with_spare = G.breakdown(method, G.Job(gpus=n), PUB, MEASURED)
            without = G.breakdown(method, G.Job(gpus=n, hot_spare=False), PUB, MEASURED)
            assert without.goodput <= with_spare.goodput


def test_swiftrun_costs_are_the_measured_ones_with_the_local_rebuild_replaced_by_the_modelled_one():
    job = G.Job(gpus=4_096, step_s=2.0, state_gb_per_gpu=10.0)
    rebuild = G.nccl_init_s(4_096, PUB) + G.barrier_s(4_096, PUB) + 10.0 / PUB.link_gb_per_s
    process = G.swift_loss_s(G.Path.PROCESS, job, PUB, MEASURED)
    assert process == pytest.approx(0.4 - 0.05 + rebuild + 2.0)
    assert G.swift_loss_s(G.Path.HANG, job, PUB, MEASURED) == pytest.approx(process + 30.0)
    assert G.swift_loss_s(G.Path.NODE, job, PUB, MEASURED) == pytest.approx(10.5 - 0.05 + rebuild + 2.0)
    assert G.swift_loss_s(G.Path.NODE, replace(job, hot_spare=False), PUB, MEASURED) == pytest.approx(
        10.5 - 0.05 + rebuild + 2.0 + PUB.node_replace_s)


def test_swiftruns_failure_free_cost_is_a_fixed_time_per_step():
    short, long = (G.breakdown(G.Method.SWIFTRUN, G.Job(gpus=1_024, step_s=s), PUB, MEASURED) for s in (0.5, 5.0))
    assert short.overhead == pytest.approx(0.004)
    assert long.overhead == pytest.approx(0.0004)
    noisy = replace(MEASURED, swift_step_extra_s=-0.01)
    assert G.breakdown(G.Method.SWIFTRUN, G.Job(gpus=1_024), PUB, noisy).overhead == 0.0


def test_torchrun_pays_the_load_the_redo_and_a_hang_at_the_nccl_timeout():
    job = G.Job(gpus=16_384)
    got = G.breakdown(G.Method.TORCHRUN, job, PUB, MEASURED)
    restart = G.torchrun_restart_s(G.Path.PROCESS, job, PUB, MEASURED)
    assert restart == pytest.approx(8.0 + G.nccl_init_s(16_384, PUB) + G.barrier_s(16_384, PUB) + PUB.ckpt_load_s)
    assert G.torchrun_restart_s(G.Path.HANG, job, PUB, MEASURED) == pytest.approx(restart + PUB.nccl_timeout_s)
    assert got.loss_by_path_s["process"] == pytest.approx(restart + (got.ckpt_interval_s + PUB.ckpt_stall_s) / 2)
    assert got.exact


def test_a_torchft_like_run_is_reported_inexact_and_loses_only_the_failed_groups_share_after_the_stall():
    job = G.Job(gpus=16_384, replica_groups=4)
    got = G.breakdown(G.Method.TORCHFT, job, PUB, MEASURED)
    assert not got.exact
    assert got.loss_by_path_s["process"] == pytest.approx(PUB.torchft_stall_s + PUB.torchft_heal_s / 4)


def test_cheaper_recoveries_give_more_goodput():
    job = G.Job(gpus=16_384)
    swift = G.breakdown(G.Method.SWIFTRUN, job, PUB, MEASURED)
    slower = G.breakdown(G.Method.SWIFTRUN, job, PUB, replace(MEASURED, swift_node_lost_s=100.0))
    assert slower.goodput < swift.goodput
    assert swift.goodput > G.breakdown(G.Method.TORCHRUN, job, PUB, MEASURED).goodput
