"""The dashboard renderer, the live dashboard and the plain-line reporter, on a fixed-size capture console."""

from __future__ import annotations

import dataclasses
import io
import re

import pytest
from rich.console import Console

from swiftrun.dashboard.live import Dashboard, PlainReporter, make_reporter, rank_ranges
from swiftrun.dashboard.render import notable_ranks, render, sparkline
from swiftrun.launcher.view import Throughput
from swiftrun.snapshot import (
    JobSnapshot,
    JobState,
    PhaseView,
    RankView,
    RecoveryPhase,
    RecoveryView,
    WorkerState,
)

WIDTH, HEIGHT = 150, 45  # the terminal the dashboard promises to fit

# A row of the rank table: rank, local rank, pid (or "-"), state; captures the rank number and the state.
STATES = "|".join(state.value for state in WorkerState)
ROW = re.compile(rf"^\s*(\d+)\s+\d+\s+(?:\d+|-)\s+({STATES})\b")


def capture_console() -> Console:
    return Console(
        width=WIDTH, height=HEIGHT, force_terminal=True, color_system=None, record=True, file=io.StringIO()
    )


def rendered(snapshot: JobSnapshot) -> str:
    console = capture_console()
    console.print(render(snapshot))
    return console.export_text()


def listed_ranks(text: str) -> dict[int, str]:
    """Rank number -> state, for every rank that has a row."""
    return {int(match[1]): match[2] for line in text.splitlines() if (match := ROW.match(line))}


def row_of(text: str, rank: int) -> str:
    """The table row of one rank."""
    return next(line.rstrip() for line in text.splitlines() if (match := ROW.match(line)) and int(match[1]) == rank)


def healthy_rank(rank: int, step: int = 1200) -> RankView:
    return RankView(
        rank=rank,
        local_rank=rank % 8,
        pid=10_000 + rank,
        state=WorkerState.RUNNING,
        step=step,
        loss=2.5,
        step_time=0.120,
        heartbeat_age=0.2,
    )


def snapshot(ranks: list[RankView], **overrides: object) -> JobSnapshot:
    fields: dict[str, object] = dict(
        script="train.py",
        world_size=len(ranks),
        nnodes=max(1, len(ranks) // 8),
        generation=1,
        state=JobState.RUNNING,
        uptime=754.0,
        ranks=tuple(ranks),
        steps_per_s=8.25,
        event_log="/tmp/run/events.jsonl",
    )
    fields.update(overrides)
    return JobSnapshot(**fields)  # type: ignore[arg-type]


def mid_recovery_snapshot() -> JobSnapshot:
    """Three ranks; rank 2 was SIGKILLed, its replacement is spawning while the survivors wait."""
    ranks = [
        dataclasses.replace(healthy_rank(0), state=WorkerState.RECOVERING),
        dataclasses.replace(healthy_rank(1), state=WorkerState.RECOVERING),
        RankView(rank=2, local_rank=2, pid=20_002, state=WorkerState.JOINING, heartbeat_age=0.1, restarts=1),
    ]
    recovery = RecoveryView(
        generation=2,
        failed_ranks=(2,),
        cause="rank 2 killed by SIGKILL",
        phases=(
            PhaseView(RecoveryPhase.DETECT, 0.012),
            PhaseView(RecoveryPhase.ABORT, 0.041),
            PhaseView(RecoveryPhase.SPAWN, None),
        ),
    )
    return snapshot(
        ranks,
        state=JobState.RECOVERING,
        generation=2,
        failures=1,
        time_lost=0.053,
        recovery=recovery,
        events=("12:34 rank 2 failed: killed by SIGKILL", "12:34 recovery gen 2 started"),
    )


def large_job(world: int) -> JobSnapshot:
    """Healthy ranks except: 5 failed, 17 silent, 29 slow, 41 behind (all above FOLD_ABOVE's reach)."""
    ranks = [healthy_rank(rank) for rank in range(world)]
    ranks[5] = dataclasses.replace(ranks[5], state=WorkerState.FAILED, pid=None, heartbeat_age=None)
    ranks[17] = dataclasses.replace(ranks[17], heartbeat_age=41.0)
    ranks[29] = dataclasses.replace(ranks[29], step_time=0.950)
    ranks[41] = dataclasses.replace(ranks[41], step=1100)
    return snapshot(ranks, events=tuple(f"event {index}" for index in range(20)))


def assert_fits(text: str) -> None:
    lines = text.splitlines()
    assert len(lines) <= HEIGHT, f"{len(lines)} lines"
    assert max(len(line) for line in lines) <= WIDTH


# --- render -----------------------------------------------------------------------------------------------------


def test_three_ranks_shows_header_and_one_row_per_rank() -> None:
    ranks = [healthy_rank(rank, step=1200 + rank) for rank in range(3)]
    ranks[1] = dataclasses.replace(ranks[1], loss=2.25, step_time=0.1234, heartbeat_age=3.5, restarts=2)
    text = rendered(
        snapshot(ranks, samples_per_s=24576.0, failures=2, time_lost=1.5, generation=3, uptime=3723.0)
    )

    assert "train.py" in text
    assert "world 3 on 1 node" in text
    assert "generation 3" in text
    assert "up 1:02:03" in text
    assert "RUNNING" in text
    assert "8.25 steps/s" in text
    assert "24,576 samples/s" in text
    assert "2 failures, 1.50 s lost" in text
    assert "/tmp/run/events.jsonl" in text
    assert listed_ranks(text) == {0: "running", 1: "running", 2: "running"}
    assert row_of(text, 1).split() == ["1", "1", "10001", "running", "1201", "2.25", "123.4", "3.5s", "2"]


def test_finishing_and_starting_ranks_show_their_state() -> None:
    ranks = [healthy_rank(rank, step=99) for rank in range(3)]
    ranks[0] = dataclasses.replace(ranks[0], state=WorkerState.FINISHING)
    ranks[2] = dataclasses.replace(ranks[2], state=WorkerState.STARTING, step=None)
    text = rendered(snapshot(ranks))

    assert listed_ranks(text) == {0: "finishing", 1: "running", 2: "starting"}


def test_folded_view_lists_finishing_ranks_after_the_alarming_ones() -> None:
    ranks = [dataclasses.replace(healthy_rank(rank), state=WorkerState.FINISHING) for rank in range(64)]
    ranks[7] = dataclasses.replace(ranks[7], state=WorkerState.FAILED)
    listed, _ = notable_ranks(ranks)

    assert [n.rank.rank for n in listed][:2] == [7, 0]
    assert listed[1].reasons == ("finishing",)


def test_tokens_per_second_is_labelled_as_tokens() -> None:
    ranks = [dataclasses.replace(healthy_rank(0), metrics={"tokens_per_s": 9000.0})]
    assert "9,000 tokens/s" in rendered(snapshot(ranks, samples_per_s=9000.0))


def test_the_header_draws_the_recent_throughput_as_a_sparkline_a_recovery_as_a_dip() -> None:
    ranks = [healthy_rank(rank) for rank in range(3)]
    text = rendered(snapshot(ranks, rate_history=(8.0, 8.0, 0.0, 0.0, 4.0, 8.0), failures=1, time_lost=2.0))
    assert "8.25 steps/s ██▁▁▅█" in text
    assert "8.25 steps/s  ·  0 failures" in rendered(snapshot(ranks, rate_history=(8.0,)))  # one sample: no bars


def test_the_sparkline_header_stays_readable_in_80_columns() -> None:
    console = Console(width=80, height=HEIGHT, force_terminal=True, color_system=None, record=True,
                      file=io.StringIO())
    history = tuple(float(v) for v in (8, 8, 8, 7, 0, 0, 0, 3, 6, 8, 8, 8, 8, 8, 8, 8))
    console.print(render(snapshot([healthy_rank(rank) for rank in range(4)], rate_history=history, failures=1,
                                  time_lost=2.4)))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if "steps/s" in line)
    assert f"8.25 steps/s {sparkline(history)}  ·  1 failure, 2.40 s lost" in header


def test_sparkline_scales_to_the_largest_value_and_draws_a_stall_flat() -> None:
    assert sparkline((1.0, 2.0, 4.0)) == "▃▅█"
    assert sparkline((0.0, 0.0)) == "▁▁"


def test_throughput_history_is_one_rate_per_period_and_a_stall_reads_as_zero() -> None:
    rate = Throughput(history=4, period=1.0)
    assert rate.history(0.0) == ()  # nothing reported yet
    rate.add(0.0, 0)
    assert rate.history(0.0) == ()  # the first sample only marks where counting starts
    rate.add(0.5, 5)
    assert rate.history(0.6) == ()  # not a period yet
    rate.add(1.0, 10)
    assert rate.history(1.0) == (10.0,)
    assert rate.history(3.0) == (10.0, 0.0)  # two seconds without a step: a stall
    rate.add(3.5, 9)  # a redone step: rank 0's step went back
    assert rate.history(4.0) == (10.0, 0.0, 0.0)
    for t, step in ((5.0, 20), (6.0, 30), (7.0, 40)):
        rate.add(t, step)
        rate.history(t)
    assert rate.history(7.0) == (0.0, 11.0, 10.0, 10.0)  # the oldest fall off


def test_mid_recovery_shows_finished_running_and_pending_phases() -> None:
    text = rendered(mid_recovery_snapshot())

    assert "RECOVERING" in text
    assert "recovery · generation 2 · rank 2 killed by SIGKILL" in text
    assert "in progress" in text
    names = next(line for line in text.splitlines() if "detect" in line and "resume" in line)
    durations = text.splitlines()[text.splitlines().index(names) + 1]
    assert durations.strip("│ ").split() == ["12", "ms", "41", "ms", "running…", "·", "·", "·", "·", "·"]
    assert listed_ranks(text) == {0: "recovering", 1: "recovering", 2: "joining"}
    assert "recovery gen 2 started" in text  # the event tail


def test_finished_recovery_shows_mode_source_total_and_skipped_phases() -> None:
    recovery = RecoveryView(
        generation=2,
        failed_ranks=(1,),
        cause="rank 1 exited with code 1",
        phases=tuple(PhaseView(phase, 0.010) for phase in RecoveryPhase if phase is not RecoveryPhase.UNDO),
        mode="roll-forward",
        source_rank=0,
        done=True,
        total=1.234,
    )
    text = rendered(snapshot([healthy_rank(rank) for rank in range(2)], recovery=recovery))

    assert "last recovery · generation 2" in text
    assert "roll-forward · state from rank 0 · total 1.23 s" in text
    assert "skipped" in text
    assert "running…" not in text


def test_a_recovery_that_undid_arithmetically_says_it_is_inexact() -> None:
    recovery = RecoveryView(generation=1, failed_ranks=(1,), cause="rank 1 killed by SIGKILL",
                            phases=tuple(PhaseView(phase, 0.010) for phase in RecoveryPhase), mode="undo",
                            source_rank=0, done=True, total=1.0, inexact="--no-exact-undo")
    text = rendered(snapshot([healthy_rank(rank) for rank in range(2)], recovery=recovery))
    assert "undo · state from rank 0 · total 1.00 s · inexact undo" in text
    exact = rendered(snapshot([healthy_rank(rank) for rank in range(2)],
                              recovery=dataclasses.replace(recovery, inexact=None)))
    assert "inexact" not in exact


def test_32_ranks_mid_recovery_still_fit_unfolded() -> None:
    base = mid_recovery_snapshot()
    ranks = [healthy_rank(rank) for rank in range(32)]
    text = rendered(dataclasses.replace(base, ranks=tuple(ranks), world_size=32, events=("e",) * 20))

    assert_fits(text)
    assert len(listed_ranks(text)) == 32


@pytest.mark.parametrize("world", [64, 512, 4096])
def test_large_jobs_fold_to_the_notable_ranks_and_fit(world: int) -> None:
    text = rendered(large_job(world))

    assert_fits(text)
    assert f"{world} ranks:  running {world - 1}  failed 1" in text
    assert "step min 1100  median 1200  max 1200" in text
    listed = listed_ranks(text)
    assert listed == {5: "failed", 17: "running", 29: "running", 41: "running"}
    assert row_of(text, 5).endswith("failed")
    assert row_of(text, 17).endswith("silent")
    assert row_of(text, 29).endswith("slow")
    assert row_of(text, 41).endswith("behind 100")


def test_mass_failure_lists_some_and_counts_the_rest() -> None:
    ranks = [dataclasses.replace(healthy_rank(rank), state=WorkerState.STARTING, step=None) for rank in range(512)]
    ranks[300] = dataclasses.replace(ranks[300], state=WorkerState.FAILED)
    text = rendered(snapshot(ranks, state=JobState.STARTING, recovery=mid_recovery_snapshot().recovery))

    assert_fits(text)
    listed = listed_ranks(text)
    assert listed[300] == "failed"  # the most alarming state is listed first
    assert f"… and {512 - len(listed)} more not listed (starting {512 - len(listed)})" in text


def test_healthy_large_job_says_nothing_is_notable() -> None:
    text = rendered(snapshot([healthy_rank(rank) for rank in range(64)]))
    assert listed_ranks(text) == {}
    assert "no notable ranks" in text


# --- PlainReporter ----------------------------------------------------------------------------------------------


def plain_lines(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


def test_plain_reporter_prints_state_changes_once() -> None:
    out = io.StringIO()
    reporter = PlainReporter(out)
    starting = snapshot(
        [dataclasses.replace(healthy_rank(rank), state=WorkerState.STARTING, step=None) for rank in range(4)],
        state=JobState.STARTING,
        uptime=0.5,
    )
    reporter.update(starting)
    assert plain_lines(out) == ["[swiftrun] job starting: train.py, world 4 on 1 node(s)"]

    running = dataclasses.replace(
        starting, state=JobState.RUNNING, uptime=2.0, ranks=tuple(healthy_rank(rank, step=1) for rank in range(4))
    )
    reporter.update(running)
    reporter.update(running)  # unchanged: silent
    assert plain_lines(out)[1:] == [
        "[swiftrun] job starting -> running (generation 1)",
        "[swiftrun] ranks 0-3 starting -> running",
        "[swiftrun] step=1 steps/s=8.25 loss=2.5 gen=1 failures=0 lost=0.0s up=0:00:02",
    ]

    ranks = list(running.ranks)
    ranks[2] = dataclasses.replace(ranks[2], state=WorkerState.FAILED)
    failed = dataclasses.replace(running, ranks=tuple(ranks))
    reporter.update(failed)
    assert plain_lines(out)[4:] == ["[swiftrun] rank 2 running -> failed"]

    ranks[0] = dataclasses.replace(ranks[0], state=WorkerState.FINISHING)
    reporter.update(dataclasses.replace(running, ranks=tuple(ranks)))
    assert plain_lines(out)[5:] == ["[swiftrun] rank 0 running -> finishing"]


def test_plain_reporter_reports_recovery_phases_as_they_complete() -> None:
    out = io.StringIO()
    reporter = PlainReporter(out)
    during = mid_recovery_snapshot()
    reporter.update(during)
    start_lines = [line for line in plain_lines(out) if "recovery" in line]
    assert start_lines == [
        "[swiftrun] recovery gen 2 started: rank 2 killed by SIGKILL",
        "[swiftrun] recovery gen 2 detect 12 ms",
        "[swiftrun] recovery gen 2 abort 41 ms",
    ]

    assert during.recovery is not None
    finished = dataclasses.replace(
        during.recovery,
        phases=(*during.recovery.phases[:2], PhaseView(RecoveryPhase.SPAWN, 0.850)),
        done=True,
        mode="roll-forward",
        source_rank=0,
        total=1.5,
    )
    before = len(plain_lines(out))
    reporter.update(dataclasses.replace(during, recovery=finished))
    assert plain_lines(out)[before:] == [
        "[swiftrun] recovery gen 2 spawn 850 ms",
        "[swiftrun] recovery gen 2 done in 1.50 s (roll-forward, source rank 0)",
    ]


def test_plain_reporter_progress_at_most_every_ten_seconds() -> None:
    out = io.StringIO()
    reporter = PlainReporter(out)
    ranks = [healthy_rank(0, step=1)]
    for uptime, step in [(1.0, 1), (5.0, 40), (10.9, 90), (11.0, 91), (21.5, 91), (22.0, 180)]:
        reporter.update(snapshot([dataclasses.replace(ranks[0], step=step)], uptime=uptime))
    progress = [line.split()[1] for line in plain_lines(out) if line.startswith("[swiftrun] step=")]
    # 10.9 is under ten seconds after 1.0; 21.5 is due but the step has not moved since 11.0.
    assert progress == ["step=1", "step=91", "step=180"]


def test_job_end_line_has_duration_and_losses() -> None:
    out = io.StringIO()
    reporter = PlainReporter(out)
    running = snapshot([healthy_rank(0)])
    reporter.update(running)
    reporter.update(
        dataclasses.replace(running, state=JobState.SUCCEEDED, uptime=3600.0, failures=1, time_lost=2.0)
    )
    assert "[swiftrun] job succeeded after 1:00:00 (1 failures, 2.00 s lost)" in plain_lines(out)


def test_print_line_prints_worker_output_verbatim() -> None:
    out = io.StringIO()
    PlainReporter(out).print_line("[rank 0] loss [bold]2.5[/bold]")
    assert out.getvalue() == "[rank 0] loss [bold]2.5[/bold]\n"


def test_rank_ranges_compacts_consecutive_ranks() -> None:
    assert rank_ranges([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8"
    assert rank_ranges([3]) == "3"


# --- Dashboard and make_reporter --------------------------------------------------------------------------------


def test_dashboard_prints_worker_lines_and_leaves_the_last_frame() -> None:
    console = capture_console()
    dashboard = Dashboard(console)
    dashboard.start()
    dashboard.update(mid_recovery_snapshot())
    dashboard.print_line("[rank 0] hello from the worker")
    dashboard.stop()
    dashboard.stop()  # idempotent

    text = console.export_text()
    assert "[rank 0] hello from the worker" in text
    assert "recovery · generation 2" in text  # the final frame stays on screen


def test_dashboard_before_the_first_snapshot_says_it_is_waiting() -> None:
    console = capture_console()
    with Dashboard(console):
        pass
    assert "waiting for the first snapshot" in console.export_text()


@pytest.mark.parametrize(
    ("terminal", "wanted", "expected"),
    [
        (True, None, Dashboard),
        (False, None, PlainReporter),
        (False, True, Dashboard),
        (True, False, PlainReporter),
    ],
)
def test_make_reporter_picks_by_terminal_unless_told(terminal: bool, wanted: bool | None, expected: type) -> None:
    console = Console(file=io.StringIO(), force_terminal=terminal)
    assert type(make_reporter(console, wanted)) is expected
