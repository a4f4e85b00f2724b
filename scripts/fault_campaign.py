"""Seeded fault campaign: realistic scripts under swiftrun, faults injected or delivered from outside, every rank's
final state compared with a failure-free run of the same configuration.

    python scripts/fault_campaign.py --seed 1 --runs 40 --out /tmp/campaign
    python scripts/fault_campaign.py --seed 1 --runs 40 --only 17          # replay run 17 (same flags otherwise)
    python scripts/fault_campaign.py --seed 1 --scripts gpt,ema --world 3
    python scripts/fault_campaign.py --seed 1 --runs 20 --scripts pp_1f1b          # pipelines (4 ranks)
    python scripts/fault_campaign.py --seed 1 --runs 8 --scripts pp_1f1b --pp-scenario replay-kill

Each run draws (from ``--seed`` and its index only) a configuration (a zoo script or examples/train_dp.py, a
world size) and one or two faults: ``--fault RANK:STEP:PHASE:KIND`` injected by swiftrun (only the phases the
runtime in this checkout accepts are drawn), or an external SIGKILL/SIGSTOP of a random child process of the
launcher at a uniformly random time over the whole run (start-up included; with ``--external-window train``, of a
rank's process at a uniform time over the failure-free run's training steps, its survivors checked as for
pipelines below). Classes (docs/FAULT_CAMPAIGN.md):

EXACT    exit 0, every rank's final state bitwise equal to the failure-free run's
CLOSE    exit 0, within 1e-6 relative (of the largest magnitude of the entry's kind, e.g. every momentum buffer),
         and a recovery undid an update (an inverted update is exact to a few ULP)
WARNED   exit 0, replicas equal, a state that differs, and the event log carries swiftrun's warning that this
         recovery is not the failure-free one (e.g. rank 0's BatchNorm statistics lost with it): reported loudly
REFUSED  non-zero exit with a message saying why (the reason is shown and counted)
BUG      exit 0 with a different state, replicas that differ, a hang past the deadline, leaked processes, a
         traceback from swiftrun's own code, a missing result file, a survivor whose process changed

Pipelines (``pp_*``: examples/train_pp.py; ``p2p_*``: the hand-written P2P pipeline of tests/scripts) always run
4 ranks and get one outside SIGKILL of a *rank* (its current process, whichever incarnation), drawn uniformly over
the whole run (``window run``) or over the failure-free run's training steps (``window train``): start-up is most
of a short run, and the steps are where replay happens. ``--pp-scenario``: ``single`` (that one kill),
``replay-kill`` (a second kill as soon as the event log shows the replay, of the replaying rank or of a random
rank), ``both-replicas`` (``pp_dp2``: both replicas of one stage killed at the same instant). Every survivor must
keep its process (checked from the event log's pids) unless the launcher restarted every worker (a failure at
start-up, before anything was trained, or a refusal turned into a restart), which the line says.

Prints one line per run as it finishes, a summary table at the end, and writes ``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples" / "zoo"))
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from _common import differing_keys, kind_rel_diff  # noqa: E402

from tests.helpers import processes_with_marker  # noqa: E402

MARKER = "SWIFTRUN_CAMPAIGN_MARKER"
FAST = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "4", "--no-dashboard"]
KINDS = ("sigkill", "sigstop", "exception", "exit", "segfault")
# phases the campaign knows; only those the runtime accepts are drawn (FaultSpec.PHASES)
ALL_PHASES = ("forward", "backward", "allreduce", "update", "step", "after-step", "recover", "import",
              "scheduler", "collective", "save", "transfer")

# name -> (script, script arguments (without --save-dir), has a scheduler, calls collectives itself)
SCRIPTS: dict[str, tuple[str, tuple[str, ...], bool, bool]] = {
    "cnn_bn": ("examples/zoo/cnn_bn.py", ("--steps", "30"), True, False),
    "gpt": ("examples/zoo/gpt.py", ("--steps", "30"), True, False),
    "ema": ("examples/zoo/ema.py", ("--steps", "30"), True, False),
    "eval_ckpt": ("examples/zoo/eval_ckpt.py", ("--steps", "30"), True, True),
    "eval_ckpt_inside": ("examples/zoo/eval_ckpt.py", ("--steps", "30", "--inside-guard"), True, True),
    "train_dp": ("examples/train_dp.py", ("--steps", "30", "--optimizer", "adam", "--hidden", "64",
                                          "--layers", "3"), False, False),
    "train_dp_sync": ("examples/train_dp.py", ("--steps", "30", "--optimizer", "momentum", "--hidden", "64",
                                               "--layers", "3", "--sync-loss"), False, True),
    # HSDP (2 replica groups x 2 shards): --world 4 only; FSDP's gradient hooks never run, so draw without the
    # backward/allreduce phases (--phases forward,step,after-step,recover,scheduler,transfer,import)
    "hsdp": ("examples/zoo/hsdp.py", ("--steps", "30"), True, False),
}
# pipelines: 4 ranks, short runs (a few layers, small hidden), a stage checkpoint interval that makes replays happen
_PP = ("--steps", "60", "--layers", "4", "--hidden", "32", "--batch", "16", "--microbatches", "4", "--dropout", "0.1",
       "--optimizer", "adamw", "--ckpt-every", "8")
PIPELINES: dict[str, tuple[str, tuple[str, ...]]] = {
    "pp_1f1b": ("examples/train_pp.py", (*_PP, "--schedule", "1f1b")),
    "pp_gpipe": ("examples/train_pp.py", (*_PP, "--schedule", "gpipe")),
    "pp_interleaved": ("examples/train_pp.py", (*_PP[:2], "--layers", "8", *_PP[4:], "--schedule", "interleaved")),
    "pp_dp2": ("examples/train_pp.py", (*_PP, "--schedule", "1f1b", "--dp", "2")),
    "p2p_1f1b": ("tests/scripts/pipeline_p2p.py", ("--steps", "60", "--ckpt-every", "8", "--schedule", "1f1b",
                                                   "--clip", "0.5")),
    "p2p_gpipe": ("tests/scripts/pipeline_p2p.py", ("--steps", "60", "--ckpt-every", "8", "--schedule", "gpipe")),
}
for _name, (_script, _args) in PIPELINES.items():
    SCRIPTS[_name] = (_script, _args, False, "--clip" in _args)
PP_WORLD = 4
SCENARIOS = ("single", "replay-kill", "both-replicas")


def steps_of(args: tuple[str, ...]) -> int:
    return int(args[args.index("--steps") + 1])


# ----------------------------------------------------------------------------------------------- results


def flatten(state: dict) -> dict[str, torch.Tensor]:
    """The zoo's flat format as is; examples/train_dp.py's {"model", "optimizer"} file flattened the same way."""
    if "model" not in state or not isinstance(state["model"], dict):
        return state
    out = {f"model.param.{k}": v for k, v in state["model"].items()}
    # one optimizer, or a list of them (train_pp.py --schedule interleaved: one per stage of the rank)
    optimizers = state["optimizer"] if isinstance(state["optimizer"], list) else [state["optimizer"]]
    for i, optimizer in enumerate(optimizers):
        for pid, entries in optimizer["state"].items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    out[f"opt{i}.state.{pid}.{key}"] = value
        for j, group in enumerate(optimizer["param_groups"]):
            for key, value in group.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    out[f"opt{i}.group{j}.{key}"] = torch.tensor(float(value), dtype=torch.float64)
    out["step"] = torch.tensor(state["step"])
    return out


def load_ranks(save: Path, world: int) -> list[dict[str, torch.Tensor] | None]:
    results = []
    for r in range(world):
        path = save / f"rank{r}.pt"
        try:
            results.append(flatten(torch.load(path, map_location="cpu", weights_only=True)))
        except Exception:  # noqa: BLE001 - a missing or truncated file is a finding, not a crash of the campaign
            results.append(None)
    return results


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


# ---------------------------------------------------------------------------------------------- processes


def marked(marker: str) -> list[int]:
    return processes_with_marker(marker, variable=MARKER)


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != b"Z":
                kids.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return sorted(kids)


def cmdline_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[-80:]
    except OSError:
        return "?"


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ----------------------------------------------------------------------------------------------- a run


@dataclass
class Plan:
    index: int
    config: str
    world: int
    faults: list[str] = field(default_factory=list)          # swiftrun --fault specs
    script: list[str] = field(default_factory=list)          # script-level faults (eval_ckpt --crash)
    external: list[dict] = field(default_factory=list)       # {"signal": "SIGKILL", "at": fraction of the run}
    scenario: str = ""                                       # pipelines: single, replay-kill, both-replicas


@dataclass
class Outcome:
    index: int
    config: str
    world: int
    faults: list[str]
    external: list[dict]
    script: list[str] = field(default_factory=list)
    verdict: str = ""
    reason: str = ""
    exit_code: int | None = None
    seconds: float = 0.0
    recoveries: list[dict] = field(default_factory=list)
    failures: int = 0
    max_rel_diff: float | None = None
    differing: list[str] = field(default_factory=list)
    out_dir: str = ""
    time_lost: float | None = None  # seconds beyond the failure-free run (pipelines)
    launcher_lost: float | None = None  # the launcher's own account (job_end's time_lost)
    survivors: str = ""  # pipelines: "kept", or what changed


def command(config: str, world: int, save: Path, events: Path, faults: list[str], extra: list[str],
            script_extra: list[str] = ()) -> list[str]:
    script, args, _, _ = SCRIPTS[config]
    args = (*args, *script_extra)
    fault_args = [a for f in faults for a in ("--fault", f)]
    # pipelines run 4 ranks on a shared machine: a 4 s heartbeat timeout declared ranks tearing down hung
    fast = [*FAST[:3], "10", *FAST[4:]] if config in PIPELINES else FAST
    return [sys.executable, "-m", "swiftrun", "--nproc-per-node", str(world), *fast, "--event-log", str(events),
            *fault_args, *extra, str(REPO / script), *args, "--save-dir", str(save)]


def environ_of(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def rank_pid(rank: int, events: Path, launcher: int) -> int | None:
    """The live process that holds ``rank`` now: the newest pid the event log gives the rank, else (at start-up,
    before the first worker_state record) the child of the launcher spawned with RANK=rank (a warm spare has no
    RANK in its environment until it is assigned, and then it appears in the event log)."""
    kids = set(children_of(launcher))
    pid = None
    for record in read_events(events):
        if record.get("event") == "worker_state" and record.get("rank") == rank and record.get("pid"):
            pid = record["pid"] if record.get("state") not in ("exited", "failed") else None
    if pid in kids:
        return pid
    for kid in sorted(kids):
        env = environ_of(kid)
        if env.get("RANK") == str(rank) and env.get("SWIFTRUN_SPARE", "0") != "1":
            return kid
    return None


def wait_for_event(events: Path, name: str, after: float, proc: subprocess.Popen, deadline: float) -> dict | None:
    """The first record ``name`` written after ``after`` seconds of the event log's clock, or None."""
    while time.monotonic() < deadline and proc.poll() is None:
        for record in read_events(events):
            if record.get("event") == name and record.get("t", 0) >= after:
                return record
        time.sleep(0.02)
    return None


def execute(cmd: list[str], marker: str, deadline: float, external: list[dict], expected: float,
            log: Path, events: Path | None = None) -> tuple[int | None, float, str, list[str]]:
    """Run the launcher to completion (or the deadline); deliver external signals to random children of the
    launcher at their times, or to the process holding a rank (``"rank"``; ``"at_s"``: seconds after the start;
    ``"after_event"``: as soon as the event log shows that record, ``"rank": "replayer"`` being the rank it names).
    Returns (exit code or None on a hang, seconds, output, notes)."""
    env = dict(os.environ)
    env[MARKER] = marker
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    notes: list[str] = []
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)

        train_start: list[float] = []  # when every rank ran its first step: one base for every "train" item

        def deliver() -> None:
            for item in sorted(external, key=lambda e: e["at"]):
                if item.get("after_event"):
                    record = wait_for_event(events, item["after_event"], 0.0, proc, started + deadline)
                    if record is None:
                        notes.append(f"{item['signal']} after {item['after_event']}: never seen")
                        continue
                    if item["rank"] == "replayer":
                        item = dict(item, rank=record.get("rank"))
                else:
                    base = started
                    if item.get("window") == "train" and train_start:
                        # measured once: a second item of the same time (both-replicas) follows the first at once,
                        # not after the same delay again (which put the two kills 0.1-1.1 s apart)
                        base = train_start[0]
                    elif item.get("window") == "train":  # from the moment every rank runs its first step
                        while proc.poll() is None and time.monotonic() < started + deadline:
                            running = {r.get("rank") for r in read_events(events)
                                       if r.get("event") == "worker_state" and r.get("state") == "running"}
                            if len(running) >= item.get("world", 1):
                                break
                            time.sleep(0.02)
                        base = time.monotonic()
                        train_start.append(base)
                    due = base + item.get("at_s", item["at"] * expected)
                    while time.monotonic() < due and proc.poll() is None:
                        time.sleep(min(0.02, max(0.0, due - time.monotonic())))
                if proc.poll() is not None:
                    notes.append(f"{item['signal']} at {item['at']:.2f}: the job had already ended")
                    continue
                if "rank" in item:
                    assert events is not None
                    victim = rank_pid(item["rank"], events, proc.pid)
                    while victim is None and proc.poll() is None and time.monotonic() < started + deadline:
                        time.sleep(0.02)  # not spawned yet (the launcher is starting): as soon as it exists
                        victim = rank_pid(item["rank"], events, proc.pid)
                    if victim is None:
                        notes.append(f"{item['signal']} rank {item['rank']}: no process holds it")
                        continue
                    try:
                        os.kill(victim, getattr(signal, item["signal"]))
                        notes.append(f"{item['signal']} rank {item['rank']} pid {victim} at "
                                     f"{time.monotonic() - started:.2f}s")
                    except (OSError, ProcessLookupError) as exc:
                        notes.append(f"{item['signal']} rank {item['rank']} pid {victim}: {exc}")
                    continue
                kids = children_of(proc.pid)
                if not kids:
                    notes.append(f"{item['signal']} at {item['at']:.2f}: no child process yet")
                    continue
                victim = kids[item["pick"] % len(kids)]
                try:
                    cmdline = open(f"/proc/{victim}/cmdline", "rb").read().replace(b"\0", b" ")[-60:].decode()
                    os.kill(victim, getattr(signal, item["signal"]))
                    notes.append(f"{item['signal']} pid {victim} at {time.monotonic() - started:.2f}s "
                                 f"({len(kids)} children; ...{cmdline.strip()})")
                except (OSError, ProcessLookupError) as exc:
                    notes.append(f"{item['signal']} pid {victim}: {exc}")

        sender = threading.Thread(target=deliver, daemon=True)
        sender.start()
        try:
            code: int | None = proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            code = None
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher; its workers follow (parent-death signal)
            except ProcessLookupError:
                pass
            proc.wait()
        sender.join(timeout=1)
    return code, time.monotonic() - started, log.read_text(errors="replace"), notes


_TRACEBACK = re.compile(r'Traceback \(most recent call last\):\n((?:[ \t]+.*\n)+)(\S[^\n]*)')


def swiftrun_tracebacks(output: str) -> list[str]:
    """Tracebacks whose innermost frame is in swiftrun's own code (fault injection excepted)."""
    found = []
    for match in _TRACEBACK.finditer(output):
        frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', match.group(1))
        if not frames:
            continue
        path, line, func = frames[-1]
        exc = match.group(2)
        if "/swiftrun/" in path and not path.endswith("runtime/worker/faults.py") and "InjectedFault" not in exc:
            found.append(f"{Path(path).parent.name}/{Path(path).name}:{line} in {func}: {exc[:200]}")
    return found


def refusal_reason(output: str) -> str:
    """The launcher's own account of why it stopped, else the root cause's lines of the failure summary."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    stop = [line for line in lines if re.match(r"swiftrun: (stopping|cannot|refus|giving up)", line)]
    cause = [line for line in lines if re.match(r"(cause|exception|exitcode)\s*:", line)]
    errors = [line for line in lines if re.match(r"\w+(Error|Exception|Fault|Interrupt)\b:?", line)]
    parts = stop[-1:] + cause[:2] + [e[:110] for e in errors[-1:]]
    if parts:
        return " | ".join(parts)[:300]
    said = [line for line in lines if line.startswith(("swiftrun:", "[swiftrun]"))]
    return (said[-1] if said else lines[-1] if lines else "no output")[:300]


class Campaign:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.refs: dict[tuple[str, int], tuple[Path, float, list[dict]]] = {}
        self.windows: dict[tuple[str, int], tuple[float, float]] = {}  # the reference's training steps, seconds

    def reference(self, config: str, world: int) -> tuple[Path, float, list[dict]] | None:
        key = (config, world)
        if key not in self.refs:
            d = self.out / "refs" / f"{config}-w{world}"
            save, events = d / "save", d / "events.jsonl"
            d.mkdir(parents=True, exist_ok=True)
            # Numerics do not depend on the heartbeat settings; the reference uses swiftrun's default timeout
            # (30 s) and is retried, since on a loaded machine a 4 s timeout can declare healthy ranks hung.
            for attempt in range(3):
                marker = uuid.uuid4().hex
                code, seconds, output, _ = execute(
                    command(config, world, save, events, [], ["--heartbeat-timeout", "30"]), marker,
                    self.args.deadline, [], 1.0, d / f"output{attempt}.log")
                kill_all(marked(marker))
                results = load_ranks(save, world)
                if code == 0 and all(r is not None for r in results):
                    break
                print(f"reference {config} world {world} attempt {attempt} FAILED (exit {code}): "
                      f"{refusal_reason(output)}", flush=True)
            else:
                self.refs[key] = None  # type: ignore[assignment]
                return None
            records = read_events(events)
            first = [r["t"] for r in records if r.get("event") == "progress"]
            last = [r["t"] for r in records if r.get("event") == "worker_state" and r.get("state") == "finishing"]
            self.windows[key] = (min(first, default=0.0), max(last, default=seconds))
            print(f"reference {config} world {world}: {seconds:.1f}s (training {self.windows[key][0]:.1f}s to "
                  f"{self.windows[key][1]:.1f}s)", flush=True)
            self.refs[key] = (save, seconds, results)  # type: ignore[assignment]
        return self.refs[key]

    def run(self, plan: Plan) -> Outcome:
        outcome = Outcome(plan.index, plan.config, plan.world, plan.faults, plan.external, plan.script)
        ref = self.reference(plan.config, plan.world)
        if ref is None:
            outcome.verdict, outcome.reason = "SKIPPED", "the failure-free reference failed"
            return outcome
        _, ref_seconds, expected = ref
        d = self.out / "runs" / f"{plan.index:04d}-{plan.config}-w{plan.world}"
        d.mkdir(parents=True, exist_ok=True)
        outcome.out_dir = str(d)
        save, events = d / "save", d / "events.jsonl"
        marker = uuid.uuid4().hex
        deadline = max(self.args.deadline, 8 * ref_seconds)
        cmd = command(plan.config, plan.world, save, events, plan.faults, [], plan.script)
        start, end = self.windows.get((plan.config, plan.world), (0.0, ref_seconds))
        for item in plan.external:  # the kill's time in seconds, over the whole run or over its training steps
            if item.get("window") == "train":  # counted from the moment every rank runs (execute)
                item["at_s"], item["world"] = round(item["at"] * (end - start), 3), plan.world
            elif item.get("window") == "run":
                item["at_s"] = round(item["at"] * ref_seconds, 3)
        code, seconds, output, notes = execute(cmd, marker, deadline, plan.external, ref_seconds,
                                               d / "output.log", events)
        outcome.exit_code, outcome.seconds = code, round(seconds, 2)
        if notes:
            outcome.external = [dict(e, note=n) for e, n in zip(plan.external, notes)] + \
                [{"note": n} for n in notes[len(plan.external):]]
        # What the launcher leaves behind must go away by itself (a DataLoader worker notices its parent's death
        # within 5 s); the tests' marker fixture allows 10 s as well.
        grace = time.monotonic() + 10
        while marked(marker) and time.monotonic() < grace:
            time.sleep(0.2)
        leaked = [f"{pid} ({cmdline_of(pid)})" for pid in marked(marker)]
        kill_all(marked(marker))
        records = read_events(events)
        outcome.recoveries = [{k: r.get(k) for k in ("generation", "outcome", "mode", "source_rank",
                                                     "failed_ranks", "undo")}
                              for r in records if r.get("event") == "recovery_end"]
        outcome.failures = sum(r.get("event") == "worker_failed" for r in records)
        warned = [r.get("message", "") for r in records if r.get("event") == "warning"
                  and "not bitwise the failure-free" in r.get("message", "")]
        outcome.time_lost = round(seconds - ref_seconds, 2)
        outcome.launcher_lost = next((r.get("time_lost") for r in records if r.get("event") == "job_end"), None)
        own = swiftrun_tracebacks(output)
        changed = ""
        if plan.config in PIPELINES or any("rank" in e for e in plan.external):
            changed = survivors_changed(records, killed_ranks(notes))
            restarted = any(r.get("event") == "restart" for r in records)
            outcome.survivors = "restart of every worker" if restarted else (changed or "kept")
            if restarted:
                changed = ""  # a restart replaces every worker by design (start-up, or a refusal)

        def verdict(kind: str, reason: str) -> Outcome:
            outcome.verdict, outcome.reason = kind, reason
            return outcome

        if code is None:
            return verdict("BUG", f"hang: still running after {deadline:.0f}s")
        if leaked:
            return verdict("BUG", f"{len(leaked)} process(es) still running 10 s after the launcher exited: "
                           + "; ".join(leaked)[:200])
        if own:
            return verdict("BUG", "traceback from swiftrun's code: " + own[0])
        if changed and code == 0:
            return verdict("BUG", changed)
        if plan.config in PIPELINES and not killed_ranks(notes) and code == 0:
            return verdict("MISSED", "no kill was delivered (the job had ended)")
        if code != 0:
            if "is not one of" in output and "fault phase" in output:
                return verdict("UNSUPPORTED", "this runtime does not know the fault phase")
            return verdict("REFUSED", f"exit {code}: " + refusal_reason(output))
        results = load_ranks(save, plan.world)
        # a rank killed while saving its final file (RANK:STEPS:save:KIND) after every rank finished training:
        # the job succeeds by design and that one file is missing; the other ranks are compared as usual
        final_save = {int(f.split(":")[0]) for f in plan.faults
                      if f.split(":")[2] == "save" and int(f.split(":")[1]) >= steps_of(SCRIPTS[plan.config][1])}
        missing = [i for i, r in enumerate(results) if r is None]
        if missing and not set(missing) <= final_save:
            return verdict("BUG", "exit 0 but rank file(s) missing: " + ",".join(map(str, missing)))
        results = [results[i] if results[i] is not None else expected[i] for i in range(plan.world)]
        # replicas: every key that is replicated in the failure-free run must be replicated here too
        replicated = [k for k in expected[0] if all(k in e and torch.equal(expected[0][k], e[k]) for e in expected)]
        for r in range(1, plan.world):
            bad = [k for k in replicated if k not in results[r] or not torch.equal(results[0][k], results[r][k])]
            if bad:
                outcome.differing = bad[:8]
                return verdict("BUG", f"exit 0 but replica {r} differs from rank 0 in {len(bad)} key(s): "
                               + ", ".join(bad[:4]))
        diff_keys = sorted({k for r in range(plan.world) for k in differing_keys(results[r], expected[r])})
        if not diff_keys:
            slow = seconds > 2 * ref_seconds + 15  # e.g. a stopped spare holding up the shutdown
            return verdict("EXACT", f"(slow: {seconds:.0f}s, failure-free {ref_seconds:.0f}s)" if slow else "")
        outcome.differing = diff_keys[:12]
        # a pipeline's ranks hold different keys (their stages): a key is judged on the ranks that have it
        floats = [k for k in diff_keys if any(k in e and e[k].is_floating_point() for e in expected)]
        exact_only = [k for k in diff_keys if k not in floats]  # integers, RNG state, missing keys
        # relative to the kind's magnitude, not the tensor's own: a one-element tensor near zero (a bias's momentum)
        # would turn an undo's 1-ULP error into "2.3e-6" (seed 2 run 1; _common.kind_rel_diff)
        worst = max((kind_rel_diff(results[r], expected[r], [k for k in floats if k in expected[r]])
                     for r in range(plan.world)), default=0.0)
        outcome.max_rel_diff = worst
        undone = any(rec.get("mode") == "undo" or rec.get("undo") for rec in outcome.recoveries)
        if undone and worst <= 1e-6 and not exact_only:
            return verdict("CLOSE", f"max rel diff {worst:.2e} after an undo")
        if warned:
            return verdict("WARNED", f"max rel diff {worst:.2e}, said: {warned[0][:120]}")
        model_keys = [k for k in floats if k.startswith(("model.", "opt"))]
        model_worst = max((kind_rel_diff(results[r], expected[r], [k for k in model_keys if k in expected[r]])
                           for r in range(plan.world)), default=0.0)
        telling = sorted(exact_only + floats, key=lambda k: (k.startswith(("model.param.", "opt0.state.")), k))
        return verdict("BUG", f"exit 0 with a different state: {len(diff_keys)} keys differ, max rel diff "
                       f"{worst:.3g} over floats ({model_worst:.2g} over model/optimizer); "
                       + ", ".join(short(k) for k in telling[:6]))


def killed_ranks(notes: list[str]) -> set[int]:
    return {int(m.group(1)) for n in notes for m in [re.match(r"SIG\w+ rank (\d+) pid \d+ at", n)] if m}


def survivors_changed(records: list[dict], killed: set[int]) -> str:
    """'' when every rank that was not killed kept one process all along (from the event log's pids)."""
    pids: dict[int, set[int]] = collections.defaultdict(set)
    for r in records:
        if r.get("event") == "worker_state" and r.get("rank") is not None and r.get("pid"):
            pids[r["rank"]].add(r["pid"])
    moved = {rank: sorted(p) for rank, p in pids.items() if rank not in killed and len(p) > 1}
    if not moved:
        return ""
    return "survivor(s) changed process: " + "; ".join(f"rank {r}: pids {p}" for r, p in sorted(moved.items()))


def short(key: str) -> str:
    return key.replace("model.param.", "p.").replace("model.buffer.", "b.")


# ---------------------------------------------------------------------------------------------- drawing


def runtime_phases() -> tuple[str, ...]:
    sys.path.insert(0, str(REPO))
    from swiftrun.config import FaultSpec

    return tuple(FaultSpec.PHASES)


def draw(index: int, seed: int, configs: list[str], worlds: list[int], phases: tuple[str, ...],
         external_share: float, external_window: str = "run") -> Plan:
    rng = random.Random(f"{seed}:{index}")
    config = rng.choice(configs)
    world = rng.choice(worlds)
    _, args, has_scheduler, has_collective = SCRIPTS[config]
    steps = steps_of(args)
    plan = Plan(index, config, world)
    usable = [p for p in phases if (p != "scheduler" or has_scheduler) and (p != "collective" or has_collective)]
    for number in range(2 if rng.random() < 0.3 else 1):
        if config.startswith("eval_ckpt") and rng.random() < 0.25:  # die right before a collective of the script
            every = 5
            step = rng.randrange(every - 1, steps, every)
            plan.script = ["--crash", f"{rng.randrange(world)}:{step}:{rng.choice(('eval', 'barrier'))}"]
            continue
        if rng.random() < external_share:
            item = {"signal": rng.choice(("SIGKILL", "SIGKILL", "SIGSTOP")), "at": round(rng.uniform(0.0, 1.0), 3),
                    "pick": rng.randrange(1 << 16)}
            if external_window == "train":  # a rank's process, during the training steps (drawn after the rest,
                # so that a seed's other draws are the same as with --external-window run)
                item.update(window="train", rank=rng.randrange(world))
                del item["pick"]
            plan.external.append(item)
            continue
        phase = rng.choice([p for p in usable if p != "transfer" or number == 0])
        kind = rng.choice(KINDS)
        rank = rng.randrange(world)
        step = steps if phase == "save" else (0 if phase == "import" else rng.randrange(steps))
        plan.faults.append(f"{rank}:{step}:{phase}:{kind}")
        if phase == "transfer":  # the source dies mid-transfer: a recovery must be running, so fail another rank
            other = (rank + 1 + rng.randrange(world - 1)) % world
            plan.faults.append(f"{other}:{step}:forward:sigkill")
            break
    plan.external.sort(key=lambda e: e["at"])
    return plan


def draw_pipeline(index: int, seed: int, configs: list[str], scenario: str) -> Plan:
    """One outside SIGKILL of a rank at a uniformly random time (plus the scenario's second kill)."""
    rng = random.Random(f"{seed}:{index}:pp")
    config = rng.choice(configs)
    plan = Plan(index, config, PP_WORLD, scenario=scenario)
    window = "train" if scenario != "single" or rng.random() < 0.5 else "run"
    at, rank = round(rng.uniform(0.0, 1.0), 3), rng.randrange(PP_WORLD)
    if scenario == "replay-kill":
        at = round(rng.uniform(0.05, 0.8), 3)  # early enough that the replay runs before the job ends
    plan.external.append({"signal": "SIGKILL", "at": at, "rank": rank, "window": window})
    if scenario == "replay-kill":
        # as soon as the replay shows in the event log: the replaying rank itself, or any rank (a log server)
        victim = "replayer" if rng.random() < 0.5 else rng.randrange(PP_WORLD)
        plan.external.append({"signal": "SIGKILL", "at": at + 1e-3, "rank": victim, "after_event": "replay"})
    elif scenario == "both-replicas":
        stages = PP_WORLD // 2  # pp_dp2: rank r is stage r % 2 of replica r // 2
        plan.external.append({"signal": "SIGKILL", "at": at, "rank": (rank + stages) % PP_WORLD, "window": window})
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--only", default="", help="comma-separated run indices to (re)play")
    parser.add_argument("--scripts", default=",".join(SCRIPTS), help=f"subset of {','.join(SCRIPTS)}")
    parser.add_argument("--world", default="2,3", help="world sizes to draw from (4 is slow on 2 cores)")
    parser.add_argument("--phases", default=",".join(ALL_PHASES),
                        help="phases to draw (intersected with those the runtime accepts)")
    parser.add_argument("--external-share", type=float, default=0.3, help="share of external signals")
    parser.add_argument("--external-window", choices=("run", "train"), default="run",
                        help="external signals: a random child of the launcher at a uniform time over the whole "
                             "run (start-up is most of a short run), or a rank during the training steps")
    parser.add_argument("--deadline", type=float, default=90.0, help="hard timeout of one run, seconds")
    parser.add_argument("--out", default="/tmp/swiftrun-campaign")
    parser.add_argument("--pp-scenario", choices=SCENARIOS, default="single",
                        help="pipelines: one kill, a second one during the replay, both replicas of a stage")
    args = parser.parse_args()

    configs = [c for c in args.scripts.split(",") if c]
    unknown = [c for c in configs if c not in SCRIPTS]
    if unknown:
        parser.error(f"unknown scripts: {unknown}")
    pipelines = [c for c in configs if c in PIPELINES]
    if pipelines and len(pipelines) != len(configs):
        parser.error("pipelines (pp_*, p2p_*) and data-parallel scripts are drawn differently: run them apart")
    if args.pp_scenario == "both-replicas" and pipelines != ["pp_dp2"]:
        parser.error("--pp-scenario both-replicas needs --scripts pp_dp2")
    worlds = [int(w) for w in args.world.split(",")]
    accepted = runtime_phases()
    phases = tuple(p for p in args.phases.split(",") if p in accepted)
    skipped = [p for p in args.phases.split(",") if p not in accepted]
    print(f"campaign seed {args.seed}: {args.runs} runs over {configs}, worlds {worlds}; phases {list(phases)}"
          + (f" (not in this runtime: {skipped})" if skipped else ""), flush=True)
    indices = [int(i) for i in args.only.split(",")] if args.only else list(range(args.runs))
    campaign = Campaign(args)
    outcomes: list[Outcome] = []
    for index in indices:
        if pipelines:
            plan = draw_pipeline(index, args.seed, configs, args.pp_scenario)
        else:
            plan = draw(index, args.seed, configs, worlds, phases, args.external_share, args.external_window)
        outcome = campaign.run(plan)
        outcomes.append(outcome)
        if pipelines:
            what = " ".join(f"kill:r{e['rank']}@" + (f"{e['after_event']}" if e.get("after_event")
                                                      else f"{e['window']}{e['at']:.2f}") for e in plan.external)
        else:
            what = " ".join(plan.faults + [f"ext:{e['signal']}" + (f":r{e['rank']}@train" if "rank" in e else "@")
                                           + f"{e['at']:.2f}" for e in plan.external]
                            + [f"crash:{plan.script[1]}" for _ in plan.script[:1]])
        modes = ",".join(str(r.get("mode")) for r in outcome.recoveries) or "-"
        extra = ""
        if pipelines or any("rank" in e for e in plan.external):
            notes = "; ".join(e.get("note", "") for e in outcome.external)
            extra = f" lost={outcome.time_lost}s survivors={outcome.survivors} [{notes}]"
        print(f"[{index:3d}] {plan.config:<16} w{plan.world} {what:<44} {outcome.verdict:<8} "
              f"exit={outcome.exit_code} {outcome.seconds:5.1f}s rec={modes} {outcome.reason}{extra}", flush=True)
        (campaign.out / "results.json").write_text(json.dumps(
            {"seed": args.seed, "args": vars(args), "phases": list(phases), "runs": [asdict(o) for o in outcomes]},
            indent=1))

    counts = collections.Counter(o.verdict for o in outcomes)
    print("\nsummary (seed %d, %d runs): %s" % (args.seed, len(outcomes),
                                                ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))))
    table = collections.defaultdict(collections.Counter)
    for o in outcomes:
        table[o.config][o.verdict] += 1
    classes = ["EXACT", "CLOSE", "WARNED", "REFUSED", "BUG", "UNSUPPORTED", "SKIPPED", "MISSED"]
    print(f"{'config':<18}" + "".join(f"{c:>12}" for c in classes))
    for config in sorted(table):
        print(f"{config:<18}" + "".join(f"{table[config][c]:>12}" for c in classes))
    if pipelines:
        print(f"\n{'config':<18}{'runs':>6}{'max rel diff':>14}{'lost: median':>14}{'max':>8}  survivors")
        for config in sorted(table):
            mine = [o for o in outcomes if o.config == config]
            diffs = [o.max_rel_diff or 0.0 for o in mine if o.verdict in ("EXACT", "CLOSE")]
            lost = sorted(o.time_lost for o in mine if o.time_lost is not None and o.verdict in ("EXACT", "CLOSE"))
            kept = collections.Counter(o.survivors.split(":")[0] for o in mine)
            print(f"{config:<18}{len(mine):>6}{max(diffs, default=0.0):>14.2e}"
                  f"{(lost[len(lost) // 2] if lost else float('nan')):>13.1f}s"
                  f"{(lost[-1] if lost else float('nan')):>7.1f}s  "
                  + ", ".join(f"{k or '-'} {v}" for k, v in kept.items()))
    reasons = collections.Counter((o.verdict, re.sub(r"\d+(\.\d+)?(e-?\d+)?", "#", o.reason)[:150])
                                  for o in outcomes if o.verdict in ("BUG", "REFUSED"))
    if reasons:
        print("\nreasons:")
        for (kind, reason), n in reasons.most_common():
            print(f"  {n:3d}  {kind:<8} {reason}")
    print(f"\nresults: {campaign.out / 'results.json'}")
    sys.exit(1 if counts.get("BUG") else 0)


if __name__ == "__main__":
    main()
