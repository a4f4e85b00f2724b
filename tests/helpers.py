"""Shared helpers for integration tests: run the real launcher, wait on conditions, find leaked processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
EXAMPLES = REPO / "examples"
MARKER = "SWIFTRUN_TEST_MARKER"  # every process a test starts carries this variable, so leaks can be found


def swiftrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "swiftrun", *args]


def test_env(marker: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env[MARKER] = marker
    env.setdefault("PYTHONPATH", str(REPO))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run(cmd: list[str], marker: str, timeout: float, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """Run a command to completion (with a hard timeout) and capture its output."""
    return subprocess.run(cmd, env=test_env(marker, **env), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


# torch's own process teardown sometimes aborts (std::terminate on a still-joinable thread at interpreter exit,
# pytorch/pytorch#65231); plain torchrun then fails a correct run. CI saw it once (2026-12-03), 1.8 s into a
# 12-step train_dp.py reference, and 50 reruns here did not reproduce it.
TORCH_EXIT_ABORT = "terminate called without an active exception"


def run_torchrun(cmd: list[str], marker: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
    """Run a plain-torchrun *reference* to completion, once more if torch itself aborted in teardown.

    Only for baselines: the run under test is always swiftrun, whose late failures are asserted on directly.
    """
    proc = run(cmd, marker, timeout, **env)
    if proc.returncode != 0 and TORCH_EXIT_ABORT in proc.stderr:
        warnings.warn(f"plain torchrun aborted in torch's teardown ({TORCH_EXIT_ABORT!r}); reference rerun once")
        proc = run(cmd, marker, timeout, **env)
    return proc


def torchrun_reference(out: Path, script: Path, world: int, args: tuple[str, ...], timeout: float = 240) -> Path:
    """Plain torchrun's failure-free run of ``script`` saving under ``out/save`` (what a recovered run must equal)."""
    proc = run_torchrun(["torchrun", "--standalone", "--nproc-per-node", str(world), str(script), *args,
                         "--save-dir", str(out / "save")], marker=f"{script.stem}-reference", timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "save"


def event_records(events: Path) -> list[dict]:
    """The records of a ``--event-log`` file written so far (none before it exists)."""
    if not events.exists():
        return []
    return [json.loads(line) for line in events.read_text().splitlines() if line.strip()]


def pids_by_rank(records: list[dict]) -> dict[int, set[int]]:
    """Every process each rank ran as (its first one, then each replacement), from the worker_state records."""
    out: dict[int, set[int]] = {}
    for r in records:
        if r["event"] == "worker_state" and r.get("pid") and r.get("rank") is not None:
            out.setdefault(r["rank"], set()).add(r["pid"])
    return out


def draw_seed() -> int:
    """A random test's seed: ``SWIFTRUN_TEST_SEED`` to replay a draw, else a fresh one (put it in every message)."""
    import random

    return int(os.environ.get("SWIFTRUN_TEST_SEED", "0")) or random.randrange(1, 2**31)


def run_killing_at_step(cmd: list[str], marker: str, events: Path, rank: int, step: int, what: str,
                        timeout: float = 240) -> tuple[int, str]:
    """Start the launcher, SIGKILL ``rank``'s process from outside once the event log shows progress at
    ``step`` (the moment within that step is wherever the kill lands), and wait for the end: ``(returncode,
    output)``. ``what`` names the draw in a timeout's message. The launcher is killed if anything in between
    fails, so nothing leaks."""
    proc = start(cmd, marker)
    try:
        wait_until(lambda: any(r["event"] == "progress" and r["step"] >= step for r in event_records(events)),
                   timeout=180, what=f"step {step} ({what})")
        try:
            os.kill(min(pids_by_rank(event_records(events))[rank]), signal.SIGKILL)
        except ProcessLookupError:
            pass  # the job ended first (the step was its last): no kill landed, as the caller's events show
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out + err


def start(cmd: list[str], marker: str, cwd: Path | None = None, **env: str) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=test_env(marker, **env), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def run_world(script: Path, tmp_path: Path, marker: str, scenario: str, world: int, deadline: float,
              expected_codes: tuple[int, ...] = (0,), **env: str) -> tuple[list[subprocess.Popen], list[dict | None]]:
    """Run ``world`` copies of a standalone worker script (``script RANK WORLD INIT_FILE OUT_JSON SCENARIO``, the
    ranks meeting over a file store) to the end within ``deadline``: the processes and each rank's JSON output
    (None where a rank wrote none). Stderr of a rank exiting otherwise than ``expected_codes`` is printed."""
    import json

    procs, outs = [], [tmp_path / f"out{r}.json" for r in range(world)]
    try:
        for r in range(world):
            procs.append(start([sys.executable, str(script), str(r), str(world), str(tmp_path / "init"), str(outs[r]),
                                scenario], marker, **env))
        end = time.monotonic() + deadline
        for p in procs:
            p.wait(timeout=max(1.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{scenario}: ranks still running after {deadline}s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            _, err = p.communicate(timeout=10)
            if p.returncode not in expected_codes:
                print(err[-3000:])
    return procs, [json.loads(o.read_text()) if o.exists() else None for o in outs]


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.02, what: str = "condition") -> None:
    """Poll ``predicate`` until it holds; fail the test with ``what`` when ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def processes_with_marker(marker: str, variable: str = MARKER) -> list[int]:
    """PIDs of live processes whose environment carries ``variable=marker`` (zombies excluded)."""
    needle = f"{variable}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            if state != b"Z":
                found.append(int(entry))
        except OSError:
            continue
    return found


def kill_marked(marker: str) -> None:
    for pid in processes_with_marker(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_together_once_stopped(events: Path, ranks: tuple[int, ...], timeout: float) -> None:
    """SIGKILL the processes of ``ranks`` back to back once the kernel reports every one stopped (each ran into a
    ``sigstop`` fault): a loss of several ranks at the same instant, whatever the machine's load. Their pids come
    from the event log's worker_state records. Do it within the heartbeat timeout, after which the launcher reaps
    a stopped rank itself."""
    from swiftrun.launcher.procs import is_stopped

    def pids() -> dict[int, int]:
        return {r["rank"]: r["pid"] for r in event_records(events)
                if r["event"] == "worker_state" and r.get("rank") in ranks and r.get("pid")}

    wait_until(lambda: len(pids()) == len(ranks) and all(is_stopped(p) for p in pids().values()), timeout=timeout,
               what=f"ranks {list(ranks)} stopped at their faults")
    for pid in pids().values():
        os.kill(pid, signal.SIGKILL)


def run_killing_together(cmd: list[str], marker: str, events: Path, ranks: tuple[int, ...], timeout: float = 200,
                         then: Callable[[], None] | None = None, **env: str) -> tuple[int, str, str]:
    """Start the launcher, SIGKILL ``ranks`` at the same instant once each stopped at its ``sigstop`` fault
    (``kill_together_once_stopped``), run ``then`` (a further fault from outside) if given, and wait for the end:
    ``(returncode, stdout, stderr)``. The launcher is killed if anything in between fails, so nothing leaks."""
    proc = start(cmd, marker, **env)
    try:
        kill_together_once_stopped(events, ranks, timeout=150)
        if then is not None:
            then()
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err
