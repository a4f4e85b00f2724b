#!/usr/bin/env python
"""Goodput at 1k to 100k GPUs under published failure rates, from recovery costs measured here and now.

First it measures, on this machine and in this invocation (each a real kill of real processes):
  * a failure-free run of examples/train_dp.py under swiftrun and under torchrun (the failure-free overhead);
  * one rank SIGKILLed under each (swiftrun recovers in place; torchrun's job is run again from its last checkpoint,
    as its own --max-restarts path hangs here): the time each lost, as scripts/bench_lost_time.py measures it;
  * one node of a two-node swiftrun job SIGKILLed (agent and workers), its slot taken by a hot-spare node.
Then it models a job of N GPUs (scripts/_goodput_model.py): failures at Llama 3's per-GPU rate (or Meta RSC's
fitted job MTTF), split by cause into process restarts, hangs and node losses, each costing what was measured plus
what grows with N (communicator initialisation, store barrier) and published costs (checkpoint load, NCCL timeout,
node replacement). Every input is printed with its source. Output: a table per size, the end-to-end speed-up in the
Swift paper's terms (total training time, checkpoint-restart over swiftrun), optionally a PNG and JSON.

    python scripts/goodput.py --quick                   # 2 ranks, short runs (a few minutes)
    python scripts/goodput.py --plot docs/img/goodput.png --json /tmp/goodput.json
    python scripts/goodput.py --from-json /tmp/goodput.json --failure-model rsc   # re-model, no measuring
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchlib as B  # noqa: E402
import _goodput_model as G  # noqa: E402
import bench_lost_time as L  # noqa: E402

SIZES = (1_024, 4_096, 16_384, 65_536, 100_000)
LOCAL_PHASES = ("rebuild", "transfer")  # what the model replaces with its at-scale figures


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 ranks, 60 steps, one repetition")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--fail-step", type=int, default=150)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0, help="per launcher run")
    p.add_argument("--from-json", default=None, help="take the measured inputs from an earlier --json instead")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="GPU counts to model")
    p.add_argument("--failure-model", choices=("llama3", "rsc"), default="llama3")
    p.add_argument("--step-s", type=float, default=5.0, help="the modelled job's step time")
    p.add_argument("--state-gb", type=float, default=20.0, help="model and optimizer state per GPU, GB")
    p.add_argument("--replica-groups", type=int, default=8, help="torchft-like: data-parallel replica groups")
    p.add_argument("--json", default=None, help="write the inputs and results here")
    p.add_argument("--plot", default=None, help="write a PNG of goodput against N here (needs matplotlib)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    a = p.parse_args()
    if a.quick:
        a.nproc, a.steps, a.fail_step, a.ckpt_every, a.reps = 2, 60, 40, 20, 1
    if not a.ckpt_every <= a.fail_step < a.steps:
        p.error("need --ckpt-every <= --fail-step < --steps")
    try:
        a.sizes = tuple(int(s) for s in a.sizes.split(",") if s.strip())
    except ValueError:
        p.error(f"--sizes must be comma-separated integers, got {a.sizes!r}")
    if not a.sizes or min(a.sizes) < 1:
        p.error("--sizes needs at least one positive GPU count")
    return a


# ------------------------------------------------------------------ measuring


def _phases_ms(events: list[dict], names: tuple[str, ...]) -> float:
    return sum(float(e.get("duration") or 0.0) * 1000 for e in events
               if e["event"] == "recovery_phase" and e.get("phase") in names)


def _wall(event: dict) -> float:
    return datetime.datetime.fromisoformat(event["wall"]).timestamp()


def measure_rank_loss(args: argparse.Namespace, scratch: B.Scratch) -> dict:
    """bench_lost_time's runs: failure-free and one rank SIGKILLed, under swiftrun and torchrun, interleaved."""
    # torchrun's own --max-restarts path never recovered on this 2-core machine (it hangs: docs/BENCHMARKS.md
    # section 1), so its restart is the failed run until torchrun exits plus the same command run again
    bench = argparse.Namespace(nproc=args.nproc, steps=args.steps, fail_step=args.fail_step, fail_rank=1,
                               ckpt_every=args.ckpt_every, optimizer="adam", swiftrun_kill="fault", swiftrun_args="",
                               timeout=args.timeout, restart_timeout=None, reps=args.reps, torchrun_method="rerun")
    runs, _ = L.interleaved_runs(bench, ["swiftrun", "torchrun"], scratch)
    bad = L.problem_runs(runs)
    if bad:
        raise SystemExit(f"measuring runs failed: {bad}")
    local_ms = [_phases_ms(B.read_events(log), LOCAL_PHASES)
                for log in sorted(scratch.root.glob("*-swiftrun-failed/events.jsonl"))]

    def lost(launcher: str) -> list[float]:
        return [f.wall - c.wall for c, f in zip(runs[launcher]["clean"], runs[launcher]["failed"])]

    # the steps from the checkpoint the rerun starts from to the kill (near --fail-step) are redone
    redo = [(args.fail_step - (f.extra.get("ckpt_step_after_failure") or args.ckpt_every)) * (c.step_ms or 0) / 1000
            for c, f in zip(runs["torchrun"]["clean"], runs["torchrun"]["failed"])]
    step = {x: B.med(r.step_ms for r in runs[x]["clean"]) for x in runs}
    return {
        "swift_rank_lost_s": B.med(r.extra.get("recovery_total_s") for r in runs["swiftrun"]["failed"]),
        "swift_rank_wall_lost_s": B.med(lost("swiftrun")),
        "swift_rank_local_s": B.med(local_ms) / 1000,
        "torchrun_lost_s": B.med(lost("torchrun")),
        "torchrun_restart_s": B.med(x - r for x, r in zip(lost("torchrun"), redo)),
        "torchrun_method": "rerun",
        "swift_step_extra_s": (step["swiftrun"] - step["torchrun"]) / 1000,
        "step_ms": step,
    }


def _free_port_pair() -> int:
    """A port p with p and p+1 free: the store, and the coordinator's control socket at p+1."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise SystemExit("no free port pair for the two-node run")


def measure_node_loss(args: argparse.Namespace, scratch: B.Scratch) -> dict:
    """Two nodes of one rank each and a hot-spare node, on this machine; node 1's process group SIGKILLed once
    training runs. Detection runs at a 6 s --node-timeout (to keep the run short); the model puts swiftrun's
    default back, so what is measured is from the node declared lost to training resumed."""
    work = scratch.new("node-loss")
    events = work / "events.jsonl"
    port = _free_port_pair()
    script = [str(B.TRAIN_DP), *B.train_args(800, work / "save")]

    def node(k: int, *extra: str) -> subprocess.Popen:
        cmd = [B.PY, "-m", "swiftrun", "--no-dashboard", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
               str(k), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "goodput",
               "--spares", "0", "--node-lease", "3", "--node-timeout", "6", *extra, *script]
        with (work / f"node{k}.log").open("w") as out:
            return subprocess.Popen(cmd, cwd=work, env=B.repo_env(), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)

    procs = [node(0, "--event-log", str(events)), node(1), node(2)]
    try:
        deadline = time.monotonic() + args.timeout
        while True:
            log = B.read_events(events)
            steps = [e["step"] for e in log if e["event"] == "progress"]
            if steps and steps[-1] >= 60 and any(e["event"] == "node_joined" and e.get("slot") is None for e in log):
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit(f"the two-node run did not get going:\n{B.tail((work / 'node0.log').read_text())}")
            time.sleep(0.1)
        killed_at = time.time()
        B.kill_tree(procs[1].pid)
        rcs = [procs[0].wait(timeout=args.timeout), procs[2].wait(timeout=args.timeout)]
    finally:
        for p in procs:
            if p.poll() is None:
                B.kill_tree(p.pid)
            p.wait()
    log = B.read_events(events)
    lost = next((e for e in log if e["event"] == "node_lost" and e.get("slot") == 1), None)
    end = next((e for e in log if e["event"] == "recovery_end"), None)
    if rcs != [0, 0] or lost is None or end is None or end.get("outcome") != "recovered":
        raise SystemExit(f"the node-loss run did not recover in place (exit codes {rcs}):\n"
                         f"{B.tail((work / 'node0.log').read_text())}")
    return {"swift_node_after_detect_s": _wall(end) - _wall(lost), "swift_node_detect_here_s": _wall(lost) - killed_at,
            "swift_node_local_s": _phases_ms(log, LOCAL_PHASES) / 1000}


def measure(args: argparse.Namespace) -> dict:
    from swiftrun.config import Timeouts

    scratch = B.Scratch("goodput", keep=args.keep)
    try:
        print(f"# measuring: {args.nproc} ranks, {args.steps} steps, rank 1 SIGKILLed near step {args.fail_step}, "
              f"torchrun checkpoints every {args.ckpt_every}, {args.reps} repetition(s)", flush=True)
        rank = measure_rank_loss(args, scratch)
        print("# measuring: a node of a two-node job SIGKILLed, a hot spare taking its slot", flush=True)
        node = measure_node_loss(args, scratch)
    finally:
        scratch.close()
    defaults = Timeouts()
    return {**rank, **node, "node_timeout_default_s": defaults.node_timeout,
            "swift_node_lost_s": defaults.node_timeout + node["swift_node_after_detect_s"],
            "swift_hang_detect_s": defaults.heartbeat_timeout, "machine": B.machine_line()}


# ------------------------------------------------------------------ reporting


def measured_inputs(raw: dict) -> G.Measured:
    return G.Measured(**{k: raw[k] for k in G.Measured.__dataclass_fields__})


def inputs_table(raw: dict, job: G.Job, pub: G.Published, origin: str) -> str:
    here = f"measured here ({origin})"
    rows = [
        ["swiftrun: one rank's SIGKILL -> training resumed", f"{raw['swift_rank_lost_s']:.2f} s",
         f"{here}, recovery_end.total"],
        ["  (cross-check: failed run - failure-free run, wall)", f"{raw['swift_rank_wall_lost_s']:.2f} s", here],
        ["  of which local process-group rebuild + state copy", f"{raw['swift_rank_local_s']:.3f} s", here],
        ["swiftrun: node declared lost -> training resumed (hot spare)", f"{raw['swift_node_after_detect_s']:.2f} s",
         here],
        ["  + node detection (swiftrun's --node-timeout default)", f"{raw['node_timeout_default_s']:.0f} s",
         "swiftrun.config.Timeouts"],
        ["swiftrun: hang detection (--heartbeat-timeout default)", f"{raw['swift_hang_detect_s']:.0f} s",
         "swiftrun.config.Timeouts"],
        ["swiftrun failure-free step time vs torchrun's (ms, a fixed cost per step)",
         f"{raw['step_ms']['swiftrun']:.1f} vs {raw['step_ms']['torchrun']:.1f}", here],
        ["torchrun: time lost to one rank's SIGKILL (run again from ckpt)", f"{raw['torchrun_lost_s']:.2f} s", here],
        ["  less the steps redone since the checkpoint", f"{raw['torchrun_restart_s']:.2f} s", here],
        ["failures: GPU-hours per unexpected interruption", f"{G.gpu_hours_per_failure():,.0f}",
         "Llama 3 405B, arXiv 2407.21783: 419 in 54 days on 16,384 GPUs"],
        ["failures: job MTTF (rsc model)", ", ".join(f"{h:.3g} h @{n:,}" for n, h in pub.rsc_mttf_h),
         "Meta RSC, arXiv 2410.21680 (via Clockwork)"],
        ["causes: process / hang / node", " / ".join(f"{w * 100:.0f}%" for w in G.cause_weights().values()),
         "Llama 3 Table 5, grouped (GPU faults cost their node)"],
        ["NCCL init", ", ".join(f"{s:g} s @{n:,}" for n, s in pub.nccl_init_s),
         "NVIDIA/nccl#587; NCCLX arXiv 2510.20171 (power law between)"],
        ["store barrier", f"{pub.barrier_s_at_16k} s @16,384 (linear)", "NVRx in-process usage guide"],
        ["hang noticed by torchrun (NCCL timeout)", f"{pub.nccl_timeout_s:.0f} s", "PyTorch default"],
        ["checkpoint stall / load", f"{pub.ckpt_stall_s} s / {pub.ckpt_load_s:.0f} s",
         "DCP async per 7B / Ant Group (DLRover)"],
        ["node replacement without a spare", f"{pub.node_replace_s:.0f} s", "Ant Group (DLRover): pod scheduling"],
        ["torchft: stall until timeout / group heal / overhead",
         f"{pub.torchft_stall_s:.0f} s / {pub.torchft_heal_s:.0f} s / {pub.torchft_overhead:.0%}",
         "torchft Manager default, torchft#164, #329; docs"],
        ["state copy link", f"{pub.link_gb_per_s:g} GB/s", "LANDSCAPE.md section 3 (inferred low end)"],
        ["job: step time / state per GPU / replica groups",
         f"{job.step_s:g} s / {job.state_gb_per_gpu:g} GB / {job.replica_groups}", "parameters (--step-s ...)"],
    ]
    return B.table(["input", "value", "source"], rows)


def results_table(results: dict[int, dict[str, G.Breakdown]]) -> str:
    rows = []
    for n, by in results.items():
        swift, swift_ns, tr, tr_ns, ft = (by[k] for k in ("swiftrun", "swiftrun, no spare", "torchrun+ckpt",
                                                          "torchrun+ckpt, no spare", "torchft-like"))
        rows.append([f"{n:,}", f"{swift.mtbf_s / 3600:.2f} h", f"{swift.goodput * 100:.2f}%",
                     f"{swift_ns.goodput * 100:.2f}%",
                     f"{tr.goodput * 100:.2f}% (ckpt {tr.ckpt_interval_s / 60:.0f} min)",
                     f"{tr_ns.goodput * 100:.2f}%", f"{ft.goodput * 100:.2f}% (inexact)",
                     f"{tr.goodput and swift.goodput / tr.goodput:.3f}x"])
    return B.table(["GPUs", "job MTBF", "swiftrun", "swiftrun, no spare", "torchrun+ckpt", "torchrun, no spare",
                    "torchft-like", "speed-up vs torchrun"], rows)


def swift_node_cost_table(raw: dict, sizes: tuple[int, ...], job: G.Job, pub: G.Published) -> str:
    """What one node loss costs swiftrun at each size: what was measured here, and what grows with N."""
    m, rows = measured_inputs(raw), []
    for n in sizes:
        init, barrier = G.nccl_init_s(n, pub), G.barrier_s(n, pub)
        here = max(0.0, m.swift_node_lost_s - m.swift_node_local_s)
        total = G.swift_loss_s(G.Path.NODE, replace(job, gpus=n), pub, m)
        rows.append([f"{n:,}", f"{here:.1f}", f"{init:.1f}", f"{barrier:.2f}",
                     f"{job.state_gb_per_gpu / pub.link_gb_per_s:.1f}", f"{job.step_s:g}", f"{total:.1f}"])
    return B.table(["GPUs", "measured here (detect + recover) s", "NCCL init s", "store barrier s", "state copy s",
                    "step redone s", "total s"], rows)


def model(raw: dict, sizes: tuple[int, ...], job: G.Job, pub: G.Published) -> dict[int, dict[str, G.Breakdown]]:
    m = measured_inputs(raw)
    out: dict[int, dict[str, G.Breakdown]] = {}
    for n in sizes:
        with_spare, without = replace(job, gpus=n), replace(job, gpus=n, hot_spare=False)
        out[n] = {"swiftrun": G.breakdown(G.Method.SWIFTRUN, with_spare, pub, m),
                  "swiftrun, no spare": G.breakdown(G.Method.SWIFTRUN, without, pub, m),
                  "torchrun+ckpt": G.breakdown(G.Method.TORCHRUN, with_spare, pub, m),
                  "torchrun+ckpt, no spare": G.breakdown(G.Method.TORCHRUN, without, pub, m),
                  "torchft-like": G.breakdown(G.Method.TORCHFT, with_spare, pub, m)}
    return out


def plot(results: dict[int, dict[str, G.Breakdown]], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: --plot needs matplotlib (pip install 'swiftrun[plot]'); no PNG written", file=sys.stderr)
        return
    sizes = list(results)
    styles = {"swiftrun": ("C0", "-"), "swiftrun, no spare": ("C0", "--"), "torchrun+ckpt": ("C3", "-"),
              "torchrun+ckpt, no spare": ("C3", "--"), "torchft-like (skips the failed group's steps)": ("C2", ":")}
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name, (color, line) in styles.items():
        key = name.split(" (")[0]
        ax.plot(sizes, [results[n][key].goodput * 100 for n in sizes], line, color=color, marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("GPUs in the job")
    ax.set_ylabel("goodput (% of wall time training)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main() -> None:
    args = parse_args()
    print(f"# goodput: {B.machine_line()}")
    if args.from_json:
        raw = json.loads(Path(args.from_json).read_text())["measured"]
        origin = f"taken from {args.from_json}, measured on {raw.get('machine', '?')}"
    else:
        raw = measure(args)
        origin = "this invocation"
    pub = G.Published()
    job = G.Job(gpus=args.sizes[0], step_s=args.step_s, state_gb_per_gpu=args.state_gb,
                replica_groups=args.replica_groups, failure_model=args.failure_model)
    print()
    print(inputs_table(raw, job, pub, origin))
    results = model(raw, args.sizes, job, pub)
    print(f"\n# goodput by job size ({args.failure_model} failure rates; a hot spare node at hand unless 'no spare')")
    print(results_table(results))
    print("\n# one node loss under swiftrun (hot spare), what it is made of")
    print(swift_node_cost_table(raw, args.sizes, job, pub))
    print("speed-up = total training time under torchrun+ckpt over swiftrun's for the same work (the Swift paper's "
          "end-to-end measure; it reports up to 1.16x); torchft-like skips the failed group's batches")
    if args.plot:
        plot(results, args.plot, f"goodput, {args.failure_model} failure rates, step {args.step_s:g} s, "
                                 f"{args.state_gb:g} GB/GPU (scripts/goodput.py)")
    B.write_json(args.json, {"args": {k: v for k, v in vars(args).items()}, "measured": raw,
                             "published": asdict(pub),
                             "results": {str(n): {k: {**asdict(b), "method": b.method.value} for k, b in by.items()}
                                         for n, by in results.items()}})


if __name__ == "__main__":
    main()
