"""What the launcher told this worker process through its environment (names in swiftrun/launcher/envs.py).

Every ``SWIFTRUN_*`` variable the runtime reads is read here, and nowhere else: :class:`WorkerEnv` (who this
process is, its deadlines), :class:`Settings` (the tuning flags: stage checkpoints, logging, transfers,
verification) and :func:`launcher_pid`.

The launcher passes its deadlines (--heartbeat-timeout, --recovery-timeout, --startup-timeout) so that the
runtime's own waits follow the same flags instead of constants; :class:`WorkerEnv` derives those waits once.
SWIFTRUN_DETECT_TIMEOUT and SWIFTRUN_CONNECT_TIMEOUT, when set, still override the derived values.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


def under_swiftrun() -> bool:
    """True when this process was started by swiftrun with its control channel (False under torchrun)."""
    return bool(os.environ.get("SWIFTRUN_CTL_ADDR"))


@dataclass(frozen=True)
class WorkerEnv:
    ctl_addr: str
    token: str
    launcher_pid: int
    rank: int  # -1 for a spare not yet assigned
    world_size: int
    incarnation: int
    generation: int
    joining: bool
    spare: bool
    heartbeat_interval: float
    faults: str
    recovery: str
    # --exact-undo/--no-exact-undo: True copies parameters and optimizer state before every optimizer step (an
    # undo restores them bitwise), False never, None (the default) wherever the job may undo an update
    exact_undo: bool | None = None
    heartbeat_timeout: float = 30.0
    recovery_timeout: float = 120.0
    startup_timeout: float = 600.0
    # How long a rank whose collective failed waits for the launcher's ABORT: a crash is seen at once, a hang
    # after the heartbeat timeout (plus the kill); past this, the failure is the script's own.
    detect_wait: float = 60.0
    # How long a rank that reported ABORTED/JOINING waits for RECOVER: the launcher sends it once every rank is
    # ready, and a replacement may run its script's preamble for up to the start-up timeout first; a later
    # failure arrives as a newer generation, so this is only a backstop against a launcher that went away.
    recover_wait: float = 750.0
    # Building a generation's process group: a peer that dies meanwhile is aborted by the launcher anyway.
    connect_wait: float = 30.0

    @classmethod
    def read(cls) -> WorkerEnv:
        env = os.environ
        heartbeat = _seconds(env, "SWIFTRUN_HEARTBEAT_TIMEOUT", 30.0)
        recovery = _seconds(env, "SWIFTRUN_RECOVERY_TIMEOUT", 120.0)
        startup = _seconds(env, "SWIFTRUN_STARTUP_TIMEOUT", 600.0)
        return cls(
            ctl_addr=env.get("SWIFTRUN_CTL_ADDR", ""),
            token=env.get("SWIFTRUN_TOKEN", ""),
            launcher_pid=int(env.get("SWIFTRUN_LAUNCHER_PID", "0") or 0),
            rank=int(env.get("RANK", "-1")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            incarnation=int(env.get("SWIFTRUN_INCARNATION", "0") or 0),
            generation=int(env.get("SWIFTRUN_GENERATION", "0") or 0),
            joining=env.get("SWIFTRUN_JOINING") == "1",
            spare=env.get("SWIFTRUN_SPARE") == "1",
            heartbeat_interval=float(env.get("SWIFTRUN_HEARTBEAT_INTERVAL", "0.5") or 0.5),
            faults=env.get("SWIFTRUN_FAULTS", ""),
            recovery=env.get("SWIFTRUN_RECOVERY", "auto"),
            exact_undo={"on": True, "off": False}.get(env.get("SWIFTRUN_EXACT_UNDO", "auto")),
            heartbeat_timeout=heartbeat,
            recovery_timeout=recovery,
            startup_timeout=startup,
            detect_wait=_seconds(env, "SWIFTRUN_DETECT_TIMEOUT", heartbeat + 30.0),
            recover_wait=startup + recovery + heartbeat,
            connect_wait=_seconds(env, "SWIFTRUN_CONNECT_TIMEOUT", min(30.0, recovery)),
        )


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    """A duration from the environment; unset, empty or malformed gives ``default`` (never crash a worker)."""
    try:
        value = float(env.get(name, "") or default)
    except ValueError:
        return default
    return value if value > 0 else default


def launcher_pid(env: Mapping[str, str] = os.environ) -> int:
    """The launcher's pid, which a worker (or the zygote) must not outlive; 0 when unknown."""
    try:
        return int(env.get("SWIFTRUN_LAUNCHER_PID", "0") or 0)
    except ValueError:
        return 0


@dataclass(frozen=True)
class Settings:
    """The runtime's tuning settings, from the launcher's flags (swiftrun/launcher/envs.py names the variables).

    Read afresh by each caller (:func:`settings`): cheap, and a test that sets a variable sees it at once."""

    loglevel: str | None = None  # SWIFTRUN_LOGLEVEL: the runtime's logging level (debug, info, ...)
    ckpt_every: int | None = None  # --ckpt-every: steps between stage checkpoints (Run(checkpoint_every) wins)
    stage_ckpt_dir: str | None = None  # --stage-ckpt-dir: stage checkpoints also on (shared) disk
    log_memory: int | None = None  # --log-memory: bytes of pipeline log kept in memory before spilling
    log_spill_dir: str | None = None  # where the log spills (default: the system's temporary directory)
    log_budget: int | None = None  # --log-budget: selective logging's storage budget in bytes
    verify_every: int = 0  # --verify-every: compare every rank's state every N steps (0: only after recovery)
    transfer_chunk_mb: int = 0  # --transfer-chunk-mb (0: the transfer's default for the device)
    parallel_replay: int = -1  # --parallel-replay: most helpers of a pipeline replay (-1: every idle rank; 0: off)

    @classmethod
    def read(cls, env: Mapping[str, str] = os.environ) -> Settings:
        memory = env.get("SWIFTRUN_LOG_MEMORY", "")
        budget = env.get("SWIFTRUN_LOG_BUDGET", "")
        helpers = env.get("SWIFTRUN_PARALLEL_REPLAY", "").strip()
        return cls(
            loglevel=env.get("SWIFTRUN_LOGLEVEL") or None,
            ckpt_every=_int(env, "SWIFTRUN_CKPT_EVERY", 0) or None,
            stage_ckpt_dir=env.get("SWIFTRUN_STAGE_CKPT_DIR") or None,
            log_memory=int(memory) if memory else None,
            log_spill_dir=env.get("SWIFTRUN_LOG_SPILL_DIR") or None,
            log_budget=int(budget) if budget.strip() else None,
            verify_every=_int(env, "SWIFTRUN_VERIFY_EVERY", 0),
            transfer_chunk_mb=_int(env, "SWIFTRUN_TRANSFER_CHUNK_MB", 0),
            parallel_replay=int(helpers) if helpers else -1,
        )


def settings() -> Settings:
    """This process's settings, as its environment holds them now."""
    return Settings.read(os.environ)


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    """An integer setting; unset, empty or malformed gives ``default`` (never crash a worker)."""
    try:
        return int(env.get(name, "") or default)
    except ValueError:
        return default
