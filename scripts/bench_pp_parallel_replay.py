#!/usr/bin/env python
"""Replay time of a lost pipeline stage, alone and with idle survivors helping (``--parallel-replay``).

tests/scripts/pipeline.py with heavy stages (``--hidden``, ``--batch``) so the replay dominates: 4 stages, a stage
checkpoint every K steps, the chosen rank SIGKILLed (swiftrun's ``--fault``) in the forward of step K + R, so
its replacement replays steps K .. K + R - 1 (R < K). For each helper cap (0 = alone) the "replay" phase the
replacement measured is read from the event log, and the ranks' final files are compared with a failure-free
run (bitwise). Caps are interleaved per repetition; the CPU other processes used during each run is printed
(the machine may be shared).

    python scripts/bench_pp_parallel_replay.py                       # hidden 1024, 6 replayed steps, caps 0,1,3
    python scripts/bench_pp_parallel_replay.py --quick               # smoke test
    python scripts/bench_pp_parallel_replay.py --hidden 512 --batch 1024 --ckpt-every 6 --replayed 4 \
        --log-budget 30MiB --caps 0,2   # groups [0,1] [2,3]: ranks 2 and 3 replay, alone or with one chain
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchlib as B  # noqa: E402
SCRIPT = REPO / "tests" / "scripts" / "pipeline.py"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--replayed", type=int, default=6, help="steps the replacement replays (< --ckpt-every)")
    p.add_argument("--fail-rank", type=int, default=2)
    p.add_argument("--caps", default="0,1,3")
    p.add_argument("--log-budget", default=None,
                   help="selective logging (e.g. one logged boundary: groups [0,1] [2,3]); the lost rank's "
                        "logging group replays together, helped by chains of idle ranks")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    return p.parse_args()


def launch(save: Path, args: argparse.Namespace, steps: int, *extra: str) -> float:
    """Runs the job; returns the CPU other processes used meanwhile, in cores (the machine may be shared)."""
    cmd = [sys.executable, "-m", "swiftrun", "--nproc-per-node", "4", "--heartbeat-interval", "0.2",
           "--heartbeat-timeout", "30", "--no-dashboard", "--event-log", str(save / "events.jsonl"), *extra,
           str(SCRIPT), "--steps", str(steps), "--save-dir", str(save), "--hidden", str(args.hidden),
           "--batch", str(args.batch), "--microbatches", str(args.microbatches), "--schedule", args.schedule,
           "--ckpt-every", str(args.ckpt_every)]
    if args.log_budget:
        cmd[cmd.index(str(SCRIPT)):cmd.index(str(SCRIPT))] = ["--log-budget", args.log_budget]
    env = B.repo_env()
    env.setdefault("OMP_NUM_THREADS", "1")  # every rank, the replacement included, one intra-op thread
    started, busy, ours = time.monotonic(), B.cpu_busy_seconds(), B.children_cpu_seconds() + B.self_cpu_seconds()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    mine = B.children_cpu_seconds() + B.self_cpu_seconds() - ours
    return max(0.0, B.cpu_busy_seconds() - busy - mine) / (time.monotonic() - started)


def replay_seconds(save: Path) -> tuple[float, dict[int, list[int]], list[list[int]]]:
    """The replay phase, each replaying rank's helpers, and the logging groups chosen."""
    events = [json.loads(line) for line in (save / "events.jsonl").read_text().splitlines() if line.strip()]
    (phase,) = [e for e in events if e["event"] == "recovery_phase" and e["phase"] == "replay"]
    helpers = {e["rank"]: list(e.get("helpers", [])) for e in events if e["event"] == "replay"}
    groups = next((e["groups"] for e in events if e["event"] == "log_plan"), [])
    return float(phase["duration"]), helpers, groups


def main() -> None:
    args = parse_args()
    if args.quick:
        args.hidden, args.batch, args.replayed, args.reps, args.ckpt_every = 256, 64, 3, 1, 5
    caps = [int(c) for c in args.caps.split(",")]
    if not 1 <= args.replayed < args.ckpt_every:
        raise SystemExit("--replayed must be below --ckpt-every (the replay starts at the last checkpoint)")
    fail_step = args.ckpt_every + args.replayed  # killed in its forward: the point is the step before
    steps = fail_step + 2
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}; "
          f"hidden {args.hidden}, batch {args.batch}, {args.microbatches} micro-batches, {args.schedule}, "
          f"rank {args.fail_rank} killed in step {fail_step}: {args.replayed} steps replayed")
    results: dict[int, list[float]] = {c: [] for c in caps}
    with tempfile.TemporaryDirectory() as tmp:
        ref = Path(tmp) / "ref"
        ref.mkdir()
        launch(ref, args, steps)
        for rep in range(args.reps):
            for cap in caps if rep % 2 == 0 else list(reversed(caps)):
                save = Path(tmp) / f"c{cap}r{rep}"
                save.mkdir()
                other = launch(save, args, steps, "--parallel-replay", str(cap), "--fault",
                               f"{args.fail_rank}:{fail_step}:forward:sigkill")
                seconds, helpers, groups = replay_seconds(save)
                exact = B.same_rank_files(save, ref)
                results[cap].append(seconds)
                print(f"  rep {rep} cap {cap}: groups {groups}, helpers {helpers}, replay {seconds:.3f} s, "
                      f"bitwise {exact}, other processes' CPU {other:.2f} cores", flush=True)
                if not exact:
                    raise SystemExit("a recovered run differs from the failure-free run")
    base = statistics.median(results[caps[0]])
    print("\n| helpers (cap) | replay, median s | runs | speed-up vs alone |\n|---|---|---|---|")
    for cap in caps:
        m = statistics.median(results[cap])
        print(f"| {cap} | {m:.3f} | {', '.join(f'{v:.2f}' for v in results[cap])} | {base / m:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
