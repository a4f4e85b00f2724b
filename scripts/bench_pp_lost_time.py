#!/usr/bin/env python
"""Time lost to one SIGKILL of one pipeline stage: torchrun's global restart vs swiftrun, on examples/train_pp.py.

The paper's setup: a checkpoint every K steps (``--ckpt-dir D --ckpt-every K``, a fresh D per run), the failure
about half-way between two checkpoints (default: step 1.5 K). For each schedule (gpipe, 1f1b) and launcher, a
failure-free run and a failed run of the same command; lost = failed wall - clean wall, paired per repetition.
Runs are interleaved (the launcher order alternates per repetition).

Both launchers get the same script arguments and ``--max-restarts 1``:
  * torchrun: a global restart; every worker restarts and resumes from the last complete stage checkpoint. It
    runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it the restarted workers read the previous
    round's gloo addresses from the shared rendezvous store and fail with "connectFullMesh ... Connection
    refused" (``--shared-rdzv-store`` reproduces that).
  * swiftrun: in-place recovery of the lost stage once the pipeline runtime replays stages; until then its
    restart-all fallback from the same checkpoint, or a failure. The table says which happened, from swiftrun's
    event log (recoveries and their outcome, restarts) and the script's ``train_pp: resumed from step N`` line.

The kill is the same for both: wait for the first checkpoint (written after step K), then after a further
(STEP - K) x step_ms (rank 0's mean step time in the same repetition's clean run of that launcher) SIGKILL the
worker whose environment has RANK=--fail-rank (a spare is never picked). "exact" says whether the failed run's
rank files are bitwise equal to the clean run's.

    python scripts/bench_pp_lost_time.py --launchers torchrun           # the baseline: 4 ranks, 300 steps, K=100
    python scripts/bench_pp_lost_time.py                                  # torchrun and swiftrun
    python scripts/bench_pp_lost_time.py --quick                          # smoke test (60 steps, K=20, 1 rep)
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchlib as B  # noqa: E402

sys.path.insert(0, str(B.REPO))  # swiftrun's event-log parser, without installing the package


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--fail-step", type=int, default=None, help="default: --ckpt-every x 1.5")
    p.add_argument("--fail-rank", type=int, default=1, help="default 1: a middle stage")
    p.add_argument("--schedules", default="gpipe,1f1b")
    p.add_argument("--launchers", default="torchrun,swiftrun")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--script-args", default="", help="extra train_pp.py arguments, e.g. '--hidden 128'")
    p.add_argument("--swiftrun-args", default="", help="extra swiftrun options, e.g. '--recovery-timeout 30'")
    p.add_argument("--shared-rdzv-store", action="store_true",
                   help="run torchrun with its default shared rendezvous store (its restart then fails here)")
    p.add_argument("--timeout", type=float, default=300.0, help="per launcher run")
    p.add_argument("--failed-timeout", type=float, default=None,
                   help="seconds a failed run may take before it counts as hung (default: 2 x its clean run + 60)")
    p.add_argument("--quick", action="store_true", help="smoke test: 60 steps, checkpoint every 20, 1 repetition")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (logs, event logs)")
    p.add_argument("--json", default=None, help="also write the raw results here")
    a = p.parse_args()
    if a.quick:
        a.steps, a.ckpt_every, a.reps = 60, 20, 1
    if a.fail_step is None:
        a.fail_step = a.ckpt_every + a.ckpt_every // 2
    if not a.ckpt_every <= a.fail_step < a.steps:
        p.error("need --ckpt-every <= --fail-step < --steps")
    if not 0 <= a.fail_rank < a.nproc:
        p.error("--fail-rank must be a rank")
    return a


def env_for(launcher: str, args: argparse.Namespace) -> dict[str, str]:
    if launcher == "torchrun" and not args.shared_rdzv_store:
        return B.repo_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return B.repo_env()


def resumed_from(output: str) -> int | None:
    found = re.findall(r"train_pp: resumed from step (\d+)", output)
    return int(found[-1]) if found else None


def swiftrun_outcome(event_log: Path) -> dict:
    summary = B.recovery_summary(event_log)
    # one "outcome/mode" per recovery, for the table
    summary["recoveries"] = [f"{o}/{m}" for o, m in zip(summary.pop("outcomes"), summary.pop("modes"))]
    return summary


def what_happened(launcher: str, res: B.Result) -> str:
    """One phrase: how the failed run ended."""
    x = res.extra
    if res.timed_out:
        started = x.get("recoveries_started")
        return f"hung: killed after {res.wall:.0f} s" + (f" ({started} recoveries started, {len(x['recoveries'])} "
                                                          f"ended)" if started is not None else "")
    if x.get("error") and "killed_pid" not in x:
        return f"no kill ({x['error']})"
    if res.rc != 0:
        return f"failed (exit {res.rc})"
    resumed = x.get("resumed_from")
    if launcher == "swiftrun":
        if any(r.startswith("recovered") for r in x.get("recoveries", [])) and not x.get("restarts"):
            return "in-place recovery"
        if x.get("restarts"):
            return f"restart-all from step {resumed}" if resumed is not None else "restart-all"
        return "no recovery seen (kill missed?)"
    return f"global restart from step {resumed}" if resumed is not None else "finished without restarting?"


def one_run(launcher: str, schedule: str, failed: bool, args: argparse.Namespace, scratch: B.Scratch,
            clean: B.Result | None) -> B.Result:
    work = scratch.new(f"{schedule}-{launcher}-{'failed' if failed else 'clean'}")
    ckpt, save = work / "ckpt", work / "out"
    script = ["--steps", str(args.steps), "--schedule", schedule, "--ckpt-dir", str(ckpt),
              "--ckpt-every", str(args.ckpt_every), "--save-dir", str(save), *args.script_args.split()]
    log = work / "events.jsonl"
    if launcher == "swiftrun":
        cmd = B.swiftrun_cmd(args.nproc, script, event_log=log, script=B.TRAIN_PP,
                             extra=["--max-restarts", "1", *args.swiftrun_args.split()])
    else:
        cmd = B.torchrun_cmd(args.nproc, script, max_restarts=1, script=B.TRAIN_PP)
    run = B.Launched(cmd, work, env=env_for(launcher, args))
    info, limit = {}, args.timeout
    if failed:
        step_ms = (clean.step_ms if clean else None) or 30.0
        info = B.timer_kill(run, ckpt / "stage0-replica0.pt", fail_rank=args.fail_rank,
                            delay_s=(args.fail_step - args.ckpt_every) * step_ms / 1000.0, timeout=args.timeout,
                            info={"step_ms_used": step_ms})
        limit = min(limit, args.failed_timeout or (2 * clean.wall + 60 if clean else limit))
    res = run.wait(limit)
    res.extra.update(info, save_dir=str(save), resumed_from=resumed_from(res.output))
    if launcher == "swiftrun":
        res.extra.update(swiftrun_outcome(log))
    return res


def main() -> None:
    args = parse_args()
    launchers = [x.strip() for x in args.launchers.split(",") if x.strip()]
    schedules = [x.strip() for x in args.schedules.split(",") if x.strip()]
    print(f"# bench_pp_lost_time: {B.machine_line()}")
    print(f"# train_pp.py, {args.nproc} ranks ({args.nproc} stages), {args.steps} steps, SIGKILL rank "
          f"{args.fail_rank} near step {args.fail_step}, checkpoint every {args.ckpt_every}, "
          f"{args.reps} repetition(s), schedules {schedules}, launchers {launchers}, --max-restarts 1; "
          f"script args '{args.script_args}'")
    scratch = B.Scratch("pplost", keep=args.keep)
    results = {(s, l): {"clean": [], "failed": []} for s in schedules for l in launchers}
    try:
        for rep in range(args.reps):
            order = launchers if rep % 2 == 0 else launchers[::-1]
            for schedule in schedules:
                for launcher in order:
                    clean = one_run(launcher, schedule, False, args, scratch, None)
                    failed = one_run(launcher, schedule, True, args, scratch, clean)
                    failed.extra["exact"] = (B.same_rank_files(Path(clean.extra["save_dir"]),
                                                             Path(failed.extra["save_dir"]))
                                             if clean.rc == 0 and failed.rc == 0 else None)
                    failed.extra["outcome"] = what_happened(launcher, failed)
                    for kind, res in (("clean", clean), ("failed", failed)):
                        results[(schedule, launcher)][kind].append(res)
                        detail = {k: v for k, v in res.extra.items() if k not in ("save_dir",) and v is not None}
                        print(f"  rep {rep + 1} {schedule:6s} {launcher:8s} {kind:6s} wall={res.wall:6.2f}s "
                              f"step_ms={B.fmt(res.step_ms, 1)} rc={res.rc} "
                              f"other_cpu={B.fmt(res.other_cores, 2)}cores {detail if kind == 'failed' else ''}",
                              flush=True)
                        if res.rc != 0 or res.timed_out:
                            print(B.tail(res.output, 8))
    finally:
        scratch.close()

    rows = []
    for (schedule, launcher), d in results.items():
        clean = [r.wall for r in d["clean"]]
        failed = [r.wall for r in d["failed"]]
        ok = [r.rc == 0 and not r.timed_out for r in d["failed"]]
        lost = [f - c for c, f, good in zip(clean, failed, ok) if good]
        outcomes = sorted({r.extra.get("outcome", "?") for r in d["failed"]})
        exact = [r.extra.get("exact") for r in d["failed"]]
        rows.append([schedule, launcher, "; ".join(outcomes), B.fmt_stat(clean), B.fmt_stat(failed),
                     B.fmt_stat(lost) if lost else "-",
                     f"{sum(1 for e in exact if e)}/{len(exact)}",
                     B.fmt_stat([r.step_ms for r in d["clean"]], 1)])
    print()
    print(B.table(["schedule", "launcher", "what happened", "clean s", "failed s", "lost s", "exact",
                   "step ms"], rows))
    print("(median [min..max] over repetitions; lost = failed - clean, paired, only runs that ended with exit 0; "
          "exact: failed run's rank files bitwise equal to the clean run's)")
    kills = {f"{s}/{l}": [round(r.extra.get("killed_at_s", 0), 2) for r in d["failed"]]
             for (s, l), d in results.items()}
    print(f"kill times (s after launch): {kills}")
    if "swiftrun" in launchers:
        for schedule in schedules:
            d = results[(schedule, "swiftrun")]["failed"]
            print(f"swiftrun {schedule}: recoveries started {[r.extra.get('recoveries_started') for r in d]}, "
                  f"ended {[r.extra.get('recoveries') for r in d]}, restarts "
                  f"{[r.extra.get('restarts') for r in d]}, recovery_end.total "
                  f"{B.fmt_stat([r.extra.get('recovery_total_s') for r in d])} s")
    others = [r.other_cores for d in results.values() for v in d.values() for r in v]
    print(f"CPU used by other processes during the runs (cores, of {os.cpu_count()}): {B.fmt_stat(others, 2)}")
    B.write_json(args.json, {"args": vars(args), "machine": B.machine_line(),
                             "results": [{"schedule": s, "launcher": l, "kind": k,
                                          "runs": [{"wall": r.wall, "rc": r.rc, "step_ms": r.step_ms,
                                                    "timed_out": r.timed_out, "other_cores": r.other_cores,
                                                    **r.extra} for r in v]}
                                         for (s, l), d in results.items() for k, v in d.items()]})


if __name__ == "__main__":
    main()
