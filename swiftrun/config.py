"""Launch configuration: one frozen, validated description of a job.

The CLI builds a :class:`LaunchConfig`; nothing below the CLI parses strings from the user. Every duration is
in seconds (float) and every relation between timeouts is checked here, once, so that the supervisor can trust
what it is handed.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field
from pathlib import Path

from swiftrun.errors import ConfigError


class EntrypointKind(str, enum.Enum):
    """How a worker runs the user's target."""

    SCRIPT = "script"  # python -u script.py args  (runpy.run_path under the injected runtime)
    MODULE = "module"  # python -u -m pkg.mod args
    EXECUTABLE = "executable"  # --no-python: exec the target directly, no runtime injected


class ExactUndo(str, enum.Enum):
    """Whether an undone optimizer update is put back from a copy taken before it (bitwise) or inverted."""

    AUTO = "auto"  # copy wherever this job may undo an update (runtime/core/recovery.py says when and the cost)
    ON = "on"  # copy before every optimizer step
    OFF = "off"  # never copy: an undo inverts the update arithmetically, not bitwise, and says so


class RecoveryMode(str, enum.Enum):
    """How a failure of a rank is repaired."""

    AUTO = "auto"  # Swift in-place recovery, choosing roll-forward or undo per failure
    ROLL_FORWARD = "roll-forward"  # Swift, always take the state of a rank that completed the step
    UNDO = "undo"  # Swift, always undo the partially applied step (the paper's update-undo)
    RESTART = "restart"  # torchrun's behaviour: stop every worker, start them all again


class Std(enum.IntFlag):
    """Which standard streams of a worker go to files (torchrun's -r / -t values)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


@dataclass(frozen=True)
class Entrypoint:
    kind: EntrypointKind
    target: str  # script path, module name or executable
    args: tuple[str, ...] = ()
    run_path: bool = False  # torchrun --run-path: runpy.run_path inside the worker interpreter


@dataclass(frozen=True)
class FaultSpec:
    """A fault the runtime injects into one rank (tests and demos only).

    ``phase`` is one of forward, backward, allreduce, update, step, scheduler, after-step, collective, save, recover,
    transfer, help, exchange, import, connect (see swiftrun/runtime/worker/faults.py for where each fires);
    ``kind`` is one of sigkill, exception, exit, sigstop, segfault, hang-gil, deaf (the rank's next watched gloo
    wait never ends by itself, as when gloo leaves a send blocked: only an ABORT ends it).
    ``every_incarnation`` makes replacements of that rank fail the same way (a deterministic crash).
    """

    rank: int
    step: int
    phase: str
    kind: str
    every_incarnation: bool = False

    PHASES = ("forward", "backward", "allreduce", "update", "step", "scheduler", "after-step", "collective", "save",
              "recover", "transfer", "help", "exchange", "import", "connect")
    KINDS = ("sigkill", "exception", "exit", "sigstop", "segfault", "hang-gil", "deaf")

    def __post_init__(self) -> None:
        if self.phase not in self.PHASES:
            raise ConfigError(f"fault phase {self.phase!r} is not one of {', '.join(self.PHASES)}")
        if self.kind not in self.KINDS:
            raise ConfigError(f"fault kind {self.kind!r} is not one of {', '.join(self.KINDS)}")
        if self.rank < 0 or self.step < 0:
            raise ConfigError("fault rank and step must be >= 0")

    def encode(self) -> str:
        tail = ":every" if self.every_incarnation else ""
        return f"{self.rank}:{self.step}:{self.phase}:{self.kind}{tail}"

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        parts = text.strip().split(":")
        if len(parts) not in (4, 5) or (len(parts) == 5 and parts[4] != "every"):
            raise ConfigError(f"fault {text!r} is not RANK:STEP:PHASE:KIND[:every]")
        try:
            rank, step = int(parts[0]), int(parts[1])
        except ValueError:
            raise ConfigError(f"fault {text!r}: rank and step must be integers") from None
        return cls(rank, step, parts[2], parts[3], len(parts) == 5)


@dataclass(frozen=True)
class Timeouts:
    """Every deadline the supervisor keeps, in seconds; checked for order once."""

    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 30.0
    progress_timeout: float = 0.0  # 0: off; applies only to workers that report steps
    shutdown_timeout: float = 30.0  # SIGTERM -> SIGKILL grace
    # one Swift recovery: survivors' abort, then (once every rank is ready) RECOVER -> RECOVERED
    recovery_timeout: float = 120.0
    # a worker's start: spawn -> HELLO (interpreter, imports); for a replacement also spawn/ASSIGN -> JOINING,
    # since it runs the user's script from the top (which may load a dataset for minutes) before swiftrun.Run
    startup_timeout: float = 600.0
    # multi-node: an agent that has not heard from the job's coordinator for node_lease kills its workers (it
    # is fenced); the coordinator declares a silent node lost only after node_timeout, which is longer, so a
    # partitioned or frozen old incarnation is gone before its slot is handed out again
    node_lease: float = 5.0
    node_timeout: float = 10.0
    # multi-node: how long an agent waits for the coordinator to answer its JOIN (torchrun's join_timeout)
    join_timeout: float = 120.0
    # multi-node, --external-coordinator: how long an agent retries a refused connection to `swiftrun
    # coordinator` (which may still be starting) before it says nothing listens there
    connect_timeout: float = 30.0  # a cold start on a shared file system can take that long to import torch

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval", "heartbeat_timeout", "shutdown_timeout", "recovery_timeout", "startup_timeout",
                     "node_lease", "node_timeout", "join_timeout", "connect_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name.replace('_', '-')} must be > 0 (got {getattr(self, name)})")
        if self.progress_timeout < 0:
            raise ConfigError("progress-timeout must be >= 0 (0 turns it off)")
        if not self.heartbeat_interval * 2 <= self.heartbeat_timeout:
            raise ConfigError(
                f"heartbeat-timeout ({self.heartbeat_timeout}s) must be at least twice the heartbeat interval "
                f"({self.heartbeat_interval}s), or one late heartbeat would kill a healthy worker"
            )
        if self.progress_timeout and self.progress_timeout < self.heartbeat_timeout:
            raise ConfigError(
                f"progress-timeout ({self.progress_timeout}s) must not be shorter than heartbeat-timeout "
                f"({self.heartbeat_timeout}s)"
            )
        if not self.node_lease < self.node_timeout:
            raise ConfigError(
                f"node-lease ({self.node_lease}s) must be shorter than node-timeout ({self.node_timeout}s): a lost "
                "node's workers must be fenced before its slot is handed out again"
            )
        if not self.heartbeat_interval * 2 <= self.node_lease:
            raise ConfigError(
                f"node-lease ({self.node_lease}s) must be at least twice the heartbeat interval "
                f"({self.heartbeat_interval}s)"
            )


@dataclass(frozen=True)
class LaunchConfig:
    """Everything one swiftrun launcher needs to run a job on this node."""

    entrypoint: Entrypoint
    nproc_per_node: int = 1
    nnodes: tuple[int, int] = (1, 1)
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500  # 0: pick a free port
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    standalone: bool = False
    max_restarts: int = 0
    monitor_interval: float = 0.1
    role: str = "default"
    local_addr: str | None = None
    log_dir: Path | None = None
    redirects: tuple[Std, ...] = ()  # per local rank; empty means Std.NONE for all
    tee: tuple[Std, ...] = ()
    local_ranks_filter: frozenset[int] | None = None
    signals_to_handle: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    virtual_local_rank: bool = False
    timeouts: Timeouts = field(default_factory=Timeouts)
    # swiftrun's own
    recovery: RecoveryMode = RecoveryMode.AUTO
    max_recoveries: int = 16
    # restarts of every worker after an infrastructure failure (a signal, a hang) before every rank registered
    # swiftrun.Run; they do not consume --max-restarts, since nothing of the job's own was lost yet
    startup_restarts: int = 3
    verify_every: int = 0  # also compare every rank's whole state every N steps (0: only after recoveries)
    # copy parameters and optimizer state before an optimizer step, so that an undo restores them bitwise instead
    # of inverting the update arithmetically (1.5e-4 relative off measured on an AdamW job); costs that memory
    # and a copy per step. AUTO: only where the job may undo (a collective after optimizer.step(), DDP-broadcast
    # buffers, pipelines, --recovery undo)
    exact_undo: ExactUndo = ExactUndo.AUTO
    transfer_chunk_mb: int = 0  # state transfer chunk size in MiB (0: 16 on the CPU, 64 on a GPU)
    log_budget: int | None = None  # pipelines: bytes of boundary logs allowed (None: log every boundary)
    stage_ckpt_dir: Path | None = None  # pipelines: also write stage checkpoints here (survives adjacent losses)
    log_memory: int | None = None  # pipelines: bytes of logs kept in host memory per rank, the rest spilled to disk
    parallel_replay: int | None = None  # pipelines: most idle survivors helping a replay (None: all; 0: off)
    spares: int = 1
    dashboard: bool | None = None  # None: on when stdout is a terminal
    event_log: Path | None = None
    faults: tuple[FaultSpec, ...] = ()
    python: str = ""  # interpreter for workers; empty: PYTHON_EXEC or sys.executable
    # multi-node: the job's coordinator (store + control plane) runs as `swiftrun coordinator` elsewhere,
    # not inside node 0's agent
    external_coordinator: bool = False
    control_port: int = 0  # the coordinator's control socket; 0: the store's port + 1

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be >= 1 (got {self.nproc_per_node})")
        lo, hi = self.nnodes
        if not 0 < lo <= hi:
            raise ConfigError(f"--nnodes {lo}:{hi} must satisfy 0 < MIN <= MAX")
        if self.node_rank < 0:
            raise ConfigError(f"--node-rank must be >= 0 (got {self.node_rank})")
        if hi > lo and self.node_rank >= hi:
            raise ConfigError(f"--node-rank {self.node_rank} is outside --nnodes {lo}:{hi} (node ranks 0..{hi - 1})")
        if self.multinode and self.standalone:
            raise ConfigError("--standalone runs one node; for several use --rdzv-endpoint HOST:PORT")
        if not 0 <= self.control_port < 65536:
            raise ConfigError(f"control port {self.control_port} is not a TCP port")
        if not 0 <= self.master_port < 65536:
            raise ConfigError(f"--master-port {self.master_port} is not a TCP port")
        if self.max_restarts < 0 or self.max_recoveries < 0 or self.spares < 0 or self.startup_restarts < 0:
            raise ConfigError("--max-restarts, --max-recoveries, --startup-restarts and --spares must be >= 0")
        if self.log_budget is not None and self.log_budget < 0:
            raise ConfigError("--log-budget must be >= 0")
        if self.log_memory is not None and self.log_memory < 0:
            raise ConfigError("--log-memory must be >= 0")
        if self.parallel_replay is not None and self.parallel_replay < 0:
            raise ConfigError("--parallel-replay must be >= 0 (0: replay alone)")
        if self.verify_every < 0 or self.transfer_chunk_mb < 0:
            raise ConfigError("--verify-every and --transfer-chunk-mb must be >= 0 (0: off / the default)")
        if self.monitor_interval <= 0:
            raise ConfigError("--monitor-interval must be > 0")
        for name, per_rank in (("--redirects", self.redirects), ("--tee", self.tee)):
            if per_rank and len(per_rank) != self.nproc_per_node:
                raise ConfigError(f"{name} has {len(per_rank)} entries for {self.nproc_per_node} local ranks")
        if self.local_ranks_filter is not None:
            bad = sorted(r for r in self.local_ranks_filter if not 0 <= r < self.nproc_per_node)
            if bad:
                raise ConfigError(f"--local-ranks-filter names local ranks {bad} outside 0..{self.nproc_per_node - 1}")
        for fault in self.faults:
            if fault.rank >= self.world_size:
                raise ConfigError(f"fault {fault.encode()} names rank {fault.rank} of a world of {self.world_size}")

    @property
    def world_size(self) -> int:
        return self.nnodes[0] * self.nproc_per_node

    @property
    def multinode(self) -> bool:
        """One agent per node, with a job-level coordinator (anything but one node of rank 0)."""
        return self.nnodes != (1, 1) or self.node_rank != 0 or self.external_coordinator

    @property
    def spare_node(self) -> bool:
        """A hot-spare node: it owns no slot until it takes over a lost node's (``--node-rank >= --nnodes``)."""
        return self.node_rank >= self.nnodes[0]

    @property
    def swift(self) -> bool:
        """Whether failures are repaired in place (Swift) rather than by restarting every worker."""
        return self.recovery is not RecoveryMode.RESTART

    def std_redirect(self, local_rank: int) -> Std:
        return self.redirects[local_rank] if self.redirects else Std.NONE

    def std_tee(self, local_rank: int) -> Std:
        return self.tee[local_rank] if self.tee else Std.NONE

    def shows_on_console(self, local_rank: int) -> bool:
        return self.local_ranks_filter is None or local_rank in self.local_ranks_filter
