"""Render a :class:`~swiftrun.snapshot.JobSnapshot` as a rich renderable.

:func:`render` is a pure function of the snapshot: no clock, no I/O, no terminal queries. The live dashboard calls
it from rich's refresh thread and tests call it with a fixed-size capture console.

The layout is sized for a 150x45 terminal whatever the job size:

- a header panel (4 lines): script, world, generation, uptime, job state, throughput, failures, event log;
- the ranks: one row per rank up to :data:`FOLD_ABOVE` ranks; above that a summary (counts per state, step
  spread) and only the notable ranks (not running, slowest, silent, behind), at most :data:`MAX_NOTABLE_ROWS`;
- the current or last recovery (4 lines): cause, every phase with its duration, mode, source, total;
- the tail of notable events, shrunk first when lines run short.

A multi-node job (the snapshot has ``nodes``) groups ranks by node: a table of node slots (state, host, node
rank, incarnation, ranks, agent heartbeat) then the ranks with their node slot. When that does not fit, healthy
nodes collapse into one summary line and only the problem nodes get a row (lost, rejoining, waiting, quiet
agent, or a rank of its own failed, being replaced, slow, silent or behind; most alarming first, at most
:data:`MAX_NODE_ROWS`), followed by the notable ranks of the nodes still live.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from swiftrun.snapshot import (
    JobSnapshot,
    JobState,
    NodeSlotState,
    NodeView,
    RankView,
    RecoveryPhase,
    RecoveryView,
    WorkerState,
)

TARGET_HEIGHT = 45  # lines; the dashboard must fit a 150x45 terminal
FOLD_ABOVE = 32  # ranks; more than this and only the notable ranks get a row
MAX_NOTABLE_ROWS = 20  # rows in the folded table, so a job with 4096 failed ranks still fits
MAX_EVENT_LINES = 5
TOP_FEW = 3  # how many slowest / most silent / furthest behind ranks a folded view names
MAX_NODE_ROWS = 8  # node rows in a collapsed multi-node view: the ranks of live nodes need room too
NODE_SUMMARY_LINES = 2  # multi-node, collapsed: counts per node state; the collapsed nodes' line

# Heights of the fixed sections, so the ranks and the event tail can share what is left.
HEADER_LINES = 4  # panel borders + 2 lines
RECOVERY_LINES = 4  # panel borders (title above, mode/total below) + phase names + durations
EVENT_CHROME_LINES = 2  # panel borders
TABLE_CHROME_LINES = 2  # column header + rule below it (box.SIMPLE_HEAD without edges)
FOLD_SUMMARY_LINES = 2  # counts per state; step and timing spread

# A heartbeat older than this is worth a colour and a row: a few missed beats at the usual 0.5 s interval. The
# supervisor's own liveness deadline, not this constant, decides when a worker is declared failed.
QUIET_HEARTBEAT_S = 2.0
# A step this much slower than the median is a straggler; below it, rank-to-rank jitter is not worth a row.
SLOW_FACTOR = 1.25

STATE_STYLES: dict[WorkerState, str] = {
    WorkerState.STARTING: "cyan",
    WorkerState.RUNNING: "green",
    WorkerState.ABORTING: "yellow",
    WorkerState.JOINING: "bright_cyan",
    WorkerState.RECOVERING: "bold yellow",
    WorkerState.REPLAYING: "magenta",
    WorkerState.FINISHING: "bright_green",
    WorkerState.RESTARTING: "bold yellow",
    WorkerState.STOPPING: "dim",
    WorkerState.EXITED: "blue",
    WorkerState.FAILED: "bold red",
}

JOB_STATE_STYLES: dict[JobState, str] = {
    JobState.STARTING: "cyan",
    JobState.RUNNING: "bold green",
    JobState.RECOVERING: "bold yellow",
    JobState.RESTARTING: "bold yellow",
    JobState.STOPPING: "dim",
    JobState.SUCCEEDED: "bold blue",
    JobState.FAILED: "bold red",
}

NODE_STATE_STYLES: dict[NodeSlotState, str] = {
    NodeSlotState.WAITING: "cyan",
    NodeSlotState.LIVE: "green",
    NodeSlotState.REJOINING: "bright_cyan",
    NodeSlotState.LOST: "bold red",
    NodeSlotState.SPARE: "blue",
}
# Most alarming first; a LIVE node with a problem rank sorts after these, a healthy one is never listed.
_NODE_SEVERITY: tuple[NodeSlotState, ...] = (
    NodeSlotState.LOST, NodeSlotState.REJOINING, NodeSlotState.WAITING, NodeSlotState.LIVE, NodeSlotState.SPARE,
)

# Most alarming first: the folded view lists non-running ranks in this order.
_STATE_SEVERITY: tuple[WorkerState, ...] = (
    WorkerState.FAILED,
    WorkerState.ABORTING,
    WorkerState.RESTARTING,
    WorkerState.RECOVERING,
    WorkerState.REPLAYING,
    WorkerState.JOINING,
    WorkerState.STARTING,
    WorkerState.STOPPING,
    WorkerState.FINISHING,  # done training, waiting for the others: worth a row, never alarming
    WorkerState.EXITED,
    WorkerState.RUNNING,
)


def render(snapshot: JobSnapshot) -> RenderableType:
    """The whole dashboard for one snapshot; fits :data:`TARGET_HEIGHT` lines at any world size."""
    recovery_lines = RECOVERY_LINES if snapshot.recovery is not None else 0
    fixed_lines = HEADER_LINES + recovery_lines
    event_floor = EVENT_CHROME_LINES + 1 if snapshot.events else 0

    room = TARGET_HEIGHT - fixed_lines - event_floor
    ranks_section: RenderableType
    if snapshot.nodes:  # multi-node: grouped by node
        ranks_section, ranks_lines = _nodes_section(snapshot, room)
    elif len(snapshot.ranks) <= FOLD_ABOVE and TABLE_CHROME_LINES + len(snapshot.ranks) <= room:
        ranks_section, ranks_lines = _rank_table(snapshot.ranks), TABLE_CHROME_LINES + len(snapshot.ranks)
    else:
        ranks_section, ranks_lines = _folded_ranks(snapshot, room)

    parts: list[RenderableType] = [_header(snapshot), ranks_section]
    if snapshot.recovery is not None:
        parts.append(_recovery_panel(snapshot.recovery, ongoing=snapshot.state is JobState.RECOVERING))
    if snapshot.events:
        room = TARGET_HEIGHT - fixed_lines - ranks_lines - EVENT_CHROME_LINES
        parts.append(_events_panel(snapshot.events, max(1, min(MAX_EVENT_LINES, room))))
    return Group(*parts)


# --- header -----------------------------------------------------------------------------------------------------


def _header(snapshot: JobSnapshot) -> Panel:
    nodes = "node" if snapshot.nnodes == 1 else "nodes"
    identity = Text.assemble(
        (snapshot.script, "bold"),
        f"  ·  world {snapshot.world_size} on {snapshot.nnodes} {nodes}",
        f"  ·  generation {snapshot.generation}",
        f"  ·  up {format_clock(snapshot.uptime)}  ·  ",
        (snapshot.state.value.upper(), JOB_STATE_STYLES[snapshot.state]),
        no_wrap=True,
        overflow="ellipsis",
    )

    figures = Text(f"{_fmt_rate(snapshot.steps_per_s)} steps/s", no_wrap=True, overflow="ellipsis")
    if len(snapshot.rate_history) >= 2:
        figures.append(f" {sparkline(snapshot.rate_history)}", style="cyan")
    if snapshot.samples_per_s is not None:
        figures.append(f"  ·  {_fmt_rate(snapshot.samples_per_s)} {throughput_unit(snapshot)}")
    failures = "1 failure" if snapshot.failures == 1 else f"{snapshot.failures} failures"
    figures.append("  ·  ")
    losses = f"{failures}, {format_duration(snapshot.time_lost)} lost"
    figures.append(losses, style="yellow" if snapshot.failures else "")
    if snapshot.nodes:
        figures.append("  ·  ")
        figures.append_text(_node_counts(snapshot.nodes))
    if snapshot.event_log:
        figures.append(f"  ·  log {snapshot.event_log}", style="dim")
    return Panel(Group(identity, figures), title="swiftrun", title_align="left", box=box.ROUNDED)


SPARK_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: tuple[float, ...]) -> str:
    """One bar per value, scaled to the largest: a recovery shows as a dip to the lowest bar."""
    top = max(values)
    if top <= 0:
        return SPARK_BARS[0] * len(values)
    return "".join(SPARK_BARS[min(len(SPARK_BARS) - 1, int(v / top * (len(SPARK_BARS) - 1) + 0.5))] for v in values)


def throughput_unit(snapshot: JobSnapshot) -> str:
    """``samples/s`` unless the workers report tokens (the snapshot carries the number, not its unit)."""
    reports_tokens = any("tokens_per_s" in rank.metrics for rank in snapshot.ranks)
    reports_samples = any("samples_per_s" in rank.metrics for rank in snapshot.ranks)
    return "tokens/s" if reports_tokens and not reports_samples else "samples/s"


# --- ranks ------------------------------------------------------------------------------------------------------


def _new_rank_table(note_column: bool, node_column: bool = False) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for name in (("node",) if node_column else ()) + ("rank", "local", "pid"):
        table.add_column(name, justify="right")
    table.add_column("state")
    for name in ("step", "loss", "step ms", "heartbeat", "restarts"):
        table.add_column(name, justify="right")
    if note_column:
        table.add_column("why", style="italic")
    return table


def _rank_cells(rank: RankView, node_column: bool = False) -> list[RenderableType]:
    heartbeat = Text(_fmt_age(rank.heartbeat_age))
    if rank.heartbeat_age is not None and rank.heartbeat_age >= QUIET_HEARTBEAT_S and not rank.state.terminal:
        heartbeat.stylize("bold red")
    node: list[RenderableType] = ["-" if rank.node is None else str(rank.node)] if node_column else []
    return node + [
        str(rank.rank),
        str(rank.local_rank),
        "-" if rank.pid is None else str(rank.pid),
        Text(rank.state.value, style=STATE_STYLES[rank.state]),
        "-" if rank.step is None else str(rank.step),
        "-" if rank.loss is None else f"{rank.loss:.4g}",
        "-" if rank.step_time is None else f"{rank.step_time * 1000:.1f}",
        heartbeat,
        Text(str(rank.restarts), style="yellow" if rank.restarts else ""),
    ]


def _rank_table(ranks: tuple[RankView, ...]) -> Table:
    table = _new_rank_table(note_column=False)
    for rank in ranks:
        table.add_row(*_rank_cells(rank))
    return table


@dataclass(frozen=True)
class NotableRank:
    rank: RankView
    reasons: tuple[str, ...]


def notable_ranks(ranks: tuple[RankView, ...]) -> tuple[list[NotableRank], Counter[WorkerState]]:
    """The ranks a folded view lists, in display order, and the not-running ranks left out, per state.

    Every rank that is not RUNNING is notable; among the live ones the slowest (at least :data:`SLOW_FACTOR`
    times the median step time), the most silent (no heartbeat for :data:`QUIET_HEARTBEAT_S`) and those more
    than one step behind the leader are named, :data:`TOP_FEW` of each. Non-running ranks beyond what
    :data:`MAX_NOTABLE_ROWS` leaves room for are counted instead of listed.
    """
    reasons: dict[int, list[str]] = {}
    by_rank = {rank.rank: rank for rank in ranks}

    not_running = sorted(
        (rank for rank in ranks if rank.state is not WorkerState.RUNNING),
        key=lambda rank: (_STATE_SEVERITY.index(rank.state), rank.rank),
    )
    # Reserve rows for the slow/silent/behind picks so a mass restart cannot hide a straggler.
    listed_not_running = not_running[: MAX_NOTABLE_ROWS - 3 * TOP_FEW]
    left_out = Counter(rank.state for rank in not_running[len(listed_not_running) :])
    for rank in listed_not_running:
        reasons[rank.rank] = [rank.state.value]

    live = [rank for rank in ranks if not rank.state.terminal]
    times = [rank.step_time for rank in live if rank.step_time is not None]
    if times:
        slow_from = SLOW_FACTOR * statistics.median(times)
        slowest = sorted(
            (rank for rank in live if rank.step_time is not None and rank.step_time >= slow_from),
            key=lambda rank: (-(rank.step_time or 0), rank.rank),
        )
        for rank in slowest[:TOP_FEW]:
            reasons.setdefault(rank.rank, []).append("slow")
    silent = sorted(
        (rank for rank in live if rank.heartbeat_age is not None and rank.heartbeat_age >= QUIET_HEARTBEAT_S),
        key=lambda rank: (-(rank.heartbeat_age or 0), rank.rank),
    )
    for rank in silent[:TOP_FEW]:
        reasons.setdefault(rank.rank, []).append("silent")
    steps = [rank.step for rank in live if rank.step is not None]
    if steps:
        lead = max(steps)
        # One step apart is sampling jitter between ranks, not lag.
        behind = sorted(
            (rank for rank in live if rank.step is not None and lead - rank.step > 1),
            key=lambda rank: (rank.step, rank.rank),
        )
        for rank in behind[:TOP_FEW]:
            reasons.setdefault(rank.rank, []).append(f"behind {lead - (rank.step or 0)}")

    listed = [NotableRank(by_rank[number], tuple(why)) for number, why in reasons.items()]
    return listed, left_out


def _folded_ranks(snapshot: JobSnapshot, lines_available: int) -> tuple[RenderableType, int]:
    """Summary plus the notable ranks, within ``lines_available``; returns the renderable and its height."""
    ranks = snapshot.ranks
    counts = Counter(rank.state for rank in ranks)
    per_state = Text(f"{len(ranks)} ranks:  ", style="bold", no_wrap=True, overflow="ellipsis")
    for state in _STATE_SEVERITY[::-1]:  # running first: the healthy majority reads as the baseline
        if counts[state]:
            per_state.append(f"{state.value} {counts[state]}", style=STATE_STYLES[state])
            per_state.append("  ")

    spread = Text(_spread_line(ranks), no_wrap=True, overflow="ellipsis")

    listed, left_out = notable_ranks(ranks)
    row_room = lines_available - FOLD_SUMMARY_LINES - TABLE_CHROME_LINES - 1  # 1: the "more" line
    rows = listed[: max(0, row_room)]
    for dropped in listed[len(rows) :]:
        left_out[dropped.rank.state] += 1

    parts: list[RenderableType] = [per_state, spread]
    height = FOLD_SUMMARY_LINES
    if rows:
        table = _new_rank_table(note_column=True)
        for entry in rows:
            table.add_row(*_rank_cells(entry.rank), ", ".join(entry.reasons))
        parts.append(table)
        height += TABLE_CHROME_LINES + len(rows)
    if not rows and not left_out:
        parts.append(Text("no notable ranks: all running, in step, none slow or silent", style="green"))
        height += 1
    if left_out:
        more = ", ".join(f"{state.value} {count}" for state, count in sorted(left_out.items(), key=_by_severity))
        parts.append(Text(f"… and {sum(left_out.values())} more not listed ({more})", style="dim"))
        height += 1
    return Group(*parts), height


def _spread_line(ranks: tuple[RankView, ...]) -> str:
    steps = sorted(rank.step for rank in ranks if rank.step is not None)
    pieces = []
    if steps:
        pieces.append(f"step min {steps[0]}  median {_fmt_number(statistics.median(steps))}  max {steps[-1]}")
    else:
        pieces.append("no steps reported yet")
    times = [rank.step_time for rank in ranks if rank.step_time is not None]
    if times:
        pieces.append(f"step ms median {statistics.median(times) * 1000:.1f}  max {max(times) * 1000:.1f}")
    ages = [rank.heartbeat_age for rank in ranks if rank.heartbeat_age is not None]
    if ages:
        pieces.append(f"oldest heartbeat {_fmt_age(max(ages))}")
    restarts = sum(rank.restarts for rank in ranks)
    if restarts:
        pieces.append(f"restarts {restarts}")
    return "  ·  ".join(pieces)


def _by_severity(item: tuple[WorkerState, int]) -> int:
    return _STATE_SEVERITY.index(item[0])


# --- nodes (multi-node) ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeRow:
    node: NodeView
    ranks: tuple[RankView, ...]  # the ranks this node slot owns, in the snapshot
    problems: tuple[str, ...]  # why it is listed; empty: healthy


def live_node_ranks(snapshot: JobSnapshot) -> tuple[list[NotableRank], Counter[WorkerState]]:
    """:func:`notable_ranks` among the ranks of LIVE nodes: a lost or rejoining node's row says what its ranks do."""
    live_slots = {node.slot for node in snapshot.nodes if node.state is NodeSlotState.LIVE}
    return notable_ranks(tuple(rank for rank in snapshot.ranks if rank.node in live_slots))


def node_rows(snapshot: JobSnapshot, live_notable: list[NotableRank] | None = None) -> list[NodeRow]:
    """Every node with its ranks and problems, most alarming first (healthy live nodes last, in slot order).

    A node has a problem when it is not LIVE (lost, rejoining, waiting), when its agent has been quiet for
    :data:`QUIET_HEARTBEAT_S`, or when a rank of its own is in trouble (:func:`_rank_problems`).
    Hot-spare nodes come after the problem nodes: worth a row when there is room, never alarming.
    """
    by_node: dict[int, list[RankView]] = {}
    for rank in snapshot.ranks:
        if rank.node is not None:
            by_node.setdefault(rank.node, []).append(rank)
    listed = live_node_ranks(snapshot)[0] if live_notable is None else live_notable
    # what makes a rank worth a look beyond its state: slow, silent, behind
    flags = {entry.rank.rank: [why for why in entry.reasons if why != entry.rank.state.value] for entry in listed}
    rows = []
    for node in snapshot.nodes:
        ranks = tuple(by_node.get(node.slot, ())) if node.slot is not None else ()
        problems: list[str] = []
        if node.state not in (NodeSlotState.LIVE, NodeSlotState.SPARE):
            problems.append(node.state.value)
        if node.heartbeat_age is not None and node.heartbeat_age >= QUIET_HEARTBEAT_S:
            problems.append(f"agent quiet {_fmt_age(node.heartbeat_age)}")
        if node.state is NodeSlotState.LIVE:
            problems += _rank_problems(ranks, flags)
        rows.append(NodeRow(node, ranks, tuple(problems)))

    def order(row: NodeRow) -> tuple[int, int, int, int]:
        if not row.problems:  # spares, then healthy nodes
            return (2 if row.node.state is NodeSlotState.SPARE else 3, 0, 0, row.node.slot or 0)
        worst = min((_STATE_SEVERITY.index(r.state) for r in row.ranks), default=len(_STATE_SEVERITY))
        return (0 if row.node.state is not NodeSlotState.LIVE else 1, _NODE_SEVERITY.index(row.node.state), worst,
                row.node.slot if row.node.slot is not None else row.node.node_rank or 0)

    return sorted(rows, key=order)


def _rank_problems(ranks: tuple[RankView, ...], flags: dict[int, list[str]]) -> list[str]:
    """What is wrong with a live node's ranks, e.g. ``rank 42 failed``, ``ranks 40-41 slow``.

    Moves the whole world makes together (aborting, recovering, restarting, finishing) are not a node's problem;
    a rank of its own failing or being replaced (failed, starting again, joining, replaying) is, and so is a
    slow, silent or lagging one.
    """
    reasons: dict[str, list[int]] = {}
    for rank in ranks:
        replaced = rank.state is WorkerState.STARTING and rank.restarts > 0
        if rank.state in (WorkerState.FAILED, WorkerState.JOINING, WorkerState.REPLAYING) or replaced:
            reasons.setdefault(rank.state.value, []).append(rank.rank)
        for why in flags.get(rank.rank, ()):
            reasons.setdefault(why.split()[0], []).append(rank.rank)  # "behind 3" -> "behind"
    return [f"rank{'s' if len(numbers) > 1 else ''} {_ranges(numbers)} {why}" for why, numbers in reasons.items()]


def _nodes_section(snapshot: JobSnapshot, lines_available: int) -> tuple[RenderableType, int]:
    """Ranks grouped by node; when everything does not fit, problem nodes expanded and healthy ones collapsed."""
    full_lines = TABLE_CHROME_LINES + len(snapshot.nodes) + (TABLE_CHROME_LINES + len(snapshot.ranks)
                                                              if snapshot.ranks else 0)
    if len(snapshot.ranks) <= FOLD_ABOVE and full_lines <= lines_available:
        parts: list[RenderableType] = [_node_table([NodeRow(n, (), ()) for n in snapshot.nodes], with_ranks=False)]
        if snapshot.ranks:
            table = _new_rank_table(note_column=False, node_column=True)
            for rank in snapshot.ranks:
                table.add_row(*_rank_cells(rank, node_column=True))
            parts.append(table)
        return Group(*parts), full_lines

    # one pass over the ranks for what is notable (at 10,000 ranks each pass is tens of ms)
    listed, left_out = live_node_ranks(snapshot)
    rows = node_rows(snapshot, listed)
    problem_rows = [row for row in rows if row.problems]
    spare_rows = [row for row in rows if row.node.state is NodeSlotState.SPARE]
    # room: the summary lines, then node rows (problems first, then spares), then the ranks of live nodes
    rank_floor = TABLE_CHROME_LINES + TOP_FEW if snapshot.ranks else 0
    node_room = max(1, min(MAX_NODE_ROWS, lines_available - NODE_SUMMARY_LINES - 1 - TABLE_CHROME_LINES - rank_floor))
    shown = (problem_rows + spare_rows)[:node_room]
    shown_ids = {id(row) for row in shown}
    collapsed = [row for row in rows if id(row) not in shown_ids]

    parts = [_node_counts_line(snapshot)]
    height = 1
    if shown:
        parts.append(_node_table(shown, with_ranks=True))
        height += TABLE_CHROME_LINES + len(shown)
    parts.append(_collapsed_line(collapsed))
    height += 1

    # the notable ranks of live nodes: a lost or rejoining node's row already says what its ranks do
    row_room = lines_available - height - TABLE_CHROME_LINES - 1  # 1: the "more" line
    ranks_shown = listed[: max(0, row_room)]
    for dropped in listed[len(ranks_shown):]:
        left_out[dropped.rank.state] += 1
    if ranks_shown:
        table = _new_rank_table(note_column=True, node_column=True)
        for entry in ranks_shown:
            table.add_row(*_rank_cells(entry.rank, node_column=True), ", ".join(entry.reasons))
        parts.append(table)
        height += TABLE_CHROME_LINES + len(ranks_shown)
    if left_out:
        more = ", ".join(f"{state.value} {count}" for state, count in sorted(left_out.items(), key=_by_severity))
        parts.append(Text(f"… and {sum(left_out.values())} more ranks of live nodes not listed ({more})",
                          style="dim"))
        height += 1
    return Group(*parts), height


def _node_counts(nodes: tuple[NodeView, ...], prefix: str = "nodes ") -> Text:
    counts = Counter(node.state for node in nodes)
    text = Text(no_wrap=True, overflow="ellipsis")
    pieces = [state for state in (NodeSlotState.LIVE, NodeSlotState.REJOINING, NodeSlotState.LOST,
                                  NodeSlotState.WAITING) if counts[state]]
    for index, state in enumerate(pieces):
        text.append((prefix if index == 0 else "  ") + f"{state.value} {counts[state]}",
                    style=NODE_STATE_STYLES[state])
    if counts[NodeSlotState.SPARE]:
        text.append(f"  spare {counts[NodeSlotState.SPARE]}", style=NODE_STATE_STYLES[NodeSlotState.SPARE])
    return text


def _node_counts_line(snapshot: JobSnapshot) -> Text:
    slots = sum(1 for node in snapshot.nodes if node.slot is not None)
    line = Text(f"{slots} node slots:  ", style="bold", no_wrap=True, overflow="ellipsis")
    line.append_text(_node_counts(snapshot.nodes, prefix=""))
    if snapshot.ranks:
        counts = Counter(rank.state for rank in snapshot.ranks)
        line.append(f"  ·  {len(snapshot.ranks)} ranks:  ")
        for state in _STATE_SEVERITY[::-1]:  # running first: the healthy majority reads as the baseline
            if counts[state]:
                line.append(f"{state.value} {counts[state]}", style=STATE_STYLES[state])
                line.append("  ")
    return line


def _collapsed_line(collapsed: list[NodeRow]) -> Text:
    if not collapsed:
        return Text("every node is listed above", style="dim")
    healthy = [row for row in collapsed if not row.problems]
    hidden = len(collapsed) - len(healthy)
    slots = sorted(row.node.slot for row in healthy if row.node.slot is not None)
    ranks = Counter(rank.state for row in collapsed for rank in row.ranks)
    text = Text(no_wrap=True, overflow="ellipsis")
    if healthy:
        text.append(f"{len(healthy)} healthy node{'s' if len(healthy) > 1 else ''}", style="green")
        if slots:
            text.append(f" (slot{'s' if len(slots) > 1 else ''} {_ranges(slots)})")
    if hidden:
        text.append(f"{', ' if healthy else ''}{hidden} more with problems not listed", style="bold yellow")
    if ranks:
        states = ", ".join(f"{state.value} {ranks[state]}" for state in _STATE_SEVERITY[::-1] if ranks[state])
        text.append(f"  ·  their ranks: {states}")
    steps = [rank.step for row in healthy for rank in row.ranks if rank.step is not None]
    if steps:
        text.append(f"  ·  step {min(steps)}" + (f"-{max(steps)}" if max(steps) != min(steps) else ""))
    return text


def _node_table(rows: list[NodeRow], with_ranks: bool) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for name in ("node", "state", "host", "node rank", "incarnation", "ranks", "agent heartbeat"):
        table.add_column(name, justify="left" if name in ("state", "host") else "right")
    if with_ranks:
        table.add_column("ranks by state")
        table.add_column("why", style="italic")
    for row in rows:
        node = row.node
        heartbeat = Text(_fmt_age(node.heartbeat_age))
        if node.heartbeat_age is not None and node.heartbeat_age >= QUIET_HEARTBEAT_S:
            heartbeat.stylize("bold red")
        cells: list[RenderableType] = [
            "-" if node.slot is None else str(node.slot),
            Text(node.state.value, style=NODE_STATE_STYLES[node.state]),
            Text(node.host or "-", no_wrap=True, overflow="ellipsis"),
            "-" if node.node_rank is None else str(node.node_rank),
            "-" if node.incarnation is None else str(node.incarnation),
            _ranges(list(node.ranks)) if node.ranks else "-",
            heartbeat,
        ]
        if with_ranks:
            counts = Counter(rank.state for rank in row.ranks)
            by_state = Text()
            for state in _STATE_SEVERITY:
                if counts[state]:
                    by_state.append(f"{state.value} {counts[state]} ", style=STATE_STYLES[state])
            cells += [by_state if counts else "-", ", ".join(p for p in row.problems if p != node.state.value)]
        table.add_row(*cells)
    return table


def _ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    spans: list[list[int]] = []
    for number in sorted(numbers):
        if spans and spans[-1][1] == number - 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in spans)


# --- recovery ---------------------------------------------------------------------------------------------------


def _recovery_panel(recovery: RecoveryView, ongoing: bool) -> Panel:
    durations = {view.phase: view.duration for view in recovery.phases}
    # a replay only happens to a pipeline stage without a replica: its column shows only then
    shown = [p for p in RecoveryPhase if p is not RecoveryPhase.REPLAY or p in durations]
    grid = Table.grid(padding=(0, 3))
    for _ in shown:
        grid.add_column(justify="left")
    grid.add_row(*(Text(phase.value, style="bold") for phase in shown))
    grid.add_row(*(_phase_cell(phase, durations, recovery.done) for phase in shown))

    which = "recovery" if ongoing or not recovery.done else "last recovery"
    title = Text(f"{which} · generation {recovery.generation} · {recovery.cause}", no_wrap=True, overflow="ellipsis")
    if recovery.done:
        outcome = [recovery.mode or "mode unknown"]
        if recovery.source_rank is not None:
            outcome.append(f"state from rank {recovery.source_rank}")
        if recovery.total is not None:
            outcome.append(f"total {format_duration(recovery.total)}")
        if recovery.inexact:
            outcome.append("inexact undo")
        # an inexact undo is not the failure-free run: the panel says so in the warning colour
        subtitle = Text(" · ".join(outcome), style="yellow" if recovery.inexact else "green")
    else:
        subtitle = Text(" · ".join(filter(None, [recovery.mode, recovery.replay, "in progress"])), style="yellow")
    return Panel(
        grid,
        title=title,
        title_align="left",
        subtitle=subtitle,
        subtitle_align="right",
        box=box.ROUNDED,
        border_style="green" if recovery.done else "yellow",
    )


def _phase_cell(phase: RecoveryPhase, durations: dict[RecoveryPhase, float | None], done: bool) -> Text:
    if phase not in durations:
        # A finished recovery that never entered a phase skipped it (e.g. undo when rolling forward).
        return Text("skipped" if done else "·", style="dim")
    duration = durations[phase]
    if duration is None:
        return Text("running…", style="bold yellow")
    return Text(format_duration(duration))


# --- events -----------------------------------------------------------------------------------------------------


def _events_panel(events: tuple[str, ...], lines: int) -> Panel:
    tail = [Text(line, no_wrap=True, overflow="ellipsis") for line in events[-lines:]]
    return Panel(Group(*tail), title="events", title_align="left", box=box.ROUNDED, border_style="dim")


# --- formatting -------------------------------------------------------------------------------------------------


def format_duration(seconds: float) -> str:
    """Milliseconds below a second (recovery phases live there), then seconds, then minutes."""
    if seconds < 1.0:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60.0:
        return f"{seconds:.2f} s"
    return format_clock(seconds)


def format_clock(seconds: float) -> str:
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _fmt_age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s"


def _fmt_rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}"


def _fmt_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"
