"""Shared helpers of the benchmark scripts in scripts/ (plain standard library, no torch import).

The benchmarks launch ``examples/train_dp.py`` (or ``train_pp.py``, via ``script=``) under swiftrun and under torchrun, time them from the outside,
read swiftrun's JSON-lines event log, and look at worker processes through /proc (Linux only).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

REPO = Path(__file__).resolve().parent.parent
TRAIN_DP = REPO / "examples" / "train_dp.py"
TRAIN_PP = REPO / "examples" / "train_pp.py"
PY = sys.executable


# ------------------------------------------------------------------ commands


def swiftrun_cmd(nproc: int, script_args: Sequence[str], *, event_log: Path | None = None,
                 extra: Sequence[str] = (), script: Path = TRAIN_DP) -> list[str]:
    cmd = [PY, "-m", "swiftrun", "--no-dashboard", "--nproc-per-node", str(nproc)]
    if event_log is not None:
        cmd += ["--event-log", str(event_log)]
    return cmd + list(extra) + [str(script), *script_args]


def torchrun_cmd(nproc: int, script_args: Sequence[str], *, max_restarts: int = 1,
                 extra: Sequence[str] = (), script: Path = TRAIN_DP) -> list[str]:
    torchrun = shutil.which("torchrun")
    base = [torchrun] if torchrun else [PY, "-m", "torch.distributed.run"]
    return base + ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
                   *extra, str(script), *script_args]


def train_args(steps: int, save_dir: Path, *, optimizer: str = "adam", ckpt_dir: Path | None = None,
               ckpt_every: int | None = None, extra: Sequence[str] = ()) -> list[str]:
    args = ["--steps", str(steps), "--optimizer", optimizer, "--save-dir", str(save_dir)]
    if ckpt_dir is not None:
        args += ["--ckpt-dir", str(ckpt_dir)]
        if ckpt_every is not None:
            args += ["--ckpt-every", str(ckpt_every)]
    return args + list(extra)


# ------------------------------------------------------------------ running


@dataclass
class Result:
    cmd: list[str]
    rc: int | None
    wall: float  # seconds from Popen to exit (or to the kill on timeout)
    output: str
    timed_out: bool = False
    load_before: float = 0.0
    load_after: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    other_cores: float | None = None  # CPU used by processes outside this run, in cores (machine busy-ness)

    @property
    def step_ms(self) -> float | None:
        return parse_step_ms(self.output)

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out and self.step_ms is not None


def parse_step_ms(text: str) -> float | None:
    """Rank 0's last ``train_dp: steps=N step_ms=X`` (or ``train_pp: ...``, ``hsdp: ...``, ``hf_trainer: ...``,
    ``lightning_ddp: ...``) line."""
    for line in reversed(text.splitlines()):
        names = ("train_dp", "train_pp", "hsdp", "hf_trainer", "lightning_ddp")
        if any(f"{name}: steps=" in line for name in names) and "step_ms=" in line:
            try:
                return float(line.rsplit("step_ms=", 1)[1].split()[0])
            except ValueError:
                return None
    return None


def load1() -> float:
    return os.getloadavg()[0]


def cpu_busy_seconds() -> float:
    """Busy CPU time of the whole machine since boot (all cores, /proc/stat)."""
    with open("/proc/stat", encoding="utf-8") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU time of this script's reaped descendants (a launcher's includes its reaped workers)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def self_cpu_seconds() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class Launched:
    """A launcher process started in its own session; its whole process tree can be killed."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        self.log_path = cwd / f"console-{time.monotonic_ns()}.log"
        self._log = self.log_path.open("w")
        self.load_before = load1()
        self._cpu0 = (cpu_busy_seconds(), children_cpu_seconds(), self_cpu_seconds())
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float) -> Result:
        timed_out = False
        try:
            rc: int | None = self.proc.wait(timeout=max(0.0, timeout - (time.monotonic() - self.t0)))
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_tree(self.proc.pid)
            rc = self.proc.wait()
        wall = time.monotonic() - self.t0
        busy, mine, me = cpu_busy_seconds(), children_cpu_seconds(), self_cpu_seconds()
        other = (busy - self._cpu0[0]) - (mine - self._cpu0[1]) - (me - self._cpu0[2])
        self._log.close()
        output = self.log_path.read_text(errors="replace")
        return Result(self.cmd, rc, wall, output, timed_out, self.load_before, load1(),
                      other_cores=max(0.0, other) / wall if wall > 0 else None)

    def kill(self) -> None:
        kill_tree(self.proc.pid)


def run(cmd: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> Result:
    return Launched(cmd, cwd, env).wait(timeout)


def repo_env(**extra: str) -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH (the scripts import swiftrun from the checkout)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO), env.get("PYTHONPATH", "")) if x)
    env.update(extra)
    return env


def timer_kill(run: Launched, anchor: Path, *, fail_rank: int, delay_s: float, timeout: float,
               info: dict | None = None) -> dict:
    """The external kill both launchers get: wait for ``anchor`` (the first checkpoint file) to appear, then after
    ``delay_s`` SIGKILL the worker whose environment has RANK=fail_rank (a spare is never picked). Returns what
    happened (anchor_s, killed_pid, killed_at_s, or error)."""
    info = dict(info or {})
    deadline = run.t0 + timeout
    while not anchor.exists():
        if run.proc.poll() is not None or time.monotonic() > deadline:
            info["error"] = "no checkpoint appeared before the job ended"
            return info
        time.sleep(0.005)
    info["anchor_s"] = time.monotonic() - run.t0
    time.sleep(max(0.0, delay_s))
    pid = None
    for _ in range(200):
        pid = find_rank_pid(run.pid, fail_rank)
        if pid:
            break
        time.sleep(0.01)
    if pid is None:
        info["error"] = f"no RANK={fail_rank} worker found"
        return info
    os.kill(pid, signal.SIGKILL)
    info.update(killed_pid=pid, killed_at_s=time.monotonic() - run.t0)
    return info


def step_time_runs(names: Sequence[str], reps: int, run_one: Callable[[str, int], Result],
                   label: Callable[[str], str] = str) -> dict[str, list[Result]]:
    """Failure-free runs of each variant, interleaved (the order alternates per repetition, so a load that drifts
    hits every variant alike), one progress line per run."""
    results: dict[str, list[Result]] = {n: [] for n in names}
    for rep in range(reps):
        for name in (names if rep % 2 == 0 else list(names)[::-1]):
            res = run_one(name, rep)
            results[name].append(res)
            print(f"  rep {rep + 1} {label(name):20s} step_ms={fmt(res.step_ms, 2)} wall={res.wall:.2f}s "
                  f"rc={res.rc} other_cpu={fmt(res.other_cores, 2)}cores", flush=True)
            if not res.ok:
                print(tail(res.output, 12))
    return results


def launcher_run(name: str, nproc: int, script: Path, script_args: Callable[[Path], list[str]], scratch: Scratch,
                 timeout: float) -> Result:
    """One failure-free run of ``script`` under ``name`` ("torchrun", no restarts, or "swiftrun" with its
    defaults), saving into its own scratch directory (``result.extra["save"]``)."""
    work = scratch.new(name)
    if name == "torchrun":
        cmd = torchrun_cmd(nproc, script_args(work / "save"), max_restarts=0, script=script)
    else:
        cmd = swiftrun_cmd(nproc, script_args(work / "save"), script=script)
    res = run(cmd, work, timeout)
    res.extra["save"] = work / "save"
    return res


def vs_baseline_table(results: dict[str, list[Result]], baseline: str, what: str = "step_ms") -> str:
    """Each variant's median [min..max] step time, and its median against the baseline's."""
    base = med(r.step_ms for r in results[baseline])
    rows = []
    for name, rs in results.items():
        m = med(r.step_ms for r in rs)
        rows.append([name, fmt_stat([r.step_ms for r in rs], 3),
                     f"{(m / base - 1) * 100:+.1f}%" if m and base else "-", f"{sum(r.ok for r in rs)}/{len(rs)}"])
    return table(["launcher", f"{what} median [min..max]", f"vs {baseline}", "ok"], rows)


RECOVERY_PHASES = ("detect", "abort", "spawn", "rebuild", "consensus", "undo", "transfer", "resume")


def recovery_runs(count: int, scratch: Scratch, command: Callable[[Path, Path], list[str]], reference: Path | None,
                  timeout: float) -> str:
    """``count`` runs of ``command(save_dir, event_log)`` (each with one injected failure): a line per run with its
    phases and whether it ended bitwise as ``reference``, then the table of phases over the runs."""
    recs = []
    for rep in range(count):
        work = scratch.new(f"recovery{rep}")
        events = work / "events.jsonl"
        res = run(command(work / "save", events), work, timeout)
        phases = {p: 0.0 for p in RECOVERY_PHASES}
        for e in read_events(events):
            if e["event"] == "recovery_phase" and e.get("phase") in phases:
                phases[e["phase"]] += float(e.get("duration") or 0.0) * 1000.0
        summary = recovery_summary(events)
        exact = same_rank_files(work / "save", reference) if reference is not None else None
        recs.append((phases, summary))
        print(f"  run {rep + 1}: rc={res.rc} outcome={summary['outcomes']} total="
              f"{fmt((summary['recovery_total_s'] or 0) * 1000, 0)} ms bitwise={exact} " +
              " ".join(f"{p}={v:.0f}" for p, v in phases.items()), flush=True)
        if res.rc != 0:
            print(tail(res.output, 12))
    return table(["phase", "ms median [min..max]"],
                 [[p, fmt_stat([ph[p] for ph, _ in recs], 0)] for p in RECOVERY_PHASES] +
                 [["total (kill -> resumed)", fmt_stat([(s["recovery_total_s"] or 0) * 1000 for _, s in recs], 0)]])


def launchers_then_recoveries(args: Any, nproc: int, script: Path, script_args: Callable[[Path], list[str]],
                              what: str, killed: str) -> None:
    """The shape of a benchmark of one example script: ``args.reps`` interleaved failure-free runs under swiftrun
    and torchrun (``args.steps`` of them timed), their table, then ``args.recoveries`` runs with rank 1 killed by
    an injected fault in the forward of step ``args.kill_step`` (``killed`` says where, for the heading), and the
    JSON of the step times where ``args.json`` asks for it."""
    scratch = Scratch(script.stem, keep=args.keep)

    def run_one(name: str, rep: int) -> Result:
        return launcher_run(name, nproc, script, script_args, scratch, args.timeout)

    def faulty(save: Path, events: Path) -> list[str]:
        return swiftrun_cmd(nproc, script_args(save), event_log=events, script=script,
                            extra=["--fault", f"1:{args.kill_step}:forward:sigkill"])

    try:
        results = step_time_runs(["swiftrun", "torchrun"], args.reps, run_one)
        print()
        print(vs_baseline_table(results, "torchrun", what))
        reference = next((r.extra["save"] for r in results["torchrun"] if r.ok), None)
        print(f"\n# recovery: rank 1 SIGKILLed {killed}")
        found = recovery_runs(args.recoveries, scratch, faulty, reference, args.timeout)
        print()
        print(found)
    finally:
        scratch.close()
    write_json(args.json, {"args": vars(args), "machine": machine_line(), "step_time": step_time_json(results)})


def step_time_json(results: dict[Any, list[Result]]) -> list[dict[str, Any]]:
    return [{"variant": name, "runs": [{"step_ms": r.step_ms, "wall": r.wall, "rc": r.rc,
                                         "other_cores": r.other_cores} for r in rs]}
            for name, rs in results.items()]


class Scratch:
    """A temporary directory for one benchmark (removed at exit unless keep)."""

    def __init__(self, name: str, keep: bool = False) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=f"swiftrun-{name}-"))
        self.keep = keep
        self._n = 0

    def new(self, label: str) -> Path:
        self._n += 1
        path = self.root / f"{self._n:03d}-{label}"
        path.mkdir(parents=True)
        return path

    def close(self) -> None:
        if self.keep:
            print(f"(kept scratch directory {self.root})", file=sys.stderr)
        else:
            shutil.rmtree(self.root, ignore_errors=True)


# ------------------------------------------------------------------ /proc


def ppid_map() -> dict[int, int]:
    out: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[-1].split()
        if len(fields) > 1:
            out[int(name)] = int(fields[1])
    return out


def descendants(root: int, parents: dict[int, int] | None = None) -> list[int]:
    parents = ppid_map() if parents is None else parents
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(root: int, sig: int = signal.SIGKILL) -> None:
    """Signal ``root`` and every descendant (the process tree this script started)."""
    pids = descendants(root) + [root]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(root, sig)  # launched with start_new_session: the group id is the launcher's pid
    except (ProcessLookupError, PermissionError):
        pass


def environ(pid: int) -> dict[str, str]:
    """The environment a process was *started* with (changes made later by the process are not visible)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def status_kb(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def find_rank_pid(launcher_pid: int, rank: int) -> int | None:
    """A live descendant of the launcher started with RANK=rank (spares have no RANK yet)."""
    for pid in descendants(launcher_pid):
        env = environ(pid)
        if env.get("RANK") == str(rank) and env.get("SWIFTRUN_SPARE", "0") != "1":
            return pid
    return None


class Poller(threading.Thread):
    """Calls ``fn()`` every ``period`` seconds in the background until stopped."""

    def __init__(self, fn: Callable[[], None], period: float) -> None:
        super().__init__(daemon=True)
        self.fn, self.period = fn, period
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.fn()
            except Exception:  # noqa: BLE001 - a process may vanish between listing and reading
                pass
            self._stop_event.wait(self.period)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)


# ------------------------------------------------------------------ event log


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return read_events_text(path.read_text(errors="replace"))


def read_events_text(text: str) -> list[dict[str, Any]]:
    """The events of JSON-lines text, skipping torn or foreign lines (swiftrun's own parser)."""
    from swiftrun.events import parse_events

    return list(parse_events(text.splitlines()))


def recovery_summary(event_log: Path) -> dict[str, Any]:
    """What swiftrun's event log says about a run's recoveries."""
    events = read_events(event_log)
    ends = [e for e in events if e["event"] == "recovery_end"]
    job_end = next((e for e in events if e["event"] == "job_end"), {})
    return {
        "recoveries_started": sum(1 for e in events if e["event"] == "recovery_start"),
        "recoveries": len(ends),
        "outcomes": [e.get("outcome") for e in ends],
        "modes": [e.get("mode") for e in ends],
        "recovery_total_s": sum(float(e.get("total") or 0) for e in ends) if ends else None,
        "restarts": sum(1 for e in events if e["event"] == "restart"),
        "job_outcome": job_end.get("outcome"),
        "time_lost_s": job_end.get("time_lost"),
    }


# ------------------------------------------------------------------ results


def same_rank_files(a: Path, b: Path) -> bool | None:
    """Whether two runs' ``rank*.pt`` files hold bitwise-equal contents (None: torch is not importable)."""
    try:
        import torch
    except ImportError:
        return None

    def equal(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(equal(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return isinstance(y, (list, tuple)) and len(x) == len(y) and all(equal(u, v) for u, v in zip(x, y))
        return x == y

    files = sorted(p.name for p in a.glob("rank*.pt"))
    if not files or files != sorted(p.name for p in b.glob("rank*.pt")):
        return False
    return all(equal(torch.load(a / f, weights_only=True), torch.load(b / f, weights_only=True)) for f in files)


# ------------------------------------------------------------------ statistics and tables


def med(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def spread(values: Iterable[float | None]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None]
    return (min(vals), max(vals)) if vals else (None, None)


def wavg(pairs: Iterable[tuple[float | None, float]]) -> float | None:
    """Weighted mean of (value, weight) pairs, skipping missing values."""
    pairs = [(v, w) for v, w in pairs if v is not None and w > 0]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def fmt_stat(values: Sequence[float | None], digits: int = 2) -> str:
    """median [min..max] (n)"""
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    if len(vals) == 1:
        return fmt(vals[0], digits)
    lo, hi = min(vals), max(vals)
    return f"{fmt(statistics.median(vals), digits)} [{fmt(lo, digits)}..{fmt(hi, digits)}]"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def machine_line() -> str:
    try:
        import platform

        torch_version = "?"
        try:
            from importlib.metadata import version

            torch_version = version("torch")
        except Exception:  # noqa: BLE001
            pass
        return (f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {os.cpu_count()} CPUs, {platform.machine()}, "
                f"python {platform.python_version()}, torch {torch_version}, load average at start "
                f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    except Exception:  # noqa: BLE001
        return time.strftime("%Y-%m-%d %H:%M:%S")


def write_json(path: str | None, payload: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2, default=str))
        print(f"raw results written to {path}")


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.splitlines()[-lines:])
