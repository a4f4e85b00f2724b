#!/usr/bin/env python
"""examples/train_dp.py's job under torchft (0.2.0): replica groups of one process each, on gloo/CPU.

Two modes, like a launcher and its training script:

    python scripts/_peer_torchft_train.py --supervise --replicas 2 [--kill-replica 1 --kill-at-step 150] \\
        -- --steps 300 --optimizer adam --save-dir out/

``--supervise`` starts torchft's lighthouse (``torchft_lighthouse --min_replicas 1``), then one worker process
per replica group. torchft does not restart processes itself (torchelastic or torchx does, in a real job), so the
supervisor does it: a worker that exits non-zero is started again at once (``--max-restarts`` times in all), and
the new process heals from a surviving replica through torchft's Manager (the peer's state_dict over HTTP).

A worker builds train_dp.py's model, optimizer and batches (train_dp's own functions and argument parser, so the
job is the same), wraps them in torchft's Manager, DistributedDataParallel and Optimizer wrappers, and runs until
torchft's committed step count reaches ``--steps``. The batch of a step is train_dp's batch of (step, replica
group). ``--kill-at-step S`` makes the worker SIGKILL itself in the backward of step S (from a hook on the last
parameter's gradient, where ``swiftrun --fault R:S:backward:sigkill`` fires), on its first launch only. It saves
``rank<replica>.pt`` in train_dp's format, so the benchmark compares it with the other launchers' files.

What the benchmark reads: lines ``peer_torchft: event=NAME key=value ...`` (start, sigkill, restart, healed, end).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from swiftrun.launcher.store import free_port

STARTED_UNIX = time.time()  # before torch is imported: a restarted worker's import time is part of its cost
HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"


def parse_own_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--supervise", action="store_true", help="start the lighthouse and the replica groups")
    p.add_argument("--replicas", type=int, default=2, help="replica groups (one process each)")
    p.add_argument("--replica", type=int, default=0, help="(worker) this process's replica group")
    p.add_argument("--lighthouse", default=None, help="(worker) the lighthouse's address")
    p.add_argument("--barrier-dir", default=None, help="(worker) where the first launch waits for its peers")
    p.add_argument("--rejoin", action="store_true", help="(worker) a restarted process: no start-up barrier")
    p.add_argument("--kill-replica", type=int, default=None)
    p.add_argument("--kill-at-step", type=int, default=None)
    p.add_argument("--max-restarts", type=int, default=1, help="worker restarts the supervisor allows")
    p.add_argument("--min-replica-size", type=int, default=1, help="torchft Manager(min_replica_size=)")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="torchft Manager timeout, quorum_timeout, connect_timeout and the gloo timeout "
                        "(60 s: torchft's defaults)")
    p.add_argument("--grad-sync", choices=("ddp", "allreduce"), default="ddp",
                   help="ddp: torchft.DistributedDataParallel; allreduce: Manager.allreduce of each gradient, waited "
                        "for (torchft 0.2.0's DDP comm hook fails 'assert fut._fut' when a peer dies)")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=5000, help="lighthouse (torchft's default)")
    p.add_argument("--join-timeout-ms", type=int, default=60000, help="lighthouse (torchft's default)")
    return p.parse_args(argv)


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Own options before ``--``, train_dp.py's after (train_dp's parser reads those)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def event(name: str, **fields: object) -> None:
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    print(f"peer_torchft: event={name} {text} unix={time.time():.3f}", flush=True)


# ------------------------------------------------------------------ supervisor (no torch import: starts at once)


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the lighthouse exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the lighthouse did not listen on port {port} within {timeout:.0f} s")


def lighthouse_cmd(opts: argparse.Namespace, port: int) -> list[str]:
    # The console script of this interpreter's torchft, not whichever one PATH finds first.
    found = Path(sys.executable).parent / "torchft_lighthouse"
    binary = str(found) if found.exists() else shutil.which("torchft_lighthouse")
    if binary is None:
        raise RuntimeError("torchft_lighthouse not found next to this Python nor on PATH")
    # min_replicas 1: the survivor may train on alone while the failed group is down (torchft's design).
    return [binary, "--min_replicas", "1", "--bind", f"127.0.0.1:{port}",
            "--heartbeat_timeout_ms", str(opts.heartbeat_timeout_ms), "--join_timeout_ms", str(opts.join_timeout_ms)]


def worker_cmd(opts: argparse.Namespace, replica: int, lighthouse: str, barrier: str, rejoin: bool,
               train_argv: list[str]) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--replica", str(replica), "--replicas",
           str(opts.replicas), "--lighthouse", lighthouse, "--barrier-dir", barrier, "--timeout-s",
           str(opts.timeout_s), "--min-replica-size", str(opts.min_replica_size)]
    cmd += ["--grad-sync", opts.grad_sync]
    if rejoin:
        cmd.append("--rejoin")
    elif replica == opts.kill_replica and opts.kill_at_step is not None:
        cmd += ["--kill-at-step", str(opts.kill_at_step)]
    return cmd + ["--", *train_argv]


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()


def supervise(opts: argparse.Namespace, train_argv: list[str]) -> int:
    """Lighthouse, then the workers; restart a worker that fails; 0 when every replica group ended with 0."""
    # SIGTERM (the benchmark's tree kill is SIGKILL, which reaches the workers directly) still stops the workers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    barrier = tempfile.mkdtemp(prefix="peer-torchft-barrier-")
    started: list[subprocess.Popen] = []
    try:
        port = free_port("127.0.0.1")
        t0 = time.monotonic()
        lighthouse = subprocess.Popen(lighthouse_cmd(opts, port))
        started.append(lighthouse)
        wait_for_port(port, lighthouse, opts.timeout_s)
        event("lighthouse", port=port, ready_s=f"{time.monotonic() - t0:.2f}")
        address = f"http://127.0.0.1:{port}"
        workers = {r: subprocess.Popen(worker_cmd(opts, r, address, barrier, False, train_argv))
                   for r in range(opts.replicas)}
        started += workers.values()
        return watch(opts, workers, started, lambda r: worker_cmd(opts, r, address, barrier, True, train_argv))
    finally:
        stop(started)
        shutil.rmtree(barrier, ignore_errors=True)


def watch(opts: argparse.Namespace, workers: dict[int, subprocess.Popen], started: list[subprocess.Popen],
          restart_cmd: Callable[[int], list[str]]) -> int:
    """Wait for every worker; start one that failed again while restarts are left (what torchelastic would do)."""
    restarts_left = opts.max_restarts
    running = dict(workers)
    while running:
        for replica, proc in list(running.items()):
            rc = proc.poll()
            if rc is None:
                continue
            del running[replica]
            if rc == 0:
                continue
            if restarts_left <= 0:
                event("failed", replica=replica, rc=rc, restarts_left=0)
                return 1
            restarts_left -= 1
            event("restart", replica=replica, rc=rc)
            running[replica] = subprocess.Popen(restart_cmd(replica))
            started.append(running[replica])
        time.sleep(0.02)
    return 0


# ------------------------------------------------------------------ worker


def wait_for_peers(barrier: Path, replica: int, replicas: int, timeout: float) -> None:
    """Every first-launch worker has its Manager (and so its lighthouse heartbeat) up before any asks for quorum:
    otherwise the lighthouse, seeing one healthy replica, would let it train the first steps alone."""
    (barrier / f"ready-{replica}").touch()
    deadline = time.monotonic() + timeout
    while len(list(barrier.glob("ready-*"))) < replicas:
        if time.monotonic() > deadline:
            raise RuntimeError(f"peers not ready within {timeout:.0f} s")
        time.sleep(0.02)
    time.sleep(0.5)  # a few heartbeat intervals (100 ms), so the lighthouse has seen every peer's heartbeat


def train_dp_args(train_argv: list[str]) -> argparse.Namespace:
    import train_dp

    sys.argv = [sys.argv[0], *train_argv]  # train_dp's parser reads sys.argv; its defaults are the job's
    return train_dp.parse_args()


def kill_in_backward(params: list, at_step: int | None, current: dict) -> None:
    """SIGKILL this process when the first gradient of step ``at_step`` is computed (swiftrun's backward fault)."""
    if at_step is None:
        return

    def hook(grad):
        if current["step"] == at_step:
            event("sigkill", replica=current["replica"], step=at_step)
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    params[-1].register_hook(hook)


def worker(opts: argparse.Namespace, train_argv: list[str]) -> int:
    # Imported here, not at the top: the supervisor runs without torch.
    from datetime import timedelta

    import torch
    import torchft
    from torch.distributed import TCPStore

    sys.path.insert(0, str(EXAMPLES))
    import train_dp

    args = train_dp_args(train_argv)
    event("start", replica=opts.replica, pid=os.getpid(), rejoin=int(opts.rejoin), started_unix=f"{STARTED_UNIX:.3f}")
    model = train_dp.build_model(args.hidden, args.layers, args.seed)
    inner = train_dp.build_optimizer(args.optimizer, list(model.parameters()), args.lr)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    # A replica group of one process hosts its own store (torchrun's agent would, for a bigger group).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=opts.timeout_s)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=opts.min_replica_size,
        use_async_quorum=False,  # quorum (and healing) completes in zero_grad, before the step's batch is chosen
        init_sync=False,  # every replica initialises the model from the same seed, as train_dp does
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout, rank=0, world_size=1,
        store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=opts.lighthouse,
        replica_id=f"peer_{opts.replica}")
    ddp = torchft.DistributedDataParallel(manager, model) if opts.grad_sync == "ddp" else model
    optimizer = torchft.Optimizer(manager, inner)
    current = {"step": -1, "replica": opts.replica}
    kill_in_backward(list(model.parameters()), opts.kill_at_step, current)
    if not opts.rejoin:
        wait_for_peers(Path(opts.barrier_dir), opts.replica, opts.replicas, opts.timeout_s)

    stats = train(manager, ddp, optimizer, args, opts, current)
    os.makedirs(args.save_dir, exist_ok=True)
    final = {"step": args.steps, "model": model.state_dict(), "optimizer": inner.state_dict()}
    torch.save(final, os.path.join(args.save_dir, f"rank{opts.replica}.pt"))
    event("end", replica=opts.replica, pid=os.getpid(), steps=manager.current_step(),
          batches_committed=manager.batches_committed(), **stats)
    manager.shutdown(wait=False)
    return 0


def average_gradients(manager, model) -> None:
    """What the DDP wrapper's comm hook does, one gradient at a time; a failed all-reduce is reported to the
    Manager by its work's wait(), so should_commit() then refuses the step."""
    works = [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]
    for work in works:
        work.wait()


def train(manager, ddp, optimizer, args: argparse.Namespace, opts: argparse.Namespace, current: dict) -> dict:
    """Steps until torchft has committed ``args.steps``; returns what the benchmark reports about them."""
    import torch
    import train_dp

    step_ms: list[float] = []
    failed_commits = degraded_steps = 0
    longest_gap, last_commit = 0.0, time.monotonic()
    first = True
    while manager.current_step() < args.steps:
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)  # torchft: the quorum; a joining replica heals here
        step = manager.current_step()
        if first and step > 0:
            event("healed", replica=opts.replica, step=step, since_start_s=f"{time.time() - STARTED_UNIX:.2f}")
        first = False
        current["step"] = step
        participants = manager.num_participants()
        inputs, targets = train_dp.batch_for(step, opts.replica, args)
        loss = torch.nn.functional.mse_loss(ddp(inputs), targets)
        loss.backward()
        if opts.grad_sync == "allreduce":
            average_gradients(manager, ddp)
        optimizer.step()  # torchft: steps the wrapped optimizer only if every group can commit
        if manager.current_step() == step:
            failed_commits += 1
            event("commit_failed", replica=opts.replica, step=step, participants=participants)
            continue
        now = time.monotonic()
        longest_gap, last_commit = max(longest_gap, now - last_commit), now
        degraded_steps += participants < opts.replicas  # committed without every replica group
        step_ms.append((time.perf_counter() - started) * 1000.0)
    steady = step_ms[max(3, len(step_ms) // 10):] or step_ms or [0.0]  # as train_dp: skip the first steps
    return {"step_ms": f"{sum(steady) / len(steady):.3f}", "failed_commits": failed_commits,
            "degraded_steps": degraded_steps, "longest_gap_s": f"{longest_gap:.2f}"}


def main() -> int:
    own_argv, train_argv = split_argv(sys.argv[1:])
    opts = parse_own_args(own_argv)
    return supervise(opts, train_argv) if opts.supervise else worker(opts, train_argv)


if __name__ == "__main__":
    sys.exit(main())
