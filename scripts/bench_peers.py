#!/usr/bin/env python
"""One job, one SIGKILL, three peers side by side: torchrun (checkpoint-restart), swiftrun (in place), torchft.

The job: examples/train_dp.py's MLP on --replicas data-parallel replicas (gloo, CPU), --steps steps of Adam.
For each peer, a failure-free run and a run in which the process of one replica (rank, or torchft replica group,
--fail-rank) is SIGKILLed at step --fail-step; lost = failed wall - clean wall, paired per repetition. The runs
are interleaved: every peer's clean run, then every peer's failed run, the peer order reversed every other
repetition. Every run has a timeout, after which its whole process tree is killed and the run reported as stalled.

How each peer runs, is killed and recovers:
  * torchrun: ``torchrun --standalone --nproc-per-node N --max-restarts 1 examples/train_dp.py ... --ckpt-dir D
    --ckpt-every K``, with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (without it the restarted workers fail to connect
    on this torch: docs/BENCHMARKS.md). torchrun has no fault injection: the RANK=R worker is SIGKILLed from
    outside, (STEP - K) x step_ms after the first checkpoint appears (step_ms of the same repetition's clean run).
    Every worker is restarted and resumes from the last checkpoint.
  * swiftrun: the same command under swiftrun, with ``--fault R:STEP:backward:sigkill``. Only the killed rank is
    replaced; its state comes from a survivor. (It writes the same checkpoints, so the commands match; it does not
    read them.)
  * torchft (0.2.0): scripts/_peer_torchft_train.py, train_dp's model, batches and optimizer under torchft's
    Manager, DistributedDataParallel and Optimizer wrappers: N replica groups of one process each, a lighthouse
    with --min_replicas 1, Manager(min_replica_size=1, use_async_quorum=False), torchft's default 60 s timeouts and
    5 s lighthouse heartbeat timeout; no checkpoints. The worker of replica group R SIGKILLs itself in the
    backward of step STEP (where swiftrun's fault fires). torchft restarts no process: this benchmark's own
    supervisor (the helper's --supervise mode, standing in for torchelastic) starts the killed worker again at
    once, and it heals from the survivor's state_dict. Meanwhile the survivor drops the failed step and trains on
    alone, so its final model is expected to differ from the failure-free run's (unless the restarted replica
    is back before the lighthouse's heartbeat timeout drops the dead one: then the survivor only waits).
    With torchft 0.2.0's DistributedDataParallel (``--torchft-grad-sync ddp``, the default) the survivor
    crashes here when its peer dies: the comm hook's ``assert fut._fut`` (torchft/ddp.py) fails once the
    gloo all-reduce raises; ``--torchft-grad-sync allreduce`` averages the gradients with Manager.allreduce
    instead (what that hook does, one tensor at a time), which survives.

Reported per peer: clean and failed wall time, lost, whether the failed run's final model (every rank's file:
parameters and optimizer state) is bitwise the failure-free run's, the largest parameter difference, whether the
surviving processes were kept (one pid from start to end), and what happened.

    python scripts/bench_peers.py                # 2 replicas, 300 steps, kill at 150, checkpoint every 100, 3 reps
    python scripts/bench_peers.py --quick        # smoke test: 40 steps, kill at 25, checkpoint every 10, 1 rep
    python scripts/bench_peers.py --peers torchrun,swiftrun

torchft must be importable by the Python running this script; where it is not, its peer is skipped, and the
table says why.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchlib as B  # noqa: E402
import bench_lost_time as L  # noqa: E402

sys.path.insert(0, str(B.REPO))  # swiftrun's event-log parser, without installing the package

TORCHFT_HELPER = Path(__file__).resolve().parent / "_peer_torchft_train.py"
PEERS = ("torchrun", "swiftrun", "torchft")
RECOVERY = {"torchrun": "restart all from checkpoint", "swiftrun": "replace killed rank in place",
            "torchft": "survivor trains on; killed replica restarted, heals from peer"}
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2,
                   help="data-parallel replicas: ranks for torchrun/swiftrun, one-process replica groups for torchft")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--fail-step", type=int, default=150)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=100, help="torchrun's (and swiftrun's) checkpoint period")
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--torchft-timeout-s", type=float, default=60.0,
                   help="torchft Manager timeout, quorum_timeout, connect_timeout and gloo timeout")
    p.add_argument("--torchft-heartbeat-timeout-ms", type=int, default=5000, help="torchft lighthouse's")
    p.add_argument("--torchft-grad-sync", choices=("ddp", "allreduce"), default="ddp",
                   help="ddp: torchft.DistributedDataParallel (here its comm hook fails 'assert fut._fut' in the "
                        "survivor when the peer dies); allreduce: torchft Manager.allreduce of each gradient")
    p.add_argument("--timeout", type=float, default=600.0, help="per run; its process tree is killed after it")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 40 steps, kill at 25, checkpoint every 10, 1 repetition, 90 s per run")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (logs, rank files)")
    p.add_argument("--json", default=None, help="also write the raw results here")
    a = p.parse_args()
    if a.quick:
        a.steps, a.fail_step, a.ckpt_every, a.reps, a.timeout = 40, 25, 10, 1, min(a.timeout, 90.0)
    if not a.ckpt_every <= a.fail_step < a.steps:
        p.error("need --ckpt-every <= --fail-step < --steps")
    if a.replicas < 2 or not 0 <= a.fail_rank < a.replicas:
        p.error("need --replicas >= 2 and 0 <= --fail-rank < --replicas")
    a.peers = [x.strip() for x in a.peers.split(",") if x.strip()]
    if set(a.peers) - set(PEERS):
        p.error(f"--peers: choose from {','.join(PEERS)}")
    return a


def torchft_missing() -> str | None:
    """Why this interpreter cannot run the torchft peer (None: it can)."""
    try:
        importlib.import_module("torchft")
    except Exception as e:  # noqa: BLE001 - a broken install (say, built against another torch) counts as missing
        return f"torchft not importable by {sys.executable}: {type(e).__name__}: {e}"
    return None


# ------------------------------------------------------------------ commands


def peer_cmd(peer: str, failed: bool, args: argparse.Namespace, work: Path) -> list[str]:
    if peer == "torchft":
        kill = ["--kill-replica", str(args.fail_rank), "--kill-at-step", str(args.fail_step)] if failed else []
        return [B.PY, str(TORCHFT_HELPER), "--supervise", "--replicas", str(args.replicas), *kill,
                "--timeout-s", str(args.torchft_timeout_s), "--heartbeat-timeout-ms",
                str(args.torchft_heartbeat_timeout_ms), "--grad-sync", args.torchft_grad_sync, "--",
                *B.train_args(args.steps, work / "out", optimizer=args.optimizer)]
    script = B.train_args(args.steps, work / "out", optimizer=args.optimizer, ckpt_dir=work / "ckpt",
                          ckpt_every=args.ckpt_every)
    if peer == "torchrun":
        return B.torchrun_cmd(args.replicas, script, max_restarts=1)
    fault = ["--fault", f"{args.fail_rank}:{args.fail_step}:backward:sigkill"] if failed else []
    return B.swiftrun_cmd(args.replicas, script, event_log=work / "events.jsonl", extra=fault)


def shown(cmd: list[str], peer: str) -> str:
    env = " ".join(f"{k}={v}" for k, v in TORCHRUN_ENV.items()) + " " if peer == "torchrun" else ""
    return f"PYTHONPATH={B.REPO} {env}{shlex.join(cmd)}"


# ------------------------------------------------------------------ one run


class SurvivorPids:
    """The pids of the surviving ranks' workers during a launcher's run, read from /proc every 0.2 s."""

    def __init__(self, run: B.Launched, ranks: list[int]) -> None:
        self.seen: dict[int, set[int]] = {r: set() for r in ranks}
        self._root = run.pid
        self._poller = B.Poller(self._look, 0.2)
        self._poller.start()

    def _look(self) -> None:
        for rank, pids in self.seen.items():
            pid = B.find_rank_pid(self._root, rank)
            if pid:
                pids.add(pid)

    def stop(self) -> dict[int, list[int]]:
        self._poller.stop()
        return {r: sorted(p) for r, p in self.seen.items()}


def kept(pids: dict[int, list[int]]) -> bool | None:
    """Every survivor had one process throughout (None: one was never seen)."""
    if any(not p for p in pids.values()):
        return None
    return all(len(p) == 1 for p in pids.values())


def one_run(peer: str, failed: bool, args: argparse.Namespace, scratch: B.Scratch,
            clean: B.Result | None) -> B.Result:
    work = scratch.new(f"{peer}-{'failed' if failed else 'clean'}")
    cmd = peer_cmd(peer, failed, args, work)
    run = B.Launched(cmd, work, env=B.repo_env(**(TORCHRUN_ENV if peer == "torchrun" else {})))
    survivors = [r for r in range(args.replicas) if r != args.fail_rank]
    watch = SurvivorPids(run, survivors) if peer != "torchft" else None
    info: dict = {}
    try:
        if failed and peer == "torchrun":
            info = torchrun_kill(run, work / "ckpt", args, clean)
        res = run.wait(args.timeout)
    finally:
        if run.proc.poll() is None:  # an exception above: leave no process behind
            run.kill()
            run.proc.wait()
        pids = watch.stop() if watch else {}
    res.extra.update(info, save=work / "out", shown=shown(cmd, peer))
    outcome = {"torchrun": torchrun_outcome, "swiftrun": swiftrun_outcome, "torchft": torchft_outcome}[peer]
    res.extra.update(outcome(res, failed, args, work, pids))
    return res


def torchrun_kill(run: B.Launched, ckpt: Path, args: argparse.Namespace, clean: B.Result | None) -> dict:
    step_ms = (clean.step_ms if clean else None) or 30.0
    info = B.timer_kill(run, ckpt / "latest.pt", fail_rank=args.fail_rank, timeout=args.timeout,
                        delay_s=(args.fail_step - args.ckpt_every) * step_ms / 1000.0,
                        info={"step_ms_used": step_ms})
    info["ckpt_step_at_kill"] = L.checkpoint_step(ckpt / "latest.pt")
    return info


def ended_badly(res: B.Result) -> str | None:
    if res.timed_out:
        return f"STALLED: no end within {res.wall:.0f} s, process tree killed"
    if res.rc != 0:
        cause = last_exception(res.output)
        return f"FAILED: exit {res.rc}" + (f" ({cause})" if cause else "")
    return None


def last_exception(output: str) -> str | None:
    """The last traceback's exception and its innermost frame, e.g. 'AssertionError at torchft/ddp.py:76'."""
    lines = output.splitlines()
    frames = [i for i, ln in enumerate(lines) if ln.strip().startswith('File "')]
    if not frames:
        return None
    frame = lines[frames[-1]].strip().split('"')
    where = "/".join(frame[1].split("/")[-2:]) + ":" + frame[2].split(",")[1].split()[-1]
    error = next((ln.strip() for ln in lines[frames[-1] + 1:] if ln[:1].isalpha()), "?")
    return f"{error[:120]} at {where}"


def torchrun_outcome(res: B.Result, failed: bool, args: argparse.Namespace, work: Path,
                     pids: dict[int, list[int]]) -> dict:
    out = {"step_ms": res.step_ms, "survivor_pids": pids, "survivor_kept": kept(pids)}
    if not failed:
        out["happened"] = ended_badly(res) or "ran"
        return out
    if "killed_pid" not in res.extra:
        out["happened"] = f"no kill: {res.extra.get('error')}"
    else:
        out["happened"] = ended_badly(res) or (f"all {args.replicas} workers restarted, resumed from checkpoint "
                                               f"step {res.extra.get('ckpt_step_at_kill')}")
    out["detail"] = (f"SIGKILL {res.extra.get('killed_at_s', 0):.2f} s after launch; checkpoint step at the kill "
                     f"{res.extra.get('ckpt_step_at_kill')}; survivor pids {pids}")
    return out


def swiftrun_outcome(res: B.Result, failed: bool, args: argparse.Namespace, work: Path,
                     pids: dict[int, list[int]]) -> dict:
    summary = B.recovery_summary(work / "events.jsonl")
    out = {"step_ms": res.step_ms, "survivor_pids": pids, "survivor_kept": kept(pids), **summary}
    in_place = (summary["recoveries"] == 1 and not summary["restarts"]
                and all(str(o).startswith("recovered") for o in summary["outcomes"]))
    if not failed:
        out["happened"] = ended_badly(res) or "ran"
    elif ended_badly(res):
        out["happened"] = ended_badly(res)
    elif in_place:
        out["happened"] = f"rank {args.fail_rank} replaced in place"
    else:
        out["happened"] = f"recoveries {summary['outcomes']}, restarts {summary['restarts']}"
    if failed:
        out["detail"] = (f"recovery {summary['outcomes']}/{summary['modes']}, kill -> resumed "
                         f"{B.fmt(summary['recovery_total_s'], 2)} s; survivor pids {pids}")
    return out


def torchft_events(output: str) -> list[dict[str, str]]:
    """The helper's ``peer_torchft: event=NAME key=value ...`` lines, as dicts."""
    found = []
    for line in output.splitlines():
        at = line.find("peer_torchft: event=")
        if at >= 0:
            fields = line[at + len("peer_torchft: "):].split()
            found.append(dict(f.split("=", 1) for f in fields if "=" in f))
    return found


def torchft_outcome(res: B.Result, failed: bool, args: argparse.Namespace, work: Path,
                    pids: dict[int, list[int]]) -> dict:
    events = torchft_events(res.output)
    by_name = lambda name: [e for e in events if e.get("event") == name]  # noqa: E731
    survivors = {str(r) for r in range(args.replicas)} - {str(args.fail_rank)}
    ends = {e["replica"]: e for e in by_name("end")}
    started = {r: sorted({e["pid"] for e in by_name("start") if e["replica"] == r}) for r in survivors}
    survivor_kept = all(len(p) == 1 and ends.get(r, {}).get("pid") == p[0] for r, p in started.items())
    first = ends.get(min(survivors), {})
    out = {"step_ms": float(first["step_ms"]) if "step_ms" in first else None, "survivor_pids": started,
           "survivor_kept": survivor_kept if ends else None, "events": events,
           "batches_committed": int(first["batches_committed"]) if first else None}
    out["happened"] = ended_badly(res) or ("ran" if not failed else torchft_story(events, first))
    if failed:
        out["detail"] = torchft_detail(events, args, first)
    return out


def torchft_story(events: list[dict[str, str]], survivor_end: dict[str, str]) -> str:
    names = [e["event"] for e in events]
    if "sigkill" not in names:
        return "no kill happened"
    if "healed" not in names:
        return "killed replica never healed"
    alone = survivor_end.get("degraded_steps", "0") != "0"
    return ("survivor dropped the failed step, " + ("trained on alone" if alone else "waited (no step alone)") +
            "; killed replica restarted by this benchmark, healed from the survivor")


def torchft_detail(events: list[dict[str, str]], args: argparse.Namespace, survivor_end: dict[str, str]) -> str:
    def at(name: str) -> dict[str, str]:
        return next((e for e in events if e.get("event") == name), {})

    kill, restart, healed = at("sigkill"), at("restart"), at("healed")
    since_kill = lambda e: f"{float(e['unix']) - float(kill['unix']):.2f} s" if e and kill else "-"  # noqa: E731
    total = args.replicas * args.steps
    return (f"SIGKILL replica {kill.get('replica', '-')} at step {kill.get('step', '-')}; survivor: "
            f"{survivor_end.get('failed_commits', '-')} step(s) not committed, longest stall between commits "
            f"{survivor_end.get('longest_gap_s', '-')} s, {survivor_end.get('degraded_steps', '-')} step(s) "
            f"committed without the killed replica; restart {since_kill(restart)} after the kill, healed at step "
            f"{healed.get('step', '-')} {since_kill(healed)} after the kill; batches committed "
            f"{survivor_end.get('batches_committed', '-')}/{total}")


# ------------------------------------------------------------------ comparison


def max_param_diff(a: Path, b: Path) -> float | None:
    """The largest |difference| over every parameter of every rank file (None: files missing or no torch)."""
    try:
        import torch
    except ImportError:
        return None
    names = sorted(p.name for p in a.glob("rank*.pt"))
    if not names or names != sorted(p.name for p in b.glob("rank*.pt")):
        return None
    worst = 0.0
    for name in names:
        x, y = (torch.load(d / name, weights_only=True)["model"] for d in (a, b))
        worst = max([worst, *((x[k].double() - y[k].double()).abs().max().item() for k in x)])
    return worst


def compare(res: B.Result, reference: B.Result | None) -> dict:
    """Bitwise equality and largest parameter difference of two runs' final models (None where either failed)."""
    if reference is None or ended_badly(res) or ended_badly(reference):
        return {"bitwise": None, "max_diff": None}
    a, b = Path(res.extra["save"]), Path(reference.extra["save"])
    return {"bitwise": B.same_rank_files(a, b), "max_diff": max_param_diff(a, b)}


# ------------------------------------------------------------------ the runs and their report


def interleaved_runs(args: argparse.Namespace, peers: list[str], scratch: B.Scratch
                     ) -> dict[str, dict[str, list[B.Result]]]:
    results: dict[str, dict[str, list[B.Result]]] = {p: {"clean": [], "failed": []} for p in peers}
    for rep in range(args.reps):
        order = peers if rep % 2 == 0 else peers[::-1]
        clean: dict[str, B.Result] = {}
        for failed in (False, True):
            for peer in order:
                res = one_run(peer, failed, args, scratch, clean.get(peer))
                if failed:
                    res.extra.update(compare(res, clean.get(peer)))
                else:
                    clean[peer] = res
                results[peer]["failed" if failed else "clean"].append(res)
                print_run(rep, peer, failed, res)
    return results


def print_run(rep: int, peer: str, failed: bool, res: B.Result) -> None:
    x = res.extra
    line = (f"  rep {rep + 1} {peer:8s} {'failed' if failed else 'clean ':6s} wall={res.wall:6.2f}s "
            f"rc={res.rc} step_ms={B.fmt(x.get('step_ms'), 2)} other_cpu={B.fmt(res.other_cores, 2)}cores "
            f"load={res.load_before:.2f}->{res.load_after:.2f}")
    if failed:
        line += (f" bitwise={x.get('bitwise')} max_diff={B.fmt(x.get('max_diff'), 6)} "
                 f"survivor_kept={x.get('survivor_kept')}\n      {x['happened']}: {x.get('detail', '')}")
    print(line, flush=True)
    if ended_badly(res):
        print(B.tail(res.output, 15))


def count(values: list, want: object = True) -> str:
    return f"{sum(1 for v in values if v is want)}/{len(values)}"


def diff_cell(diffs: list[float | None]) -> str:
    if all(d is None for d in diffs):
        return "-"
    return "0" if all(d == 0 for d in diffs if d is not None) else B.fmt_stat(diffs, 6)


def peer_row(peer: str, runs: dict[str, list[B.Result]]) -> list[str]:
    clean, failed = runs["clean"], runs["failed"]
    ok = [not ended_badly(c) and not ended_badly(f) for c, f in zip(clean, failed)]
    lost = [f.wall - c.wall for c, f, good in zip(clean, failed, ok) if good]
    diffs = [f.extra.get("max_diff") for f in failed]
    happened = sorted({f.extra.get("happened", "?") for f in failed})
    return [peer, RECOVERY[peer], B.fmt_stat([r.wall for r in clean]), B.fmt_stat([r.wall for r in failed]),
            B.fmt_stat(lost) if lost else "-", count([f.extra.get("bitwise") for f in failed]),
            diff_cell(diffs),
            count([f.extra.get("survivor_kept") for f in failed]), "; ".join(happened)]


def cross_peer_line(results: dict[str, dict[str, list[B.Result]]]) -> str | None:
    """Whether every peer's first failure-free run ended where torchrun's did (the same job, computed alike)."""
    if "torchrun" not in results:
        return None
    reference = results["torchrun"]["clean"][0]
    parts = []
    for peer, runs in results.items():
        if peer != "torchrun":
            found = compare(runs["clean"][0], reference)
            parts.append(f"{peer}: bitwise={found['bitwise']} max_diff={B.fmt(found['max_diff'], 6)}")
    return "failure-free final models against torchrun's failure-free run (repetition 1): " + "; ".join(parts)


def report(args: argparse.Namespace, results: dict[str, dict[str, list[B.Result]]], skipped: str | None) -> None:
    rows = [peer_row(peer, runs) for peer, runs in results.items()]
    if skipped:
        rows.append(["torchft", RECOVERY["torchft"], "-", "-", "-", "-", "-", "-", f"SKIPPED: {skipped}"])
    print()
    print(B.table(["peer", "recovery", "clean s", "failed s", "lost s", "bitwise = clean", "max |param diff|",
                   "survivor kept", "what happened"], rows))
    print("(median [min..max] over repetitions; lost = failed - clean, paired, only where both runs ended with "
          "exit 0; bitwise = clean: the failed run's final rank files (parameters and optimizer state) equal the "
          "same peer's failure-free run's, torch.equal on every tensor; survivor kept: the ranks not killed kept "
          "one process from start to end)")
    for peer, runs in results.items():
        for i, res in enumerate(runs["failed"]):
            print(f"{peer} failed run {i + 1}: {res.extra.get('detail', res.extra.get('happened'))}")
        if peer == "torchft":
            print(f"torchft batches committed (of {args.replicas * args.steps}): clean "
                  f"{[r.extra.get('batches_committed') for r in runs['clean']]}, failed "
                  f"{[r.extra.get('batches_committed') for r in runs['failed']]} (a lost time does not count "
                  f"the batches a run dropped)")
        print(f"{peer} step_ms clean {B.fmt_stat([r.extra.get('step_ms') for r in runs['clean']], 2)}, "
              f"failed {B.fmt_stat([r.extra.get('step_ms') for r in runs['failed']], 2)}")
    line = cross_peer_line(results)
    if line:
        print(line)
    others = [r.other_cores for d in results.values() for v in d.values() for r in v]
    print(f"CPU used by other processes during the runs (cores, of {os.cpu_count()}): {B.fmt_stat(others, 2)}; "
          f"load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("\n# commands (repetition 1; every run has its own scratch directory)")
    for peer, runs in results.items():
        for kind in ("clean", "failed"):
            if runs[kind]:
                print(f"{peer} {kind}: {runs[kind][0].extra['shown']}")


def run_json(res: B.Result) -> dict:
    return {"wall": res.wall, "rc": res.rc, "timed_out": res.timed_out, "other_cores": res.other_cores,
            "load_before": res.load_before, "load_after": res.load_after, **res.extra}


def main() -> None:
    args = parse_args()
    # The launchers of this interpreter's environment (torchrun, torchft_lighthouse), not whichever PATH has first.
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    skipped = torchft_missing() if "torchft" in args.peers else None
    peers = [p for p in args.peers if not (p == "torchft" and skipped)]
    print(f"# bench_peers: {B.machine_line()}")
    print(f"# invocation: {shlex.join([sys.executable, *sys.argv])}")
    print(f"# {args.replicas} replicas, {args.steps} steps, SIGKILL replica {args.fail_rank} at step "
          f"{args.fail_step}, torchrun checkpoint every {args.ckpt_every}, {args.reps} repetition(s), peers {peers}")
    if skipped:
        print(f"# torchft skipped: {skipped}")
    scratch = B.Scratch("peers", keep=args.keep)
    started = time.monotonic()
    try:
        results = interleaved_runs(args, peers, scratch)
        report(args, results, skipped)
    finally:
        scratch.close()
    print(f"(benchmark took {time.monotonic() - started:.0f} s)")
    B.write_json(args.json, {"args": vars(args), "machine": B.machine_line(), "invocation": sys.argv,
                             "torchft_skipped": skipped,
                             "results": {p: {k: [run_json(r) for r in v] for k, v in d.items()}
                                         for p, d in results.items()}})


if __name__ == "__main__":
    main()
