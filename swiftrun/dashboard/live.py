"""Show job snapshots to a person: a live dashboard on a terminal, greppable lines everywhere else.

Both reporters share one interface (:class:`Reporter`) so the supervisor never asks which one it has:

- :meth:`~Reporter.update` is called from the supervisor's event loop and must stay cheap. The dashboard only
  stores the snapshot; rich's refresh thread renders the latest one about four times a second. The plain
  reporter compares it with the previous one and prints a line per visible change.
- :meth:`~Reporter.print_line` prints worker output. Under the dashboard it goes through the console, which rich's
  ``Live`` hooks so the line lands above the live region instead of tearing it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Protocol, TextIO

from rich.console import Console, RenderableType
from rich.live import Live
from rich.text import Text

from swiftrun.dashboard.render import format_clock, format_duration, render, throughput_unit
from swiftrun.snapshot import JobSnapshot, JobState, NodeSlotState, NodeView, RecoveryPhase, WorkerState

PREFIX = "[swiftrun]"
PROGRESS_EVERY_S = 10.0  # job time (snapshot uptime) between two progress lines


class Reporter(Protocol):
    def start(self) -> None: ...

    def update(self, snapshot: JobSnapshot) -> None: ...

    def print_line(self, text: str) -> None: ...

    def stop(self) -> None: ...


def _as_console(target: Console | TextIO) -> Console:
    return target if isinstance(target, Console) else Console(file=target)


class Dashboard:
    """A rich ``Live`` region redrawn from the latest snapshot by rich's own refresh thread."""

    def __init__(self, console: Console | TextIO, refresh_per_second: float = 4.0) -> None:
        self.console = _as_console(console)
        self._refresh_per_second = refresh_per_second
        self._latest: JobSnapshot | None = None
        self._drawn: tuple[JobSnapshot, RenderableType] | None = None  # the last snapshot and its renderable
        self._live: Live | None = None

    def start(self) -> None:
        if self._live is not None:
            return
        self._live = Live(
            console=self.console,
            refresh_per_second=self._refresh_per_second,
            get_renderable=self._renderable,
            # Keep the last frame on screen after stop(): it is the job's final state.
            transient=False,
        )
        self._live.start(refresh=True)

    def update(self, snapshot: JobSnapshot) -> None:
        # A single reference assignment: atomic under the GIL, and the refresh thread only ever reads it.
        self._latest = snapshot

    def print_line(self, text: str) -> None:
        # Console.out goes through Live's render hook, which prints above the live region; no markup or
        # highlighting, so worker output appears as the worker wrote it.
        self.console.out(text, highlight=False)

    def stop(self) -> None:
        if self._live is None:
            return
        live, self._live = self._live, None
        live.stop()  # draws once more, so a snapshot that came after the last timed refresh is shown

    def __enter__(self) -> Dashboard:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _renderable(self) -> RenderableType:
        latest, drawn = self._latest, self._drawn
        if latest is None:
            return Text("swiftrun: waiting for the first snapshot…", style="dim")
        if drawn is not None and drawn[0] is latest:
            return drawn[1]  # refreshes outnumber snapshots (10,000 ranks: one per ~2 s); render each once
        renderable = render(latest)
        self._drawn = (latest, renderable)
        return renderable


class PlainReporter:
    """One greppable line per visible change, for CI logs, files and pipes.

    Lines start with ``[swiftrun]``: job state changes, node state changes in a multi-node job (nodes that move
    together share a line), worker state changes (ranks that move together share a line), recovery start, each
    completed recovery phase with its duration, the end of a recovery, and a progress line at most every
    :data:`PROGRESS_EVERY_S` seconds of job time while steps advance.
    """

    def __init__(self, console: Console | TextIO, progress_every: float = PROGRESS_EVERY_S) -> None:
        self.console = _as_console(console)
        self._progress_every = progress_every
        self._previous: JobSnapshot | None = None
        self._last_progress_uptime: float | None = None
        self._last_progress_step: int | None = None

    def start(self) -> None:
        """Nothing to set up; here so both reporters share one interface."""

    def stop(self) -> None:
        """Nothing to tear down; the final state was printed when it changed."""

    def print_line(self, text: str) -> None:
        self.console.out(text, highlight=False)

    def update(self, snapshot: JobSnapshot) -> None:
        previous, self._previous = self._previous, snapshot
        for line in self._changes(previous, snapshot):
            self._emit(line)
        progress = self._progress(snapshot)
        if progress is not None:
            self._emit(progress)

    def _emit(self, message: str) -> None:
        self.console.out(f"{PREFIX} {message}", highlight=False)

    def _changes(self, previous: JobSnapshot | None, current: JobSnapshot) -> list[str]:
        lines: list[str] = []
        if previous is None:
            lines.append(
                f"job {current.state.value}: {current.script}, world {current.world_size} on {current.nnodes} node(s)"
            )
        elif current.state is not previous.state:
            lines.append(_job_state_line(previous.state, current))
        lines.extend(_node_changes(previous, current))
        lines.extend(_worker_changes(previous, current))
        lines.extend(_recovery_changes(previous, current))
        return lines

    def _progress(self, snapshot: JobSnapshot) -> str | None:
        steps = [rank.step for rank in snapshot.ranks if rank.step is not None]
        if not steps:
            return None
        step = max(steps)
        due = (
            self._last_progress_uptime is None
            or snapshot.uptime - self._last_progress_uptime >= self._progress_every
        )
        # A stalled job repeats nothing: the supervisor reports a stall as a failure in its own line.
        if not due or step == self._last_progress_step:
            return None
        self._last_progress_uptime = snapshot.uptime
        self._last_progress_step = step
        return progress_line(snapshot, step)


def progress_line(snapshot: JobSnapshot, step: int) -> str:
    fields = [f"step={step}"]
    if snapshot.steps_per_s is not None:
        fields.append(f"steps/s={snapshot.steps_per_s:.2f}")
    if snapshot.samples_per_s is not None:
        fields.append(f"{throughput_unit(snapshot)}={snapshot.samples_per_s:.0f}")
    loss = next((rank.loss for rank in sorted(snapshot.ranks, key=lambda r: r.rank) if rank.loss is not None), None)
    if loss is not None:
        fields.append(f"loss={loss:.4g}")
    fields += [
        f"gen={snapshot.generation}",
        f"failures={snapshot.failures}",
        f"lost={snapshot.time_lost:.1f}s",
        f"up={format_clock(snapshot.uptime)}",
    ]
    return " ".join(fields)


def _job_state_line(was: JobState, current: JobSnapshot) -> str:
    if current.state.terminal:
        return (
            f"job {current.state.value} after {format_clock(current.uptime)}"
            f" ({current.failures} failures, {format_duration(current.time_lost)} lost)"
        )
    return f"job {was.value} -> {current.state.value} (generation {current.generation})"


def _node_changes(previous: JobSnapshot | None, current: JobSnapshot) -> list[str]:
    """``node slot 1 (node rank 1, host-b, incarnation 0) live -> lost``; a slot with a new holder names both
    (a hot spare can take a lost slot before any snapshot showed it lost); many slots moving together share one
    line (a 1,000-node job coming up prints one line, not 1,000)."""
    before = {} if previous is None else {_node_key(node): node for node in previous.nodes}
    moves: dict[tuple[NodeSlotState | None, NodeSlotState], list[NodeView]] = defaultdict(list)
    lines = []
    for node in current.nodes:
        was = before.get(_node_key(node))
        # a new holder of a slot that had one (a slot's first agent, after WAITING, is no change of holder)
        new_holder = was is not None and was.node_rank is not None and \
            (was.incarnation, was.node_rank) != (node.incarnation, node.node_rank)
        if previous is None and node.state is NodeSlotState.WAITING:
            continue
        if was is not None and was.state is node.state and not new_holder:
            continue
        if was is not None and new_holder and node.slot is not None:
            lines.append(f"node slot {node.slot} ({_holder(node)}; was {_holder(was)}) "
                         f"{was.state.value} -> {node.state.value}")
            continue
        moves[(None if was is None else was.state, node.state)].append(node)
    for (was_state, now), nodes in moves.items():
        change = now.value if was_state is None else f"{was_state.value} -> {now.value}"
        if now is NodeSlotState.SPARE:
            for node in nodes:
                lines.append(f"hot-spare node rank {node.node_rank} ({node.host or '?'}) joined: waiting to take "
                             "over a lost node slot")
        elif len(nodes) == 1:
            holder = _holder(nodes[0])
            lines.append(f"node slot {nodes[0].slot}" + (f" ({holder})" if holder else "") + f" {change}")
        else:
            lines.append(f"node slots {rank_ranges([n.slot for n in nodes if n.slot is not None])} {change}")
    return lines


def _node_key(node: NodeView) -> tuple[str, int | None]:
    return ("slot", node.slot) if node.slot is not None else ("spare", node.node_rank)


def _holder(node: NodeView) -> str:
    """``node rank 1, host-b, incarnation 0``: the agent holding (or that last held) a node slot."""
    who = [f"node rank {node.node_rank}"] if node.node_rank is not None else []
    who += [node.host] if node.host else []
    who += [f"incarnation {node.incarnation}"] if node.incarnation is not None else []
    return ", ".join(who)


def _worker_changes(previous: JobSnapshot | None, current: JobSnapshot) -> list[str]:
    before = {} if previous is None else {rank.rank: rank.state for rank in previous.ranks}
    moves: dict[tuple[WorkerState | None, WorkerState], list[int]] = defaultdict(list)
    for rank in current.ranks:
        was = before.get(rank.rank)
        # The first snapshot says "job starting" already; only ranks that begin elsewhere are worth a line.
        if (previous is None and rank.state is WorkerState.STARTING) or was is rank.state:
            continue
        moves[(was, rank.state)].append(rank.rank)
    lines = []
    # Ranks that moved together share a line, so 4096 workers coming up print one line, not 4096.
    for (was, now), numbers in moves.items():
        who = f"rank {numbers[0]}" if len(numbers) == 1 else f"ranks {rank_ranges(numbers)}"
        lines.append(f"{who} {now.value}" if was is None else f"{who} {was.value} -> {now.value}")
    return lines


def _recovery_changes(previous: JobSnapshot | None, current: JobSnapshot) -> list[str]:
    recovery = current.recovery
    if recovery is None:
        return []
    old = previous.recovery if previous is not None else None
    if old is not None and old.generation != recovery.generation:
        old = None  # a new recovery: everything about it is news
    lines = []
    tag = f"recovery gen {recovery.generation}"
    if old is None and not recovery.done:
        lines.append(f"{tag} started: {recovery.cause}")
    finished_before: set[RecoveryPhase] = set()
    if old is not None:
        finished_before = {view.phase for view in old.phases if view.duration is not None}
    for view in recovery.phases:
        if view.duration is not None and view.phase not in finished_before:
            lines.append(f"{tag} {view.phase.value} {format_duration(view.duration)}")
    if recovery.done and (old is None or not old.done):
        details = [recovery.mode or "mode unknown"]
        if recovery.source_rank is not None:
            details.append(f"source rank {recovery.source_rank}")
        if recovery.inexact:
            details.append("inexact undo")
        total = "" if recovery.total is None else f" in {format_duration(recovery.total)}"
        lines.append(f"{tag} done{total} ({', '.join(details)})")
    return lines


def rank_ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    ordered = sorted(numbers)
    spans: list[str] = []
    start = end = ordered[0]
    for number in ordered[1:]:
        if number == end + 1:
            end = number
            continue
        spans.append(str(start) if start == end else f"{start}-{end}")
        start = end = number
    spans.append(str(start) if start == end else f"{start}-{end}")
    return ",".join(spans)


def make_reporter(console: Console, dashboard: bool | None = None) -> Dashboard | PlainReporter:
    """The live dashboard when asked for, or by default (``None``) when the console is a terminal."""
    wants_dashboard = console.is_terminal if dashboard is None else dashboard
    return Dashboard(console) if wants_dashboard else PlainReporter(console)
