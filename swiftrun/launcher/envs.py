"""The environment of a worker process: torchrun's variables, exactly, plus swiftrun's own.

torchrun's names and values come from ``LocalElasticAgent._start_workers`` (see ANCHORS.md b.2); a script
must not be able to tell the two launchers apart from its environment, apart from ports and run ids.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from swiftrun.config import LaunchConfig

# swiftrun's own variables, read by the injected runtime (swiftrun/runtime/worker/env.py mirrors these names)
CTL_ADDR = "SWIFTRUN_CTL_ADDR"  # ZeroMQ endpoint of the launcher's ROUTER
TOKEN = "SWIFTRUN_TOKEN"  # per-job secret the worker presents in HELLO
LAUNCHER_PID = "SWIFTRUN_LAUNCHER_PID"  # the worker exits if its parent is not this process any more
INCARNATION = "SWIFTRUN_INCARNATION"  # 0 for the first process of a rank, +1 per replacement
GENERATION = "SWIFTRUN_GENERATION"  # recovery generation the process was started in
JOINING = "SWIFTRUN_JOINING"  # "1" for a replacement that joins survivors instead of starting fresh
SPARE = "SWIFTRUN_SPARE"  # "1" for a warm spare that waits for a rank
HEARTBEAT_INTERVAL = "SWIFTRUN_HEARTBEAT_INTERVAL"
# the launcher's deadlines, so that the runtime's own waits are derived from the same flags (and a user's
# SWIFTRUN_<FLAG> variable, which already sets the flag, keeps meaning the same thing in the worker)
HEARTBEAT_TIMEOUT = "SWIFTRUN_HEARTBEAT_TIMEOUT"  # silence after which the launcher declares a worker hung
RECOVERY_TIMEOUT = "SWIFTRUN_RECOVERY_TIMEOUT"  # survivors' abort; and RECOVER -> RECOVERED once all are ready
STARTUP_TIMEOUT = "SWIFTRUN_STARTUP_TIMEOUT"  # a replacement's spawn/ASSIGN -> JOINING (its script's preamble)
FAULTS = "SWIFTRUN_FAULTS"  # ";"-joined FaultSpec encodings
RECOVERY = "SWIFTRUN_RECOVERY"  # RecoveryMode value
LOG_BUDGET = "SWIFTRUN_LOG_BUDGET"  # pipelines: bytes of boundary logs allowed (unset: log every boundary)
STAGE_CKPT_DIR = "SWIFTRUN_STAGE_CKPT_DIR"  # pipelines: stage checkpoints are also written here
VERIFY_EVERY = "SWIFTRUN_VERIFY_EVERY"  # compare the replicas' whole state every N steps (0: after recoveries)
EXACT_UNDO = "SWIFTRUN_EXACT_UNDO"  # "auto" / "on" / "off": when an undo restores a pre-step copy (core/precopy.py)
TRANSFER_CHUNK_MB = "SWIFTRUN_TRANSFER_CHUNK_MB"  # state transfer chunk, MiB (0: the device's default)


@dataclass(frozen=True)
class JobEndpoints:
    """What every worker of the job shares: where the store and the control socket are."""

    master_addr: str
    master_port: int
    ctl_addr: str
    token: str
    run_id: str
    attempt_dir: Path  # <log root>/attempt_<n>


def omp_threads_banner(config: LaunchConfig) -> str | None:
    """torchrun's warning when it sets OMP_NUM_THREADS=1 for several local workers, else None."""
    if "OMP_NUM_THREADS" in os.environ or config.nproc_per_node <= 1:
        return None
    return (
        "\n*****************************************\n"
        "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system "
        "being overloaded, please further tune the variable for optimal performance in your application as "
        "needed. \n*****************************************"
    )


def signals_value(config: LaunchConfig) -> str:
    return ",".join(signal.Signals(s).name for s in config.signals_to_handle)


def rank_env(config: LaunchConfig, ends: JobEndpoints, rank: int, attempt: int) -> dict[str, str]:
    """torchrun's per-worker variables for ``rank`` in restart attempt ``attempt`` (no swiftrun variables)."""
    local_rank = rank - config.node_rank * config.nproc_per_node
    env = {
        "RANK": str(rank),
        "GROUP_RANK": str(config.node_rank),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": config.role,
        "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
        "WORLD_SIZE": str(config.world_size),
        "GROUP_WORLD_SIZE": str(config.nnodes[0]),
        "ROLE_WORLD_SIZE": str(config.world_size),
        "MASTER_ADDR": ends.master_addr,
        "MASTER_PORT": str(ends.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
        "TORCHELASTIC_RUN_ID": ends.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TORCHELASTIC_ERROR_FILE": str(ends.attempt_dir / str(local_rank) / "error.json"),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": signals_value(config),
        "LOCAL_RANK": str(local_rank),
    }
    if "OMP_NUM_THREADS" in os.environ:
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    elif config.nproc_per_node > 1:
        env["OMP_NUM_THREADS"] = "1"
    if config.virtual_local_rank:
        env["LOCAL_RANK"] = "0"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(config.nproc_per_node)]
        env["CUDA_VISIBLE_DEVICES"] = devices[local_rank % len(devices)]
    return env


def runtime_env(
    config: LaunchConfig, ends: JobEndpoints, *, incarnation: int, generation: int, joining: bool, spare: bool
) -> dict[str, str]:
    """swiftrun's variables for the injected runtime."""
    env = {
        CTL_ADDR: ends.ctl_addr,
        TOKEN: ends.token,
        LAUNCHER_PID: str(os.getpid()),
        INCARNATION: str(incarnation),
        GENERATION: str(generation),
        JOINING: "1" if joining else "0",
        SPARE: "1" if spare else "0",
        HEARTBEAT_INTERVAL: repr(config.timeouts.heartbeat_interval),
        HEARTBEAT_TIMEOUT: repr(config.timeouts.heartbeat_timeout),
        RECOVERY_TIMEOUT: repr(config.timeouts.recovery_timeout),
        STARTUP_TIMEOUT: repr(config.timeouts.startup_timeout),
        RECOVERY: config.recovery.value,
        VERIFY_EVERY: str(config.verify_every),
        TRANSFER_CHUNK_MB: str(config.transfer_chunk_mb),
        EXACT_UNDO: config.exact_undo.value,
    }
    if config.faults:
        env[FAULTS] = ";".join(f.encode() for f in config.faults)
    if config.log_budget is not None:
        env[LOG_BUDGET] = str(config.log_budget)
    if config.log_memory is not None:
        env["SWIFTRUN_LOG_MEMORY"] = str(config.log_memory)
    if config.parallel_replay is not None:
        env["SWIFTRUN_PARALLEL_REPLAY"] = str(config.parallel_replay)
    if config.stage_ckpt_dir is not None:
        env[STAGE_CKPT_DIR] = str(config.stage_ckpt_dir.resolve())
    return env


def worker_environ(
    config: LaunchConfig,
    ends: JobEndpoints,
    rank: int | None,
    *,
    attempt: int,
    incarnation: int,
    generation: int,
    joining: bool,
) -> dict[str, str]:
    """The complete environment of a new worker process (``rank=None``: a warm spare without a rank yet)."""
    env = dict(os.environ)
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = signals_value(config)
    if rank is not None:
        env.update(rank_env(config, ends, rank, attempt))
    elif "OMP_NUM_THREADS" not in env and config.nproc_per_node > 1:
        # a spare imports torch before it knows its rank: its thread pool is sized now, not at ASSIGN
        env["OMP_NUM_THREADS"] = "1"
    env.update(
        runtime_env(config, ends, incarnation=incarnation, generation=generation, joining=joining, spare=rank is None)
    )
    return env
