"""Worker environments (swiftrun.launcher.envs): torchrun's variables exactly, plus swiftrun's own."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from swiftrun.config import Entrypoint, EntrypointKind, FaultSpec, LaunchConfig, RecoveryMode, Timeouts
from swiftrun.launcher import envs

SCRIPT = Entrypoint(EntrypointKind.SCRIPT, "train.py")
ENDS = envs.JobEndpoints(
    master_addr="10.0.0.1", master_port=29511, ctl_addr="ipc:///tmp/swiftrun-x/ctl", token="tok",
    run_id="run-42", attempt_dir=Path("/logs/run-42/attempt_0"),
)
TORCHRUN_VARS = {
    "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "LOCAL_RANK",
}


@pytest.fixture(autouse=True)
def _clean_environ(monkeypatch):
    """Tests decide which of the inherited variables exist."""
    for name in ("OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "CUDA_VISIBLE_DEVICES", "RANK", "LOCAL_RANK",
                 "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def config(**kw) -> LaunchConfig:
    return LaunchConfig(entrypoint=SCRIPT, **kw)


def test_rank_env_of_the_second_node_has_torchruns_values():
    c = config(nproc_per_node=4, nnodes=(2, 2), node_rank=1, max_restarts=3, role="trainer")

    env = envs.rank_env(c, ENDS, rank=6, attempt=2)

    assert env == {
        "RANK": "6",
        "LOCAL_RANK": "2",
        "GROUP_RANK": "1",
        "ROLE_RANK": "6",
        "ROLE_NAME": "trainer",
        "LOCAL_WORLD_SIZE": "4",
        "WORLD_SIZE": "8",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_WORLD_SIZE": "8",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29511",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_RUN_ID": "run-42",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCHELASTIC_ERROR_FILE": "/logs/run-42/attempt_0/2/error.json",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "OMP_NUM_THREADS": "1",
    }


@pytest.mark.parametrize("rank", range(3))
def test_rank_and_local_rank_follow_the_rank_on_one_node(rank):
    env = envs.rank_env(config(nproc_per_node=3), ENDS, rank=rank, attempt=0)

    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), str(rank), "3")
    assert env["TORCHELASTIC_ERROR_FILE"] == f"/logs/run-42/attempt_0/{rank}/error.json"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "0"


def test_every_value_is_a_string():
    env = envs.worker_environ(config(nproc_per_node=2), ENDS, 1, attempt=0, incarnation=0, generation=0,
                              joining=False)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())


def test_nccl_async_error_handling_is_inherited_when_set(monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    assert envs.rank_env(config(), ENDS, 0, 0)["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_nccl_async_error_handling_defaults_to_one():
    assert envs.rank_env(config(), ENDS, 0, 0)["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_omp_num_threads_is_one_when_unset_and_several_local_workers():
    assert envs.rank_env(config(nproc_per_node=2), ENDS, 0, 0)["OMP_NUM_THREADS"] == "1"
    assert envs.omp_threads_banner(config(nproc_per_node=2)) is not None


def test_omp_num_threads_is_not_set_for_a_single_local_worker():
    assert "OMP_NUM_THREADS" not in envs.rank_env(config(nproc_per_node=1), ENDS, 0, 0)
    assert "OMP_NUM_THREADS" not in envs.worker_environ(config(nproc_per_node=1), ENDS, 0, attempt=0, incarnation=0,
                                                        generation=0, joining=False)
    assert envs.omp_threads_banner(config(nproc_per_node=1)) is None


def test_an_inherited_omp_num_threads_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    c = config(nproc_per_node=4)

    assert envs.rank_env(c, ENDS, 3, 0)["OMP_NUM_THREADS"] == "8"
    assert envs.worker_environ(c, ENDS, 3, attempt=0, incarnation=0, generation=0, joining=False)[
        "OMP_NUM_THREADS"] == "8"
    assert envs.omp_threads_banner(c) is None


def test_signals_to_handle_lists_the_configured_signals_by_name():
    c = config(signals_to_handle=(signal.SIGUSR1, signal.SIGTERM))
    assert envs.rank_env(c, ENDS, 0, 0)["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGUSR1,SIGTERM"


def test_virtual_local_rank_gives_every_worker_local_rank_zero_and_its_own_device():
    c = config(nproc_per_node=3, virtual_local_rank=True)

    envs_ = [envs.rank_env(c, ENDS, r, 0) for r in range(3)]

    assert [e["LOCAL_RANK"] for e in envs_] == ["0", "0", "0"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs_] == ["0", "1", "2"]
    assert [e["RANK"] for e in envs_] == ["0", "1", "2"]
    assert [e["TORCHELASTIC_ERROR_FILE"] for e in envs_] == [f"/logs/run-42/attempt_0/{r}/error.json" for r in range(3)]


def test_virtual_local_rank_picks_from_the_inherited_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6")
    c = config(nproc_per_node=2, nnodes=(2, 2), node_rank=1, virtual_local_rank=True)

    assert [envs.rank_env(c, ENDS, r, 0)["CUDA_VISIBLE_DEVICES"] for r in (2, 3)] == ["4", "6"]


def test_without_virtual_local_rank_visible_devices_pass_through_untouched(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    c = config(nproc_per_node=2)

    assert "CUDA_VISIBLE_DEVICES" not in envs.rank_env(c, ENDS, 1, 0)
    assert envs.worker_environ(c, ENDS, 1, attempt=0, incarnation=0, generation=0, joining=False)[
        "CUDA_VISIBLE_DEVICES"] == "4,6"


def test_worker_environ_inherits_the_launcher_environment_and_adds_torchrun_and_swiftrun_variables(monkeypatch):
    monkeypatch.setenv("SWIFTRUN_TEST_INHERITED", "yes")
    c = config(nproc_per_node=2, recovery=RecoveryMode.UNDO,
               timeouts=Timeouts(heartbeat_interval=0.25, heartbeat_timeout=7, recovery_timeout=40, startup_timeout=90),
               faults=(FaultSpec(1, 3, "step", "sigkill"), FaultSpec(0, 5, "forward", "exit", True)))

    env = envs.worker_environ(c, ENDS, 1, attempt=1, incarnation=2, generation=3, joining=True)

    assert env["SWIFTRUN_TEST_INHERITED"] == "yes"
    assert TORCHRUN_VARS <= env.keys()
    assert env["RANK"] == "1" and env["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert env[envs.CTL_ADDR] == "ipc:///tmp/swiftrun-x/ctl"
    assert env[envs.TOKEN] == "tok"
    assert env[envs.INCARNATION] == "2"
    assert env[envs.GENERATION] == "3"
    assert env[envs.JOINING] == "1"
    assert env[envs.SPARE] == "0"
    assert float(env[envs.HEARTBEAT_INTERVAL]) == 0.25
    assert (env[envs.HEARTBEAT_TIMEOUT], env[envs.RECOVERY_TIMEOUT], env[envs.STARTUP_TIMEOUT]) == ("7", "40", "90")
    assert env[envs.RECOVERY] == "undo"
    assert env[envs.FAULTS] == "1:3:step:sigkill;0:5:forward:exit:every"
    assert env[envs.LAUNCHER_PID].isdigit()


def test_a_fresh_worker_is_not_joining_and_no_faults_variable_without_faults():
    env = envs.worker_environ(config(nproc_per_node=2), ENDS, 0, attempt=0, incarnation=0, generation=0,
                              joining=False)
    assert (env[envs.JOINING], env[envs.SPARE], env[envs.INCARNATION]) == ("0", "0", "0")
    assert envs.FAULTS not in env


def test_a_spare_has_no_rank_variables_but_knows_it_is_a_spare():
    c = config(nproc_per_node=2)

    env = envs.worker_environ(c, ENDS, None, attempt=0, incarnation=0, generation=1, joining=False)

    assert not (TORCHRUN_VARS - {"TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}) & env.keys()
    assert "RANK" not in env and "LOCAL_RANK" not in env and "WORLD_SIZE" not in env
    assert env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    assert env[envs.SPARE] == "1"
    assert env[envs.GENERATION] == "1"


def test_the_launcher_environment_is_not_modified():
    before = dict(os.environ)
    envs.worker_environ(config(nproc_per_node=2, virtual_local_rank=True), ENDS, 1, attempt=0, incarnation=0,
                        generation=0, joining=False)
    assert dict(os.environ) == before


def test_the_runtime_reads_the_launchers_deadlines_and_derives_its_waits_from_them(monkeypatch):
    from swiftrun.runtime.worker.env import WorkerEnv

    c = config(nproc_per_node=2, timeouts=Timeouts(heartbeat_timeout=8, recovery_timeout=40, startup_timeout=90))
    env = envs.worker_environ(c, ENDS, 1, attempt=0, incarnation=0, generation=0, joining=False)
    for name in ("SWIFTRUN_DETECT_TIMEOUT", "SWIFTRUN_CONNECT_TIMEOUT"):
        env.pop(name, None)
    monkeypatch.setattr(os, "environ", env)

    w = WorkerEnv.read()

    assert (w.heartbeat_timeout, w.recovery_timeout, w.startup_timeout) == (8, 40, 90)
    assert w.detect_wait == 8 + 30  # the launcher detects a hang within the heartbeat timeout
    assert w.recover_wait == 90 + 40 + 8  # a replacement may take its whole start-up before RECOVER
    assert w.connect_wait == 30
    env["SWIFTRUN_DETECT_TIMEOUT"], env["SWIFTRUN_CONNECT_TIMEOUT"] = "5", "7"  # the old knobs still win
    assert (WorkerEnv.read().detect_wait, WorkerEnv.read().connect_wait) == (5, 7)


@pytest.mark.parametrize("cap, expected", [(None, None), (0, "0"), (2, "2")])
def test_parallel_replay_cap_reaches_the_workers(cap, expected):
    env = envs.worker_environ(config(nproc_per_node=2, parallel_replay=cap), ENDS, 1, attempt=0, incarnation=0,
                              generation=0, joining=False)
    assert env.get("SWIFTRUN_PARALLEL_REPLAY") == expected
