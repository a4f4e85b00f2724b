#!/usr/bin/env python
"""The phases of one in-place recovery, from swiftrun's event log, over N repetitions.

Each repetition runs ``swiftrun --nproc-per-node 4 --fault 1:STEP:backward:sigkill examples/train_dp.py`` once
with a warm spare (``--spares 1``, the default) and once without (``--spares 0``), interleaved, and reads the
``recovery_phase`` / ``recovery_end`` events of generation 1: detect, abort, spawn, rebuild, consensus, undo,
transfer, resume (ms) and total = failure -> resume (``recovery_end.total``).

Was a warm spare used? Three independent signs, all reported:
  * /proc: the replacement rank's pid (from its ``worker_state`` -> joining event) was seen, before the failure,
    as a worker process started with SWIFTRUN_SPARE=1;
  * event log: the replacement enters ``joining`` within 50 ms of ``recovery_start`` (a cold process must start
    Python and say hello first). Note: the event says ``previous: starting`` in both cases;
  * was the spare already warm? Workers run with SWIFTRUN_LOGLEVEL=debug; a spare logs "spare warm, waiting for
    a rank" then "spare assigned rank R". If both carry the same timestamp, the rank was assigned while the
    spare was still warming up (importing torch), so the replacement paid part of a cold start.

On a small machine the spare, started only once every rank is training, needs several seconds of CPU to warm
up; --fail-step is therefore late by default so that it is warm before the failure.

    python scripts/bench_recovery_timeline.py            # 4 ranks, 5 repetitions of each configuration
    python scripts/bench_recovery_timeline.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchlib as B  # noqa: E402

PHASES = ("detect", "abort", "spawn", "rebuild", "consensus", "undo", "transfer", "resume")
DEBUG_LINE = re.compile(r"^\s*(\d+)ms swiftrun\[(\d+)\] (.*)$")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=450)
    p.add_argument("--fail-step", type=int, default=400)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--fault-phase", default="backward")
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--spares", default="1,0", help="configurations to compare (values of --spares)")
    p.add_argument("--swiftrun-args", default="")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="smoke test: 60 steps, fail at 40, 1 repetition")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.quick:
        a.steps, a.fail_step, a.reps = 60, 40, 1
    return a


def spare_watch(launcher_pid: int, seen: dict[int, float], t0: float):
    def poll() -> None:
        for pid in B.descendants(launcher_pid):
            if pid not in seen and B.environ(pid).get("SWIFTRUN_SPARE") == "1":
                seen[pid] = time.monotonic() - t0
    return poll


def analyse(events: list[dict], output: str, spare_pids: dict[int, float]) -> dict:
    out: dict = {"phases_ms": {}, "ok": False}
    starts = [e for e in events if e["event"] == "recovery_start"]
    ends = [e for e in events if e["event"] == "recovery_end"]
    out["recoveries"] = len(ends)
    if not starts or not ends:
        out["error"] = "no recovery in the event log"
        return out
    gen = ends[0].get("generation")
    for e in events:
        if e["event"] == "recovery_phase" and e.get("generation") == gen and e.get("phase") in PHASES:
            out["phases_ms"][e["phase"]] = float(e["duration"]) * 1000.0
    out["phases_ms"]["total"] = float(ends[0]["total"]) * 1000.0
    out.update(outcome=ends[0].get("outcome"), mode=ends[0].get("mode"), source_rank=ends[0].get("source_rank"),
               ok=ends[0].get("outcome") == "recovered")
    rs = starts[0]
    joining = next((e for e in events if e["event"] == "worker_state" and e.get("state") == "joining"
                    and e.get("rank") in rs.get("failed_ranks", [])), None)
    if joining:
        pid = joining.get("pid")
        out["replacement_pid"] = pid
        out["joining_previous"] = joining.get("previous")
        out["joining_after_start_ms"] = (joining["t"] - rs["t"]) * 1000.0
        out["joining_immediate"] = out["joining_after_start_ms"] < 50.0
        # /proc: started as a spare? (a cold replacement is started with SWIFTRUN_SPARE=0; a process's
        # /proc/PID/environ keeps its start-up environment, so an assigned spare still shows SWIFTRUN_SPARE=1)
        out["replacement_was_spare_process"] = bool(pid) and pid in spare_pids
        # debug log of that pid: was the spare already warm when assigned?
        warm = assigned = None
        for line in output.splitlines():
            m = DEBUG_LINE.match(line)
            if m and int(m.group(2)) == pid:
                if m.group(3).startswith("spare warm"):
                    warm = int(m.group(1))
                elif m.group(3).startswith("spare assigned"):
                    assigned = int(m.group(1))
        if warm is not None and assigned is not None:
            out["spare_idle_before_assign_ms"] = assigned - warm
            out["spare_was_warm"] = assigned - warm > 5
    out["spares_seen"] = len(spare_pids)
    return out


def main() -> None:
    args = parse_args()
    configs = [int(x) for x in args.spares.split(",") if x.strip()]
    print(f"# bench_recovery_timeline: {B.machine_line()}")
    print(f"# {args.nproc} ranks, {args.steps} steps, --fault {args.fail_rank}:{args.fail_step}:"
          f"{args.fault_phase}:sigkill, spares {configs}, {args.reps} repetition(s)")
    scratch = B.Scratch("timeline", keep=args.keep)
    results: dict[int, list[dict]] = {c: [] for c in configs}
    env = dict(os.environ, SWIFTRUN_LOGLEVEL="debug")
    try:
        for rep in range(args.reps):
            order = configs if rep % 2 == 0 else configs[::-1]
            for spares in order:
                work = scratch.new(f"spares{spares}")
                log = work / "events.jsonl"
                extra = ["--spares", str(spares),
                         "--fault", f"{args.fail_rank}:{args.fail_step}:{args.fault_phase}:sigkill",
                         *args.swiftrun_args.split()]
                cmd = B.swiftrun_cmd(args.nproc, B.train_args(args.steps, work / "out", optimizer=args.optimizer),
                                     event_log=log, extra=extra)
                seen: dict[int, float] = {}
                run = B.Launched(cmd, work, env=env)
                poller = B.Poller(spare_watch(run.pid, seen, run.t0), 0.05)
                poller.start()
                res = run.wait(args.timeout)
                poller.stop()
                events = B.read_events(log)
                info = analyse(events, res.output, seen)
                info.update(wall=res.wall, rc=res.rc, step_ms=res.step_ms, other_cores=res.other_cores)
                results[spares].append(info)
                ph = " ".join(f"{k}={v:.0f}" for k, v in info["phases_ms"].items())
                print(f"  rep {rep + 1} spares={spares} rc={res.rc} wall={res.wall:.1f}s other_cpu="
                      f"{B.fmt(res.other_cores, 2)}cores mode={info.get('mode')} [{ph}] "
                      f"spare_process={info.get('replacement_was_spare_process')} "
                      f"joining_after={B.fmt(info.get('joining_after_start_ms'), 0)}ms "
                      f"spare_warm={info.get('spare_was_warm')} "
                      f"idle_before_assign={info.get('spare_idle_before_assign_ms')}ms", flush=True)
                if res.rc != 0 or not info.get("ok"):
                    print(B.tail(res.output, 12))
    finally:
        scratch.close()

    headers = ["phase (ms)"] + [f"--spares {c}: median [min..max]" for c in configs]
    rows = []
    for phase in (*PHASES, "total"):
        rows.append([phase] + [B.fmt_stat([r["phases_ms"].get(phase) for r in results[c]], 0) for c in configs])

    def count(c: int, key: str) -> str:
        vals = [r.get(key) for r in results[c]]
        if all(v is None for v in vals):
            return "n/a"
        return f"{sum(1 for v in vals if v)}/{len(vals)}"

    rows.append(["replacement was a spare process (/proc)"] + [count(c, "replacement_was_spare_process") for c in configs])
    rows.append(["joining within 50 ms of failure (log)"] + [count(c, "joining_immediate") for c in configs])
    rows.append(["spare already warm when assigned (debug)"] + [count(c, "spare_was_warm") for c in configs])
    rows.append(["recovered in place"] + [count(c, "ok") for c in configs])
    rows.append(["step_ms of the run (rank 0)"] + [B.fmt_stat([r.get("step_ms") for r in results[c]], 1)
                                                   for c in configs])
    print()
    print(B.table(headers, rows))
    print(f"CPU used by other processes during the runs (cores, of {os.cpu_count()}): "
          f"{B.fmt_stat([r.get('other_cores') for c in configs for r in results[c]], 2)}")
    modes = {c: sorted({str(r.get("mode")) for r in results[c]}) for c in configs}
    print(f"modes: {modes}; 'previous' state of the joining event: "
          f"{ {c: sorted({str(r.get('joining_previous')) for r in results[c]}) for c in configs} }")
    B.write_json(args.json, {"args": vars(args), "machine": B.machine_line(), "results": results})


if __name__ == "__main__":
    main()
