#!/usr/bin/env python
"""HSDP (examples/zoo/hsdp.py, 2 replica groups x 2 shards): failure-free step time under swiftrun vs torchrun,
and one in-place recovery's phases.

Step time: interleaved failure-free runs of each launcher (order alternating per repetition), rank 0's mean of
the steady steps (``hsdp: steps=N step_ms=X``). swiftrun runs with its defaults (one warm spare; an HSDP job keeps
a pre-step copy of the local shards and their AdamW state for an exact undo, runtime/hsdp/recovery.py).

Recovery: rank 1 SIGKILLed by an injected fault mid-forward at step ``--kill-step``; the event log's phases
(detect, abort, spawn, rebuild, consensus, undo, transfer, resume) and the kill-to-resumed total, per run, and
whether the recovered run's every rank is bitwise the failure-free one.

    python scripts/bench_hsdp.py                         # 5 x 200 steps, width 1025, 512 features
    python scripts/bench_hsdp.py --quick                 # smoke test
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchlib as B  # noqa: E402

SCRIPT = B.REPO / "examples" / "zoo" / "hsdp.py"
PHASES = ("detect", "abort", "spawn", "rebuild", "consensus", "undo", "transfer", "resume")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--recoveries", type=int, default=3)
    p.add_argument("--kill-step", type=int, default=20)
    p.add_argument("--width", type=int, default=1025)
    p.add_argument("--features", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="2 repetitions of 40 steps, 1 recovery")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.quick:
        a.steps, a.reps, a.recoveries, a.kill_step = 40, 2, 1, 10
    return a


def main() -> None:
    args = parse_args()
    print(f"# bench_hsdp: {B.machine_line()}")
    print(f"# 4 ranks (2 replicas x 2 shards), width {args.width}, features {args.features}, batch {args.batch}, "
          f"{args.steps} steps, {args.reps} repetition(s)")
    scratch = B.Scratch("hsdp", keep=args.keep)

    def script(save: Path) -> list[str]:
        return ["--steps", str(args.steps), "--width", str(args.width), "--features", str(args.features),
                "--batch", str(args.batch), "--save-dir", str(save)]

    def run_one(name: str, rep: int) -> B.Result:
        work = scratch.new(name)
        if name == "torchrun":
            cmd = B.torchrun_cmd(4, script(work / "save"), max_restarts=0, script=SCRIPT)
        else:
            cmd = B.swiftrun_cmd(4, script(work / "save"), script=SCRIPT)
        res = B.run(cmd, work, args.timeout)
        res.extra["save"] = work / "save"
        return res

    try:
        results = B.step_time_runs(["swiftrun", "torchrun"], args.reps, run_one)
        base = B.med(r.step_ms for r in results["torchrun"])
        rows = []
        for name, rs in results.items():
            m = B.med(r.step_ms for r in rs)
            rows.append([name, B.fmt_stat([r.step_ms for r in rs], 3),
                         f"{(m / base - 1) * 100:+.1f}%" if m and base else "-", f"{sum(r.ok for r in rs)}/{len(rs)}"])
        print()
        print(B.table(["launcher", "step_ms median [min..max]", "vs torchrun", "ok"], rows))
        reference = next((r.extra["save"] for r in results["torchrun"] if r.ok), None)

        print(f"\n# recovery: rank 1 SIGKILLed mid-forward at step {args.kill_step}")
        recs = []
        for rep in range(args.recoveries):
            work = scratch.new(f"recovery{rep}")
            events = work / "events.jsonl"
            cmd = B.swiftrun_cmd(4, script(work / "save"), event_log=events, script=SCRIPT,
                                 extra=["--fault", f"1:{args.kill_step}:forward:sigkill"])
            res = B.run(cmd, work, args.timeout)
            phases = {p: 0.0 for p in PHASES}
            for e in B.read_events(events):
                if e["event"] == "recovery_phase" and e.get("phase") in phases:
                    phases[e["phase"]] += float(e.get("duration") or 0.0) * 1000.0
            summary = B.recovery_summary(events)
            exact = B.same_rank_files(work / "save", reference) if reference is not None else None
            recs.append((res, phases, summary, exact))
            print(f"  run {rep + 1}: rc={res.rc} outcome={summary['outcomes']} total="
                  f"{B.fmt((summary['recovery_total_s'] or 0) * 1000, 0)} ms bitwise={exact} " +
                  " ".join(f"{p}={v:.0f}" for p, v in phases.items()), flush=True)
            if res.rc != 0:
                print(B.tail(res.output, 12))
        print()
        print(B.table(["phase", "ms median [min..max]"],
                      [[p, B.fmt_stat([ph[p] for _, ph, _, _ in recs], 0)] for p in PHASES] +
                      [["total (kill -> resumed)", B.fmt_stat([(s["recovery_total_s"] or 0) * 1000
                                                               for _, _, s, _ in recs], 0)]]))
    finally:
        scratch.close()
    B.write_json(args.json, {"args": vars(args), "machine": B.machine_line(),
                             "step_time": B.step_time_json(results)})


if __name__ == "__main__":
    main()
