"""The launcher end to end: real workers, real signals, compared with torchrun where torchrun defines the answer.

Worker scripts live in tests/scripts; most do not import torch, so a run costs the launcher's own start-up
(it imports torch for the TCPStore) and little else. Every test waits on conditions (files a worker writes, the
event log), never on sleeps, and the ``marker`` fixture fails any test that leaves a process behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from swiftrun.events import read_events
from tests.helpers import SCRIPTS, processes_with_marker, run, start, swiftrun_cmd, wait_until

RUN_TIMEOUT = 90  # hard limit for one launcher run (2 slow cores, each run imports torch at least once)

# ANCHORS.md b.2: what torchrun sets for every worker
TORCHRUN_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS",
)
VOLATILE = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}  # ports, run ids, paths
SCRIPT_ARGS = ("--lr", "3", "-n", "8", "--standalone")  # flag-like: they belong to the script, not the launcher


def swiftrun(*args: str) -> list[str]:
    return swiftrun_cmd("--no-dashboard", *args)


def script(name: str) -> str:
    return str(SCRIPTS / name)


@contextmanager
def launched(cmd: list[str], marker: str, **env: str) -> Iterator[subprocess.Popen]:
    """A launcher started in the background; killed if the test fails before it ends (workers: see ``marker``)."""
    proc = start(cmd, marker, **env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()  # not drained: orphaned workers may still hold the write ends


def pid_of(path: Path) -> int:
    return int(path.read_text())


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def lines_of(text: str) -> set[str]:
    """The lines print_ranks.py wrote (with whatever prefix the launcher added)."""
    return {line for line in text.splitlines() if "line of rank" in line}


def root_cause_block(stderr: str) -> str:
    """The "Root Cause" section of the failure summary (up to its closing rule)."""
    assert "Root Cause (first observed failure):" in stderr, f"no failure summary in:\n{stderr}"
    block = stderr.split("Root Cause (first observed failure):", 1)[1]
    return block.split("\n=", 1)[0]


# ---------------------------------------------------------------------------------------------------------------
# 1. Environment parity
# ---------------------------------------------------------------------------------------------------------------


def dump_env(launcher: list[str], out: Path, marker: str, **env: str) -> dict[int, dict]:
    out.mkdir()
    res = run([*launcher, script("dump_env.py"), *SCRIPT_ARGS], marker, timeout=RUN_TIMEOUT,
              DUMP_ENV_DIR=str(out), **env)
    assert res.returncode == 0, res.stdout + res.stderr
    return {rank: json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1)}


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_worker_env_and_argv_match_torchrun(tmp_path, marker):
    torchrun = dump_env([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
                        tmp_path / "torchrun", marker)
    ours = dump_env(swiftrun("--standalone", "--nproc-per-node", "2"), tmp_path / "swiftrun", marker)
    for rank in (0, 1):
        t_env, s_env = torchrun[rank]["env"], ours[rank]["env"]
        assert ours[rank]["argv"] == torchrun[rank]["argv"] == [script("dump_env.py"), *SCRIPT_ARGS]
        for name in TORCHRUN_VARS:
            assert name in t_env, f"torchrun did not set {name} (is ANCHORS.md b.2 out of date?)"
            assert name in s_env, f"swiftrun did not set {name}"
        # beyond the list: every variable torchrun's worker sees, swiftrun's sees with the same value
        differing = {k for k in t_env if s_env.get(k) != t_env[k]} - {"DUMP_ENV_DIR"}  # the test's own
        assert differing <= VOLATILE, {k: (t_env[k], s_env.get(k)) for k in differing - VOLATILE}
        assert {k for k in s_env if k not in t_env} <= {k for k in s_env if k.startswith("SWIFTRUN_")}
        assert s_env["RANK"] == s_env["LOCAL_RANK"] == s_env["ROLE_RANK"] == str(rank)
        assert s_env["MASTER_PORT"].isdigit() and s_env["TORCHELASTIC_RUN_ID"] not in ("", "none")
        for env in (t_env, s_env):
            assert Path(env["TORCHELASTIC_ERROR_FILE"]).parts[-3:] == ("attempt_0", str(rank), "error.json")
    assert ours[0]["env"]["MASTER_PORT"] == ours[1]["env"]["MASTER_PORT"]
    assert ours[0]["env"]["TORCHELASTIC_RUN_ID"] == ours[1]["env"]["TORCHELASTIC_RUN_ID"]


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_dashed_underscored_and_pet_spellings_give_the_same_env(tmp_path, marker):
    dashed = dump_env(swiftrun("--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-id", "spelling",
                               "--role", "trainer"), tmp_path / "dashed", marker)
    underscored = dump_env(swiftrun("--nproc_per_node", "2", "--max_restarts", "1", "--rdzv_id", "spelling",
                                    "--role", "trainer"), tmp_path / "underscored", marker)
    pet = dump_env(swiftrun(), tmp_path / "pet", marker, PET_NPROC_PER_NODE="2", PET_MAX_RESTARTS="1",
                   PET_RDZV_ID="spelling", PET_ROLE="trainer")
    for rank in (0, 1):
        views = []
        for dump in (dashed, underscored, pet):
            env = dump[rank]["env"]
            assert dump[rank]["argv"] == [script("dump_env.py"), *SCRIPT_ARGS]
            views.append({k: env.get(k) for k in TORCHRUN_VARS if k not in {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}})
        assert views[0] == views[1] == views[2]
        assert views[0]["WORLD_SIZE"] == "2"
        assert views[0]["TORCHELASTIC_MAX_RESTARTS"] == "1"
        assert views[0]["TORCHELASTIC_RUN_ID"] == "spelling"
        assert views[0]["ROLE_NAME"] == "trainer"


# ---------------------------------------------------------------------------------------------------------------
# 2. A failing worker
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_failing_worker_stops_the_job_with_a_summary(tmp_path, marker, how):
    began = time.monotonic()
    res = run(swiftrun("--nproc-per-node", "2", script("fail_rank.py"), how, str(tmp_path)), marker,
              timeout=RUN_TIMEOUT)
    assert res.returncode == 1, res.stdout + res.stderr
    cause = root_cause_block(res.stderr)
    assert "rank      : 1 (local_rank: 1)" in cause
    if how == "raise":
        assert "exitcode  : 1 (pid:" in cause
        assert "ValueError: boom at rank 1" in cause
    else:
        assert "exitcode  : -9 (pid:" in cause
        assert "SIGKILL" in cause
    assert "rank      : 0" not in res.stderr  # rank 0 was stopped by the launcher, it did not fail
    # rank 0 (which would have run for two minutes) was stopped at once, not after the 30 s kill grace
    assert not alive(pid_of(tmp_path / "0.pid"))
    assert time.monotonic() - began < 25


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_record_decorated_worker_reports_its_error_as_under_torchrun(marker):
    res = run(swiftrun("--nproc-per-node", "2", script("record_fail.py")), marker, timeout=RUN_TIMEOUT)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "FileNotFoundError" not in res.stdout + res.stderr
    cause = root_cause_block(res.stderr)
    assert "rank      : 1 (local_rank: 1)" in cause and "ValueError: boom at rank 1" in cause


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_failure_summary_names_the_error_file_like_torchrun(tmp_path, marker):
    res = run(swiftrun("--nproc-per-node", "2", script("fail_rank.py"), "raise", str(tmp_path)), marker,
              timeout=RUN_TIMEOUT)
    assert res.returncode == 1, res.stdout + res.stderr
    cause = root_cause_block(res.stderr)
    error_file = next(line for line in cause.splitlines() if line.startswith("  error_file:")).split(": ", 1)[1]
    assert Path(error_file).parts[-3:] == ("attempt_0", "1", "error.json"), cause
    assert "cause     :" not in cause


# ---------------------------------------------------------------------------------------------------------------
# 3. Hang of an unmodified script
# ---------------------------------------------------------------------------------------------------------------


def wait_for_running(event_log: Path, rank: int, pid: int) -> None:
    """The launcher has heard from ``pid`` (its HELLO): from now on a silence is a hang, not a slow start."""
    def seen() -> bool:
        if not event_log.exists():
            return False
        return any(e["event"] == "worker_state" and e.get("rank") == rank and e.get("pid") == pid
                   and e.get("state") == "running" for e in read_events(event_log))
    wait_until(seen, timeout=30, what=f"rank {rank} (pid {pid}) to be running")


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_restarts", [1, 0])
def test_stopped_worker_is_detected_as_hung(tmp_path, marker, max_restarts):
    events = tmp_path / "events.jsonl"
    cmd = swiftrun("--nproc-per-node", "2", "--heartbeat-timeout", "2", "--heartbeat-interval", "0.2",
                   "--event-log", str(events), *(["--max-restarts", str(max_restarts)] if max_restarts else []),
                   script("hang.py"), str(tmp_path), "60")
    with launched(cmd, marker) as proc:
        wait_until(lambda: (tmp_path / "hang.pid").exists(), timeout=60, what="rank 1 to write its pid")
        pid = pid_of(tmp_path / "hang.pid")
        wait_for_running(events, 1, pid)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
        ended_after = time.monotonic() - stopped_at
    output = out + err
    assert "no heartbeat" in output
    attempts = set((tmp_path / "attempts").read_text().split("\n")) - {""}
    if max_restarts:
        assert proc.returncode == 0, output
        assert "restarting every worker" in output
        assert {"1 0", "1 1"} <= attempts  # every rank ran again, in attempt 1
    else:
        assert proc.returncode == 1, output
        assert "0 1" in attempts and not any(a.startswith("1 ") for a in attempts)  # no restart
        cause = root_cause_block(err)
        assert "rank      : 1 (local_rank: 1)" in cause and "no heartbeat" in cause
        assert ended_after < 2 + 8, f"the hang ended the job only after {ended_after:.1f}s"
    assert not alive(pid)


# ---------------------------------------------------------------------------------------------------------------
# 4. Signals to the launcher
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_sigterm_to_launcher_is_forwarded_and_ends_the_job(tmp_path, marker):
    with launched(swiftrun("--nproc-per-node", "2", script("sleeper.py"), str(tmp_path)), marker) as proc:
        wait_until(lambda: all((tmp_path / f"{r}.pid").exists() for r in (0, 1)), timeout=60,
                   what="both workers to write their pids")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    for rank in (0, 1):
        assert (tmp_path / f"{rank}.term").exists(), f"rank {rank} never got SIGTERM"
    wait_until(lambda: not processes_with_marker(marker), timeout=5, what="every process to be gone")


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_sigkill_to_launcher_takes_the_workers_with_it(tmp_path, marker):
    with launched(swiftrun("--nproc-per-node", "2", script("sleeper.py"), str(tmp_path)), marker) as proc:
        wait_until(lambda: all((tmp_path / f"{r}.pid").exists() for r in (0, 1)), timeout=60,
                   what="both workers to write their pids")
        pids = [pid_of(tmp_path / f"{r}.pid") for r in (0, 1)]
        proc.kill()
        proc.wait(timeout=10)
        wait_until(lambda: not processes_with_marker(marker), timeout=5, what="the orphaned workers to die")
    assert not any(alive(pid) for pid in pids)
    assert not any((tmp_path / f"{r}.term").exists() for r in (0, 1))  # SIGKILL (parent-death), not SIGTERM


# ---------------------------------------------------------------------------------------------------------------
# 5. Bad input
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_missing_script_and_malformed_flag_are_usage_errors(tmp_path, marker):
    missing = tmp_path / "no_such_script.py"
    began = time.monotonic()
    res = run(swiftrun("--nproc-per-node", "2", str(missing), "--lr", "3"), marker, timeout=30)
    assert res.returncode == 2, res.stdout + res.stderr
    assert time.monotonic() - began < 5
    assert "not found" in res.stderr and str(missing) in res.stderr
    assert "Traceback" not in res.stdout + res.stderr

    res = run(swiftrun("--nproc-per-node", "x", script("print_ranks.py")), marker, timeout=30)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "--nproc-per-node" in res.stderr and "'x'" in res.stderr
    assert "Traceback" not in res.stdout + res.stderr


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_port_in_use_is_a_clear_error(marker):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = run(swiftrun("--nproc-per-node", "2", "--master-port", str(port), script("print_ranks.py")), marker,
                  timeout=RUN_TIMEOUT)
    output = res.stdout + res.stderr
    assert res.returncode != 0, output
    assert "already in use" in res.stderr and str(port) in res.stderr
    assert "Traceback" not in output
    assert "line of rank" not in output  # no worker was started


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_long_tmpdir_does_not_break_the_control_socket(tmp_path, marker):
    tmpdir = tmp_path / ("t" * 60) / ("t" * 60)  # deeper than a unix socket path may be
    tmpdir.mkdir(parents=True)
    res = run(swiftrun("--nproc-per-node", "2", script("print_ranks.py")), marker, timeout=RUN_TIMEOUT,
              TMPDIR=str(tmpdir))
    output = res.stdout + res.stderr
    assert "Traceback" not in output
    assert res.returncode == 0, output
    assert lines_of(res.stdout) == {"stdout line of rank 0", "stdout line of rank 1"}


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_script_failing_at_import_exhausts_restarts_and_stops(tmp_path, marker):
    attempts_file = tmp_path / "attempts"
    res = run(swiftrun("--nproc-per-node", "2", "--max-restarts", "3", script("import_error.py"), str(attempts_file)),
              marker, timeout=RUN_TIMEOUT)
    output = res.stdout + res.stderr
    assert res.returncode == 1, output
    # 4 attempts (0..3), never a 5th; a rank may be stopped before it starts when the other fails first
    attempts = {line.split()[0] for line in attempts_file.read_text().splitlines()}
    assert attempts == {"0", "1", "2", "3"}
    assert "No module named 'swiftrun_test_no_such_module'" in root_cause_block(res.stderr)


# ---------------------------------------------------------------------------------------------------------------
# 6. Logs
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("flags", "console_out", "console_err", "file_ranks"),
    [
        pytest.param(["-r", "3"], set(), set(), {0, 1}, id="redirect"),
        pytest.param(["--tee", "3"], {"[default0]:stdout line of rank 0", "[default1]:stdout line of rank 1"},
                     {"[default0]:stderr line of rank 0", "[default1]:stderr line of rank 1"}, {0, 1}, id="tee"),
        pytest.param(["--tee", "3", "--local-ranks-filter", "1"], {"[default1]:stdout line of rank 1"},
                     {"[default1]:stderr line of rank 1"}, {0, 1}, id="tee-filtered"),
        pytest.param(["--local-ranks-filter", "1"], {"stdout line of rank 1"}, {"stderr line of rank 1"}, set(),
                     id="filtered"),
    ],
)
def test_redirects_tee_and_rank_filter(tmp_path, marker, flags, console_out, console_err, file_ranks):
    log_dir = tmp_path / "logs"
    res = run(swiftrun("--nproc-per-node", "2", "--log-dir", str(log_dir), *flags, script("print_ranks.py")), marker,
              timeout=RUN_TIMEOUT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert lines_of(res.stdout) == console_out
    assert lines_of(res.stderr) == console_err
    files = {p.relative_to(log_dir).parts[-3:]: p for p in log_dir.rglob("*.log")}
    expected = {("attempt_0", str(r), f"{s}.log") for r in file_ranks for s in ("stdout", "stderr")}
    assert set(files) == expected
    for rank in file_ranks:
        assert files[("attempt_0", str(rank), "stdout.log")].read_text() == f"stdout line of rank {rank}\n"
        assert files[("attempt_0", str(rank), "stderr.log")].read_text() == f"stderr line of rank {rank}\n"


# ---------------------------------------------------------------------------------------------------------------
# 7-8. Entry points other than a script
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_no_python_runs_the_program_directly(marker):
    res = run(swiftrun("--nproc-per-node", "2", "--no-python", "/bin/sh", "-c", 'echo "rank=$RANK args=$*"', "sh",
                       "--lr", "3"), marker, timeout=RUN_TIMEOUT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert {line for line in res.stdout.splitlines() if line.startswith("rank=")} == {
        "rank=0 args=--lr 3", "rank=1 args=--lr 3"}


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_module_mode_runs_as_main_with_argv(tmp_path, marker):
    plain, ours = tmp_path / "plain", tmp_path / "swiftrun"
    plain.mkdir()
    ours.mkdir()
    res = run([sys.executable, "-m", "show_main", str(plain), "--standalone", "-n", "8"], marker, timeout=30,
              cwd=SCRIPTS)
    assert res.returncode == 0, res.stderr
    expected = json.loads((plain / "plain.json").read_text())
    assert expected["name"] == "__main__"
    res = run(swiftrun("--nproc-per-node", "2", "-m", "show_main", str(ours), "--standalone", "-n", "8"), marker,
              timeout=RUN_TIMEOUT, cwd=SCRIPTS)
    assert res.returncode == 0, res.stdout + res.stderr
    for rank in (0, 1):
        seen = json.loads((ours / f"{rank}.json").read_text())
        assert seen["name"] == "__main__"
        assert seen["argv"] == [expected["argv"][0], str(ours), "--standalone", "-n", "8"]
