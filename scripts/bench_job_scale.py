"""The whole-world supervisor's own costs at 1,000 and 10,000 ranks, in-process (no sockets, no processes).

What the coordinator's one thread spends on: every rank's REGISTERED at start (START goes out once all did),
one worker failure (-> ABORT to every survivor, a replacement), that recovery's events (every survivor's
ABORTED, the replacement's HELLO and JOINING, every rank's RECOVERED, up to RESUME), and the dashboard: building the job's snapshot
(``Coordinator.snapshot``'s work, on the coordinator's thread) and rendering it (rich's refresh thread). The real
:class:`~swiftrun.launcher.job.Job`, :class:`~swiftrun.launcher.nodes.NodeTable`, ``launcher/view.py`` and
``dashboard/render.py``, fed with a fake clock; 8 ranks per node, one node lost before the snapshot is taken.

Run it from an older tree (``cd OLD && PYTHONPATH=. python NEW/scripts/bench_job_scale.py``) to compare: the
dashboard columns are left empty where ``launcher/view.py`` does not exist yet.

Usage::

    PYTHONPATH=. python scripts/bench_job_scale.py                  # 1,000 and 10,000 ranks
    PYTHONPATH=. python scripts/bench_job_scale.py --ranks 10000 --repeat 3
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH: an older tree can be measured

from rich.console import Console  # noqa: E402

from swiftrun.config import Entrypoint, EntrypointKind, LaunchConfig  # noqa: E402
from swiftrun.dashboard.render import render  # noqa: E402
from swiftrun.launcher.actions import Assign, Spawn  # noqa: E402
from swiftrun.launcher.job import Job  # noqa: E402
from swiftrun.launcher.nodes import NodeTable  # noqa: E402
from swiftrun.protocol.control import EventKind  # noqa: E402


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def measure(ranks: int, per_node: int) -> dict[str, float]:
    nnodes = ranks // per_node
    config = LaunchConfig(entrypoint=Entrypoint(EntrypointKind.SCRIPT, "train.py"), nproc_per_node=per_node,
                          nnodes=(nnodes, nnodes), node_rank=0, master_addr="127.0.0.1", rdzv_backend="c10d",
                          rdzv_id="bench", external_coordinator=True)
    table = NodeTable(nnodes, node_timeout=10.0)
    for k in range(nnodes):
        table.join(f"node{k}".encode(), k, {}, 0.0, {"host": f"host-{k}"})
    job = Job(config, 0.0, registers=True)
    spawns = [a for a in job.start(0.0) if isinstance(a, Spawn)]
    for spawn in spawns:
        job.on_spawned(spawn.slot_id, 1000 + spawn.slot_id, 0.0)
        job.on_hello(spawn.slot_id, 0, 0.0)
    workers = [s.slot_id for s in spawns if s.rank is not None]
    register_s, _ = timed(lambda: [job.on_event(sid, 0, EventKind.REGISTERED, {}, 0.0) for sid in workers])
    assert job.swift_started
    for rank in range(ranks):
        job.on_status(job.rank_slot[rank], 1.0, 100, 2.5, 0.1, {})
    failure_s, actions = timed(lambda: job.on_exit(job.rank_slot[5], -9, 2.0))
    # a node's warm spare takes the rank (Assign); without one a replacement is spawned cold
    (replacement,) = [a.slot_id for a in actions if isinstance(a, (Assign, Spawn)) and a.rank == 5]
    if job.slots[replacement].pid is None:
        job.on_spawned(replacement, 99_999, 2.0)

    def recovery() -> None:
        gen = job.generation
        for rank in range(ranks):
            if rank != 5:
                job.on_event(job.rank_slot[rank], gen, EventKind.ABORTED, {}, 2.0)
        job.on_hello(replacement, gen, 2.0)
        job.on_event(replacement, gen, EventKind.JOINING, {}, 2.0)
        for rank in range(ranks):
            job.on_event(job.rank_slot[rank], gen, EventKind.RECOVERED, {}, 2.0)

    recovery_s, _ = timed(recovery)
    assert job.recovery is None and job.last_recovery is not None and job.last_recovery.done
    table.lose(b"node7")
    job.on_node_lost(7, 3.0, "its agent's connection closed")
    try:
        from swiftrun.launcher import view
    except ImportError:  # a tree from before the multi-node dashboard: the supervisor's costs only
        return {"register": register_s, "failure": failure_s, "recovery": recovery_s, "snapshot": float("nan"),
                "render": float("nan")}
    snapshot_s, snap = timed(lambda: view.job_snapshot(
        job, config, 4.0, started_at=0.0, notes=(), event_log=None, throughput=view.Throughput(),
        local_rank=lambda r: r % per_node, nodes=view.node_views(table, job, per_node, 4.0)))

    def draw() -> None:
        console = Console(width=150, height=45, force_terminal=True, color_system=None, file=io.StringIO())
        console.print(render(snap))

    render_s, _ = timed(draw)
    return {"register": register_s, "failure": failure_s, "recovery": recovery_s, "snapshot": snapshot_s,
            "render": render_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="runs per size; the best is reported")
    args = parser.parse_args()
    with open("/proc/loadavg") as f:
        print(f"load average before: {f.read().strip()}")
    print(" ranks  nodes  all REGISTERED (s)  one failure (ms)  its recovery's events (s)  snapshot (ms)  render (ms)")
    for ranks in args.ranks:
        runs = [measure(ranks, args.per_node) for _ in range(args.repeat)]
        best = {key: min(run[key] for run in runs) for key in runs[0]}
        dash = "".join(f" {'-' if value != value else f'{value * 1e3:.1f}':>{width}}"  # NaN: not measured
                       for value, width in ((best["snapshot"], 14), (best["render"], 12)))
        print(f"{ranks:6d} {ranks // args.per_node:6d} {best['register']:19.3f} {best['failure'] * 1e3:17.1f}"
              f" {best['recovery']:25.3f}{dash}")
    with open("/proc/loadavg") as f:
        print(f"load average after: {f.read().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
