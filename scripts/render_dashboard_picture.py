"""Render the README's picture: the dashboard in the middle of an in-place recovery, as SVG.

This is a rendering of a **synthetic** snapshot, not a screenshot of a run. The snapshot is built by hand with
swiftrun's own snapshot types (swiftrun/snapshot.py) and drawn by swiftrun's own renderer
(swiftrun/dashboard/render.py), the same function the live dashboard calls, on a 150-column console (the size
the dashboard is laid out for). Nothing is run.

The scene: 4 ranks of examples/train_dp.py with the default warm spare, rank 1 SIGKILLed at step 400 (the setup
of docs/BENCHMARKS.md section 2, `--fault 1:400:backward:sigkill`). The replacement has been forked from the
spare and reached swiftrun.Run; every rank is now recovering (rebuild, consensus, undo, transfer run inside the
workers, whose timings the launcher learns only when the recovery ends, so those phases show "·" until then).
The detect, abort and spawn durations are the medians of that benchmark section (0, 10 and 75 ms); step times
are near its 20.2 ms per step; pids, losses and uptime are made up but of the kind a real run shows.

    python scripts/render_dashboard_picture.py              # writes docs/img/dashboard-recovery.svg
    python scripts/render_dashboard_picture.py --out x.svg
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # draw with this checkout's renderer, not an installed swiftrun's

from swiftrun.dashboard.render import TARGET_HEIGHT, render  # noqa: E402
from swiftrun.snapshot import (  # noqa: E402
    JobSnapshot,
    JobState,
    PhaseView,
    RankView,
    RecoveryPhase,
    RecoveryView,
    WorkerState,
)

WIDTH = 150  # the terminal width the dashboard is laid out for
DEFAULT_OUT = ROOT / "docs" / "img" / "dashboard-recovery.svg"

EVENT_LOG = "/tmp/run/events.jsonl"
CAUSE = "rank 1 (local_rank 1) killed by SIGKILL (pid 41207)"


def synthetic_snapshot() -> JobSnapshot:
    """A made-up but plausible snapshot: 4 ranks, rank 1 replaced from the warm spare, recovery under way."""
    survivor = dict(state=WorkerState.RECOVERING, step=399, restarts=0)
    ranks = (
        RankView(rank=0, local_rank=0, pid=41205, loss=0.02411, step_time=0.0202, heartbeat_age=0.1, **survivor),
        # the replacement: a forked spare (new pid) that has not finished a step yet
        RankView(rank=1, local_rank=1, pid=41298, state=WorkerState.RECOVERING, heartbeat_age=0.0, restarts=1),
        RankView(rank=2, local_rank=2, pid=41209, loss=0.02637, step_time=0.0199, heartbeat_age=0.2, **survivor),
        RankView(rank=3, local_rank=3, pid=41211, loss=0.02352, step_time=0.0205, heartbeat_age=0.1, **survivor),
    )
    recovery = RecoveryView(
        generation=1,
        failed_ranks=(1,),
        cause=CAUSE,
        phases=(
            PhaseView(RecoveryPhase.DETECT, 0.0),
            PhaseView(RecoveryPhase.ABORT, 0.010),
            PhaseView(RecoveryPhase.SPAWN, 0.075),
        ),
    )
    return JobSnapshot(
        script="examples/train_dp.py",
        world_size=4,
        nnodes=1,
        generation=1,
        state=JobState.RECOVERING,
        uptime=12.4,
        ranks=ranks,
        steps_per_s=49.50,
        # steps/s over the last seconds, the last one cut short by the kill: the header's sparkline
        rate_history=(48.0, 50.0, 50.0, 49.0, 51.0, 50.0, 50.0, 49.0, 50.0, 51.0, 50.0, 17.0),
        failures=1,
        time_lost=0.0,  # counted when the recovery ends
        recovery=recovery,
        events=(
            f"event log: {EVENT_LOG}",
            CAUSE,
            "recovering in place (generation 1): replacing rank(s) 1",
        ),
        event_log=EVENT_LOG,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="SVG to write")
    args = parser.parse_args()

    console = Console(width=WIDTH, height=TARGET_HEIGHT, force_terminal=True, color_system="truecolor",
                      record=True, file=io.StringIO())
    console.print(render(synthetic_snapshot()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    console.save_svg(str(args.out), title="swiftrun: dashboard mid-recovery (synthetic snapshot)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
