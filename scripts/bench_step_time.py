#!/usr/bin/env python
"""Failure-free step time: swiftrun vs torchrun, same script, interleaved runs.

Each repetition runs ``examples/train_dp.py --steps N`` under each launcher (order alternating per repetition)
and reads rank 0's ``train_dp: steps=N step_ms=X`` line (mean of the steady-state steps: the script drops the
first max(3, N/10) steps). Reports the median and spread per launcher and swiftrun's relative overhead
(median swiftrun / median torchrun - 1), plus the wall time of each whole run (start-up and exit included).

swiftrun runs with its defaults, i.e. one warm spare, forked from the agent's zygote (which imports torch while
the workers start and at idle priority once they train); --with-no-spare adds swiftrun --spares 0 (no spare, no
zygote) and --with-cold-spare swiftrun with SWIFTRUN_NO_ZYGOTE=1 (the spare imports torch itself, as before the
zygote), to separate those costs.

    python scripts/bench_step_time.py --with-no-spare --with-cold-spare             # 5 x 300 steps, 4 ranks
    python scripts/bench_step_time.py --with-no-spare --with-cold-spare --steps 60  # a short run
    python scripts/bench_step_time.py --quick                                        # smoke test
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
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--with-no-spare", action="store_true", help="also run swiftrun --spares 0")
    p.add_argument("--with-cold-spare", action="store_true",
                   help="also run swiftrun with a spare but no zygote (SWIFTRUN_NO_ZYGOTE=1: the spare imports torch "
                        "itself, as before the zygote)")
    p.add_argument("--swiftrun-args", default="")
    p.add_argument("--script-args", default="", help="extra train_dp.py arguments, e.g. '--hidden 512'")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="smoke test: 2 repetitions of 60 steps")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.quick:
        a.steps, a.reps = 60, 2
    return a


COLD = "swiftrun, no zygote"


def main() -> None:
    args = parse_args()
    variants = {"swiftrun": args.swiftrun_args.split(), "torchrun": None}
    if args.with_no_spare:
        variants["swiftrun --spares 0"] = ["--spares", "0", *args.swiftrun_args.split()]
    if args.with_cold_spare:
        variants[COLD] = args.swiftrun_args.split()
    names = list(variants)
    print(f"# bench_step_time: {B.machine_line()}")
    print(f"# {args.nproc} ranks, {args.steps} steps, optimizer {args.optimizer}, {args.reps} repetition(s), "
          f"variants {names}")
    scratch = B.Scratch("steptime", keep=args.keep)

    def run_one(name: str, rep: int) -> B.Result:
        work = scratch.new(name.replace(" ", "_"))
        script = B.train_args(args.steps, work / "out", optimizer=args.optimizer, extra=args.script_args.split())
        if variants[name] is None:
            cmd = B.torchrun_cmd(args.nproc, script, max_restarts=0)
        else:
            cmd = B.swiftrun_cmd(args.nproc, script, extra=variants[name])
        env = {**os.environ, "SWIFTRUN_NO_ZYGOTE": "1"} if name == COLD else None
        return B.run(cmd, work, args.timeout, env=env)

    try:
        results = B.step_time_runs(names, args.reps, run_one)
    finally:
        scratch.close()

    base = B.med(r.step_ms for r in results["torchrun"])
    rows = []
    for name in names:
        ms = [r.step_ms for r in results[name]]
        m = B.med(ms)
        overhead = f"{(m / base - 1) * 100:+.1f}%" if (m is not None and base) else "-"
        rows.append([name, B.fmt_stat(ms, 2), overhead, B.fmt_stat([r.wall for r in results[name]], 2),
                     f"{sum(r.ok for r in results[name])}/{len(results[name])}"])
    print()
    print(B.table(["launcher", "step_ms median [min..max]", "vs torchrun", "wall s median [min..max]", "ok"],
                  rows))
    quiet = {n: [r.step_ms for r in rs if r.other_cores is not None and r.other_cores < 0.1] for n, rs in results.items()}
    qbase = B.med(quiet["torchrun"])
    if qbase and all(quiet.values()):
        print("quiet runs only (other processes < 0.1 core): " + "; ".join(
            f"{n} {B.fmt_stat(v, 2)} ms (n={len(v)}, {(B.med(v) / qbase - 1) * 100:+.1f}%)" for n, v in quiet.items()))
    others = [r.other_cores for rs in results.values() for r in rs]
    print(f"CPU used by other processes during the runs (cores, of {os.cpu_count()}): {B.fmt_stat(others, 2)}")
    B.write_json(args.json, {"args": vars(args), "machine": B.machine_line(), "results": B.step_time_json(results)})


if __name__ == "__main__":
    main()
