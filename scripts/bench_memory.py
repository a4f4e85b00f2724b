#!/usr/bin/env python
"""Peak resident memory (VmHWM) per worker: swiftrun vs torchrun on the same job.

While each run goes, /proc is polled (every --period s) for the launcher's descendants, and each process's
VmHWM (peak RSS, kB, from /proc/PID/status) is recorded; the last value read before it exits is its peak.

  * swiftrun: rank pids come from the ``worker_state`` events of its event log (read while it runs); a process
    started with SWIFTRUN_SPARE=1 that never became a rank is a warm spare, reported separately. Workers run
    with SWIFTRUN_LOGLEVEL=debug so that the script can tell whether the spare finished warming up ("spare
    warm, waiting for a rank") before the job ended: a spare still importing torch has not reached its peak.
  * torchrun: its descendants started with RANK in their environment are the workers.

The launcher process itself (swiftrun's supervisor, torchrun's agent) is reported too. Repetitions are
interleaved (swiftrun, torchrun, torchrun, swiftrun, ...); per rank the median over repetitions is shown.

    python scripts/bench_memory.py             # 4 ranks, 400 steps, 2 repetitions
    python scripts/bench_memory.py --quick     # smoke test
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchlib as B  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--period", type=float, default=0.1)
    p.add_argument("--swiftrun-args", default="")
    p.add_argument("--script-args", default="", help="extra train_dp.py arguments, e.g. '--hidden 1024'")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="smoke test: 1 repetition of 120 steps")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.quick:
        a.steps, a.reps = 120, 1
    return a


class Sampler:
    def __init__(self, launcher: str, run: B.Launched, event_log: Path | None) -> None:
        self.launcher, self.run, self.event_log = launcher, run, event_log
        self.peak_kb: dict[int, int] = {}
        self.env: dict[int, dict[str, str]] = {}
        self.rank_of: dict[int, int] = {}  # pid -> rank
        self._log_pos = 0

    def _read_worker_states(self) -> None:
        if self.event_log is None or not self.event_log.exists():
            return
        with self.event_log.open(encoding="utf-8", errors="replace") as f:
            f.seek(self._log_pos)
            chunk = f.read()
        end = chunk.rfind("\n")
        if end < 0:
            return
        self._log_pos += len(chunk[: end + 1].encode())
        for rec in B.read_events_text(chunk[: end + 1]):
            if rec.get("event") == "worker_state" and rec.get("pid") is not None and rec.get("rank") is not None:
                self.rank_of[int(rec["pid"])] = int(rec["rank"])

    def poll(self) -> None:
        self._read_worker_states()
        for pid in [self.run.pid, *B.descendants(self.run.pid)]:
            if pid not in self.env:
                self.env[pid] = B.environ(pid)
            kb = B.status_kb(pid, "VmHWM")
            if kb is not None:
                self.peak_kb[pid] = max(kb, self.peak_kb.get(pid, 0))

    def classify(self) -> dict:
        self._read_worker_states()
        ranks: dict[int, float] = {}
        spares: list[float] = []
        other: list[tuple[int, float, str]] = []
        for pid, kb in self.peak_kb.items():
            mb = kb / 1024.0
            env = self.env.get(pid, {})
            if pid == self.run.pid:
                continue
            if self.launcher == "swiftrun":
                if pid in self.rank_of:
                    ranks[self.rank_of[pid]] = max(mb, ranks.get(self.rank_of[pid], 0.0))
                elif env.get("SWIFTRUN_SPARE") == "1":
                    spares.append(mb)
                else:
                    other.append((pid, mb, "?"))
            else:
                if "RANK" in env:
                    rank = int(env["RANK"])
                    ranks[rank] = max(mb, ranks.get(rank, 0.0))
                else:
                    other.append((pid, mb, "?"))
        return {"ranks": ranks, "spares": spares, "launcher": self.peak_kb.get(self.run.pid, 0) / 1024.0,
                "other": other}


def spare_warm_pids(output: str) -> set[int]:
    return {int(m.group(1)) for m in re.finditer(r"swiftrun\[(\d+)\] spare warm, waiting", output)}


def main() -> None:
    args = parse_args()
    print(f"# bench_memory: {B.machine_line()}")
    print(f"# {args.nproc} ranks, {args.steps} steps, optimizer {args.optimizer} {args.script_args}, "
          f"{args.reps} repetition(s), /proc poll every {args.period}s")
    scratch = B.Scratch("memory", keep=args.keep)
    names = ["swiftrun", "torchrun"]
    results: dict[str, list[dict]] = {n: [] for n in names}
    try:
        for rep in range(args.reps):
            for name in (names if rep % 2 == 0 else names[::-1]):
                work = scratch.new(name)
                script = B.train_args(args.steps, work / "out", optimizer=args.optimizer,
                                      extra=args.script_args.split())
                if name == "swiftrun":
                    log = work / "events.jsonl"
                    cmd = B.swiftrun_cmd(args.nproc, script, event_log=log, extra=args.swiftrun_args.split())
                    env = dict(os.environ, SWIFTRUN_LOGLEVEL="debug")
                else:
                    log, env = None, None
                    cmd = B.torchrun_cmd(args.nproc, script, max_restarts=0)
                run = B.Launched(cmd, work, env=env)
                sampler = Sampler(name, run, log)
                poller = B.Poller(sampler.poll, args.period)
                poller.start()
                res = run.wait(args.timeout)
                poller.stop()
                info = sampler.classify()
                warm = spare_warm_pids(res.output)
                info["spares_warm"] = sum(1 for pid, kb in sampler.peak_kb.items()
                                          if pid in warm and pid not in sampler.rank_of)
                info.update(rc=res.rc, wall=res.wall, other_cores=res.other_cores)
                results[name].append(info)
                per_rank = " ".join(f"r{r}={mb:.0f}" for r, mb in sorted(info["ranks"].items()))
                print(f"  rep {rep + 1} {name:8s} rc={res.rc} wall={res.wall:.1f}s ranks(MB): {per_rank} "
                      f"launcher={info['launcher']:.0f} spares={[round(x) for x in info['spares']]} "
                      f"(warm: {info['spares_warm']}) other={info['other']} "
                      f"other_cpu={B.fmt(res.other_cores, 2)}cores", flush=True)
                if res.rc != 0:
                    print(B.tail(res.output, 12))
    finally:
        scratch.close()

    rows = []
    for rank in range(args.nproc):
        s = [r["ranks"].get(rank) for r in results["swiftrun"]]
        t = [r["ranks"].get(rank) for r in results["torchrun"]]
        ms, mt = B.med(s), B.med(t)
        diff = f"{ms - mt:+.1f} ({(ms / mt - 1) * 100:+.1f}%)" if ms is not None and mt else "-"
        rows.append([f"rank {rank}", B.fmt_stat(s, 1), B.fmt_stat(t, 1), diff])
    s_all = [B.med(r["ranks"].values()) for r in results["swiftrun"]]
    t_all = [B.med(r["ranks"].values()) for r in results["torchrun"]]
    ms, mt = B.med(s_all), B.med(t_all)
    rows.append(["median of ranks", B.fmt_stat(s_all, 1), B.fmt_stat(t_all, 1),
                 f"{ms - mt:+.1f} ({(ms / mt - 1) * 100:+.1f}%)" if ms is not None and mt else "-"])
    sl = [r["launcher"] for r in results["swiftrun"]]
    tl = [r["launcher"] for r in results["torchrun"]]
    rows.append(["launcher process", B.fmt_stat(sl, 1), B.fmt_stat(tl, 1),
                 f"{B.med(sl) - B.med(tl):+.1f}" if sl and tl else "-"])
    spares = [x for r in results["swiftrun"] for x in r["spares"]]
    rows.append(["warm spare (swiftrun only)", B.fmt_stat(spares, 1), "n/a",
                 f"{sum(r['spares_warm'] for r in results['swiftrun'])} of {len(spares)} spare(s) finished warming"])
    totals_s = [sum(r["ranks"].values()) + sum(r["spares"]) + r["launcher"] for r in results["swiftrun"]]
    totals_t = [sum(r["ranks"].values()) + r["launcher"] for r in results["torchrun"]]
    mts, mtt = B.med(totals_s), B.med(totals_t)
    rows.append(["sum of peaks (ranks+spare+launcher)", B.fmt_stat(totals_s, 0), B.fmt_stat(totals_t, 0),
                 f"{mts - mtt:+.0f}" if mts is not None and mtt is not None else "-"])
    print()
    print(B.table(["peak RSS, MB (VmHWM)", "swiftrun", "torchrun", "swiftrun - torchrun"], rows))
    others = [r["other_cores"] for rs in results.values() for r in rs]
    print(f"CPU used by other processes during the runs (cores, of {os.cpu_count()}): {B.fmt_stat(others, 2)}")
    B.write_json(args.json, {"args": vars(args), "machine": B.machine_line(), "results": results})


if __name__ == "__main__":
    main()
