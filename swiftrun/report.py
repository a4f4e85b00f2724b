"""``swiftrun report EVENTLOG [--plot FILE.png]``: what happened to a job, from its event log.

Works on a finished job and on one still running (the log is read up to its last complete line). The summary
gives the outcome, duration, steps, every failure, every recovery with its phase breakdown, restarts, the time
lost to failures and the goodput. ``--plot`` draws step over time with failures and recoveries marked; it needs
matplotlib, an optional dependency (``pip install 'swiftrun[plot]'``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Iterable, Optional

import typer

from swiftrun.events import EventName, read_events
from swiftrun.snapshot import RecoveryPhase

PLOT_INSTALL_HINT = "pip install 'swiftrun[plot]'"

app = typer.Typer(add_completion=False, help="Summarize a swiftrun job from its event log.")


@dataclass(frozen=True)
class Failure:
    t: float
    rank: int | None
    cause: str
    node: int | None = None  # multi-node: the node slot that ran it
    host: str | None = None
    node_incarnation: int | None = None


@dataclass(frozen=True)
class Holder:
    """Who held a node slot: an agent, by the node rank it was started with, its host and the slot's incarnation."""

    node_rank: int | None
    host: str | None
    incarnation: int | None
    spare: bool = False  # a hot-spare node that took the slot over

    def describe(self) -> str:
        what = "hot-spare node rank" if self.spare else "node rank"
        parts = [f"{what} {'?' if self.node_rank is None else self.node_rank}"]
        parts += [self.host] if self.host else []
        parts += [] if self.incarnation is None else [f"incarnation {self.incarnation}"]
        return ", ".join(parts)


@dataclass(frozen=True)
class NodeEvent:
    """A node slot lost, taken over by a hot spare, or rejoined by its restarted node; a hot spare joining."""

    t: float
    slot: int | None  # None: a hot-spare node joined
    what: str  # "lost", "taken over", "rejoined", "spare joined"
    holder: Holder
    cause: str = ""


@dataclass
class Recovery:
    generation: int
    t_start: float
    cause: str
    failed_ranks: tuple[int, ...] = ()
    phases: dict[str, float] = field(default_factory=dict)  # phase name -> seconds, in completion order
    t_end: float | None = None
    outcome: str | None = None
    mode: str | None = None
    source_rank: int | None = None
    total: float | None = None  # seconds from failure to resume, as the supervisor measured it
    lost_steps: int | None = None
    inexact: str | None = None  # an update was undone arithmetically: the recovered run is not the failure-free one
    replays: list[str] = field(default_factory=list)  # pipelines: "ranks 2, 3 replayed steps 4..5"
    nodes: tuple[int, ...] = ()  # multi-node: the node slots whose ranks it replaced
    holders: dict[int, tuple[Holder | None, Holder | None]] = field(default_factory=dict)  # slot -> before, after


@dataclass(frozen=True)
class Restart:
    t: float
    attempt: int | None
    reason: str
    resumed_at: float | None  # t of the first progress after it; None if training never resumed


@dataclass
class JobSummary:
    script: str | None = None
    world_size: int | None = None
    nnodes: int | None = None
    outcome: str = "running"  # "running" until a job_end says otherwise
    exit_code: int | None = None
    duration: float = 0.0
    steps: int | None = None
    progress: list[tuple[float, int]] = field(default_factory=list)  # (t, step), for the plot
    failures: list[Failure] = field(default_factory=list)
    recoveries: list[Recovery] = field(default_factory=list)
    restarts: list[Restart] = field(default_factory=list)
    node_events: list[NodeEvent] = field(default_factory=list)  # multi-node: membership changes after the start
    log_plan: str | None = None  # pipelines: the logging groups chosen under --log-budget
    time_lost: float = 0.0
    finished: bool = False

    @property
    def goodput(self) -> float | None:
        """Fraction of wall time not lost to failures; None before any time has passed."""
        if self.duration <= 0:
            return None
        return min(1.0, max(0.0, 1.0 - self.time_lost / self.duration))


def summarize(events: Iterable[dict[str, Any]]) -> JobSummary:
    """Fold an event stream into a :class:`JobSummary`; unknown events and missing fields are tolerated."""
    summary = JobSummary()
    recoveries: dict[int, Recovery] = {}
    restart_events: list[dict[str, Any]] = []
    reported_time_lost: float | None = None
    last_t = 0.0
    holders: dict[int, Holder] = {}  # node slot -> its current (or last) holder, as the log goes
    filled = False  # every node slot was held once: later joins are rejoins

    for event in events:
        t = float(event.get("t", last_t))
        last_t = max(last_t, t)
        name = event["event"]
        if name == EventName.JOB_START:
            summary.script = event.get("script")
            summary.world_size = event.get("world_size")
            summary.nnodes = event.get("nnodes")
        elif name == EventName.PROGRESS and event.get("step") is not None:
            summary.progress.append((t, int(event["step"])))
        elif name == EventName.WORKER_FAILED:
            summary.failures.append(Failure(t, event.get("rank"), str(event.get("cause", "unknown cause")),
                                            event.get("node"), event.get("host"), event.get("node_incarnation")))
        elif name == EventName.RECOVERY_START:
            recovery = _start_recovery(recoveries, event, t)
            for slot in recovery.nodes:
                if slot not in recovery.holders:
                    recovery.holders[slot] = (holders.get(slot), None)
        elif name in (EventName.NODE_JOINED, EventName.NODE_TAKEOVER, EventName.NODE_LOST):
            filled = _node_event(summary, recoveries, holders, event, t, filled)
        elif name == EventName.RECOVERY_PHASE:
            recovery = _recovery_for(recoveries, event, t)
            if event.get("duration") is not None:
                recovery.phases[str(event.get("phase"))] = float(event["duration"])
        elif name == EventName.RECOVERY_END:
            recovery = _recovery_for(recoveries, event, t)
            recovery.t_end = t
            recovery.outcome = event.get("outcome")
            recovery.mode = event.get("mode")
            recovery.source_rank = event.get("source_rank")
            recovery.total = None if event.get("total") is None else float(event["total"])
            recovery.lost_steps = event.get("lost_steps")
            recovery.inexact = event.get("inexact")
        elif name == EventName.REPLAY:
            recovery = _recovery_for(recoveries, event, t)
            ranks = ", ".join(str(r) for r in event.get("ranks", [event.get("rank")]))
            text = f"rank(s) {ranks} replayed steps {event.get('first')}..{event.get('last')}"
            if text not in recovery.replays:
                recovery.replays.append(text)
        elif name == EventName.LOG_PLAN:
            summary.log_plan = str(event.get("message", ""))
        elif name == EventName.RESTART:
            restart_events.append(event)
        elif name == EventName.JOB_END:
            summary.finished = True
            summary.outcome = str(event.get("outcome", "unknown"))
            summary.exit_code = event.get("exit_code")
            if event.get("duration") is not None:
                last_t = max(last_t, float(event["duration"]))
            if event.get("time_lost") is not None:
                reported_time_lost = float(event["time_lost"])

    summary.duration = last_t
    summary.steps = max((step for _, step in summary.progress), default=None)
    summary.recoveries = sorted(recoveries.values(), key=lambda recovery: recovery.t_start)
    summary.restarts = [_restart(event, summary.progress) for event in restart_events]
    # The supervisor's own figure wins; for a job still running (or a launcher that died) estimate it.
    summary.time_lost = reported_time_lost if reported_time_lost is not None else _estimated_time_lost(summary)
    return summary


def _node_event(summary: JobSummary, recoveries: dict[int, Recovery], holders: dict[int, Holder],
                event: dict[str, Any], t: float, filled: bool) -> bool:
    """Fold one node event; returns whether every node slot has been held once (the job started)."""
    name, slot = event["event"], event.get("slot")
    node_rank, incarnation = event.get("node_rank"), event.get("incarnation")
    if name == EventName.NODE_LOST:
        holder = holders.get(slot) if slot is not None else None
        if holder is None or holder.incarnation != incarnation:
            holder = Holder(node_rank, event.get("host"), incarnation)
        summary.node_events.append(NodeEvent(t, slot, "lost", holder, str(event.get("cause", ""))))
        return filled
    if slot is None:
        summary.node_events.append(NodeEvent(t, None, "spare joined", Holder(node_rank, event.get("host"), None)))
        return filled
    takeover = name == EventName.NODE_TAKEOVER
    host = event.get("host")
    if takeover and host is None:  # a takeover names the spare by its node rank: its host came with its JOIN
        host = next((e.holder.host for e in reversed(summary.node_events)
                     if e.what == "spare joined" and e.holder.node_rank == node_rank), None)
    holder = Holder(node_rank, host, incarnation, spare=takeover)
    holders[slot] = holder
    if takeover or filled:
        summary.node_events.append(NodeEvent(t, slot, "taken over" if takeover else "rejoined", holder))
    for recovery in recoveries.values():
        before, after = recovery.holders.get(slot, (None, None))
        if slot in recovery.holders and after is None and recovery.t_end is None:
            recovery.holders[slot] = (before, holder)
    nnodes = summary.nnodes
    return filled or (nnodes is not None and len(holders) >= int(nnodes))


def _start_recovery(recoveries: dict[int, Recovery], event: dict[str, Any], t: float) -> Recovery:
    generation = int(event.get("generation", max(recoveries, default=0) + 1))
    cause = str(event.get("cause", "unknown cause"))
    failed_ranks = tuple(event.get("failed_ranks") or ())
    nodes = tuple(int(n) for n in event.get("nodes") or ())
    ongoing = next((recovery for recovery in recoveries.values() if recovery.t_end is None), None)
    if event.get("during_recovery") and ongoing is not None:
        # Another failure mid-recovery: the supervisor carries on with the same recovery in a new generation,
        # so it is one recovery (one span of lost time), now known by the new generation.
        del recoveries[ongoing.generation]
        ongoing.generation = generation
        ongoing.cause = f"{ongoing.cause}; then {cause}"
        ongoing.failed_ranks = failed_ranks or ongoing.failed_ranks
        ongoing.nodes = tuple(sorted(set(ongoing.nodes) | set(nodes)))
        recoveries[generation] = ongoing
        return ongoing
    recoveries[generation] = Recovery(generation=generation, t_start=t, cause=cause, failed_ranks=failed_ranks,
                                      nodes=nodes)
    return recoveries[generation]


def _recovery_for(recoveries: dict[int, Recovery], event: dict[str, Any], t: float) -> Recovery:
    """The recovery an event belongs to; a log that starts mid-recovery gets a placeholder."""
    generation = int(event.get("generation", max(recoveries, default=0)))
    if generation not in recoveries:
        recoveries[generation] = Recovery(generation=generation, t_start=float(event.get("start", t)), cause="?")
    return recoveries[generation]


def _restart(event: dict[str, Any], progress: list[tuple[float, int]]) -> Restart:
    t = float(event.get("t", 0.0))
    resumed_at = next((when for when, _ in progress if when > t), None)
    return Restart(t, event.get("attempt"), str(event.get("reason", "")), resumed_at)


def _estimated_time_lost(summary: JobSummary) -> float:
    """Recoveries count from failure to resume; restarts from the restart to the next progress event.

    Unfinished ones count up to the end of the log, since that time is lost so far.
    """
    lost = 0.0
    for recovery in summary.recoveries:
        if recovery.total is not None:
            lost += recovery.total
        else:
            lost += (recovery.t_end if recovery.t_end is not None else summary.duration) - recovery.t_start
    for restart in summary.restarts:
        lost += (restart.resumed_at if restart.resumed_at is not None else summary.duration) - restart.t
    return lost


# --- text -------------------------------------------------------------------------------------------------------


def format_summary(summary: JobSummary, source: Path) -> list[str]:
    lines = [f"swiftrun report: {source}"]
    job = summary.script or "unknown script"
    if summary.world_size is not None:
        job += f", world {summary.world_size}"
    lines.append(f"job:        {job}")
    outcome = summary.outcome
    if summary.exit_code is not None:
        outcome += f" (exit code {summary.exit_code})"
    if not summary.finished:
        outcome += " (no job_end yet: still running, or the launcher died)"
    lines.append(f"outcome:    {outcome}")
    lines.append(f"duration:   {summary.duration:.1f} s")
    lines.append(f"steps:      {'-' if summary.steps is None else summary.steps}")

    if summary.nnodes is not None and (summary.nnodes > 1 or summary.node_events):
        lines.extend(_node_lines(summary))
    lines.append(f"failures:   {len(summary.failures)}")
    for failure in summary.failures:
        who = "?" if failure.rank is None else failure.rank
        where = ""
        if failure.node is not None:
            details = [failure.host] if failure.host else []
            details += [] if failure.node_incarnation is None else [f"incarnation {failure.node_incarnation}"]
            where = f" on node slot {failure.node}" + (f" ({', '.join(details)})" if details else "")
        lines.append(f"  t={failure.t:.1f}s  rank {who}{where}: {failure.cause}")

    lines.append(f"recoveries: {len(summary.recoveries)}")
    for recovery in summary.recoveries:
        lines.extend(_recovery_lines(recovery))

    if summary.log_plan:
        lines.append(f"logging:    {summary.log_plan}")
    lines.append(f"restarts:   {len(summary.restarts)}")
    for restart in summary.restarts:
        attempt = "" if restart.attempt is None else f" attempt {restart.attempt}"
        lines.append(f"  t={restart.t:.1f}s{attempt}: {restart.reason}")

    lines.append(f"time lost:  {summary.time_lost:.2f} s")
    goodput = summary.goodput
    lines.append(f"goodput:    {'-' if goodput is None else f'{goodput:.1%}'}")
    return lines


def _node_lines(summary: JobSummary) -> list[str]:
    counts = {what: sum(1 for e in summary.node_events if e.what == what)
              for what in ("lost", "taken over", "rejoined", "spare joined")}
    figures = [f"{summary.nnodes} node slots"] + [f"{n} {what}" for what, n in counts.items() if n]
    lines = [f"nodes:      {', '.join(figures)}"]
    for event in summary.node_events:
        if event.slot is None:
            lines.append(f"  t={event.t:.1f}s  hot spare joined: {event.holder.describe()}")
        elif event.what == "lost":
            cause = f": {event.cause}" if event.cause else ""
            lines.append(f"  t={event.t:.1f}s  node slot {event.slot} lost ({event.holder.describe()}){cause}")
        else:
            lines.append(f"  t={event.t:.1f}s  node slot {event.slot} {event.what} by {event.holder.describe()}")
    return lines


def _recovery_lines(recovery: Recovery) -> list[str]:
    if recovery.t_end is None:
        status = "in progress"
    else:
        status = recovery.outcome or "ended"
        if recovery.mode:
            status += f", {recovery.mode}"
        if recovery.source_rank is not None:
            status += f" from rank {recovery.source_rank}"
        if recovery.total is not None:
            status += f", total {recovery.total * 1000:.0f} ms"
        if recovery.lost_steps is not None:
            status += f", {recovery.lost_steps} steps lost"
        if recovery.inexact:
            status += ", INEXACT"
    head = f"  generation {recovery.generation} at t={recovery.t_start:.1f}s: {recovery.cause} -> {status}"
    # Known phases in protocol order, then anything newer the supervisor logged.
    order: list[str] = [phase.value for phase in RecoveryPhase if phase.value in recovery.phases]
    order += [name for name in recovery.phases if name not in order]
    phases = "  ".join(f"{name} {recovery.phases[name] * 1000:.0f}" for name in order)
    replays = [f"    replay: {text}" for text in recovery.replays]
    nodes = []
    for slot in recovery.nodes:
        before, after = recovery.holders.get(slot, (None, None))
        text = f"    node slot {slot}: {before.describe() if before else 'holder unknown'}"
        if after is not None and after != before:
            text += f" -> {after.describe()}"
        nodes.append(text)
    inexact = [f"    inexact: {recovery.inexact}"] if recovery.inexact else []
    return [head, f"    phases (ms): {phases or 'none recorded'}", *inexact, *nodes, *replays]


# --- plot -------------------------------------------------------------------------------------------------------


class PlotUnavailable(Exception):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise PlotUnavailable(str(error)) from error
    return plt


def draw_timeline(summary: JobSummary, out: Path, plt: Any) -> None:
    """Step over time; failures as red lines, recoveries and restarts as shaded spans."""
    figure, axes = plt.subplots(figsize=(10, 4))
    if summary.progress:
        times, steps = zip(*summary.progress)
        axes.plot(times, steps, color="tab:blue", linewidth=1.2, label="step")
    for index, failure in enumerate(summary.failures):
        axes.axvline(failure.t, color="tab:red", linestyle="--", linewidth=1, label="failure" if index == 0 else None)
    for index, recovery in enumerate(summary.recoveries):
        end = recovery.t_end if recovery.t_end is not None else summary.duration
        axes.axvspan(recovery.t_start, end, color="tab:orange", alpha=0.3, label="recovery" if index == 0 else None)
    for index, restart in enumerate(summary.restarts):
        end = restart.resumed_at if restart.resumed_at is not None else summary.duration
        axes.axvspan(restart.t, end, color="tab:purple", alpha=0.25, label="restart" if index == 0 else None)
    goodput = summary.goodput
    title = summary.script or "swiftrun job"
    if goodput is not None:
        title += f"  (goodput {goodput:.1%})"
    axes.set(title=title, xlabel="time since start (s)", ylabel="step")
    if axes.get_legend_handles_labels()[0]:
        axes.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)


# --- command ----------------------------------------------------------------------------------------------------


def _fail(message: str) -> typer.Exit:
    typer.echo(f"swiftrun report: error: {message}", err=True)
    return typer.Exit(code=1)


@app.command()
def report(
    eventlog: Annotated[Path, typer.Argument(metavar="EVENTLOG", help="The job's events.jsonl.")],
    plot: Annotated[
        Optional[Path], typer.Option("--plot", metavar="FILE.png", help="Also draw the timeline to this PNG.")
    ] = None,
) -> None:
    # Fail before any output when the plot cannot be drawn, rather than after printing a summary.
    plt = None
    if plot is not None:
        try:
            plt = _pyplot()
        except PlotUnavailable:
            raise _fail(f"--plot needs matplotlib, which is not installed; run: {PLOT_INSTALL_HINT}") from None

    if not eventlog.is_file():
        raise _fail(f"no event log at {eventlog}")
    try:
        events = list(read_events(eventlog))
    except (OSError, UnicodeDecodeError) as error:
        raise _fail(f"cannot read {eventlog}: {error}") from None
    if not events:
        raise _fail(f"{eventlog} holds no events (empty, or not a swiftrun event log)")

    try:
        summary = summarize(events)
    except (TypeError, ValueError) as error:
        raise _fail(f"{eventlog} has a malformed event: {error}") from None
    for line in format_summary(summary, eventlog):
        typer.echo(line)
    if plt is not None and plot is not None:
        try:
            draw_timeline(summary, plot, plt)
        except (OSError, ValueError) as error:
            raise _fail(f"cannot write the plot to {plot}: {error}") from None
        typer.echo(f"plot:       {plot}")


def main(argv: list[str] | None = None) -> int:
    """Run ``swiftrun report`` with ``argv`` (the arguments after ``report``); returns the exit code."""
    try:
        app(args=sys.argv[1:] if argv is None else argv, prog_name="swiftrun report")
    except SystemExit as exit_:
        # typer always exits via SystemExit in standalone mode; turn it into a return code for the CLI.
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0
