"""What the launcher told this worker process through its environment (names in swiftrun/launcher/envs.py)."""

from __future__ import annotations

import os
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

    @classmethod
    def read(cls) -> WorkerEnv:
        env = os.environ
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
        )
