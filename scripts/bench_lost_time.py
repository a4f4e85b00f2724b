#!/usr/bin/env python
"""Time lost to one SIGKILL of one rank: swiftrun (in-place recovery) vs torchrun (checkpoint-restart).

For each launcher: wall time of a failure-free run and of a run in which rank 1 is SIGKILLed near step
--fail-step; lost = failed - clean (paired within a repetition). Runs are interleaved
(swiftrun clean, torchrun clean, swiftrun failed, torchrun failed; the launcher order alternates per repetition).

Both launchers run the same script with the same arguments, including periodic checkpoints
(``--ckpt-dir D --ckpt-every K``; every run gets a fresh D). Checkpoints are what torchrun needs to restart;
swiftrun does not read them (they only cost it the save time, equally in its clean and failed runs).

How the kill happens:
  * swiftrun: ``--fault 1:STEP:backward:sigkill`` (exactly at step STEP), or with ``--swiftrun-kill timer`` the
    same external kill as torchrun.
  * torchrun ("timer"): it has no fault injection, so the script waits for the first checkpoint
    (written after step K) and sends SIGKILL to the RANK=1 worker (found via /proc) after a further
    (STEP - K) * step_ms, with step_ms from the same repetition's clean run of that launcher. The checkpoint
    step seen after the failure is reported, to check the kill landed between two checkpoints.

How torchrun recovers (--torchrun-method):
  * restart: torchrun's own ``--max-restarts 1`` whole-group restart; the restarted workers resume from the
    checkpoint. Counted only if the job then ends successfully within --restart-timeout.
  * rerun: what a user does when that does not work: the failed job (``--max-restarts 0``, so it exits when the
    rank dies) until it exits, plus an immediate rerun of the same command, which resumes from the checkpoint.
  * auto (default): try "restart" once; if it fails or hangs, say so and use "rerun" for every repetition.

    python scripts/bench_lost_time.py                # 4 ranks, 250 steps, kill at 150, checkpoint every 100
    python scripts/bench_lost_time.py --quick        # smoke test (2 ranks, short run, 1 repetition)
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
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--fail-step", type=int, default=150)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--launchers", default="swiftrun,torchrun")
    p.add_argument("--swiftrun-kill", choices=("fault", "timer"), default="fault")
    p.add_argument("--torchrun-method", choices=("auto", "restart", "rerun"), default="auto")
    p.add_argument("--restart-timeout", type=float, default=None,
                   help="seconds a torchrun --max-restarts run may take before it counts as hung "
                        "(default: 2 x its clean run + 60)")
    p.add_argument("--swiftrun-args", default="", help="extra swiftrun options, e.g. '--spares 0'")
    p.add_argument("--timeout", type=float, default=600.0, help="per launcher run")
    p.add_argument("--quick", action="store_true", help="smoke test: 2 ranks, 50 steps, kill at 30, 1 repetition")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (logs, event logs)")
    p.add_argument("--json", default=None, help="also write the raw results here")
    a = p.parse_args()
    if a.quick:
        a.nproc, a.steps, a.fail_step, a.ckpt_every, a.reps = 2, 50, 30, 20, 1
    if not a.ckpt_every <= a.fail_step < a.steps:
        p.error("need --ckpt-every <= --fail-step < --steps")
    if a.fail_step >= 2 * a.ckpt_every and (a.swiftrun_kill == "timer" or "torchrun" in a.launchers):
        print("note: the timer kill anchors on the first checkpoint (step --ckpt-every); it is less precise the "
              "further --fail-step is from it", file=sys.stderr)
    return a


def checkpoint_step(path: Path) -> int | None:
    if not path.exists():
        return None
    try:
        import torch

        return int(torch.load(path, map_location="cpu", weights_only=False)["step"])
    except Exception:  # noqa: BLE001
        return None


def timer_kill(run: B.Launched, ckpt: Path, args: argparse.Namespace, step_ms: float) -> dict:
    """Wait for the first checkpoint, then SIGKILL the fail rank after (fail_step - ckpt_every) more steps."""
    return B.timer_kill(run, ckpt, fail_rank=args.fail_rank, timeout=args.timeout,
                        delay_s=(args.fail_step - args.ckpt_every) * step_ms / 1000.0,
                        info={"kill": "timer", "step_ms_used": step_ms})


def swift_recovery(event_log: Path) -> dict:
    summary = B.recovery_summary(event_log)
    return {"recoveries": summary["recoveries"], "outcomes": summary["outcomes"],
            "recovery_total_s": summary["recovery_total_s"],
            "mode": summary["modes"][0] if summary["modes"] else None, "time_lost_s": summary["time_lost_s"]}


def one_run(launcher: str, failed: bool, args: argparse.Namespace, scratch: B.Scratch, clean_ms: dict,
            method: str) -> B.Result:
    work = scratch.new(f"{launcher}-{'failed' if failed else 'clean'}")
    ckpt = work / "ckpt"
    script = B.train_args(args.steps, work / "out", optimizer=args.optimizer, ckpt_dir=ckpt,
                          ckpt_every=args.ckpt_every)
    if launcher == "swiftrun":
        log = work / "events.jsonl"
        extra = args.swiftrun_args.split()
        if failed and args.swiftrun_kill == "fault":
            extra += ["--fault", f"{args.fail_rank}:{args.fail_step}:backward:sigkill"]
        run = B.Launched(B.swiftrun_cmd(args.nproc, script, event_log=log, extra=extra), work)
        info = {"kill": "fault"} if failed and args.swiftrun_kill == "fault" else {}
        if failed and args.swiftrun_kill == "timer":
            info = timer_kill(run, ckpt / "latest.pt", args, clean_ms[launcher])
        res = run.wait(args.timeout)
        res.extra.update(info, **swift_recovery(log), method="in-place")
        if failed and res.extra.get("recoveries") != 1:
            res.extra["error"] = f"expected one recovery, saw {res.extra.get('recoveries')}"
        return res

    # torchrun
    max_restarts = 1 if (not failed or method == "restart") else 0
    cmd = B.torchrun_cmd(args.nproc, script, max_restarts=max_restarts)
    run = B.Launched(cmd, work)
    info = timer_kill(run, ckpt / "latest.pt", args, clean_ms[launcher]) if failed else {}
    if failed and method == "restart":
        limit = args.restart_timeout or (2 * clean_ms.get("torchrun_wall", 60.0) + 60.0)
        res = run.wait(limit)
        res.extra.update(info, method="restart", ckpt_step_after_failure=None)
        if not res.ok:
            res.extra["error"] = ("torchrun --max-restarts 1 hung (killed after "
                                  f"{limit:.0f} s)" if res.timed_out else f"torchrun exited with {res.rc}")
            refused = [ln for ln in res.output.splitlines() if "Connection refused" in ln or "Traceback" in ln]
            res.extra["evidence"] = refused[-3:] or B.tail(res.output, 5).splitlines()
        return res
    res = run.wait(args.timeout)
    if not failed:
        return res
    res.extra.update(info, method="rerun", failed_rc=res.rc, failed_wall_s=res.wall,
                     ckpt_step_after_failure=checkpoint_step(ckpt / "latest.pt"))
    rerun = B.run(B.torchrun_cmd(args.nproc, script, max_restarts=1), work, args.timeout)
    res.extra.update(rerun_wall_s=rerun.wall, rerun_rc=rerun.rc, rerun_step_ms=rerun.step_ms)
    combined = B.Result(cmd, rerun.rc, res.wall + rerun.wall, res.output + "\n--- rerun ---\n" + rerun.output,
                        res.timed_out or rerun.timed_out, res.load_before, rerun.load_after, res.extra,
                        other_cores=B.wavg([(res.other_cores, res.wall), (rerun.other_cores, rerun.wall)]))
    if res.rc == 0:
        combined.extra["error"] = "the failed run exited 0: the kill missed (job finished first?)"
    return combined


def interleaved_runs(args: argparse.Namespace, launchers: list[str], scratch: B.Scratch
                     ) -> tuple[dict[str, dict[str, list[B.Result]]], str | None]:
    """``args.reps`` repetitions of a clean then a failed run per launcher (the launcher order alternating), each
    printed as it ends; with ``--torchrun-method auto``, a torchrun restart that fails is measured as a rerun from
    then on. Returns the runs by launcher and kind, and the note saying why the restart was given up, if it was."""
    method = "restart" if args.torchrun_method == "auto" else args.torchrun_method
    probe_note = None
    results: dict[str, dict[str, list[B.Result]]] = {l: {"clean": [], "failed": []} for l in launchers}
    for rep in range(args.reps):
        order = launchers if rep % 2 == 0 else launchers[::-1]
        clean_ms: dict = {}
        for failed in (False, True):
            for launcher in order:
                res = one_run(launcher, failed, args, scratch, clean_ms, method)
                if (launcher == "torchrun" and failed and method == "restart"
                        and args.torchrun_method == "auto" and not res.ok):
                    probe_note = (f"torchrun --max-restarts 1 restart path did not work here "
                                  f"({res.extra.get('error')}; {res.wall:.1f} s spent); "
                                  f"evidence: {res.extra.get('evidence')}")
                    print(f"  {probe_note}\n  -> measuring torchrun as failed run + rerun from the checkpoint")
                    method = "rerun"
                    res = one_run(launcher, failed, args, scratch, clean_ms, method)
                if not failed:
                    clean_ms[launcher] = res.step_ms or 30.0
                    if launcher == "torchrun":
                        clean_ms["torchrun_wall"] = res.wall
                results[launcher]["failed" if failed else "clean"].append(res)
                detail = {k: v for k, v in res.extra.items() if k not in ("evidence",)}
                status = "ok" if (res.rc == 0 and not res.timed_out) else f"rc={res.rc} timed_out={res.timed_out}"
                print(f"  rep {rep + 1} {launcher:8s} {'failed' if failed else 'clean ':6s} "
                      f"wall={res.wall:6.2f}s step_ms={B.fmt(res.step_ms, 1)} {status} "
                      f"other_cpu={B.fmt(res.other_cores, 2)}cores {detail if detail else ''}", flush=True)
                if res.rc != 0 or res.timed_out:
                    print(B.tail(res.output, 12))
    return results, probe_note


def problem_runs(results: dict[str, dict[str, list[B.Result]]]) -> list[tuple[str, str, int]]:
    return [(l, k, i) for l, d in results.items() for k, runs in d.items() for i, r in enumerate(runs)
            if r.rc != 0 or r.timed_out or r.extra.get("error")]


def main() -> None:
    args = parse_args()
    launchers = [x.strip() for x in args.launchers.split(",") if x.strip()]
    print(f"# bench_lost_time: {B.machine_line()}")
    print(f"# {args.nproc} ranks, {args.steps} steps, SIGKILL rank {args.fail_rank} near step {args.fail_step}, "
          f"checkpoint every {args.ckpt_every}, {args.reps} repetition(s)")
    scratch = B.Scratch("lost", keep=args.keep)
    try:
        results, probe_note = interleaved_runs(args, launchers, scratch)
    finally:
        scratch.close()

    rows, summary = [], {}
    for launcher in launchers:
        clean = [r.wall for r in results[launcher]["clean"]]
        failed = [r.wall for r in results[launcher]["failed"]]
        lost = [f - c for c, f in zip(clean, failed)]
        summary[launcher] = {"clean": clean, "failed": failed, "lost": lost}
    base = B.med(summary.get("swiftrun", {}).get("lost", []))
    for launcher in launchers:
        s = summary[launcher]
        lost_med = B.med(s["lost"])
        method_used = sorted({r.extra.get("method", "?") for r in results[launcher]["failed"]})
        if launcher == "swiftrun":
            method_used = [f"in-place ({args.swiftrun_kill} kill)"]
        elif launcher == "torchrun":
            method_used = [f"{m} (timer kill)" for m in method_used]
        ratio = (lost_med / base) if (lost_med is not None and base) else None
        rows.append([launcher, ", ".join(method_used), B.fmt_stat(s["clean"]), B.fmt_stat(s["failed"]),
                     B.fmt_stat(s["lost"]), B.fmt(ratio, 2)])
    print()
    print(B.table(["launcher", "method", "clean s", "failed s", "lost s", "lost / swiftrun lost"], rows))
    print("(median [min..max] over repetitions; lost = failed - clean, paired per repetition)")
    if "swiftrun" in results:
        rec = [r.extra.get("recovery_total_s") for r in results["swiftrun"]["failed"]]
        steps = [r.step_ms for r in results["swiftrun"]["failed"]]
        print(f"swiftrun recovery_end.total (its own failure->resume accounting): {B.fmt_stat(rec)} s; "
              f"step_ms clean {B.fmt_stat([r.step_ms for r in results['swiftrun']['clean']], 1)}, "
              f"failed run {B.fmt_stat(steps, 1)}")
    if "torchrun" in results:
        ck = [r.extra.get("ckpt_step_after_failure") for r in results["torchrun"]["failed"]]
        print(f"torchrun checkpoint step after the failure: {ck}; kill times (s after launch): "
              f"{[round(r.extra.get('killed_at_s', 0), 2) for r in results['torchrun']['failed']]}")
    others = [r.other_cores for d in results.values() for v in d.values() for r in v]
    print(f"CPU used by other processes during the runs (cores, of {os.cpu_count()}): {B.fmt_stat(others, 2)}")
    if probe_note:
        print(f"note: {probe_note}")
    bad = problem_runs(results)
    if bad:
        print(f"WARNING: runs with problems: {bad}")
    B.write_json(args.json, {"args": vars(args), "machine": B.machine_line(), "probe": probe_note,
                             "results": {l: {k: [{"wall": r.wall, "rc": r.rc, "step_ms": r.step_ms,
                                                   "other_cores": r.other_cores, **r.extra}
                                                  for r in v] for k, v in d.items()} for l, d in results.items()}})


if __name__ == "__main__":
    main()
