#!/usr/bin/env python
"""Failure-free step time of examples/train_pp.py: swiftrun vs torchrun, same command, interleaved runs.

Each repetition runs ``train_pp.py --steps N --schedule S`` under each launcher (the order alternates per
repetition) and reads rank 0's ``train_pp: steps=N step_ms=X`` line (mean step time without the first step).
Reports per schedule and launcher the median and spread, and the ratio median swiftrun / median torchrun (what
registering the pipeline with ``swiftrun.Run`` and running under swiftrun costs a step; once the runtime logs
stage boundaries, this is where the logging cost shows). Wall time of the whole run is shown too.

    python scripts/bench_pp_overhead.py                    # 4 ranks, 300 steps, gpipe and 1f1b, 5 repetitions
    python scripts/bench_pp_overhead.py --quick            # smoke test
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchlib as B  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--schedules", default="gpipe,1f1b")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--script-args", default="", help="extra train_pp.py arguments, e.g. '--hidden 256 --dp 2'")
    p.add_argument("--swiftrun-args", default="", help="extra swiftrun options, e.g. '--spares 0'")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="smoke test: 2 repetitions of 60 steps")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.quick:
        a.steps, a.reps = 60, 2
    return a


def main() -> None:
    args = parse_args()
    schedules = [x.strip() for x in args.schedules.split(",") if x.strip()]
    launchers = ["torchrun", "swiftrun"]
    print(f"# bench_pp_overhead: {B.machine_line()}")
    print(f"# train_pp.py, {args.nproc} ranks, {args.steps} steps, schedules {schedules}, {args.reps} "
          f"repetition(s), script args '{args.script_args}', swiftrun args '{args.swiftrun_args}'")
    env = B.repo_env()
    scratch = B.Scratch("ppoverhead", keep=args.keep)
    variants = [(s, l) for s in schedules for l in launchers]

    def run_one(variant: tuple[str, str], rep: int) -> B.Result:
        schedule, launcher = variant
        work = scratch.new(f"{schedule}-{launcher}")
        script = ["--steps", str(args.steps), "--schedule", schedule, "--save-dir", str(work / "out"),
                  *args.script_args.split()]
        if launcher == "torchrun":
            cmd = B.torchrun_cmd(args.nproc, script, max_restarts=0, script=B.TRAIN_PP)
        else:
            cmd = B.swiftrun_cmd(args.nproc, script, extra=args.swiftrun_args.split(), script=B.TRAIN_PP)
        return B.run(cmd, work, args.timeout, env=env)

    try:
        results = B.step_time_runs(variants, args.reps, run_one, label=" ".join)
    finally:
        scratch.close()

    rows = []
    for schedule in schedules:
        base = B.med(r.step_ms for r in results[(schedule, "torchrun")])
        for launcher in launchers:
            runs = results[(schedule, launcher)]
            ms = [r.step_ms for r in runs]
            m = B.med(ms)
            ratio = B.fmt(m / base, 3) if (m is not None and base) else "-"
            rows.append([schedule, launcher, B.fmt_stat(ms, 2), ratio, B.fmt_stat([r.wall for r in runs], 2),
                         f"{sum(r.ok for r in runs)}/{len(runs)}"])
    print()
    print(B.table(["schedule", "launcher", "step_ms median [min..max]", "/ torchrun", "wall s median [min..max]",
                   "ok"], rows))
    others = [r.other_cores for rs in results.values() for r in rs]
    print(f"CPU used by other processes during the runs (cores, of {os.cpu_count()}): {B.fmt_stat(others, 2)}")
    B.write_json(args.json, {"args": vars(args), "machine": B.machine_line(),
                             "results": B.step_time_json({" ".join(k): v for k, v in results.items()})})


if __name__ == "__main__":
    main()
