"""The job-level control plane at 1,000 and 10,000 simulated workers: heartbeat cost and failure -> ABORT latency.

What is real: the coordinator process runs swiftrun's own :class:`~swiftrun.launcher.coordinator.Coordinator`
(its ROUTER, its socket monitor, the :class:`~swiftrun.launcher.nodes.NodeTable`, the whole-world
:class:`~swiftrun.launcher.job.Job` and its loop), unchanged, in a process of its own (as ``swiftrun
coordinator`` would run it). What is simulated: the node agents. A few driver processes each hold many DEALER
sockets, one per simulated node, and speak the node protocol of :mod:`swiftrun.launcher.wire` exactly as a
:class:`~swiftrun.launcher.node_agent.NodeAgent` does: JOIN; SPAWNED, HELLO and REGISTERED for every worker the
coordinator asks for; one BEAT per heartbeat interval per node carrying its P workers' liveness and step (fan-in
per node, not per rank). No torch, no worker processes.

What is stubbed: only the c10d TCPStore the coordinator normally hosts (no worker connects to it here; the
coordinator loop itself never calls it). ``--real-store`` starts the real one instead (imports torch).

Measured, per size:

- the coordinator process's CPU per second of wall time while the job trains (heartbeats only), read from
  /proc/PID/stat (the loop thread plus ZeroMQ's I/O thread), and per BEAT;
- node messages per second through the ROUTER (BEATs in, LEASEs out);
- failure -> ABORT at every agent: a simulated node reports one dead worker (REPORT EXITED, as an agent does when
  a worker's pidfd fires), or closes its connection (a node lost loudly: its agent's process is gone); the time
  from that message to the moment the *last* surviving node has received its ABORT (a DO Send ABORT of the new
  generation), on CLOCK_MONOTONIC, which every process of this machine shares. It includes the simulated agents'
  own receive delay (two driver processes polling hundreds of sockets each), so it is an upper bound.

Usage::

    PYTHONPATH=. python scripts/bench_control_plane.py                 # 1,000 and 10,000 workers, 8 per node
    PYTHONPATH=. python scripts/bench_control_plane.py --workers 1000 --steady 5 --trials 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import zmq  # noqa: E402

from swiftrun.config import Entrypoint, EntrypointKind, LaunchConfig, Timeouts  # noqa: E402
from swiftrun.launcher import wire  # noqa: E402
from swiftrun.launcher.wire import NodeKind, ReportKind  # noqa: E402

BEAT_PHASES = 10  # nodes beat in this many groups spread over the interval, as independent agents would


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_config(nnodes: int, per_node: int, store_port: int, control_port: int, interval: float) -> LaunchConfig:
    return LaunchConfig(
        entrypoint=Entrypoint(EntrypointKind.SCRIPT, str(REPO / "examples" / "train_dp.py")),
        nproc_per_node=per_node, nnodes=(nnodes, nnodes), node_rank=0, master_addr="127.0.0.1",
        master_port=store_port, rdzv_backend="c10d", rdzv_id="bench", external_coordinator=True,
        control_port=control_port, dashboard=False,
        timeouts=Timeouts(heartbeat_interval=interval, join_timeout=300.0),
    )


# ------------------------------------------------------------------ the coordinator process (real code)


class StubStore:
    """Stands in for the c10d TCPStore the coordinator hosts (nobody connects to it in this benchmark)."""

    def __init__(self, host: str, port: int, world_size: int, timeout_s: float = 900.0, flag: str = "") -> None:
        self.host, self.port = host, port

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


def coordinator_main(args: tuple, log_dir: str, real_store: bool) -> None:
    from swiftrun.launcher import coordinator as coord_mod

    if not real_store:
        coord_mod.AgentStore = StubStore  # type: ignore[misc,assignment]  (only the store; the rest is real)
    sys.stderr = open(Path(log_dir) / "coordinator.log", "w", buffering=1)
    config = make_config(*args)
    coordinator = coord_mod.Coordinator(config, Path(log_dir) / "events.jsonl", registers=True)
    if not os.environ.get("BENCH_PROFILE"):
        coordinator.run()
        return
    import cProfile
    import signal

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    prof = cProfile.Profile()
    try:
        prof.runcall(coordinator.run)
    except KeyboardInterrupt:
        pass
    prof.dump_stats(str(Path(log_dir) / "coordinator.prof"))


# ------------------------------------------------------------------ simulated node agents


class SimNode:
    def __init__(self, ctx: zmq.Context, node_rank: int, address: str) -> None:
        self.node_rank = node_rank
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.identity = f"node:{node_rank}:bench{os.getpid()}".encode()
        self.sock.connect(address)
        self.slots: dict[int, int | None] = {}  # slot_id -> rank (None: a spare)
        self.accepted = False
        self.started: set[int] = set()  # ranks' slots that got START
        self.abort_at: list[float] = []  # when each ABORT arrived
        self.step = 0
        self.alive = True

    def send(self, kind: NodeKind, body: dict[str, Any]) -> None:
        self.sock.send_multipart(wire.encode(kind, body), zmq.NOBLOCK)

    def report(self, what: ReportKind, slot_id: int, **data: Any) -> None:
        self.send(NodeKind.REPORT, {"what": what.value, "slot_id": slot_id, "data": data})


def agents_main(node_ranks: list[int], address: str, config_args: tuple, conn, interval: float) -> None:
    """One driver process: many simulated agents, one thread, one poller."""
    from swiftrun.launcher.coordinator import fingerprint

    config = make_config(*config_args)
    fp = fingerprint(config)
    ctx = zmq.Context()
    ctx.max_sockets = len(node_ranks) + 64  # the default is 1,023 sockets per context
    nodes = [SimNode(ctx, k, address) for k in node_ranks]
    by_sock = {n.sock: n for n in nodes}
    poller = zmq.Poller()
    for n in nodes:
        poller.register(n.sock, zmq.POLLIN)
    poller.register(conn.fileno(), zmq.POLLIN)
    for n in nodes:
        n.send(NodeKind.JOIN, {"proto": wire.NODE_PROTOCOL_VERSION, "node_rank": n.node_rank, "fingerprint": fp,
                               "host": "sim", "pid": os.getpid(), "registers": True})
    rng = random.Random(node_ranks[0] if node_ranks else 0)
    phase = {n.node_rank: rng.randrange(BEAT_PHASES) for n in nodes}
    next_group = time.monotonic()
    group = 0
    counts = {"beats": 0, "leases": 0, "other_in": 0}
    beating = True  # from the JOIN on, as a real agent: a node silent for --node-timeout is lost
    while True:
        now = time.monotonic()
        for sock, _ in poller.poll(max(0.0, next_group - now) * 1000):
            if sock == conn.fileno():
                cmd, arg = conn.recv()
                if cmd == "stop":
                    for n in nodes:
                        n.sock.close(linger=0)
                    ctx.term()
                    return
                if cmd == "disconnect":
                    poller.unregister(next(n.sock for n in nodes if n.node_rank == arg))
                conn.send(_command(cmd, arg, nodes, counts, time.monotonic()))
                if cmd == "beat":
                    beating = bool(arg)
                continue
            node = by_sock[sock]
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                _on_message(node, *wire.decode(frames), time.monotonic(), counts)
        now = time.monotonic()
        if now >= next_group:
            if beating:
                for n in nodes:
                    if n.alive and n.accepted and phase[n.node_rank] == group:
                        n.step += 1
                        seen = {str(sid): n.step for sid in n.slots}
                        n.send(NodeKind.BEAT, {"seen": seen, "status": {}, "stopped": []})
                        counts["beats"] += 1
            group = (group + 1) % BEAT_PHASES
            next_group = max(now, next_group + interval / BEAT_PHASES)


def _on_message(node: SimNode, kind: NodeKind, body: dict[str, Any], now: float, counts: dict[str, int]) -> None:
    if kind is NodeKind.LEASE:
        counts["leases"] += 1
        return
    counts["other_in"] += 1
    if kind is NodeKind.ACCEPT:
        node.accepted = True
    elif kind is NodeKind.DO:
        for action in wire.actions_of(body):
            _on_action(node, action, now)
    elif kind in (NodeKind.REFUSE, NodeKind.FENCED):
        node.alive = False


def _on_action(node: SimNode, action: Any, now: float) -> None:
    name = type(action).__name__
    if name == "Spawn":
        node.slots[action.slot_id] = action.rank
        node.report(ReportKind.SPAWNED, action.slot_id, pid=100000 + action.slot_id)
        node.report(ReportKind.HELLO, action.slot_id, gen=action.generation)
        if action.rank is not None:
            node.report(ReportKind.EVENT, action.slot_id, gen=action.generation, event="REGISTERED", data={})
    elif name == "Send":
        if action.command.value == "START":
            node.started.add(action.slot_id)
        elif action.command.value == "ABORT":
            node.abort_at.append(now)
    elif name == "Kill":
        node.slots.pop(action.slot_id, None)


def _command(cmd: str, arg: Any, nodes: list[SimNode], counts: dict[str, int], now: float) -> Any:
    if cmd == "progress":
        ranks = sum(1 for n in nodes for r in n.slots.values() if r is not None)
        started = sum(len(n.started) for n in nodes)
        return {"accepted": sum(n.accepted for n in nodes), "ranks": ranks, "started": started}
    if cmd == "counts":
        return dict(counts)
    if cmd == "beat":
        return None
    if cmd in ("fail_worker", "disconnect"):
        node = next(n for n in nodes if n.node_rank == arg)
        t = time.monotonic()
        if cmd == "fail_worker":  # its other workers survive: the node gets ABORT too
            slot_id = next(sid for sid, r in node.slots.items() if r is not None)
            del node.slots[slot_id]
            node.report(ReportKind.EXITED, slot_id, returncode=-9, error_file=None, traceback=None)
        else:
            node.alive = False
            node.sock.close(linger=0)  # the agent's process is gone: its TCP connection closes
        return t
    if cmd == "aborts":
        return {n.node_rank: next((t for t in n.abort_at if t >= arg), None) for n in nodes if n.alive}
    raise ValueError(cmd)


# ------------------------------------------------------------------ the driver


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ask(conns: list, cmd: str, arg: Any = None) -> list[Any]:
    for c in conns:
        c.send((cmd, arg))
    return [c.recv() for c in conns]


def run_size(workers: int, per_node: int, drivers: int, interval: float, steady: float, trials: int,
             real_store: bool) -> dict[str, Any]:
    nnodes = workers // per_node
    store_port, control_port = free_port(), free_port()
    config_args = (nnodes, per_node, store_port, control_port, interval)
    log_dir = tempfile.mkdtemp(prefix="swiftrun-bench-cp-")
    ctx = mp.get_context("spawn")
    coord = ctx.Process(target=coordinator_main, args=(config_args, log_dir, real_store), daemon=True)
    coord.start()
    time.sleep(0.5)
    address = f"tcp://127.0.0.1:{control_port}"
    conns, procs = [], []
    for d in range(drivers):
        parent, child = ctx.Pipe()
        ranks = list(range(d, nnodes, drivers))
        p = ctx.Process(target=agents_main, args=(ranks, address, config_args, child, interval), daemon=True)
        p.start()
        conns.append(parent)
        procs.append(p)
    out: dict[str, Any] = {"workers": nnodes * per_node, "nodes": nnodes, "log_dir": log_dir}
    try:
        t0 = time.monotonic()
        cpu0 = proc_cpu(coord.pid)
        while True:
            prog = ask(conns, "progress")
            if sum(p["started"] for p in prog) >= nnodes * per_node:
                break
            if time.monotonic() - t0 > 600 or not coord.is_alive():
                raise RuntimeError(f"the job did not start: {prog} (see {log_dir}/coordinator.log)")
            time.sleep(0.2)
        out["startup_s"] = time.monotonic() - t0
        out["startup_cpu_s"] = proc_cpu(coord.pid) - cpu0
        ask(conns, "beat", True)
        time.sleep(max(1.0, 2 * interval))  # every node is beating
        c0, cpu0, w0 = ask(conns, "counts"), proc_cpu(coord.pid), time.monotonic()
        time.sleep(steady)
        c1, cpu1, w1 = ask(conns, "counts"), proc_cpu(coord.pid), time.monotonic()
        wall = w1 - w0
        beats = sum(b["beats"] for b in c1) - sum(b["beats"] for b in c0)
        leases = sum(b["leases"] for b in c1) - sum(b["leases"] for b in c0)
        out["cpu_per_s"] = (cpu1 - cpu0) / wall
        out["msgs_per_s"] = (beats + leases) / wall
        out["beats_per_s"] = beats / wall
        out["us_per_beat"] = (cpu1 - cpu0) / max(beats, 1) * 1e6
        lat: list[tuple[str, float, float]] = []
        victims = iter(range(1, nnodes))
        for trial in range(trials):
            how = "fail_worker" if trial % 2 == 0 else "disconnect"
            victim = next(victims)
            owner = conns[victim % drivers]
            owner.send((how, victim))
            t_fail = owner.recv()
            deadline = time.monotonic() + 10.0
            while True:
                time.sleep(0.2)
                got = {k: v for r in ask(conns, "aborts", t_fail) for k, v in r.items()}
                waiting = [k for k, v in got.items() if v is None]
                if not waiting or time.monotonic() > deadline:
                    break
            times = sorted(v - t_fail for v in got.values() if v is not None)
            if waiting:
                raise RuntimeError(f"{len(waiting)} nodes never got an ABORT after failure {trial + 1} "
                                   f"(see {log_dir}/coordinator.log)")
            lat.append((how, times[-1], statistics.median(times)))
            time.sleep(1.0)
        out["latency"] = lat
    finally:
        for c in conns:
            try:
                c.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
        for p in procs:
            p.join(5)
        coord.terminate()
        coord.join(5)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--drivers", type=int, default=2, help="processes simulating the node agents")
    ap.add_argument("--interval", type=float, default=Timeouts().heartbeat_interval,
                    help="heartbeat interval (s), swiftrun's default")
    ap.add_argument("--steady", type=float, default=10.0, help="seconds of heartbeats measured")
    ap.add_argument("--trials", type=int, default=4, help="failures injected (worker exit, node disconnect, ...)")
    ap.add_argument("--real-store", action="store_true", help="host the real c10d TCPStore (imports torch)")
    args = ap.parse_args()
    rows = []
    for workers in args.workers:
        r = run_size(workers, args.per_node, args.drivers, args.interval, args.steady, args.trials, args.real_store)
        rows.append(r)
        print(f"# {r['workers']} workers: logs in {r['log_dir']}", file=sys.stderr, flush=True)
    print(f"heartbeat interval {args.interval:g}s, {args.per_node} workers per node, store "
          f"{'real TCPStore' if args.real_store else 'stubbed'}, {args.drivers} driver processes, "
          f"{os.cpu_count()} CPUs")
    head = (f"{'workers':>8} {'nodes':>6} {'start s':>8} {'coord CPU/s':>12} {'us/BEAT':>8} {'msgs/s':>8} "
            f"{'fail->ABORT all (ms), each trial':>40}")
    print(head)
    for r in rows:
        trials = ", ".join(f"{'exit' if how == 'fail_worker' else 'disc'} {mx * 1e3:.1f}" for how, mx, _ in r["latency"])
        print(f"{r['workers']:>8} {r['nodes']:>6} {r['startup_s']:>8.1f} {r['cpu_per_s'] * 100:>11.1f}% "
              f"{r['us_per_beat']:>8.0f} {r['msgs_per_s']:>8.0f} {trials:>40}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
